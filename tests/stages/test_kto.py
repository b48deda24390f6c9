"""KTO stage end to end on the tiny model: reference, KL rows, training, metrics, full fine-tuning, resume."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from alignkit.callbacks import read_log
from alignkit.config.parse import parse_config
from alignkit.data import UnpairedCollator
from alignkit.model.logprobs import forward_sequence_logps
from alignkit.model.tiny import build_tiny_tokenizer
from alignkit.stages.kto import TOKEN_COLUMNS, KTOTrainer
from alignkit.train import run_train
from tests.helpers import tiny_config

ROWS = [
    ("What is 12 plus 7?", "12 plus 7 is 19.", True),
    ("The capital of France?", "Tokyo.", False),
    ("Name a colour.", "green", True),
    ("Translate to French: good morning.", "Bonjour.", True),
    ("Write a short poem about the sea.", "8", False),
    ("How many apples does Tom have?", "Tom has 8 apples.", True),
]


def unpaired_dataset(tokenizer, rows=ROWS) -> Dataset:
    """The `get_dataset(..., "kto")` columns, built by hand from chat-templated rows."""
    columns: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": [], "desirable": []}
    for prompt, reply, desirable in rows:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   tokenize=True)["input_ids"]
        full = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": reply}], tokenize=True)["input_ids"]
        columns["input_ids"].append(full)
        columns["attention_mask"].append([1] * len(full))
        columns["labels"].append([-100] * len(prompt_ids) + full[len(prompt_ids):])
        columns["desirable"].append(desirable)
    return Dataset.from_dict(columns)


def make_config(tmp_path, **overrides):
    values = {"stage": "kto", "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 3,
              "per_device_eval_batch_size": 6, "max_steps": 3, "learning_rate": 5e-3, "lr_scheduler_type": "constant",
              "save_strategy": "no", "use_cpu": True, "seed": 0, "data_seed": 0, "dataloader_num_workers": 0,
              "train_sampling_strategy": "sequential"}
    values.update(overrides)
    return tiny_config(**values)


def lora_model(tiny_model_dir, init_lora_weights=True):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"], init_lora_weights=init_lora_weights)
    torch.manual_seed(1)
    return get_peft_model(base, config)


def make_trainer(model, config, dataset, eval_dataset=None, callbacks=None):
    return KTOTrainer(model=model, args=config.training, kto_args=config.method,
                      data_collator=UnpairedCollator(build_tiny_tokenizer()), train_dataset=dataset,
                      eval_dataset=eval_dataset, callbacks=callbacks)


def batch_of(trainer, indices):
    return trainer.data_collator([trainer.train_dataset[i] for i in indices])


def logps_of(model, batch, prefix=""):
    with torch.no_grad():
        return forward_sequence_logps(model, batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"],
                                      batch[f"{prefix}labels"])


def losses_of(trainer) -> list[float]:
    return [record["loss"] for record in trainer.state.log_history if "loss" in record]


def test_lora_reference_is_the_base_model_and_the_loss_uses_the_kl_rows(tiny_model_dir, tiny_tokenizer, tmp_path):
    """A non-zero adapter: the reference is the plain base model (no copy), and the loss equals `kto_loss`
    on policy and base log-probs with z0 from the batch's mismatched rows."""
    trainer = make_trainer(lora_model(tiny_model_dir, init_lora_weights=False), make_config(tmp_path),
                           unpaired_dataset(tiny_tokenizer))
    assert trainer.ref_model is None
    batch = batch_of(trainer, range(3))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch).item()

    beta = trainer.beta
    policy, _ = logps_of(trainer.model, batch)
    reference, _ = logps_of(base, batch)
    z0 = max(0.0, (logps_of(trainer.model, batch, "kl_")[0] - logps_of(base, batch, "kl_")[0]).mean().item())
    h = policy - reference
    assert not torch.allclose(policy, reference, atol=1e-3)  # the adapter matters
    desirable = batch["desirable"]
    expected = torch.where(desirable, 1 - torch.sigmoid(beta * (h - z0)), 1 - torch.sigmoid(beta * (z0 - h)))
    assert loss == pytest.approx(expected.mean().item(), abs=1e-5)
    assert trainer._metrics["train"]["kl"][-1] == pytest.approx(z0, abs=1e-5)
    # The KL rows are each prompt with the reply of the row before it in the batch (the first, the last's).
    assert trainer.train_dataset[1]["kl_input_ids"][-3:] == trainer.train_dataset[0]["input_ids"][-3:]
    assert trainer.train_dataset[0]["kl_input_ids"][-3:] == trainer.train_dataset[2]["input_ids"][-3:]


