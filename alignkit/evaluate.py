"""`alignkit eval`: the mean of reward functions over a held-out prompt set, for a model or an adapter.

It answers "did RL training help?" the way training measured it: the same reward specs as `reward_funcs`
(built-ins, `module:function`, `file.py:function`, reward model directories), on prompts the run never
trained on, with greedy decoding so that two evaluations of one model agree. Run it before and after:

    alignkit eval --dataset demo_math_eval --reward accuracy
    alignkit eval --dataset demo_math_eval --reward accuracy --adapter saves/grpo_lora

Prompts go through the data layer as GRPO's do (`convert_dataset` to prompt examples, `encode_prompt`:
the template's rendering, left-truncated to `cutoff_len`), so every other column of a row (`answer`)
reaches the reward functions; completions come from the rollouts' decode loop
(`model.generation.generate_with_decode`: greedy, token for token `model.generate`'s, on oneDNN-packed
weights and a KV cache grown in place), stopping at the template's end of turn, and the `length` reward gets
their token ids and truncation flags.

With a reference (`kl_reference`, `alignkit eval --kl-reference DIR|base`) it also reports how far the model
moved from it on those answers: the KL divergence of the model's next-token distribution from the
reference's, over the whole vocabulary, summed over each answer's tokens (nats per answer). For a PPO or
GRPO adapter the reference is the model the run started from (the SFT adapter, or `base`), so the figure
sits beside the run's `objective/kl` (the same divergence, estimated from sampled tokens).

With tools (`alignkit eval --tools file.py:function`, and the run's `max_tool_calling_iterations`, `tool_timeout`,
`max_tool_output_chars` as key=value), each prompt is answered by GRPO's tool loop (`rl.tools.ToolLoop`, greedy,
batched): the prompt shows the tool schemas, calls are run and their results fed back until the model answers
without a call, and the reward functions get the whole conversation as a message list, as in training;
`max_new_tokens` counts the whole multi-turn completion, as `max_completion_length` does. Beside the rewards it
reports the tool use (`ToolUse`): calls per prompt, the share of calls that parsed and ran without error, and the
counts per tool. With an environment (`--environment-factory file.py:Class`, alone or with `--tools`; TRL 1.16's
contract, as GRPO's `environment_factory`) each row of a batch gets its own instance from the loop's pool, reset with
the row's columns and `prompt` just before the batch is answered (a string it returns is appended to the prompt's last
message); its public methods are tools, counted under their names, and the reward functions get the batch's
instances as `environments`, row for row, as in training.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from .data.collator import padding_token_id
from .data.loader import convert_dataset, resolve_datasets
from .constants import IGNORE_INDEX
from .data.processors import encode_prompt, warn_cut_prompts
from .data.template import ChatFormatter
from .config import Config, FinetuningArguments, convert_value, field_types
from .errors import ConfigError
from .jsonl import write_jsonl
from .rewards import RewardFunctionArguments, build_reward_functions, check_reward_functions, combine_rewards

logger = logging.getLogger(__name__)


@dataclass
class ToolUse:
    """The tool calls of an evaluation with tools (`rl.tools.ToolRollout`'s counts, summed over batches).

    Attributes:
        calls: calls made (each `<tool_call>` block, readable or not).
        failures: calls that did not parse, named no tool, raised or timed out.
        calls_per_tool, failures_per_tool: the same per tool name (`unknown` for unreadable calls or unknown names).
    """

    calls: int = 0
    failures: int = 0
    calls_per_tool: Counter = field(default_factory=Counter)
    failures_per_tool: Counter = field(default_factory=Counter)

    def add(self, rollout) -> None:
        """Count one batch's `ToolRollout`."""
        self.calls += rollout.calls
        self.failures += rollout.failures
        self.calls_per_tool.update(rollout.calls_per_tool)
        self.failures_per_tool.update(rollout.failures_per_tool)

    @property
    def success_rate(self) -> float:
        """Calls that parsed and ran without error over all calls (NaN without calls)."""
        return (self.calls - self.failures) / self.calls if self.calls else math.nan

    def metrics(self, rows: int) -> dict[str, float]:
        """`tools/call_frequency` (calls per prompt, TRL's name), `tools/success_rate`, and per tool
        `tools/<name>/calls` and `tools/<name>/failures`."""
        values = {"tools/call_frequency": self.calls / rows if rows else math.nan,
                  "tools/success_rate": self.success_rate}
        for name in sorted(self.calls_per_tool):
            values[f"tools/{name}/calls"] = float(self.calls_per_tool[name])
            values[f"tools/{name}/failures"] = float(self.failures_per_tool[name])
        return values

    def summary(self, rows: int) -> list[str]:
        """Lines for the terminal, e.g. `tool calls: 12 over 10 prompts (1.2000 per prompt), 11 ran without
        error (success rate 0.9167)` then one line per tool."""
        ran = (f", {self.calls - self.failures} ran without error (success rate {self.success_rate:.4f})"
               if self.calls else ", so no success rate")
        lines = [f"tool calls: {self.calls} over {rows} prompts ({self.calls / rows if rows else math.nan:.4f} per "
                 f"prompt){ran}"]
        lines += [f"  {name}: {self.calls_per_tool[name]} calls, {self.failures_per_tool[name]} failed"
                  for name in sorted(self.calls_per_tool)]
        return lines


@dataclass
class RewardEvaluation:
    """What `evaluate_rewards` measured.

    Attributes:
        names: the reward functions' names.
        means: name -> mean over the rows it scored (rows where it returned None are left out; NaN if none).
        scored: name -> how many rows it scored.
        reward_mean: mean of the weighted sum (`combine_rewards`) over rows at least one function scored.
        num_rows: prompts evaluated.
        rows: per row: prompt, completion, its other columns, each reward, `truncated`, `completion_tokens`
            (and `kl` with a reference).
        kl_mean: with a reference, the mean over answers of the KL to it (`answer_kl`), nats per answer.
        kl_reference: the reference it was measured against (adapter directories, or "base").
        tool_use: with tools, the calls made (`ToolUse`); None without.
    """

    names: list[str]
    means: dict[str, float]
    scored: dict[str, int]
    reward_mean: float
    num_rows: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    kl_mean: Optional[float] = None
    kl_reference: Optional[str] = None
    tool_use: Optional[ToolUse] = None

    def metrics(self) -> dict[str, float]:
        """The scalars a tracker receives (`trackers.report_evaluation`), named as the online stages log them:
        `rewards/<name>/mean` per function, `reward` (the weighted sum), `kl` with a reference."""
        values = {f"rewards/{name}/mean": self.means[name] for name in self.names}
        values["reward"] = self.reward_mean
        if self.kl_mean is not None:
            values["kl"] = self.kl_mean
        if self.tool_use is not None:
            values.update(self.tool_use.metrics(self.num_rows))
        return values

    def summary(self) -> str:
        """Lines for the terminal: one per function, then the weighted sum when there are several."""
        lines = [f"{name}: {self.means[name]:.4f} (mean over {self.scored[name]} of {self.num_rows} rows)"
                 for name in self.names]
        if len(self.names) > 1:
            lines.append(f"reward (weighted sum): {self.reward_mean:.4f}")
        if self.kl_mean is not None:
            lines.append(f"KL to the reference ({self.kl_reference}): {self.kl_mean:.4f} nats per answer "
                         f"(mean over {self.num_rows} answers; full vocabulary, summed over answer tokens)")
        if self.tool_use is not None:
            lines += self.tool_use.summary(self.num_rows)
        return "\n".join(lines)


def default_dataset_dir(dataset: str, dataset_dir: str = "data") -> str:
    """`dataset_dir` when it registers every dataset named (or they are files), else the source checkout's
    `data/` when that registers them, so `alignkit eval --dataset demo_math_eval` works from any folder."""
    names = [n.strip() for n in dataset.split(",") if n.strip()]

    def knows(folder: Path) -> bool:
        info = folder / "dataset_info.json"
        registry = json.loads(info.read_text(encoding="utf-8")) if info.is_file() else {}
        return all(name in registry or Path(name).exists() for name in names)

    checkout = Path(__file__).resolve().parents[1] / "data"
    if not knows(Path(dataset_dir)) and knows(checkout):
        return str(checkout)
    return dataset_dir


def reward_arguments(reward_funcs: list[str], overrides: dict[str, Any]) -> RewardFunctionArguments:
    """`RewardFunctionArguments` from the specs and `key=value` settings of the reward keys, each value
    converted to its field's type as in a config file."""
    types = field_types(RewardFunctionArguments)
    values = {key: convert_value(key, value, types[key]) for key, value in overrides.items()}
    return RewardFunctionArguments(reward_funcs=reward_funcs, **values)


def answer_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || p_ref) of next-token distributions over the whole vocabulary, position by position.

    Args:
        logits: [..., V] the evaluated model's logits.
        ref_logits: [..., V] the reference's logits at the same positions.

    Returns:
        [...] float32: sum_v p(v) (log p(v) - log p_ref(v)).

    Example: logits log([0.5, 0.5]) vs ref log([0.25, 0.75]):
    0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75) = 0.5 (0.693147 - 0.405465) = 0.143841; equal logits give 0.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(dim=-1)


