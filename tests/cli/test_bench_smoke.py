"""The benchmark harness (`python -m bench`): its bookkeeping by hand, and one end-to-end run on the tiny model.

Times are never asserted: the end-to-end test checks that the JSON and Markdown reports carry every field
docs/performance.md and the lead's comparison rely on.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# The benchmark's own default is 2 torch threads a process; here a second test runs beside each one (one xdist
# worker per core), and a second OpenMP thread on a tiny model's products takes CPU from it (this file: 254 CPU s
# with 2 threads, 238 with 1, 2-core AVX2 AMD EPYC, 2026-12-03).
ONE_THREAD = ("--threads", "1")
if str(ROOT) not in sys.path:  # `bench/` is a folder of the checkout, not part of the installed package
    sys.path.insert(0, str(ROOT))

from bench import run as bench_run  # noqa: E402
from bench import workloads  # noqa: E402
from bench.worker import StepRecorder, count_computed_tokens, count_real_tokens, per_step, summarise  # noqa: E402


def test_count_real_tokens_sums_every_attention_mask():
    """Masks [[1,1,0],[1,0,0]] hold 3 real tokens; a second `rejected_attention_mask` [[1,1,1]] adds 3: 6.
    A padding-free batch (no mask) counts its input_ids: 1 x 5 = 5."""
    batch = {"input_ids": torch.zeros(2, 3), "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
             "rejected_attention_mask": torch.tensor([[1, 1, 1]])}
    assert count_real_tokens(batch) == 6
    assert count_real_tokens({"input_ids": torch.zeros(1, 5), "position_ids": torch.zeros(1, 5)}) == 5
    with pytest.raises(KeyError, match="no attention mask"):
        count_real_tokens({"labels": torch.zeros(2)})


def test_count_computed_tokens_counts_a_shared_prefix_once():
    """A pair [7 8 9 4], [7 8 5] (right-padded) shares [7 8]: 7 real tokens, 5 run. The mismatched (`kl_`) rows
    [7 1], [3 3] are a forward of their own: 4 real, 4 run (they share nothing). 9 in all."""
    batch = {"input_ids": torch.tensor([[7, 8, 9, 4], [7, 8, 5, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
             "kl_input_ids": torch.tensor([[7, 1], [3, 3]]), "kl_attention_mask": torch.ones(2, 2, dtype=torch.long)}
    assert count_real_tokens(batch) == 11
    assert count_computed_tokens(batch) == 9


def test_summarise_leaves_out_warmup_steps():
    """Begin at t=0, steps end at 10, 12, 15, 19: durations 10, 2, 3, 4. With warmup 2 the measured steps
    are the last two: (3 + 4) / 2 = 3.5 s per step; their tokens 30 + 40 = 70 over 7 s = 10 tokens/s."""
    recorder = StepRecorder()
    recorder.train_begin, recorder.step_ends = 0.0, [10.0, 12.0, 15.0, 19.0]
    recorder.batch_tokens = [100, 20, 30, 40, 999]  # a prefetched batch beyond the last step is ignored
    history = [{"loss": 2.0}, {"loss": 1.5}, {"train_runtime": 19.0}]
    out = summarise(recorder, history, warmup=2)
    assert out["measured_steps"] == 2
    assert out["step_time_s"] == pytest.approx(3.5)
    assert out["tokens_per_s"] == pytest.approx(10.0)
    assert out["computed_tokens_per_s"] == pytest.approx(10.0)  # nothing shared: the same tokens
    assert (out["first_loss"], out["final_loss"]) == (2.0, 1.5)
    recorder.computed_tokens = [100, 20, 15, 20]  # half of the measured steps' tokens ran (shared prefixes)
    assert summarise(recorder, history, warmup=2)["computed_tokens_per_s"] == pytest.approx(5.0)


def test_summarise_sums_the_micro_batches_of_each_step():
    """Gradient accumulation 2: batches [10, 20 | 30, 40 | 50, 60] are steps of 30, 70, 110 tokens; steps end at
    1, 3, 6 s, so with warmup 1 the measured steps ran 180 tokens in 5 s = 36 tokens/s (one batch a step would
    count 20 + 30 = 50 tokens)."""
    assert per_step([3, 4, 5, None, 6], 2) == [7, None]
    recorder = StepRecorder()
    recorder.train_begin, recorder.step_ends = 0.0, [1.0, 3.0, 6.0]
    recorder.batch_tokens, recorder.batches_per_step = [10, 20, 30, 40, 50, 60], 2
    out = summarise(recorder, [{"loss": 1.0}], warmup=1)
    assert out["tokens_per_step"] == [30, 70, 110]
    assert out["tokens_per_s"] == pytest.approx(36.0)


def test_flops_per_token_formula():
    """N = 1000: LoRA 4N = 4000; full 6N = 6000; LoRA with a reference forward 4N + 2N = 6000."""
    assert workloads.flops_per_token(1000, lora=True, reference_forward=False)[0] == 4000
    assert workloads.flops_per_token(1000, lora=False, reference_forward=False)[0] == 6000
    flops, text = workloads.flops_per_token(1000, lora=True, reference_forward=True)
    assert flops == 6000 and "reference" in text


def test_matmul_params_counts_linear_layers_and_head(tiny_model_dir):
    """Tiny model: hidden 64, intermediate 128, 4 heads of 16, 2 KV heads, vocab V, 2 layers.
    Per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 + gate/up 2*64*128 + down 128*64 = 36864;
    2 layers = 73728; LM head 64*V; score head 64*1."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    assert workloads.matmul_params(tiny_model_dir, "causal_lm") == 73728 + 64 * vocab
    assert workloads.matmul_params(tiny_model_dir, "reward") == 73728 + 64


