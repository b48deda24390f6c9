"""Group relative policy optimisation (GRPO, Shao et al. 2024, DeepSeekMath §4.1), at TRL 1.16's numbers.

For each prompt the policy samples `num_generations` completions, reward functions score them, and each
completion's advantage is its reward relative to its group: `(r - mean) / (std + 1e-4)`. The policy then
takes clipped policy-gradient steps on those completions (PPO's surrogate without a value model), with an
optional k3 KL penalty towards the step-0 policy.

How the work is laid out, and why:
- Generation batches. The dataloader yields `per_device_train_batch_size x steps_per_generation` rows, each
  prompt repeated `num_generations` times, and yields each such batch `steps_per_generation x
  num_iterations` times in a row. The first time, `_prepare_inputs` generates and scores the whole batch at
  once (one batched decode loop, `rollout.sample_completions`), shuffles it and cuts it into `steps_per_generation`
  micro-batches, which it buffers; later calls take the next slice of the buffer. Trainer's own loop,
  gradient accumulation, scheduler and checkpointing run unchanged around that (the layout of TRL 1.16 and
  of the transformers guide on subclassing `Trainer`).
- Off-policy corrections. The importance ratio `pi / pi_old` needs the log-probs of the policy that
  sampled. When every slice is trained within the optimizer step that generated it (TRL's rule:
  `gradient_accumulation_steps % (steps_per_generation x num_iterations) == 0`) that policy is the current
  one and `pi_old = pi.detach()`. Otherwise, when each slice's first forward still runs at the sampling
  weights (`old_logps_from_first_iteration`), that forward's are kept for the later iterations; where the rollout
  itself reads them (a KL folded into the reward) and the one slice trains next, the rollout runs its training
  forward (`training_forward_in_rollout`); else they are computed once, right after generation.
- The reference (only when `beta > 0`) is the policy with its LoRA adapter disabled, or a frozen in-memory
  copy under full fine-tuning: `StageTrainer.reference()`, never a second model read from disk.
- Loss aggregation follows TRL 1.16 for each `loss_type`, including its division for gradient
  accumulation, so that changing `gradient_accumulation_steps` alone (with the batch it accumulates to
  fixed) leaves the update unchanged for `grpo`, `dr_grpo` and `dapo`; `bnpo` normalises by the tokens of
  each micro-batch, so it depends on how the batch is cut, as in TRL.
- On-policy with `beta = 0` the loss is about 0 by construction: the ratio is 1, and the advantages of a
  group sum to 0. Its gradient is not 0. Watch `reward` (and `rewards/<name>/mean`), not `loss`.
- Resume. Sampling is seeded per generation round (`rollout_seed`) and per row (`rollout.row_seeds`), and
  the buffered generation batch is saved in each checkpoint (one file per process), so a run stopped at any
  checkpoint, also in the middle of a generation batch, continues with the completions, rewards and losses
  of the uninterrupted run.
- Several processes (`torchrun`, `accelerate launch`), as TRL 1.16 lays them out. The generation batch is
  global: `per_device_train_batch_size x processes x steps_per_generation` completions, and process r
  generates rows `r x L .. (r + 1) x L - 1` of it (L = its per-device share). A prompt's group is not kept
  on one process: its completions may lie on two. Each process scores its own rows; the `[N, F]` reward
  matrices are then gathered from all processes, advantages are computed over the whole batch (so every
  group is normalised as a whole), and each process keeps its own slice. Each row is sampled under a seed
  of its own, from the round and its place in the global batch (`rollout.row_seeds`, one generator per row), so the
  completions, and with them the run, are the same for any number of processes given `seed` and the
  global batch. The token counts of `dapo` (the generation batch) and `bnpo` (the micro-batch) are summed
  over processes, so N processes x batch b train exactly as one process x batch N x b; the rollout
  metrics are those of the whole batch; `completions.jsonl` is written by the main process with every
  process's rows, in global order. (TRL normalises `bnpo` by each process's own tokens; here it is the
  micro-batch's tokens over all processes, so the update does not depend on the number of processes.)
- ZeRO-3 / FSDP: the sharded weights are gathered once per generation batch around generation
  (`alignkit.model.distributed.full_weights`, given the DeepSpeed engine), not once per token. Run on the CPU
  (gloo, 2 processes equal to 1, tests/distributed/): LoRA under real DeepSpeed ZeRO-3 and under FSDP2; not on a
  GPU.
- `use_vllm: true` samples with vLLM in this process (`rollout.VLLMColocateSampler`, GPU only, weights
  pushed in after each update). It is written against vLLM's documented API and has not run: no GPU was
  available to this project.
- Threads: on a machine other programs keep busy, torch's two threads wait on each other at every operator
  and made GRPO steps several times slower; set `OMP_NUM_THREADS=1` there (torch reads it at start). The
  measurements: docs/performance.md, "Threads on a shared CPU".

- Other algorithms on the same loop. `compute_advantages` (rewards -> advantages, the estimator of
  `advantage_estimator`: `group`, or `reinforce_pp` with its KL folded into a token-level reward),
  `policy_term` (the `loss_type`'s term) and `_init_loss_state` are the seams: `stages/rloo.py` overrides
  the first, `compute_loss` and the last, and shares everything else.

Defaults: every key below has TRL 1.16's default (`loss_type: dapo`, `beta: 0.0`, `num_generations: 8`,
`max_completion_length: 512`, `temperature: 1.0`, `top_p: 1.0`, `top_k: 0`, `epsilon: 0.2`,
`scale_rewards: group`, `use_bias_correction_kl: true`, ...). One shared key differs: `learning_rate` is the
Trainer's (5e-5) unless set, where TRL's GRPOConfig uses 1e-6 for full fine-tuning; a LoRA run wants a
larger rate than that anyway, so the examples set it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch
from torch.utils.data import Sampler

from ..data.collator import padding_token_id
from ..data.multimodal import IMAGE_COLUMN
from ..env import launched_processes
from ..errors import ConfigError
from ..rewards import require_reward_funcs
from ..rl.advantages import decoupled_group_advantages, group_advantages
from ..rl.kl import k3_kl, sequence_log_ratio
from ..rl.losses import (CLIPPED_LOSS_TYPES, AdaptiveEntropyController, aggregate_loss, cispo_loss,
                         clipped_surrogate, entropy_bonus, high_entropy_mask, importance_log_weights,
                         off_policy_sequence_mask, sapo_loss, vespo_weights)
from ..rl.record import COMPLETIONS_FILE
from ..rl.rollout import VLLMColocateSampler, completion_logps, rollout_seed
from ..rl.stats import masked_mean, nan_std
from ..rl.tools import ToolLoop, environment_reward, rollout_tensors, turn_seeds
from .arguments import GroupRolloutArguments, GRPOArguments, check_vllm_keys, resolve_generation_batch
from .base import check_reference_sync, is_peft_model, run_stage_trainer
from .online import PROMPT_COLUMNS, OnlineTrainer, data_order_seed, has_active_dropout

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from ..config import Config

logger = logging.getLogger(__name__)

# The examples `data.get_dataset` builds for this stage (`formats.DATA_KINDS`); the registry records it too.
DATA_KIND = "prompt"

ROLLOUT_BUFFER_FILE = "grpo_rollout_buffer.pt"
# A generation batch's pixel inputs (vision-language models) ride in its buffered slices under these keys.
IMAGE_KEY_PREFIX = "images/"
# The adaptive entropy coefficient and the entropy it last measured (`use_adaptive_entropy`), per checkpoint.
ENTROPY_CONTROLLER_FILE = "grpo_entropy_controller.json"


def check_config(config: "Config") -> None:
    """What `stage: grpo` (and `rloo`) refuses beyond its own keys (called after the config is parsed)."""
    g, t = config.method, config.training
    g.check_run(config.finetuning.stage, t)
    if g.uses_tools:
        from ..rl.tools import check_tool_keys

        # An environment with `get_reward` is a reward source of its own.
        if environment_reward(check_tool_keys(g, config.dir)) is None:
            require_reward_funcs(g, config.finetuning.stage)
    check_generation_loop(g, t)
    check_reference_sync(config, g.beta != 0, "beta=0 (no KL term)")


def check_generation_loop(g: Any, t: Any) -> None:
    """What GRPO's generation loop refuses: the generation batch and vLLM (GRPO, RLOO and distill's student loop).

    Args:
        g: the loop's keys (`GRPOArguments`, or distill's `generation_loop()`).
        t: the run's `TrainingArguments`.
    """
    # Checked only (the Trainer derives them again from its process count): a check leaves the config as given.
    resolve_generation_batch(t.per_device_train_batch_size, launched_processes(), g.num_generations,
                             g.steps_per_generation, g.generation_batch_size, t.gradient_accumulation_steps)
    if t.train_sampling_strategy != "random":
        # transformers' samplers never run here: the prompts come in generation groups (`GenerationBatchSampler`).
        fix = ("shuffle_dataset: false takes the prompts in dataset order" if t.train_sampling_strategy == "sequential"
               else "remove it (and group_by_length)")
        raise ConfigError(f"train_sampling_strategy={t.train_sampling_strategy}: this stage draws its prompts in "
                          f"generation groups of num_generations, shuffled or not by shuffle_dataset; {fix}.")
    if g.use_vllm and importlib.util.find_spec("vllm") is None:
        raise ConfigError("use_vllm: true needs vLLM, which is not installed: pip install 'alignkit[vllm]' (on a "
                          "machine with a GPU), or set use_vllm: false to generate with transformers.")
    if g.use_vllm and (t.use_cpu or not torch.cuda.is_available()):
        raise ConfigError("use_vllm: true needs a CUDA GPU; on this machine set use_vllm: false.")


# ---------------------------------------------------------------------------------------------------
# Data: generation batches
# ---------------------------------------------------------------------------------------------------


class GenerationBatchSampler(Sampler[int]):
    """Row indices laid out in generation batches, each prompt repeated, each batch repeated.

    An epoch shuffles the prompts (seeded by `seed + epoch`), cuts them into chunks of
    `prompts_per_batch` (an incomplete last chunk is dropped, as TRL drops it), and for each chunk yields
    `repeat_count` times the chunk with every index repeated `num_generations` times in a row. With a
    dataloader batch of `prompts_per_batch x num_generations` rows, each batch is one generation batch,
    delivered `repeat_count = steps_per_generation x num_iterations` times.

    Example: 4 prompts, no shuffle, 2 per batch, G = 2, repeat 2 →
    [0,0,1,1], [0,0,1,1], [2,2,3,3], [2,2,3,3].
    """

    def __init__(self, num_rows: int, num_generations: int, prompts_per_batch: int, repeat_count: int = 1,
                 shuffle: bool = True, seed: int = 0) -> None:
        self.num_rows = num_rows
        self.num_generations = num_generations
        self.prompts_per_batch = prompts_per_batch
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Trainer calls this at each epoch start: a new order per epoch, the same order on resume."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=generator).tolist()
        else:
            order = list(range(self.num_rows))
        for start in range(0, len(order) - self.prompts_per_batch + 1, self.prompts_per_batch):
            chunk = order[start:start + self.prompts_per_batch]
            for _ in range(self.repeat_count):
                for index in chunk:
                    yield from [index] * self.num_generations

    def __len__(self) -> int:
        return (self.num_rows // self.prompts_per_batch) * self.prompts_per_batch * self.num_generations \
            * self.repeat_count


def slice_image_inputs(inputs: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The pixel inputs (laid out by row) a buffered slice carries under `IMAGE_KEY_PREFIX`; None without images."""
    found = {key[len(IMAGE_KEY_PREFIX):]: value for key, value in inputs.items() if key.startswith(IMAGE_KEY_PREFIX)}
    return found or None


