"""On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models", GKD with lambda = 1), at
TRL 1.16's numbers (`DistillationTrainer`).

The student samples one completion per prompt; a frozen teacher reads the same tokens; the student is trained to
match the teacher's whole next-token distribution at every completion position under the generalized
Jensen-Shannon divergence `generalized_jsd` (`beta` 0: forward KL(teacher || student), 1: reverse KL(student ||
teacher), in between: the JSD of the mixture `(1 - beta) p_student + beta p_teacher`). No reward, no advantage, no
reference model: the teacher is the target.

How the work is laid out, and why:
- The generation loop is GRPO's (`GRPOTrainer`, this class's parent) with one completion per prompt, one pass
  over each generation batch and no KL term, which is TRL 1.16's layout for distillation too: the generation batch
  is `per_device_train_batch_size x processes x gradient_accumulation_steps` prompts, sampled once per optimizer
  step, shuffled and cut into the step's micro-batches. GRPO's round (`_generate_and_score`) runs as it is, with no
  reward function and no advantage (`DistillTrainer.advantages`), so the seeded per-row sampling, the buffered batch
  saved in each checkpoint (exact resume), the several-process layout, vLLM, the `completions/*` metrics and
  `completions.jsonl` are GRPO's, not copies. This module adds the teacher and the divergence.
- The loss of a micro-batch is `sum of per-token divergences / completion tokens of the whole generation batch`
  (over all processes, divided by their number), TRL's `num_items_in_batch`; summed over the step's micro-batches it
  is the mean divergence per completion token of the step, whatever `gradient_accumulation_steps` is. That is
  `rl.losses.aggregate_loss`'s `dapo` count with `steps_per_generation = gradient_accumulation_steps`.
- Both distributions are `softmax(logits / temperature)`, the sampling temperature, as TRL divides both.
- The teacher: `teacher_model_name_or_path` (a folder, a hub id, or the bundled model) with an optional
  `teacher_adapter_name_or_path` merged into it, or, with only the adapter given, the student's own base with that
  adapter (an SFT adapter as teacher for the bare base). It is loaded frozen, in eval mode, as a second model. Its
  tokenizer must equal the student's (same vocabulary, same special tokens), checked before any weights load; TRL
  checks only `vocab_size`, after loading.
- Logits: one padding-free forward per model (`rl.rollout.completion_token_logits`, the per-token forward of
  every stage, `model.logprobs.labelled_forward`; `padding_free: false` runs the padded batch), reaching the
  output layer only at the real completion tokens: `[K, V]` logits for the K tokens of the micro-batch, where
  TRL runs the padded batch and projects the hidden states chunk by chunk through the output layer. The same
  numbers up to float rounding. The teacher runs first, so its activations are gone before the student's, kept
  for the backward, exist; under `bf16` it enters the run's autocast (TRL prepares its teacher for mixed
  precision). On a CPU under `bf16` the frozen linear weights of both models (the teacher's, the student's base
  under LoRA) are stored in bf16 (`precision.bf16_frozen_linears`): autocast would cast them to the same bf16
  numbers at every call and keep a copy of each for the backward; the rollouts decode from bf16 packed copies
  (`model.generation.packed_linears`).
- The divergence and its gradient are computed row chunk by row chunk (`_GeneralizedJSD`), the student's entropy
  in the same pass, so no `[K, V]` fp32 temporary of the whole batch is kept for the backward (the straightforward
  autograd formula kept several, and took 7 times as long on the benchmark's 256 tokens: `generalized_jsd`).

Defaults: TRL 1.16's (`beta: 1.0`, `max_completion_length: 512`, `temperature: 1.0`, `top_p: 1.0`, `top_k: 0`,
`shuffle_dataset: true`); `learning_rate` is the Trainer's (5e-5) unless set, where TRL's DistillationConfig uses
1e-6 for full fine-tuning (the example sets one for LoRA).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..config import FinetuningArguments
from ..env import launched_processes
from ..errors import ConfigError
from ..model.distributed import full_weights, sharding_of
from ..model.logprobs import elementwise_rows
from ..model.precision import bf16_frozen_linears
from ..rewards import RewardFunctions
from ..rl.losses import aggregate_loss
from ..rl.rollout import completion_token_logits
from .arguments import DistillArguments
from .grpo import GRPOTrainer, check_generation_loop, resolve_generation_batch

if TYPE_CHECKING:
    from transformers import TrainerCallback

    from ..config import Config, ModelArguments

# The examples `data.get_dataset` builds for this stage (`formats.DATA_KINDS`): prompts, as for GRPO.
DATA_KIND = "prompt"


# ---------------------------------------------------------------------------------------------------
# The divergence
# ---------------------------------------------------------------------------------------------------


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-token generalized Jensen-Shannon divergence between the student's and the teacher's next-token
    distributions (Agarwal et al. 2024, eq. 2 with TRL 1.16's convention for `beta`).

    With `p_s = softmax(z_s / T)`, `p_t = softmax(z_t / T)` and `m = (1 - beta) p_s + beta p_t`:
    `JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)` for 0 < beta < 1; at the ends (where that formula is 0)
    `beta = 0` is the forward KL(p_t || p_s) and `beta = 1` the reverse KL(p_s || p_t). `beta = 0.5` is the usual
    JSD.

    Example (one token, two-word vocabulary): p_s = [1/2, 1/2], p_t = [1/5, 4/5] (teacher logits [0, ln 4]):
    beta 0: 0.2 ln 0.4 + 0.8 ln 1.6 = 0.192745; beta 1: 0.5 ln 2.5 + 0.5 ln 0.625 = 0.223144;
    beta 0.5: m = [0.35, 0.65], 0.5 (0.2 ln(0.2/0.35) + 0.8 ln(0.8/0.65)) + 0.5 (0.5 ln(0.5/0.35) + 0.5 ln(0.5/0.65))
    = 0.5 x 0.054187 + 0.5 x 0.047158 = 0.050672.

    Computed row chunk by row chunk (`model.logprobs.ELEMENTWISE_CHUNK_ELEMENTS`) with its gradient by hand
    (`_GeneralizedJSD`), so no `[..., V]` temporary of the whole batch is kept for the backward. Forward and backward
    of 256 x 49152 bf16 logits on an AMD EPYC, 2 threads: 0.39 s for the autograd formula over the whole batch,
    0.054 s in chunks of 2^18 numbers, 0.53 s in chunks of 2^24.

    Args:
        student_logits: `[..., V]` (gradients flow through these).
        teacher_logits: `[..., V]`, the same shape (constants: no gradient reaches them).
        beta: in [0, 1].
        temperature: divides both logits first (> 0).

    Returns:
        `[...]` float32 divergences, >= 0.
    """
    return jsd_and_entropy(student_logits, teacher_logits, beta, temperature)[0]