def test_generated_data_is_deterministic_and_fits_the_cutoff(tiny_tokenizer):
    rows = workloads.canonical_rows("pref", 6)
    assert rows == workloads.canonical_rows("pref", 6)
    fitted = workloads.fit_to_cutoff(tiny_tokenizer, rows, 120)
    for row in fitted:
        for key in ("chosen", "rejected"):
            assert workloads.chat_length(tiny_tokenizer, row, key) <= 120
    assert rows[0]["chosen"] != fitted[0]["chosen"] or workloads.chat_length(tiny_tokenizer, rows[0], "chosen") <= 120


def test_targets_met_and_not_met():
    """SFT tokens/s 150 vs TRL default 100: 1.5 >= 1.4 met; vs TRL best 200: 0.75 < 1.0 not met.
    DPO step time 7 vs 10: 0.7 <= 0.7 met."""
    def fig(v):
        return {"median": v, "min": v, "max": v, "n": 1}

    stages = {
        "sft": {"summary": {"alignkit": {"tokens_per_s": fig(150.0), "mfu": fig(0.5)},
                            "trl_default": {"tokens_per_s": fig(100.0)}, "trl_best": {"tokens_per_s": fig(200.0)}}},
        "dpo": {"summary": {"alignkit": {"step_time_s": fig(7.0), "peak_rss_mb": fig(1.0)},
                            "trl_default": {"step_time_s": fig(10.0), "peak_rss_mb": fig(1.0)}}},
    }
    got = {(t["stage"], t["target"]): t["met"] for t in bench_run.check_targets(stages)}
    assert got[("sft", "tokens_per_s alignkit/trl_default >= 1.4")] is True
    assert got[("sft", "tokens_per_s alignkit/trl_best >= 1.0")] is False
    assert got[("sft", "alignkit mfu >= 0.8 (share of the measured matmul throughput)")] is False
    assert got[("dpo", "step_time_s alignkit/trl_default <= 0.7")] is True
    assert got[("dpo", "step_time_s alignkit/trl_best <= 1.0")] is None  # no TRL best run


