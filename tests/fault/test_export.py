"""Fault injection for `alignkit export --force`: a target that is one of the sources, an export that fails.

An export builds the whole model beside its target and only then moves it in, so neither a refused nor a failed
export may cost a byte: not of the adapter, not of the base, not of the good export already in the target (issue 31,
item 1). Each case runs the command through the CLI's own `main`, in-process (the faults are on disk, not in the
process): its return value is the exit status, and an exception it lets through is what the process would die of,
exit 1 with a traceback.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import traceback
from pathlib import Path

import pytest
import torch

from alignkit.cli import main

pytestmark = pytest.mark.fault


def export(capsys, *argv) -> tuple[int, str]:
    """`alignkit export ARGV`: (exit status, stderr)."""
    try:
        code = main(["export", *argv])
    except Exception:
        return 1, capsys.readouterr().err + traceback.format_exc()
    return code, capsys.readouterr().err


def error_line(err: str) -> str:
    """The one `alignkit: error:` line of a refused command (loading shows progress bars on stderr too)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("alignkit: error:")]
    assert len(lines) == 1, err
    return lines[0]


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def base(tiny_model_dir, tmp_path) -> Path:
    """A copy of the tiny model this test may lose (the session's own stays whole for the other tests)."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "base"))


@pytest.fixture
def forbid_model_load(monkeypatch):
    """`forbid_model_load()`: from then on, loading weights fails the test (a refusal must come before it)."""
    import alignkit.model.loader as loader

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the export dir was refused")

    return lambda: monkeypatch.setattr(loader, "_load_base", refuse)


@pytest.mark.parametrize("target", ["adapter", "adapter through a symlink", "adapter its record names", "base"])
def test_export_into_a_source_folder_is_refused_even_forced(base, tmp_path, capsys, save_perturbed_adapter,
                                                           forbid_model_load, target):
    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    save_perturbed_adapter(base, sft, seed=3)
    save_perturbed_adapter(base, dpo, seed=4, over=sft)  # records sft in its base_adapters.json
    (tmp_path / "link").symlink_to(dpo)
    adapter, export_dir = {"adapter": (dpo, dpo), "adapter through a symlink": (dpo, tmp_path / "link"),
                           "adapter its record names": (dpo, sft), "base": (dpo, base)}[target]
    before = {folder: tree_digest(folder) for folder in (base, sft, dpo)}
    siblings = sorted(tmp_path.iterdir())
    forbid_model_load()

    code, err = export(capsys, "--model", str(base), "--adapter", str(adapter), "--export-dir", str(export_dir),
                       "--force")

    assert {folder: tree_digest(folder) for folder in (base, sft, dpo)} == before
    assert code == 2, err
    line = error_line(err)
    source = base if target == "base" else export_dir.resolve()
    assert f"export_dir {export_dir} is " in line and str(source) in line and "--export-dir" in line
    assert sorted(tmp_path.iterdir()) == siblings


@pytest.mark.parametrize("fault", ["truncated adapter weights", "no adapter weights", "adapter config not JSON",
                                   "disk full while writing", "a rename fails while moving in"])
def test_a_failing_export_leaves_the_earlier_export_intact(base, tmp_path, capsys, save_perturbed_adapter,
                                                           monkeypatch, fault):
    adapter, merged = tmp_path / "sft", tmp_path / "merged"
    save_perturbed_adapter(base, adapter)
    code, err = export(capsys, "--model", str(base), "--export-dir", str(merged))  # the base alone
    assert code == 0, err
    before, siblings = tree_digest(merged), sorted(tmp_path.iterdir())
    weights = adapter / "adapter_model.safetensors"
    if fault == "truncated adapter weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif fault == "no adapter weights":
        weights.unlink()
    elif fault == "adapter config not JSON":
        (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", ')
    elif fault == "a rename fails while moving in":
        # Late: the old files are set aside and the new weights are in (the files move in name order).
        real_replace, failed = os.replace, []

        def replace(src, dst):
            if Path(dst) == merged / "tokenizer.json" and not failed:  # once: putting the old one back works
                failed.append(dst)
                raise OSError(errno.EIO, "Input/output error")
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
    else:
        # The tokenizer is saved after the weights: the build stops with a model half written.
        import alignkit.export as export_module

        real_load_tokenizer = export_module.load_tokenizer

        def no_space(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        def tokenizer_on_a_full_disk(model_args):
            tokenizer = real_load_tokenizer(model_args)
            tokenizer.save_pretrained = no_space
            return tokenizer

        monkeypatch.setattr(export_module, "load_tokenizer", tokenizer_on_a_full_disk)

    code, err = export(capsys, "--model", str(base), "--adapter", str(adapter), "--export-dir", str(merged), "--force")

    assert tree_digest(merged) == before
    assert sorted(tmp_path.iterdir()) == siblings  # no temp folder left
    assert code == 2, err
    named = str(adapter) if "adapter" in fault else str(merged)
    assert named in error_line(err)


def test_a_forced_export_over_an_earlier_one_leaves_no_stale_model_files(base, tmp_path, capsys,
                                                                         save_perturbed_adapter):
    from transformers import AutoModelForCausalLM

    first, second, merged = tmp_path / "first", tmp_path / "second", tmp_path / "merged"
    save_perturbed_adapter(base, first, seed=1)
    trained = save_perturbed_adapter(base, second, seed=2)
    code, err = export(capsys, "--model", str(base), "--adapter", str(first), "--export-dir", str(merged))
    assert code == 0, err
    # What a training run into the same folder would add, which `from_pretrained` would mix in: an adapter (it
    # would load the folder as one) and the shards of a sharded save (read instead of model.safetensors).
    shutil.copy(first / "adapter_config.json", merged)
    shutil.copy(first / "adapter_model.safetensors", merged)
    shutil.copy(merged / "model.safetensors", merged / "model-00001-of-00002.safetensors")
    (merged / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (merged / "notes.txt").write_text("keep me")
    siblings = sorted(tmp_path.iterdir())

    code, err = export(capsys, "--model", str(base), "--adapter", str(second), "--export-dir", str(merged), "--force")

    assert code == 0, err
    assert sorted(p.name for p in merged.iterdir()) == ["chat_template.jinja", "config.json", "generation_config.json",
                                                         "model.safetensors", "notes.txt", "tokenizer.json",
                                                         "tokenizer_config.json"]
    assert (merged / "notes.txt").read_text() == "keep me"
    assert sorted(tmp_path.iterdir()) == siblings
    input_ids = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(merged)(input_ids=input_ids).logits,
                                   trained(input_ids=input_ids).logits, atol=1e-5, rtol=0)
