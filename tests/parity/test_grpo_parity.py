"""Parity with TRL 1.16's GRPOTrainer: same tiny model, prompts, completions and rewards → same loss and metrics.

Sampling is the one thing the two cannot share, so both trainers get the same completions injected: TRL's
`_generate_single_turn` and our `sample_completions` are replaced by a lookup that answers each prompt
(by its token ids, which are checked to be equal on both sides) with fixed completions of mixed lengths,
some ending with the end-of-turn token, some cut off at `max_completion_length`. Two deterministic reward
functions score them, one returning None for some completions (TRL's "does not apply"), weighted 1 and 0.5.

Both train the full tiny model with SGD for two steps (one micro-batch holding the whole generation batch),
so step 2's numbers include one update; the logged loss and every shared metric must agree within 1e-5,
for each loss_type, with and without the KL term, with num_iterations 1 (two generation rounds) and 2 (one
round trained twice, with old log-probs).
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignkit.config.parse import parse_config
from alignkit.rewards import RewardFunction, RewardFunctions
from alignkit.rl.losses import LOSS_TYPES
from alignkit.stages.grpo import GRPOTrainer
from tests.helpers import Injector, inject_completions, prompt_dataset

pytestmark = pytest.mark.parity
trl = pytest.importorskip("trl")

PROMPTS = ["What is 12 plus 7?", "Name a colour.", "Translate to French: good morning.", "Write a haiku."]
NUM_GENERATIONS, MAX_LENGTH, BATCH, STEPS, LR = 4, 6, 8, 2, 0.5
METRICS = ("loss", "reward", "reward_std", "frac_reward_zero_std", "rewards/token_sum/mean",
           "rewards/token_sum/std", "rewards/even_length/mean", "rewards/even_length/std",
           "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
           "completions/mean_terminated_length", "completions/min_terminated_length",
           "completions/max_terminated_length", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
           "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio",
           "vespo/phi_seq_mean", "policy_loss", "entropy_coef")


@pytest.fixture(autouse=True)
def _no_collect_per_train(monkeypatch):
    """`Trainer.train` starts with `accelerator.free_memory()`, whose `gc.collect()` takes about a second in a
    test process this large; on the CPU it frees nothing a fresh trainer needs, so the 128 trainings skip it."""
    import accelerate.utils.memory

    monkeypatch.setattr(accelerate.utils.memory, "clear_device_cache", lambda garbage_collection=False: None)


def token_sum(completions, completion_ids, **kwargs):
    return [float(sum(ids) % 7) / 2 for ids in completion_ids]


def even_length(completions, completion_ids, **kwargs):
    """Scores only completions of even length (None elsewhere), by how long they are."""
    return [len(ids) / 3 if len(ids) % 2 == 0 else None for ids in completion_ids]


def _prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"] for p in PROMPTS]


def _completions(tokenizer) -> dict[tuple, list[list[int]]]:
    """Fixed completions per prompt, as generation makes them: a stopped one (2-5 tokens, the last the
    end-of-turn token) or a cut-off one (MAX_LENGTH tokens, no end of turn), alternating."""
    generator = torch.Generator().manual_seed(7)
    table = {}
    for p, ids in enumerate(_prompt_ids(tokenizer)):
        rows = []
        for j in range(NUM_GENERATIONS):
            stopped = (p + j) % 2 == 0
            length = 2 + (p + 2 * j) % (MAX_LENGTH - 2) if stopped else MAX_LENGTH
            body = torch.randint(10, len(tokenizer) - 10, (length,), generator=generator).tolist()
            rows.append(body[:-1] + [tokenizer.eos_token_id] if stopped else body)
        table[tuple(ids)] = rows
    return table


def _run_trl(model_dir, tokenizer, injector, tmp_path, stage="grpo", **method):
    """TRL's GRPOTrainer (or, `stage="rloo"`, its RLOOTrainer) on the injected completions; the log per step."""
    import trl

    config_class, trainer_class = ((trl.GRPOConfig, trl.GRPOTrainer) if stage == "grpo"
                                   else (trl.RLOOConfig, trl.RLOOTrainer))
    args = config_class(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=BATCH, num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_LENGTH, max_steps=STEPS, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", logging_steps=1, report_to="none", bf16=False, use_cpu=True,
        gradient_checkpointing=False, shuffle_dataset=False, save_strategy="no", seed=0, reward_weights=[1.0, 0.5],
        **method)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    trainer = trainer_class(model=model_dir, reward_funcs=[token_sum, even_length], args=args,
                            train_dataset=dataset, processing_class=tokenizer)

    def generate(prompt_ids, images, multimodal_fields, num_generations=None, has_tool_images=False):
        # GRPO's returns (completions, tool data); RLOO's the completions alone.
        return (injector(prompt_ids), None) if stage == "grpo" else injector(prompt_ids)

    trainer._generate_single_turn = generate
    trainer.train()
    return {r["step"]: r for r in trainer.state.log_history if "loss" in r}