def collate_prompt_rows(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as they are: prompts are padded when they are generated from, not before."""
    return features


# ---------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------


class GRPOTrainer(OnlineTrainer):
    """`Trainer` that samples groups of completions, scores them and takes clipped policy-gradient steps.

    Args:
        grpo_args: the stage's keys (`GRPOArguments`), with `steps_per_generation` resolved or None.
        reward_functions: `alignkit.rewards.RewardFunctions` (`.names`, `.weights`, callable → `[N, F]`).
        stop_token_ids: ids that end a completion (the template's end of turn).
        images: a vision-language model's `data.multimodal.ImageProcessing`, for prompt rows with images (their
            `images` column of paths): rollouts, log-prob passes and reward functions get the images (see
            `_generate_and_score`); None for a text-only model.
        *args, **kwargs: as for `transformers.Trainer`; `train_dataset` holds the data layer's prompt rows
            (`input_ids`, `prompt_messages`, `prompt_conversational` and the row's other columns) and
            `processing_class` the tokenizer.
    """

    # Whether the stage has `generation_batch_size` (a one-batch hint names it, so the generation batch stays).
    names_generation_batch = True

    # Each micro-batch's loss is divided for gradient accumulation by `aggregate_loss` itself.
    loss_is_scaled_for_ga = True
    # Rewards -> advantages: the group-normalised estimator (`alignkit.rl.advantages.ADVANTAGE_ESTIMATORS`).
    advantage_estimator = "group"

    def __init__(self, *args, grpo_args: GroupRolloutArguments, reward_functions, stop_token_ids: Sequence[int],
                 tools: Sequence[Any] = (), environment_factory: Optional[Any] = None, formatter: Optional[Any] = None,
                 images: Optional[Any] = None, **kwargs) -> None:
        kwargs.setdefault("data_collator", collate_prompt_rows)
        owned = environment_reward(environment_factory)
        if owned is not None:  # the environment's `get_reward` (TRL 1.16): one more reward of weight 1
            from ..rewards import RewardFunction, RewardFunctions

            name, function = owned
            reward_functions = RewardFunctions(
                list(reward_functions.functions) + [RewardFunction(name, f"{name}.get_reward", function)],
                reward_functions.weights.tolist() + [1.0])
        super().__init__(*args, reward_functions=reward_functions, stop_token_ids=stop_token_ids,
                         log_completions=grpo_args.log_completions, keep_reference_copy=grpo_args.beta != 0,
                         reference_sync=grpo_args, disable_dropout=grpo_args.disable_dropout, **kwargs)
        self.grpo_args = grpo_args
        self.images = images
        self.num_generations = grpo_args.num_generations
        self.steps_per_generation, self.generation_batch_size = resolve_generation_batch(
            self.args.per_device_train_batch_size, self.accelerator.num_processes, grpo_args.num_generations,
            grpo_args.steps_per_generation,
            grpo_args.generation_batch_size, self.args.gradient_accumulation_steps)
        self.num_iterations = grpo_args.num_iterations
        self.generate_every = self.steps_per_generation * self.num_iterations
        # Old log-probs (TRL's rule): needed when a slice may be trained after an optimizer step that followed
        # its generation. With vLLM always: it samples from its own kernels' numbers, so the ratio is taken
        # against the trainer's log-probs of the sampled tokens (TRL also reweights by vLLM's; not done here).
        self.needs_old_logps = self.args.gradient_accumulation_steps % self.generate_every != 0 or grpo_args.use_vllm
        # Whether the rollout itself reads the old log-probs (an estimator folding a KL into the reward): then they
        # are computed right after generation whatever `old_logps_from_first_iteration` says.
        self.rollout_reads_old_logps = False
        self._generation_step: Optional[int] = None  # the optimizer steps done when the buffered batch was sampled
        # The slice's training forward run in the rollout (`training_forward_in_rollout`): its log-probs and entropy
        # with their graph, and the order that cut the slice from the batch; taken by `compute_loss`.
        self._rollout_forward: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self._vllm: Optional[VLLMColocateSampler] = None
        self.generation_kwargs = {
            "do_sample": True, "max_new_tokens": grpo_args.max_completion_length,
            "temperature": grpo_args.temperature, "top_p": grpo_args.top_p, "top_k": grpo_args.top_k,
            "min_p": grpo_args.min_p, "repetition_penalty": grpo_args.repetition_penalty,
        }
        if images is not None:  # a completion holding an image token would not match the prompt's pixel inputs
            self.generation_kwargs["suppress_tokens"] = images.image_token_ids
        self._micro_step: Optional[int] = None  # micro-batches trained so far; set from the state on first use
        self._micro_batches_per_epoch: Optional[int] = None
        self._buffer: Optional[list[dict[str, torch.Tensor]]] = None
        self._buffer_round: Optional[int] = None
        self._step_time = 0.0
        self._step_generation_time = 0.0
        self._entropy_bonus_enabled = False
        self._entropy_controller: Optional[AdaptiveEntropyController] = None
        self._entropy_window: Optional[torch.Tensor] = None
        # Tool-calling rollouts (`rl.tools`): None without tools, the common case.
        self.tool_loop = ToolLoop(tools, environment_factory, formatter, self.stop_token_ids) \
            if (tools or environment_factory) else None
        self._init_loss_state()
        # 2 completions x 4 micro-batches trained 1.7x as long as 8 x 1 on the bundled model (generation alike).
        self._suggest_one_batch(self._accumulation_is_one_batch(),
                                keep=f" and generation_batch_size={self.generation_batch_size}"
                                if self.names_generation_batch else "")

    def _accumulation_is_one_batch(self) -> bool:
        """Whether one micro-batch of the step's completions trains as its micro-batches do: the token or sequence
        sums over the generation batch (`dapo`, `grpo`, `dr_grpo`; `bnpo` normalises each micro-batch), with no
        statistic of the micro-batch's own (the entropy quantile's threshold, the entropy bonus's mean)."""
        g = self.grpo_args
        return (g.loss_type in ("dapo", "grpo", "dr_grpo") and g.top_entropy_quantile >= 1.0
                and not self._entropy_bonus_enabled)

    def old_logps_from_first_iteration(self) -> bool:
        """Whether the old log-probs come from the first iteration's own forwards instead of a pass after generation.

        With `num_iterations` > 1 every slice is trained again after an optimizer step, so its ratio needs the
        log-probs of the policy that sampled it. When the generation batch starts at an optimizer step and its
        first iteration ends within that step (`steps_per_generation` <= `gradient_accumulation_steps`, and
        `steps_per_generation x num_iterations` a multiple of it: the defaults with any `num_iterations`), every
        slice's first forward runs at the sampling weights: its log-probs, detached, are the old ones (the first
        iteration's ratio is exactly 1) and are kept in the buffer for the later iterations, so no no-grad pass of
        the batch runs for them. Not with vLLM (its numbers are its kernels'), nor where the rollout reads them.
        """
        ga = self.args.gradient_accumulation_steps
        return (self.needs_old_logps and not self.grpo_args.use_vllm and not self.rollout_reads_old_logps
                and self.generate_every % ga == 0 and self.steps_per_generation <= ga)

    def training_forward_in_rollout(self) -> bool:
        """Whether the rollout runs the slice's training forward itself, keeping its graph for `compute_loss`.

        Where the rollout reads the old log-probs (RLOO's KL reward with `beta > 0`, TRL's default, or reinforce_pp's)
        they come from a pass right after generation. With one slice per generation batch and one iteration (the
        defaults) that slice is trained next, at the same weights, on the same rows: its training forward computes
        exactly those log-probs. So the rollout runs that forward with gradients, reads its log-probs detached, and
        the loss backpropagates it: one forward of the batch less per step. One process only, without DeepSpeed,
        FSDP, tools or images, and without active dropout; elsewhere the no-grad pass runs.
        """
        if not (self.rollout_reads_old_logps and self.steps_per_generation == 1 and self.num_iterations == 1):
            return False
        if self.grpo_args.use_vllm or self.tool_loop is not None or self.images is not None:
            return False
        if self.accelerator.num_processes != 1 or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return False
        return not has_active_dropout(self.model)

    def slice_forward(self, model, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The slice's per-token log-probs and entropy with their graph: the rollout's training forward, in the
        slice's row order, when it ran one (`training_forward_in_rollout`), else `model`'s forward now."""
        if self._rollout_forward is not None:
            logps, entropy, order = self._rollout_forward
            self._rollout_forward = None
            return logps[order], entropy[order]
        mask = inputs["completion_mask"]
        # With tools the forward attends to the tool turns too (`completion_attention_mask`); the loss mask does not.
        return completion_logps(model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                                inputs.get("completion_attention_mask", mask), temperature=self.grpo_args.temperature,
                                with_entropy=True, image_inputs=slice_image_inputs(inputs))

    def old_logps_of(self, inputs: dict[str, torch.Tensor], logps: torch.Tensor) -> torch.Tensor:
        """The slice's old log-probs: computed after generation, kept from its first iteration, or (a slice trained
        within the optimizer step that sampled it, once) its own forward's, detached (the ratio is 1).

        Under `old_logps_from_first_iteration` the first forward's are written into `inputs`, the buffered slice
        itself, where the later iterations and a checkpoint's copy of the buffer read them.
        """
        old_logps = inputs.get("old_logps")
        if old_logps is not None:
            return old_logps
        old_logps = logps.detach()
        if self.needs_old_logps:
            if self._generation_step != self.state.global_step:
                raise RuntimeError("GRPO: a slice without old log-probs after an optimizer step since its generation "
                                   "(old_logps_from_first_iteration assumed otherwise); please report this.")
            inputs["old_logps"] = old_logps
        return old_logps

    def _init_loss_state(self) -> None:
        """GRPO's own state: its advantage estimator key, and the entropy bonus (TRL 1.16): on with a coefficient,
        or adaptive (which may bring it back from 0)."""
        g = self.grpo_args
        self.advantage_estimator = g.advantage_estimator
        if g.advantage_estimator == "reinforce_pp" and g.beta != 0:
            # The KL in the reward is taken at rollout time. With beta 0 that reward is 0 whatever the log-probs, so
            # no scoring pass runs for it (one no-grad forward of the batch a round, about a fifth of a step).
            self.needs_old_logps = self.rollout_reads_old_logps = True
        self._entropy_bonus_enabled = g.entropy_coef != 0.0 or g.use_adaptive_entropy
        if g.use_adaptive_entropy:
            self._entropy_controller = AdaptiveEntropyController(g.entropy_coef, g.entropy_target,
                                                                 g.entropy_coef_delta, g.entropy_coef_min,
                                                                 g.entropy_coef_max)

    # ---- data ----

    def _get_train_sampler(self, dataset=None) -> Sampler:
        dataset = self.train_dataset if dataset is None else dataset
        return GenerationBatchSampler(len(dataset), self.num_generations,
                                      self.generation_batch_size // self.num_generations,
                                      repeat_count=self.generate_every, shuffle=self.grpo_args.shuffle_dataset,
                                      seed=data_order_seed(self.args))

    def get_train_dataloader(self):
        """Each process's share of one generation batch (`per_device_train_batch_size x steps_per_generation` rows).

        The sampler yields the global generation batch; the accelerator hands process r the r-th of every N
        consecutive dataloader batches, that is rows `r x L .. (r + 1) x L - 1` of each generation batch.
        """
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer: training needs a train_dataset of prompts.")
        rows_needed = self.generation_batch_size // self.num_generations
        if len(self.train_dataset) < rows_needed:
            raise ConfigError(f"the training set has {len(self.train_dataset)} prompt(s) but one generation batch "
                              f"takes {rows_needed} ({self.generation_batch_size} completions / num_generations "
                              f"{self.num_generations}): add prompts or lower per_device_train_batch_size.")
        dataloader = self._get_dataloader(self.train_dataset, "Training",
                                          self._train_batch_size * self.steps_per_generation,
                                          sampler_fn=self._get_train_sampler, is_training=True)
        self._micro_batches_per_epoch = len(dataloader)
        return dataloader

    def _track_num_input_tokens(self, inputs) -> None:
        """Tokens are counted when they are generated (prompt + completion, as TRL counts), not per slice."""

    # ---- the step ----

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._micro_step += 1
        self._step_time += time.perf_counter() - start
        if self.accelerator.sync_gradients:  # the last micro-batch of this optimizer step
            self.record_metrics({"step_time": self._step_time,
                                 "time/generation": self._step_generation_time,
                                 "time/training": self._step_time - self._step_generation_time}, 1)
            self._step_time = self._step_generation_time = 0.0
        return loss

    def _micro_steps_done(self) -> int:
        """Micro-batches trained before `state.global_step` (a resumed run starts at a step boundary)."""
        ga = self.args.gradient_accumulation_steps
        per_epoch = self._micro_batches_per_epoch
        if per_epoch is None:
            return self.state.global_step * ga
        updates_per_epoch = max(math.ceil(per_epoch / ga), 1)
        epochs, within = divmod(self.state.global_step, updates_per_epoch)
        return epochs * per_epoch + within * ga

    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            raise ValueError("stage grpo does not evaluate through the Trainer; use `alignkit eval`.")
        if self._micro_step is None:
            self._micro_step = self._micro_steps_done()
        round_index = self._micro_step // self.generate_every
        if self._buffer is None or self._buffer_round != round_index:
            self._buffer = self._generate_and_score(generation_batch, round_index)
            self._buffer_round = round_index
        return self._buffer[self._micro_step % self.steps_per_generation]

    # ---- generation and scoring ----

    def _generate_and_score(self, rows: list[dict[str, Any]], round_index: int) -> list[dict[str, torch.Tensor]]:
        """Generate for this process's share of the generation batch, score it, compute advantages over the
        whole batch (all processes), and cut the share into `steps_per_generation` slices."""
        start = time.perf_counter()
        prompt_ids = [row["input_ids"] for row in rows]
        seed = rollout_seed(self.args.seed, round_index)
        # This process holds rows first_row .. first_row + len(rows) - 1 of the global generation batch.
        first_row = self.accelerator.process_index * len(rows)
        columns = {key: [row[key] for row in rows] for key in rows[0] if key not in PROMPT_COLUMNS}
        prompt_messages = [row["prompt_messages"] for row in rows]
        image_paths, image_inputs = self._row_images(rows)
        tool_mask = tool_completions = None
        if self.tool_loop is not None:
            generation, tool_mask, tool_completions, prompt_messages = self._tool_generation(
                rows, columns, seed, first_row)
        elif self.grpo_args.use_vllm:
            generation = self._vllm_sampler().sample(self.processing_class, prompt_ids,
                                                     stop_token_ids=self.stop_token_ids,
                                                     generation_kwargs=self.generation_kwargs, seed=seed,
                                                     first_row=first_row)
        else:
            generation = self.sample(prompt_ids, generation_kwargs=self.generation_kwargs, seed=seed,
                                     first_row=first_row, image_inputs=image_inputs)
        generation_time = time.perf_counter() - start
        self._step_generation_time += generation_time

        device = self.args.device
        prompt_ids, prompt_mask = generation.prompt_ids.to(device), generation.prompt_mask.to(device)
        completion_ids = generation.completion_ids.to(device)
        # The attention over the completion; with tools the loss mask leaves the tool turns out of it (`tool_mask`).
        attention_mask = generation.completion_mask.to(device)
        truncated = generation.truncated.to(device)
        lengths = attention_mask.sum(1)
        # The policy's own tokens per completion, as TRL counts them for the length metrics and tokens seen.
        policy_lengths = lengths if tool_mask is None else (attention_mask * tool_mask.to(device)).sum(1)
        if self.grpo_args.mask_truncated_completions:
            attention_mask = attention_mask * (~truncated).unsqueeze(1).long()
        completion_mask = attention_mask if tool_mask is None else attention_mask * tool_mask.to(device)

        if tool_completions is not None and self.tool_loop.environment_factory is not None:
            columns["environments"] = self.tool_loop.environments(len(rows))
        completion_id_lists = [ids[:n].tolist() for ids, n in zip(generation.completion_ids, lengths.tolist())]
        prompts, completions, per_function, rewards = self.score(
            prompt_messages, [bool(row["prompt_conversational"]) for row in rows],
            generation.texts, columns, completion_id_lists, truncated.tolist(), completions=tool_completions,
            image_paths=image_paths)
        batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                 "completion_mask": completion_mask}
        if image_inputs is not None:  # by row, so the slices below cut them with their rows
            batch.update({IMAGE_KEY_PREFIX + key: value for key, value in image_inputs.items()})
        if tool_mask is not None:
            batch["completion_attention_mask"] = attention_mask
        self._generation_step = self.state.global_step
        self._rollout_forward = None
        if self.training_forward_in_rollout():
            logps, entropy = completion_logps(self.model, prompt_ids, prompt_mask, completion_ids, attention_mask,
                                              temperature=self.grpo_args.temperature, with_entropy=True)
            batch["old_logps"] = logps.detach()
            self._rollout_forward = (logps, entropy, None)
        with torch.no_grad():
            if self.needs_old_logps and "old_logps" not in batch and not self.old_logps_from_first_iteration():
                batch["old_logps"], _ = completion_logps(
                    self.model, prompt_ids, prompt_mask, completion_ids, attention_mask,
                    temperature=self.grpo_args.temperature, batch_size=self.args.per_device_train_batch_size,
                    image_inputs=image_inputs)
            if self.grpo_args.beta != 0:
                with self.reference() as reference:
                    batch["ref_logps"], _ = completion_logps(
                        reference, prompt_ids, prompt_mask, completion_ids, attention_mask,
                        temperature=self.grpo_args.temperature, batch_size=self.args.per_device_train_batch_size,
                        image_inputs=image_inputs)
        # Groups may straddle processes: normalise over the gathered batch, then keep this process's slice.
        gather = self.accelerator.gather
        all_per_function, all_rewards = gather(per_function.to(device)), gather(rewards.to(device))
        advantages, std_is_zero = self.compute_advantages(all_per_function, all_rewards, batch,
                                                          slice(first_row, first_row + len(rows)))
        batch["advantages"] = advantages

        all_lengths, all_truncated = gather(policy_lengths), gather(truncated.long()).bool()
        token_counts = self.accelerator.reduce(
            torch.stack([prompt_mask.sum() + policy_lengths.sum(), completion_mask.sum()]).long(), reduction="sum")
        self.state.num_input_tokens_seen += int(token_counts[0].item())
        self._record_rollout_metrics(all_per_function, all_rewards, std_is_zero, all_lengths, all_truncated)
        self.write_completions(self.completion_records(self.state.global_step + 1, prompts, completions,
                                                       per_function, rewards,
                                                       advantages if advantages.dim() == 1 else None))

        # Shuffle (seeded per round) so each slice mixes groups, then cut into equal slices.
        generator = torch.Generator().manual_seed(rollout_seed(self.args.seed, round_index) + 1)
        order = torch.randperm(len(rows), generator=generator).to(device)
        # dapo's count: the generation batch's tokens over all processes, each process's share of them.
        generation_tokens = token_counts[1].float() / self.accelerator.num_processes
        if self._rollout_forward is not None:  # one slice: the whole batch in `order`
            self._rollout_forward = (*self._rollout_forward[:2], order)
        slices = []
        for part in order.chunk(self.steps_per_generation):
            piece = {key: value[part] for key, value in batch.items()}
            piece["generation_tokens"] = generation_tokens
            slices.append(piece)
        return slices

    def _row_images(self, rows: list[dict[str, Any]]) -> tuple[Optional[list[list[str]]], Optional[dict[str, Any]]]:
        """The rows' image paths and their pixel inputs laid out by row (`ImageProcessing.row_pixel_inputs`), on the
        training device; (None, None) for a batch without images."""
        if self.images is None:
            return None, None
        paths = [list(row.get(IMAGE_COLUMN) or []) for row in rows]
        if not any(paths):
            return None, None
        return paths, {key: value.to(self.args.device) for key, value in self.images.row_pixel_inputs(paths).items()}

    def _tool_generation(self, rows: list[dict[str, Any]], columns: dict[str, list], seed: int, first_row: int
                         ) -> tuple[Any, torch.Tensor, list[list[dict[str, Any]]], list[list[dict[str, Any]]]]:
        """A tool-calling rollout of this process's rows (`rl.tools.ToolLoop`): each turn sampled under per-row,
        per-turn seeds (`rl.tools.turn_seeds`), so it is the same in a resumed run and with any number of processes.

        Returns:
            `(generation, tool_mask [N, C], completions, prompt_messages)`: the completions as message lists (what the
            reward functions get) and the prompts as the environments' `reset` left them.
        """
        g = self.grpo_args
        loop = self.tool_loop
        reset_kwargs = [{**{key: values[i] for key, values in columns.items()}, "prompt": row["prompt_messages"]}
                        for i, row in enumerate(rows)]
        messages, row_tools, _, prompt_ids = loop.start([row["prompt_messages"] for row in rows], reset_kwargs)

        def generate(contexts: list[list[int]], turn_rows: list[int], turn: int, max_new_tokens: int) -> list[list[int]]:
            kwargs = dict(self.generation_kwargs, max_new_tokens=max_new_tokens)
            seeds = turn_seeds(seed, turn, [first_row + r for r in turn_rows])
            generation = self.sample(contexts, generation_kwargs=kwargs, seed=seed, first_row=first_row, seeds=seeds)
            return [ids[:n].tolist() for ids, n in zip(generation.completion_ids, generation.completion_mask.sum(1))]

        config = self.model.config
        out = loop.run(generate, prompt_ids, row_tools, max_completion_length=g.max_completion_length,
                       max_iterations=g.max_tool_calling_iterations, timeout=g.tool_timeout,
                       max_tool_output_chars=g.max_tool_output_chars,
                       max_context_length=getattr(config, "max_position_embeddings", None))
        device = self.args.device
        self.record_metrics(loop.metrics(
            out, lambda t: self.accelerator.reduce(t.to(device), reduction="sum").cpu(),
            len(rows) * self.accelerator.num_processes), 1)
        generation, tool_mask = rollout_tensors(out, prompt_ids, padding_token_id(self.processing_class),
                                                self.stop_token_ids)
        return generation, tool_mask, out.messages, messages

    def compute_advantages(self, all_per_function: torch.Tensor, all_rewards: torch.Tensor,
                           batch: dict[str, torch.Tensor], local: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's advantages, from the gathered rewards of the whole generation batch (every process's rows).

        Args:
            all_per_function: `[N, F]` each reward function's scores, all processes.
            all_rewards: `[N]` their weighted sum.
            batch: this process's rows (`completion_mask`, `old_logps`, `ref_logps` when computed), for estimators
                that fold log-probs into the reward.
            local: this process's rows within the N.

        Returns:
            `(advantages, std_is_zero)`: `[n]` per completion, or `[n, C]` per token (reinforce_pp); the second
            for `frac_reward_zero_std`.
        """
        g = self.grpo_args
        if g.multi_objective_aggregation == "normalize_then_sum":
            advantages, std_is_zero = decoupled_group_advantages(
                all_per_function, self.reward_functions.weights.to(all_rewards.device), self.num_generations)
            return advantages[local], std_is_zero
        if self.advantage_estimator == "reinforce_pp":
            mask = batch["completion_mask"]
            # Without the rollout's log-probs (beta 0, no scoring pass) the KL reward is 0 on any equal pair.
            old_logps = batch.get("old_logps", torch.zeros(mask.shape, dtype=torch.float32, device=mask.device))
            ref_logps = batch["ref_logps"] if g.beta != 0 else old_logps
            # A completion no reward function scored gets score 0 (there is no group to leave it out of).
            scores = torch.nan_to_num(all_rewards[local], nan=0.0)
            advantages, _ = self.advantages(scores, old_logps, ref_logps, mask, g.beta,
                                            reduce_sum=lambda t: self.accelerator.reduce(t, reduction="sum"))
            if g.beta != 0:
                _, kl = sequence_log_ratio(old_logps, ref_logps, mask)
                totals = self.accelerator.reduce(torch.stack([kl.sum(), mask.sum().float()]), reduction="sum")
                self.record_metrics({"kl": (totals[0] / totals[1].clamp(min=1.0)).item()}, 1)
            return advantages, group_advantages(all_rewards, self.num_generations, g.scale_rewards)[1]
        advantages, std_is_zero = self.advantages(all_rewards, self.num_generations, g.scale_rewards)
        return advantages[local], std_is_zero

    def _vllm_sampler(self) -> VLLMColocateSampler:
        """The colocated vLLM engine, created on first use, holding the policy's weights as of this step."""
        if self._vllm is None:
            base = self.model.get_base_model() if is_peft_model(self.model) else self.model
            self._vllm = VLLMColocateSampler(base.name_or_path,
                                             gpu_memory_utilization=self.grpo_args.vllm_gpu_memory_utilization,
                                             max_model_len=None, dtype=next(base.parameters()).dtype)
        if self._vllm.synced_step != self.state.global_step:
            self._vllm.sync_weights(self.model)
            self._vllm.synced_step = self.state.global_step
        return self._vllm

    def _record_rollout_metrics(self, per_function, rewards, std_is_zero, lengths, truncated) -> None:
        """TRL 1.16's rollout metrics, one value per generation round."""
        lengths = lengths.float()
        terminated = lengths[~truncated] if (~truncated).any() else torch.zeros(1, device=lengths.device)
        metrics: dict[str, float] = {
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(),
            "completions/mean_terminated_length": terminated.mean().item(),
            "completions/min_terminated_length": terminated.min().item(),
            "completions/max_terminated_length": terminated.max().item(),
        }
        for i, name in enumerate(self.reward_functions.names):
            metrics[f"rewards/{name}/mean"] = torch.nanmean(per_function[:, i]).item()
            metrics[f"rewards/{name}/std"] = nan_std(per_function[:, i]).item()
        metrics["reward"] = torch.nanmean(rewards).item()
        metrics["reward_std"] = nan_std(rewards).item()
        metrics["frac_reward_zero_std"] = std_is_zero.float().mean().item()
        # A metric that is NaN this round (e.g. every value None) is left out rather than poisoning the mean.
        self.record_metrics({k: v for k, v in metrics.items() if not math.isnan(v)}, 1)

    # ---- the loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss returns the loss only.")
        g = self.grpo_args
        mask = inputs["completion_mask"]
        logps, entropy = self.slice_forward(model, inputs)
        old_logps = self.old_logps_of(inputs, logps)
        advantages = inputs["advantages"]
        entropy_mask = None
        if g.top_entropy_quantile < 1.0:
            entropy_mask = high_entropy_mask(entropy, mask, g.top_entropy_quantile,
                                             all_entropies=self._gather_counted(entropy.detach(), mask))
        metrics: dict[str, torch.Tensor] = {}
        per_token_loss, ratio, shown_ratio = self.policy_term(logps, old_logps, advantages, mask, metrics)
        if g.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * off_policy_sequence_mask(advantages, logps, old_logps, mask,
                                                                       g.off_policy_mask_threshold)
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        if g.beta != 0 and self.advantage_estimator != "reinforce_pp":  # reinforce_pp has its KL in the reward
            per_token_kl = k3_kl(logps, inputs["ref_logps"])
            if g.use_bias_correction_kl:
                per_token_kl = per_token_kl * ratio
            per_token_loss = per_token_loss + g.beta * per_token_kl
            metrics["kl"] = masked_mean(per_token_kl.detach(), mask)
        micro_batch_tokens = None
        if g.loss_type == "bnpo" and self.accelerator.num_processes > 1:
            # The micro-batch over all processes, each process's share (see `aggregate_loss`).
            micro_batch_tokens = self.accelerator.reduce(mask.sum().detach().float(), reduction="sum").item() \
                / self.accelerator.num_processes
        accumulation_steps = self.current_gradient_accumulation_steps
        loss = aggregate_loss(per_token_loss, mask, g.loss_type,
                              accumulation_steps=accumulation_steps,
                              steps_per_generation=self.steps_per_generation,
                              generation_tokens=inputs["generation_tokens"],
                              max_completion_length=g.max_completion_length,
                              micro_batch_tokens=micro_batch_tokens)
        if self._entropy_bonus_enabled:
            loss = self._add_entropy_bonus(loss, entropy, mask if entropy_mask is None else mask * entropy_mask,
                                           metrics)
        metrics["entropy"] = masked_mean(entropy, mask)
        if g.loss_type in CLIPPED_LOSS_TYPES:
            self._clip_metrics(shown_ratio.detach(), advantages, mask, metrics)
        self.record_metrics(metrics, 1)
        return loss

    def policy_term(self, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, metrics: dict[str, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `loss_type`'s policy term per token (`rl.losses`), before masks, KL and aggregation.

        Returns:
            `(per_token_loss [N, C] or [N, 1], ratio, shown_ratio)`: the importance ratio (per token, or `[N, 1]`
            per sequence) that weighs the KL; the ratio the clip metrics count (capped at `delta` when set, as TRL
            counts it).
        """
        g = self.grpo_args
        log_ratio = logps - old_logps
        ratio = torch.exp(importance_log_weights(log_ratio, mask, g.importance_sampling_level))
        shown_ratio = ratio if g.delta is None else torch.clamp(ratio, max=g.delta)
        if g.loss_type in CLIPPED_LOSS_TYPES:
            per_token_loss, _ = clipped_surrogate(logps, old_logps, advantages, g.epsilon, g.epsilon_high,
                                                  delta=g.delta, mask=mask,
                                                  importance_sampling_level=g.importance_sampling_level)
        elif g.loss_type == "cispo":
            per_token_loss = cispo_loss(logps, ratio, advantages, g.epsilon_high)
            per_row = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            clipped = ((ratio.detach() > g.epsilon_high) & (per_row > 0)).float()
            metrics["cispo_clip_ratio"] = self._sequence_or_token_mean(clipped, mask)
        elif g.loss_type == "sapo":
            per_token_loss = sapo_loss(ratio, advantages, g.sapo_temperature_pos, g.sapo_temperature_neg)
        else:  # vespo
            phi = vespo_weights(log_ratio, mask, advantages, g.vespo_k_pos, g.vespo_lambda_pos, g.vespo_k_neg,
                                g.vespo_lambda_neg)
            per_row = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            per_token_loss = -phi * per_row * logps
            metrics["vespo/phi_seq_mean"] = phi.mean()
        return per_token_loss, ratio, shown_ratio

    @staticmethod
    def _sequence_or_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A metric's mean: over rows for a per-sequence `[N, 1]` value, over counted tokens for `[N, C]`."""
        return values.mean() if values.shape[1] == 1 else masked_mean(values, mask)

    def _clip_metrics(self, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      metrics: dict[str, torch.Tensor]) -> None:
        """TRL 1.16's clip shares of the clipped surrogate: means, and the lowest / highest share of one completion."""
        g = self.grpo_args
        adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages)
        low = ((ratio < 1 - g.epsilon) & (adv < 0)).float()
        high = ((ratio > 1 + g.epsilon_high) & (adv > 0)).float()
        metrics.update({
            "clip_ratio/low_mean": self._sequence_or_token_mean(low, mask),
            "clip_ratio/high_mean": self._sequence_or_token_mean(high, mask),
            "clip_ratio/region_mean": self._sequence_or_token_mean(torch.maximum(low, high), mask),
        })
        if ratio.shape[1] == 1:  # one value per completion already
            low_rows, high_rows = low.squeeze(1), high.squeeze(1)
        else:
            # Per-completion clip shares, over completions with a token that counts (TRL's nanmin/nanmax).
            counted = mask.sum(-1) > 0
            row_tokens = mask.sum(-1).clamp(min=1)
            low_rows = ((low * mask).sum(-1) / row_tokens)[counted]
            high_rows = ((high * mask).sum(-1) / row_tokens)[counted]
        low_min = low_rows.min() if low_rows.numel() else torch.tensor(math.inf, device=mask.device)
        high_max = high_rows.max() if high_rows.numel() else torch.tensor(-math.inf, device=mask.device)
        if self.accelerator.num_processes > 1:
            # Over the micro-batch of every process, as TRL takes them (the min of the gathered values).
            low_min, high_max = low_min.detach().clone(), high_max.detach().clone()
            torch.distributed.all_reduce(low_min, op=torch.distributed.ReduceOp.MIN)
            torch.distributed.all_reduce(high_max, op=torch.distributed.ReduceOp.MAX)
        if math.isfinite(low_min.item()):
            metrics.update({"clip_ratio/low_min": low_min, "clip_ratio/high_max": high_max})

    def _gather_counted(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The values at counted tokens of every process's micro-batch (for the entropy quantile)."""
        local = values[mask.bool()].float()
        if self.accelerator.num_processes == 1:
            return local
        # Entropies are >= 0, so a negative pad cannot be mistaken for one.
        gathered = self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=-1e9))
        return gathered[gathered != -1e9]

    def _add_entropy_bonus(self, loss: torch.Tensor, entropy: torch.Tensor, effective_mask: torch.Tensor,
                           metrics: dict[str, torch.Tensor]) -> torch.Tensor:
        """`loss - coef x mean token entropy` (`rl.losses.entropy_bonus`), the coefficient fixed or adaptive."""
        g = self.grpo_args
        accumulation_steps = self.current_gradient_accumulation_steps
        # The policy loss alone, as TRL logs it: undivided for the per-micro-batch normalisations.
        scale = 1 if g.loss_type in ("dapo", "cispo", "vespo") else accumulation_steps
        metrics["policy_loss"] = loss.detach() * scale
        controller = self._entropy_controller
        coef = controller.applied() if controller is not None else g.entropy_coef
        loss = loss - coef * entropy_bonus(entropy, effective_mask, accumulation_steps)
        if controller is not None:
            stats = torch.stack([(entropy * effective_mask).sum(), effective_mask.sum()]).detach()
            self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
            if self.accelerator.sync_gradients:
                total = self.accelerator.reduce(self._entropy_window, reduction="sum")
                controller.update((total[0] / total[1].clamp(min=1.0)).item())
                self._entropy_window = None
        if self.accelerator.sync_gradients:
            metrics["entropy_coef"] = torch.tensor(controller.coef if controller is not None else g.entropy_coef)
        return loss

    # ---- checkpoints ----

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Beside the optimizer: the buffered generation batch, so a resume mid-batch trains on the same slices."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self._buffer is not None:
            # Every process buffers its own share of the generation batch.
            self.save_process_file({"round": self._buffer_round,
                                    "slices": [{k: v.cpu() for k, v in s.items()} for s in self._buffer]},
                                   output_dir, ROLLOUT_BUFFER_FILE)
        if self._entropy_controller is not None and self.accelerator.is_main_process:
            (Path(output_dir) / ENTROPY_CONTROLLER_FILE).write_text(json.dumps(self._entropy_controller.state_dict()))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        self._micro_step = None  # recomputed from the restored global step on the next micro-batch
        self._buffer = self._buffer_round = None
        if checkpoint is None:
            return
        controller_path = Path(checkpoint) / ENTROPY_CONTROLLER_FILE
        if self._entropy_controller is not None and controller_path.is_file():
            self._entropy_controller.load_state_dict(json.loads(controller_path.read_text()))
        path = Path(checkpoint) / self.process_file(ROLLOUT_BUFFER_FILE)
        if path.is_file():
            saved = torch.load(path, weights_only=True)
            self._buffer = [{k: v.to(self.args.device) for k, v in s.items()} for s in saved["slices"]]
            self._buffer_round = saved["round"]


# ---------------------------------------------------------------------------------------------------
# Stage entry point
# ---------------------------------------------------------------------------------------------------


def build_online_trainer(trainer_class: type["OnlineTrainer"], config: "Config", callbacks: list["TrainerCallback"],
                         *, method_keyword: str = "grpo_args",
                         max_completion_length: Optional[int] = None) -> "OnlineTrainer":
    """Tokenizer, prompts, model and reward functions as `config` says, in an online stage's trainer.

    Args:
        trainer_class: `GRPOTrainer` or a subclass (RLOO), or another `OnlineTrainer` taking reward functions and
            stop tokens (online DPO).
        method_keyword: the trainer's keyword for the stage's own keys (`config.method`): `grpo_args` for GRPO and
            its subclasses, `online_dpo_args` for online DPO.
        max_completion_length: L_max of the `length` reward when the stage's keys do not name it
            `max_completion_length` (online DPO: its `max_new_tokens`); checked before anything loads.
    """
    from ..data import ChatFormatter, get_dataset
    from ..model.loader import load_image_processing, load_model, load_tokenizer
    from ..rewards import build_reward_functions, check_reward_functions
    from .base import check_splits

    config_dir = config.dir
    check_reward_functions(config.method, config_dir=config_dir,  # before anything loads
                           max_completion_length=max_completion_length)
    tokenizer = load_tokenizer(config.model)
    formatter = ChatFormatter(tokenizer, config.data.template, config.data.default_system)
    tool_kwargs: dict[str, Any] = {}
    if getattr(config.method, "uses_tools", False):  # checked before the data and the model load
        from ..rl.tools import ToolCallFormat, load_environment_factory, load_tools

        ToolCallFormat.from_formatter(formatter)  # the template must write tool calls
        tools = load_tools(config.method.tools or [], config_dir)
        factory = (load_environment_factory(config.method.environment_factory, config_dir, tools)
                   if config.method.environment_factory else None)
        tool_kwargs = {"tools": tools, "environment_factory": factory, "formatter": formatter}
    # Image prompts: GRPO and its subclasses (RLOO); another online stage keeps refusing a vision-language model
    # before its weights load (`load_model(vision=False)`).
    vision = method_keyword == "grpo_args"
    images = load_image_processing(config.model, tokenizer) if vision else None
    if images is not None:
        from ..rewards.builtin import BUILTIN_NAMES

        reward_models = [spec for spec in config.method.reward_funcs if spec not in BUILTIN_NAMES and ":" not in spec]
        refused = ("tools / environment_factory" if tool_kwargs else "use_vllm: true" if config.method.use_vllm
                   else f"a reward model in reward_funcs ({reward_models[0]}; it scores text, not images)"
                   if reward_models else None)
        if refused:
            raise ConfigError(f"stage {config.finetuning.stage} with a vision-language model does not take {refused} "
                              "yet: image prompts go through alignkit's own rollouts and reward functions "
                              "(docs/multimodal.md).")
    datasets = get_dataset(config, tokenizer, DATA_KIND, images=images)
    check_splits(config, datasets)
    model = load_model(config.model, config.finetuning, is_trainable=config.training.do_train, vision=vision)
    reward_functions = build_reward_functions(
        config.method, model=model, formatter=formatter, model_args=config.model, config_dir=config_dir,
        max_completion_length=max_completion_length)
    return trainer_class(
        model=model,
        args=config.training,
        reward_functions=reward_functions,
        stop_token_ids=formatter.stop_token_ids(),
        processing_class=tokenizer,
        callbacks=callbacks,
        train_dataset=datasets["train_dataset"],
        **{method_keyword: config.method},
        **({"images": images} if vision else {}),
        **tool_kwargs,
    )


def run_grpo(config: "Config", callbacks: list["TrainerCallback"]) -> None:
    """Train the policy with GRPO as `config` says; outputs (adapter, logs, completions.jsonl) go to `output_dir`."""
    trainer = build_online_trainer(GRPOTrainer, config, callbacks)
    run_stage_trainer(trainer, config)
    save_processor(trainer, config)


def save_processor(trainer: "GRPOTrainer", config: "Config") -> None:
    """A vision-language model's processor beside the trained model, so it reloads as trained (as sft does)."""
    if trainer.images is not None and config.training.do_train and trainer.is_world_process_zero():
        trainer.images.save(config.training.output_dir)


__all__ = [
    "GroupRolloutArguments",
    "GRPOArguments",
    "build_online_trainer",
    "check_config",
    "check_generation_loop",
    "check_vllm_keys",
    "resolve_generation_batch",
    "GenerationBatchSampler",
    "GRPOTrainer",
    "run_grpo",
    "save_processor",
    "slice_image_inputs",
]
