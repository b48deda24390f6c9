"""Shared fixtures: a tiny random model directory built locally, and an offline environment."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path to a tiny LlamaForCausalLM (2 layers, hidden 64) + ChatML tokenizer with pad == eos."""
    from alignkit.model.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_model")))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Keep caches written by a test (tokenised data, converted models) inside its tmp dir,
    except the bundled model cache, which slow tests share through ALIGNKIT_HOME when set."""
    if "ALIGNKIT_HOME" not in os.environ:
        monkeypatch.setenv("ALIGNKIT_HOME", str(tmp_path / "alignkit_home"))
    monkeypatch.setenv("ALIGNKIT_DATA_CACHE", str(tmp_path / "data_cache"))


def _save_perturbed_adapter(model_dir, out_dir, head="causal_lm", seed=1, over=None):
    """Save a fresh LoRA adapter over `model_dir` whose lora_B is random (PEFT starts it at zero, so an
    untouched adapter would change nothing), as if trained; returns the model with the adapter active.
    `over`: adapter_name_or_path merged into the base first, recorded beside the adapter as a run records it."""
    import torch

    from alignkit.hparams import parse_config
    from alignkit.model.loader import load_model, save_base_adapters

    config = parse_config({"model_name_or_path": str(model_dir), "adapter_name_or_path": over and str(over)})
    # lora_A (and a fresh score head) come from the global RNG: seed it, so the adapter does not depend on
    # which tests ran before (merge-vs-unmerged rounding checks near 1e-5 flipped with the test order).
    torch.manual_seed(seed)
    model = load_model(config.model, config.finetuning, is_trainable=True, head=head)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model.eval()
    model.save_pretrained(out_dir)
    save_base_adapters(model, out_dir)
    return model


@pytest.fixture
def save_perturbed_adapter():
    """`save_perturbed_adapter(model_dir, out_dir, head="causal_lm", seed=1, over=None)` -> model with a non-zero
    LoRA adapter (over the adapters `over` names, merged and recorded)."""
    return _save_perturbed_adapter


@pytest.fixture
def reward_adapter_dir(tiny_model_dir, tmp_path):
    """An rm run's LoRA output over the tiny model (task_type SEQ_CLS, `score` in modules_to_save), its
    score head shifted off its initial values as if trained."""
    import torch

    out = tmp_path / "rm_lora"
    trained = _save_perturbed_adapter(tiny_model_dir, out, head="reward")
    with torch.no_grad():
        trained.base_model.model.score.modules_to_save["default"].weight.add_(1.0)
    trained.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def bundled_model_dir(tmp_path_factory):
    """The bundled SmolLM2-135M-Instruct converted once per test session (for `slow` tests).

    Uses $ALIGNKIT_HOME's cache when the variable is set (so a developer's converted copy is reused),
    else converts into a session temp dir.
    """
    from alignkit.model import bundled

    if "ALIGNKIT_HOME" not in os.environ:
        mp = pytest.MonkeyPatch()
        mp.setenv("ALIGNKIT_HOME", str(tmp_path_factory.mktemp("bundled_home")))
        try:
            return str(bundled.ensure_bundled_model())
        finally:
            mp.undo()
    return str(bundled.ensure_bundled_model())


class SimulatedCrash(Exception):
    """Stands for the training process dying (resume tests)."""


@pytest.fixture
def record_forward_shapes(monkeypatch):
    """`record_forward_shapes(model) -> list`: until the test ends, every forward of `model`'s class appends the
    shape of its `input_ids` (a tuple) to the returned list, then runs as before (counts the passes a batch
    takes and their sizes)."""
    def record(model) -> list[tuple[int, ...]]:
        seen: list[tuple[int, ...]] = []
        real_forward = type(model).forward

        def recording_forward(self, *args, **kwargs):
            seen.append(tuple(kwargs["input_ids"].shape))
            return real_forward(self, *args, **kwargs)

        monkeypatch.setattr(type(model), "forward", recording_forward)
        return seen

    return record


@pytest.fixture
def crash_before_step():
    """`crash_before_step(n)` -> a callback that raises `SimulatedCrash` when step n is about to start, i.e.
    after step n - 1 has been logged and its checkpoint saved, as when the process is killed there."""
    from transformers import TrainerCallback

    class CrashBeforeStep(TrainerCallback):
        def __init__(self, step: int) -> None:
            self.step = step

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == self.step:
                raise SimulatedCrash(f"killed before step {self.step}")

    return CrashBeforeStep
