"""The LLaMA-Factory peer of the benchmark, without its environment: nothing here installs or imports it.

What is checked: the translation of a benchmark run into LLaMA-Factory's arguments, the install recipe's
filtering of its requirements and the torchaudio workaround on a fake tree, the stamp that makes the install
happen once, and the plan (`--dry-run`) and targets that `--peer llamafactory` adds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench/` is a folder of the checkout, not part of the installed package
    sys.path.insert(0, str(ROOT))

from bench import llamafactory as lf  # noqa: E402
from bench import run as bench_run  # noqa: E402


def _config(stage: str, **overrides):
    kwargs = dict(model_dir="/m", dataset="bench_sft", dataset_dir="/d", output_dir="/o", batch=8, steps=6,
                  lr=1e-4, cutoff=256)
    kwargs.update(overrides)
    return lf.lf_config(stage, **kwargs)


def test_lf_config_matches_the_alignkit_run_settings():
    """The keys alignkit's run sets (bench/worker.py run_alignkit) appear with the same values."""
    config = _config("sft")
    expected = {"stage": "sft", "do_train": True, "model_name_or_path": "/m", "finetuning_type": "lora",
                "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target": "all", "dataset": "bench_sft",
                "dataset_dir": "/d", "cutoff_len": 256, "per_device_train_batch_size": 8,
                "gradient_accumulation_steps": 1, "max_steps": 6, "learning_rate": 1e-4, "warmup_steps": 0,
                "seed": 42, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
                "dataloader_num_workers": 0, "bf16": False, "fp16": False, "use_cpu": True,
                "template": "smollm2", "disable_gradient_checkpointing": True, "lr_scheduler_type": "linear"}
    assert {k: config[k] for k in expected} == expected
    assert "pref_beta" not in config and "reward_model" not in config


def test_lf_config_per_stage_keys_and_cuda():
    dpo = _config("dpo", dataset="bench_pref")
    assert (dpo["stage"], dpo["pref_beta"], dpo["pref_loss"]) == ("dpo", 0.1, "sigmoid")
    assert _config("rm")["stage"] == "rm"
    ppo = _config("ppo")
    assert ppo["reward_model"] == "/m" and ppo["reward_model_type"] == "full"
    cuda = _config("sft", device="cuda")
    assert cuda["bf16"] is True and "use_cpu" not in cuda
    with pytest.raises(ValueError, match="grpo"):
        _config("grpo")


def test_requirement_filtering_leaves_out_torchvision_torchaudio_and_extras():
    """llamafactory's metadata: torchvision, torchaudio and extra-only entries go; version ranges stay as written."""
    requires = ["transformers!=4.52.0,<=5.6.0,>=4.55.0", "torchvision>=0.15", "torchaudio", "Torch_Data<=0.11.0",
                "deepspeed<=0.16.9,>=0.10.0; extra == \"deepspeed\"", "trl<=0.24.0,>=0.18.0",
                "av; python_version >= \"3.9\""]
    assert lf.requirement_name("Torch_Data<=0.11.0") == "torch-data"
    assert lf.requirement_name("trl[peft] >= 0.18") == "trl"
    assert lf.core_requirements(requires) == ["transformers!=4.52.0,<=5.6.0,>=4.55.0", "Torch_Data<=0.11.0",
                                              "trl<=0.24.0,>=0.18.0", "av; python_version >= \"3.9\""]


def test_install_commands_pin_torch_before_llamafactory_without_deps(tmp_path):
    python = tmp_path / "bin" / "python"
    cmds = lf.install_commands(python)
    flat = [" ".join(c) for c in cmds]
    torch_step = next(i for i, c in enumerate(flat) if c.endswith(lf.TORCH_PIN))
    lf_step = next(i for i, c in enumerate(flat) if f"llamafactory=={lf.LF_VERSION}" in c)
    assert torch_step < lf_step and "--no-deps" in cmds[lf_step]
    assert all(c[0] == str(python) for c in cmds)