def test_lora_training_logs_metrics_and_moves_only_the_adapter(tiny_model_dir, tiny_tokenizer, tmp_path):
    model = lora_model(tiny_model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = make_config(tmp_path, max_steps=6)
    trainer = make_trainer(model, config, unpaired_dataset(tiny_tokenizer))
    trainer.train()

    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in logs] == [1, 2, 3, 4, 5, 6]
    for r in logs:
        assert torch.isfinite(torch.tensor(r["loss"]))
        assert {"kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                "logps/rejected"} <= set(r)
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6)
    # Step 1: policy == reference (fresh adapter), so rewards and z0 are 0 and each loss is 1 - sigmoid(0).
    assert logs[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    assert logs[0]["kl"] == 0.0 and logs[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-7)
    assert logs[-1]["rewards/margins"] > 0  # trained: desirable replies gain on undesirable ones
    assert logs[-1]["loss"] < 0.5


def test_full_finetuning_reference_is_the_policy_at_init(tiny_model_dir, tiny_tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = make_trainer(model, make_config(tmp_path, finetuning_type="full", max_steps=2),
                           unpaired_dataset(tiny_tokenizer))
    batch = batch_of(trainer, range(3))
    at_init = logps_of(model, batch)[0]
    trainer.train()
    assert not torch.allclose(logps_of(model, batch)[0], at_init, atol=1e-4)  # the policy trained
    with trainer.reference() as reference:
        assert torch.allclose(logps_of(reference, batch)[0], at_init, atol=1e-5)
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses_of(trainer))


def test_pref_ftx_adds_the_desirable_nll(tiny_model_dir, tiny_tokenizer, tmp_path):
    """At step 0 (fresh adapter) every KTO loss is 0.5, so loss - 0.5 = pref_ftx * the mean over desirable replies
    of each one's per-token NLL."""
    trainer = make_trainer(lora_model(tiny_model_dir), make_config(tmp_path, pref_ftx=0.5),
                           unpaired_dataset(tiny_tokenizer))
    batch = batch_of(trainer, range(3))  # rows 0 and 2 desirable
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
    logps, lengths = logps_of(trainer.model, batch)
    nll = (-logps[0] / lengths[0] - logps[2] / lengths[2]) / 2
    assert loss == pytest.approx(0.5 + 0.5 * nll.item(), abs=1e-5)



@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_precomputed_reference_matches_on_the_fly_and_is_cached(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                                monkeypatch, loss_type):
    """`precompute_ref_log_probs`: the columns hold the base model's summed log-probs of each reply and of each KL
    row (kto only); training and evaluation read them instead of running the reference, and give the on-the-fly
    losses and metrics; a second trainer over the same tokens and weights reads the cache. Without precomputing,
    an evaluation after training takes the reference outputs kept from the one before it (`kept_reference`)."""
    dataset = unpaired_dataset(tiny_tokenizer)
    common = dict(max_steps=4, per_device_train_batch_size=2, loss_type=loss_type)
    on_the_fly = make_trainer(lora_model(tiny_model_dir), make_config(tmp_path / "a", **common), dataset,
                              eval_dataset=dataset)
    on_the_fly.evaluate()  # before training: the base's outputs of the evaluation batches are kept
    on_the_fly.train()
    reference_passes = []
    kept_from_before = on_the_fly.reference_logps
    on_the_fly.reference_logps = lambda inputs: reference_passes.append(1) or kept_from_before(inputs)
    on_the_fly_eval = on_the_fly.evaluate()
    assert reference_passes == []  # ... and serve this evaluation (checked against the precomputed columns below)

    config = make_config(tmp_path / "b", precompute_ref_log_probs=True, **common)
    precomputed = make_trainer(lora_model(tiny_model_dir), config, dataset, eval_dataset=dataset)
    columns = ["ref_logps", "ref_kl_logps"] if loss_type == "kto" else ["ref_logps"]
    assert [c for c in precomputed.train_dataset.column_names if c.startswith("ref_")] == columns
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for column, prefix in zip(columns, ("", "kl_")):
        for data in (precomputed.train_dataset, precomputed.eval_dataset):
            batch = UnpairedCollator(build_tiny_tokenizer())([{k: v for k, v in row.items() if k not in columns}
                                                              for row in data])
            expected = logps_of(base, batch, prefix)[0].tolist()
            assert data[column] == pytest.approx(expected, abs=1e-4), column
    calls = []
    original = KTOTrainer.reference_logps
    monkeypatch.setattr(KTOTrainer, "reference_logps", lambda self, inputs: calls.append(1) or original(self, inputs))
    precomputed.train()
    precomputed_eval = precomputed.evaluate()
    assert calls == []  # training and evaluation read the columns, never ran the reference
    assert losses_of(precomputed) == pytest.approx(losses_of(on_the_fly), abs=1e-5)
    assert precomputed_eval["eval_rewards/margins"] != pytest.approx(0.0, abs=1e-4)
    for key, value in on_the_fly_eval.items():
        if key.startswith("eval_") and not key.endswith(("_runtime", "_per_second", "_preparation_time")):
            assert precomputed_eval[key] == pytest.approx(value, abs=1e-5), key

    # A second trainer over the same tokens and weights reads the cache instead of recomputing.
    again = make_trainer(lora_model(tiny_model_dir), config, dataset)
    assert calls == []
    assert again.train_dataset["ref_logps"] == precomputed.train_dataset["ref_logps"]


@pytest.mark.parametrize("bf16", [False, True])
def test_precomputed_reference_runs_under_the_runs_autocast(tiny_model_dir, tiny_tokenizer, tmp_path, bf16,
                                                           monkeypatch):
    """The precompute replaces reference passes that would have run under the run's autocast (accelerate wraps the
    forward once training prepares the model), so it runs under that autocast too: bf16 in a bf16 run. The CPU's
    bf16 support is patched in: without it the config keeps `bf16: true` off (a CPU without AVX512-BF16 or AMX)."""
    monkeypatch.setattr("alignkit.config.parse._cpu_has_bf16", lambda: True)
    model = lora_model(tiny_model_dir)
    seen = []
    layer = model.base_model.model.model.layers[0]
    handle = layer.register_forward_pre_hook(lambda module, args: seen.append(torch.is_autocast_enabled("cpu")))
    make_trainer(model, make_config(tmp_path, per_device_train_batch_size=2, bf16=bf16, precompute_ref_log_probs=True),
                 unpaired_dataset(tiny_tokenizer))
    handle.remove()
    assert seen and set(seen) == {bf16}


def test_reference_cache_key_counts_the_precision(tiny_model_dir, tiny_tokenizer):
    """bf16-computed reference log-probs are not fp32's: another file; fp32 ("no") keeps the key it always had."""
    from alignkit.stages.reference_cache import reference_cache_path

    dataset = unpaired_dataset(tiny_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    paths = {precision: reference_cache_path(dataset, model.named_parameters(), TOKEN_COLUMNS, precision)
             for precision in ("no", "bf16")}
    assert paths["no"] == reference_cache_path(dataset, model.named_parameters(), TOKEN_COLUMNS)
    assert paths["no"] != paths["bf16"] and paths["no"].parent == paths["bf16"].parent


def test_full_finetuning_with_precomputed_reference_keeps_no_copy(tiny_model_dir, tiny_tokenizer, tmp_path):
    """The policy at init served as the reference for the columns; no frozen copy is kept, and a dataset that did
    not get its columns then cannot get a correct reference after training."""
    dataset = unpaired_dataset(tiny_tokenizer)
    trainer = make_trainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           make_config(tmp_path, finetuning_type="full", max_steps=1, per_device_train_batch_size=2,
                                       precompute_ref_log_probs=True), dataset)
    assert trainer.ref_model is None and "ref_kl_logps" in trainer.train_dataset.column_names
    trainer.train()
    with pytest.raises(ValueError, match="precompute_ref_log_probs"):
        trainer.evaluate(eval_dataset=dataset)


def test_resumed_run_equals_uninterrupted_run(tiny_model_dir, tiny_tokenizer, tmp_path, stop_after_step):
    dataset = unpaired_dataset(tiny_tokenizer)
    common = dict(max_steps=6, per_device_train_batch_size=2, train_sampling_strategy="random")
    full = make_trainer(lora_model(tiny_model_dir), make_config(tmp_path / "full", **common), dataset)
    full.train()
    config = make_config(tmp_path / "resumed", **common)
    make_trainer(lora_model(tiny_model_dir), config, dataset, callbacks=[stop_after_step(3)]).train()
    checkpoint = tmp_path / "resumed" / "out" / "checkpoint-3"
    second = make_trainer(lora_model(tiny_model_dir), config, dataset)
    second.train(resume_from_checkpoint=str(checkpoint))
    assert len(losses_of(second)) == 6  # the checkpoint's log history plus steps 4-6
    assert losses_of(second) == pytest.approx(losses_of(full), abs=1e-5)


def test_run_train_kto_end_to_end(tiny_model_dir, tmp_path):
    """`stage: kto` from TRL-style rows: metrics in trainer_log.jsonl, eval over the whole set in one batch,
    predictions hold each example's implicit reward, whose means per kind are the eval rewards."""
    data_file = tmp_path / "kto.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": p, "completion": c, "label": d}) + "\n" for p, c, d in ROWS),
                         encoding="utf-8")
    config = parse_config({
        "stage": "kto", "model_name_or_path": tiny_model_dir, "dataset": str(data_file),
        "eval_dataset": str(data_file), "output_dir": str(tmp_path / "out"), "do_train": True, "do_eval": True,
        "do_predict": True, "max_steps": 3, "per_device_train_batch_size": 2, "per_device_eval_batch_size": 6,
        "learning_rate": 5e-3, "lora_rank": 4, "cutoff_len": 64, "save_strategy": "no", "seed": 0,
    })
    run_train(config)
    out = tmp_path / "out"
    records = [r for r in read_log(out) if "loss" in r]
    assert [r["current_steps"] for r in records] == [1, 2, 3]
    # A batch of 2 may hold one kind of reply only: its other kind's metrics are then absent, not zero.
    assert all("kl" in r and ("rewards/chosen" in r or "rewards/rejected" in r) for r in records)
    eval_results = json.loads((out / "eval_results.json").read_text())
    predictions = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert [p["desirable"] for p in predictions] == [d for _, _, d in ROWS]
    # Each line carries the text it scores: the rendered prompt holds the question, the completion is the reply.
    assert all(q in p["prompt"] and p["completion"].strip() == c for (q, c, _), p in zip(ROWS, predictions))
    chosen = [p["reward"] for p in predictions if p["desirable"]]
    rejected = [p["reward"] for p in predictions if not p["desirable"]]
    assert any(abs(r) > 1e-4 for r in chosen + rejected)  # trained: the policy moved from the reference
    assert eval_results["eval_rewards/chosen"] == pytest.approx(sum(chosen) / len(chosen), abs=1e-5)
    assert eval_results["eval_rewards/rejected"] == pytest.approx(sum(rejected) / len(rejected), abs=1e-5)
    assert (out / "adapter_model.safetensors").is_file()


