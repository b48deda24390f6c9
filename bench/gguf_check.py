"""GGUF export of the bundled model (and of an SFT adapter merged into it), checked through transformers:
`python -m bench.gguf_check [--adapter DIR] [--work-dir DIR]`.

For the base (and, with `--adapter`, base + adapter): `alignkit export --format gguf --gguf-type f32 --ollama`
(`export_model`), then the same merged model written again as f16 and q8_0 (`gguf_export.write_gguf`). Each file is
loaded by transformers (`from_pretrained(..., gguf_file=...)`) and its logits on a fixed chat-templated prompt are
compared with the merged model's (max absolute difference). Also: the file's metadata read back by `gguf`'s
reader (architecture, tokenizer model, chat template), the GGUF tokenizer's ids against the merged tokenizer's,
and the Modelfile's stop tokens. A measurement, not a test (the tiny-model test is tests/cli/test_export_gguf.py):
it prints one line per file and writes `gguf_check.json` in the work dir.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
TYPES = ("f32", "f16", "q8_0")


def check(name: str, model: str | None, adapter: str | None, work: Path) -> list[dict]:
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignkit.config.parse import parse_config
    from alignkit.export import export_model
    from alignkit.gguf_export import write_gguf

    keys = {"adapter_name_or_path": adapter} if adapter else {}
    if model:
        keys["model_name_or_path"] = model
    out = export_model(parse_config(keys).model, str(work / name), force=True, gguf_type="f32", ollama=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        expected = merged(ids["input_ids"]).logits
    rows = []
    for gguf_type in TYPES:
        path = out / f"{out.name}-{gguf_type}.gguf"
        if gguf_type != "f32":
            write_gguf(merged, out, path, gguf_type)
        start = time.perf_counter()
        loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32).eval()
        with torch.no_grad():
            difference = float((loaded(ids["input_ids"]).logits - expected).abs().max())
        reader = gguf.GGUFReader(path)
        fields = {key: reader.fields[key].contents() for key in
                  ("general.architecture", "tokenizer.ggml.model", "general.file_type")}
        gguf_tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=path.name)
        text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        rows.append({
            "model": name, "gguf_type": gguf_type, "file_mib": round(path.stat().st_size / 2**20, 1),
            "max_abs_logit_difference": difference, "logit_range": float(expected.abs().max()),
            "same_argmax": bool((loaded(ids["input_ids"]).logits.argmax(-1) == expected.argmax(-1)).all()),
            "chat_template_in_file": reader.fields["tokenizer.chat_template"].contents() == tokenizer.chat_template,
            "same_token_ids": gguf_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"],
            "load_and_forward_s": round(time.perf_counter() - start, 1), **fields})
        print(json.dumps(rows[-1]), flush=True)
        del loaded
        if gguf_type != "f32":
            path.unlink()  # keep the work dir small; the f32 file stays beside the Modelfile
    modelfile = (out / "Modelfile").read_text()
    print(f"{name}: Modelfile stop lines:", [line for line in modelfile.splitlines() if line.startswith("PARAMETER stop")])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="base model directory (default: the bundled model)")
    parser.add_argument("--adapter", help="an SFT adapter of the bundled model (e.g. `alignkit demo`'s output dir)")
    parser.add_argument("--work-dir", default="outputs/gguf_check")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    rows = check("base", args.model, None, work)
    if args.adapter:
        rows += check("base_plus_adapter", args.model, args.adapter, work)
    record = {"machine": platform.processor() or platform.machine(), "rows": rows}
    (work / "gguf_check.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