def test_move_torchaudio_libs_on_a_fake_tree(tmp_path):
    lib = tmp_path / "lib" / "python3.11" / "site-packages" / "torchaudio" / "lib"
    lib.mkdir(parents=True)
    (lib / "libtorchaudio.so").write_bytes(b"x")
    (lib / "_torchaudio.so").write_bytes(b"y")
    (lib / "__init__.py").write_text("")
    assert lf.move_torchaudio_libs(tmp_path) == ["_torchaudio.so", "libtorchaudio.so"]
    assert sorted(p.name for p in lib.iterdir()) == ["__init__.py"]
    assert sorted(p.name for p in (lib.parent / "lib.moved-aside").iterdir()) == ["_torchaudio.so",
                                                                                  "libtorchaudio.so"]


def test_ensure_venv_returns_a_matching_stamp_without_running_anything(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    stamp = {"recipe": lf.recipe_hash(), "python": str(tmp_path / "bin" / "python"), "versions": {"trl": "0.24.0"}}
    (tmp_path / lf.STAMP).write_text(json.dumps(stamp))

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"ensure_venv ran {args[0]} although the stamp matches")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert lf.ensure_venv(tmp_path) == stamp
    # A stamp from another recipe means a reinstall, which would run pip: here it reaches the guard.
    (tmp_path / lf.STAMP).write_text(json.dumps({**stamp, "recipe": "older"}))
    with pytest.raises(AssertionError, match="stamp matches"):
        lf.ensure_venv(tmp_path, log=lambda line: None)


def test_default_peer_is_trl_and_peer_llamafactory_adds_its_runs(monkeypatch):
    """On a CPU with bf16 hardware the TRL peer runs its defaults in fp32 and its real default, bf16=True
    (trl_default_bf16); without it, tests/cli/test_bench_config.py."""
    monkeypatch.setattr(bench_run, "native_bf16", lambda: "AVX512-BF16")
    assert bench_run.parse_args([]).variants == ["alignkit", "trl_default", "trl_default_bf16", "trl_best"]
    assert bench_run.parse_args(["--peer", "llamafactory"]).variants == ["alignkit", "llamafactory"]
    both = bench_run.parse_args(["--peer", "trl", "llamafactory"]).variants
    assert both == ["alignkit", "trl_default", "trl_default_bf16", "trl_best", "llamafactory"]


