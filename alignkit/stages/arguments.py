"""Every stage's own keys (`Config.method`), as dataclasses that import neither torch nor transformers.

Each stage module (`dpo.py`, `grpo.py`, ...) re-exports its class; they live here so that `alignkit train` can build
the run's stage keys, and so raise a bad value's `ConfigError` with the parse's message, before it imports torch
(`alignkit.config.keytable.check_config_early`). Each class checks its own fields in `__post_init__`; what a stage
refuses across sections is its module's `check_config`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from types import SimpleNamespace
from typing import Any, Literal, Optional, Union

from ..config.sections import check_sampling_knobs
from ..env import launched_processes
from ..errors import ConfigError
from ..rewards.arguments import RewardFunctionArguments, require_reward_funcs

logger = logging.getLogger(__name__)

# TRL 1.16's DPO loss types (`DPOConfig.loss_type`), then LLaMA-Factory's two reference-free ones.
TRL_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
PREFERENCE_LOSSES = TRL_LOSSES + ("orpo", "simpo")
PreferenceLoss = Literal[PREFERENCE_LOSSES]  # type: ignore[valid-type]
# Losses that read no reference log-probs: a run whose losses are all among them runs no reference pass.
REFERENCE_FREE_LOSSES = ("orpo", "simpo", "sft")
# Losses built on the chosen-minus-rejected score, where an f-divergence other than reverse KL is defined (TRL's set).
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# Losses that read `dpo_label_smoothing` (cDPO's, robust DPO's and EXO's epsilon; AOT's smoothing).
SMOOTHED_LOSSES = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")


@dataclass
class ReferenceSyncArguments:
    """TRL 1.16's reference-sync keys (TR-DPO, Gorbatovski et al. 2024), names and defaults as in its `DPOConfig`,
    `GRPOConfig` and `RLOOConfig`."""

    sync_ref_model: bool = field(
        default=False,
        metadata={"help": "Mix the policy into the reference model every ref_model_sync_steps steps (TR-DPO). Needs "
                          "a separate reference: finetuning_type full or freeze (a LoRA policy's reference is its "
                          "base with the adapter disabled, nothing to sync). TRL default false."})
    ref_model_mixup_alpha: float = field(
        default=0.6,
        metadata={"help": "sync_ref_model: alpha in ref = alpha x policy + (1 - alpha) x ref, in [0, 1]. TRL default "
                          "0.6."})
    ref_model_sync_steps: int = field(
        default=512,
        metadata={"help": "sync_ref_model: optimizer steps between two reference updates (TR-DPO's tau). TRL "
                          "default 512."})

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:  # the next keys class of a stage's own (GRPO: the reward keys)
            parent()
        from ..errors import ConfigError

        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ConfigError(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1] (TR-DPO's alpha; "
                              "TRL's default is 0.6).")
        if self.ref_model_sync_steps < 1:
            raise ConfigError(f"ref_model_sync_steps={self.ref_model_sync_steps} must be at least 1 (TRL's default "
                              "is 512).")


@dataclass
class RewardArguments:
    """The keys of `stage: rm`."""

    center_rewards_coefficient: Optional[float] = field(
        default=None,
        metadata={"help": "Weight of the penalty pushing mean rewards towards zero (TRL's key; unset: off)."},
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Set every dropout of the model (LoRA's included) to 0 while training, so that the "
                          "chosen and rejected replies of a pair are scored by the same network. TRL default true."})

    def __post_init__(self) -> None:
        from ..errors import ConfigError

        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ConfigError(f"center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0 "
                              "(a penalty weight).")


@dataclass
class DPOArguments(ReferenceSyncArguments):
    """The keys of `stage: dpo` (LLaMA-Factory's names; TRL's for the reference sync)."""

    pref_beta: float = field(default=0.1, metadata={"help": "DPO-family beta: how far the policy may move."})
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Set every dropout of the model (LoRA's included) to 0 while training, so that a step "
                          "sees the network its reference sees. TRL default true."})
    pref_loss: Union[PreferenceLoss, list[PreferenceLoss]] = field(
        default="sigmoid",
        metadata={"help": "Preference loss: sigmoid (DPO), ipo, hinge, orpo, simpo (LLaMA-Factory's), or TRL's "
                          "exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, "
                          "discopop, sft, sigmoid_norm; several (a list or comma-separated) add up, weighted by "
                          "loss_weights (MPO: sigmoid,bco_pair,sft)."})
    loss_weights: Optional[list[float]] = field(
        default=None,
        metadata={"help": "One weight per pref_loss entry for their weighted sum (TRL's key); unset: all 1."})
    pref_ftx: float = field(default=0.0, metadata={"help": "Weight of the SFT loss on chosen added to DPO (each "
                                                   "chosen reply's mean NLL per token, per pair, as LLaMA-Factory)."})
    dpo_label_smoothing: float = field(
        default=0.0,
        metadata={
            "help": "Conservative-DPO label smoothing in [0, 0.5) for the sigmoid loss: the assumed share of "
            "flipped preference labels (0 = plain DPO)."
        },
    )
    simpo_gamma: float = field(default=0.5, metadata={"help": "SimPO target reward margin."})
    discopop_tau: float = field(
        default=0.05,
        metadata={"help": "DiscoPOP's temperature of the log-ratio modulation (pref_loss=discopop; > 0). TRL default "
                          "0.05."})
    f_divergence_type: Literal[F_DIVERGENCES] = field(  # type: ignore[valid-type]
        default="reverse_kl",
        metadata={"help": "f-DPO's divergence from the reference: reverse_kl (plain DPO), forward_kl, js_divergence "
                          "or alpha_divergence; other than reverse_kl only for sigmoid, sigmoid_norm, hinge, ipo, "
                          "exo_pair, robust, discopop and sft. TRL default reverse_kl."})
    f_alpha_divergence_coef: float = field(
        default=0.5,
        metadata={"help": "The alpha of f_divergence_type=alpha_divergence. TRL default 0.5."})
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute reference log-probs once for the whole dataset before training (cached)."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.pref_beta > 0:  # also refuses NaN
            raise ConfigError(f"pref_beta={self.pref_beta} must be > 0: at 0 the preference loss has no gradient.")
        losses = self.loss_types
        if not losses:
            raise ConfigError("pref_loss is empty: name at least one loss (sigmoid is DPO's).")
        if len(set(losses)) < len(losses):
            raise ConfigError(f"pref_loss={','.join(losses)} names a loss twice; give each once (weight it with "
                              "loss_weights).")
        if self.loss_weights is not None:
            try:
                self.loss_weights = [float(w) for w in self.loss_weights]
            except (TypeError, ValueError):
                raise ConfigError(f"loss_weights={self.loss_weights} must be numbers, one per pref_loss entry.") \
                    from None
            if len(self.loss_weights) != len(losses):
                raise ConfigError(f"loss_weights has {len(self.loss_weights)} entries for {len(losses)} losses "
                                  f"(pref_loss={','.join(losses)}); give one weight per loss.")
            if not all(math.isfinite(w) and w >= 0 for w in self.loss_weights):
                raise ConfigError(f"loss_weights={self.loss_weights} must be finite and >= 0.")
        if not 0 <= self.dpo_label_smoothing < 0.5:
            raise ConfigError(f"dpo_label_smoothing={self.dpo_label_smoothing} must be in [0, 0.5).")
        if self.dpo_label_smoothing and not set(losses) & set(SMOOTHED_LOSSES):
            raise ConfigError(f"dpo_label_smoothing only applies to pref_loss {', '.join(SMOOTHED_LOSSES)}, not "
                              f"{','.join(losses)}; set one or the other.")
        if "exo_pair" in losses and not self.dpo_label_smoothing > 0:
            raise ConfigError("pref_loss=exo_pair needs dpo_label_smoothing > 0 (its epsilon; the EXO paper "
                              "advises 1e-3).")
        if not self.discopop_tau > 0:
            raise ConfigError(f"discopop_tau={self.discopop_tau} must be > 0.")
        if self.f_divergence_type != "reverse_kl" and not set(losses) <= set(F_DIVERGENCE_LOSSES):
            raise ConfigError(
                f"f_divergence_type={self.f_divergence_type} is defined for pref_loss {', '.join(F_DIVERGENCE_LOSSES)}"
                f" only, not {','.join(sorted(set(losses) - set(F_DIVERGENCE_LOSSES)))}; use reverse_kl with them.")
        if self.f_divergence_type == "alpha_divergence" and not math.isfinite(self.f_alpha_divergence_coef):
            raise ConfigError(f"f_alpha_divergence_coef={self.f_alpha_divergence_coef} must be a finite number.")
        if self.pref_ftx < 0:
            raise ConfigError(f"pref_ftx={self.pref_ftx} must be >= 0 (the weight of an added SFT loss).")
        if self.precompute_ref_log_probs and not self.needs_reference:
            raise ConfigError(f"pref_loss={','.join(losses)} uses no reference model; drop precompute_ref_log_probs.")

    @property
    def loss_types(self) -> tuple[str, ...]:
        """`pref_loss` as a tuple of loss names (one name, or a list)."""
        return (self.pref_loss,) if isinstance(self.pref_loss, str) else tuple(self.pref_loss)

    @property
    def needs_reference(self) -> bool:
        """Whether some loss of `pref_loss` reads reference log-probs."""
        return any(loss not in REFERENCE_FREE_LOSSES for loss in self.loss_types)


@dataclass
class KTOArguments:
    """The keys of `stage: kto` (LLaMA-Factory's names; `loss_type` is TRL's, LLaMA-Factory has no such key)."""

    pref_beta: float = field(
        default=0.1, metadata={"help": "KTO beta: scales the implicit reward (how far the policy may move)."}
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Set every dropout of the model (LoRA's included) to 0 while training, so that a step "
                          "sees the network its reference sees. TRL default true."})
    kto_chosen_weight: float = field(
        default=1.0, metadata={"help": "Weight of the losses of desirable replies (TRL: desirable_weight)."}
    )
    kto_rejected_weight: float = field(
        default=1.0, metadata={"help": "Weight of the losses of undesirable replies (TRL: undesirable_weight)."}
    )
    pref_ftx: float = field(
        default=0.0, metadata={"help": "Weight of the SFT loss on desirable replies added to the KTO loss."}
    )
    loss_type: Literal["kto", "apo_zero_unpaired"] = field(
        default="kto",
        metadata={
            "help": "kto (the paper's loss, reference point = KL estimate) or apo_zero_unpaired (the unpaired "
            "APO-zero loss of D'Oosterlinck et al. 2024: no reference point, no KL pass)."
        },
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute reference log-probs (of the replies and of the KL rows) once for each dataset "
                  "before training (cached): training and every evaluation then run no reference pass."},
    )

    def __post_init__(self) -> None:
        if not self.pref_beta > 0:  # also refuses NaN
            raise ConfigError(f"pref_beta={self.pref_beta} must be > 0: at 0 the KTO loss has no gradient.")
        for key in ("kto_chosen_weight", "kto_rejected_weight"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be > 0 (1.0 weighs both kinds of reply alike).")
        if self.pref_ftx < 0:
            raise ConfigError(f"pref_ftx={self.pref_ftx} must be >= 0 (the weight of an added SFT loss).")


def check_vllm_keys(args: Any) -> None:
    """The vLLM keys GRPO, RLOO and distill share: `vllm_gpu_memory_utilization` in (0, 1], and `vllm_mode`
    colocate, the only mode alignkit runs."""
    if not 0 < args.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"vllm_gpu_memory_utilization={args.vllm_gpu_memory_utilization} must be in (0, 1].")
    if args.vllm_mode != "colocate":
        raise ConfigError(f"vllm_mode={args.vllm_mode}: alignkit runs vLLM inside the training process (TRL's colocate "
                          "mode) and talks to no `trl vllm-serve` server; set vllm_mode: colocate (or leave it out).")


def resolve_generation_batch(per_device_train_batch_size: int, num_processes: int, num_generations: int,
                             steps_per_generation: Optional[int], generation_batch_size: Optional[int],
                             gradient_accumulation_steps: int) -> tuple[int, int]:
    """`(steps_per_generation, generation_batch_size)` from whichever is given, as TRL 1.16 derives them.

    Neither given: `steps_per_generation = gradient_accumulation_steps`. Example: batch 4, 1 process, GA 2,
    nothing set → (2, 8).

    Raises:
        ConfigError: the generation batch is not a whole number of micro-batches or of groups.
    """
    global_batch = per_device_train_batch_size * num_processes
    if steps_per_generation is None and generation_batch_size is None:
        steps_per_generation = gradient_accumulation_steps
    if steps_per_generation is None:
        if generation_batch_size % global_batch:
            raise ConfigError(f"generation_batch_size={generation_batch_size} must be a multiple of "
                              f"per_device_train_batch_size x processes = {global_batch}.")
        steps_per_generation = generation_batch_size // global_batch
    generation_batch_size = global_batch * steps_per_generation
    if generation_batch_size % num_generations:
        raise ConfigError(
            f"the generation batch ({generation_batch_size} = per_device_train_batch_size "
            f"{per_device_train_batch_size} x steps_per_generation {steps_per_generation}) must hold whole groups of "
            f"num_generations={num_generations} completions: make per_device_train_batch_size x steps_per_generation "
            f"a multiple of {num_generations} (e.g. per_device_train_batch_size: {num_generations}).")
    return steps_per_generation, generation_batch_size


@dataclass
class GroupRolloutArguments(ReferenceSyncArguments, RewardFunctionArguments):
    """The keys GRPO and RLOO share (TRL 1.16's names): sampling groups of completions, the generation batch, the
    KL weight and the clip range, plus the reward keys. Each stage's own dataclass adds its keys and defaults."""

    num_generations: int = field(
        default=8,
        metadata={"help": "Completions sampled per prompt (the group); at least 2. TRL default 8 (GRPO), 2 (RLOO)."})
    steps_per_generation: Optional[int] = field(
        default=None,
        metadata={"help": "Micro-batches trained per generation batch (default: gradient_accumulation_steps). "
                          "Set this or generation_batch_size, not both."})
    generation_batch_size: Optional[int] = field(
        default=None,
        metadata={"help": "Completions generated at once (default: per_device_train_batch_size x "
                          "steps_per_generation); a multiple of per_device_train_batch_size and num_generations."})
    num_iterations: int = field(
        default=1, metadata={"help": "Passes over each generation batch (mu in the GRPO paper). TRL default 1."})
    max_completion_length: int = field(
        default=512, metadata={"help": "Most tokens generated per completion. TRL default 512."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (> 0). TRL default 1.0."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass in (0, 1]; 1 = off. TRL default 1.0."})
    top_k: int = field(default=0, metadata={"help": "Sample among the k most likely tokens; 0 = off. TRL default 0."})
    min_p: Optional[float] = field(
        default=None,
        metadata={"help": "Min-p sampling: drop tokens below min_p x the most likely token's probability, after "
                          "temperature, top-k and top-p; unset = off. TRL default none."})
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Penalty > 1 discourages repeated tokens; 1 = none. TRL default 1.0."})
    beta: float = field(
        default=0.0,
        metadata={"help": "Weight of the k3 KL penalty towards the reference (the step-0 policy); 0 = no reference "
                          "pass at all. TRL default 0.0 (DeepSeek-R1 used 0.001)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range of the ratio: 1 - epsilon."})
    epsilon_high: Optional[float] = field(
        default=None, metadata={"help": "Upper clipping range: 1 + epsilon_high (default: epsilon; DAPO uses 0.28)."})
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Leave completions that hit max_completion_length out of the loss (DAPO)."})
    shuffle_dataset: bool = field(default=True, metadata={"help": "Shuffle the prompts each epoch (seeded)."})
    disable_dropout: bool = field(
        default=False, metadata={"help": "Set every dropout of the policy to 0 while training. TRL default false."})
    use_vllm: bool = field(
        default=False,
        metadata={"help": "Generate with vLLM in the training process (colocate mode; needs a GPU and the `vllm` "
                          "extra: pip install 'alignkit[vllm]'). Written against vLLM 0.33's API, not run here."})
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "How vLLM runs: `colocate` (in the training process), TRL's default and the only mode "
                          "here; `server` (a `trl vllm-serve` process) is refused."})
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Share of GPU memory vLLM may take in colocate mode. TRL default 0.3."})
    tools: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Python functions the policy may call during a rollout: `path/to/file.py:function` or "
                          "`package.module:function`, a list or comma-separated. Each needs type hints and a Google-style "
                          "docstring (its JSON schema, shown in the prompt, is derived from them as TRL does). The "
                          "template must write tool calls (chatml/qwen). See docs/stages/tools.md."})
    environment_factory: Optional[str] = field(
        default=None,
        metadata={"help": "`path/to/file.py:Class`: one instance per rollout row (TRL 1.16's contract): reset(**row) "
                          "before each rollout (a returned string is appended to the prompt's last message), its "
                          "public methods are tools; reward functions get the instances as `environments`."})
    max_tool_calling_iterations: Optional[int] = field(
        default=None,
        metadata={"help": "Most tool turns per completion; null (TRL default) = until a turn has no call or the "
                          "completion reaches max_completion_length."})
    tool_timeout: float = field(
        default=5.0,
        metadata={"help": "Seconds one tool call may take; a call that takes longer gets an error message as its "
                          "result (it is left running in a daemon thread). 0 = untimed, in the training thread."})
    max_tool_output_chars: int = field(
        default=10_000,
        metadata={"help": "Longest tool result (characters) put back into the conversation; longer ones are cut with "
                          "a note saying so."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_generations < 2:
            raise ConfigError(f"num_generations={self.num_generations}: the stage compares completions of the same "
                              "prompt, so it needs at least 2 (TRL's default is 8 for GRPO, 2 for RLOO).")
        for key in ("num_iterations", "max_completion_length", "steps_per_generation", "generation_batch_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"{key}={value} must be at least 1.")
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ConfigError("steps_per_generation and generation_batch_size are both set; set one (the other "
                              "follows from per_device_train_batch_size).")
        if not self.temperature > 0:
            raise ConfigError(f"temperature={self.temperature} must be > 0: the stage samples its completions.")
        check_sampling_knobs(self)
        if not self.beta >= 0:
            raise ConfigError(f"beta={self.beta} must be >= 0 (0 = no KL penalty).")
        if not self.epsilon >= 0:
            raise ConfigError(f"epsilon={self.epsilon} must be >= 0.")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        elif not self.epsilon_high >= 0:
            raise ConfigError(f"epsilon_high={self.epsilon_high} must be >= 0 (default: epsilon).")
        check_vllm_keys(self)
        if isinstance(self.tools, str):
            self.tools = [t.strip() for t in self.tools.split(",") if t.strip()]
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ConfigError(f"max_tool_calling_iterations={self.max_tool_calling_iterations} must be >= 0 (null: no "
                              "cap).")
        if not self.tool_timeout >= 0:
            raise ConfigError(f"tool_timeout={self.tool_timeout} must be >= 0 seconds (0 = untimed).")
        if self.max_tool_output_chars < 1:
            raise ConfigError(f"max_tool_output_chars={self.max_tool_output_chars} must be at least 1.")
        if self.uses_tools and self.use_vllm:
            raise ConfigError("tools / environment_factory with use_vllm: true is not supported: the tool loop "
                              "generates with transformers; set use_vllm: false.")

    @property
    def uses_tools(self) -> bool:
        """Whether rollouts call tools (`tools` or `environment_factory` set)."""
        return bool(self.tools) or bool(self.environment_factory)

    def check_run(self, stage: str, training: Any) -> None:
        """What `grpo.check_config` refuses from these keys and the run's training keys alone (`check_run` of the
        argument classes: called by the stage's `check_config` and by the early check): evaluation, a run with
        nothing to reward it, and a generation batch that does not hold whole groups. A tool environment may bring
        a reward of its own, which only loading it tells, so runs with tools pass the reward check here and
        `check_config` makes it after loading their environment.

        Args:
            stage: the run's stage, named in the messages.
            training: `do_train`, `do_eval`, `do_predict`, `per_device_train_batch_size` and
                `gradient_accumulation_steps` (the run's `TrainingArguments`, or the early check's view of them).
        """
        if training.do_eval or training.do_predict:
            raise ConfigError(f"stage {stage} trains only: remove do_eval/do_predict, and measure a reward on held-out "
                              "prompts with `alignkit eval` (greedy) before and after training.")
        if not self.uses_tools:
            require_reward_funcs(self, stage)
        resolve_generation_batch(training.per_device_train_batch_size, launched_processes(), self.num_generations,
                                 self.steps_per_generation, self.generation_batch_size,
                                 training.gradient_accumulation_steps)


@dataclass
class GRPOArguments(GroupRolloutArguments):
    """The keys of `stage: grpo` (TRL 1.16's names and defaults): the shared ones and GRPO's loss keys."""

    delta: Optional[float] = field(
        default=None,
        metadata={"help": "Two-sided clipping (INTELLECT-2): also cap the unclipped ratio at delta (> 1 + epsilon). "
                          "None (default) = off."})
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = field(
        default="dapo",
        metadata={"help": "Policy term and token-loss aggregation: dapo (default: clipped, over the generation "
                          "batch's tokens), grpo (per sequence, then mean), dr_grpo (over batch x "
                          "max_completion_length), bnpo (over the micro-batch's tokens), cispo (clipped weight x "
                          "log-prob, MiniMax-M1; epsilon_high is the cap, e.g. 5.0), sapo (soft gate, SAPO), luspo "
                          "(sequence sums, LUSPO; use importance_sampling_level: sequence), vespo (Gamma-weighted "
                          "sequence ratio, VESPO). TRL 1.16's eight."})
    importance_sampling_level: Literal["token", "sequence"] = field(
        default="token",
        metadata={"help": "Importance ratio per token, or one per sequence (the mean log-ratio: GSPO). TRL default "
                          "token."})
    sapo_temperature_neg: float = field(
        default=1.05, metadata={"help": "loss_type sapo: gate temperature for non-positive advantages. TRL 1.05."})
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "loss_type sapo: gate temperature for positive advantages. TRL 1.0."})
    vespo_k_pos: float = field(
        default=2.0, metadata={"help": "loss_type vespo: power k for non-negative advantages. TRL 2.0."})
    vespo_lambda_pos: float = field(
        default=3.0, metadata={"help": "loss_type vespo: decay lambda for non-negative advantages. TRL 3.0."})
    vespo_k_neg: float = field(
        default=3.0, metadata={"help": "loss_type vespo: power k for negative advantages. TRL 3.0."})
    vespo_lambda_neg: float = field(
        default=2.0, metadata={"help": "loss_type vespo: decay lambda for negative advantages. TRL 2.0."})
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = field(
        default="sum_then_normalize",
        metadata={"help": "Several reward functions: sum the weighted rewards, then normalise (default), or "
                          "normalise each function within its group, sum, and normalise over the batch (GDPO)."})
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={"help": "Keep in the policy loss only the top share of tokens by entropy (rho of 'Beyond the "
                          "80/20 rule', which recommends 0.2); 1.0 (default) keeps all, 0.0 only the highest."})
    entropy_coef: float = field(
        default=0.0,
        metadata={"help": "Weight of an entropy bonus (the mean token entropy, subtracted from the loss); 0 = off. "
                          "With use_adaptive_entropy, the starting coefficient."})
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={"help": "Steer entropy_coef each step (Skywork-OR1): up by entropy_coef_delta while the entropy "
                          "is at most entropy_target, down otherwise; applied only while at most the target."})
    entropy_coef_min: float = field(default=0.0, metadata={"help": "use_adaptive_entropy: lowest coefficient."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "use_adaptive_entropy: highest coefficient."})
    entropy_coef_delta: float = field(
        default=0.005, metadata={"help": "use_adaptive_entropy: change of the coefficient per step. TRL 0.005."})
    entropy_target: float = field(
        default=0.2, metadata={"help": "use_adaptive_entropy: target mean token entropy (nats). TRL 0.2."})
    off_policy_mask_threshold: Optional[float] = field(
        default=None,
        metadata={"help": "Leave out of the loss completions with a negative advantage whose mean KL(sampler || "
                          "policy) exceeds this (DeepSeek-V3.2's delta, e.g. 0.5). None (default) = off."})
    advantage_estimator: Literal["group", "reinforce_pp"] = field(
        default="group",
        metadata={"help": "group (default): GRPO's group-normalised advantage. reinforce_pp: REINFORCE++ (OpenRLHF's "
                          "semantics): the KL (beta, k1 at rollout) folded into a token-level reward with the score at "
                          "the last token, returns whitened over the whole batch; the loss then has no KL term."})
    scale_rewards: Literal["group", "batch", "none"] = field(
        default="group",
        metadata={"help": "Divide advantages by the reward std of the group, of the whole batch, or not at all "
                          "(Dr. GRPO). TRL default group."})
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={"help": "Multiply the per-token KL by the importance ratio (unbiased reverse-KL gradient, "
                          "DeepSeek-V3.2). TRL 1.16 default true; only matters with beta > 0."})
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={"help": "vLLM only (use_vllm: true); accepted for TRL configs. TRL reweights by vLLM's own "
                          "sampling log-probs; alignkit's vLLM path does not (it takes the ratio against the "
                          "trainer's log-probs), so this has no effect."})
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = \
        field(default="sequence_mask",
              metadata={"help": "vLLM only; accepted, no effect (see vllm_importance_sampling_correction)."})
    vllm_importance_sampling_clip_max: Optional[float] = field(
        default=3.0, metadata={"help": "vLLM only; accepted, no effect (see vllm_importance_sampling_correction)."})
    vllm_importance_sampling_clip_min: Optional[float] = field(
        default=None, metadata={"help": "vLLM only; accepted, no effect (see vllm_importance_sampling_correction)."})


    def __post_init__(self) -> None:
        super().__post_init__()
        if self.delta is not None and not self.delta > 1 + self.epsilon_high:
            logger.warning(f"delta={self.delta} is not above 1 + epsilon_high = {1 + self.epsilon_high}: it is meant "
                           "to cap the unclipped ratio above the clip range (INTELLECT-2 uses 4).")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ConfigError(f"top_entropy_quantile={self.top_entropy_quantile} must be in [0, 1] (1 = every token).")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold > 0:
            raise ConfigError(f"off_policy_mask_threshold={self.off_policy_mask_threshold} must be > 0 (e.g. 0.5), "
                              "or unset it.")
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ConfigError(f"entropy_coef_min={self.entropy_coef_min} is above entropy_coef_max="
                              f"{self.entropy_coef_max}.")
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            logger.warning("loss_type luspo: the LUSPO paper uses importance_sampling_level: sequence.")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            logger.warning("loss_type vespo computes its own sequence weight: set importance_sampling_level: token.")
        if self.importance_sampling_level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            logger.warning(f"importance_sampling_level sequence with loss_type {self.loss_type} weights each sequence "
                           "by its length; GSPO's own setup is loss_type: grpo.")


