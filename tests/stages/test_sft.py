"""SFT and PT end to end on the tiny model via `run_train(parse_config(...))`, plus bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from alignkit.callbacks import read_log
from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.metrics import similarity_scores
from alignkit.train import run_train

QA = [("What is 12 plus 7?", "19"), ("Name a colour.", "green"), ("The capital of France?", "Paris."),
      ("The capital of Japan?", "Tokyo."), ("List three fruits.", "apple, banana, cherry"),
      ("Translate to French: good morning.", "Bonjour."), ("What is 9 times 3?", "It is 27."),
      ("Why is the sky blue?", "sunlight scatters off air molecules."), ("中国的首都是哪里？", "北京。"),
      ("请介绍你自己。", "我是一个乐于助人的助手。"), ("Tom has 5 apples and buys 3 more.", "8"),
      ("Write a short poem about the sea.", "The waves roll in and out again.")]


def write_alpaca(path: Path) -> str:
    path.write_text("\n".join(json.dumps({"instruction": q, "output": a}, ensure_ascii=False) for q, a in QA),
                    encoding="utf-8")
    return str(path)


class ParameterSnapshot(TrainerCallback):
    """Copies every parameter at train begin and end, to tell trained from frozen ones."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.before = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.trainable = {n for n, p in model.named_parameters() if p.requires_grad}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.after = {n: p.detach().clone() for n, p in model.named_parameters()}


def base_config(tiny_model_dir, tmp_path, **extra):
    values = {
        "model_name_or_path": tiny_model_dir, "stage": "sft", "finetuning_type": "lora", "lora_rank": 4,
        "dataset": write_alpaca(tmp_path / "qa.jsonl"), "cutoff_len": 64, "val_size": 4,
        "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4,
        "num_train_epochs": 2, "learning_rate": 5e-3, "use_cpu": True, "save_strategy": "no",
        "max_new_tokens": 6,
    }
    values.update(extra)
    return values