def jsd_and_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`generalized_jsd` and, from the same pass, the entropy of the student's `softmax(z_s / T)` per token (no
    gradient; TRL's `entropy` metric). Both `[...]` float32 (float64 for float64 logits)."""
    shape = student_logits.shape[:-1]
    vocab = student_logits.size(-1)
    jsd, entropy = _GeneralizedJSD.apply(student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab),
                                         float(beta), float(temperature))
    return jsd.reshape(shape), entropy.reshape(shape)


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`log_softmax(logits / T)` in at least fp32 (x / 1 is x: no division at the default temperature)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.log_softmax(z if temperature == 1.0 else z / temperature, dim=-1)


class _GeneralizedJSD(torch.autograd.Function):
    """`generalized_jsd` over `[K, V]` rows, chunk by chunk, with the student's entropy as a second output.

    Forward keeps only the two logits tensors (already alive); backward recomputes each chunk's log-probs and
    applies the gradient with respect to the student's logits `z_s`, with `g = dJSD/dp_s`:
    `dJSD/dz_s = p_s * (g - sum_v p_s g) / T`, where `g = (1 - beta) log(p_s / m)` for 0 < beta < 1 (the terms
    in `p_t / m` cancel), `g = log(p_s / p_t)` for beta = 1 (up to a constant, which the softmax removes), and for
    beta = 0 the whole gradient is `(p_s - p_t) / T`.
    """

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float):
        dtype = torch.promote_types(student.dtype, torch.float32)
        rows = student.size(0)
        jsd = torch.empty(rows, dtype=dtype, device=student.device)
        entropy = torch.empty_like(jsd)
        step = elementwise_rows(student.size(-1))
        for start in range(0, rows, step):
            chunk = slice(start, start + step)
            log_ps, log_pt = _log_probs(student[chunk], temperature), _log_probs(teacher[chunk], temperature)
            p_s = log_ps.exp()
            entropy[chunk] = -(p_s * log_ps).sum(-1)
            if beta == 0.0:
                jsd[chunk] = (log_pt.exp() * (log_pt - log_ps)).sum(-1)
            elif beta == 1.0:
                jsd[chunk] = (p_s * (log_ps - log_pt)).sum(-1)
            else:
                log_m = torch.logaddexp(log_ps + math.log(1.0 - beta), log_pt + math.log(beta))
                jsd[chunk] = (beta * (log_pt.exp() * (log_pt - log_m)).sum(-1)
                              + (1.0 - beta) * (p_s * (log_ps - log_m)).sum(-1))
        ctx.save_for_backward(student, teacher)
        ctx.beta, ctx.temperature = beta, temperature
        ctx.mark_non_differentiable(entropy)
        return jsd, entropy

    @staticmethod
    def backward(ctx, grad_jsd: torch.Tensor, grad_entropy: torch.Tensor):
        student, teacher = ctx.saved_tensors
        beta, temperature = ctx.beta, ctx.temperature
        grad = torch.empty_like(student)
        step = elementwise_rows(student.size(-1))
        for start in range(0, student.size(0), step):
            chunk = slice(start, start + step)
            log_ps, log_pt = _log_probs(student[chunk], temperature), _log_probs(teacher[chunk], temperature)
            p_s = log_ps.exp()
            if beta == 0.0:
                g_z = p_s - log_pt.exp()
            else:
                if beta == 1.0:
                    g = log_ps - log_pt
                else:
                    g = (1.0 - beta) * (log_ps - torch.logaddexp(log_ps + math.log(1.0 - beta),
                                                                 log_pt + math.log(beta)))
                g_z = p_s * (g - (p_s * g).sum(-1, keepdim=True))
            scale = grad_jsd[chunk, None] if temperature == 1.0 else grad_jsd[chunk, None] / temperature
            grad[chunk] = g_z * scale
        return grad, None, None, None