@dataclass
class RLOOArguments(GroupRolloutArguments):
    """The keys of `stage: rloo` (TRL 1.16 `RLOOConfig`'s names and defaults): GRPO's shared keys, two defaults
    changed, and RLOO's own."""

    num_generations: int = field(
        default=2, metadata={"help": "Completions sampled per prompt (the group); at least 2. TRL RLOO default 2."})
    beta: float = field(
        default=0.05,
        metadata={"help": "Weight of the KL penalty folded into each reward: r - beta x sum_t (log pi_old - log "
                          "pi_ref). 0 = no reference pass. TRL RLOO default 0.05."})
    normalize_advantages: bool = field(
        default=False,
        metadata={"help": "Whiten the leave-one-out advantages over the generation batch (mean 0, std 1). TRL "
                          "default false."})
    reward_clip_range: Optional[list[float]] = field(
        default=None,
        metadata={"help": "Clip each reward to [min, max] before the KL penalty, e.g. [-1, 1]; null (default) = no "
                          "clipping."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reward_clip_range is not None:
            low_high = list(self.reward_clip_range)
            if len(low_high) != 2 or not low_high[0] < low_high[1]:
                raise ConfigError(f"reward_clip_range={self.reward_clip_range}: give two numbers [min, max] with "
                                  "min < max, e.g. [-1, 1], or leave it unset.")
            self.reward_clip_range = [float(v) for v in low_high]


@dataclass
class OnlineDPOArguments(RewardFunctionArguments):
    """The keys of `stage: online_dpo` (TRL 1.16 `OnlineDPOConfig`'s names and defaults), plus the reward keys."""

    beta: Union[float, list[float]] = field(
        default_factory=lambda: [0.1],
        metadata={"help": "DPO beta (IPO's tau): how far the policy may move from the reference. A list gives one "
                          "beta per epoch, the last one for the epochs after. TRL default [0.1]."})
    loss_type: Literal["sigmoid", "ipo"] = field(
        default="sigmoid", metadata={"help": "sigmoid (DPO) or ipo (on summed log-probs). TRL default sigmoid."})
    max_new_tokens: int = field(
        default=64, metadata={"help": "Most tokens sampled per completion. TRL default 64."})
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature (> 0). TRL default 0.9."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass in (0, 1]; 1 = off. TRL default 1.0."})
    top_k: int = field(default=0, metadata={"help": "Sample among the k most likely tokens; 0 = off. TRL default 0."})
    min_p: Optional[float] = field(
        default=None,
        metadata={"help": "Min-p sampling: drop tokens below min_p x the most likely token's probability, after "
                          "temperature, top-k and top-p; unset = off. TRL default none."})
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Penalty > 1 discourages repeated tokens; 1 = none. TRL default 1.0."})
    missing_eos_penalty: Optional[float] = field(
        default=None,
        metadata={"help": "Subtracted from the reward of a completion cut off at max_new_tokens without an end of "
                          "turn (> 0). TRL default none."})
    disable_dropout: bool = field(
        default=True, metadata={"help": "Set every dropout of the policy to 0 while training. TRL default true."})

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            betas = [float(b) for b in (self.beta if isinstance(self.beta, list) else [self.beta])]
        except (TypeError, ValueError):
            raise ConfigError(f"beta={self.beta!r} must be a number, or a list of numbers (one per epoch).") from None
        if not betas or not all(b > 0 for b in betas):
            raise ConfigError(f"beta={self.beta} must be > 0 (one value, or one per epoch).")
        self.beta = betas[0] if len(betas) == 1 else betas  # TRL keeps a one-item list as its value
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be at least 1.")
        if not self.temperature > 0:
            raise ConfigError(f"temperature={self.temperature} must be > 0: online DPO samples its pairs.")
        check_sampling_knobs(self)
        if self.missing_eos_penalty is not None and not self.missing_eos_penalty > 0:
            raise ConfigError(f"missing_eos_penalty={self.missing_eos_penalty} must be > 0 (or unset).")

    def check_run(self, stage: str, training: Any) -> None:
        """Refuse evaluation, and a run without `reward_funcs` (they choose which completion of each pair is
        chosen); `training` as for `GroupRolloutArguments.check_run`."""
        if training.do_eval or training.do_predict:
            raise ConfigError(f"stage {stage} trains only: remove do_eval/do_predict, and measure a reward on held-out "
                              "prompts with `alignkit eval` before and after training.")
        if not self.reward_funcs:
            raise ConfigError(f"stage {stage} needs reward_funcs (functions and/or reward model directories) to judge "
                              "which of each prompt's two completions is chosen.")

    def beta_at(self, epoch: float) -> float:
        """The beta of epoch `epoch` (0-based, fractional within an epoch): `beta[int(epoch)]`, the last after."""
        if not isinstance(self.beta, list):
            return float(self.beta)
        return float(self.beta[min(int(epoch), len(self.beta) - 1)])


