"""The benchmark's run building, by hand, without running anything: which runs the plan holds, what each tool is
told for the online stages, the precision a run is measured in and the CPU features the report states; and which
precisions the decode dtype probe times (one real step of its fp32 products)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `bench/` is a folder of the checkout, not part of the installed package
    sys.path.insert(0, str(ROOT))

from bench import run as bench_run  # noqa: E402
from bench import worker  # noqa: E402


def fig(v):
    return {"median": v, "min": v, "max": v, "n": 1}


def test_online_stage_settings_give_both_tools_the_same_completions():
    """--batch 8, --num-generations 4, length 32: GRPO and RLOO 8 completions of 4 per prompt in both tools;
    distill one completion per prompt, the teacher the model itself; online DPO 4 prompts x 2 answers."""
    opts = SimpleNamespace(stage="rloo", batch=8, num_generations=4, max_completion_length=32, cutoff=256,
                           model_dir="/m")
    assert worker.alignkit_stage_settings(opts) == {"reward_funcs": "bench.workloads:bench_reward",
                                                    "num_generations": 4, "max_completion_length": 32}
    assert worker.trl_stage_settings(opts) == {"num_generations": 4, "max_completion_length": 32}
    opts.stage = "distill"
    assert worker.alignkit_stage_settings(opts) == {"teacher_model_name_or_path": "/m", "max_completion_length": 32}
    assert worker.trl_stage_settings(opts) == {"max_completion_length": 32}
    opts.stage = "online_dpo"
    assert worker.alignkit_stage_settings(opts)["per_device_train_batch_size"] == 4
    assert worker.trl_stage_settings(opts) == {"max_new_tokens": 32, "per_device_train_batch_size": 4}
    opts.stage = "sft"
    assert worker.alignkit_stage_settings(opts) == {} and worker.trl_stage_settings(opts) == {"max_length": 256}
    assert [worker.completions_per_prompt(s, 4) for s in worker.ONLINE_STAGES] == [4, 4, 1, 2, 4]
    assert {s: bench_run.data_kind(s) for s in worker.ONLINE_STAGES} == {
        "grpo": "prompt", "rloo": "prompt", "distill": "distill_prompt", "online_dpo": "online_dpo_prompt",
        "grpo_tools": "tool_prompt"}


def test_alignkit_keys_of_the_online_stages_parse():
    """What the worker passes alignkit is accepted by its config parser (no unknown key), QLoRA keys included."""
    from alignkit.config.parse import parse_config

    opts = SimpleNamespace(batch=8, num_generations=4, max_completion_length=32, cutoff=256, model_dir="/m")
    for stage in ("rloo", "distill", "online_dpo"):
        opts.stage = stage
        config = parse_config({"stage": stage, **worker.alignkit_stage_settings(opts)})
        assert config.finetuning.stage == stage
    assert parse_config({"stage": "sft", **worker.QLORA}).model.quantization_bit == 4


def test_run_precision_from_autocast_and_frozen_weights():
    """Autocast -> bf16; no autocast: the dtype holding most frozen elements decides (a 4-bit base is uint8 -> fp32)."""
    assert worker.run_precision(True, {"float32": 10}) == "bf16"
    assert worker.run_precision(False, {"bfloat16": 900, "float32": 100}) == "bf16"
    assert worker.run_precision(False, {"uint8": 500, "float32": 300}) == "fp32"
    assert worker.run_precision(False, {}) == "fp32"


def test_cpu_features_name_the_bf16_support():
    text = ("processor : 0\nmodel name : Intel Xeon Platinum\nflags : fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
            "processor : 1\nmodel name : Intel Xeon Platinum\nflags : fpu\n")
    got = bench_run.cpu_features(text)
    assert got["cpu"] == "Intel Xeon Platinum" and got["native_bf16"] == "AMX" and all(got["flags"].values())
    epyc = bench_run.cpu_features("model name : AMD EPYC\nflags : avx2 avx512f avx512_bf16\n")
    assert epyc["native_bf16"] == "AVX512-BF16" and epyc["flags"]["amx_bf16"] is False
    assert bench_run.cpu_features("model name : old\nflags : avx2\n")["native_bf16"] == "none"


def test_plan_adds_trl_real_default_on_cpu_and_qlora_only_for_sft(monkeypatch):
    monkeypatch.setattr(bench_run, "native_bf16", lambda: "AVX512-BF16")
    opts = bench_run.parse_args(["--stage", "sft", "rloo"])
    assert opts.variants == ["alignkit", "trl_default", "trl_default_bf16", "trl_best"] and opts.left_out == {}
    # Without bf16 hardware TRL's bf16 default cannot finish a step in time: left out by default, and said why.
    monkeypatch.setattr(bench_run, "native_bf16", lambda: "none")
    opts = bench_run.parse_args(["--stage", "sft"])
    assert opts.variants == ["alignkit", "trl_default", "trl_best"]
    assert opts.left_out == {"trl_default_bf16": bench_run.NO_BF16_HARDWARE}
    assert bench_run.parse_args(["--variants", "alignkit,trl_default_bf16"]).variants == ["alignkit",
                                                                                           "trl_default_bf16"]
    assert bench_run.parse_args(["--device", "cuda"]).variants == ["alignkit", "trl_default", "trl_best"]
    opts = bench_run.parse_args(["--stage", "sft", "rloo", "--variants", "alignkit,alignkit_qlora,trl_default_bf16",
                                 "--reps", "1"])
    plan = bench_run.plan_runs(opts, ["sft", "rloo"], {"sft": True, "rloo": True})
    assert plan == [("sft", 0, "alignkit"), ("sft", 0, "alignkit_qlora"), ("sft", 0, "trl_default_bf16"),
                    ("rloo", 0, "alignkit"), ("rloo", 0, "trl_default_bf16")]
    assert bench_run.tool_of("alignkit_qlora") == "alignkit" and bench_run.tool_of("trl_default_bf16") == "trl"
    # alignkit's own bf16 key: its default, auto, unless asked; the worker passes the value through to its config.
    assert opts.alignkit_bf16 == "auto"
    assert bench_run.parse_args(["--alignkit-bf16", "false"]).alignkit_bf16 == "false"
    assert worker.parse_args(["--tool", "alignkit", "--stage", "sft", "--model-dir", "m", "--alignkit-dataset", "d",
                              "--alignkit-bf16", "true"]).alignkit_bf16 == "true"


def test_alignkit_extra_keys_reach_only_alignkit_runs(capsys):
    """`--alignkit-extra` must be KEY=VALUE; it is an alignkit-only option (TRL's runs keep their settings)."""
    opts = bench_run.parse_args(["--stage", "sft", "--alignkit-extra", "gradient_checkpointing=true",
                                 "neftune_noise_alpha=5"])
    assert opts.alignkit_extra == ["gradient_checkpointing=true", "neftune_noise_alpha=5"]
    assert bench_run.parse_args([]).alignkit_extra == []
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--alignkit-extra", "gradient_checkpointing"])
    assert "gradient_checkpointing is not KEY=VALUE" in capsys.readouterr().err
    assert worker._parse_extra(opts.alignkit_extra) == {"gradient_checkpointing": True, "neftune_noise_alpha": 5}


def test_online_batch_must_hold_whole_groups(capsys):
    """Online DPO samples 2 answers per prompt: --batch 5 cannot be cut into pairs; --batch 4 plans."""
    with pytest.raises(SystemExit, match="multiple of 2 for stage online_dpo"):
        bench_run.main(["--stage", "online_dpo", "--batch", "5", "--dry-run"])
    assert bench_run.main(["--stage", "distill", "--batch", "5", "--dry-run"]) == 0
    capsys.readouterr()


def test_mfu_against_the_probe_of_the_run_precision_and_qlora_ratio():
    """N = 1000, LoRA 4N = 4000 FLOPs/token. fp32 run at 1e5 tokens/s = 0.4 GFLOP/s: MFU 0.4 of a 1 GFLOP/s fp32
    probe; bf16 run at the same rate: 0.1 of a 4 GFLOP/s bf16 probe. QLoRA at 5e4 tokens/s: 0.5x alignkit's."""
    def run(variant, precision, rate, rss):
        return {"variant_key": variant, "ok": True, "precision": precision, "tokens_per_s": rate,
                "step_time_s": 1.0, "peak_rss_mb": rss, "tokens_per_step": [10]}

    runs = [run("alignkit", "fp32", 1e5, 1000.0), run("trl_default_bf16", "bf16", 1e5, 1200.0),
            run("alignkit_qlora", "fp32", 5e4, 600.0)]
    out = bench_run.summarise_stage(runs, 1000, {"fp32": 1.0, "bf16": 4.0})
    assert out["summary"]["alignkit"]["mfu"]["median"] == pytest.approx(0.4)
    assert out["summary"]["trl_default_bf16"]["mfu"]["median"] == pytest.approx(0.1)
    assert out["summary"]["trl_default_bf16"]["precision"] == "bf16"
    assert out["ratios"]["alignkit_qlora/alignkit"]["tokens_per_s"] == pytest.approx(0.5)
    assert out["ratios"]["alignkit_qlora/alignkit"]["peak_rss_mb"] == pytest.approx(0.6)
    assert out["ratios"]["alignkit/trl_default_bf16"]["peak_rss_mb"] == pytest.approx(1000 / 1200)


def test_rloo_and_distill_targets_include_trl_real_default():
    """RLOO 2.4 completions/s vs TRL default 1.0 (2.4 >= 2 met) and its bf16 default 1.5 (1.6 < 2 not met)."""
    stages = {"rloo": {"summary": {"alignkit": {"completions_per_s": fig(2.4), "peak_rss_mb": fig(900.0)},
                                   "trl_default": {"completions_per_s": fig(1.0), "peak_rss_mb": fig(1000.0)},
                                   "trl_default_bf16": {"completions_per_s": fig(1.5), "peak_rss_mb": fig(800.0)}}}}
    got = {t["target"]: t["met"] for t in bench_run.check_targets(stages, variants=["alignkit", "trl_default"])}
    assert got["completions_per_s alignkit/trl_default >= 2.0"] is True
    assert got["completions_per_s alignkit/trl_default_bf16 >= 2.0"] is False
    assert got["peak_rss_mb alignkit/trl_default_bf16 <= 1.0"] is False
    assert got["completions_per_s alignkit/trl_best >= 1.0"] is None
    assert {t[0] for t in bench_run.TARGETS if t[1] == "completions_per_s"} == {"grpo", "rloo", "distill"}


def test_online_sweep_grid_and_worker_arguments():
    """Lengths (32, 64), generations (4, 8), 2 prompts: grpo (32, 4) on both axes, (64, 4) and (32, 8); 8, 8 and 16
    completions per step. GRPO's --batch counts completions with G per prompt; PPO's counts prompts."""
    from bench import sweep_online

    grid = sweep_online.online_points((32, 64), (4, 8), 2, ["grpo", "ppo"])
    grpo = {(p["length"], p["generations"]): p for p in grid if p["stage"] == "grpo"}
    assert set(grpo) == {(32, 4), (64, 4), (32, 8)} and len(grid) == 6
    assert grpo[(32, 4)]["axes"] == ["length", "generations"]
    assert [grpo[k]["completions"] for k in ((32, 4), (64, 4), (32, 8))] == [8, 8, 16]
    assert sweep_online.worker_args(grpo[(32, 8)]) == ["--batch", "16", "--max-completion-length", "32",
                                                       "--num-generations", "8"]
    ppo = next(p for p in grid if p["stage"] == "ppo" and p["generations"] == 8)
    assert sweep_online.worker_args(ppo) == ["--batch", "16", "--max-completion-length", "32"]
    assert sweep_online.variants_for("ppo", ["alignkit", "trl_best"]) == ["alignkit"]


def test_online_sweep_counts_generated_tokens_and_fits_lines():
    """GRPO: steps 3, 1 timed, generated [50, 60, 70] -> 70 per measured step. PPO: mean length 12.5 x 8 = 100.
    Three points at 1k, 2k, 3k generated tokens taking 3, 5, 7 s: 1 s + 2 s per 1k tokens, no residual."""
    from bench import sweep_online

    assert sweep_online.generated_per_step({"steps": 3, "measured_steps": 1,
                                            "generated_tokens_per_step": [50, 60, 70]}, 8) == 70
    assert sweep_online.generated_per_step({"steps": 2, "measured_steps": 1, "response_length_mean": 12.5}, 8) == 100
    settings = {"stages": ["grpo"], "variants": ["alignkit"], "lengths": [32, 64, 128], "generations": [4],
                "prompts": 2, "model": "tiny", "steps": 2, "warmup": 1, "threads": 2}
    runs = {f"grpo L{length} G4 alignkit": {"ok": True, "stage": "grpo", "variant": "alignkit", "length": length,
                                            "generations": 4, "step_time_s": t, "peak_rss_mb": 500 + t,
                                            "generation_s": t / 2, "training_s": t / 2,
                                            "generated_tokens_per_measured_step": tokens}
            for length, t, tokens in ((32, 3.0, 1000), (64, 5.0, 2000), (128, 7.0, 3000))}
    report = {"settings": settings, "runs": runs, "command": "c", "date": "d", "complete": True,
              "versions": {"trl": "1.16.0", "transformers": "t", "torch": "t"},
              "machine": {"cpu": "cpu", "cores": 2},
              "grid": sweep_online.online_points((32, 64, 128), (4,), 2, ["grpo"])}
    report["fits"] = sweep_online.online_fits(report)
    fit = report["fits"]["grpo alignkit length"]["step_time_s"]
    assert fit["intercept"] == pytest.approx(1.0) and fit["slope"] == pytest.approx(2.0)
    assert fit["max_relative_residual"] == pytest.approx(0.0, abs=1e-9)
    markdown = sweep_online.render_online_sweep(report)
    assert "| grpo | length+generations | 32 | 4 | 8 | alignkit | 3.00 | 1.50 | 1.50 | 1000 | 503 |" in markdown
    assert "1.0 s + 2.00 s per 1k tokens" in markdown


def test_sweep_of_online_stages_takes_its_own_defaults():
    opts = bench_run.parse_args(["--sweep", "--stage", "grpo", "ppo"])
    assert (opts.sweep_lengths, opts.sweep_generations, opts.sweep_prompts) == ((32, 64, 128, 256, 512), (4, 8, 16), 2)
    assert opts.sweep_name == "sweep_online" and opts.variants == ["alignkit", "trl_best"]
    assert bench_run.parse_args(["--sweep"]).sweep_name == "sweep"
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--sweep", "--stage", "grpo", "sft"])


def test_decode_dtype_probe_skips_bf16_where_onednn_cannot_pack_it(monkeypatch, capsys):
    """On a CPU without oneDNN bf16 packing (AVX2 only) the probe times fp32 alone and says why bf16 is missing,
    instead of dying in oneDNN's weight reorder; with it, both precisions are timed."""
    import json

    import torch

    import alignkit.env
    from bench import decode_dtype_probe as probe

    # The probe sets the thread count and OMP_NUM_THREADS: keep this process's as they are.
    threads = str(torch.get_num_threads())
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", threads))
    timed = []
    monkeypatch.setattr(probe, "step_seconds", lambda dtype, rows, steps: timed.append((str(dtype), rows)) or 0.5)
    monkeypatch.setattr(alignkit.env, "onednn_supports_bf16", lambda: False)
    assert probe.main(["--rows", "4", "--steps", "1", "--threads", threads]) == 0
    result = json.loads(capsys.readouterr().out)
    assert timed == [("torch.float32", 4)]
    assert result["fp32_s"] == 0.5 and result["bf16_s"] is None and "AVX512" in result["bf16_skipped"]

    timed.clear()
    monkeypatch.setattr(alignkit.env, "onednn_supports_bf16", lambda: True)
    assert probe.main(["--rows", "4", "--steps", "1", "--threads", threads]) == 0
    result = json.loads(capsys.readouterr().out)
    assert timed == [("torch.float32", 4), ("torch.bfloat16", 4)]
    assert result["bf16_s"] == 0.5 and "bf16_skipped" not in result


def test_decode_dtype_probe_times_the_packed_fp32_products():
    """One real step of the 211 packed products (fp32 works on every CPU with oneDNN): a positive time."""
    import torch

    from bench import decode_dtype_probe as probe

    assert probe.step_seconds(torch.float32, rows=2, steps=1) > 0