def test_dry_run_lists_llamafactory_runs_without_installing(tmp_path, monkeypatch, capsys):
    """sft, dpo and ppo alternate alignkit / LLaMA-Factory per repetition (ppo: LLaMA-Factory's attempt); grpo has
    no LLaMA-Factory run."""
    venv = tmp_path / "lf-venv"
    monkeypatch.setenv("ALIGNKIT_LF_VENV", str(venv))
    assert bench_run.main(["--peer", "llamafactory", "--stage", "sft", "dpo", "ppo", "grpo", "--reps", "2",
                           "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    runs = [tuple(r) for r in plan["runs"]]
    assert runs[:4] == [("sft", 0, "alignkit"), ("sft", 0, "llamafactory"), ("sft", 1, "alignkit"),
                        ("sft", 1, "llamafactory")]
    assert [r for r in runs if r[0] == "ppo"] == [("ppo", 0, "alignkit"), ("ppo", 0, "llamafactory"),
                                                  ("ppo", 1, "alignkit"), ("ppo", 1, "llamafactory")]
    assert {r[2] for r in runs if r[0] == "grpo"} == {"alignkit"}
    info = plan["llamafactory"]
    assert info["venv"] == str(venv) and info["installed"] is False and not venv.exists()
    assert set(info["configs"]) == {"sft", "dpo", "ppo"}
    assert info["configs"]["dpo"]["dataset"] == "bench_pref" and info["configs"]["sft"]["template"] == "smollm2"
    assert "ppo" in info["settings_that_differ"]
    # Without --stage: the stages LLaMA-Factory has (no grpo); with the TRL peer, as before.
    assert bench_run.main(["--peer", "llamafactory", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"] == ["sft", "rm", "dpo", "ppo"]
    assert bench_run.main(["--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"] == ["sft", "rm", "dpo", "grpo"]


def test_llamafactory_targets_only_when_it_runs():
    """SFT tokens/s 150 vs LLaMA-Factory 100: 1.5 >= 1.5 met; peak RSS 3000 vs 2900 MB: 1.03 > 1.0 not met."""
    def fig(v):
        return {"median": v, "min": v, "max": v, "n": 1}

    stages = {"sft": {"summary": {"alignkit": {"tokens_per_s": fig(150.0), "peak_rss_mb": fig(3000.0)},
                                  "llamafactory": {"tokens_per_s": fig(100.0), "peak_rss_mb": fig(2900.0)}}}}
    with_lf = {t["target"]: t["met"] for t in bench_run.check_targets(stages, variants=["alignkit", "llamafactory"])}
    assert with_lf["tokens_per_s alignkit/llamafactory >= 1.5"] is True
    assert with_lf["peak_rss_mb alignkit/llamafactory <= 1.0"] is False
    without = [t["target"] for t in bench_run.check_targets(stages, variants=["alignkit", "trl_default"])]
    assert not any("llamafactory" in t for t in without)
    lf_only = [t["target"] for t in bench_run.check_targets(stages, variants=["alignkit", "llamafactory"])]
    assert not any("trl" in t for t in lf_only)
    assert {t[0] for t in bench_run.TARGETS if t[2] == "llamafactory"} == {"sft", "rm", "dpo", "ppo"}


@pytest.mark.slow
def test_llamafactory_end_to_end_on_tiny_model_when_installed(tmp_path):
    """Only where `python -m bench --peer llamafactory` has already built the environment (never installs):
    on the same data and seed, LLaMA-Factory consumes the same tokens per step as alignkit and starts from
    the same loss; its PPO attempt fails with the recorded trl version error."""
    venv = lf.default_venv_dir()
    stamp = lf.read_stamp(venv)
    if not stamp or stamp.get("recipe") != lf.recipe_hash():
        pytest.skip(f"no LLaMA-Factory environment at {venv}; `python -m bench --peer llamafactory` creates it.")
    out_dir = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench", "--model", "tiny", "--peer", "llamafactory", "--stage", "sft", "rm", "dpo",
           "ppo", "--reps", "1", "--steps", "2", "--warmup", "1", "--batch", "2", "--cutoff", "96", "--matmul-size",
           "256", "--matmul-seconds", "0.2", "--output-dir", str(out_dir), "--name", "lf", "--work-dir",
           str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]  # 1: the PPO attempt failed, everything else ran
    report = json.loads((out_dir / "lf.json").read_text())
    assert report["llamafactory"]["versions"]["llamafactory"] == lf.LF_VERSION
    for stage in ("sft", "rm", "dpo"):
        runs = {r["variant_key"]: r for r in report["stages"][stage]["runs"]}
        assert runs["alignkit"]["ok"] and runs["llamafactory"]["ok"], runs["llamafactory"].get("error")
        assert runs["llamafactory"]["tokens_per_step"] == runs["alignkit"]["tokens_per_step"], stage
        effective = runs["llamafactory"]["settings"]["effective"]
        assert effective["gradient_checkpointing"] is False and effective["per_device_train_batch_size"] == 2
        if stage != "rm":  # rm: value head vs score head, different random heads
            assert runs["llamafactory"]["first_loss"] == pytest.approx(runs["alignkit"]["first_loss"], rel=1e-3)
    ppo = {r["variant_key"]: r for r in report["stages"]["ppo"]["runs"]}
    assert ppo["alignkit"]["ok"], ppo["alignkit"].get("error")
    assert not ppo["llamafactory"]["ok"] and "trl>=0.8.6,<=0.9.6" in ppo["llamafactory"]["error"]
    assert "| llamafactory | failed:" in (out_dir / "lf.md").read_text()
