"""Parity with TRL 1.16's `GRPOTrainer(tools=...)` and `GRPOTrainer(environment_factory=...)`: the same multi-turn
completion ids, the same tool mask, and the loss and shared metrics within 1e-5.

Both trainers get one scripted policy in place of sampling (the one thing they cannot share): each turn is answered
from the context alone (TRL's `_generate_single_turn` and our `sample_completions` replaced by the same function), so
a rollout diverges as soon as the two build a context differently: the prompt rendered with the tool schemas, a
tool turn's tokens, which rows go on, where the completion budget cuts. The k-th completion of a prompt follows
script k: answer at once; call once then answer; two calls in one turn (one tool raises) then an unknown tool then
answer; call until `max_tool_calling_iterations` stops it. Tools are deterministic. The template is Qwen2.5's (the
one TRL knows how to parse), on the tiny model's tokenizer.
"""

from __future__ import annotations

import json
import shutil

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignkit.config.parse import parse_config
from alignkit.data.template import ChatFormatter
from alignkit.rewards import RewardFunction, RewardFunctions
from alignkit.stages import grpo as grpo_module
from tests.helpers import inject_completions

pytestmark = pytest.mark.parity
trl = pytest.importorskip("trl")

PROMPTS = ["Multiply two and three.", "Multiply four and five.", "What is six?", "Say hi."]
NUM_GENERATIONS, BATCH, STEPS, MAX_LENGTH, LR = 4, 8, 2, 700, 0.5
METRICS = ("loss", "reward", "reward_std", "frac_reward_zero_std", "rewards/message_count/mean",
           "rewards/message_count/std", "rewards/token_sum/mean", "rewards/token_sum/std",
           "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
           "completions/mean_terminated_length", "completions/min_terminated_length",
           "completions/max_terminated_length", "entropy", "kl", "clip_ratio/region_mean",
           "tools/call_frequency", "tools/failure_frequency", "rewards/ScoredCalculator/mean",
           "rewards/ScoredCalculator/std")


def multiply(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: the first.
        b: the second.
    """
    return a * b


def fail(x: int) -> int:
    """A tool that always raises.

    Args:
        x: ignored.
    """
    raise ValueError(f"cannot use {x}")


class Calculator:
    """An environment: reset adds a line to the prompt; its method is a tool."""

    def reset(self, **kwargs):
        self.uses = 0
        return " Use the calculator."

    def multiply(self, a: int, b: int) -> int:
        """Multiply two numbers.

        Args:
            a: the first.
            b: the second.
        """
        self.uses += 1
        return a * b


class ScoredCalculator(Calculator):
    """A `Calculator` that owns a reward (TRL 1.16's `get_reward`): how often it was used."""

    def get_reward(self) -> float:
        return float(self.uses)


def message_count(completions, **kwargs):
    return [float(len(c)) for c in completions]


def token_sum(completions, completion_ids, **kwargs):
    return [float(sum(ids) % 11) / 3 for ids in completion_ids]


def _call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


SCRIPTS = [
    ["Plan 0. It is 6."],
    ["Plan 1.\n" + _call("multiply", a=2, b=3), "The product is 6."],
    ["Plan 2.\n" + _call("multiply", a=2, b=3) + "\n" + _call("fail", x=1), _call("nope"), "Done."],
    ["Plan 3.\n" + _call("multiply", a=4, b=5)] * 5,
]


class ScriptedPolicy:
    """Answers a context with its script's next turn: at the first turn the k-th copy of a prompt in the call takes
    script k (written into the turn, "Plan k."), later turns read the script from the context."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, contexts):
        seen: dict[tuple, int] = {}
        out = []
        for ids in contexts:
            ids = [int(i) for i in ids]
            text = self.tokenizer.decode(ids)
            turn = text.count("<|im_start|>assistant") - 1
            if turn == 0:
                script = seen.get(tuple(ids), 0)
                seen[tuple(ids)] = script + 1
            else:
                script = int(text.split("Plan ")[1][0])
            turns = SCRIPTS[script % len(SCRIPTS)]
            out.append(self.tokenizer(turns[min(turn, len(turns) - 1)], add_special_tokens=False)["input_ids"]
                       + [self.eos])
        return out


@pytest.fixture(scope="module")
def qwen_tiny(tiny_model_dir, tmp_path_factory):
    """The tiny model with a 4096-token context and Qwen2.5's chat template (TRL parses its tool calls)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    path = tmp_path_factory.mktemp("qwen_tiny") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.save_pretrained(path)
    return str(path)


def _run_trl(model_dir, tmp_path, tool_kwargs, **method):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = ScriptedPolicy(tokenizer)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=BATCH, num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_LENGTH, max_steps=STEPS, learning_rate=LR, optim="sgd", lr_scheduler_type="constant",
        logging_steps=1, report_to="none", bf16=False, use_cpu=True, gradient_checkpointing=False,
        shuffle_dataset=False, save_strategy="no", seed=0, reward_weights=[1.0, 0.5], max_tool_calling_iterations=2,
        **method)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=[message_count, token_sum], args=args,
                              train_dataset=dataset, processing_class=tokenizer, **tool_kwargs)
    # Each turn at most the completion budget, as `generate`'s max_new_tokens would cut it.
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: ([ids[:MAX_LENGTH] for ids in policy(prompt_ids)],
                                                                  None)
    rollouts = []
    generate = trainer._generate

    def recording(prompts):
        out = generate(prompts)
        rollouts.append([(list(p), list(ids), list(mask)) for p, ids, mask in zip(out[0], out[1], out[2])])
        return out

    trainer._generate = recording
    trainer.train()
    return {r["step"]: r for r in trainer.state.log_history if "loss" in r}, rollouts