def _answer_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[S, V] logits of the positions that predict an answer token (`labels` not -100 on the next position), from
    the per-token forward every stage shares: only they go through the output layer, so no [N, L, V] tensor."""
    from .model.logprobs import labelled_forward

    return labelled_forward(model, input_ids, attention_mask, labels, logits=True).values


def answers_kl(model, reference, generation, pad_id: int) -> torch.Tensor:
    """[N] KL of `model` to `reference` summed over each generated answer's tokens (`answer_kl`).

    Args:
        model, reference: causal LMs on the same tokenizer and device.
        generation: `alignkit.model.generation.Generation` of one batch; each prompt + answer is laid out as PPO
            lays out its rollouts (`alignkit.stages.ppo.pack_right`), so both models see the same positions.
        pad_id: the tokenizer's padding id.
    """
    from .stages.ppo import pack_right

    device = next(model.parameters()).device
    input_ids, attention_mask, labels = pack_right(
        generation.prompt_ids.to(device), generation.prompt_mask.to(device), generation.completion_ids.to(device),
        generation.completion_mask.to(device), pad_id)
    selected = labels[:, 1:] != IGNORE_INDEX
    with torch.no_grad():
        per_position = answer_kl(_answer_logits(model, input_ids, attention_mask, labels),
                                 _answer_logits(reference, input_ids, attention_mask, labels))
    return torch.zeros(selected.shape, device=device).masked_scatter(selected, per_position).sum(dim=1).cpu()


def _nan_to_none(value: float) -> Optional[float]:
    return None if math.isnan(value) else value


def evaluate_rewards(
    config: Config,
    reward_args: RewardFunctionArguments,
    *,
    batch_size: int = 32,
    output: Optional[str] = None,
    config_dir: Optional[str] = None,
    kl_reference: Optional[str] = None,
    tool_args: Optional[Any] = None,
) -> RewardEvaluation:
    """Generate greedily for every prompt of `config.data.dataset` and score the completions.

    Args:
        config: model (`model_name_or_path`, `adapter_name_or_path` merged in), data (`dataset`,
            `dataset_dir`, `template`, `cutoff_len`, `max_samples`) and generation (`max_new_tokens`; decoding
            is greedy whatever `do_sample` says).
        reward_args: `reward_funcs`, `reward_weights` and the built-ins' settings. The `length` reward's
            L_max defaults to `max_new_tokens`.
        batch_size: most prompts generated together. The prompts are split into as few batches as that allows,
            of equal size (100 prompts at 32: four batches of 25), since a decode step costs about the same at any
            of these widths (each streams every weight once).
        output: a .jsonl path to write one line per row (prompt, completion, columns, rewards).
        config_dir: where relative `file.py:function` and reward model paths are looked up first.
        kl_reference: also measure the KL of the model to this reference on its answers (`answers_kl`): adapter
            directories (comma-separated) on `model_name_or_path`, e.g. the SFT adapter a PPO run started from,
            or "base" for the model without adapters. It is loaded beside the model (a second copy in memory).
        tool_args: the tool keys of a GRPO/RLOO run (`tools`, `environment_factory`, `max_tool_calling_iterations`,
            `tool_timeout`, `max_tool_output_chars`; `tool_arguments` builds them): answer through the tool loop
            (module docstring). None or neither `tools` nor `environment_factory`: plain generation.

    Raises:
        ConfigError, DataError: bad settings or data, before the model loads.
        RewardFunctionError: a reward function failed.
    """
    from dataclasses import replace

    from .model.generation import DECODE_KEYS, generate_with_decode, pad_prompts
    from .model.loader import load_model, load_tokenizer

    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1.")
    d = config.data
    if not d.dataset:
        raise ValueError("give the prompts to evaluate on (dataset).")
    examples = []
    for attr in resolve_datasets(d.dataset, d.dataset_dir):  # bad data fails here, before the model loads
        examples += [example for _, example in convert_dataset(attr, "prompt", "eval", d.max_samples,
                                                               d.skip_invalid_rows)]
    if d.max_samples is not None:
        examples = examples[:d.max_samples]
    check_reward_functions(reward_args, config_dir=config_dir, max_completion_length=config.generating.max_new_tokens,
                           key="--reward")
    tool_functions = environment_factory = None
    if tool_args is not None and tool_args.uses_tools:
        from .rl.tools import load_environment_factory, load_tools

        if kl_reference:
            raise ConfigError("alignkit eval: --kl-reference with --tools or --environment-factory is not supported yet "
                              "(the KL would have to leave the tool results out); evaluate them in two runs.")
        tool_functions = load_tools(tool_args.tools or [], config_dir)
        if tool_args.environment_factory:
            environment_factory = load_environment_factory(tool_args.environment_factory, config_dir, tool_functions,
                                                           key="--environment-factory")
    tokenizer = load_tokenizer(config.model)
    formatter = ChatFormatter(tokenizer, d.template, d.default_system)
    tool_loop = None
    if tool_functions is not None:  # the template must write tool calls: checked here, before the model loads
        from .rl.tools import ToolLoop
        from .stages.online import PROMPT_COLUMNS  # what a row's `reset` is not given, as in training

        tool_loop = ToolLoop(tool_functions, environment_factory, formatter, formatter.stop_token_ids())
    encoded, cut = [], []
    for row, example in enumerate(examples, start=1):
        features, tokens_cut = encode_prompt(formatter, example, d.cutoff_len)
        encoded.append(features)
        if tokens_cut:
            cut.append((f"prompt {row}", tokens_cut))
    warn_cut_prompts(cut, len(examples), d.cutoff_len)

    model = load_model(config.model, FinetuningArguments(), is_trainable=False)
    reference = None
    if kl_reference:
        reference_adapters = None if kl_reference == "base" else kl_reference
        reference = load_model(replace(config.model, adapter_name_or_path=reference_adapters), FinetuningArguments(),
                               is_trainable=False)
    if torch.cuda.is_available():
        model.to("cuda")
        if reference is not None:
            reference.to("cuda")
    max_new_tokens = config.generating.max_new_tokens
    rewards = build_reward_functions(reward_args, model=model, formatter=formatter, model_args=config.model,
                                     config_dir=config_dir, max_completion_length=max_new_tokens)
    generating = replace(config.generating, do_sample=False, num_beams=1)
    # Greedy: max_new_tokens and repetition_penalty are all the decode loop needs (num_beams=1 is no beam search).
    decode_kwargs = {key: value for key, value in generating.to_generation_kwargs().items() if key in DECODE_KEYS}
    stop_ids = formatter.stop_token_ids()
    pad_id = padding_token_id(tokenizer)

    device_type = next(model.parameters()).device.type
    # `bf16=true` decodes under bf16 autocast (on a CPU `packed_linears` then streams bf16 weight copies: half the
    # bytes a token); `auto` and `false` decode in fp32, so an evaluation's numbers do not depend on the machine.
    bf16 = config.training.bf16 is True

    def decode(input_ids: torch.Tensor, attention_mask: torch.Tensor, kwargs: dict[str, Any]):
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            return generate_with_decode(model, tokenizer, input_ids, attention_mask, stop_token_ids=stop_ids,
                                        generation_kwargs=kwargs)

    def generate_turn(contexts: list[list[int]], _rows: list[int], _turn: int, budget: int) -> list[list[int]]:
        """One turn of the tool loop for the rows still calling, greedy, at most `budget` new tokens."""
        return _decoded_ids(decode(*pad_prompts(contexts, pad_id), {**decode_kwargs, "max_new_tokens": budget}))

    tool_use = ToolUse() if tool_loop is not None else None
    batch_size = math.ceil(len(examples) / math.ceil(len(examples) / batch_size)) if examples else batch_size
    per_function, rows, kls = [], [], []
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        features = encoded[start:start + batch_size]
        messages = environments = None
        prompts = [example["prompt"] for example in batch]
        if tool_loop is None:
            input_ids, attention_mask = pad_prompts([f["input_ids"] for f in features], pad_id)
            out = decode(input_ids, attention_mask, decode_kwargs)
            completion_ids = _decoded_ids(out)
            texts, truncated = out.texts, out.truncated.tolist()
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        else:
            # Per batch, as training's rounds: the pool's first len(batch) environments, reset for these rows now, so
            # each row has its own instance until the batch is scored. The rewards then see the prompts as `reset`
            # left them.
            reset_kwargs = [{**{k: v for k, v in f.items() if k not in PROMPT_COLUMNS}, "prompt": p}
                            for f, p in zip(features, prompts)]
            prompts, row_tools, environments, tool_prompt_ids = tool_loop.start(
                [_as_messages(p) for p in prompts], reset_kwargs)
            rollout = tool_loop.run(
                generate_turn, tool_prompt_ids, row_tools,
                max_completion_length=max_new_tokens, max_iterations=tool_args.max_tool_calling_iterations,
                timeout=tool_args.tool_timeout, max_tool_output_chars=tool_args.max_tool_output_chars,
                max_context_length=getattr(model.config, "max_position_embeddings", None))
            tool_use.add(rollout)
            completion_ids, messages = rollout.completion_ids, rollout.messages
            completions = messages  # the whole conversation, as GRPO's reward functions get it
            texts = [m[-1]["content"] if m and m[-1]["role"] == "assistant" else "" for m in messages]
            truncated = [not ids or ids[-1] not in stop_ids for ids in completion_ids]
        extra_keys = [k for k in features[0] if k not in ("input_ids", "attention_mask")]
        columns = {key: [f.get(key) for f in features] for key in extra_keys}
        if environments:  # for the reward functions only: not a column of the --output rows
            columns["environments"] = environments
        scores = rewards(prompts, completions, columns, completion_ids=completion_ids, truncated=truncated)
        per_function.append(scores)
        if reference is not None:
            kls.append(answers_kl(model, reference, out, pad_id))
        for i, text in enumerate(texts):
            rows.append({"prompt": prompts[i], "completion": text, **{k: columns[k][i] for k in extra_keys},
                         **({"messages": messages[i]} if messages is not None else {}),
                         "rewards": {name: _nan_to_none(float(scores[i, j])) for j, name in enumerate(rewards.names)},
                         "truncated": bool(truncated[i]), "completion_tokens": len(completion_ids[i]),
                         **({"kl": float(kls[-1][i])} if reference is not None else {})})
        logger.info("eval: %d of %d prompts", min(start + batch_size, len(examples)), len(examples))

    scores = torch.cat(per_function) if per_function else torch.empty(0, len(rewards))
    scored = {name: int((~torch.isnan(scores[:, j])).sum()) for j, name in enumerate(rewards.names)}
    means = {name: float(torch.nanmean(scores[:, j])) if scored[name] else math.nan
             for j, name in enumerate(rewards.names)}
    combined = combine_rewards(scores, rewards.weights)
    reward_mean = float(torch.nanmean(combined)) if (~torch.isnan(combined)).any() else math.nan
    if output:
        path = write_jsonl(output, rows)
        logger.info("Wrote %d rows to %s", len(rows), path)
    kl_mean = float(torch.cat(kls).mean()) if kls else None
    return RewardEvaluation(rewards.names, means, scored, reward_mean, len(rows), rows, kl_mean,
                            kl_reference if reference is not None else None, tool_use)


def _as_messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompt example's prompt as messages (a plain-text prompt is one user turn, as the template renders it)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _decoded_ids(out) -> list[list[int]]:
    """Each row's generated ids, without the padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(out.completion_ids.cpu(), out.completion_mask.cpu())]


def tool_arguments(tools: list[str], overrides: dict[str, Any], environment_factory: Optional[str] = None):
    """The tool keys of a GRPO/RLOO run for `evaluate_rewards(tool_args=...)`: `tools`, `environment_factory` and the
    `key=value` settings of `TOOL_KEYS`, converted and checked as in a config file (`GroupRolloutArguments`'s fields
    and checks).

    Raises:
        ConfigError: a value of the wrong type or out of range.
    """
    from .stages.grpo import GroupRolloutArguments

    types = field_types(GroupRolloutArguments)
    values = {key: convert_value(key, value, types[key]) for key, value in overrides.items()}
    return GroupRolloutArguments(tools=list(tools), environment_factory=environment_factory, **values)


# The keys of a run's config that `alignkit eval --tools` (or `--environment-factory`) takes as key=value (the loop's
# limits).
TOOL_KEYS = ("max_tool_calling_iterations", "tool_timeout", "max_tool_output_chars")


__all__ = ["RewardEvaluation", "TOOL_KEYS", "ToolUse", "answer_kl", "answers_kl", "default_dataset_dir",
           "evaluate_rewards", "reward_arguments", "tool_arguments"]
