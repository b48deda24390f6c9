"""One benchmark run in a fresh process: `python -m bench.worker --tool alignkit|trl|llamafactory ...` prints one
JSON line. LLaMA-Factory runs use its own environment's python (`bench.llamafactory`); this module imports only
the standard library at the top so that it loads there too.

All three tools train with `transformers.Trainer` subclasses, so the same callback measures each of them:
- step time: `on_step_end` timestamps; step k lasted t[k] - t[k-1] (t[-1] = `on_train_begin`); the first
  `--warmup` steps (allocator growth, lazy initialisation) are left out;
- real tokens: the training dataloader's collate function is wrapped at `on_train_begin`, and each batch's
  tokens are counted from its attention masks (every tensor whose key ends in `attention_mask`); a
  padding-free batch has no mask and no padding, so its `input_ids` are all counted. Batch k belongs to step k
  (one micro-batch per step). Collator calls outside the training loop (TRL's reference precomputation)
  are not counted, because that loop uses its own dataloader;
- peak resident memory of the whole process: `getrusage(RUSAGE_SELF).ru_maxrss`;
- online stages (GRPO, RLOO, distillation, online DPO; `ONLINE_STAGES`): each generation call is timed
  (alignkit's `sample_completions`; TRL's `_generate_single_turn`, or `_generate` for its experimental online DPO)
  with the tokens it generated; their batches are raw prompt rows, so tokens/s is not counted, completions/s is
  (`--batch` completions per step, one generation batch per step);
- precision: at `on_train_begin` the run records `bf16` autocast from the Trainer's arguments and the dtypes of the
  model's frozen weights (elements per dtype: a 4-bit base shows as uint8); a run that autocasts or whose frozen
  weights are mostly bf16 is `bf16`, otherwise `fp32`, and its MFU is taken against the matmul probe of that
  precision;
- losses: the Trainer's own `log_history` (logging every step);
- PPO (alignkit only): a step is one rollout and its `ppo_epochs` passes; its split into generation, scoring
  (reward model and the rollout's policy, critic and reference passes) and training is the stage's own
  `time/generation`, `time/scoring`, `time/training` log entries; the reward model is a LoRA reward adapter
  (fresh adapter, seeded score head) on the same base, as `examples/ppo_lora.yaml` uses one (`ppo_reward_model`).

`--matmul` instead times a large square `torch.mm` at the same thread count (`--matmul-dtype`: float32 or
bfloat16): the machine's limit in that precision.

Everything the libraries print goes to stderr, so stdout carries exactly one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Settings used in every run of both tools, beyond the shared ones passed on the command line. They are
# measurement settings (log every step to read the losses; never save checkpoints mid-run; no reporters).
COMMON_TRAINING = {"logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": 42,
                   "gradient_accumulation_steps": 1, "dataloader_num_workers": 0, "warmup_steps": 0}

# TRL's faster settings, per stage. "default" is TRL 1.16's own defaults (bf16 aside).
# SFT: padding-free batches (TRL requires max_length=None with it; the data is already fitted to the cutoff,
# so nothing would be truncated anyway). DPO: reference log-probs computed once before training.
# Both also turn off gradient checkpointing, which TRL enables by default and which only saves memory.
TRL_BEST = {
    "sft": {"padding_free": True, "max_length": None, "gradient_checkpointing": False},
    "rm": {"gradient_checkpointing": False},
    "dpo": {"precompute_ref_log_probs": True, "gradient_checkpointing": False},
    "grpo": {"gradient_checkpointing": False},
    "rloo": {"gradient_checkpointing": False},
    "distill": {"gradient_checkpointing": False},
    "online_dpo": {"gradient_checkpointing": False},
    "grpo_tools": {"gradient_checkpointing": False},
}

# Stages whose step starts by sampling completions: measured in completions/s with the step split into
# generation and training. `completions_per_prompt` says how a step's `--batch` completions are grouped.
ONLINE_STAGES = ("grpo", "rloo", "distill", "online_dpo", "grpo_tools")
# `grpo_tools`: GRPO whose rollouts may call the calculator (`bench.workloads.CALCULATOR`), at most this many tool
# turns per completion, in both tools; alignkit runs it as `stage: grpo` with `tools`, TRL as GRPOTrainer(tools=...).
TOOL_ITERATIONS = 2


def completions_per_prompt(stage: str, num_generations: int) -> int:
    """Completions sampled per prompt in one step: `num_generations` (GRPO, RLOO, GRPO with tools), 1 (distillation:
    the student answers each prompt once), 2 (online DPO: a pair per prompt)."""
    return {"grpo": num_generations, "rloo": num_generations, "distill": 1, "online_dpo": 2,
            "grpo_tools": num_generations}[stage]


class StepRecorder:
    """Trainer callback: step-end timestamps and real tokens per consumed batch (see the module docstring)."""

    def __init__(self) -> None:
        self.train_begin = 0.0
        self.step_ends: list[float] = []
        self.batch_tokens: list[int | None] = []  # None for a batch of raw rows (GRPO prompts)
        # The tokens the model ran per batch where fewer than `batch_tokens` (alignkit's shared prefixes), else equal.
        self.computed_tokens: list[int | None] = []
        self.threads_at_begin = 0
        # Batches collated per optimizer step (`gradient_accumulation_steps` of an offline stage; 1 otherwise).
        self.batches_per_step = 1
        # What the run computed in: Trainer's bf16 (autocast) and the frozen weights' dtypes, at train begin.
        self.precision: dict[str, Any] = {}
        # Online stages: one entry per generation call (seconds, new tokens generated, the step it ran in: a tool
        # rollout calls once per turn).
        self.generation_s: list[float] = []
        self.generated_tokens: list[int] = []
        self.generation_steps: list[int] = []

    def timed_generation(self, generate, count_tokens):
        """Wrap `generate` so each call's wall time and generated tokens (`count_tokens(output)`) are recorded."""
        def timed(*args, **kwargs):
            start = time.perf_counter()
            output = generate(*args, **kwargs)
            self.generation_s.append(time.perf_counter() - start)
            self.generated_tokens.append(int(count_tokens(output)))
            self.generation_steps.append(len(self.step_ends))  # steps finished before this call
            return output

        return timed