@dataclass
class PPOArguments(RewardFunctionArguments):
    """The keys of `stage: ppo` (plus the reward keys it shares with GRPO: `reward_funcs`, `reward_weights`,
    `reward_model_type`, `log_completions`, ...).

    Defaults are those of TRL 0.x's `PPOConfig` (the last TRL with this PPO) and LLaMA-Factory's PPO keys,
    except where a help text says otherwise.
    """

    reward_model: Optional[str] = field(
        default=None,
        metadata={"help": "Reward model: an rm run's output_dir (LLaMA-Factory's key). Its score is added to any "
                  "`reward_funcs` (weight 1). `reward_model_type` says how it is held: `lora` a second adapter "
                  "on the policy's base, `full` on its own, `auto` (default) lora when it fits."},
    )
    ppo_critic: Literal["head", "adapter"] = field(
        default="head",
        metadata={"help": "`head` (default): a value head on the policy's hidden states (the original PPO-with-PEFT "
                  "design); `adapter`: the critic gets its own LoRA adapter and head, both initialised from the "
                  "LoRA reward model (InstructGPT style; one more decoder pass per update)."},
    )
    ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout (TRL 0.x and LLaMA-Factory: 4)."})
    ppo_buffer_size: int = field(
        default=1,
        metadata={"help": "Rollout size in optimizer steps: a rollout holds per_device_train_batch_size x "
                  "gradient_accumulation_steps x ppo_buffer_size prompts (LLaMA-Factory's key, default 1)."},
    )
    ppo_score_norm: bool = field(
        default=False,
        metadata={"help": "Normalise scores by the running mean and std of all scores so far (LLaMA-Factory's key)."},
    )
    ppo_whiten_rewards: bool = field(
        default=False, metadata={"help": "Whiten the per-token rewards (scale only) before GAE (LLaMA-Factory's key)."}
    )
    ppo_target: float = field(
        default=6.0, metadata={"help": "Target KL (nats per response) of the adaptive KL controller (TRL: 6)."}
    )
    init_kl_coef: float = field(
        default=0.2, metadata={"help": "Initial (or, with adap_kl_ctrl false, fixed) KL coefficient (TRL: 0.2)."}
    )
    adap_kl_ctrl: bool = field(
        default=True, metadata={"help": "Adapt the KL coefficient towards ppo_target (Ziegler et al.; TRL: true)."}
    )
    horizon: int = field(default=10000, metadata={"help": "Horizon of the adaptive KL controller (TRL: 10000)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount over response tokens (TRL: 1)."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda (TRL: 0.95)."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip range (TRL: 0.2)."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range (TRL: 0.2)."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss (TRL: 0.1)."})
    mini_batch_size: Optional[int] = field(
        default=None,
        metadata={"help": "Rows per forward/backward pass in the PPO update (default per_device_train_batch_size). "
                  "One optimizer step covers per_device_train_batch_size x gradient_accumulation_steps rows; TRL "
                  "0.x's default of 128 (with batch 128) is a GPU size, so it follows the batch here instead."},
    )
    whiten_advantages: bool = field(
        default=True, metadata={"help": "Whiten the advantages over the rollout's response tokens (TRL: always)."}
    )
    response_length_range: Optional[list[int]] = field(
        default=None,
        metadata={"help": "`min,max` (both included): each response is cut to a length drawn uniformly from this "
                  "range (the length sampler), or ends at its end of turn before. Unset (default): responses end at "
                  "their end of turn or at max_new_tokens."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        from ..errors import ConfigError

        if self.response_length_range is not None:
            try:
                self.response_length_range = [int(v) for v in self.response_length_range]
            except (TypeError, ValueError):
                raise ConfigError(f"response_length_range={self.response_length_range!r}: give two integers "
                                  "`min,max`.") from None
            if len(self.response_length_range) != 2 or not 1 <= self.response_length_range[0] \
                    <= self.response_length_range[1]:
                raise ConfigError(f"response_length_range={self.response_length_range}: give `min,max` with "
                                  "1 <= min <= max (e.g. 16,64).")
        for key in ("ppo_epochs", "ppo_buffer_size", "horizon"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be at least 1.")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ConfigError(f"mini_batch_size={self.mini_batch_size} must be at least 1.")
        for key in ("ppo_target", "cliprange", "cliprange_value"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be > 0.")
        for key in ("init_kl_coef", "vf_coef"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 0.")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"gamma={self.gamma} and lam={self.lam} must lie in [0, 1].")

    def check_run(self, stage: str, training: Any) -> None:
        """Refuse training without a reward (`reward_model` and/or `reward_funcs`), and evaluation; `training` as
        for `GroupRolloutArguments.check_run`."""
        if training.do_train and not self.reward_model and not self.reward_funcs:
            raise ConfigError(f"stage {stage} needs a reward: set `reward_model` (an rm run's output_dir) and/or "
                              "`reward_funcs`.")
        if training.do_eval or training.do_predict:
            raise ConfigError(f"stage {stage} trains only: set do_eval and do_predict to false (score the trained "
                              "policy with `alignkit score`).")


@dataclass
class DistillArguments:
    """The keys of `stage: distill` (TRL 1.16 `DistillationConfig`'s names and defaults)."""

    teacher_model_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "Teacher model: a local directory, hub id, or `smollm2-135m-instruct` (bundled). Unset: "
                          "the student's base (model_name_or_path), which then needs teacher_adapter_name_or_path. "
                          "Its tokenizer must equal the student's."})
    teacher_adapter_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "PEFT adapter(s) merged into the teacher, comma-separated (e.g. an SFT adapter, to "
                          "distil it into a fresh adapter on the bare base)."})
    teacher_model_revision: Optional[str] = field(
        default=None, metadata={"help": "Hub revision of the teacher (default: main)."})
    beta: float = field(
        default=1.0,
        metadata={"help": "Generalized JSD interpolation in [0, 1]: 0 = forward KL(teacher || student), 0.5 = JSD, "
                          "1 = reverse KL(student || teacher). Selects the divergence (no reference model). "
                          "TRL default 1.0."})
    max_completion_length: int = field(
        default=512, metadata={"help": "Most tokens the student generates per completion. TRL default 512."})
    temperature: float = field(
        default=1.0,
        metadata={"help": "Sampling temperature (> 0), also dividing both models' logits in the loss. TRL default "
                          "1.0."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass in (0, 1]; 1 = off. TRL default 1.0."})
    top_k: int = field(default=0, metadata={"help": "Sample among the k most likely tokens; 0 = off. TRL default 0."})
    min_p: Optional[float] = field(
        default=None,
        metadata={"help": "Min-p sampling: drop tokens below min_p x the most likely token's probability, after "
                          "temperature, top-k and top-p; unset = off. TRL default none."})
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Penalty > 1 discourages repeated tokens; 1 = none. TRL default 1.0."})
    shuffle_dataset: bool = field(default=True, metadata={"help": "Shuffle the prompts each epoch (seeded)."})
    disable_dropout: bool = field(
        default=False, metadata={"help": "Set every dropout of the student to 0 while training. TRL default false."})
    log_completions: bool = field(
        default=False, metadata={"help": "Append each prompt and completion to `completions.jsonl` in output_dir."})
    use_vllm: bool = field(
        default=False,
        metadata={"help": "Generate with vLLM in the training process (colocate mode; GPU and the `vllm` extra). "
                          "Written against vLLM's API, not run here."})
    vllm_mode: str = field(
        default="colocate",
        metadata={"help": "How vLLM runs: `colocate` (in the training process), TRL's default and the only mode "
                          "here; `server` (a `trl vllm-serve` process) is refused."})
    vllm_gpu_memory_utilization: float = field(
        default=0.3, metadata={"help": "Share of GPU memory vLLM may take in colocate mode. TRL default 0.3."})

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError(f"beta={self.beta} must be in [0, 1] (0 = forward KL, 0.5 = JSD, 1 = reverse KL).")
        if self.max_completion_length < 1:
            raise ConfigError(f"max_completion_length={self.max_completion_length} must be at least 1.")
        if not self.temperature > 0:
            raise ConfigError(f"temperature={self.temperature} must be > 0: the student samples its completions.")
        check_sampling_knobs(self)
        check_vllm_keys(self)

    def check_run(self, stage: str, training: Any) -> None:
        """Refuse evaluation (the stage trains only); `training` as for `GroupRolloutArguments.check_run`."""
        if training.do_eval or training.do_predict:
            raise ConfigError("stage distill trains only: remove do_eval/do_predict, and measure the KL to the teacher "
                              "on held-out prompts with `alignkit eval --kl-reference` before and after training.")

    def generation_loop(self) -> SimpleNamespace:
        """The settings `GRPOTrainer`'s round reads, for distillation: GRPO's defaults, the sampling keys of this
        stage, and one completion per prompt, one generation batch per optimizer step, trained once, no KL term to a
        reference, no reward function."""
        grpo_defaults = {f.name: f.default_factory() if f.default_factory is not MISSING else f.default
                         for f in fields(GRPOArguments)}
        return SimpleNamespace(**{**grpo_defaults, **asdict(self), "num_generations": 1, "steps_per_generation": None,
                                  "generation_batch_size": None, "num_iterations": 1, "beta": 0.0,
                                  "mask_truncated_completions": False, "reward_funcs": []})
