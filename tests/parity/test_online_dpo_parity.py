"""Parity with TRL 1.16's experimental OnlineDPOTrainer on injected pairs: same tiny model, prompts, two completions
per prompt and reward functions → same chosen/rejected choice, loss and DPO metrics.

Sampling is the one thing the two cannot share, so both get the same completions injected (TRL's `_generate` and
our `sample_completions`): the k-th time a prompt appears in a round it gets its k-th fixed completion, a stopped
one (ending with the end-of-turn token) or a cut-off one (`max_new_tokens` tokens). The reward reads the completion
text only (TRL hands reward functions the padded token ids, alignkit the completion's own).

Both train the full tiny model with SGD for two steps: the loss (TRL's unrounded per-step value) and the metrics
the two compute alike must agree within 1e-5, for `sigmoid` and `ipo`. Not compared: `objective/kl`,
`objective/non_score_reward`, `objective/rlhf_reward` and `objective/entropy`, which TRL sums over padding too.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from alignkit.config.parse import parse_config
from alignkit.rewards import RewardFunction, RewardFunctions
from alignkit.stages.online_dpo import OnlineDPOTrainer
from tests.helpers import inject_completions, prompt_dataset

pytestmark = pytest.mark.parity
trl = pytest.importorskip("trl")

PROMPTS = ["What is 12 plus 7?", "Name a colour.", "Translate to French: good morning.", "Write a haiku."]
MAX_LENGTH, BATCH, STEPS, LR = 6, 2, 2, 0.5
METRICS = ("objective/scores", "objective/scores_margin", "val/contain_eos_token", "logps/chosen", "logps/rejected",
           "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "beta")


def text_reward(completions, **kwargs):
    """Coarse (3 values), so some pairs tie: a tie goes to the first completion in both."""
    return [float(sum(map(ord, c[0]["content"])) % 3) / 2 for c in completions]


def _completions(tokenizer, prompt_ids) -> dict[tuple, list[list[int]]]:
    """Two fixed completions per prompt: stopped (2-5 tokens, the last the end of turn) or cut off, alternating."""
    generator = torch.Generator().manual_seed(0)  # a seed whose pairs include a tie and wins either way
    table = {}
    for p, ids in enumerate(prompt_ids):
        rows = []
        for j in range(2):
            stopped = (p + j) % 2 == 0
            length = 2 + (p + j) % 4 if stopped else MAX_LENGTH
            body = torch.randint(10, len(tokenizer) - 10, (length,), generator=generator).tolist()
            rows.append(body[:-1] + [tokenizer.eos_token_id] if stopped else body)
        table[tuple(ids)] = rows
    return table


def _run_trl(model_dir, tokenizer, injector, tmp_path, **method):
    from trl.data_utils import maybe_apply_chat_template
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer as TRLOnlineDPOTrainer

    args = OnlineDPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=BATCH, max_new_tokens=MAX_LENGTH,
        max_steps=STEPS, learning_rate=LR, optim="sgd", lr_scheduler_type="constant", logging_steps=1,
        report_to="none", bf16=False, use_cpu=True, gradient_checkpointing=False, save_strategy="no", seed=0,
        **method)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    trainer = TRLOnlineDPOTrainer(model=model_dir, reward_funcs=[text_reward], args=args, train_dataset=dataset,
                                  processing_class=tokenizer)

    def generate(model, prompts, images=None):
        texts = [maybe_apply_chat_template({"prompt": p}, tokenizer)["prompt"] for p in prompts]
        inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="left",
                           add_special_tokens=False)
        prompt_ids, prompt_mask = inputs["input_ids"].repeat(2, 1), inputs["attention_mask"].repeat(2, 1)
        unpadded = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        completions = injector(unpadded)
        width = max(len(c) for c in completions)
        completion_ids = torch.full((len(completions), width), tokenizer.pad_token_id)
        completion_mask = torch.zeros((len(completions), width), dtype=torch.long)
        for i, c in enumerate(completions):
            completion_ids[i, :len(c)] = torch.tensor(c)
            completion_mask[i, :len(c)] = 1
        return prompt_ids, prompt_mask, completion_ids, completion_mask, None

    trainer._generate = generate
    losses = []
    training_step = trainer.training_step

    def recording_step(*args, **kwargs):
        loss = training_step(*args, **kwargs)
        losses.append(loss.item())
        return loss

    trainer.training_step = recording_step
    trainer.train()
    records = {r["step"]: r for r in trainer.state.log_history if "loss" in r}
    for step, loss in enumerate(losses, start=1):
        records[step]["loss"] = loss  # TRL's log rounds it to 4 decimals
    return records


def _run_ours(model_dir, tokenizer, prompt_ids, injector, tmp_path, monkeypatch, **method):
    config = parse_config({
        "stage": "online_dpo", "model_name_or_path": model_dir, "dataset": "unused", "reward_funcs": "accuracy",
        "output_dir": str(tmp_path / "ours"), "per_device_train_batch_size": BATCH, "max_new_tokens": MAX_LENGTH,
        "max_steps": STEPS, "learning_rate": LR, "optim": "sgd", "lr_scheduler_type": "constant",
        "logging_steps": 1, "use_cpu": True, "save_strategy": "no", "seed": 0, "disable_tqdm": True, **method})
    stop_ids = [tokenizer.eos_token_id]
    inject_completions(monkeypatch, tokenizer, injector, stop_ids)
    dataset = prompt_dataset(PROMPTS, prompt_ids)
    rewards = RewardFunctions([RewardFunction("text_reward", "text_reward", text_reward)], [1.0])
    trainer = OnlineDPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=config.training,
                               online_dpo_args=config.method, reward_functions=rewards, stop_token_ids=stop_ids,
                               processing_class=tokenizer, train_dataset=dataset)
    trainer.train()
    return {r["step"]: r for r in trainer.state.log_history if "loss" in r}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_and_metrics_match_trl(loss_type, tiny_model_dir, tmp_path, monkeypatch, chat_prompt_ids,
                                    completion_injector):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt_ids = chat_prompt_ids(tokenizer, PROMPTS)
    method = {"loss_type": loss_type, "beta": 0.1 if loss_type == "sigmoid" else 0.5}
    table = _completions(tokenizer, prompt_ids)
    scores = [text_reward([[{"content": tokenizer.decode(c, skip_special_tokens=True)}] for c in pair])
              for pair in table.values()]
    assert any(a == b for a, b in scores) and any(a != b for a, b in scores)  # ties and wins both occur
    trl_injector, our_injector = completion_injector(table), completion_injector(table)
    theirs = _run_trl(tiny_model_dir, tokenizer, trl_injector, tmp_path, **method)
    ours = _run_ours(tiny_model_dir, tokenizer, prompt_ids, our_injector, tmp_path, monkeypatch, **method)
    assert trl_injector.calls == our_injector.calls == STEPS  # one round of pairs per micro-batch
    assert sorted(theirs) == sorted(ours) == list(range(1, STEPS + 1))
    largest = 0.0
    for step in theirs:
        for key in ("loss", *METRICS):
            assert key in theirs[step] and key in ours[step], (step, key)
            assert ours[step][key] == pytest.approx(theirs[step][key], abs=1e-5), (step, key)
            largest = max(largest, abs(ours[step][key] - theirs[step][key]))
    print(f"max |ours - TRL| over {STEPS} steps: {largest:.3g}")
    # Step 2 follows an update: the policy moved from the reference.
    assert ours[2]["rewards/margins"] != 0


def test_defaults_are_trls():
    """Every key `stage: online_dpo` shares with TRL 1.16's OnlineDPOConfig has TRL's default (beta's one-item list
    is kept as its value by both)."""
    from trl.experimental.online_dpo import OnlineDPOConfig

    from alignkit.stages.online_dpo import OnlineDPOArguments

    theirs = OnlineDPOConfig(output_dir="unused", report_to="none", use_cpu=True)
    ours = OnlineDPOArguments()
    shared = ["beta", "loss_type", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "missing_eos_penalty", "disable_dropout", "reward_weights"]
    for key in shared:
        assert getattr(ours, key) == getattr(theirs, key), key