def count_real_tokens(batch: dict[str, Any]) -> int:
    """Real (non-pad) tokens of one collated batch, from its attention masks; all `input_ids` if it has none."""
    masks = [v for k, v in batch.items() if k.endswith("attention_mask") and hasattr(v, "sum")]
    if masks:
        return int(sum(int(m.sum()) for m in masks))
    ids = [v for k, v in batch.items() if k.endswith("input_ids") and hasattr(v, "numel")]
    if not ids:
        raise KeyError(f"cannot count tokens: batch keys {sorted(batch)} have no attention mask or input_ids.")
    return int(sum(int(t.numel()) for t in ids))


def count_computed_tokens(batch: dict[str, Any]) -> int:
    """The tokens alignkit's padding-free forward runs for a batch: each forward's (`input_ids`, `kl_input_ids`) real
    tokens less the prefixes its sequences share with earlier ones (`alignkit.model.padding_free.shared_prefixes`,
    which such a forward runs once). For a preference batch the pairs' prompts count once, for a chat batch the
    system prompt."""
    from alignkit.model.padding_free import shared_prefixes

    total = 0
    for key in [k for k in batch if k.endswith("input_ids")]:
        real = batch[key.replace("input_ids", "attention_mask")].bool()
        lengths = real.sum(-1)
        total += int(lengths.sum() - shared_prefixes(batch[key][real], lengths)[1].sum())
    return total


def shares_prefixes(args, model) -> bool:
    """Whether a run's forwards share prefixes: alignkit's padding-free path under per-sequence attention, which
    the sft (training steps), rm, dpo and kto stages build their forwards with."""
    from alignkit.model.padding_free import uses_per_sequence_attention

    return (type(args).__module__.startswith("alignkit.") and bool(getattr(args, "padding_free", False))
            and model is not None and uses_per_sequence_attention(model))


def run_precision(bf16_autocast: bool, frozen_dtypes: dict[str, int]) -> str:
    """"bf16" when the run autocasts to bf16 or most of its frozen weights (by element count) are bf16, else
    "fp32": the matmul probe its MFU is measured against.

    Example: autocast off, frozen {"bfloat16": 900, "float32": 100} (TRL loading a bf16 checkpoint) -> "bf16";
    frozen {"uint8": 500, "float32": 300} (a 4-bit base computing in fp32) -> "fp32"."""
    main = max(frozen_dtypes, key=frozen_dtypes.get) if frozen_dtypes else None
    return "bf16" if bf16_autocast or main == "bfloat16" else "fp32"


def record_precision(recorder: StepRecorder, args, model) -> None:
    """Store the run's precision (`run_precision`) from the Trainer's arguments and the model's frozen weights."""
    frozen: dict[str, int] = {}
    for param in model.parameters() if model is not None else ():
        if not param.requires_grad:
            name = str(param.dtype).replace("torch.", "")
            frozen[name] = frozen.get(name, 0) + param.numel()
    bf16 = bool(getattr(args, "bf16", False))
    recorder.precision = {"bf16_autocast": bf16, "frozen_weights_dtypes": frozen,
                          "precision": run_precision(bf16, frozen)}


