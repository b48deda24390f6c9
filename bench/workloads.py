"""What both tools train on, and how much arithmetic that is.

The data is generated here, deterministically (a seeded `random.Random`), rather than read from `data/`, so a
benchmark result stays comparable across commits that change the demo sets. Prompt and response lengths follow
log-normal distributions, as chat data does: most examples are short, a few are long, so padding and
padding-free batching matter as they would on real data. Every example is trimmed until its chat-formatted
token count fits `cutoff_len` under the benchmarked model's own tokenizer, so neither tool truncates anything
and both see exactly the same tokens.

Each example is kept in one canonical form (system, prompt, response / chosen / rejected) and written twice:
a LLaMA-Factory style `dataset_info.json` registry + JSON file for alignkit, and TRL's conversational
prompt-completion / preference rows (a JSON-lines file) for TRL. Both tools then apply the same tokenizer
chat template.

FLOPs: `matmul_params` counts N, the weights that take part in matrix multiplications (every `nn.Linear`,
including the LM head or score head; not the embedding lookup). `flops_per_token` turns N into model FLOPs
per real token for the usual 2N forward / 4N backward accounting.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

SYSTEM_PROMPT = "You are a helpful assistant."

_TOPICS = [
    "the water cycle", "compound interest", "photosynthesis", "a binary search", "the French revolution",
    "how vaccines work", "plate tectonics", "a hash table", "inflation", "the immune system", "solar eclipses",
    "recursion", "supply and demand", "the printing press", "black holes", "public key cryptography",
    "coral reefs", "the Roman road network", "garbage collection", "sleep and memory",
]
_TASKS = [
    "Explain {t} to a curious teenager.",
    "Write a short summary of {t}.",
    "What are the three most important facts about {t}?",
    "Give an everyday analogy for {t} and say where the analogy breaks down.",
    "I am preparing a lesson about {t}. Suggest an outline.",
    "Compare {t} with something most people already know.",
    "List common misconceptions about {t} and correct them.",
]
# A plain word bank: sentences built from it have ordinary English token statistics (about 1.3 tokens per
# word for a byte-level BPE tokenizer), which is what matters for a throughput benchmark.
_WORDS = (
    "the a of to and in is that it for on with as was by this be are at from or an have not which but one "
    "all were can more when there their will would what about if out up so into has time than two other only "
    "its some could these first new because may way people over such many most made after also through well "
    "where much before back any good very each same work part between long years under both world often while "
    "small large number system water energy light simple example change point place question problem answer "
    "process result reason idea model level early later common useful careful important different possible "
    "usually clearly quickly slowly together against around during without within toward across"
).split()


def _lognormal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


def _sentences(rng: random.Random, n_words: int) -> str:
    """Roughly `n_words` words of sentence-shaped filler (capitalised, punctuated)."""
    out: list[str] = []
    while len(out) < n_words:
        length = rng.randint(6, 18)
        words = [rng.choice(_WORDS) for _ in range(length)]
        words[0] = words[0].capitalize()
        out.extend(words[:-1] + [words[-1] + rng.choice([".", ".", ".", "?", "!"])])
    text = " ".join(out[:n_words])
    return text if text[-1] in ".?!" else text + "."


def canonical_rows(kind: str, n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` canonical rows: `kind="sft"` gives system/prompt/response; `"pref"` gives system/prompt/chosen/rejected;
    `"prompt"` (GRPO) gives system/prompt only; `"tool_prompt"` (GRPO with the calculator) arithmetic questions that
    ask for the tool (`tool_prompt_rows`).

    After a one-line task, prompts carry a median of 6 words of context (up to 80); responses have a median of
    28 words (up to 170); chosen answers 22 and rejected 18 (up to 150), so chosen and rejected lengths differ
    as in real preference data. The medians keep a full benchmark run within its time budget on two CPU cores.
    """
    if kind == "tool_prompt":
        return tool_prompt_rows(n, seed)
    if kind not in ("sft", "pref", "prompt"):
        raise ValueError(f"kind={kind!r}: expected 'sft', 'pref', 'prompt' or 'tool_prompt'.")
    rng = random.Random(f"alignkit-bench-{kind}-{seed}")
    rows = []
    for _ in range(n):
        task = rng.choice(_TASKS).format(t=rng.choice(_TOPICS))
        context = _sentences(rng, _lognormal_int(rng, 6, 0.9, 2, 80))
        prompt = f"{task}\n\n{context}"
        row = {"system": SYSTEM_PROMPT, "prompt": prompt}
        if kind == "sft":
            row["response"] = _sentences(rng, _lognormal_int(rng, 28, 0.7, 5, 170))
        elif kind == "pref":
            row["chosen"] = _sentences(rng, _lognormal_int(rng, 22, 0.6, 5, 150))
            row["rejected"] = _sentences(rng, _lognormal_int(rng, 18, 0.8, 4, 150))
        rows.append(row)
    return rows


