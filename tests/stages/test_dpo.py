"""DPO stage end to end on the tiny model: references, training, metrics, precomputed log-probs, resume."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from alignkit.callbacks import read_log
from alignkit.config.parse import parse_config
from alignkit.data import PairwiseCollator
from alignkit.model.logprobs import forward_token_logps
from alignkit.model.tiny import build_tiny_tokenizer
from alignkit.stages import dpo as dpo_module
from alignkit.stages.dpo import DPOTrainer
from alignkit.train import run_train
from tests.helpers import tiny_config

PAIRS = [
    ("What is 12 plus 7?", "12 plus 7 is 19.", "It is 27."),
    ("The capital of France?", "The capital of France is Paris.", "Tokyo."),
    ("Name a colour.", "green", "apple, banana, cherry"),
    ("Translate to French: good morning.", "Bonjour.", "The waves roll in and out again."),
    ("Write a short poem about the sea.", "The waves roll in and out again.", "8"),
    ("How many apples does Tom have?", "Tom has 8 apples.", "It is 27."),
]


def _encode(tokenizer, prompt: str, response: str) -> dict[str, list[int]]:
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=True)["input_ids"]
    full = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                          {"role": "assistant", "content": response}], tokenize=True)["input_ids"]
    labels = [-100] * len(prompt_ids) + full[len(prompt_ids):]
    return {"input_ids": full, "attention_mask": [1] * len(full), "labels": labels}


def pair_dataset(tokenizer, pairs=PAIRS) -> Dataset:
    """The `get_dataset(..., "preference")` columns, built by hand from chat-templated pairs."""
    columns: dict[str, list] = {}
    for prompt, chosen, rejected in pairs:
        for side, response in (("chosen", chosen), ("rejected", rejected)):
            for key, value in _encode(tokenizer, prompt, response).items():
                columns.setdefault(f"{side}_{key}", []).append(value)
    return Dataset.from_dict(columns)


def make_config(tmp_path, **overrides):
    values = {
        "stage": "dpo",
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 4,
        "max_steps": 3,
        "learning_rate": 5e-3,
        "lr_scheduler_type": "constant",
        "save_strategy": "no",
        "use_cpu": True,
        "seed": 0,
        "data_seed": 0,
        "dataloader_num_workers": 0,
    }
    values.update(overrides)
    return tiny_config(**values)


def lora_model(tiny_model_dir, init_lora_weights=True):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"],
                        init_lora_weights=init_lora_weights)
    torch.manual_seed(1)
    return get_peft_model(base, config)


def pairwise_collate(features):
    return PairwiseCollator(build_tiny_tokenizer())(features)


def make_trainer(model, config, dataset, eval_dataset=None, callbacks=None):
    return DPOTrainer(model=model, args=config.training, dpo_args=config.method,
                      data_collator=PairwiseCollator(build_tiny_tokenizer()), train_dataset=dataset, eval_dataset=eval_dataset,
                      callbacks=callbacks)


def losses_of(trainer) -> list[float]:
    return [record["loss"] for record in trainer.state.log_history if "loss" in record]


def sequence_logps_by_hand(model, ids: list[int], labels: list[int]) -> float:
    """Sum of log p(label t | tokens before t) over the labelled tokens of one unpadded sequence."""
    with torch.no_grad():
        logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
    targets = torch.tensor(labels[1:])
    scored = targets != -100
    return logps[scored].gather(-1, targets[scored, None]).sum().item()


def dpo_eval_by_hand(policy, reference, rows: Dataset, beta: float) -> dict[str, float]:
    """The sigmoid-DPO eval metrics over all pairs of `rows`, one sequence at a time (no batching, no padding)."""
    logps = {}
    for name, model in (("policy", policy), ("reference", reference)):
        for side in ("chosen", "rejected"):
            logps[name, side] = torch.tensor([
                sequence_logps_by_hand(model, ids, labels)
                for ids, labels in zip(rows[f"{side}_input_ids"], rows[f"{side}_labels"])
            ], dtype=torch.float64)
    chosen_rewards = beta * (logps["policy", "chosen"] - logps["reference", "chosen"])
    rejected_rewards = beta * (logps["policy", "rejected"] - logps["reference", "rejected"])
    return {
        "eval_loss": -torch.nn.functional.logsigmoid(chosen_rewards - rejected_rewards).mean().item(),
        "eval_rewards/chosen": chosen_rewards.mean().item(),
        "eval_rewards/rejected": rejected_rewards.mean().item(),
        "eval_rewards/accuracies": (chosen_rewards > rejected_rewards).double().mean().item(),
        "eval_rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "eval_logps/chosen": logps["policy", "chosen"].mean().item(),
        "eval_logps/rejected": logps["policy", "rejected"].mean().item(),
    }


def test_lora_reference_equals_base_model_logps(tiny_model_dir, tiny_tokenizer, tmp_path):
    """With a non-zero adapter the policy differs from the base; the reference equals the plain base model."""
    dataset = pair_dataset(tiny_tokenizer)
    trainer = make_trainer(lora_model(tiny_model_dir, init_lora_weights=False), make_config(tmp_path), dataset)
    assert trainer.ref_model is None  # no second copy under LoRA
    batch = pairwise_collate([dataset[i] for i in range(3)])
    trainer.model.train()
    ref_chosen, ref_rejected = trainer.reference_logps(batch)
    assert trainer.model.training  # the reference pass ran in eval mode and restored training mode

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        base_logps = forward_token_logps(base, batch["input_ids"], batch["attention_mask"], batch["labels"])[0]
        policy_logps = forward_token_logps(trainer.model, batch["input_ids"], batch["attention_mask"],
                                           batch["labels"])[0]
    assert torch.allclose(torch.cat([ref_chosen, ref_rejected]), base_logps.sum(-1), atol=1e-5)
    assert not torch.allclose(policy_logps.sum(-1), base_logps.sum(-1), atol=1e-3)


def _count_reference_passes(monkeypatch) -> list[bool]:
    """Record each `DPOTrainer.reference_logps` call: True when it ran inside an evaluation."""
    calls: list[bool] = []
    original = DPOTrainer.reference_logps

    def counted(self, inputs):
        calls.append(not self.model.training)
        return original(self, inputs)

    monkeypatch.setattr(DPOTrainer, "reference_logps", counted)
    return calls


def test_lora_training_logs_metrics_and_moves_only_the_adapter(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                               monkeypatch):
    """... and the reference (the untouched base) runs in the first epoch only (steps 1-3 take the 6 pairs by 2):
    the second epoch and both evaluations (the same 6 pairs, by 3) take the outputs kept from those steps
    (`StageTrainer.kept_reference`), and the step-6 evaluation still equals the hand-computed metrics."""
    calls = _count_reference_passes(monkeypatch)
    dataset = pair_dataset(tiny_tokenizer)
    model = lora_model(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Two eval batches of 3 pairs: a mean of batch means is then the mean over all 6 pairs.
    config = make_config(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=3, eval_dataset="hand-built",
                         per_device_eval_batch_size=3)
    trainer = make_trainer(model, config, dataset, eval_dataset=dataset)
    trainer.train()

    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    train_logs = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in train_logs] == [1, 2, 3, 4, 5, 6]
    for r in train_logs:
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6)
        assert r["rewards/accuracies"] in (0.0, 0.5, 1.0)  # 2 pairs a step
    # Step 1: policy == reference (fresh adapter), so rewards are 0 and the loss is log 2.
    assert train_logs[0]["loss"] == pytest.approx(0.693147, abs=1e-4)
    assert train_logs[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert train_logs[-1]["rewards/margins"] > 0
    eval_logs = [r for r in trainer.state.log_history if "eval_loss" in r]
    assert [r["step"] for r in eval_logs] == [3, 6]
    assert "rewards/chosen" not in eval_logs[-1]
    assert calls == [False] * 3  # the first epoch's three steps
    # The step-6 evaluation ran on the final weights: it equals the metrics computed pair by pair with the
    # trained policy against the base model as the reference.
    trainer.model.eval()
    expected = dpo_eval_by_hand(trainer.model, AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), dataset,
                                beta=config.method.pref_beta)
    assert expected["eval_rewards/margins"] > 0.01  # training moved the policy: the comparison is not of zeros
    for key, value in expected.items():
        assert eval_logs[-1][key] == pytest.approx(value, abs=1e-5), key


def test_accumulated_micro_batches_equal_one_batch(tiny_model_dir, tiny_tokenizer, tmp_path):
    """4 pairs as 1 pair x 4 micro-batches and as one batch of 4, from the same non-zero adapter: the same
    examples in each step, the same logged loss and metrics, the same SGD update (what the trainer's hint on
    accumulation says, `StageTrainer._suggest_one_batch`)."""
    dataset = pair_dataset(tiny_tokenizer).select(range(4))
    runs = {}
    for batch, accumulation in ((4, 1), (1, 4)):
        model = lora_model(tiny_model_dir, init_lora_weights=False)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        config = make_config(tmp_path / f"{batch}x{accumulation}", max_steps=1, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=1.0,
                             max_grad_norm=0.0)
        trainer = make_trainer(model, config, dataset)
        trainer.train()
        update = {n: before[n] - p.detach() for n, p in model.named_parameters() if p.requires_grad}
        runs[batch] = ([r for r in trainer.state.log_history if "loss" in r][0], update)
    (log_one, update_one), (log_acc, update_acc) = runs[4], runs[1]
    assert log_one["loss"] != pytest.approx(0.693147, abs=1e-3)  # a non-zero adapter: not the trivial log 2
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
        assert log_acc[key] == pytest.approx(log_one[key], abs=1e-5), key
    assert max(u.abs().max().item() for u in update_one.values()) > 1e-4
    for name, value in update_one.items():
        torch.testing.assert_close(update_acc[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_full_finetuning_reference_is_the_in_memory_policy_at_init(tiny_model_dir, tiny_tokenizer, tmp_path):
    """A policy changed in memory before the trainer is built gets that policy as reference, frozen after."""
    dataset = pair_dataset(tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)  # differs from what is on disk
    trainer = make_trainer(model, make_config(tmp_path, finetuning_type="full", max_steps=2), dataset)
    batch = pairwise_collate([dataset[i] for i in range(2)])
    with torch.no_grad():
        at_init = forward_token_logps(model, batch["input_ids"], batch["attention_mask"], batch["labels"])[0]
    assert torch.allclose(torch.cat(trainer.reference_logps(batch)), at_init.sum(-1), atol=1e-5)
    trainer.train()
    assert torch.allclose(torch.cat(trainer.reference_logps(batch)), at_init.sum(-1), atol=1e-5)
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())


@pytest.mark.parametrize("sync", [False, True])
def test_reference_outputs_kept_only_while_it_cannot_move(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch,
                                                           sync):
    """A full fine-tuning's frozen reference copy serves every evaluation from the first one's outputs; with
    `sync_ref_model` (TR-DPO mixes the policy into it every step here) each evaluation runs it again, and the
    numbers show why: the reference moved."""
    calls = _count_reference_passes(monkeypatch)
    dataset = pair_dataset(tiny_tokenizer)
    config = make_config(tmp_path, finetuning_type="full", max_steps=2, sync_ref_model=sync,
                         ref_model_mixup_alpha=0.5, ref_model_sync_steps=1)
    trainer = make_trainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config, dataset,
                           eval_dataset=dataset)
    def numbers(metrics):
        return {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k}

    first = trainer.evaluate()
    assert numbers(trainer.evaluate()) == numbers(first) and calls == [True] * (2 if not sync else 4)
    trainer.train()
    calls.clear()
    after = trainer.evaluate()
    assert calls == ([True, True] if sync else [])
    trainer.model.eval()
    reference = trainer.ref_model if sync else AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    expected = dpo_eval_by_hand(trainer.model, reference, dataset, beta=config.method.pref_beta)
    for key, value in expected.items():
        assert after[key] == pytest.approx(value, abs=1e-5), key


def test_full_finetuning_with_precomputed_reference_refuses_new_data_after_training(tiny_model_dir, tiny_tokenizer,
                                                                                     tmp_path):
    """No frozen copy is kept then; a dataset not precomputed at init cannot get a correct reference later."""
    dataset = pair_dataset(tiny_tokenizer)
    config = make_config(tmp_path, finetuning_type="full", max_steps=1, precompute_ref_log_probs=True)
    trainer = make_trainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir), config, dataset)
    assert trainer.ref_model is None
    trainer.train()
    with pytest.raises(ValueError, match="eval_dataset"):
        trainer.evaluate(eval_dataset=dataset)


@pytest.mark.parametrize("loss_type", ["orpo", "simpo", "sft", ["orpo", "sft"]])
def test_reference_free_losses_run_no_reference_pass(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch,
                                                     loss_type):
    """Step 1 takes all 6 pairs in one batch, so its loss and rewards are those of `preference_loss` on the
    untrained model's log-probs, computed here sequence by sequence (per-token averages: summed log-prob
    over the response's token count)."""
    dataset = pair_dataset(tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = make_config(tmp_path, pref_loss=loss_type, finetuning_type="full", max_steps=2,
                         per_device_train_batch_size=len(PAIRS))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    logps, lengths = {}, {}
    for side in ("chosen", "rejected"):
        rows = list(zip(dataset[f"{side}_input_ids"], dataset[f"{side}_labels"]))
        logps[side] = torch.tensor([sequence_logps_by_hand(base, ids, labels) for ids, labels in rows])
        lengths[side] = torch.tensor([sum(t != -100 for t in labels[1:]) for _, labels in rows])
    losses, chosen_rewards, rejected_rewards = dpo_module.preference_loss(
        loss_type, logps["chosen"], logps["rejected"], lengths["chosen"], lengths["rejected"], None, None,
        beta=config.method.pref_beta, simpo_gamma=config.method.simpo_gamma)

    trainer = make_trainer(model, config, dataset)
    assert trainer.ref_model is None  # no frozen copy either
    monkeypatch.setattr(DPOTrainer, "reference_logps", lambda *a, **k: pytest.fail("reference pass"))
    trainer.train()
    first = [r for r in trainer.state.log_history if "loss" in r][0]
    assert first["loss"] == pytest.approx(losses.mean().item(), abs=1e-5)
    assert first["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), abs=1e-6)
    assert first["rewards/rejected"] == pytest.approx(rejected_rewards.mean().item(), abs=1e-6)


def test_weighted_losses_add_up_with_the_adapter_disabled_as_reference(tiny_model_dir, tiny_tokenizer, tmp_path):
    """MPO's sum (TRL's loss_type list with loss_weights) under LoRA. At step 0 (fresh adapter) policy equals
    reference: sigmoid is log 2, bco_pair -log s(0) - log s(-0) = 2 log 2, and sft the chosen replies' NLL per token
    over the batch, so the loss is 0.8 log 2 + 0.2 * 2 log 2 + NLL."""
    dataset = pair_dataset(tiny_tokenizer)
    config = make_config(tmp_path, pref_loss="sigmoid,bco_pair,sft", loss_weights="0.8,0.2,1")
    trainer = make_trainer(lora_model(tiny_model_dir), config, dataset)
    batch = pairwise_collate([dataset[i] for i in range(4)])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
        logps, mask = forward_token_logps(trainer.model, batch["input_ids"], batch["attention_mask"], batch["labels"])
    nll = -logps[:4].sum() / mask[:4].sum()
    assert loss == pytest.approx(0.8 * 0.6931472 + 0.2 * 2 * 0.6931472 + nll.item(), abs=1e-5)
    trainer.train()
    with torch.no_grad():
        after = trainer.compute_loss(trainer.model, batch).item()
    assert len(losses_of(trainer)) == 3 and after < loss - 0.05  # the three steps trained the sum (7.09 -> 6.94)


def test_pref_ftx_adds_the_chosen_nll(tiny_model_dir, tiny_tokenizer, tmp_path):
    """At step 0 (fresh adapter) DPO's loss is log 2, so loss - log 2 = pref_ftx * the mean over pairs of each chosen
    reply's per-token NLL."""
    dataset = pair_dataset(tiny_tokenizer)
    trainer = make_trainer(lora_model(tiny_model_dir), make_config(tmp_path, pref_ftx=0.5), dataset)
    batch = pairwise_collate([dataset[i] for i in range(4)])
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
        logps, mask = forward_token_logps(trainer.model, batch["input_ids"], batch["attention_mask"], batch["labels"])
    chosen_nll = (-logps[:4].sum(-1) / mask[:4].sum(-1)).mean()
    assert loss == pytest.approx(0.6931472 + 0.5 * chosen_nll.item(), abs=1e-5)


def test_precomputed_reference_matches_on_the_fly_and_is_cached(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                                monkeypatch):
    dataset = pair_dataset(tiny_tokenizer)
    on_the_fly = make_trainer(lora_model(tiny_model_dir), make_config(tmp_path / "a", max_steps=4), dataset)
    on_the_fly.train()
    on_the_fly_eval = on_the_fly.evaluate(eval_dataset=dataset)

    config = make_config(tmp_path / "b", max_steps=4, precompute_ref_log_probs=True)
    precomputed = make_trainer(lora_model(tiny_model_dir), config, dataset, eval_dataset=dataset)
    # The columns hold the base model's (the reference's) summed log-probs of each response.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for side in ("chosen", "rejected"):
        expected = [sequence_logps_by_hand(base, ids, labels)
                    for ids, labels in zip(dataset[f"{side}_input_ids"], dataset[f"{side}_labels"])]
        assert precomputed.train_dataset[f"ref_{side}_logps"] == pytest.approx(expected, abs=1e-4), side
    calls = []
    original = DPOTrainer.reference_logps
    monkeypatch.setattr(DPOTrainer, "reference_logps", lambda self, inputs: calls.append(1) or original(self, inputs))
    precomputed.train()
    assert calls == []  # training read the columns, never ran the reference
    assert losses_of(precomputed) == pytest.approx(losses_of(on_the_fly), abs=1e-5)
    precomputed_eval = precomputed.evaluate()
    assert precomputed_eval["eval_rewards/margins"] > 0
    for key, value in on_the_fly_eval.items():
        if key.startswith("eval_") and not key.endswith(("_runtime", "_per_second")):
            assert precomputed_eval[key] == pytest.approx(value, abs=1e-5), key

    # A second run over the same tokens and weights reads the cache instead of recomputing.
    again = make_trainer(lora_model(tiny_model_dir), config, dataset)
    assert calls == []
    assert again.train_dataset["ref_chosen_logps"] == precomputed.train_dataset["ref_chosen_logps"]
    # Other weights are another key: recomputed.
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        other.lm_head.weight.mul_(2.0)
    make_trainer(other, make_config(tmp_path / "c", precompute_ref_log_probs=True, finetuning_type="full"), dataset)
    assert calls


def test_reference_cache_is_read_with_weights_only(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """The cache holds only tensors, so it is read in the mode that unpickles nothing else."""
    dataset = pair_dataset(tiny_tokenizer, PAIRS[:2])
    config = make_config(tmp_path, precompute_ref_log_probs=True)
    make_trainer(lora_model(tiny_model_dir), config, dataset)  # computes and writes the cache
    loads = []
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: loads.append(kwargs) or original(*args, **kwargs))
    make_trainer(lora_model(tiny_model_dir), config, dataset)
    assert loads and all(kwargs.get("weights_only") is True for kwargs in loads)



def test_later_epochs_take_the_kept_reference_outputs(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """Three epochs of 6 pairs by 2, shuffled each epoch: the reference runs in the first epoch's 3 steps only, and
    the losses and metrics equal those of the run that reruns it at every step (kept outputs off) within float
    rounding."""
    calls = _count_reference_passes(monkeypatch)
    dataset = pair_dataset(tiny_tokenizer)
    runs = {}
    for keep in (True, False):
        if not keep:
            monkeypatch.setattr(DPOTrainer, "_reference_is_fixed", lambda self, sync: False)
        calls.clear()
        config = make_config(tmp_path / str(keep), max_steps=9)
        trainer = make_trainer(lora_model(tiny_model_dir, init_lora_weights=False), config, dataset)
        trainer.train()
        runs[keep] = ([r for r in trainer.state.log_history if "loss" in r], len(calls))
    (kept_logs, kept_calls), (rerun_logs, rerun_calls) = runs[True], runs[False]
    assert (kept_calls, rerun_calls) == (3, 9)
    for kept, rerun in zip(kept_logs, rerun_logs, strict=True):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert kept[key] == pytest.approx(rerun[key], abs=1e-6), (kept["step"], key)


@pytest.mark.parametrize("precompute", [False, True])
def test_resumed_run_equals_uninterrupted_run(tiny_model_dir, tiny_tokenizer, tmp_path, precompute, stop_after_step,
                                              monkeypatch):
    """Resumed in the second epoch (6 pairs by 2): on the fly, the checkpoint carries the reference outputs kept in
    the first, so the resumed steps run no reference pass, as the uninterrupted ones do not."""
    calls = _count_reference_passes(monkeypatch)
    dataset = pair_dataset(tiny_tokenizer)
    common = dict(max_steps=6, precompute_ref_log_probs=precompute)
    full = make_trainer(lora_model(tiny_model_dir), make_config(tmp_path / "full", **common), dataset)
    calls.clear()  # with precompute: the pass over the dataset when the trainer is built
    full.train()
    assert calls == ([] if precompute else [False] * 3)

    config = make_config(tmp_path / "resumed", **common)
    first = make_trainer(lora_model(tiny_model_dir), config, dataset, callbacks=[stop_after_step(3)])
    first.train()
    checkpoint = tmp_path / "resumed" / "out" / "checkpoint-3"
    assert (checkpoint / "trainer_state.json").is_file()
    second = make_trainer(lora_model(tiny_model_dir), config, dataset)
    calls.clear()
    second.train(resume_from_checkpoint=str(checkpoint))
    assert calls == []
    assert (checkpoint / "reference_outputs.pt").is_file() != precompute
    resumed_losses = losses_of(second)
    assert len(resumed_losses) == 6  # the checkpoint's log history plus steps 4-6
    assert resumed_losses == pytest.approx(losses_of(full), abs=1e-5)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 3


@pytest.mark.parametrize("batch_eval_metrics", [False, True])
def test_run_train_dpo_end_to_end(tiny_model_dir, tmp_path, batch_eval_metrics):
    """`stage: dpo` from a preference file: trainer_log.jsonl carries the reward metrics, outputs are written,
    eval metrics are exact means over the set (batches of 4 and 2 pairs), and prediction writes each pair's
    implicit rewards, whose means are those eval metrics (under `batch_eval_metrics` the evaluation keeps no
    predictions and prediction runs its own pass)."""
    rows = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    data_file = tmp_path / "pairs.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    config = parse_config({
        "stage": "dpo", "model_name_or_path": tiny_model_dir, "dataset": str(data_file),
        "eval_dataset": str(data_file), "output_dir": str(tmp_path / "out"), "do_train": True, "do_eval": True,
        "do_predict": True, "max_steps": 3, "per_device_train_batch_size": 2, "per_device_eval_batch_size": 4,
        "learning_rate": 5e-3, "lora_rank": 4, "cutoff_len": 64, "save_strategy": "no", "seed": 0,
        "precompute_ref_log_probs": True, "batch_eval_metrics": batch_eval_metrics,
    })
    run_train(config)
    out = tmp_path / "out"
    records = [r for r in read_log(out) if "loss" in r]
    assert [r["current_steps"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6)
    # eval_results.json: the saved adapter over the base model, against the base model as the reference
    # (precomputed), pair by pair over the 6 pairs (eval batches of 4 and 2: the eval means are exact over the set).
    from peft import PeftModel
    from transformers import AutoTokenizer

    from alignkit.data import get_dataset

    eval_rows = get_dataset(config, AutoTokenizer.from_pretrained(tiny_model_dir), "preference")["eval_dataset"]
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out)).eval()
    expected = dpo_eval_by_hand(policy, AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), eval_rows,
                                beta=config.method.pref_beta)
    assert len(eval_rows) == 6 and expected["eval_rewards/margins"] != pytest.approx(0.0, abs=1e-3)
    eval_results = json.loads((out / "eval_results.json").read_text())
    for key, value in expected.items():
        assert eval_results[key] == pytest.approx(value, abs=1e-5), key
    predictions = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == len(PAIRS)
    assert [(p["prompt"], p["chosen_response"], p["rejected_response"]) for p in predictions] == [
        (f"user\n{prompt}\nassistant\n", chosen + "\n", rejected + "\n") for prompt, chosen, rejected in PAIRS]
    margins = [p["chosen"] - p["rejected"] for p in predictions]
    assert any(abs(m) > 1e-4 for m in margins)  # trained: the policy has moved away from the reference
    assert eval_results["eval_rewards/margins"] == pytest.approx(sum(margins) / len(margins), abs=1e-5)
    assert eval_results["eval_rewards/accuracies"] == pytest.approx(sum(m > 0 for m in margins) / len(margins))
    assert json.loads((out / "predict_results.json").read_text())["predict_loss"] == pytest.approx(
        eval_results["eval_loss"], abs=1e-6)