# ---------------------------------------------------------------------------------------------------
# The teacher
# ---------------------------------------------------------------------------------------------------


def teacher_model_arguments(model_args: "ModelArguments", args: DistillArguments) -> "ModelArguments":
    """The teacher's `ModelArguments`: its own model (or the student's base) and adapters, the student's dtype and
    hub settings.

    Raises:
        ConfigError: neither a teacher model nor a teacher adapter is given (the teacher would be the student).
    """
    from dataclasses import replace

    if args.teacher_model_name_or_path is None and args.teacher_adapter_name_or_path is None:
        raise ConfigError("stage distill needs a teacher: set teacher_model_name_or_path (a model folder, hub id or "
                          "smollm2-135m-instruct) and/or teacher_adapter_name_or_path (an adapter over the student's "
                          "base, e.g. saves/smollm2/lora/sft).")
    return replace(model_args,
                   model_name_or_path=args.teacher_model_name_or_path or model_args.model_name_or_path,
                   adapter_name_or_path=args.teacher_adapter_name_or_path,
                   model_revision=args.teacher_model_revision or model_args.model_revision)


def check_same_tokenizer(student_tokenizer, teacher_tokenizer, teacher_name: str) -> None:
    """Refuse a teacher whose tokenizer differs from the student's: the divergence compares the two next-token
    distributions entry by entry, so token i must be the same string, and the special tokens the same, for both.

    Raises:
        ConfigError: naming the first difference and the fix.
    """
    student_vocab, teacher_vocab = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student_vocab != teacher_vocab:
        if len(student_vocab) != len(teacher_vocab):
            what = f"{len(teacher_vocab)} tokens against the student's {len(student_vocab)}"
        else:
            token = next(t for t, i in sorted(student_vocab.items(), key=lambda item: item[1])
                         if teacher_vocab.get(t) != i)
            what = f"token {token!r} is id {student_vocab[token]} for the student, {teacher_vocab.get(token)} for it"
        raise ConfigError(f"the teacher {teacher_name!r} has another tokenizer than the student ({what}). "
                          "Distillation matches the two next-token distributions id by id: use a teacher of the same "
                          "tokenizer family (another size of the same model), or the student's base with an adapter "
                          "(teacher_adapter_name_or_path).")
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        mine, theirs = getattr(student_tokenizer, name), getattr(teacher_tokenizer, name)
        # The pad token may be set to eos by the loader on one side only; it never reaches the divergence.
        if name != "pad_token" and mine != theirs:
            raise ConfigError(f"the teacher {teacher_name!r} has {name} {theirs!r} where the student has {mine!r}: "
                              "the two tokenizers differ; use a teacher of the same tokenizer family.")


