"""The `alignkit` command: argument handling only; the work happens in the modules it calls.

    alignkit train CONFIG.yaml [key=value ...]   run the stage named by `stage:`
    alignkit train --nproc N CONFIG.yaml          the same in N processes (through torchrun)
    alignkit chat [--model DIR] [--adapter DIR] [--prompt TEXT] [--tools file.py:function,...]
                  [--environment-factory file.py:Class]
    alignkit export --model DIR [--adapter DIR] --export-dir DIR [--force] [--format gguf [--gguf-type T] [--ollama]]
    alignkit api [--model DIR] [--adapter NAME=DIR ...] [--host H] [--port N] [--api-key KEY]   OpenAI-compatible
    alignkit score --model DIR --input FILE.jsonl [--output FILE.jsonl]
    alignkit eval --dataset NAME --reward SPEC [--model DIR] [--adapter DIR]   mean rewards, greedy (before/after RL)
                  [--tools file.py:function,...]                           ... answering through the tool loop
                  [--environment-factory file.py:Class]                     ... with an environment per prompt
    alignkit eval --tasks NAME|task.yaml [--model DIR] [--adapter DIR]        lm-eval benchmarks (the lm-eval extra)
    alignkit board [--runs DIR] [--host H] [--port N]  web page: launch, watch, compare, stop runs, chat
    alignkit demo                                 a short LoRA SFT of the bundled model, checked before/after
    alignkit env                                  versions and device

Start-up: this module imports nothing heavy at its top (torch, transformers, peft and datasets take seconds to
import). The help, argument errors and the first reading of a config file and its overrides come back without
them; each command imports what it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .env import launched_processes, silence_deepspeed_cpu_notice, start_up_imports
from .errors import ConfigError, DataError, RewardFunctionError, TrainingDiverged


# `alignkit eval`: a greedy decode step streams every weight once whatever the batch, so a wide batch costs little
# more a step than a narrow one and needs fewer steps (docs/performance.md, "alignkit eval"). lm-eval's batch stays
# at its usual size.
REWARD_EVAL_BATCH_SIZE = 32
TASKS_BATCH_SIZE = 8


# The format of every log line the CLI prints (also the tests' in-process runs, tests/distributed/conftest.py).
LOG_FORMAT = "[%(levelname)s|%(name)s] %(message)s"


def _configure_logging() -> None:
    logging.basicConfig(format=LOG_FORMAT, level=logging.INFO)
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _print_help_keys() -> None:
    """Every key with its help, by group; transformers' own training keys folded into their names and a link.

    Read from the key table (`alignkit.config.keytable`) when it matches the installed transformers, so the help
    comes without importing torch; otherwise from the dataclasses themselves.
    """
    import textwrap

    from .config.keytable import load_key_table
    from .config.values import TRANSFORMERS_TRAINING_DOCS, TRANSFORMERS_TRAINING_GROUP

    table = load_key_table()
    if table is not None:
        groups = table["help"]
    else:
        from .config.parse import all_keys

        groups = all_keys()
    for group, keys in groups.items():
        print(f"\n[{group}]")
        if group == TRANSFORMERS_TRAINING_GROUP:
            print(f"  {len(keys)} keys of transformers' Seq2SeqTrainingArguments, as transformers defines them (a few\n"
                  f"  defaults differ, e.g. logging_steps=1, report_to=none). Each key's help: {TRANSFORMERS_TRAINING_DOCS}")
            print(textwrap.fill(", ".join(keys), width=110, initial_indent="    ", subsequent_indent="    "))
            continue
        for key, help_text in keys.items():
            print(f"  {key}: {help_text}")


def _import_training_stack() -> None:
    """Import torch, transformers, peft and alignkit's stages (`alignkit.config.parse` imports them all) with the
    collector paused, as a command's start-up (`env.start_up_imports`); a command calls this before its first
    import of them."""
    with start_up_imports():
        from .config import parse  # noqa: F401


def _cmd_train(args: argparse.Namespace) -> int:
    if args.help_keys:
        _print_help_keys()
        return 0
    if not args.config:
        raise ConfigError("alignkit train needs a config file: alignkit train CONFIG.yaml [key=value ...]")
    from .launch import asks_for_deepspeed, relaunch, single_process_rendezvous, torchrun_command

    command = torchrun_command([args.config, *args.overrides], args.nproc, os.environ)
    # Reads the YAML file and splits the overrides before the config parser (and with it torch) is imported:
    # a missing or malformed file, or an override without `=`, fails at once.
    deepspeed = asks_for_deepspeed(args.config, args.overrides)
    from .config.keytable import check_config_early, load_key_table

    table = load_key_table()
    if table is not None:  # an unknown key, a value of the wrong type or a missing dataset fails before torch loads
        check_config_early(args.config, args.overrides, table)
    if command is None and deepspeed:
        # Before the config is read: reading it sets up the process group (transformers' TrainingArguments).
        os.environ.update(single_process_rendezvous(os.environ))
    _import_training_stack()
    from .config.parse import read_config

    config = read_config(args.config, args.overrides)  # checked here first: a bad key fails before any launch
    if command is not None:
        return relaunch(command)
    if not config.training.deepspeed and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true"):
        silence_deepspeed_cpu_notice()
    from .train import run_train

    try:
        run_train(config)
    except KeyboardInterrupt:
        print(f"alignkit: interrupted. {_resume_hint(config.training)}", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a Ctrl-C
    finally:
        _close_process_group()
    if launched_processes() > 1:
        _exit_without_teardown()
    return 0


def _resume_hint(training) -> str:
    """What an interrupted run keeps and how to go on: the last checkpoint in `output_dir`, if any."""
    from .lifecycle import checkpoint_problem, list_checkpoints

    # The newest checkpoint a rerun would resume from, by the rerun's rule (`train.resolve_resume`: the optimizer
    # state is needed unless save_only_model), passing over one the interrupt cut short; nothing is moved here.
    need_optimizer = not training.save_only_model
    last = next((c for c in list_checkpoints(training.output_dir) if checkpoint_problem(c, need_optimizer) is None),
                None)
    if last is None:
        return (f"No checkpoint was saved in {training.output_dir} yet; re-running the same command starts the run "
                "again.")
    return f"{last} is kept; re-running the same command resumes from it."


def _close_process_group() -> None:
    """End a multi-process run's process group before the process exits."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _exit_without_teardown() -> None:
    """Exit a finished torchrun worker with status 0 without the interpreter's C++ teardown.

    With torch 2.13 and gloo on a CPU, a worker that has finished and destroyed its process group still aborts
    now and then while the interpreter tears down ("terminate called without an active exception", SIGABRT:
    a thread object destroyed while joinable), about once in 15 launches under load here, and torchrun then
    reports the whole finished run as failed. Everything the run writes is closed by now; logging and the
    standard streams are flushed, then `os._exit` skips the teardown.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _model_args(model: str | None, adapter: str | None, extra: list[str] | None = None):
    from .config.parse import parse_config

    overrides = [f"model_name_or_path={model}"] if model else []
    if adapter:
        overrides.append(f"adapter_name_or_path={adapter}")
    return parse_config({}, overrides + list(extra or []))


def _cmd_chat(args: argparse.Namespace) -> int:
    _import_training_stack()
    from .chat import chat

    config = _model_args(args.model, args.adapter, args.overrides)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()] if args.tools else None
    # `default_system` (with `template`) is the system prompt when `--system` gives none.
    system = args.system if args.system is not None else config.data.default_system
    chat(config.model, config.generating, prompt=args.prompt, system=system, template=config.data.template,
         images=args.image, tools=tools, environment_factory=args.environment_factory)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    if args.gguf_type != "f16" and args.format != "gguf":
        raise ConfigError("--gguf-type applies to --format gguf; add --format gguf.")
    _import_training_stack()
    from .export import export_model

    config = _model_args(args.model, args.adapter)
    gguf_type = args.gguf_type if args.format == "gguf" else None
    path = export_model(config.model, args.export_dir, force=args.force, gguf_type=gguf_type, ollama=args.ollama)
    print(f"Exported to {path}")
    return 0


def _cmd_api(args: argparse.Namespace) -> int:
    from .serve import check_installed, parse_adapters, serve

    check_installed()
    _import_training_stack()
    adapters = parse_adapters(args.adapter or [])
    config = _model_args(args.model, None, args.overrides)
    base_id = args.model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                  else "SmolLM2-135M-Instruct")
    serve(config.model, adapters, template=config.data.template, default_system=config.data.default_system,
          base_id=base_id, host=args.host, port=args.port,
          api_key=args.api_key or os.environ.get("ALIGNKIT_API_KEY") or None,
          max_tokens=config.generating.max_new_tokens, max_batch_rows=args.max_batch_rows, max_queue=args.max_queue)
    return 0


def _cmd_score(args: argparse.Namespace) -> int:
    _import_training_stack()
    from .config import DataArguments
    from .score import score_file

    output = args.output or os.path.splitext(args.input)[0] + ".scored.jsonl"
    cutoff_len = DataArguments().cutoff_len if args.cutoff_len is None else args.cutoff_len
    score_file(args.model, args.input, output, batch_size=args.batch_size, cutoff_len=cutoff_len,
               template=args.template)
    print(f"Scores written to {output}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    if args.tasks:
        return _eval_tasks(args)
    if not args.dataset or not args.reward:
        raise ConfigError("alignkit eval needs --dataset and --reward (mean rewards), or --tasks (lm-eval "
                          "benchmarks).")
    from dataclasses import fields

    _import_training_stack()
    from .evaluate import TOOL_KEYS, default_dataset_dir, evaluate_rewards, reward_arguments, tool_arguments
    from .config.parse import parse_override
    from .rewards import RewardFunctionArguments

    reward_keys = {f.name for f in fields(RewardFunctionArguments)}
    reward_settings, tool_settings, config_overrides = {}, {}, []
    for item in args.overrides:
        key, value = parse_override(item)
        if key in reward_keys:
            reward_settings[key] = value
        elif key in TOOL_KEYS:
            tool_settings[key] = value
        else:
            config_overrides.append(item)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()] if args.tools else []
    environment_factory = args.environment_factory
    if tool_settings and not (tools or environment_factory):
        raise ConfigError(f"alignkit eval: {', '.join(sorted(tool_settings))} apply to the tool loop; add --tools "
                          "file.py:function or --environment-factory file.py:Class.")
    tool_args = tool_arguments(tools, tool_settings, environment_factory) if tools or environment_factory else None
    if args.reward_weights:
        reward_settings["reward_weights"] = args.reward_weights
    reward_args = reward_arguments(args.reward, reward_settings)
    for key, value in (("dataset", args.dataset), ("template", args.template), ("max_new_tokens", args.max_new_tokens),
                       ("max_samples", args.max_samples), ("cutoff_len", args.cutoff_len)):
        if value is not None:
            config_overrides.append(f"{key}={value}")
    config_overrides.append(f"dataset_dir={args.dataset_dir or default_dataset_dir(args.dataset)}")
    config = _model_args(args.model, args.adapter, config_overrides)
    result = evaluate_rewards(config, reward_args, batch_size=args.batch_size or REWARD_EVAL_BATCH_SIZE,
                              output=args.output, kl_reference=args.kl_reference, tool_args=tool_args)
    adapter = f" + {args.adapter}" if args.adapter else ""
    with_tools = ""
    if tool_args is not None:
        cap = tool_args.max_tool_calling_iterations
        turns = f"at most {cap} tool turns" if cap is not None else "no cap on tool turns"
        used = tools + ([f"environment {environment_factory}"] if environment_factory else [])
        with_tools = f", tools {', '.join(used)} ({turns}, tool_timeout {tool_args.tool_timeout:g} s)"
    precision = ", bf16" if config.training.bf16 is True else ""
    print(f"eval: {result.num_rows} prompts of {args.dataset}, model {config.model.model_name_or_path or 'bundled'}"
          f"{adapter}, greedy{precision}, max_new_tokens {config.generating.max_new_tokens}{with_tools}")
    print(result.summary())
    if args.output:
        print(f"Per-row completions and rewards written to {args.output}")
    _report_evaluation(config, result.metrics())
    return 0


def _report_evaluation(config, metrics: dict[str, float]) -> None:
    """`alignkit eval`'s result to the trackers of `report_to=...` (none by default; docs/trackers.md)."""
    from .trackers import report_evaluation

    sent = report_evaluation(config.training, metrics)
    if sent:
        print(f"Sent {len(sent)} metrics to {', '.join(config.training.report_to)} (run {config.training.output_dir})")