def _run_ours(model_dir, tmp_path, monkeypatch, tool_kwargs, **method):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = ScriptedPolicy(tokenizer)
    formatter = ChatFormatter(tokenizer, None)
    stop_ids = formatter.stop_token_ids()
    config = parse_config({
        "stage": "grpo", "model_name_or_path": model_dir, "dataset": "unused", "reward_funcs": "accuracy",
        "output_dir": str(tmp_path / "ours"), "per_device_train_batch_size": BATCH,
        "num_generations": NUM_GENERATIONS, "max_completion_length": MAX_LENGTH, "max_steps": STEPS,
        "learning_rate": LR, "optim": "sgd", "lr_scheduler_type": "constant", "logging_steps": 1, "use_cpu": True,
        "shuffle_dataset": False, "save_strategy": "no", "seed": 0, "disable_tqdm": True,
        "max_tool_calling_iterations": 2, **method})

    inject_completions(monkeypatch, tokenizer, policy, stop_ids)
    rollouts = []
    tool_generation = grpo_module.GRPOTrainer._tool_generation

    def recording(self, *args):
        generation, tool_mask, completions, prompts = tool_generation(self, *args)
        lengths = generation.completion_mask.sum(1).tolist()
        rollouts.append([(p[m.bool()].tolist(), ids[:n].tolist(), mask[:n].tolist()) for p, m, ids, mask, n in zip(
            generation.prompt_ids, generation.prompt_mask, generation.completion_ids, tool_mask, lengths)])
        return generation, tool_mask, completions, prompts

    monkeypatch.setattr(grpo_module.GRPOTrainer, "_tool_generation", recording)
    dataset = Dataset.from_list([{"input_ids": [1], "attention_mask": [1],
                                  "prompt_messages": [{"role": "user", "content": p}], "prompt_conversational": True}
                                 for p in PROMPTS])
    rewards = RewardFunctions([RewardFunction("message_count", "message_count", message_count),
                               RewardFunction("token_sum", "token_sum", token_sum)], [1.0, 0.5])
    trainer = grpo_module.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir), args=config.training, grpo_args=config.method,
        reward_functions=rewards, stop_token_ids=stop_ids, processing_class=tokenizer, train_dataset=dataset,
        formatter=formatter, **tool_kwargs)
    trainer.train()
    return {r["step"]: r for r in trainer.state.log_history if "loss" in r}, rollouts


