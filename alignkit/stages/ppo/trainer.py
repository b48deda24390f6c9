"""PPO's loop (`PPOTrainer`), built from the Trainer's parts. What it simplifies, and why:
- A Trainer "step" (`global_step`, `max_steps`, `save_steps`, `logging_steps`, the scheduler) is one PPO step
  (one rollout and its `ppo_epochs` passes), as in LLaMA-Factory's PPO; the optimizer steps several times in
  it. The loop is our own (`_inner_training_loop`, which `Trainer.train` runs after its set-up: activation
  checkpointing, Liger, memory metrics), built from the Trainer's parts (optimizer, scheduler, `TrainerState`,
  callbacks, `_save_checkpoint`, `log`), so the files every stage writes are written here too.
- Prompts are drawn by a permutation seeded from `data_seed` (else `seed`) and the epoch, responses are sampled
  under a seed of their own per step (`rollout.rollout_seed`, shared with GRPO), response lengths and update
  batches are drawn from `(seed, step)`: step k depends on k and the weights alone, so a resumed run needs no
  data skipping and equals the uninterrupted one. Checkpoints add the KL coefficient and score statistics (`ppo_state.json`).
- The policy's log-probs and the critic's values come from one call of the model (`policy_forward`); the
  sequences are laid out contiguously (`pack_right`) so each token has its true position in the padded and the
  padding-free forward alike.
- Several processes (`torchrun`, `accelerate launch`): data parallel without a DDP wrapper. A rollout is
  global (`per_device_train_batch_size x gradient_accumulation_steps x ppo_buffer_size x processes` prompts);
  process r takes the r-th equal share of it and samples each row under the seed of its place in the global
  rollout (`rollout.row_seeds`, one generator per row). Everything that is a statistic of the rollout is taken over all
  processes: the score normalisation moments (`ppo_score_norm`) from the gathered scores, the mean KL fed
  to the adaptive KL controller, the whitening of rewards and advantages (masked sums reduced across
  processes), the metrics. So every process keeps the same `kl_coef` and score moments, and
  `ppo_state.json` (written once, by the main process) holds what all of them hold. An update batch is
  the global one (the rows of the global permutation that a process holds, so the shares may be unequal);
  each process backpropagates its rows with token weights over the whole batch, and the gradients of
  every trainable tensor (policy adapter, value head, critic adapter) are summed over processes before
  clipping and the optimizer step. A value head outside a DDP-wrapped model would get no all-reduce;
  here no tensor depends on a wrapper. N processes x batch b therefore update as one process x batch N x b.
- DeepSpeed ZeRO-0/1/2 (the `deepspeed` key or an `accelerate launch` DeepSpeed config; optimizer state and
  gradients sharded, optimizer offload allowed, weights whole on every process): the Trainer's DeepSpeed set-up
  (`deepspeed_init`, then `accelerator.prepare` of model and optimizer) builds the engine, with the value head and
  every adapter inside it as submodules. Each micro-batch's backward goes through `accelerator.backward`
  (`scale_wrt_gas` off, the loss times the process count since DeepSpeed averages gradients where this loop sums
  them); the update batch's last one is the engine's accumulation boundary, where DeepSpeed reduces, clips (its
  `gradient_clipping`, from max_grad_norm), steps and zeroes the gradients, so the manual gradient sum is skipped.
  Every process runs as many micro-batches (passes over a row with weight 0 even them out), as DeepSpeed's
  collectives need. Training forwards call the engine (`model_wrapped`), as the Trainer's training step does. The
  learning-rate schedule is the Trainer's, stepped once per PPO step (a DeepSpeed `scheduler` block is refused).
  Checkpoints are the Trainer's DeepSpeed ones (the engine's `save_checkpoint`; a resume loads them with
  `deepspeed_load_checkpoint`, master weights and optimizer state included), plus the adapter, value head and
  `ppo_state.json` as always. Under DeepSpeed bf16/fp16 the engine casts the whole module, value head included.
- DeepSpeed ZeRO-3 (weights partitioned too), what changes and why it is right:
  - Every weight is read inside its own module's call. ZeRO-3 partitions each weight when `from_pretrained`
    returns (`deepspeed.zero.Init`); the engine's hooks gather a module's weights before its forward, release them
    after, and gather them again before its backward. So the training forward is one call of the engine
    (`policy_forward`): a pre-hook on the output layer keeps only the positions that predict a response token and
    records the hidden states it receives, and the value head runs as a module on those (it is H + 1 numbers,
    under DeepSpeed's default `stage3_param_persistence_threshold` of 10 x H, so it stays whole anyway). The
    fused paths that read weights outside their module step aside under ZeRO-3: `lora_fused` (the LoRA layer
    read its base layer's weight) and the fused output-layer log-probs of `logprobs` (`_fusable_head` returns None
    for a partitioned head).
  - The LoRA adapter switches (the reward adapter, the critic adapter, the reference with adapters off) are not a
    problem: they flip flags (the active adapter's name, PEFT's disable flag, `requires_grad`), never copy or
    replace a tensor; an inactive adapter's weights stay partitioned and unused, an active one's are gathered by
    its modules' hooks like any weight. The optimizer holds every trainable tensor from the start; a tensor whose
    `requires_grad` is off during a pass (the policy adapter in the critic pass) just gets no gradient from it.
  - Each rollout (generation, reward adapter, the policy, critic and reference passes) runs in one
    `full_weights(model, engine)` block: DeepSpeed's `unwrap_model_for_generation(engine)` gathers every weight
    once and takes the engine's hooks off for the block (with the hooks on, each forward would release and
    re-gather its layers: once per token). That holds the whole model on every process for the rollout. A reward
    model loaded on its own (partitioned by `from_pretrained`, in no engine) is gathered for the rollout too.
  - Saving: the Trainer's `save_model` consolidates the trainable tensors on the main process
    (`_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)` for a PEFT model, accelerate's
    `get_state_dict(engine)`, the same consolidation of every weight, for a full/freeze one), and `_save`
    writes the adapter(s) and value head from that dict, not from the module's partitions. Checkpoints and resume
    are the engine's, as under ZeRO-0/1/2.
  - A full/freeze policy's reference is not a deep copy (that would copy partitions no engine gathers) but the
    policy loaded again from its source, partitioned the same way, and gathered for the reference pass
    (`StageTrainer`, `full_weights`). `adapter_name_or_path` is merged into a cached base before the load
    (`loader.ensure_merged_base`), never into partitioned weights.
- FSDP2 (`fsdp` with `fsdp_config: {version: 2}`, or an accelerate config with `fsdp_version: 2`): the Trainer's
  FSDP2 set-up (`_prepare_fsdp2`): the optimizer is made over the whole model, then `accelerator.prepare` shards
  it in place (each decoder layer and the root a unit: the policy's adapters sit in their layers' units, the value
  head, a submodule, in the root's) and points the optimizer at the shards. Each micro-batch's backward reduces
  the gradients (FSDP2 averages over processes, so the loss is multiplied by the process count, as under
  DeepSpeed); every process runs as many micro-batches (weightless passes, as under DeepSpeed), since each
  forward gathers and each backward reduces. The value head is read on the hidden states after the model's call:
  the root unit keeps its weights whole from its forward to the end of its backward (FSDP2 does not reshard the
  root after forward; `full_weights` keeps it so even when the first rollout comes before any forward). Each
  rollout runs in one `full_weights` block (every unit unsharded once, resharded on exit). Saving: the Trainer's
  `save_model` gathers the full state dict (`FULL_STATE_DICT`) and `_save` writes the adapter(s) and value head
  from it; checkpoints add accelerate's FSDP model and optimizer files, which a resume loads into the shards (an
  optimizer without per-parameter state, plain SGD, gets its groups' settings back by hand: torch's loader finds
  no tensor to place). Tested on the CPU (gloo, accelerate's device gate lifted for the test, see
  `tests/distributed/test_distributed_rl.py`): 2 FSDP2 processes equal 1 process with the double batch, and a
  resume equals the uninterrupted run, for a LoRA policy and (2 steps, no resume) a full one (its reference a
  whole copy per process, taken before sharding). Not tested: `ppo_critic: adapter` (its `requires_grad`
  switches on sharded parameters), a LoRA reward adapter, a freeze policy.
- Refused: FSDP1 (`FSDP_REFUSAL`): no FSDP1 path is written (its root unit's flattened parameters are whole only
  inside the wrapper's forward, and the value head is read after it).
- NOT RUN ON A GPU: the DeepSpeed paths (ZeRO-0/1/2 and ZeRO-3) are written against the documented APIs of
  transformers 5.24, accelerate and DeepSpeed, run with real DeepSpeed 0.19.8 on the CPU over gloo
  (tests/distributed/test_distributed_deepspeed.py: LoRA under ZeRO-2 and ZeRO-3, 2 processes equal 1), and tested
  with stand-ins that keep DeepSpeed's contract (tests/stages/test_ppo.py: an engine, and for ZeRO-3 parameters
  that are empty outside their module's calls and the rollout's gather).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from ...constants import IGNORE_INDEX
from ...model.distributed import full_weights
from ...rl.kl import AdaptiveKLController, FixedKLController, kl_penalty_rewards
from ...rl.losses import clipped_policy_loss, clipped_value_loss
from ...rl.stats import RunningMoments, masked_mean, masked_whiten
from ..online import OnlineTrainer, data_order_seed, has_active_dropout
from .config import CRITIC_ADAPTER, FSDP_REFUSAL, PPO_STATE_FILE, PPOArguments, deepspeed_refusal
from .layout import Rollout, pack_right, policy_forward, sample_response_lengths, truncate_to_lengths

logger = logging.getLogger(__name__)

# The private members of `transformers.Trainer` this loop relies on, where no public API does the job, each named
# here once. Checked against transformers 5.24.0 (`tests/stages/test_ppo.py` fails if one disappears).
TRAINER_INTERNALS: dict[str, str] = {
    "_save": "overridden: writes the policy adapter, the critic adapter and the value head",
    "_save_checkpoint": "overridden, then called: the Trainer's checkpoint files after ppo_state.json",
    "_get_output_dir": "the run folder a checkpoint goes to (as `_save_checkpoint` computes it)",
    "_inner_training_loop": "overridden: PPO's loop, which `Trainer.train` runs after its set-up",
    "_load_from_checkpoint": "overridden to do nothing before the loop; the Trainer's, called by `_resume`: a "
                             "full/freeze policy's weights, or accelerate's FSDP2 model state",
    "_memory_tracker": "the memory metrics `skip_memory_metrics: false` asks for, which `Trainer.train` started",
    "_load_optimizer_and_scheduler": "optimizer and scheduler state on resume",
    "_load_rng_state": "the RNG states on resume",
    "_load_callback_state": "the stateful callbacks' state on resume",
    "_get_learning_rate": "the learning rate that `log` reports (DeepSpeed-aware)",
    "_initial_num_input_tokens_seen": "the attribute `log` reads for the tokens-seen metric",
}

class PPOTrainer(OnlineTrainer):
    """PPO's loop on the Trainer's optimizer, scheduler, state, callbacks, checkpoints and logging.

    Args:
        ppo_args: the stage's `PPOArguments`.
        reward_functions: `alignkit.rewards.RewardFunctions` (reward model and/or functions), or None when
            the run does not train.
        formatter: the run's `ChatFormatter` (stop tokens).
        value_head: the critic's head, attached to the policy (`attach_value_head`).
        max_new_tokens: most response tokens when no `response_length_range` is set.
        *args, **kwargs: as for `transformers.Trainer` (`train_dataset`: prompt rows).
    """

    # Rewards -> advantages: GAE over the critic's values (`alignkit.rl.advantages.ADVANTAGE_ESTIMATORS`).
    advantage_estimator = "gae"

    def __init__(self, *args, ppo_args: PPOArguments, reward_functions, formatter, value_head,
                 max_new_tokens: int, **kwargs) -> None:
        # A full/freeze policy needs a frozen copy as its reference (under LoRA the adapter is disabled instead; under
        # ZeRO-3 the copy is a second, partitioned load, gathered for each reference pass: `StageTrainer`).
        kwargs.setdefault("keep_reference_copy", True)
        super().__init__(*args, reward_functions=reward_functions, stop_token_ids=formatter.stop_token_ids(),
                         log_completions=ppo_args.log_completions, **kwargs)
        # As in `check_config`, for set-ups that come from `accelerate launch --config_file` rather than the keys.
        reason = FSDP_REFUSAL if self.is_fsdp_enabled and not self.accelerator.is_fsdp2 else None
        if self.is_deepspeed_enabled:
            reason = deepspeed_refusal(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        if reason:
            from ...errors import ConfigError

            raise ConfigError(reason)
        self.ppo_args = ppo_args
        self.formatter = formatter
        self.value_head = value_head
        low_high = ppo_args.response_length_range
        self.max_response_tokens = low_high[1] if low_high else max_new_tokens
        self.kl_ctl = (AdaptiveKLController(ppo_args.init_kl_coef, ppo_args.ppo_target, ppo_args.horizon)
                       if ppo_args.adap_kl_ctrl else FixedKLController(ppo_args.init_kl_coef))
        self.score_moments = RunningMoments()
        t = self.args
        self.num_processes, self.process_index = self.accelerator.num_processes, self.accelerator.process_index
        # This process's share of an update batch and of a rollout, and the global sizes (all processes).
        self.backward_batch_size = t.per_device_train_batch_size * t.gradient_accumulation_steps
        self.rollout_size = self.backward_batch_size * ppo_args.ppo_buffer_size
        self.global_backward_batch_size = self.backward_batch_size * self.num_processes
        self.global_rollout_size = self.rollout_size * self.num_processes
        # This process holds rows first_row .. first_row + rollout_size - 1 of each global rollout.
        self.first_row = self.process_index * self.rollout_size
        self.mini_batch_size = ppo_args.mini_batch_size or t.per_device_train_batch_size
        # The rollout's policy and critic outputs with their graph, when they are also the first pass's
        # (`first_pass_in_rollout`); taken by that pass.
        self._first_pass: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    # ---- across processes ----

    def _sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over all processes (itself in one process)."""
        if self.num_processes == 1:
            return tensor
        return self.accelerator.reduce(tensor, reduction="sum")

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rows of every process's `tensor`, in process order (the global rollout's order)."""
        return self.accelerator.gather(tensor) if self.num_processes > 1 else tensor

    def _sum_gradients(self) -> None:
        """Sum every trainable tensor's gradient over processes (the update batch is global; each process
        backpropagated its own rows with token weights over the whole batch). A tensor that got no gradient
        on any process keeps none, as in one process, so the optimizer skips it there as well."""
        if self.num_processes == 1:
            return
        # The optimizer's tensors: the same list, in the same order, on every process (which tensors have
        # requires_grad set at a given moment is not: the critic adapter's flag follows adapter switches).
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        has_grad = self._sum(torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                                          device=self.args.device))
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param, count in zip(params, has_grad.tolist()):
            if count > 0:
                by_dtype.setdefault(param.dtype, []).append(param)
        for group in by_dtype.values():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
            flat = self._sum(flat)
            offset = 0
            for param in group:
                param.grad = flat[offset:offset + param.numel()].view_as(param).clone()
                offset += param.numel()

    def _most_micro_batches(self, count: int) -> int:
        """The largest `count` of any process (this one's alone in one process)."""
        if self.num_processes == 1:
            return count
        return int(self._gather(torch.tensor([count], device=self.args.device)).max())

    def _deepspeed_backward(self, loss: torch.Tensor, last: bool) -> None:
        """One micro-batch's backward through the DeepSpeed engine (`accelerator.backward`); `last` marks the update
        batch's last one, where the engine reduces, clips, steps and zeroes the gradients.

        The loss weights are token shares of the whole update batch (all processes), so the gradient wanted is the
        sum over processes; DeepSpeed averages over them, hence the factor of the process count. `scale_wrt_gas`
        off: the shares already make the update the token mean, as the Trainer turns it off for its own loss.
        """
        # The Trainer marks the boundary the same way; after the last pass the flag is True again, as it was.
        self.accelerator.gradient_state._set_sync_gradients(last)
        self.accelerator.backward(loss * self.num_processes, scale_wrt_gas=False)

    # ---- data ----

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train_dataset) // self.global_rollout_size

    def rollout_rows(self, step: int) -> dict[str, list]:
        """This process's prompt rows of PPO step `step`: its share of slice `step` of the epoch's permutation,
        seeded by (seed, epoch)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([data_order_seed(self.args), epoch]).permutation(len(self.train_dataset))
        chosen = order[index * self.global_rollout_size:(index + 1) * self.global_rollout_size]
        chosen = chosen[self.first_row:self.first_row + self.rollout_size]
        return self.train_dataset.select(chosen.tolist()).to_dict()

    # ---- forward passes ----

    def _critic_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, grad: bool,
                       call: Optional[nn.Module]) -> torch.Tensor:
        """[N, L - 1] values of the critic adapter + head, aligned with the log-prob columns (`call`: as for
        `policy_forward`)."""
        from ...model.adapters import use_adapter
        from ...model.heads import values_from_hidden

        with use_adapter(self.model, CRITIC_ADAPTER):
            if grad:
                for name, param in self.model.named_parameters():
                    if f".{CRITIC_ADAPTER}." in name:
                        param.requires_grad_(True)
            # No labels: the output layer runs on no position, only the hidden states are read.
            _, hidden, flat = policy_forward(self.model, input_ids, attention_mask,
                                             torch.full_like(input_ids, IGNORE_INDEX),
                                             padding_free=self.args.padding_free, call=call)
            values = values_from_hidden(self.value_head, hidden, attention_mask, flat)
        return values[:, :-1]

    def _standalone_reward_models(self) -> list[nn.Module]:
        """The reward models loaded with their own base (`reward_model_type: full`, or an RM that does not fit the
        policy's base as an adapter), which the rollout runs outside the policy's engine."""
        from ...rewards.model import FullRewardModel

        functions = self.reward_functions.functions if self.reward_functions is not None else []
        return [f.scorer.model for f in functions if isinstance(f, FullRewardModel)]

    def policy_outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                       with_values: bool = True, grad: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs of the labelled tokens and, with `with_values`, the critic's values, both [N, L - 1].

        Critic `head`: one model call feeds both the output layer and the value head (`policy_forward`).
        Critic `adapter`: a second call with the critic adapter switched in. With `grad` (training) the call goes
        through `model_wrapped` (the DeepSpeed engine, whose forward and module hooks gather ZeRO-3 partitions);
        without (the rollout, whose weights `full_weights` has gathered) through the model itself.
        """
        from ...model.heads import values_from_hidden

        call = self.model_wrapped if grad else None
        with self.accelerator.autocast():
            logps, hidden, flat = policy_forward(self.model, input_ids, attention_mask, labels,
                                                 padding_free=self.args.padding_free, call=call)
            if not with_values:
                return logps.float(), None
            if self.ppo_args.ppo_critic == "head":
                # A module call: under ZeRO-3 the value head's hooks gather it (it is H + 1 numbers, under the
                # default `stage3_param_persistence_threshold` of 10 x H, so DeepSpeed keeps it whole anyway).
                values = values_from_hidden(self.value_head, hidden, attention_mask, flat)[:, :-1]
            else:
                values = self._critic_values(input_ids, attention_mask, grad, call)
        return logps.float(), values.float()

    def first_pass_in_rollout(self) -> bool:
        """Whether the rollout's policy and critic pass can be the first PPO pass's forward as well.

        The first pass's first update batch trains at the weights that made the rollout. When it is the whole
        rollout in one micro-batch (one update batch per pass, `mini_batch_size` covering this process's rows: the
        defaults) and no dropout is active, its forward gives exactly the rollout's log-probs and values, so the
        rollout runs that forward once, with its graph, and the pass backpropagates it instead of running the
        model again: one forward of the rollout less per step, and the first pass's ratios are exactly 1, as PPO's
        definition has them. Not under DeepSpeed or FSDP2 (their rollout runs on gathered weights outside the
        engine, their training forwards through it), and not with several micro-batches (holding every
        micro-batch's graph at once is the memory `mini_batch_size` is there to save).
        """
        if self.is_deepspeed_enabled or self.accelerator.is_fsdp2:
            return False
        if self.global_backward_batch_size < self.global_rollout_size or self.mini_batch_size < self.rollout_size:
            return False
        return not has_active_dropout(self.model, *([self.value_head] if self.value_head is not None else []))

    # ---- one PPO step ----

    def make_rollout(self, step: int) -> tuple[Rollout, dict[str, Any], list[dict[str, Any]]]:
        """Generate, score and evaluate one rollout; returns it, its metrics and its completion records."""
        from ...data.collator import padding_token_id
        from ...rl.rollout import rollout_seed
        from ..online import PROMPT_COLUMNS

        rows = self.rollout_rows(step)
        # Under ZeRO-3 the weights are gathered once for the whole rollout (generation, the reward model's
        # adapter, the policy, critic and reference passes), not once per forward or per token: DeepSpeed's own
        # block over the engine, which also takes the engine's per-module hooks off meanwhile (`full_weights`).
        # A reward model loaded on its own (not in the engine, but partitioned by `from_pretrained` under ZeRO-3)
        # is gathered for the rollout as well. Without partitioned weights both are no-ops.
        with contextlib.ExitStack() as gathered:
            gathered.enter_context(full_weights(self.model, self.model_wrapped if self.is_deepspeed_enabled else None))
            for reward_model in self._standalone_reward_models():
                gathered.enter_context(full_weights(reward_model))
            start = time.perf_counter()
            # Mixed precision (`bf16`): PPO's model is not `accelerator.prepare`d outside DeepSpeed and FSDP, so
            # accelerate's autocast forward is not there; every forward of the step (decode, policy, critic,
            # reference) runs under the accelerator's autocast instead, as the other stages' forwards do (a no-op
            # in fp32 and under DeepSpeed, whose engine holds the precision).
            gathered.enter_context(self.accelerator.autocast())
            generation = self.sample(
                rows["input_ids"],
                # The policy's own distribution: the log-probs, ratios and KL below are those of what was sampled.
                generation_kwargs={"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                   "max_new_tokens": self.max_response_tokens},
                seed=rollout_seed(self.args.seed, step), first_row=self.first_row)
            response_mask = generation.completion_mask
            if self.ppo_args.response_length_range is not None:
                low, high = self.ppo_args.response_length_range
                # Drawn for the whole rollout, so a row's length does not depend on the number of processes.
                lengths = sample_response_lengths(low, high, self.global_rollout_size, self.args.seed, step)
                own = lengths[self.first_row:self.first_row + self.rollout_size]
                response_mask = truncate_to_lengths(response_mask, own)
            generation_time = time.perf_counter() - start

            start = time.perf_counter()
            response_ids = [row[m.bool()].tolist()
                            for row, m in zip(generation.completion_ids.cpu(), response_mask.cpu())]
            texts = self.processing_class.batch_decode(response_ids, skip_special_tokens=True)
            columns = {k: v for k, v in rows.items() if k not in PROMPT_COLUMNS}
            truncated = [not any(t in self.stop_token_ids for t in ids) for ids in response_ids]
            prompts, completions, per_function, raw_scores = self.score(
                rows["prompt_messages"], rows.get("prompt_conversational", [True] * len(texts)), texts, columns,
                response_ids, truncated)
            # The whole rollout's scores (all processes), for the check below, the score moments and the metrics.
            all_scores = self._gather(raw_scores.to(self.args.device))
            if torch.isnan(all_scores).any():
                bad = int(torch.isnan(all_scores).nonzero()[0])
                local = bad - self.first_row
                text = f" ({texts[local][:80]!r})" if 0 <= local < len(texts) else ""
                raise ValueError(f"PPO step {step + 1}: every reward function returned None for completion {bad}"
                                 f"{text}; PPO needs a score for every response.")

            device = self.args.device
            input_ids, attention_mask, labels = pack_right(
                generation.prompt_ids.to(device), generation.prompt_mask.to(device),
                generation.completion_ids.to(device), response_mask.to(device), padding_token_id(self.processing_class))
            mask = (labels[:, 1:] != IGNORE_INDEX).float()
            self._first_pass = None
            was_training = self.model.training
            try:
                if self.first_pass_in_rollout():
                    # The first pass's training forward (train mode: no dropout is active, so it is the eval one).
                    self.model.train()
                    self._first_pass = self.policy_outputs(input_ids, attention_mask, labels)
                    logps, values = (tensor.detach() for tensor in self._first_pass)
                else:
                    self.model.eval()
                    with torch.no_grad():
                        logps, values = self.policy_outputs(input_ids, attention_mask, labels, grad=False)
                self.model.eval()
                with self.reference() as reference_model:
                    ref_logps = policy_forward(reference_model, input_ids, attention_mask, labels,
                                               padding_free=self.args.padding_free)[0]
            finally:
                self.model.train(was_training)

        scores = raw_scores.to(device)
        if self.ppo_args.ppo_score_norm:
            self.score_moments.update(all_scores)  # the same moments on every process
            scores = self.score_moments.normalize(scores).float()
        kl_coef = self.kl_ctl.value
        rewards, kl = kl_penalty_rewards(logps, ref_logps, scores, mask, kl_coef)
        reduce_sum = self._sum if self.num_processes > 1 else None
        if self.ppo_args.ppo_whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, reduce_sum=reduce_sum)
        advantages, returns = self.advantages(rewards, values * mask, mask, self.ppo_args.gamma, self.ppo_args.lam)
        if self.ppo_args.whiten_advantages:
            advantages = masked_whiten(advantages, mask, reduce_sum=reduce_sum)
        rollout = Rollout(input_ids, attention_mask, labels, mask, logps, ref_logps, values * mask, advantages,
                          returns, scores)
        # Metrics of the whole rollout: per-response sums and lengths gathered from every process.
        all_kl, all_entropy = self._gather(kl.sum(dim=1)), self._gather((-logps * mask).sum(dim=1))
        lengths = self._gather(mask.sum(dim=1))
        all_per_function = self._gather(per_function.to(device))
        all_scores = all_scores.float()
        # The online stages' shared names (TRL's GRPO names) where the concept is the same; PPO's own under `objective/`.
        metrics = {
            "reward": all_scores.mean().item(),
            "reward_std": all_scores.std().item() if all_scores.numel() > 1 else 0.0,
            # KL to the reference per response token (GRPO's `kl` unit), from the sampled tokens' log-ratios.
            "kl": (all_kl.sum() / lengths.sum().clamp(min=1)).item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            # The KL summed over each response, averaged: what the adaptive controller steers to ppo_target.
            "objective/kl": all_kl.mean().item(),
            "objective/kl_coef": kl_coef,
            # TRL 0.x's estimate: the sampled tokens' negative log-probs summed over each response.
            "objective/entropy": all_entropy.mean().item(),
            "time/generation": generation_time,
        }
        for name, column in zip(self.reward_functions.names, all_per_function.T):
            metrics[f"rewards/{name}/mean"] = torch.nanmean(column).item()
        # GAE's advantages are per token: the records carry none.
        records = self.completion_records(step + 1, prompts, completions, per_function, raw_scores)
        self.state.num_input_tokens_seen += int(self._sum(attention_mask.sum().to(device)).item())
        # Scoring plus the rollout's policy, critic and reference passes.
        metrics["time/scoring"] = time.perf_counter() - start
        return rollout, metrics, records

    def ppo_update(self, rollout: Rollout, step: int) -> dict[str, float]:
        """`ppo_epochs` passes over the rollout in shuffled mini-batches; one optimizer step per backward batch."""
        a = self.ppo_args
        sums: dict[str, float] = {}
        updates = 0
        grad_norm = None
        self.model.train()
        size = rollout.input_ids.shape[0]
        first_pass, self._first_pass = self._first_pass, None
        for epoch in range(a.ppo_epochs):
            # One permutation of the global rollout; an update batch is a slice of it, and each process trains the
            # rows of that slice it holds (its rows are global rows first_row .. first_row + size - 1).
            order = torch.as_tensor(np.random.default_rng([self.args.seed, step, epoch]).permutation(
                self.global_rollout_size))
            for start in range(0, self.global_rollout_size, self.global_backward_batch_size):
                global_index = order[start:start + self.global_backward_batch_size]
                held = (global_index >= self.first_row) & (global_index < self.first_row + size)
                batch_index = global_index[held] - self.first_row
                # Token-weighted: each micro-batch's token mean counts by its share of the backward batch's tokens
                # (over all processes), so the update is the token mean over the backward batch whatever
                # mini_batch_size is and however the batch is spread over processes.
                batch_tokens = self._sum(rollout.mask[batch_index].sum()).clamp(min=1)
                stats = {k: 0.0 for k in ("ppo/loss/policy", "ppo/loss/value", "ppo/loss/total", "clip_ratio/region_mean",
                                          "policy/approxkl", "val/clipfrac", "val/mean")}
                micro_starts: list[Optional[int]] = list(range(0, len(batch_index), self.mini_batch_size))
                if self.is_deepspeed_enabled or self.accelerator.is_fsdp2:
                    # DeepSpeed reduces gradients inside the backward passes (ZeRO-2) or at the batch's last one,
                    # FSDP2 gathers weights in each forward and reduces gradients in each backward: every process
                    # must run as many. One that holds fewer rows of this batch adds passes over its first row that
                    # weigh nothing (share 0).
                    micro_starts += [None] * (self._most_micro_batches(len(micro_starts)) - len(micro_starts))
                for number, micro_start in enumerate(micro_starts):
                    if micro_start is None:
                        micro, share = rollout.rows(torch.zeros(1, dtype=torch.long)), batch_tokens.new_zeros(())
                    else:
                        micro_index = batch_index[micro_start:micro_start + self.mini_batch_size]
                        micro = rollout.rows(micro_index)
                        share = micro.mask.sum() / batch_tokens
                    if first_pass is not None:  # the rollout's own forward (`first_pass_in_rollout`): its rows
                        logps, values = (tensor[micro_index] for tensor in first_pass)
                        first_pass = None
                    else:
                        logps, values = self.policy_outputs(micro.input_ids, micro.attention_mask, micro.labels)
                    policy_loss, policy_clipfrac, approxkl = clipped_policy_loss(
                        logps, micro.logps, micro.advantages, micro.mask, a.cliprange)
                    value_loss, value_clipfrac = clipped_value_loss(values, micro.values, micro.returns, micro.mask,
                                                                    a.cliprange_value)
                    loss = policy_loss + a.vf_coef * value_loss
                    if self.is_deepspeed_enabled:
                        self._deepspeed_backward(loss * share, last=number == len(micro_starts) - 1)
                    elif self.accelerator.is_fsdp2:
                        # FSDP2 averages the gradients over processes in the backward; the shares are of the whole
                        # update batch (all processes), so the gradient wanted is their sum.
                        self.accelerator.backward(loss * share * self.num_processes)
                    else:
                        self.accelerator.backward(loss * share)
                    for key, value in (("ppo/loss/policy", policy_loss), ("ppo/loss/value", value_loss),
                                       ("ppo/loss/total", loss), ("clip_ratio/region_mean", policy_clipfrac),
                                       ("policy/approxkl", approxkl), ("val/clipfrac", value_clipfrac),
                                       ("val/mean", masked_mean(values.detach(), micro.mask))):
                        stats[key] += value.detach().item() * share.item()
                if not (self.is_deepspeed_enabled or self.accelerator.is_fsdp2):  # reduced in their backward passes
                    self._sum_gradients()
                if self.num_processes > 1:
                    keys = list(stats)
                    totals = self._sum(torch.tensor([stats[k] for k in keys], dtype=torch.float64,
                                                    device=self.args.device))
                    stats = dict(zip(keys, totals.tolist()))
                if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
                    # Under DeepSpeed the engine clipped (its `gradient_clipping`, filled from max_grad_norm) and
                    # stepped in the last backward: accelerate returns the norm it measured, and the prepared
                    # optimizer's step and zero_grad below do nothing.
                    grad_norm = self.accelerator.clip_grad_norm_(
                        [p for p in self.model.parameters() if p.requires_grad], self.args.max_grad_norm)
                self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)
                self.optimizer.step()
                self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)
                self.optimizer.zero_grad(set_to_none=True)
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + value
                updates += 1
        out = {key: value / updates for key, value in sums.items()}
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        return out

    # ---- the loop ----

    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint: Optional[str] = None,
                             trial=None, ignore_keys_for_eval=None):
        """Run PPO steps until `max_steps` (or `num_train_epochs` passes over the prompts); see the module doc.

        `Trainer.train` calls it after its set-up (activation checkpointing, Liger, memory metrics, the last
        checkpoint's path for `resume_from_checkpoint: true`), in place of the Trainer's own loop; `_resume` loads
        the checkpoint here (`_load_from_checkpoint`, which the Trainer calls first, leaves it to this loop).
        """
        from transformers.trainer_callback import ExportableState, TrainerState
        from transformers.trainer_utils import TrainOutput, speed_metrics

        from ...errors import ConfigError

        args = self.args
        if self.steps_per_epoch < 1:
            raise ConfigError(f"the training set has {len(self.train_dataset)} prompts, fewer than one rollout of "
                              f"{self.global_rollout_size} (per_device_train_batch_size x gradient_accumulation_steps "
                              "x ppo_buffer_size x processes); lower those or give more prompts.")
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * self.steps_per_epoch)
        self.state = TrainerState(stateful_callbacks=[
            cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)])
        self.state.train_batch_size = self.global_rollout_size
        self.state.compute_steps(args, max_steps)
        if self.is_deepspeed_enabled:
            self._prepare_deepspeed(max_steps)
        elif self.accelerator.is_fsdp2:
            self._prepare_fsdp2()
        else:
            self.create_optimizer()
            self.model_wrapped = self.model
        self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
        if resume_from_checkpoint:
            self._resume(resume_from_checkpoint)
        self.state.init_training_references(self, max_steps, math.ceil(max_steps / self.steps_per_epoch), trial)
        self.state.max_steps = max_steps
        self._initial_num_input_tokens_seen = self.state.num_input_tokens_seen
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start_time, first_step = time.time(), self.state.global_step
        total_loss, loss_since_log, steps_since_log = 0.0, 0.0, 0
        self.model.train()
        while self.state.global_step < max_steps:
            step = self.state.global_step
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            rollout, metrics, records = self.make_rollout(step)
            start = time.perf_counter()
            stats = self.ppo_update(rollout, step)
            metrics["time/training"] = time.perf_counter() - start
            # The global mean KL and rollout size: every process updates kl_coef alike.
            self.kl_ctl.update(metrics["objective/kl"], self.global_rollout_size)
            self.lr_scheduler.step()
            self.write_completions(records)
            grad_norm = stats.pop("grad_norm", None)
            # Global values on every process: the cross-process mean in `log()` leaves them as they are.
            self.record_metrics({**metrics, **stats}, self.global_rollout_size)
            total_loss += stats["ppo/loss/total"]
            loss_since_log += stats["ppo/loss/total"]
            steps_since_log += 1
            self.state.global_step += 1
            self.state.epoch = self.state.global_step / self.steps_per_epoch
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_log or self.state.global_step >= max_steps:
                logs = {"loss": loss_since_log / steps_since_log, "learning_rate": self._get_learning_rate()}
                if grad_norm is not None:
                    logs["grad_norm"] = grad_norm
                self.log(logs, start_time)
                loss_since_log, steps_since_log = 0.0, 0
            if self.control.should_save:
                self._save_checkpoint(self.model, trial)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if self.control.should_training_stop:
                break
        done = self.state.global_step - first_step
        metrics = speed_metrics("train", start_time, num_samples=done * self.global_rollout_size, num_steps=done)
        metrics["train_loss"] = total_loss / max(done, 1)
        metrics["total_flos"] = self.state.total_flos
        self.is_in_train = False
        self._memory_tracker.stop_and_update_metrics(metrics)
        self.log(metrics)
        # After the summary, as `Trainer.train` orders them: trackers (MLflow, TensorBoard) close their run at
        # train end, and a log after it would open a second run holding only the summary.
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Nothing before the loop: `_resume` loads every part of a PPO checkpoint (adapters, value head, critic,
        optimizer, PPO state) inside `_inner_training_loop`, after the optimizer exists."""

    def _prepare_deepspeed(self, max_steps: int) -> None:
        """The Trainer's DeepSpeed set-up, for this loop: `deepspeed_init` fills the config's "auto" values from the
        arguments and makes the optimizer (the config's, or the Trainer's), and `accelerator.prepare` builds the
        engine over the model and optimizer. No scheduler goes to DeepSpeed, which would step it per optimizer
        step; `train` creates the Trainer's over the prepared optimizer and steps it once per PPO step."""
        from transformers.integrations.deepspeed import deepspeed_init

        optimizer, _ = deepspeed_init(self, num_training_steps=max_steps)
        self.model_wrapped, self.optimizer = self.accelerator.prepare(self.model, optimizer)
        self.deepspeed = self.model_wrapped  # what the Trainer's DeepSpeed save paths call
        self.lr_scheduler = None

    def _prepare_fsdp2(self) -> None:
        """The Trainer's FSDP2 set-up, for this loop: the optimizer is made over the whole model (policy, adapters,
        value head), then `accelerator.prepare` shards the model in place (`fully_shard` on each decoder layer and
        the root, weights turned into DTensors) and points the optimizer at the shards. The value head is a
        submodule, so it sits in the root unit, whose weights FSDP2 keeps whole from its forward to the end of its
        backward: `policy_forward` reads it on the hidden states after the model's call, inside that window."""
        from torch.distributed.fsdp import register_fsdp_forward_method

        self.create_optimizer()
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        self.model_wrapped = self.model
        # As the Trainer does: `generate` runs FSDP's forward hooks (outside `full_weights` too).
        register_fsdp_forward_method(self.model, "generate")

    # ---- saving and resuming ----

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        """The policy as a plain PEFT adapter (only it: not the reward or critic adapter), the value head beside
        it (`value_head.safetensors`), and the critic adapter in `critic/` with `ppo_critic: adapter`.

        Under DeepSpeed the Trainer's `save_model` passes the consolidated state dict it gathered on every process
        (ZeRO-3 with a PEFT model: the engine's `_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=
        True)`, the trainable tensors whole on the main process; otherwise `accelerator.get_state_dict`), and
        everything is saved from it: under ZeRO-3 the module's own tensors hold only this process's partition.
        """
        from ...model.adapters import POLICY_ADAPTER
        from ...model.distributed import sharding_of
        from ...model.heads import VALUE_HEAD_NAME, ValueHead, save_value_head
        from ..base import is_peft_model

        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        if not state_dict:
            if sharding_of(self.model) != "none":
                if state_dict is None and not self.is_world_process_zero():
                    # DeepSpeed consolidates on the global main process only; another node's main process (under
                    # save_on_each_node) gets None and has nothing whole to write.
                    logger.warning("Under ZeRO-3 only the global main process holds the consolidated adapter and "
                                   "value head; process %d does not write them to %s.", self.args.process_index,
                                   output_dir)
                    return
                # The Trainer passes {} when it could not consolidate (stage3_gather_16bit_weights_on_model_save off
                # on a path that needs it); the partitions alone are no adapter.
                raise RuntimeError("stage ppo under ZeRO-3 saves the adapter and value head from the state dict that "
                                   "the Trainer's save_model consolidates, and none came: save through save_model, "
                                   "with stage3_gather_16bit_weights_on_model_save: true in the DeepSpeed config.")
            state_dict = None
        os.makedirs(output_dir, exist_ok=True)
        if is_peft_model(self.model):
            # PEFT picks each adapter's tensors out of `state_dict` (the module's own when None).
            self.model.save_pretrained(output_dir, selected_adapters=[POLICY_ADAPTER], state_dict=state_dict)
            if self.ppo_args.ppo_critic == "adapter":
                self.model.save_pretrained(output_dir, selected_adapters=[CRITIC_ADAPTER], state_dict=state_dict)
        else:
            # A full/freeze policy: its weights without the attached value head (saved on its own below).
            state = {k: v for k, v in (state_dict or self.model.state_dict()).items()
                     if not k.startswith(f"{VALUE_HEAD_NAME}.")}
            self.model.save_pretrained(output_dir, state_dict=state)
        value_head = self.value_head
        if state_dict is not None:
            # The head's tensors from the consolidated dict (keys end in `v_head.weight` / `v_head.bias` under
            # whatever wrapper prefix the engine's module adds).
            value_head = ValueHead(self.value_head.hidden_size)
            value_head.load_state_dict({key.rsplit(".", 1)[1]: tensor for key, tensor in state_dict.items()
                                        if key.rsplit(".", 2)[-2:-1] == [VALUE_HEAD_NAME]})
        save_value_head(value_head, output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint plus `ppo_state.json` (KL coefficient, score moments), written first so that a
        checkpoint with a `trainer_state.json` always has it."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            folder.mkdir(parents=True, exist_ok=True)
            state = {"kl_ctl": self.kl_ctl.state_dict(), "score_moments": self.score_moments.state_dict()}
            (folder / PPO_STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")
        super()._save_checkpoint(model, trial)

    def _resume(self, checkpoint: str) -> None:
        """Everything a checkpoint holds back in place: adapter(s), value head, optimizer, scheduler, RNG,
        Trainer state and PPO state. Weights are copied into the existing tensors, which the optimizer holds
        (under DeepSpeed, the engine loads its own checkpoint instead)."""
        from peft.utils import load_peft_weights, set_peft_model_state_dict
        from transformers.trainer_callback import TrainerState

        from ...model.adapters import POLICY_ADAPTER
        from ...model.heads import load_value_head
        from ..base import is_peft_model

        if self.is_deepspeed_enabled:
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            # The engine's checkpoint (`global_step*/`, written by the Trainer's `_save_optimizer_and_scheduler`)
            # holds every trainable tensor (adapters, value head: submodules of the model), DeepSpeed's fp32 master
            # copies of them and the optimizer state. Copying weights into the module instead would be undone by
            # the master copies at the next step.
            deepspeed_load_checkpoint(self.model_wrapped, checkpoint, load_module_strict=not is_peft_model(self.model))
        elif self.accelerator.is_fsdp2:
            # accelerate's FSDP checkpoint (`pytorch_model_fsdp.bin`, written by the Trainer's
            # `_save_optimizer_and_scheduler`) holds the whole module: adapters, value head, and under full/freeze the
            # policy; the Trainer loads it into the shards. The files `_save` writes are whole tensors, which the
            # sharded DTensors cannot take by copying.
            super()._load_from_checkpoint(checkpoint, self.model_wrapped)
        else:
            if is_peft_model(self.model):
                set_peft_model_state_dict(self.model, load_peft_weights(checkpoint), adapter_name=POLICY_ADAPTER)
                if self.ppo_args.ppo_critic == "adapter":
                    set_peft_model_state_dict(self.model, load_peft_weights(os.path.join(checkpoint, CRITIC_ADAPTER)),
                                              adapter_name=CRITIC_ADAPTER)
            else:
                super()._load_from_checkpoint(checkpoint)
            with torch.no_grad():
                loaded = load_value_head(checkpoint, self.value_head.hidden_size)
                self.value_head.weight.copy_(loaded.weight)
                self.value_head.bias.copy_(loaded.bias)
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        self._load_callback_state()
        saved_groups = _stateless_optimizer_groups(checkpoint) if self.accelerator.is_fsdp2 else None
        if saved_groups is not None:
            # torch's `set_optimizer_state_dict` (accelerate's FSDP load) cannot load an optimizer that keeps no
            # per-parameter state (plain SGD): it finds no tensor to place. All such a state holds is each group's
            # settings, the scheduled learning rate among them: put those back, then the scheduler.
            from transformers.trainer import SCHEDULER_NAME

            for group, saved in zip(self.optimizer.param_groups, saved_groups):
                group.update({key: value for key, value in saved.items() if key != "params"})
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        else:
            self._load_optimizer_and_scheduler(checkpoint)
        self._load_rng_state(checkpoint)
        state = json.loads((Path(checkpoint) / PPO_STATE_FILE).read_text(encoding="utf-8"))
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.score_moments.load_state_dict(state["score_moments"])
        logger.info("Resumed PPO from %s at step %d (kl_coef %.6g).", checkpoint, self.state.global_step,
                    self.kl_ctl.value)


def _stateless_optimizer_groups(checkpoint: str | os.PathLike) -> Optional[list[dict[str, Any]]]:
    """The parameter groups of the FSDP optimizer state in `checkpoint` (accelerate's full state dict,
    `optimizer.bin`) when it holds no per-parameter state (plain SGD); None otherwise."""
    path = Path(checkpoint) / "optimizer.bin"
    if not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return None if saved.get("state") else saved["param_groups"]
