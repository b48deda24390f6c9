"""The `alignkit` command: argument handling only; the work happens in the modules it calls.

    alignkit train CONFIG.yaml [key=value ...]   run the stage named by `stage:`
    alignkit chat [--model DIR] [--adapter DIR] [--prompt TEXT]
    alignkit export --model DIR [--adapter DIR] --export-dir DIR [--force]
    alignkit score --model DIR --input FILE.jsonl [--output FILE.jsonl]
    alignkit demo                                 a short LoRA SFT of the bundled model, before/after
    alignkit env                                  versions and device
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .callbacks import TrainingDiverged
from .data.errors import DataError
from .hparams import ConfigError, DataArguments


def _configure_logging() -> None:
    logging.basicConfig(format="[%(levelname)s|%(name)s] %(message)s", level=logging.INFO)
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _cmd_train(args: argparse.Namespace) -> int:
    from .hparams import all_keys, read_config

    if args.help_keys:
        for group, keys in all_keys().items():
            print(f"\n[{group}]")
            for key, help_text in keys.items():
                print(f"  {key}: {help_text}")
        return 0
    if not args.config:
        raise ConfigError("alignkit train needs a config file: alignkit train CONFIG.yaml [key=value ...]")
    config = read_config(args.config, args.overrides)
    from .train import run_train

    run_train(config)
    return 0


def _model_args(model: str | None, adapter: str | None, extra: list[str] | None = None):
    from .hparams import parse_config

    overrides = [f"model_name_or_path={model}"] if model else []
    if adapter:
        overrides.append(f"adapter_name_or_path={adapter}")
    return parse_config({}, overrides + list(extra or []))


def _cmd_chat(args: argparse.Namespace) -> int:
    from .chat import chat

    config = _model_args(args.model, args.adapter, args.overrides)
    chat(config.model, config.generating, prompt=args.prompt, system=args.system, template=config.data.template)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .export import export_model

    config = _model_args(args.model, args.adapter)
    path = export_model(config.model, args.export_dir, force=args.force)
    print(f"Exported to {path}")
    return 0


def _cmd_score(args: argparse.Namespace) -> int:
    from .score import score_file

    output = args.output or os.path.splitext(args.input)[0] + ".scored.jsonl"
    score_file(args.model, args.input, output, batch_size=args.batch_size, cutoff_len=args.cutoff_len,
               template=args.template)
    print(f"Scores written to {output}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(output_dir=args.output_dir, steps=args.steps)
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    from .env import env_info, format_env

    print(format_env(env_info()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignkit", description="Post-training for language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train with a YAML config: alignkit train CONFIG.yaml [key=value ...]")
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    p.add_argument("--help-keys", action="store_true", help="list every config key with its help")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("chat", help="chat with a model (interactive, streaming)")
    p.add_argument("--model", help="model directory or hub id (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--adapter", help="LoRA adapter directory (comma-separated for several)")
    p.add_argument("--prompt", help="answer this one prompt and exit")
    p.add_argument("--system", help="system prompt")
    p.add_argument("overrides", nargs="*", help="settings as key=value (e.g. max_new_tokens=64 template=chatml)")
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("export", help="merge a LoRA adapter into its base and save a standalone model")
    p.add_argument("--model", help="base model directory or hub id (default: the bundled model)")
    p.add_argument("--adapter", help="adapter directory (comma-separated for several)")
    p.add_argument("--export-dir", required=True, help="where to write the merged model")
    p.add_argument("--force", action="store_true", help="write into a non-empty export directory")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("score", help="score prompt/response pairs with a trained reward model")
    p.add_argument("--model", required=True, help="reward model directory (adapter or exported model)")
    p.add_argument("--input", required=True, help="jsonl with prompt + response, or messages")
    p.add_argument("--output", help="where to write the scores (default: INPUT.scored.jsonl)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--cutoff-len", type=int, default=DataArguments().cutoff_len,
                   help="most tokens per sequence, as the config's cutoff_len (default %(default)s)")
    p.add_argument("--template", default=None, help="chat template (default: the tokenizer's own)")
    p.set_defaults(func=_cmd_score)

    p = sub.add_parser("demo", help="a short LoRA fine-tune of the bundled model, answers before and after")
    p.add_argument("--output-dir", default="outputs/demo")
    p.add_argument("--steps", type=int, default=None, help="override the number of SFT steps")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("env", help="print versions and device")
    p.set_defaults(func=_cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `alignkit` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging()
    try:
        return args.func(args)
    except (ConfigError, DataError, TrainingDiverged, FileExistsError, FileNotFoundError) as err:
        # Raised where input enters, with a message written for the user; anything else is a bug
        # and keeps its traceback.
        print(f"alignkit: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