def make_callback(recorder: StepRecorder, count_tokens: bool = True, stage_shares_prefixes: bool = False):
    """The TrainerCallback feeding `recorder` (built here so that `--matmul` never imports transformers).

    `count_tokens=False` (online stages, whose batches are prompt rows) records None for every batch.
    `stage_shares_prefixes`: the stage's forwards share prefixes where the run allows (`shares_prefixes`); the
    tokens they run are then counted apart (`count_computed_tokens`), for MFU."""
    import torch
    from transformers import TrainerCallback

    class _Callback(TrainerCallback):
        def on_train_begin(self, args, state, control, train_dataloader=None, model=None, **kwargs):
            recorder.threads_at_begin = torch.get_num_threads()
            record_precision(recorder, args, model)
            if count_tokens:  # the Trainer collates this many micro-batches for each step
                recorder.batches_per_step = max(int(args.gradient_accumulation_steps), 1)
            if train_dataloader is None:
                raise RuntimeError("the Trainer did not pass train_dataloader to callbacks; cannot count tokens.")
            loader = getattr(train_dataloader, "base_dataloader", train_dataloader)  # accelerate's wrapper
            collate = loader.collate_fn
            sharing = stage_shares_prefixes and shares_prefixes(args, model)

            def counting_collate(examples):
                batch = collate(examples)
                # A Mapping, not only a dict: LLaMA-Factory's collators return transformers' BatchEncoding.
                tokens = count_real_tokens(batch) if count_tokens and isinstance(batch, Mapping) else None
                recorder.batch_tokens.append(tokens)
                recorder.computed_tokens.append(count_computed_tokens(batch) if sharing and tokens else tokens)
                return batch

            loader.collate_fn = counting_collate
            recorder.train_begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if args.device.type == "cuda":
                torch.cuda.synchronize()
            recorder.step_ends.append(time.perf_counter())

    callback = _Callback()
    callback.recorder = recorder  # runners that time generation reach the recorder through the callback
    return callback


def per_step(batch_counts: list[int | None], batches_per_step: int) -> list[int | None]:
    """Per-batch token counts summed over each step's `batches_per_step` micro-batches (None if any is None); a
    trailing incomplete group is dropped.

    Example: [3, 4, 5, None, 6], 2 -> [7, None]."""
    groups = [batch_counts[i:i + batches_per_step]
              for i in range(0, len(batch_counts) - batches_per_step + 1, batches_per_step)]
    return [None if any(count is None for count in group) else sum(group) for group in groups]


def summarise(recorder: StepRecorder, log_history: list[dict[str, Any]], warmup: int,
              completions_per_step: int | None = None) -> dict[str, Any]:
    """Per-run figures from the recorded timestamps, token counts and the Trainer's log history."""
    stamps = [recorder.train_begin] + recorder.step_ends
    durations = [b - a for a, b in zip(stamps, stamps[1:])]
    steps = len(durations)
    measured = list(range(min(warmup, max(steps - 1, 0)), steps))  # keep at least one step
    tokens = per_step(recorder.batch_tokens, recorder.batches_per_step)[:steps]
    if len(tokens) < steps:
        raise RuntimeError(f"counted {len(tokens)} batches for {steps} steps; the token counter missed batches.")
    time_measured = sum(durations[i] for i in measured)
    counted = all(tokens[i] is not None for i in measured)
    tokens_measured = sum(tokens[i] for i in measured) if counted else None
    computed = per_step(recorder.computed_tokens, recorder.batches_per_step)[:steps]
    computed_measured = (sum(computed[i] for i in measured)
                         if counted and len(computed) == steps and all(computed[i] is not None for i in measured)
                         else tokens_measured)
    losses = [h["loss"] for h in log_history if "loss" in h]
    out = {
        "steps": steps,
        "measured_steps": len(measured),
        "step_times_s": [round(d, 4) for d in durations],
        "tokens_per_step": tokens,
        "step_time_s": time_measured / len(measured) if measured else None,
        "tokens_per_s": tokens_measured / time_measured if counted and time_measured > 0 else None,
        # The tokens the model ran per second (fewer than tokens_per_s where prefixes are shared): MFU's basis.
        "computed_tokens_per_s": computed_measured / time_measured if counted and time_measured > 0 else None,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
    }
    if recorder.generation_s:
        out.update(summarise_generation(recorder, measured, time_measured, completions_per_step))
    calls = [h["tools/call_frequency"] for h in log_history if "tools/call_frequency" in h]
    if calls:  # a tool rollout: how often the policy called, so the two tools' workloads can be compared
        failures = [h.get("tools/failure_frequency", 0.0) for h in log_history if "tools/call_frequency" in h]
        out.update(tool_calls_per_completion=sum(calls) / len(calls),
                   tool_failure_frequency=sum(failures) / len(failures))
    return out