def _assert_match(model_dir, tmp_path, monkeypatch, trl_tools, our_tools, **method):
    theirs, their_rollouts = _run_trl(model_dir, tmp_path, trl_tools, **method)
    ours, our_rollouts = _run_ours(model_dir, tmp_path, monkeypatch, our_tools, **method)
    if "environment_factory" in our_tools:
        assert "Use the calculator." in AutoTokenizer.from_pretrained(model_dir).decode(our_rollouts[0][0][0])
    assert len(their_rollouts) == len(our_rollouts) == STEPS
    for their_round, our_round in zip(their_rollouts, our_rollouts):
        assert len(their_round) == len(our_round) == BATCH
        for (their_prompt, their_ids, their_mask), (our_prompt, our_ids, our_mask) in zip(their_round, our_round):
            assert our_prompt == their_prompt  # rendered with the tool schemas (and the environment's reset text)
            assert our_ids == their_ids
            assert our_mask == their_mask
        # Every script ran: rows that answer at once, after one and two tool turns, and at the cap.
        assert sorted(mask.count(0) > 0 for _, _, mask in our_round) == [False] * 2 + [True] * 6
    for step in theirs:
        assert theirs[step]["tools/call_frequency"] > 0 and theirs[step]["tools/failure_frequency"] > 0
        for key in METRICS:
            if key in theirs[step] or key in ours[step]:
                assert ours[step][key] == pytest.approx(theirs[step][key], abs=1e-5), (step, key)


def test_tool_rollouts_match_trl(qwen_tiny, tmp_path, monkeypatch):
    """With the KL term (a reference pass over the multi-turn completions, `kl` over the policy's tokens)."""
    _assert_match(qwen_tiny, tmp_path, monkeypatch, {"tools": [multiply, fail]}, {"tools": [multiply, fail]},
                  beta=0.04)


def test_environment_rollouts_match_trl(qwen_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    kwargs = {"tools": [fail], "environment_factory": Calculator}
    _assert_match(qwen_tiny, tmp_path, monkeypatch, kwargs, dict(kwargs), beta=0.0)


def test_an_environment_that_owns_its_reward_matches_trl(qwen_tiny, tmp_path, monkeypatch):
    """`get_reward` on the environment: one more reward source of weight 1 named after its class, in both."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    kwargs = {"tools": [fail], "environment_factory": ScoredCalculator}
    theirs, _ = _run_trl(qwen_tiny, tmp_path, dict(kwargs), beta=0.0)
    assert all(r["rewards/ScoredCalculator/mean"] > 0 for r in theirs.values())
    _assert_match(qwen_tiny, tmp_path, monkeypatch, kwargs, dict(kwargs), beta=0.0)


def test_a_call_cut_off_by_the_completion_budget_counts_as_in_trl(qwen_tiny, tmp_path, monkeypatch):
    """A budget that ends each calling script's first turn right after its call's JSON, before `</tool_call>`: TRL
    reads the open block as a call (counted in `tools/call_frequency`, its result dropped as over the budget), and so
    do we; the rollouts, masks and metrics agree."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tiny)
    ids = tokenizer(SCRIPTS[1][0], add_special_tokens=False)["input_ids"]
    budget = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).rstrip().endswith("}}"))
    assert "</tool_call>" not in tokenizer.decode(ids[:budget])
    monkeypatch.setitem(globals(), "MAX_LENGTH", budget)  # both runners read it
    theirs, their_rollouts = _run_trl(qwen_tiny, tmp_path, {"tools": [multiply, fail]}, beta=0.0)
    ours, our_rollouts = _run_ours(qwen_tiny, tmp_path, monkeypatch, {"tools": [multiply, fail]}, beta=0.0)
    assert their_rollouts == our_rollouts
    for step in theirs:
        assert theirs[step]["tools/call_frequency"] == pytest.approx(0.75)  # scripts 1-3 of every prompt
        for key in METRICS:
            if key in theirs[step] or key in ours[step]:
                assert ours[step][key] == pytest.approx(theirs[step][key], abs=1e-5), (step, key)