def _eval_tasks(args: argparse.Namespace) -> int:
    _import_training_stack()
    from .benchmark import check_installed, run_tasks

    check_installed()
    tasks = [task.strip() for item in args.tasks for task in item.split(",") if task.strip()]
    given_output_dir = any(item.split("=", 1)[0].strip() == "output_dir" for item in args.overrides)
    config = _model_args(args.model, args.adapter, args.overrides + (
        [f"output_dir={args.output_dir}"] if args.output_dir and not given_output_dir else []))
    scores = run_tasks(config.model, tasks, limit=args.max_samples, batch_size=args.batch_size or TASKS_BATCH_SIZE,
                       output_dir=args.output_dir)
    adapter = f" + {args.adapter}" if args.adapter else ""
    print(f"eval: lm-eval tasks on model {config.model.model_name_or_path or 'bundled'}{adapter}"
          + (f", first {args.max_samples} documents each" if args.max_samples else ""))
    for task, metrics in scores.items():
        shown = ", ".join(f"{name} {value:.4f}" for name, value in metrics.items() if name != "sample_len")
        print(f"  {task}: {shown}")
    if args.output_dir:
        print(f"Scores written to {os.path.join(args.output_dir, 'eval_results.json')}")
    _report_evaluation(config, {f"{task}/{name}": value for task, metrics in scores.items()
                                for name, value in metrics.items() if name != "sample_len"})
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    _import_training_stack()
    from .demo import run_demo

    run_demo(output_dir=args.output_dir, steps=args.steps)
    return 0