def summarise_generation(recorder: StepRecorder, measured: list[int], time_measured: float,
                         completions_per_step: int | None) -> dict[str, Any]:
    """Online-stage figures: each generation call belongs to the step it ran in (`StepRecorder.generation_steps`; one
    generation batch per step, GA 1), a tool rollout's several calls (one per turn) summed.

    Example: measured steps of 10 s and 12 s with generation calls of 6 s and 8 s, 8 completions per step:
    completions/s = 16 / 22 = 0.727; generation 7 s/step, training 11 - 7 = 4 s/step. With calls of 4 + 2 s in the
    first of them (two turns), the same.
    """
    steps = recorder.generation_steps or list(range(len(recorder.generation_s)))
    seconds, tokens = [0.0] * (max(steps) + 1), [0] * (max(steps) + 1)
    for step, spent, generated in zip(steps, recorder.generation_s, recorder.generated_tokens):
        seconds[step] += spent
        tokens[step] += generated
    if len(seconds) < max(measured) + 1 or any(seconds[i] == 0 for i in measured):
        raise RuntimeError(f"generation calls in steps {sorted(set(steps))} for {max(measured) + 1} steps: expected "
                           "generation in every step (gradient_accumulation_steps 1, steps_per_generation 1).")
    generation = sum(seconds[i] for i in measured) / len(measured)
    generated = sum(tokens[i] for i in measured)
    step_time = time_measured / len(measured)
    return {
        "generation_s_per_step": [round(t, 4) for t in seconds],
        "generated_tokens_per_step": tokens,
        "generation_calls": len(recorder.generation_s),
        "generation_s": generation,
        "training_s": step_time - generation,
        "completions_per_s": completions_per_step * len(measured) / time_measured if completions_per_step else None,
        "generated_tokens_per_s": generated / time_measured if time_measured > 0 else None,
    }