def check_config(config: "Config") -> None:
    """What `stage: distill` refuses beyond its own keys (called after the config is parsed)."""
    d, t = config.method, config.training
    d.check_run("distill", t)
    teacher_model_arguments(config.model, d)
    resolve_generation_batch(t.per_device_train_batch_size, launched_processes(), 1, None, None,
                             t.gradient_accumulation_steps)
    check_generation_loop(d.generation_loop(), t)


# ---------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------


class DistillTrainer(GRPOTrainer):
    """`Trainer` that samples completions from the student and trains it towards the teacher's distributions.

    Args:
        distill_args: the stage's keys (`DistillArguments`).
        teacher: the frozen teacher (a causal LM with the student's vocabulary).
        stop_token_ids: ids that end a completion (the template's end of turn).
        *args, **kwargs: as for `transformers.Trainer`; `train_dataset` holds the data layer's prompt rows.
    """

    names_generation_batch = False  # one generation batch per optimizer step, whatever the batch's split

    def __init__(self, *args, distill_args: DistillArguments, teacher: nn.Module, stop_token_ids, **kwargs) -> None:
        super().__init__(*args, grpo_args=distill_args.generation_loop(), reward_functions=RewardFunctions([], []),
                         stop_token_ids=stop_token_ids, **kwargs)
        self.distill_args = distill_args
        student_vocab = self.model.get_output_embeddings().weight.shape[0]
        teacher_vocab = teacher.get_output_embeddings().weight.shape[0]
        if student_vocab != teacher_vocab:
            raise ConfigError(f"the teacher's output layer has {teacher_vocab} rows and the student's {student_vocab}: "
                              "distillation needs the same vocabulary on both sides.")
        self.teacher = teacher.to(self.args.device).eval().requires_grad_(False)
        if self.args.bf16 and self.args.device.type == "cpu":
            # Every forward of both models runs under the run's autocast (the teacher's in `compute_loss`, the
            # student's as `accelerator.prepare` wraps it; its rollouts decode from fp32 packed copies): frozen
            # linear weights kept in bf16 are the same numbers at half the memory, with no cast per call and no
            # bf16 copy of each saved for the backward. The student's LoRA weights stay fp32.
            for frozen in (self.teacher, self.model):
                if sharding_of(frozen) == "none":
                    bf16_frozen_linears(frozen)

    # ---- advantages ----

    def advantages(self, rewards: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """None: the teacher's distributions are the target. GRPO's round (`_generate_and_score`, reused as it is)
        runs with no reward function, so `rewards` are NaN; the advantages stay NaN (null in `completions.jsonl`,
        unused by the loss) and no group has a reward spread to report (`frac_reward_zero_std` left out)."""
        return torch.full_like(rewards, math.nan), torch.zeros(0, dtype=torch.bool, device=rewards.device)

    # ---- the loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("DistillTrainer.compute_loss returns the loss only.")
        d = self.distill_args
        mask = inputs["completion_mask"]
        # Both score only the real completion tokens, padding-free unless `padding_free: false`
        # (`rl.rollout.completion_token_logits`; the same places, in the same order, for both). The teacher first,
        # so its activations are gone before the student's (kept for the backward) exist; it is not
        # `accelerator.prepare`d, so the run's autocast is entered here, as the student's forward enters it.
        tokens = (inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], mask)
        padding_free = self.args.padding_free
        with torch.no_grad(), self.accelerator.autocast(), full_weights(self.teacher) as teacher:
            teacher_logits, _ = completion_token_logits(teacher, *tokens, padding_free=padding_free)
        student_logits, place = completion_token_logits(model, *tokens, padding_free=padding_free)
        divergence, entropy = jsd_and_entropy(student_logits, teacher_logits, d.beta, d.temperature)
        per_token = mask.new_zeros(mask.shape, dtype=torch.float32).index_put(place, divergence)
        loss = aggregate_loss(per_token, mask, "dapo", accumulation_steps=self.current_gradient_accumulation_steps,
                              steps_per_generation=self.steps_per_generation,
                              generation_tokens=inputs["generation_tokens"])
        # TRL's entropy: the student's mean per-token entropy over this micro-batch's tokens (of every process).
        sums = torch.stack([entropy.sum(), torch.tensor(float(entropy.numel()), device=entropy.device)])
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        self.record_metrics({"entropy": (sums[0] / sums[1]).item() if sums[1] > 0 else 0.0}, 1)
        return loss