def test_zero3_full_finetuning_reference_is_a_second_load_gathered_per_pass(tiny_model_dir, tmp_path, zero3_loading):
    """Under (stand-in) ZeRO-3 a full fine-tuning policy's reference is the policy's source loaded again, partitioned,
    and gathered once per batch (its two passes, the rows and the KL rows, in one block); the run equals the plain one.
    The policy is given back whole when the Trainer is built (its DeepSpeed engine is not stood in for)."""
    data_file = tmp_path / "kto.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": p, "completion": c, "label": d}) + "\n" for p, c, d in ROWS),
                         encoding="utf-8")

    def config(out):
        return parse_config({
            "stage": "kto", "model_name_or_path": tiny_model_dir, "dataset": str(data_file), "output_dir": str(out),
            "do_train": True, "max_steps": 3, "per_device_train_batch_size": 3, "learning_rate": 5e-3,
            "finetuning_type": "full", "cutoff_len": 64, "save_strategy": "no", "seed": 0, "logging_steps": 1})

    plain, zero3 = tmp_path / "plain", tmp_path / "zero3"
    run_train(config(plain))
    loaded = zero3_loading(policy_whole=True)
    run_train(config(zero3))
    assert len(loaded) == 2  # the policy (given to the stand-in engine whole), then its reference, partitioned
    reference = next(loaded[1].parameters()).ds_owner
    # One gather per batch's reference passes: steps 1 and 2 (the 6 rows by 3); step 3 starts the second epoch,
    # whose rows' outputs are kept (`StageTrainer.kept_reference`).
    assert reference.gathers == 2 and reference.is_partitioned()
    losses = [[r["loss"] for r in read_log(out) if "loss" in r] for out in (plain, zero3)]
    assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], abs=1e-5)