def run_alignkit(opts: argparse.Namespace, callback) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train with `alignkit.train.run_train`; returns (log_history, settings used)."""
    from alignkit.config.parse import parse_config
    from alignkit.train import run_train

    values: dict[str, Any] = {
        "stage": opts.stage,
        "model_name_or_path": opts.model_dir,
        "dataset": opts.alignkit_dataset,
        "dataset_dir": opts.alignkit_dataset_dir,
        "cutoff_len": opts.cutoff,
        "finetuning_type": "lora",
        "lora_rank": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "lora_target": "all",
        "output_dir": opts.output_dir,
        "overwrite_output_dir": True,
        "do_train": True,
        "per_device_train_batch_size": opts.batch,
        "max_steps": opts.steps,
        "learning_rate": opts.lr,
        # alignkit already defaults to report_to none; passing the string would read as YAML null.
        **{k: v for k, v in COMMON_TRAINING.items() if k != "report_to"},
    }
    values.update(alignkit_stage_settings(opts))
    if opts.stage in ONLINE_STAGES:
        import alignkit.stages.online as online

        online.sample_completions = callback.recorder.timed_generation(  # what `OnlineTrainer.sample` calls
            online.sample_completions, lambda generation: generation.completion_mask.sum())
    if opts.stage == "ppo":
        values.update(ppo_settings(opts))
    if opts.device == "cuda":
        # Same as the TRL side: fp32 master weights under bf16 autocast.
        values.update(bf16=True, infer_dtype="float32")
    else:
        # --alignkit-bf16: auto (alignkit's own choice, its config default), false (fp32) or true (bf16 autocast
        # where the CPU has bf16).
        values.update(bf16={"false": False, "true": True}.get(opts.alignkit_bf16, opts.alignkit_bf16), use_cpu=True)
    if opts.variant == "qlora":
        values.update(QLORA)
    values.update(_parse_extra(opts.extra))
    config = parse_config(values)
    histories: list[list[dict[str, Any]]] = []

    from transformers import TrainerCallback

    class _History(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            histories.append(list(state.log_history))

    run_train(config, callbacks=[callback, _History()])
    return (histories[-1] if histories else []), values


# The `alignkit_qlora` variant: LLaMA-Factory's QLoRA keys (its examples/train_qlora), a 4-bit NF4 base under the
# same LoRA adapter. The adapter and its optimizer stay fp32.
QLORA = {"quantization_bit": 4, "quantization_method": "bnb", "quantization_type": "nf4", "double_quantization": True}


def alignkit_stage_settings(opts: argparse.Namespace) -> dict[str, Any]:
    """alignkit's stage keys for a run beyond the shared ones; the online stages' mirror `trl_stage_settings`.

    Online stages take `--batch` completions per step (`completions_per_prompt` per prompt) and the same reward
    function object TRL gets, named by module path (`bench.workloads:bench_reward`); the distillation teacher is the
    model itself, loaded as a second frozen copy in both tools (the cost does not depend on the teacher's weights).
    Every other key keeps its TRL 1.16 default on both sides.

    Example: stage online_dpo, --batch 8, --max-completion-length 32: 4 prompts x 2 answers of at most 32 tokens.
    """
    if opts.stage == "dpo":
        return {"pref_beta": 0.1}  # TRL's DPOConfig default, written out so both sides agree
    if opts.stage in ("grpo", "rloo"):
        return {"reward_funcs": "bench.workloads:bench_reward", "num_generations": opts.num_generations,
                "max_completion_length": opts.max_completion_length}
    if opts.stage == "grpo_tools":  # no `template`: the tokenizer's own (Qwen2.5's, `workloads.tool_model_dir`)
        from bench.workloads import CALCULATOR

        return {"stage": "grpo", "reward_funcs": "bench.workloads:bench_reward", "tools": f"{CALCULATOR}:calculate",
                "max_tool_calling_iterations": TOOL_ITERATIONS, "num_generations": opts.num_generations,
                "max_completion_length": opts.max_completion_length}
    if opts.stage == "distill":
        return {"teacher_model_name_or_path": opts.model_dir, "max_completion_length": opts.max_completion_length}
    if opts.stage == "online_dpo":  # alignkit's batch counts prompts, two answers each
        return {"reward_funcs": "bench.workloads:bench_reward", "max_new_tokens": opts.max_completion_length,
                "per_device_train_batch_size": opts.batch // 2}
    return {}


def trl_stage_settings(opts: argparse.Namespace) -> dict[str, Any]:
    """TRL's config keys for a run beyond the shared ones (see `alignkit_stage_settings`): the online stages'
    completions per step and their length; `max_length` (the cutoff) for the others. Online prompts are not
    truncated (none reaches the cutoff); completions are capped."""
    if opts.stage in ("grpo", "rloo"):
        return {"num_generations": opts.num_generations, "max_completion_length": opts.max_completion_length}
    if opts.stage == "grpo_tools":
        return {"num_generations": opts.num_generations, "max_completion_length": opts.max_completion_length,
                "max_tool_calling_iterations": TOOL_ITERATIONS}
    if opts.stage == "distill":
        return {"max_completion_length": opts.max_completion_length}
    if opts.stage == "online_dpo":  # TRL's batch counts prompts too, two answers each
        return {"max_new_tokens": opts.max_completion_length, "per_device_train_batch_size": opts.batch // 2}
    return {"max_length": opts.cutoff}


def run_trl(opts: argparse.Namespace, callback) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train with TRL 1.16's trainer for the stage, with its defaults except precision; returns (history, settings)."""
    from datasets import load_dataset
    from peft import LoraConfig

    dataset = load_dataset("json", data_files=opts.trl_file, split="train")
    settings: dict[str, Any] = {
        "output_dir": opts.output_dir,
        "per_device_train_batch_size": opts.batch,
        "max_steps": opts.steps,
        "learning_rate": opts.lr,
        **COMMON_TRAINING,
    }
    settings.update(trl_stage_settings(opts))
    if opts.device == "cuda":
        settings["bf16"] = True
    else:
        # "bf16": TRL's real default (its configs default to bf16=True: autocast on the CPU too); otherwise fp32.
        settings.update(bf16=opts.variant == "bf16", use_cpu=True)
    if opts.variant == "best":
        settings.update(TRL_BEST[opts.stage])
    settings.update(_parse_extra(opts.extra))
    lora = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}

    if opts.stage == "sft":
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=opts.model_dir, args=SFTConfig(**settings), train_dataset=dataset,
                             peft_config=LoraConfig(task_type="CAUSAL_LM", **lora), callbacks=[callback])
    elif opts.stage == "rm":
        from trl import RewardConfig, RewardTrainer

        # The score head is new, so it is trained in full beside the adapter, as alignkit does.
        trainer = RewardTrainer(model=opts.model_dir, args=RewardConfig(**settings), train_dataset=dataset,
                                peft_config=LoraConfig(task_type="SEQ_CLS", modules_to_save=["score"], **lora),
                                callbacks=[callback])
    elif opts.stage == "dpo":
        from trl import DPOConfig, DPOTrainer

        settings.setdefault("beta", 0.1)
        trainer = DPOTrainer(model=opts.model_dir, args=DPOConfig(**settings), train_dataset=dataset,
                             peft_config=LoraConfig(task_type="CAUSAL_LM", **lora), callbacks=[callback])
    elif opts.stage in ("grpo", "grpo_tools"):
        from trl import GRPOConfig, GRPOTrainer

        from bench.workloads import bench_reward, calculator_tool

        # With tools TRL calls `_generate_single_turn` once per turn; each call is timed and counted in its step.
        tools = {"tools": [calculator_tool()]} if opts.stage == "grpo_tools" else {}
        trainer = GRPOTrainer(model=opts.model_dir, reward_funcs=bench_reward, args=GRPOConfig(**settings),
                              train_dataset=dataset, peft_config=LoraConfig(task_type="CAUSAL_LM", **lora),
                              callbacks=[callback], **tools)
        trainer._generate_single_turn = callback.recorder.timed_generation(
            trainer._generate_single_turn, lambda output: sum(len(ids) for ids in output[0]))
    elif opts.stage == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        from bench.workloads import bench_reward

        trainer = RLOOTrainer(model=opts.model_dir, reward_funcs=bench_reward, args=RLOOConfig(**settings),
                              train_dataset=dataset, peft_config=LoraConfig(task_type="CAUSAL_LM", **lora),
                              callbacks=[callback])
        trainer._generate_single_turn = callback.recorder.timed_generation(  # returns the completion id lists
            trainer._generate_single_turn, lambda output: sum(len(ids) for ids in output))
    elif opts.stage == "distill":
        from trl import DistillationConfig, DistillationTrainer

        trainer = DistillationTrainer(model=opts.model_dir, teacher_model=opts.model_dir,
                                      args=DistillationConfig(**settings), train_dataset=dataset,
                                      peft_config=LoraConfig(task_type="CAUSAL_LM", **lora), callbacks=[callback])
        trainer._generate_single_turn = callback.recorder.timed_generation(
            trainer._generate_single_turn, lambda output: sum(len(ids) for ids in output))
    elif opts.stage == "online_dpo":
        from transformers import AutoTokenizer
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        from bench.workloads import bench_reward

        # Unlike the other trainers it does not load the tokenizer from the model's name itself.
        trainer = OnlineDPOTrainer(model=opts.model_dir, reward_funcs=bench_reward, args=OnlineDPOConfig(**settings),
                                   train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(opts.model_dir),
                                   peft_config=LoraConfig(task_type="CAUSAL_LM", **lora), callbacks=[callback])
        # (prompt_ids, prompt_mask, completion_ids, completion_mask, ...): both answers of every prompt, one call
        trainer._generate = callback.recorder.timed_generation(trainer._generate, lambda output: output[3].sum())
    else:
        raise ValueError(f"stage {opts.stage!r} has no TRL runner in the benchmark yet.")
    effective = {k: _jsonable(getattr(trainer.args, k)) for k in
                 ("gradient_checkpointing", "bf16", "max_length", "learning_rate", "lr_scheduler_type",
                  "per_device_train_batch_size", "padding_free", "precompute_ref_log_probs", "packing",
                  "beta", "loss_type", "disable_dropout", "num_generations", "max_completion_length",
                  "steps_per_generation", "temperature", "max_new_tokens") if hasattr(trainer.args, k)}
    trainer.train()
    return list(trainer.state.log_history), {"passed": {k: _jsonable(v) for k, v in settings.items()},
                                             "effective": effective}


