"""On-policy distillation end to end on the tiny model: the teacher is the tiny base with a perturbed adapter, the
student a fresh LoRA adapter on the bare base. A run trains, logs TRL's metrics, records its completions, moves the
student towards the teacher; another tokenizer is refused before any weights load; a resumed run equals the
uninterrupted one."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignkit.callbacks import read_log
from alignkit.errors import ConfigError
from alignkit.rl.record import COMPLETIONS_FILE
from alignkit.rl.rollout import completion_token_logits
from alignkit.stages import distill as distill_module
from alignkit.train import run_train
from tests.helpers import tiny_config


def _data(tmp_path: Path, num_prompts: int = 4) -> str:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"prompt": f"What is {i} plus {i + 1}?"} for i in range(num_prompts)]))
    return str(path)


@pytest.fixture
def teacher_adapter(tiny_model_dir, tmp_path, save_perturbed_adapter):
    out = tmp_path / "teacher_adapter"
    save_perturbed_adapter(tiny_model_dir, out, seed=3)
    return str(out)


def _config(tiny_model_dir, tmp_path, out, teacher_adapter, **overrides):
    return tiny_config(**{
        "stage": "distill", "do_train": True, "model_name_or_path": tiny_model_dir,
        "teacher_adapter_name_or_path": teacher_adapter, "dataset": _data(tmp_path), "output_dir": str(out),
        "per_device_train_batch_size": 2, "max_completion_length": 6, "max_steps": 4, "learning_rate": 5e-2,
        "lr_scheduler_type": "constant", "save_strategy": "no", "logging_steps": 1, "lora_rank": 4, "seed": 0,
        "disable_tqdm": True, "use_cpu": True, **overrides,
    })


def _losses(out: Path) -> dict[int, float]:
    return {r["current_steps"]: r["loss"] for r in read_log(out) if "loss" in r}


def test_distill_trains_towards_the_teacher_and_logs_trls_metrics(tiny_model_dir, tmp_path, teacher_adapter,
                                                                 monkeypatch, caplog):
    """GA 2: each step generates 2 x 2 completions once and trains them as 2 micro-batches. The divergence to the
    teacher on fixed completions is lower after training than before."""
    seen = []
    original = distill_module.DistillTrainer.compute_loss

    def recording(self, model, inputs, *args, **kwargs):
        loss = original(self, model, inputs, *args, **kwargs)
        seen.append({k: v.detach().clone() for k, v in inputs.items()})
        return loss

    monkeypatch.setattr(distill_module.DistillTrainer, "compute_loss", recording)
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="alignkit.stages.base"):
        run_train(_config(tiny_model_dir, tmp_path, out, teacher_adapter, gradient_accumulation_steps=2, beta=0.5,
                          log_completions=True))
    # The loss is a token mean over the step's completions, so one batch of 4 would train alike; the generation
    # batch follows the batch here (no `generation_batch_size` to keep).
    hints = [r.getMessage() for r in caplog.records if "gradient_accumulation_steps=1" in r.getMessage()]
    assert len(hints) == 1 and "per_device_train_batch_size=4 with gradient_accumulation_steps=1 trains" in hints[0]
    records = [r for r in read_log(out) if "loss" in r]
    assert [r["current_steps"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert math.isfinite(record["loss"]) and record["loss"] > 0 and record["entropy"] > 0
        assert 1 <= record["completions/min_length"] <= record["completions/mean_length"] <= 6
        assert not any(key.startswith("reward") for key in record)  # no reward: none of GRPO's reward metrics
    # The generation batch's completion tokens divide every micro-batch's sum (TRL's num_items_in_batch).
    assert len(seen) == 8 and torch.equal(seen[0]["generation_tokens"], seen[1]["generation_tokens"])
    assert int(seen[0]["generation_tokens"]) == int(seen[0]["completion_mask"].sum() + seen[1]["completion_mask"].sum())

    lines = [json.loads(line) for line in (out / COMPLETIONS_FILE).read_text().splitlines()]
    assert len(lines) == 16 and {line["step"] for line in lines} == {1, 2, 3, 4}  # 2 x 2 completions a step
    assert lines[0]["prompt"].startswith("What is ") and lines[0]["reward"] is None and lines[0]["rewards"] == {}

    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert any(name.endswith("lora_B.weight") and value.abs().max() > 0 for name, value in adapter.items())

    # Before / after on the first micro-batch's completions: the student moved towards the teacher.
    from alignkit.config import FinetuningArguments, ModelArguments
    from alignkit.model.loader import load_model

    teacher = load_model(ModelArguments(model_name_or_path=tiny_model_dir, adapter_name_or_path=teacher_adapter),
                         FinetuningArguments(), is_trainable=False)
    before = load_model(ModelArguments(model_name_or_path=tiny_model_dir), FinetuningArguments(), is_trainable=False)
    after = load_model(ModelArguments(model_name_or_path=tiny_model_dir, adapter_name_or_path=str(out)),
                       FinetuningArguments(), is_trainable=False)
    batch = seen[0]
    args = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"])

    def divergence(student):
        with torch.no_grad():
            per_token = distill_module.generalized_jsd(completion_token_logits(student, *args)[0],
                                                       completion_token_logits(teacher, *args)[0], 0.5)
        return float(per_token.mean())

    assert divergence(after) < divergence(before)


def test_a_teacher_with_another_tokenizer_is_refused_before_loading(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    other = tmp_path / "other_teacher"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<extra_teacher_token>"])
    tokenizer.save_pretrained(other)
    for name in ("config.json", "model.safetensors"):  # the same weights: only the tokenizer differs
        shutil.copy(Path(tiny_model_dir) / name, other / name)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the tokenizer check")

    monkeypatch.setattr("alignkit.model.loader.load_model", no_weights)
    config = _config(tiny_model_dir, tmp_path, tmp_path / "out", None, teacher_model_name_or_path=str(other))
    with pytest.raises(ConfigError, match=r"has another tokenizer than the student \(\d+ tokens against"):
        run_train(config)
    missing = _config(tiny_model_dir, tmp_path, tmp_path / "out", str(tmp_path / "no_adapter"))
    with pytest.raises(ConfigError, match="teacher_adapter_name_or_path: .*no_adapter' holds no adapter_config.json"):
        run_train(missing)


@pytest.mark.fault  # exact resume: a run killed after a checkpoint continues with the uninterrupted run's numbers
def test_resume_equals_the_straight_run(tiny_model_dir, tmp_path, teacher_adapter, crash_before_step):
    overrides = dict(max_steps=4, save_strategy="steps", save_steps=2, log_completions=True)
    straight = tmp_path / "straight"
    run_train(_config(tiny_model_dir, tmp_path, straight, teacher_adapter, **overrides))
    resumed = tmp_path / "resumed"
    with pytest.raises(Exception, match="killed before step"):
        run_train(_config(tiny_model_dir, tmp_path, resumed, teacher_adapter, **overrides),
                  callbacks=[crash_before_step(3)])
    run_train(_config(tiny_model_dir, tmp_path, resumed, teacher_adapter, **overrides))
    want, got = _losses(straight), _losses(resumed)
    assert set(got) == set(want) == {1, 2, 3, 4}
    assert [got[step] for step in (3, 4)] == [want[step] for step in (3, 4)]
    texts = [(out / COMPLETIONS_FILE).read_text() for out in (straight, resumed)]
    assert texts[0] == texts[1]  # the same completions, none generated twice
    a, b = (load_file(str(o / "adapter_model.safetensors")) for o in (straight, resumed))
    assert [name for name in a if not torch.equal(a[name], b[name])] == []