def _run_ours(model_dir, tokenizer, injector, tmp_path, monkeypatch, stage="grpo", trainer_class=GRPOTrainer,
              return_trainer=False, resume_from_checkpoint=None, **method):
    """Our `trainer_class` (GRPOTrainer, or a subclass: RLOO) on the injected completions; the log per step (and
    the trained trainer, with `return_trainer`)."""
    config = parse_config({
        "stage": stage, "model_name_or_path": model_dir, "dataset": "unused", "reward_funcs": "accuracy",
        "output_dir": str(tmp_path / "ours"), "per_device_train_batch_size": BATCH,
        "num_generations": NUM_GENERATIONS, "max_completion_length": MAX_LENGTH, "max_steps": STEPS,
        "learning_rate": LR, "optim": "sgd", "lr_scheduler_type": "constant", "logging_steps": 1,
        "use_cpu": True, "shuffle_dataset": False, "save_strategy": "no", "seed": 0, "disable_tqdm": True,
        **method})
    stop_ids = [tokenizer.eos_token_id]
    inject_completions(monkeypatch, tokenizer, injector, stop_ids)
    dataset = prompt_dataset(PROMPTS, _prompt_ids(tokenizer))
    rewards = RewardFunctions([RewardFunction("token_sum", "token_sum", token_sum),
                               RewardFunction("even_length", "even_length", even_length)], [1.0, 0.5])
    trainer = trainer_class(model=AutoModelForCausalLM.from_pretrained(model_dir), args=config.training,
                            grpo_args=config.method, reward_functions=rewards, stop_token_ids=stop_ids,
                            processing_class=tokenizer, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    logs = {r["step"]: r for r in trainer.state.log_history if "loss" in r}
    return (logs, trainer) if return_trainer else logs


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("importance_sampling_level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_metrics_match_trl(loss_type, importance_sampling_level, beta, num_iterations, tiny_model_dir,
                                    tmp_path, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    method = {"loss_type": loss_type, "importance_sampling_level": importance_sampling_level, "beta": beta,
              "num_iterations": num_iterations}
    _assert_runs_match(tiny_model_dir, tokenizer, tmp_path, monkeypatch, method)


# The keys around the policy term, together: two-sided clipping, the off-policy mask, the top-entropy token mask,
# a fixed or adaptive entropy bonus, GDPO's per-function normalisation. num_iterations 2, so ratios move off 1.
EXTRA_KEYS = [
    {"loss_type": "dapo", "beta": 0.04, "delta": 1.05, "off_policy_mask_threshold": 0.001,
     "top_entropy_quantile": 0.5, "entropy_coef": 0.01, "multi_objective_aggregation": "normalize_then_sum"},
    {"loss_type": "grpo", "importance_sampling_level": "sequence", "use_adaptive_entropy": True, "entropy_coef": 0.1,
     "entropy_target": 100.0, "entropy_coef_delta": 0.05},
]


@pytest.mark.parametrize("extra", EXTRA_KEYS, ids=["masks-delta-gdpo", "adaptive-entropy"])
def test_extra_keys_match_trl(extra, tiny_model_dir, tmp_path, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    _assert_runs_match(tiny_model_dir, tokenizer, tmp_path, monkeypatch, {"num_iterations": 2, **extra})


def _assert_runs_match(tiny_model_dir, tokenizer, tmp_path, monkeypatch, method, stage="grpo",
                       trainer_class=GRPOTrainer, metrics=METRICS):
    """Both trainers on the same injected completions: every metric of `metrics` either absent from both logs or
    within 1e-5, at both steps (`kl` absent without `beta`)."""
    beta, num_iterations = method.get("beta", 0.0), method["num_iterations"]
    trl_injector, our_injector = Injector(_completions(tokenizer)), Injector(_completions(tokenizer))
    theirs = _run_trl(tiny_model_dir, tokenizer, trl_injector, tmp_path, stage=stage, **method)
    ours = _run_ours(tiny_model_dir, tokenizer, our_injector, tmp_path, monkeypatch, stage=stage,
                     trainer_class=trainer_class, **method)
    assert trl_injector.calls == our_injector.calls == (STEPS if num_iterations == 1 else 1)
    assert sorted(theirs) == sorted(ours) == list(range(1, STEPS + 1))
    largest = 0.0
    for step in theirs:
        for key in metrics:
            if key == "kl" and not beta:
                assert key not in theirs[step] and key not in ours[step]
                continue
            assert (key in theirs[step]) == (key in ours[step]), (step, key)
            if key in theirs[step]:
                assert ours[step][key] == pytest.approx(theirs[step][key], abs=1e-5), (step, key)
                largest = max(largest, abs(ours[step][key] - theirs[step][key]))
    print(f"max |ours - TRL| over {len(metrics)} metrics x {STEPS} steps: {largest:.3g}")
    # Step 2 follows an update: if the loss still matches, so did the gradient.
    assert any(ours[2][k] != ours[1][k] for k in ("loss", "entropy"))