def ppo_reward_model(model_dir: str, out_dir: str) -> str:
    """Save a reward model for the PPO benchmark: an rm-run-shaped LoRA adapter (task SEQ_CLS, the score head in
    modules_to_save) on `model_dir`, untrained but with a seeded score head, so scores differ between responses.
    PPO loads it as a second adapter on the policy's base, as with a trained RM; the cost does not depend on
    the weights. Returns its directory."""
    import torch

    from alignkit.config.parse import parse_config
    from alignkit.model.loader import load_model, save_base_adapters

    config = parse_config({"model_name_or_path": model_dir, "finetuning_type": "lora", "lora_rank": 8,
                           "lora_target": "all"})
    torch.manual_seed(0)
    model = load_model(config.model, config.finetuning, is_trainable=True, head="reward")
    model.save_pretrained(out_dir)
    save_base_adapters(model, out_dir)
    del model
    return out_dir


def ppo_settings(opts: argparse.Namespace) -> dict[str, Any]:
    """alignkit's PPO keys for a benchmark run: one response per prompt, `batch` prompts per step, at most
    `--max-completion-length` new tokens, the stage's defaults otherwise (4 passes per rollout, adaptive KL)."""
    reward_dir = ppo_reward_model(opts.model_dir, str(Path(opts.output_dir).parent / "ppo_reward_model"))
    return {"reward_model": reward_dir, "reward_model_type": "lora", "max_new_tokens": opts.max_completion_length,
            "lr_scheduler_type": "constant"}