def test_prediction_on_the_data_just_evaluated_is_that_evaluation(tiny_model_dir, tiny_tokenizer, tmp_path):
    """Issue 30: evaluation gathers each row's implicit reward and flag, and `predict` on the same rows with the
    same weights is that pass (`StageTrainer.evaluation_predictions`), equal to running it again; an optimizer step,
    or other data, means a new pass."""
    eval_rows = unpaired_dataset(tiny_tokenizer)
    trainer = make_trainer(lora_model(tiny_model_dir, init_lora_weights=False), make_config(tmp_path, max_steps=1),
                           unpaired_dataset(tiny_tokenizer), eval_dataset=eval_rows)
    metrics = trainer.evaluate()
    evaluated = trainer.eval_dataset  # the rows with their KL rows added by the trainer
    reused = trainer.evaluation_predictions(evaluated)
    fresh = trainer.predict(evaluated, metric_key_prefix="predict")
    assert reused is not None and reused.predictions.shape == (len(ROWS),)
    assert reused.predictions == pytest.approx(fresh.predictions, abs=1e-6)
    assert reused.label_ids.tolist() == fresh.label_ids.tolist() == [int(d) for _, _, d in ROWS]
    assert reused.metrics["predict_loss"] == pytest.approx(fresh.metrics["predict_loss"], abs=1e-6)
    assert reused.metrics["predict_loss"] == metrics["eval_loss"]
    assert trainer.evaluation_predictions(eval_rows) is None  # other data
    trainer.train()
    assert trainer.evaluation_predictions(evaluated) is None  # the weights moved since


def test_later_epochs_take_the_kept_reference_outputs(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """Two epochs on the fly: the reference (replies and KL rows) runs in the first epoch's steps only
    (`StageTrainer.kept_reference`), and the losses equal the rerun-every-step run's within float rounding."""
    dataset = unpaired_dataset(tiny_tokenizer)
    calls = []
    original = KTOTrainer.reference_logps
    monkeypatch.setattr(KTOTrainer, "reference_logps", lambda self, inputs: calls.append(1) or original(self, inputs))
    runs = {}
    for keep in (True, False):
        if not keep:
            monkeypatch.setattr(KTOTrainer, "_reference_is_fixed", lambda self, sync: False)
        calls.clear()
        epoch = len(dataset) // 2
        trainer = make_trainer(lora_model(tiny_model_dir, init_lora_weights=False),
                               make_config(tmp_path / str(keep), max_steps=2 * epoch, per_device_train_batch_size=2),
                               dataset)
        trainer.train()
        runs[keep] = (losses_of(trainer), len(calls))
    assert runs[True][1] == epoch and runs[False][1] == 2 * epoch
    assert runs[True][0] == pytest.approx(runs[False][0], abs=1e-6)