def test_sft_lora_train_eval_predict(tiny_model_dir, tmp_path):
    snapshot = ParameterSnapshot()
    config = parse_config(base_config(tiny_model_dir, tmp_path, do_train=True, do_eval=True, do_predict=True,
                                      predict_with_generate=True))
    run_train(config, callbacks=[snapshot])
    out = Path(config.training.output_dir)

    losses = [r["loss"] for r in read_log(out) if "loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(x)) for x in losses)  # 8 rows / 4 x 2 epochs

    changed = {n for n in snapshot.before if not torch.equal(snapshot.before[n], snapshot.after[n])}
    assert snapshot.trainable and all("lora_" in n for n in snapshot.trainable)
    assert changed == {n for n in snapshot.trainable if "lora_B" in n or "lora_A" in n}

    # Each held-out question's prompt is its ChatML user turn ending in the assistant header, and its
    # label is that question's answer.
    records = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert len(records) == 4
    answers = dict(QA)
    for r in records:
        assert set(r) == {"prompt", "predict", "label"}
        question = r["prompt"].removeprefix("<|im_start|>user\n").removesuffix("<|im_end|>\n<|im_start|>assistant\n")
        assert r["prompt"] == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        assert r["label"] == answers[question]
    # The metrics of both splits (the same held-out rows, the same trained model) are those of the file's texts.
    expected = similarity_scores([r["predict"] for r in records], [r["label"] for r in records])
    for split in ("eval", "predict"):
        results = json.loads((out / f"{split}_results.json").read_text())
        for key, value in expected.items():
            assert results[f"{split}_{key}"] == pytest.approx(value, abs=1e-4), (split, key)

    # The adapter reloads over the base and reproduces the trained weights.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    reloaded_params = dict(reloaded.named_parameters())
    for name in changed:
        torch.testing.assert_close(reloaded_params[name], snapshot.after[name])


@pytest.mark.parametrize("batched", [{}, {"batch_eval_metrics": True, "per_device_eval_batch_size": 1}])
def test_sft_eval_loss_and_accuracy_with_packing(tiny_model_dir, tmp_path, batched):
    """Without generation, evaluation reports loss and token accuracy; packing and group_by_length run. Under
    `batch_eval_metrics` the accuracy is summed batch by batch, to the same value."""
    config = parse_config(base_config(tiny_model_dir, tmp_path, do_train=True, do_eval=True, packing=True,
                                      eval_strategy="steps", eval_steps=1, max_steps=2, finetuning_type="full",
                                      **batched))
    run_train(config)
    out = Path(config.training.output_dir)
    results = json.loads((out / "eval_results.json").read_text())
    evals = [r for r in read_log(out) if "eval_loss" in r]
    # Every step; the one at the last step is the end-of-run evaluation, not run again after training.
    assert [r["current_steps"] for r in evals] == [1, 2]
    assert evals[-1]["eval_loss"] == results["eval_loss"]

    # By hand, each held-out example alone through the saved model: the packed evaluation (one batch of
    # packed rows) must give the unpacked token loss and argmax accuracy over all its targets.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignkit.data import get_dataset

    eval_rows = get_dataset(config, AutoTokenizer.from_pretrained(tiny_model_dir), "supervised")["eval_dataset"]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    total, correct, count = 0.0, 0, 0
    for ids, labels in zip(eval_rows["input_ids"], eval_rows["labels"]):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        targets = torch.tensor(labels[1:])
        scored = targets != -100
        total += torch.nn.functional.cross_entropy(logits[scored], targets[scored], reduction="sum").item()
        correct += int((logits[scored].argmax(-1) == targets[scored]).sum())
        count += int(scored.sum())
    assert len(eval_rows) == 4 and count > 4
    if not batched:  # the Trainer's eval_loss is a mean of batch means (rows of one batch here)
        assert results["eval_loss"] == pytest.approx(total / count, abs=1e-5)
    assert results["eval_accuracy"] == pytest.approx(correct / count, abs=1e-6)


def test_group_by_length_sets_sampling_strategy(tiny_model_dir, tmp_path):
    config = parse_config(base_config(tiny_model_dir, tmp_path, do_train=True, group_by_length=True, max_steps=1))
    run_train(config)
    assert config.training.train_sampling_strategy == "group_by_length"


def test_pt_trains_on_raw_text(tiny_model_dir, tmp_path):
    """PT cuts the texts, each closed by eos, into blocks of cutoff_len tokens, all of them targets. One batch
    holds every block, so step 1 (LoRA's B still zero: the base model) logs the base model's mean next-token
    loss over the whole stream, computed here block by block."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignkit.data import get_dataset

    texts = [f"{q} {a}" for q, a in QA * 3]
    data = tmp_path / "text.jsonl"
    data.write_text("\n".join(json.dumps({"text": text}, ensure_ascii=False) for text in texts))
    config = parse_config(base_config(tiny_model_dir, tmp_path, stage="pt", dataset=str(data), cutoff_len=32,
                                      val_size=0, do_train=True, max_steps=2, per_device_train_batch_size=64))
    run_train(config)
    losses = [r["loss"] for r in read_log(config.training.output_dir) if "loss" in r]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert (Path(config.training.output_dir) / "adapter_model.safetensors").is_file()

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    blocks = get_dataset(config, tokenizer, "text")["train_dataset"]
    stream = [token for text in texts for token in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    assert [len(ids) for ids in blocks["input_ids"]] == [32] * (len(stream) // 32) + [len(stream) % 32]
    assert sum(blocks["input_ids"], []) == stream and blocks["labels"] == blocks["input_ids"]
    assert len(blocks) <= 64
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    total, count = 0.0, 0
    for ids in blocks["input_ids"]:
        with torch.no_grad():
            logits = base(input_ids=torch.tensor([ids])).logits[0, :-1]
        total += torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    assert losses[0] == pytest.approx(total / count, abs=1e-5)


def test_max_new_tokens_zero_is_a_config_error(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="max_new_tokens=0"):
        parse_config(base_config(tiny_model_dir, tmp_path, do_predict=True, predict_with_generate=True,
                                 max_new_tokens=0))


def test_sft_settings_and_empty_splits_are_refused_before_loading(tiny_model_dir, tmp_path):
    """Generation without eval/predict, packing with generation, an empty split: ConfigError before any load."""
    from datasets import Dataset

    from alignkit.stages.base import check_splits

    with pytest.raises(ConfigError, match="predict_with_generate=true does nothing"):
        parse_config(base_config(tiny_model_dir, tmp_path, predict_with_generate=True))
    with pytest.raises(ConfigError, match="packing=true with predict_with_generate"):
        parse_config(base_config(tiny_model_dir, tmp_path, do_predict=True, predict_with_generate=True,
                                 packing=True))
    rows = Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1, 2]]})
    empty = Dataset.from_dict({"input_ids": [], "labels": []})
    generating = parse_config(base_config(tiny_model_dir, tmp_path, do_train=True, do_predict=True,
                                          predict_with_generate=True))
    with pytest.raises(ConfigError, match="evaluation set is empty"):
        check_splits(generating, {"train_dataset": rows, "eval_dataset": empty})
    with pytest.raises(ConfigError, match="training set is empty"):
        check_splits(generating, {"train_dataset": empty, "eval_dataset": rows})
    check_splits(generating, {"train_dataset": rows, "eval_dataset": rows})  # fine


@pytest.mark.parametrize("name", ["sft_lora.yaml", "sft_full.yaml", "pt_lora.yaml"])
def test_example_yaml_runs(name, tiny_model_dir, tmp_path):
    """Each shipped example parses and runs a step on the tiny model with its own dataset and settings."""
    from alignkit.config.parse import read_config

    root = Path(__file__).resolve().parents[2]
    path = root / "examples" / name
    assert path.read_text(encoding="utf-8").startswith(f"# alignkit train examples/{name}\n")
    config = read_config(path, [f"model_name_or_path={tiny_model_dir}", f"dataset_dir={root / 'data'}",
                                f"output_dir={tmp_path / 'out'}", "max_samples=24", "max_steps=1",
                                "per_device_train_batch_size=2", "gradient_accumulation_steps=1", "use_cpu=true"])
    run_train(config)
    out = Path(config.training.output_dir)
    log = read_log(out)
    assert [r["current_steps"] for r in log if "loss" in r] == [1]
    assert torch.isfinite(torch.tensor([r["loss"] for r in log if "loss" in r])).all()
    # eval_results.json holds what the final evaluation logged.
    results = json.loads((out / "eval_results.json").read_text())
    final_eval = [r for r in log if "eval_loss" in r][-1]
    assert results["eval_loss"] == final_eval["eval_loss"] and torch.isfinite(torch.tensor(results["eval_loss"]))


def test_gradient_checkpointing_with_lora_trains(tiny_model_dir, tmp_path):
    """Checkpointed LoRA gets the gradients of the plain run (inputs of the frozen embedding must require
    grad), so one step ends at the same weights. lora_B starts at zero, so after one step every lora_B and
    nothing else has moved (lora_A's gradient is B^T(...) = 0)."""
    after = {}
    for checkpointing in (False, True):
        snapshot = ParameterSnapshot()
        config = parse_config(base_config(tiny_model_dir, tmp_path, do_train=True, max_steps=1,
                                          gradient_checkpointing=checkpointing,
                                          output_dir=str(tmp_path / f"out_{checkpointing}")))
        run_train(config, callbacks=[snapshot])
        changed = {n for n in snapshot.trainable if not torch.equal(snapshot.before[n], snapshot.after[n])}
        assert changed == {n for n in snapshot.trainable if "lora_B" in n}
        after[checkpointing] = snapshot.after
    for name, weight in after[False].items():
        torch.testing.assert_close(after[True][name], weight, rtol=0, atol=1e-6, msg=name)