# The tool of the `grpo_tools` workload, the same function in both tools: arithmetic read from the syntax tree.
CALCULATOR = Path(__file__).resolve().parents[1] / "examples" / "tools" / "calculator.py"


def tool_prompt_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` arithmetic questions that ask for the calculator (`CALCULATOR`), e.g. "Use the calculate tool to work out
    37 * 12 + 5, then state the result." Deterministic in `seed`."""
    rng = random.Random(f"alignkit-bench-tool_prompt-{seed}")
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 20)
        expression = f"{a} {rng.choice('+-*')} {b} {rng.choice('+-')} {c}"
        rows.append({"system": SYSTEM_PROMPT,
                     "prompt": f"Use the calculate tool to work out {expression}, then state the result."})
    return rows


def calculator_tool():
    """The `calculate` function of `CALCULATOR`, imported from its file (TRL's side takes the function itself;
    alignkit's the key `tools: <CALCULATOR>:calculate`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_calculator", CALCULATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.calculate


def tool_model_dir(model_dir: str | Path, out_dir: str | Path) -> str:
    """`model_dir` with Qwen2.5's chat template (TRL 1.16's tool-call parsing knows it; alignkit reads the call
    format from any template that writes calls): config and tokenizer files copied, weight files linked.

    Both tools load this directory in the `grpo_tools` workload, so both render the same prompts with the tool's
    schema and parse the same `<tool_call>` format. Returns its path."""
    import shutil

    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    source, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            (out / path.name).symlink_to(path.resolve())
        elif path.is_file():
            shutil.copy(path, out / path.name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.save_pretrained(out)
    return str(out)


def _messages(row: dict[str, str], answer_key: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": row["system"]},
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": row[answer_key]},
    ]


def chat_length(tokenizer, row: dict[str, str], answer_key: str) -> int:
    """Tokens of the whole chat-formatted conversation under the tokenizer's own template."""
    encoded = tokenizer.apply_chat_template(_messages(row, answer_key), tokenize=True)
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return len(ids)


def fit_to_cutoff(tokenizer, rows: list[dict[str, str]], cutoff_len: int) -> list[dict[str, str]]:
    """Drop trailing words of each answer (and, if needed, of the prompt) until every conversation fits.

    Answers keep at least 3 words. Returns new rows; the input is not modified.
    """
    answer_keys = [k for k in ("response", "chosen", "rejected") if k in rows[0]]
    fitted = []
    for row in rows:
        row = dict(row)
        for key in answer_keys:
            while chat_length(tokenizer, row, key) > cutoff_len:
                words = row[key].split()
                if len(words) > 3:
                    row[key] = " ".join(words[: max(3, int(len(words) * 0.85))])
                    continue
                prompt_words = row["prompt"].split()
                if len(prompt_words) <= 3:
                    raise ValueError(f"cutoff_len={cutoff_len} is too small for even a minimal conversation.")
                row["prompt"] = " ".join(prompt_words[: max(3, int(len(prompt_words) * 0.85))])
        fitted.append(row)
    return fitted


def write_datasets(rows: list[dict[str, str]], out_dir: str | Path, name: str) -> dict[str, str]:
    """Write the rows for both tools; returns {"alignkit_dataset_dir", "alignkit_dataset", "trl_file"}.

    alignkit gets an alpaca-format file (`instruction`, `input`, `output` or `chosen`/`rejected`, `system`)
    registered in `dataset_info.json`; TRL gets conversational rows with an explicit prompt.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    is_pref = "chosen" in rows[0]
    is_prompt = not is_pref and "response" not in rows[0]
    alpaca = []
    trl_rows: list[dict[str, Any]] = []
    for row in rows:
        prompt_messages = [{"role": "system", "content": row["system"]}, {"role": "user", "content": row["prompt"]}]
        if is_prompt:
            alpaca.append({"instruction": row["prompt"], "input": "", "system": row["system"]})
            trl_rows.append({"prompt": prompt_messages})
        elif is_pref:
            alpaca.append({"instruction": row["prompt"], "input": "", "chosen": row["chosen"],
                           "rejected": row["rejected"], "system": row["system"]})
            trl_rows.append({
                "prompt": prompt_messages,
                "chosen": [{"role": "assistant", "content": row["chosen"]}],
                "rejected": [{"role": "assistant", "content": row["rejected"]}],
            })
        else:
            alpaca.append({"instruction": row["prompt"], "input": "", "output": row["response"],
                           "system": row["system"]})
            trl_rows.append({"prompt": prompt_messages,
                             "completion": [{"role": "assistant", "content": row["response"]}]})
    file_name = f"{name}.json"
    (out / file_name).write_text(json.dumps(alpaca, ensure_ascii=False, indent=1), encoding="utf-8")
    columns = {"prompt": "instruction", "query": "input", "system": "system"}
    if not is_prompt:
        columns.update({"chosen": "chosen", "rejected": "rejected"} if is_pref else {"response": "output"})
    entry: dict[str, Any] = {"file_name": file_name, "formatting": "alpaca", "columns": columns}
    if is_pref:
        entry["ranking"] = True
    info_path = out / "dataset_info.json"
    info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.exists() else {}
    info[name] = entry
    info_path.write_text(json.dumps(info, indent=1), encoding="utf-8")
    trl_file = out / f"{name}.trl.jsonl"
    trl_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in trl_rows), encoding="utf-8")
    return {"alignkit_dataset_dir": str(out), "alignkit_dataset": name, "trl_file": str(trl_file)}


def bench_reward(completions, completion_ids=None, **kwargs) -> list[float]:
    """GRPO benchmark reward, the same function in both tools: each completion's share of distinct tokens.

    Cheap and deterministic, and it differs between completions of one prompt, so advantages are not all 0.
    Example: ids [5, 5, 7, 9] → 3 distinct of 4 = 0.75.
    """
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


def matmul_params(model_dir: str | Path, head: str) -> int:
    """N: weights used in matmuls (all `nn.Linear`, including the LM or score head), counted on the meta device.

    Args:
        model_dir: a `from_pretrained` directory.
        head: "causal_lm" (the LM head projects to the vocabulary) or "reward" (a 1-output score head).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        if head == "reward":
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))


def flops_per_token(n_params: int, *, lora: bool, reference_forward: bool) -> tuple[int, str]:
    """Model FLOPs per real token of one optimisation step, and the formula as text.

    Forward 2N; backward 4N with weight gradients (full fine-tuning), 2N without (LoRA: only activation
    gradients flow through the frozen weights; the adapters' own FLOPs are negligible at r=8). A reference
    forward inside the step (DPO without precomputed reference log-probs) adds 2N. Attention score FLOPs
    and gradient-checkpointing recomputation are not counted (model FLOPs, not hardware FLOPs).
    """
    train = 4 if lora else 6
    ref = 2 if reference_forward else 0
    text = f"{train}N" + (" + 2N (reference forward)" if ref else "")
    return (train + ref) * n_params, text