def test_cuda_mode_parses_and_plans_bf16(capsys):
    opts = bench_run.parse_args(["--device", "cuda", "--stage", "sft", "--stage", "dpo"])
    assert opts.device == "cuda" and opts.matmul_size == 8192 and opts.stage == ["sft", "dpo"]
    assert bench_run.main(["--device", "cuda", "--stage", "sft", "--dry-run", "--reps", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["bf16"] is True
    assert [r[2] for r in plan["runs"]] == ["alignkit", "trl_default", "trl_best"] * 2  # alternating
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--steps", "2", "--warmup", "2"])


def test_bench_end_to_end_on_tiny_model(tmp_path):
    """All three stages, alignkit and TRL's default, 2 steps (1 timed), one repetition."""
    out_dir = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench", *ONE_THREAD, "--model", "tiny", "--stage", "sft", "rm", "dpo", "--reps", "1",
           "--steps", "2", "--warmup", "1", "--batch", "2", "--cutoff", "96", "--variants", "alignkit,trl_default",
           "--matmul-size", "256", "--matmul-seconds", "0.2", "--output-dir", str(out_dir), "--name", "smoke",
           "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out_dir / "smoke.json").read_text())
    keys = {"date", "command", "machine", "versions", "model", "settings", "formula", "matmul", "targets"}
    assert keys <= set(report)
    assert report["machine"]["cores"] >= 1 and report["machine"]["cpu"]
    assert report["versions"]["trl"] == "1.16.0"
    assert report["matmul"]["probes_gflops"] and report["matmul"]["gflops"] == max(report["matmul"]["probes_gflops"])
    assert set(report["stages"]) == {"sft", "rm", "dpo"}
    # Every finished run was also recorded as it came, for a benchmark that dies before its report.
    recorded = [json.loads(line) for line in (tmp_path / "work" / "runs.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["variant_key"], r["step_times_s"]) for r in recorded] == [
        (r["stage"], r["variant_key"], r["step_times_s"]) for data in report["stages"].values() for r in data["runs"]]
    for stage, data in report["stages"].items():
        assert {r["variant_key"] for r in data["runs"]} == {"alignkit", "trl_default"}
        for run in data["runs"]:
            assert run["ok"], run.get("error")
            assert run["steps"] == 2 and run["measured_steps"] == 1
            assert run["threads"] == 1
            # Step 1 is warm-up: the figures are those of step 2 alone.
            assert run["step_time_s"] == pytest.approx(run["step_times_s"][1], abs=1e-4)
            assert run["tokens_per_s"] == pytest.approx(run["tokens_per_step"][1] / run["step_time_s"])
            # MFU counts the tokens the model ran: alignkit's rm and dpo run each pair's shared prompt once, and
            # every stage the system prompt its chats share.
            if run["variant_key"] == "alignkit":
                assert run["computed_tokens_per_s"] < (0.9 if stage in ("rm", "dpo") else 1.0) * run["tokens_per_s"]
            else:
                assert run["computed_tokens_per_s"] == pytest.approx(run["tokens_per_s"])
            assert run["mfu"] == pytest.approx(
                run["flops_per_token"] * run["computed_tokens_per_s"] / (report["matmul"]["gflops"] * 1e9))
            assert run["peak_rss_mb"] > 0 and math.isfinite(run["final_loss"])
        for variant in ("alignkit", "trl_default"):
            (run,) = [r for r in data["runs"] if r["variant_key"] == variant]
            for figure in ("step_time_s", "tokens_per_s", "peak_rss_mb", "final_loss", "mfu"):
                assert data["summary"][variant][figure]["median"] == run[figure], (stage, variant, figure)  # 1 rep
        summary = data["summary"]
        for figure, ratio in data["ratios"]["alignkit/trl_default"].items():
            # peak_gpu_mb is not measured on a CPU, the GRPO figures only for grpo
            if summary["alignkit"][figure] is None:
                assert ratio is None
            else:
                assert ratio == pytest.approx(summary["alignkit"][figure]["median"]
                                              / summary["trl_default"][figure]["median"]), (stage, figure)
    # Same data, same sampler seed: both tools see the same batches, so their token counts nearly agree
    # (templates may differ by a trailing newline token per sequence).
    sft = report["stages"]["sft"]["summary"]
    assert abs(sft["alignkit"]["tokens_per_step_mean"] - sft["trl_default"]["tokens_per_step_mean"]) <= 2 * 2
    # Every target of the stages run, except those against LLaMA-Factory, which this run did not plan.
    assert len(report["targets"]) == len([t for t in bench_run.TARGETS
                                          if t[0] in report["stages"] and t[2] != "llamafactory"])
    markdown = (out_dir / "smoke.md").read_text()
    for text in ("| stage | run | step time (s)", "alignkit/trl_default", "GFLOP/s", "4N", "not measured",
                 report["machine"]["cpu"]):
        assert text in markdown
    assert markdown in proc.stdout


def test_summarise_grpo_generation_split():
    """Steps of 10, 10 and 12 s (warm-up 1) with generation calls of 5, 6 and 8 s generating 40, 50 and 60 tokens,
    8 completions per step: measured steps 2-3 take 22 s → 16 / 22 = 0.727 completions/s; generation
    (6 + 8) / 2 = 7 s/step, training 11 - 7 = 4 s/step; (50 + 60) / 22 = 5 generated tokens/s. A batch of raw
    rows (no attention mask) leaves tokens/s uncounted."""
    recorder = StepRecorder()
    recorder.train_begin, recorder.step_ends = 0.0, [10.0, 20.0, 32.0]
    recorder.batch_tokens = [None, None, None]
    recorder.generation_s, recorder.generated_tokens = [5.0, 6.0, 8.0], [40, 50, 60]
    out = summarise(recorder, [{"loss": 0.0}], warmup=1, completions_per_step=8)
    assert out["completions_per_s"] == pytest.approx(16 / 22)
    assert out["generation_s"] == pytest.approx(7.0) and out["training_s"] == pytest.approx(4.0)
    assert out["generated_tokens_per_s"] == pytest.approx(5.0)
    assert out["tokens_per_s"] is None


def test_summarise_sums_a_tool_rollouts_turns_per_step():
    """A tool rollout samples once per turn: calls of 2 s (step 0), 3 + 1 s (step 1: a second turn) and 4 + 2 + 1 s
    (step 2) generating 10, 20 + 5 and 30 + 6 + 2 tokens. Steps end at 5, 10 and 20 (warm-up 1): generation per step
    (4 + 7) / 2 = 5.5 s, 25 + 38 = 63 tokens over 15 s; the log's tool calls per completion average (0.5 + 1.5) / 2."""
    recorder = StepRecorder()
    recorder.train_begin, recorder.step_ends = 0.0, [5.0, 10.0, 20.0]
    recorder.batch_tokens = [None, None, None]
    recorder.generation_s, recorder.generated_tokens = [2.0, 3.0, 1.0, 4.0, 2.0, 1.0], [10, 20, 5, 30, 6, 2]
    recorder.generation_steps = [0, 1, 1, 2, 2, 2]
    history = [{"loss": 0.0, "tools/call_frequency": 0.5, "tools/failure_frequency": 0.0},
               {"loss": 0.1, "tools/call_frequency": 1.5, "tools/failure_frequency": 0.5}]
    out = summarise(recorder, history, warmup=1, completions_per_step=4)
    assert out["generation_s_per_step"] == [2.0, 4.0, 7.0] and out["generated_tokens_per_step"] == [10, 25, 38]
    assert out["generation_s"] == pytest.approx(5.5) and out["training_s"] == pytest.approx(7.5 - 5.5)
    assert out["generated_tokens_per_s"] == pytest.approx(63 / 15) and out["completions_per_s"] == pytest.approx(8 / 15)
    assert out["generation_calls"] == 6
    assert out["tool_calls_per_completion"] == pytest.approx(1.0) and out["tool_failure_frequency"] == pytest.approx(0.25)
    recorder.generation_steps = [0, 0, 0, 0, 0, 0]  # no sampling in the measured steps: not a GRPO step
    with pytest.raises(RuntimeError, match="generation in every step"):
        summarise(recorder, history, warmup=1, completions_per_step=4)


def test_bench_grpo_tools_end_to_end_on_tiny_model(tmp_path):
    """GRPO with the calculator, alignkit and TRL's GRPOTrainer(tools=...), 2 steps (1 timed): both load the model
    with Qwen2.5's template, every sampling call (one per turn) is counted in its step, and the report carries the
    tool-call rates beside completions/s. (A random tiny model does not call; the turn accounting is checked above.)"""
    report, markdown = _online_bench(tmp_path, "grpo_tools")
    assert report["data"]["tool_prompt"]["rows"] == 4  # 8 completions / 2 per prompt
    data = report["stages"]["grpo_tools"]
    assert {r["variant_key"] for r in data["runs"]} == {"alignkit", "trl_default"}
    for run in data["runs"]:
        assert run["ok"], run.get("error")
        assert run["steps"] == 2 and len(run["generation_s_per_step"]) == 2 and run["generation_calls"] >= 2
        assert run["completions_per_s"] == pytest.approx(4 / run["step_time_s"])
        assert run["tool_calls_per_completion"] >= 0 and math.isfinite(run["final_loss"])
    (alignkit_run,) = [r for r in data["runs"] if r["variant_key"] == "alignkit"]
    assert alignkit_run["settings"]["stage"] == "grpo" and alignkit_run["settings"]["tools"].endswith(
        "examples/tools/calculator.py:calculate")
    assert data["ratios"]["alignkit/trl_default"]["completions_per_s"] > 0
    assert "GRPOTrainer(tools=...)" in markdown and "Tool calls per completion" in markdown


def _online_bench(tmp_path, stage: str) -> tuple[dict, str]:
    """`python -m bench` for one online stage on the tiny model, alignkit and TRL's default, 2 steps (1 timed), batch
    4 of 2 completions per prompt, at most 8 new tokens: the JSON report and the Markdown."""
    out_dir = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench", *ONE_THREAD, "--model", "tiny", "--stage", stage, "--reps", "1", "--steps", "2",
           "--warmup", "1", "--batch", "4", "--num-generations", "2", "--max-completion-length", "8",
           "--variants", "alignkit,trl_default", "--matmul-size", "256", "--matmul-seconds", "0.2",
           "--output-dir", str(out_dir), "--name", stage, "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out_dir / f"{stage}.json").read_text()), (out_dir / f"{stage}.md").read_text()


def test_bench_grpo_end_to_end_on_tiny_model(tmp_path):
    """GRPO, alignkit and TRL's default, 2 steps (1 timed): completions/s and the generation/training split."""
    report, markdown = _online_bench(tmp_path, "grpo")
    assert report["settings"]["num_generations"] == 2 and report["settings"]["max_completion_length"] == {"grpo": 8}
    data = report["stages"]["grpo"]
    for run in data["runs"]:
        assert run["ok"], run.get("error")
        assert run["steps"] == 2 and len(run["generation_s_per_step"]) == 2  # one generation per step
        assert 0 < run["generation_s"] < run["step_time_s"]
        assert run["training_s"] == pytest.approx(run["step_time_s"] - run["generation_s"])
        assert run["completions_per_s"] == pytest.approx(4 / run["step_time_s"])
        assert all(4 <= n <= 4 * 8 for n in run["generated_tokens_per_step"])
        assert run["peak_rss_mb"] > 0 and math.isfinite(run["final_loss"])
    ratio = data["ratios"]["alignkit/trl_default"]["completions_per_s"]
    summary = data["summary"]
    assert ratio == pytest.approx(summary["alignkit"]["completions_per_s"]["median"]
                                  / summary["trl_default"]["completions_per_s"]["median"])
    assert {t["target"] for t in report["targets"] if t["stage"] == "grpo"} >= {
        "completions_per_s alignkit/trl_default >= 2.0", "peak_rss_mb alignkit/trl_default <= 1.0"}
    assert "| run | step time (s) | completions/s | generation (s/step)" in markdown


def test_summarise_ppo_step_split():
    """Steps of 10, 10 and 14 s (warm-up 1), PPO logging time/generation 4, 4, 6 s, time/scoring 1, 1, 1 s and
    time/training 5, 4, 6 s, 8 prompts per step: measured steps 2-3 take 24 s → 16 / 24 = 0.667 responses/s;
    generation (4 + 6) / 2 = 5 s/step, scoring 1, training (4 + 6) / 2 = 5; response length (10 + 20) / 2 = 15."""
    from bench.worker import summarise_ppo

    recorder = StepRecorder()
    recorder.train_begin, recorder.step_ends = 0.0, [10.0, 20.0, 34.0]
    recorder.batch_tokens = [None, None, None]
    history = [{"loss": 0.5, "time/generation": g, "time/scoring": 1.0, "time/training": t,
                "completions/mean_length": n, "ppo/loss/total": loss}
               for g, t, n, loss in ((4.0, 5.0, 30.0, 0.5), (4.0, 4.0, 10.0, 0.4), (6.0, 6.0, 20.0, 0.3))]
    out = summarise_ppo(recorder, history + [{"train_runtime": 34.0}], warmup=1, prompts_per_step=8)
    assert out["measured_steps"] == 2 and out["step_time_s"] == pytest.approx(12.0)
    assert out["responses_per_s"] == pytest.approx(16 / 24)
    assert (out["generation_s"], out["scoring_s"], out["training_s"]) == pytest.approx((5.0, 1.0, 5.0))
    assert out["response_length_mean"] == pytest.approx(15.0) and out["final_loss"] == pytest.approx(0.3)
    with pytest.raises(RuntimeError, match="one per step"):
        summarise_ppo(recorder, history[:2], warmup=1, prompts_per_step=8)


def test_bench_ppo_end_to_end_on_tiny_model(tmp_path):
    """PPO, alignkit alone (no TRL runs are planned), 2 steps (1 timed): step time, its split, peak memory."""
    out_dir = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench", *ONE_THREAD, "--model", "tiny", "--stage", "ppo", "--reps", "1", "--steps", "2",
           "--warmup", "1", "--batch", "2", "--max-completion-length", "8", "--matmul-size", "256",
           "--matmul-seconds", "0.2", "--output-dir", str(out_dir), "--name", "ppo", "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out_dir / "ppo.json").read_text())
    data = report["stages"]["ppo"]
    (run,) = data["runs"]  # TRL's variants are not planned for ppo
    assert run["ok"], run.get("error")
    assert run["variant_key"] == "alignkit" and run["steps"] == 2 and run["measured_steps"] == 1
    assert run["step_time_s"] == pytest.approx(run["step_times_s"][1], abs=1e-4)
    assert run["responses_per_s"] == pytest.approx(2 / run["step_time_s"])
    for part in ("generation_s", "scoring_s", "training_s"):
        assert 0 < run[part] < run["step_time_s"], part
    # The three parts are the step but for bookkeeping (logging, the KL controller, the scheduler).
    assert run["generation_s"] + run["scoring_s"] + run["training_s"] <= run["step_time_s"] + 1e-6
    assert 1 <= run["response_length_mean"] <= 8 and run["peak_rss_mb"] > 0 and math.isfinite(run["final_loss"])
    assert run["settings"]["reward_model_type"] == "lora" and run["settings"]["max_new_tokens"] == 8
    summary = data["summary"]["alignkit"]
    for figure in ("step_time_s", "generation_s", "scoring_s", "training_s", "peak_rss_mb", "responses_per_s"):
        assert summary[figure]["median"] == run[figure], figure
    markdown = (out_dir / "ppo.md").read_text()
    assert "| run | step time (s) | responses/s | generation (s/step) | scoring (s/step) | training (s/step)" in markdown
    assert "| alignkit |" in markdown and "No peer ran" in markdown
    assert markdown in proc.stdout


def test_ppo_memory_sft_twin_trains_on_the_rollouts(tmp_path):
    """Two PPO completion records (one with message prompts, one with a string prompt) become two SFT rows with
    the same prompt and response; the SFT config keeps the PPO config's model, adapter, batch and cutoff."""
    import yaml

    from bench import ppo_memory

    ppo_dir = tmp_path / "ppo"
    ppo_dir.mkdir()
    records = [{"step": 1, "prompt": [{"role": "user", "content": "Capital of Italy?"}], "completion": "Rome.",
                "reward": 0.5},
               {"step": 1, "prompt": "Say hi.", "completion": "Hi!", "reward": -0.1}]
    (ppo_dir / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    ppo_config = {"model_name_or_path": "m", "adapter_name_or_path": "saves/sft", "stage": "ppo", "lora_rank": 8,
                  "cutoff_len": 256, "per_device_train_batch_size": 8, "reward_model": "rm", "max_new_tokens": 48}
    (tmp_path / "ppo.yaml").write_text(yaml.safe_dump(ppo_config), encoding="utf-8")
    assert ppo_memory.main([str(ppo_dir), str(tmp_path / "out"), "--ppo-config", str(tmp_path / "ppo.yaml"),
                            "--steps", "3"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "ppo_rollouts.jsonl").read_text().splitlines()]
    assert rows == [{"messages": [{"role": "user", "content": "Capital of Italy?"},
                                  {"role": "assistant", "content": "Rome."}]},
                    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}]
    config = yaml.safe_load((tmp_path / "out" / "sft_like_ppo.yaml").read_text())
    assert config["stage"] == "sft" and config["max_steps"] == 3
    for key in ("model_name_or_path", "adapter_name_or_path", "lora_rank", "cutoff_len", "per_device_train_batch_size"):
        assert config[key] == ppo_config[key], key
    assert "reward_model" not in config and "max_new_tokens" not in config
    (ppo_dir / "completions.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="log_completions"):
        ppo_memory.rollout_rows(ppo_dir / "completions.jsonl")


def test_sweep_grid_and_linear_fit():
    """Lengths (128, 256), batches (1, 32), 4096 tokens, batch length 128 (the `points` docstring example);
    fit of [1, 2, 3] -> [3, 5, 7]: slope 2, intercept 1, no residual."""
    from bench import sweep

    grid = {(p["stage"], p["length"], p["batch"]): p["axes"] for p in sweep.points((128, 256), (1, 32), 4096, 128,
                                                                                   ["sft", "dpo"])}
    assert grid == {(stage, *point): axes for stage in ("sft", "dpo") for point, axes in
                    [((128, 32), ["length", "batch"]), ((256, 16), ["length"]), ((128, 1), ["batch"])]}
    fit = sweep.linear_fit([1, 2, 3], [3, 5, 7])
    assert fit["slope"] == pytest.approx(2) and fit["intercept"] == pytest.approx(1)
    assert fit["max_relative_residual"] == pytest.approx(0, abs=1e-12)
    assert sweep.linear_fit([1, 1], [2, 3]) is None


@pytest.mark.parametrize("kind,keys", [("sft", ["response"]), ("pref", ["chosen", "rejected"])])
def test_exact_length_rows_hit_the_length(tiny_tokenizer, kind, keys):
    from bench import sweep

    for length in (128, 200):
        rows = sweep.exact_length_rows(tiny_tokenizer, kind, 5, length)
        assert len(rows) == 5
        assert {workloads.chat_length(tiny_tokenizer, r, k) for r in rows for k in keys} == {length}


def test_sweep_quick_end_to_end(tmp_path):
    """`--sweep --quick` for dpo on two lengths and batches 1 and 2 (batch x L = 256: 3 points, L 128 at 2 pairs on
    both axes), alignkit alone (the TRL workers are the stage comparison's, run end to end above): every run counts
    exactly batch x 2 x L tokens per step, the table, the fits and both plots are written; a second call with
    the same settings reruns nothing."""
    out_dir = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench", *ONE_THREAD, "--sweep", "--quick", "--stage", "dpo", "--sweep-lengths", "128", "256",
           "--sweep-batches", "1", "2", "--variants", "alignkit", "--output-dir", str(out_dir),
           "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out_dir / "sweep.json").read_text())
    assert report["complete"] and report["settings"]["variants"] == ["alignkit"]
    assert {(p["length"], p["batch"]) for p in report["grid"]} == {(128, 2), (256, 1), (128, 1)}
    assert len(report["runs"]) == 3
    for run in report["runs"].values():
        assert run["ok"], run.get("error")
        assert run["tokens_per_step"] == [run["batch"] * 2 * run["length"]] * 2
        assert run["step_time_s"] > 0 and run["peak_rss_mb"] > 0
    fits = report["memory_fits"]
    assert set(fits) == {"dpo alignkit"}
    assert fits["dpo alignkit"]["batch_axis_fit_mb_per_1k_tokens"]["slope"] is not None
    for name in ("sweep.md", "sweep_time.png", "sweep_memory.png"):
        assert (out_dir / name).stat().st_size > 0
    table = (out_dir / "sweep.md").read_text()
    assert "| dpo | length+batch | 128 | 2 | 512 |" in table and "| dpo | length | 256 | 1 | 512 |" in table
    assert report["settings"]["tokens"] == 256
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 runs to do (3 kept" in again.stderr


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_memory_phases_reports_every_phase_of_a_tiny_qlora_run(tmp_path):
    """`python -m bench.memory_phases` (docs/qlora.md "Memory"): a peak per phase, what autograd saved, the heap."""
    from bench import memory_phases

    out = tmp_path / "phases.json"
    assert memory_phases.main(["--model", "tiny", "--steps", "2", "--batch", "2", "--variant", "qlora", "--trim",
                               "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["phase_peaks_mb"])[:3] == ["import", "load", "setup"]
    assert {f"step{k}.{p}" for k in (1, 2) for p in ("forward", "backward", "optimizer", "rest")} <= set(
        report["phase_peaks_mb"])
    assert report["peak_rss_mb"] >= max(report["phase_peaks_mb"].values()) * 0.99
    for step in report["steps"]:
        assert step["saved_for_backward_mb"]["float32"] > 0
        assert step["heap_at_end_mb"]["in_use"] > 0 and "rss_after_trim_mb" in step


def test_memory_phases_gives_an_online_stage_its_generation_phase(tmp_path):
    """`python -m bench.memory_phases --stage distill` (docs/stages/distill.md "Memory and speed"): the sampling call is
    a phase of each step, with the resident size after it."""
    from bench import memory_phases

    out = tmp_path / "phases.json"
    assert memory_phases.main(["--model", "tiny", "--steps", "2", "--batch", "2", "--stage", "distill",
                               "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {f"step{k}.{p}" for k in (1, 2) for p in ("generation", "forward", "backward")} <= set(
        report["phase_peaks_mb"])
    assert all(step["rss_after_generation_mb"] > 0 for step in report["steps"])