def _cmd_board(args: argparse.Namespace) -> int:
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise ConfigError("alignkit board needs Gradio: pip install 'alignkit[board]' (bash scripts/test.sh "
                          "installs it; scripts/demo.sh does not).") from None
    from .board.app import serve

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger(__name__).warning(
            "alignkit board on %s: anyone who can reach this address can start and stop training runs and read "
            "the runs under %s. The board has no login; keep it on 127.0.0.1 and use an SSH tunnel instead.",
            args.host, args.runs)
    serve(args.runs, host=args.host, port=args.port)
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
    p.add_argument("--nproc", type=int, default=None,
                   help="start N data-parallel processes on this machine through torchrun (FORCE_TORCHRUN=1 with "
                   "NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT does the same)")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("chat", help="chat with a model (interactive, streaming)")
    p.add_argument("--model", help="model directory or hub id (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--adapter", help="LoRA adapter directory (comma-separated for several)")
    p.add_argument("--prompt", help="answer this one prompt and exit")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--image", action="append", help="an image file for the first message (repeat for several; a "
                   "vision-language model, docs/multimodal.md)")
    p.add_argument("--tools", help="Python functions the model may call, comma-separated file.py:function or "
                                   "module:function (as GRPO's `tools`; docs/stages/tools.md)")
    p.add_argument("--environment-factory", help="file.py:Class or module:Class, as GRPO's `environment_factory`: one "
                   "instance for the conversation, reset(prompt=...) at its first message (a string it returns is "
                   "appended to that message; again after `clear`), its public methods the model's tools")
    p.add_argument("overrides", nargs="*", help="settings as key=value (e.g. max_new_tokens=64 template=chatml)")
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("export", help="merge a LoRA adapter into its base and save a standalone model")
    p.add_argument("--model", help="base model directory or hub id (default: the bundled model)")
    p.add_argument("--adapter", help="adapter directory (comma-separated for several)")
    p.add_argument("--export-dir", required=True, help="where to write the merged model")
    p.add_argument("--force", action="store_true",
                   help="replace the model files of a non-empty export directory (its other files stay)")
    p.add_argument("--format", choices=["hf", "gguf"], default="hf",
                   help="hf: a transformers model folder; gguf: that folder and one GGUF file for llama.cpp/Ollama "
                   "(llama/SmolLM2, qwen2, qwen3)")
    p.add_argument("--gguf-type", choices=["f32", "f16", "q8_0"], default="f16",
                   help="tensor type of the GGUF file (default %(default)s)")
    p.add_argument("--ollama", action="store_true",
                   help="with --format gguf, also write an Ollama Modelfile (chat template and stop tokens)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("api", help="an OpenAI-compatible server (/v1/chat/completions) for a model and its adapters")
    p.add_argument("--model", help="base model directory or hub id (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--adapter", action="append", metavar="NAME=DIR",
                   help="serve a LoRA adapter as model id NAME (repeatable)")
    p.add_argument("--model-name", help="the base model's id (default: the --model folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` (default: $ALIGNKIT_API_KEY, else none)")
    p.add_argument("--max-batch-rows", type=int, default=16, help="most completions decoded together "
                   "(default %(default)s)")
    p.add_argument("--max-queue", type=int, default=64, help="most requests waiting; more get HTTP 429 "
                   "(default %(default)s)")
    p.add_argument("overrides", nargs="*", help="settings as key=value: template=chatml, max_new_tokens=256 (a "
                   "request's max_tokens when it gives none), infer_dtype=...")
    p.set_defaults(func=_cmd_api)

    p = sub.add_parser("score", help="score prompt/response pairs with a trained reward model")
    p.add_argument("--model", required=True, help="reward model directory (adapter or exported model)")
    p.add_argument("--input", required=True, help="jsonl with prompt + response, or messages")
    p.add_argument("--output", help="where to write the scores (default: INPUT.scored.jsonl)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--cutoff-len", type=int,
                   help="most tokens per sequence, as the config's cutoff_len (default: cutoff_len's default)")
    p.add_argument("--template", default=None, help="chat template (default: the tokenizer's own)")
    p.set_defaults(func=_cmd_score)

    p = sub.add_parser("eval", help="mean reward of a model or adapter on held-out prompts, greedy (before/after RL)")
    p.add_argument("--model", help="model directory or hub id (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--adapter", help="LoRA adapter directory to evaluate (e.g. a grpo run's output_dir)")
    p.add_argument("--tasks", action="append", help="instead of rewards: lm-evaluation-harness tasks (the lm-eval "
                   "extra), names or task YAML files, comma-separated or repeated; demo_reply_choice is shipped")
    p.add_argument("--output-dir", help="with --tasks: write eval_results.json there")
    p.add_argument("--dataset", help="prompts: a name in dataset_info.json or a file "
                   "(e.g. demo_math_eval); every other column (answer) reaches the reward functions")
    p.add_argument("--dataset-dir", help="folder with dataset_info.json (default: ./data, else the checkout's data/)")
    p.add_argument("--reward", action="append",
                   help="reward spec, repeatable: accuracy, format, length, module:function, file.py:function, "
                   "or a reward model directory")
    p.add_argument("--reward-weights", help="comma-separated weights of the weighted sum (default all 1)")
    p.add_argument("--max-new-tokens", type=int, help="most tokens per completion; use the run's "
                   "max_completion_length (default: max_new_tokens' default, 512)")
    p.add_argument("--batch-size", type=int, default=None, help="most prompts generated together (default "
                   f"{REWARD_EVAL_BATCH_SIZE}; with --tasks, lm-eval's batch: {TASKS_BATCH_SIZE})")
    p.add_argument("--max-samples", type=int, help="evaluate only the first N prompts (with --tasks: documents "
                   "of each task)")
    p.add_argument("--cutoff-len", type=int, help="most prompt tokens (default: cutoff_len's default)")
    p.add_argument("--template", help="chat template (default: the tokenizer's own)")
    p.add_argument("--output", help="write one jsonl line per prompt: completion, columns, rewards")
    p.add_argument("--kl-reference", help="also report the KL of the model to this reference on its answers: "
                   "adapter directory (e.g. the SFT adapter a PPO run started from), or `base`")
    p.add_argument("--tools", help="answer through GRPO's tool loop with these Python functions, comma-separated "
                   "file.py:function or module:function (docs/stages/tools.md); reports tool calls and their success "
                   "rate too. The loop's limits as the run's keys: max_tool_calling_iterations=N tool_timeout=S "
                   "max_tool_output_chars=N")
    p.add_argument("--environment-factory", help="answer through the tool loop with this environment, file.py:Class "
                   "or module:Class (as GRPO's `environment_factory`; alone or with --tools): each prompt gets its own "
                   "instance, reset with the row's columns and prompt; its public methods are tools and the reward "
                   "functions get the instances as `environments`")
    p.add_argument("overrides", nargs="*", help="more settings as key=value, e.g. format_reward_pattern=... "
                   "length_reward_window=64")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("demo", help="a short LoRA fine-tune of the bundled model, answers before and after")
    p.add_argument("--output-dir", default="saves/demo", help="where the adapter goes (under saves/, where alignkit "
                   "board looks)")
    p.add_argument("--steps", type=int, default=None, help="override the number of SFT steps")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("board", help="local web page: launch, watch, compare and stop runs, chat with their models")
    p.add_argument("--runs", default="saves", help="folder whose runs the board shows and writes; nothing "
                   "outside it is read or written (default %(default)s, where the examples write)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default %(default)s)")
    p.set_defaults(func=_cmd_board)

    p = sub.add_parser("env", help="print versions and device")
    p.set_defaults(func=_cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `alignkit` console script; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    # argparse ends a positional list at the first option, so `train CONFIG --nproc 2 key=value` would leave
    # `key=value` over; key=value words after an option are overrides all the same.
    if unknown and hasattr(args, "overrides") and not any(word.startswith("-") for word in unknown):
        args.overrides = [*args.overrides, *unknown]
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    _configure_logging()
    if args.func is not _cmd_train:
        silence_deepspeed_cpu_notice()  # only `train` runs DeepSpeed; it decides once it has read the config
    try:
        return args.func(args)
    except (ConfigError, DataError, RewardFunctionError, TrainingDiverged, FileExistsError, FileNotFoundError) as err:
        # Raised where input enters, with a message written for the user; anything else is a bug
        # and keeps its traceback. A worker of `--nproc` leaves it to the launching process to print once.
        from .launch import report_worker_error

        if not report_worker_error(str(err)):
            print(f"alignkit: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