def make_ppo_callback(recorder: StepRecorder):
    """The TrainerCallback of a PPO run: step-end timestamps only (PPO's loop has no training dataloader, so
    training tokens are not counted; its rollouts are timed by the stage itself)."""
    import torch
    from transformers import TrainerCallback

    class _Callback(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            recorder.threads_at_begin = torch.get_num_threads()
            record_precision(recorder, args, model)
            recorder.train_begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if args.device.type == "cuda":
                torch.cuda.synchronize()
            recorder.step_ends.append(time.perf_counter())
            recorder.batch_tokens.append(None)

    callback = _Callback()
    callback.recorder = recorder
    return callback


def summarise_ppo(recorder: StepRecorder, log_history: list[dict[str, Any]], warmup: int,
                  prompts_per_step: int) -> dict[str, Any]:
    """PPO figures: step time as for every stage, and the step's split from the stage's own log entries
    (logging every step, so entry k is step k).

    Example: measured steps of 10 s and 14 s, logged time/generation 4 and 6 s, time/scoring 1 and 1 s,
    time/training 4 and 6 s, 8 prompts per step: 16 responses / 24 s = 0.667 responses/s; generation 5 s/step,
    scoring 1, training 5.
    """
    out = summarise(recorder, log_history, warmup)
    steps = [h for h in log_history if "time/generation" in h]
    if len(steps) < out["steps"]:
        raise RuntimeError(f"{len(steps)} PPO log entries with time/generation for {out['steps']} steps: expected "
                           "one per step (logging_steps 1).")
    measured = range(out["steps"] - out["measured_steps"], out["steps"])
    time_measured = out["step_time_s"] * out["measured_steps"]
    split = {key: sum(steps[i][f"time/{key}"] for i in measured) / len(measured)
             for key in ("generation", "scoring", "training")}
    out.update({
        "generation_s_per_step": [round(h["time/generation"], 4) for h in steps],
        "generation_s": split["generation"],
        "scoring_s": split["scoring"],
        "training_s": split["training"],
        "responses_per_s": prompts_per_step * len(measured) / time_measured if time_measured > 0 else None,
        "response_length_mean": sum(steps[i]["completions/mean_length"] for i in measured) / len(measured),
        "final_loss": steps[-1].get("ppo/loss/total", out["final_loss"]),
    })
    return out


def run_llamafactory(opts: argparse.Namespace, callback) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train with LLaMA-Factory's `run_exp` (inside its own environment); returns (log_history, settings).

    The arguments come from `bench.llamafactory.lf_config`, the same dataset registry alignkit reads, and the
    same `StepRecorder` callback, which `run_exp` adds to LLaMA-Factory's own Trainer."""
    from llamafactory.train.tuner import run_exp
    from transformers import TrainerCallback

    from bench.llamafactory import lf_config

    config = lf_config(opts.stage, model_dir=opts.model_dir, dataset=opts.alignkit_dataset,
                       dataset_dir=opts.alignkit_dataset_dir, output_dir=opts.output_dir, batch=opts.batch,
                       steps=opts.steps, lr=opts.lr, cutoff=opts.cutoff, device=opts.device,
                       seed=COMMON_TRAINING["seed"])
    config.update(_parse_extra(opts.extra))
    histories: list[list[dict[str, Any]]] = []
    effective: dict[str, Any] = {}

    class _History(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            # What LLaMA-Factory's Trainer actually runs with, to check the translation took effect.
            effective.update({k: _jsonable(getattr(args, k, None)) for k in
                              ("gradient_checkpointing", "bf16", "learning_rate", "lr_scheduler_type",
                               "per_device_train_batch_size", "gradient_accumulation_steps", "warmup_steps",
                               "dataloader_num_workers", "seed", "max_steps")})
            if model is not None:
                effective["model_class"] = type(model).__name__
                effective["model_gradient_checkpointing"] = bool(getattr(model, "is_gradient_checkpointing", False))
                effective["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)

        def on_train_end(self, args, state, control, **kwargs):
            histories.append(list(state.log_history))

    run_exp(args=config, callbacks=[callback, _History()])
    return (histories[-1] if histories else []), {"passed": {k: _jsonable(v) for k, v in config.items()},
                                                  "effective": effective}


def _parse_extra(items: list[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for item in items or []:
        key, _, value = item.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def measure_matmul(size: int, device: str, seconds: float, dtype_name: str | None = None) -> dict[str, Any]:
    """Sustained square-matmul throughput in GFLOP/s (2*n^3 FLOPs per product); `dtype_name` float32 or
    bfloat16 (default: float32 on CPU, bfloat16 on CUDA)."""
    import torch

    dtype_name = dtype_name or ("bfloat16" if device == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):  # warm-up: thread pool start, allocator, clocks
        started = time.perf_counter()
        torch.mm(a, b)
        sync()
        if time.perf_counter() - started > seconds:
            break  # a product slower than the whole probe (bf16 without bf16 hardware: ~1 min): one is enough
    iterations, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        iterations += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and (iterations >= 3 or elapsed >= 3 * seconds):
            break
    return {"matmul_size": size, "matmul_dtype": str(dtype).replace("torch.", ""), "matmul_iterations": iterations,
            "matmul_gflops": 2 * size**3 * iterations / elapsed / 1e9}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__.splitlines()[0])
    p.add_argument("--tool", choices=["alignkit", "trl", "llamafactory"],
                   help="llamafactory: run with the LLaMA-Factory environment's python (bench.llamafactory).")
    p.add_argument("--variant", choices=["default", "best", "bf16", "qlora"], default="default",
                   help="TRL: its defaults in fp32 (default), its real default bf16=True (bf16), or its faster "
                        "settings (best, bench.worker.TRL_BEST); alignkit: fp32 LoRA (default) or a 4-bit base "
                        "(qlora, bench.worker.QLORA).")
    p.add_argument("--stage", choices=["sft", "rm", "dpo", "grpo", "rloo", "distill", "online_dpo", "ppo",
                                       "grpo_tools"])
    p.add_argument("--alignkit-bf16", choices=["false", "true", "auto"], default="auto",
                   help="alignkit on a CPU: its `bf16` key (auto: its own choice, the default; false: fp32; true: bf16 "
                        "autocast).")
    p.add_argument("--model-dir")
    p.add_argument("--alignkit-dataset", help="Name in dataset_info.json (alignkit and LLaMA-Factory read it).")
    p.add_argument("--alignkit-dataset-dir")
    p.add_argument("--trl-file")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cutoff", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--num-generations", type=int, default=4, help="GRPO, RLOO: completions per prompt.")
    p.add_argument("--max-completion-length", type=int, default=32,
                   help="Online stages: most new tokens per completion; PPO: per response (max_new_tokens).")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--output-dir", default=None, help="Trainer output_dir (default: a temporary directory).")
    p.add_argument("--extra", nargs="*", default=[], help="key=value training settings added for this run.")
    p.add_argument("--matmul", action="store_true", help="Only measure matmul throughput.")
    p.add_argument("--matmul-size", type=int, default=2048)
    p.add_argument("--matmul-dtype", choices=["float32", "bfloat16"], default=None,
                   help="Probe precision (default: float32 on a CPU, bfloat16 on CUDA).")
    p.add_argument("--matmul-seconds", type=float, default=4.0)
    opts = p.parse_args(argv)
    if not opts.matmul:
        missing = [name for name in ("tool", "stage", "model_dir") if getattr(opts, name) is None]
        if opts.tool in ("alignkit", "llamafactory") and not opts.alignkit_dataset:
            missing.append("alignkit_dataset")
        if opts.tool == "trl" and not opts.trl_file:
            missing.append("trl_file")
        if missing:
            p.error("missing " + ", ".join("--" + m.replace("_", "-") for m in missing))
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    # Keep stdout for the one result line: whatever the libraries print goes to stderr.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(opts.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch

    torch.set_num_threads(opts.threads)
    result: dict[str, Any] = {"tool": opts.tool, "variant": opts.variant, "stage": opts.stage, "ok": False}
    started = time.perf_counter()
    try:
        if opts.matmul:
            result = {"tool": "matmul", "ok": True, "threads": torch.get_num_threads(),
                      **measure_matmul(opts.matmul_size, opts.device, opts.matmul_seconds, opts.matmul_dtype)}
        else:
            if opts.device == "cuda" and not torch.cuda.is_available():
                raise RuntimeError("--device cuda was given but torch sees no CUDA device.")
            with tempfile.TemporaryDirectory(prefix="alignkit-bench-") as tmp:
                # Fresh caches per run: nothing tokenised or precomputed by an earlier run is reused.
                os.environ["HF_DATASETS_CACHE"] = str(Path(tmp) / "hf_datasets")
                os.environ["ALIGNKIT_DATA_CACHE"] = str(Path(tmp) / "alignkit_data")
                opts.output_dir = opts.output_dir or str(Path(tmp) / "out")
                if opts.stage == "grpo_tools":  # both tools render and parse calls with Qwen2.5's template
                    from bench.workloads import tool_model_dir

                    opts.model_dir = tool_model_dir(opts.model_dir, Path(tmp) / "tool_model")
                recorder = StepRecorder()
                callback = (make_ppo_callback(recorder) if opts.stage == "ppo"
                            else make_callback(recorder, count_tokens=opts.stage not in ONLINE_STAGES,
                                               stage_shares_prefixes=opts.stage in ("sft", "rm", "dpo", "kto")))
                runner = {"alignkit": run_alignkit, "trl": run_trl, "llamafactory": run_llamafactory}[opts.tool]
                history, settings = runner(opts, callback)
                if opts.stage == "ppo":
                    result.update(summarise_ppo(recorder, history, opts.warmup, prompts_per_step=opts.batch))
                else:
                    result.update(summarise(recorder, history, opts.warmup,
                                            completions_per_step=opts.batch if opts.stage in ONLINE_STAGES else None))
                result.update(ok=True, settings=settings, threads=torch.get_num_threads(),
                              threads_at_train_begin=recorder.threads_at_begin, **recorder.precision,
                              setup_s=recorder.train_begin - started if recorder.train_begin else None)
    except Exception as err:  # the orchestrator reports a failed run instead of stopping the benchmark
        result.update(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=8))
    result["wall_s"] = time.perf_counter() - started
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    if opts.device == "cuda":
        import torch

        if torch.cuda.is_available():
            result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    with os.fdopen(result_fd, "w") as out:
        out.write(json.dumps(result) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
