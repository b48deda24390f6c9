"""Padding-free vs padded SFT on the hidden-48 tiny model: issue 11's case and a batch sweep.

    python bench/padding_free_sweep.py --source after=. --source before=runs/pf_before --out runs/pf_sweep

Each run is one `/usr/bin/time -v alignkit train <yaml>` in a fresh process (one LoRA SFT step, fp32, CPU)
with `PYTHONPATH` set to the named source tree, so two versions of alignkit can be compared with the same
command. It records `train_runtime`, real tokens per second (`num_input_tokens_seen` / `train_runtime`) and
the peak resident memory and the process's user + system CPU seconds that `time -v` reports. The runs alternate (every configuration once, then again)
so that load from other programs hits both paths alike; the tables give medians and the 1-minute load
average seen before each run. Data and model are generated from `--seed`, so a rerun trains the same step.

Cases (each with `padding_free` false and true):
- `issue`: 64 rows of 700-1000 tokens cut to `cutoff_len: 512` (every sequence 512 tokens), batch 32,
  every source: issue 11's before/after table;
- `sweep`: the same data at batch 1, 8 and 32, the first source only;
- `mixed`: 64 rows of 40-1000 tokens cut to 512 (padding in every batch), batch 32, the first source only.
Not a test: nothing asserts on time. Run it alone; about 10 minutes on the 2-core development CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORDS = ("the capital of france is paris japan tokyo write a short poem about sea waves roll in and out again "
         "what is plus times it explain why sky blue sunlight scatters off air molecules answer briefly").split()


def make_model(directory: Path, seed: int) -> None:
    from alignkit.model.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_tiny_model(len(tokenizer), seed=seed, hidden_size=48).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def make_data(directory: Path, tokenizer, name: str, low: int, high: int, seed: int) -> None:
    """64 alpaca rows whose ChatML text is `low`-`high` tokens long (a short prompt, a long response)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(64):
        target = rng.randint(low, high)
        words = [rng.choice(WORDS) for _ in range(target)]
        # Shrink until the whole chat (template included) fits the target token count.
        while True:
            text = " ".join(words)
            chat = [{"role": "user", "content": "Write about the sea."}, {"role": "assistant", "content": text}]
            length = len(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
            if length <= target:
                break
            words = words[: max(1, len(words) - max(1, (length - target) // 2))]
        rows.append({"instruction": "Write about the sea.", "input": "", "output": text})
    (directory / f"{name}.json").write_text(json.dumps(rows))


def run_once(source: Path, workdir: Path, label: str, dataset: str, batch: int, padding_free: bool) -> dict:
    out = workdir / "runs" / label
    config = {
        "model_name_or_path": str(workdir / "model"), "stage": "sft", "do_train": True, "finetuning_type": "lora",
        "dataset": dataset, "dataset_dir": str(workdir / "data"), "cutoff_len": 512,
        "per_device_train_batch_size": batch, "max_steps": 1, "logging_steps": 1, "save_strategy": "no",
        "output_dir": str(out), "overwrite_output_dir": True, "padding_free": padding_free, "seed": 0,
    }
    yaml_path = workdir / f"{label}.yaml"
    yaml_path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))
    env = dict(os.environ, PYTHONPATH=str(source), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    load = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", "alignkit", "train", str(yaml_path)], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    # CPU seconds of the whole process (start-up included): less moved by other programs than wall time.
    cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", proc.stderr).group(1))
              for kind in ("User", "System"))
    results = json.loads((out / "train_results.json").read_text())
    tokens = max(json.loads(line).get("total_tokens", 0) for line in (out / "trainer_log.jsonl").open())
    runtime = results["train_runtime"]
    return {"runtime": runtime, "tokens_per_s": tokens / runtime, "rss_gb": rss_kb / 1024**2, "load": load,
            "wall": wall, "cpu": cpu, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", action="append", required=True,
                        help="label=path of an alignkit source tree (the first one gets the sweep)")
    parser.add_argument("--out", default="/tmp/pf_sweep")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", default="issue,sweep,mixed")
    args = parser.parse_args()
    sources = [(s.split("=", 1)[0], Path(s.split("=", 1)[1]).resolve()) for s in args.source]
    workdir = Path(args.out)
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    if not (workdir / "model" / "config.json").exists():
        make_model(workdir / "model", args.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    make_data(workdir / "data", tokenizer, "long", 700, 1000, args.seed)
    make_data(workdir / "data", tokenizer, "mixed", 40, 1000, args.seed + 1)
    (workdir / "data" / "dataset_info.json").write_text(json.dumps({n: {"file_name": f"{n}.json"} for n in ("long", "mixed")}))

    cases = set(args.cases.split(","))
    plan = []  # (case, source label, dataset, batch, padding_free)
    for padding_free in (False, True):
        if "issue" in cases:
            plan += [("issue", label, "long", 32, padding_free) for label, _ in sources]
        if "sweep" in cases:
            plan += [("sweep", sources[0][0], "long", batch, padding_free) for batch in (1, 8)]
        if "mixed" in cases:
            plan.append(("mixed", sources[0][0], "mixed", 32, padding_free))
    plan.sort(key=lambda p: (p[0], p[1], p[3], p[4]))  # padded and padding-free of one setting back to back
    paths = dict(sources)
    measured: dict[tuple, list[dict]] = {}
    for rep in range(args.reps):
        for case, label, dataset, batch, padding_free in plan:
            key = (case, label, batch, padding_free)
            run = run_once(paths[label], workdir, f"{case}-{label}-b{batch}-pf{int(padding_free)}", dataset, batch,
                           padding_free)
            measured.setdefault(key, []).append(run)
            print(f"rep {rep} {key}: {run['runtime']:.2f} s, {run['tokens_per_s']:.0f} tok/s, {run['rss_gb']:.2f} GB, "
                  f"load {run['load']:.1f}", flush=True)
    (workdir / "results.json").write_text(json.dumps({" ".join(map(str, k)): v for k, v in measured.items()}, indent=1))

    print("\n| case | source | batch | padding_free | train_runtime (s) | tokens/s | peak RSS (GB) | process CPU s | "
          "load 1 min | runs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    issue_and_sweep = sorted(measured, key=lambda k: (k[0] != "issue", k[0], k[1], k[2], k[3]))
    for key in issue_and_sweep:
        runs = measured[key]
        med = {m: statistics.median(r[m] for r in runs) for m in ("runtime", "tokens_per_s", "rss_gb", "cpu", "load")}
        print(f"| {key[0]} | {key[1]} | {key[2]} | {str(key[3]).lower()} | {med['runtime']:.2f} | "
              f"{med['tokens_per_s']:.0f} | {med['rss_gb']:.2f} | {med['cpu']:.1f} | {med['load']:.1f} | {len(runs)} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