def test_zero3_full_finetuning_reference_is_a_second_load_gathered_per_pass(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                                            zero3_loading):
    """Under (stand-in) ZeRO-3 a full fine-tuning policy's reference is not a deep copy (that would copy partitions)
    but the policy's source loaded again, partitioned as `from_pretrained` leaves it, and each reference pass gathers
    it once; the run equals the plain one. The policy is whole here: under DeepSpeed the Trainer's engine owns its
    partitions, and that engine is not stood in for."""
    from alignkit.model.loader import load_model

    dataset = pair_dataset(tiny_tokenizer)
    batch = pairwise_collate([dataset[i] for i in range(2)])

    def config(name):
        return make_config(tmp_path / name, finetuning_type="full", model_name_or_path=tiny_model_dir, max_steps=3,
                           logging_steps=1)

    plain_config = config("plain")
    plain = make_trainer(load_model(plain_config.model, plain_config.finetuning, is_trainable=True), plain_config,
                         dataset)
    plain.train()

    zero3_config = config("zero3")
    policy = load_model(zero3_config.model, zero3_config.finetuning, is_trainable=True)
    loaded = zero3_loading()
    trainer = make_trainer(policy, zero3_config, dataset)
    assert loaded == [trainer.ref_model] and trainer.ref_model is not policy  # loaded again, partitioned
    partitions = next(trainer.ref_model.parameters()).ds_owner
    assert partitions.is_partitioned()
    with pytest.raises((RuntimeError, IndexError, AssertionError)), torch.no_grad():
        trainer.ref_model(input_ids=batch["input_ids"])  # a reference forward outside its gather reads nothing
    trainer.train()

    assert losses_of(trainer) == pytest.approx(losses_of(plain), abs=1e-5) and len(losses_of(plain)) == 3
    assert partitions.gathers == 3 and partitions.is_partitioned()  # one gather per reference pass (3 steps)
    trained, expected = dict(trainer.model.named_parameters()), dict(plain.model.named_parameters())
    for name, param in expected.items():
        torch.testing.assert_close(trained[name].detach(), param.detach(), rtol=0, atol=1e-5, msg=name)