# ---------------------------------------------------------------------------------------------------
# Stage entry point
# ---------------------------------------------------------------------------------------------------


def run_distill(config: "Config", callbacks: list["TrainerCallback"]) -> None:
    """Distil the teacher into the student as `config` says; outputs (adapter, logs, completions.jsonl) go to
    `output_dir`."""
    from ..data import ChatFormatter, get_dataset
    from ..model.loader import load_model, load_tokenizer, resolve_adapter_chain, split_adapters
    from .base import check_splits, run_stage_trainer

    teacher_args = teacher_model_arguments(config.model, config.method)
    try:  # the teacher's adapters exist, before anything loads
        resolve_adapter_chain(split_adapters(teacher_args.adapter_name_or_path))
    except ConfigError as err:
        raise ConfigError(str(err).replace("adapter_name_or_path:", "teacher_adapter_name_or_path:", 1)) from None
    tokenizer = load_tokenizer(config.model)
    teacher_name = ", ".join(filter(None, [teacher_args.model_name_or_path or "smollm2-135m-instruct",
                                           teacher_args.adapter_name_or_path]))
    check_same_tokenizer(tokenizer, load_tokenizer(teacher_args), teacher_name)  # before any weights load
    datasets = get_dataset(config, tokenizer, DATA_KIND)
    check_splits(config, datasets)
    model = load_model(config.model, config.finetuning, is_trainable=config.training.do_train)
    teacher = load_model(teacher_args, FinetuningArguments(), is_trainable=False)
    formatter = ChatFormatter(tokenizer, config.data.template, config.data.default_system)
    trainer = DistillTrainer(
        model=model,
        args=config.training,
        distill_args=config.method,
        teacher=teacher,
        stop_token_ids=formatter.stop_token_ids(),
        processing_class=tokenizer,
        callbacks=callbacks,
        train_dataset=datasets["train_dataset"],
    )
    run_stage_trainer(trainer, config)


__all__ = ["DistillArguments", "generalized_jsd", "jsd_and_entropy", "teacher_model_arguments",
           "check_same_tokenizer", "check_config", "DistillTrainer", "run_distill"]
