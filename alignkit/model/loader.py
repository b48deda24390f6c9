"""Tokenizer and model loading: where the weights come from, which head, and what is trained.

`model_name_or_path` is a local directory, a hub id, or the bundled default (absent or
`smollm2-135m-instruct`). `load_model` then applies, in this order:

1. the head: a causal LM, or for reward models `AutoModelForSequenceClassification` with one label
   over the same weights (so the checkpoint is a standard sequence-classification model);
2. the adapters of `adapter_name_or_path`, merged into the base weights in memory (recorded on the
   model, see `merged_adapters`). A new stage then trains a fresh adapter on top, so "adapter
   disabled" is the earlier stage's model, which is the reference DPO, GRPO and PPO need: reference =
   base + SFT adapter, policy = that + the fresh adapter. The new adapter only means something on that
   merged base, so a LoRA run writes the chain beside it (`base_adapters.json`, `save_base_adapters`)
   and every later load puts it back first (`resolve_adapter_chain`): giving the last adapter is enough;
3. what is trained (`finetuning_type`): a fresh LoRA adapter, every weight, or the last decoder layers.

Under DeepSpeed ZeRO-3 `from_pretrained` partitions every weight as it loads (`deepspeed.zero.Init`), and merging
(`merge_and_unload`) would write into those partitions. So there step 2 happens before the load, once: the base
with its adapter chain merged is built with ZeRO-3 switched off (whole weights in CPU memory), saved into
`$ALIGNKIT_HOME/merged/<key>` (`ensure_merged_base`; the key covers the base and each adapter's weights and
config, so a retrained adapter gets a new folder), and the run loads that folder, partitioned, as its base.
The model then records the same merged chain and names the same base as an in-memory merge would.

A quantized base (`quantization_bit`, QLoRA) takes the same route for the same reason: merging into 4- or 8-bit
weights would round base + delta to the quantization grid again. The chain is merged once in full precision into
that folder, which is then quantized as it loads, so the reference ("adapter disabled") is the quantized earlier
stage's model. Only LoRA trains on a quantized base; a LoRA run records the quantization it trained over beside
the adapter (`base_quantization.json`, `save_base_quantization`), which `alignkit export` reports when it merges
the adapter into the full-precision base.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
from torch import nn

from ..config import BUNDLED_MODEL_NAME, FinetuningArguments, ModelArguments
from ..config.sections import attention_from_flash_attn
from ..errors import ConfigError
from ..env import alignkit_home
from .bundled import build_folder_once, ensure_bundled_model
from .distributed import zero3_enabled, zero3_switched_off
from .heads import VALUE_HEAD_NAME
from .multimodal import check_supported, freeze_parts, lora_target_pattern, vision_language_type
from .weight_files import check_adapter_files, check_model_files

logger = logging.getLogger(__name__)

Head = Literal["causal_lm", "reward"]
# Output heads are never LoRA targets: `lm_head` maps to the vocabulary (tied to the embeddings in
# SmolLM2), `score` (`classifier` in some architectures) is the reward head, trained in full instead,
# and `v_head` is the value head `heads.attach_value_head` puts on a PPO policy.
OUTPUT_HEADS = ("lm_head", "score", "classifier", VALUE_HEAD_NAME)
# The sequence-classification head's name across architectures.
REWARD_HEADS = ("score", "classifier")
# Attribute on the loaded transformers model listing the adapter dirs merged into its weights.
_MERGED_ATTR = "alignkit_merged_adapters"
# Beside a LoRA run's adapter (and in its checkpoints): the adapters merged into the base under it, in order.
BASE_ADAPTERS_FILE = "base_adapters.json"
# Attribute on the loaded transformers model: the (ModelArguments, head) it was loaded from (`load_frozen_copy`).
_SOURCE_ATTR = "alignkit_model_source"
# In a merged base folder (`ensure_merged_base`): what it was merged from.
MERGED_BASE_FILE = "alignkit_merged_base.json"
# Beside a LoRA adapter trained on a quantized base (and in its checkpoints): the quantization keys of that base.
BASE_QUANTIZATION_FILE = "base_quantization.json"
# Attribute on the trained transformers model: (loraplus_lr_ratio, loraplus_lr_embedding) of its LoRA+ adapter.
LORAPLUS_ATTR = "alignkit_loraplus"
_QUANTIZATION_KEYS = ("quantization_bit", "quantization_method", "quantization_type", "double_quantization")


def resolve_model_path(model_args: ModelArguments) -> str:
    """The directory or hub id that `from_pretrained` should read.

    Raises:
        ConfigError: a path that is not a directory, or a hub id that cannot be reached offline.
    """
    name = model_args.model_name_or_path
    if not name or name == BUNDLED_MODEL_NAME:
        return str(ensure_bundled_model())
    path = Path(name).expanduser()
    if path.is_dir():
        check_model_files(path)  # a cut-off copy fails here, not after the data is tokenised
        return str(path)
    # A hub id is `name` or `owner/name`; anything else that is not a directory is a mistyped path, and so is
    # `owner/name` whose `owner` is a folder here (`models/X` with a `models/` beside the config).
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
    if path.exists() or looks_like_path or (len(path.parts) == 2 and path.parent.is_dir()):
        raise ConfigError(
            f"model_name_or_path={name!r} is not a model directory (a hub id has the form owner/name). "
            f"Give a folder holding config.json, or omit the key for the bundled `{BUNDLED_MODEL_NAME}`."
        )
    if _hub_offline() and not _in_hub_cache(name, model_args):
        raise ConfigError(
            f"model_name_or_path={name!r} is neither a local directory nor reachable offline "
            "(HF_HUB_OFFLINE is set and the hub cache does not hold it). Give a local model directory, "
            f"or omit the key to use the bundled default `{BUNDLED_MODEL_NAME}`."
        )
    if not _hub_offline() and not _in_hub_cache(name, model_args):
        _check_on_hub(name, model_args.model_revision)
    return name


@functools.lru_cache(maxsize=None)  # one question per model and revision, however often a run resolves it
def _check_on_hub(name: str, revision: Optional[str]) -> None:
    """Ask the hub once whether `name` is a model there, before `from_pretrained` retries its downloads for a
    minute: a name that is neither a folder here nor a model there, or a hub that cannot be reached, is a
    ConfigError naming the key and the fix. A gated or private model (it exists; the download decides) passes."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    where = f"model_name_or_path={name!r} is not a folder here ({Path.cwd()})"
    try:
        HfApi().model_info(name, revision=revision, timeout=10)
    except GatedRepoError:
        return
    except RevisionNotFoundError:
        raise ConfigError(f"model_name_or_path={name!r} has no revision {revision!r} on the hub; "
                          "set model_revision to a branch, tag or commit it has.") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{where}, nor a model on the hub (or a private one this machine has no token for). "
                          "Check the spelling, give a local model folder, or log in with `hf auth login`.") from None
    except HfHubHTTPError:
        return  # the hub answered with another error: the download reports it
    except Exception as err:  # no answer: refused, timed out, no route, DNS (httpx raises them all differently)
        raise ConfigError(f"{where}, and the hub cannot be reached to look it up ({type(err).__name__}). Give a "
                          "local model folder, or set HF_HUB_OFFLINE=1 to use only models in the hub cache.") from None


def _hub_offline() -> bool:
    # Read the environment at call time: huggingface_hub caches the flag at import.
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(str(f).upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def _in_hub_cache(repo_id: str, model_args: ModelArguments) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=model_args.cache_dir,
                                       revision=model_args.model_revision)
    except ValueError:  # not a valid repo id
        return False
    return isinstance(found, str)


def _hub_kwargs(model_args: ModelArguments) -> dict:
    return {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision,
            "trust_remote_code": model_args.trust_remote_code}


def resolve_dtype(infer_dtype: str) -> torch.dtype:
    """`auto` is float32 on CPU (bf16 has no hardware support there and runs ~50x slower), bfloat16 on
    GPUs that support it, float16 on other GPUs; any other value names the dtype."""
    if infer_dtype != "auto":
        return getattr(torch, infer_dtype)
    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_tokenizer(model_args: ModelArguments):
    """The model's tokenizer with a pad token (eos when it has none) and right padding.

    Right padding is what training collators expect; generation code pads prompts on the left itself.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(model_args)
    tokenizer = AutoTokenizer.from_pretrained(path, **_hub_kwargs(model_args))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"the tokenizer of {path} has neither a pad nor an eos token; add one to its config.")
        logger.warning("The tokenizer of %s has no pad token; using its eos token %r.", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    adapters = split_adapters(model_args.adapter_name_or_path)
    saved = saved_chat_template(adapters[-1]) if adapters else None
    if saved is not None and saved != tokenizer.chat_template:
        # Training saves the template it rendered with beside the adapter (`template` may differ from the
        # base's own): chat, export and later stages must use that format.
        logger.info("Using the chat template saved with adapter %s (the format it was trained with).", adapters[-1])
        tokenizer.chat_template = saved
    return tokenizer


def load_image_processing(model_args: ModelArguments, tokenizer):
    """For a vision-language model (`model.multimodal`), the data layer's `ImageProcessing` over its processor
    (holding `tokenizer`); None for a text-only model. Reads the config and processor files, no weights."""
    from transformers import AutoConfig

    from ..data.multimodal import ImageProcessing
    from .multimodal import load_processor

    path = resolve_model_path(model_args)
    model_type = vision_language_type(AutoConfig.from_pretrained(path, **_hub_kwargs(model_args)))
    if model_type is None:
        return None
    check_supported(model_type, path)
    return ImageProcessing(load_processor(path, tokenizer, _hub_kwargs(model_args)), model_type,
                           model_args.image_max_pixels, model_args.image_min_pixels)


def saved_chat_template(folder: str | os.PathLike) -> str | None:
    """The chat template a tokenizer saved in `folder` holds (`chat_template.jinja`, else the
    `chat_template` of `tokenizer_config.json`), or None."""
    jinja = Path(folder) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = Path(folder) / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_model(
    model_args: ModelArguments,
    finetuning_args: FinetuningArguments,
    *,
    is_trainable: bool,
    head: Head = "causal_lm",
    vision: bool = False,
):
    """Load the base model, merge `adapter_name_or_path` into it, and set up what is trained.

    Args:
        model_args: where the model and adapters come from, dtype, remote code.
        finetuning_args: `finetuning_type` and its LoRA / freeze settings (used when `is_trainable`).
        is_trainable: True for training (a fresh LoRA adapter named "default", or full / freeze);
            False for inference (adapters merged, every weight frozen, eval mode).
        head: `causal_lm`, or `reward` for a one-label sequence-classification model whose `score`
            head trains in full.
        vision: the stage trains vision-language models (sft, dpo, kto, grpo, rloo); a stage that does not gets a
            ConfigError for one, before its weights load.

    Returns:
        A `PeftModel` when training with LoRA, otherwise a `PreTrainedModel`.
    """
    if head not in ("causal_lm", "reward"):
        raise ValueError(f"head={head!r}: expected 'causal_lm' or 'reward'.")
    if is_trainable and not vision:
        _refuse_vision_language(model_args)
    adapters = resolve_adapter_chain(split_adapters(model_args.adapter_name_or_path))
    head_comes_later = head == "reward" and (is_trainable or any(is_reward_adapter(a) for a in adapters))
    if is_trainable and model_args.quantization_bit and finetuning_args.finetuning_type != "lora":
        raise ConfigError(f"quantization_bit={model_args.quantization_bit} with finetuning_type="
                          f"{finetuning_args.finetuning_type}: a quantized base cannot be trained itself; use "
                          "finetuning_type=lora (QLoRA), or remove quantization_bit.")
    if adapters and (zero3_enabled() or model_args.quantization_bit):
        # Partitioned or quantized as it loads: merge first, once, in full precision into a folder the run then
        # loads (module docstring).
        merged = ensure_merged_base(model_args, adapters, head)
        model = _load_base(_merged_base_arguments(model_args, merged), head, head_comes_later)
        # Named as an in-memory merge names it, so a LoRA adapter trained on it records the real base (and its
        # `base_adapters.json` the chain), not the cache folder, which a later load would merge the chain into again.
        model.name_or_path = model.config.name_or_path = resolve_model_path(model_args)
    else:
        model = _load_base(model_args, head, head_comes_later)
        if adapters:
            model = merge_adapters(model, adapters, head=head)
    setattr(model, _MERGED_ATTR, tuple(adapters))
    setattr(model, _SOURCE_ATTR, (model_args, head))

    if not is_trainable:
        model.requires_grad_(False)
        model.eval()
        return model

    model.config.use_cache = False  # the KV cache only costs memory in a training forward pass
    if model_args.upcast_layernorm:
        upcast_layernorm(model)
    kind = finetuning_args.finetuning_type
    vision_type = vision_language_type(model.config)
    if vision_type is not None and kind == "freeze":
        raise ConfigError("finetuning_type=freeze is not supported for vision-language models; use lora or full with "
                          "freeze_vision_tower / freeze_multi_modal_projector / freeze_language_model.")
    if kind == "lora":
        model = add_lora(model, finetuning_args, head=head)
    elif kind == "full" and vision_type is not None:
        freeze_parts(model, vision_type, finetuning_args)
    elif kind == "full":
        model.requires_grad_(True)
    elif kind == "freeze":
        freeze_all_but_last_layers(model, finetuning_args.freeze_trainable_layers, head=head)
    else:
        raise ConfigError(f"finetuning_type={kind!r}: choose lora, full or freeze.")
    model.train()
    trainable, total = count_parameters(model)
    logger.info("Trainable parameters: %s of %s (%.4f%%), finetuning_type=%s.",
                f"{trainable:,}", f"{total:,}", 100 * trainable / max(total, 1), kind)
    return model


def _refuse_vision_language(model_args: ModelArguments) -> None:
    """A stage that does not train vision-language models, given one: say so before the weights load."""
    from transformers import AutoConfig

    path = resolve_model_path(model_args)
    config = AutoConfig.from_pretrained(path, **_hub_kwargs(model_args))
    if vision_language_type(config) is not None:
        raise ConfigError(f"{path} is a vision-language model ({config.model_type}); stages sft, dpo, kto, grpo and "
                          "rloo train those here, this one does not yet (docs/multimodal.md).")


def upcast_layernorm(model) -> int:
    """`upcast_layernorm`: the norm layers' weights (1-D parameters named `*norm*` or `*ln*`, LLaMA-Factory's rule)
    in float32 for training a bf16/fp16 model; their outputs are cast by the mixed-precision autocast. Returns how
    many were cast (0 for a float32 model)."""
    count = 0
    for name, param in model.named_parameters():
        if param.ndim == 1 and param.dtype != torch.float32 and any(part in name for part in ("norm", "ln")):
            param.data = param.data.float()
            count += 1
    if count:
        logger.info("upcast_layernorm: %d norm weights in float32.", count)
    return count


def merged_adapters(model) -> tuple[str, ...]:
    """The adapter dirs (absolute, with the chains their records add) that `load_model` merged into
    `model`'s base weights, in order.

    They are part of the reference (adapters disabled) and of every adapter switched in on this base
    (`alignkit.model.adapters`). Empty for a model `load_model` did not build or that had none.
    """
    from .heads import unwrap_model

    return tuple(getattr(unwrap_model(model), _MERGED_ATTR, ()))


def load_frozen_copy(model):
    """A second, frozen copy of `model` as `load_model` built it, loaded again from the same source (base and
    adapter chain, head, dtype), in eval mode.

    Under ZeRO-3 this is how a full/freeze policy gets its reference: a deep copy would copy partitions; a new
    load is partitioned by `from_pretrained` like the policy (and a merged base comes from its cache folder).
    It equals the policy as loaded, not as changed in memory since.

    Raises:
        ValueError: `model` was not built by `load_model` (there is no source to load it from again).
    """
    from .heads import unwrap_model

    source = getattr(unwrap_model(model), _SOURCE_ATTR, None)
    if source is None:
        raise ValueError(f"{type(unwrap_model(model)).__name__} was not loaded by alignkit.model.loader.load_model, so "
                         "there is no source to load its reference from again; pass the reference as ref_model.")
    model_args, head = source
    return load_model(model_args, FinetuningArguments(), is_trainable=False, head=head)


def _load_base(model_args: ModelArguments, head: Head, head_comes_later: bool = False):
    """The base model with `head`.

    Args:
        head_comes_later: (reward head) the score head is trained next or loaded from a reward adapter, so
            transformers' report that the checkpoint lacks it is not shown (anything else it finds is).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    path = resolve_model_path(model_args)
    if model_args.quantization_bit:
        fixed_mmap_threshold()
    # `low_cpu_mem_usage` is accepted in configs but not passed: transformers 5 always loads lazily.
    kwargs = dict(dtype=resolve_dtype(model_args.infer_dtype), **_hub_kwargs(model_args), **_quantization_kwargs(model_args))
    attention = model_args.attn_implementation or attention_from_flash_attn(model_args.flash_attn)
    if attention:
        kwargs["attn_implementation"] = attention
    if head == "causal_lm":
        if model_args.rope_scaling:
            kwargs["config"] = scale_rope(AutoConfig.from_pretrained(path, **_hub_kwargs(model_args)), model_args)
        config = kwargs.get("config") or AutoConfig.from_pretrained(path, **_hub_kwargs(model_args))
        model_type = vision_language_type(config)
        if model_type is not None:
            from transformers import AutoModelForImageTextToText

            check_supported(model_type, path)
            return AutoModelForImageTextToText.from_pretrained(path, **kwargs)
        return _quantized_base_settled(AutoModelForCausalLM.from_pretrained(path, **kwargs))

    # The reward score is read at each sequence's last real token; transformers finds that token via
    # `pad_token_id`, so the config must carry it for plain-transformers scoring to work.
    config = scale_rope(AutoConfig.from_pretrained(path, num_labels=1, **_hub_kwargs(model_args)), model_args)
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = load_tokenizer(model_args).pad_token_id
    if not head_comes_later:
        return _quantized_base_settled(AutoModelForSequenceClassification.from_pretrained(path, config=config,
                                                                                            **kwargs))
    with _load_report_held() as held:
        model, info = AutoModelForSequenceClassification.from_pretrained(path, config=config, output_loading_info=True,
                                                                         **kwargs)
    # A causal LM checkpoint has no score head: transformers reports it MISSING ("newly initialized"), which
    # says nothing here, where the head is trained or loaded from the adapter next. Any other finding is shown.
    if info["unexpected_keys"] or info["mismatched_keys"] or any(
            key.split(".")[0] not in REWARD_HEADS for key in info["missing_keys"]):
        held.release()
    return _quantized_base_settled(model)


def _quantization_kwargs(model_args: ModelArguments) -> dict:
    """`from_pretrained`'s `quantization_config` and `device_map` for `quantization_bit` (empty without it).

    4-bit computes in the run's dtype (`infer_dtype`). transformers keeps the output heads (`lm_head`, the reward
    `score`) in full precision. The whole model goes on this process's device, as LLaMA-Factory places it, unless
    `quantization_device_map: auto`, or under ZeRO-3, which places weights itself (LLaMA-Factory's rule too; not run
    here: bitsandbytes with ZeRO-3 needs GPUs).
    """
    if not model_args.quantization_bit:
        return {}
    from transformers import BitsAndBytesConfig

    if model_args.quantization_bit == 8:
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=resolve_dtype(model_args.infer_dtype),
                                    bnb_4bit_use_double_quant=model_args.double_quantization,
                                    bnb_4bit_quant_type=model_args.quantization_type)
    if zero3_enabled():
        return {"quantization_config": config}  # ZeRO-3 places the weights itself; transformers refuses a device_map
    if model_args.quantization_device_map == "auto":
        device_map: object = "auto"
    elif torch.cuda.is_available():
        device_map = {"": f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"}
    else:
        device_map = {"": "cpu"}
    return {"quantization_config": config, "device_map": device_map}


def scale_rope(config, model_args: ModelArguments):
    """`config` with `rope_scaling` applied (returned; unchanged without the key), LLaMA-Factory's rule on transformers
    5's `rope_parameters`: the factor is ceil(model_max_length / the model's original context), the context grows by
    it, and dynamic, yarn and llama3 also record the original length (llama3 with its frequency factors 1 and 4). A
    length the model already covers needs no scaling (logged, nothing changed); no model_max_length (chat, export)
    takes factor 2.

    Raises:
        ConfigError: the model's config has no RoPE parameters to scale.
    """
    kind = model_args.rope_scaling
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if not kind:
        return config
    if not rope or not hasattr(config, "max_position_embeddings"):
        raise ConfigError(f"rope_scaling={kind}: the model ({config.model_type}) has no RoPE parameters in its "
                          "config to scale; remove the key.")
    original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
    wanted = model_args.model_max_length
    if wanted is not None and wanted <= original:
        logger.info("rope_scaling=%s: model_max_length=%d fits the model's %d positions; no scaling.", kind, wanted,
                    original)
        return config
    factor = float(math.ceil(wanted / original)) if wanted is not None else 2.0
    rope.update(rope_type=kind, factor=factor)
    if kind in ("dynamic", "yarn", "llama3"):
        rope["original_max_position_embeddings"] = original
    if kind == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0)
    config.rope_parameters = rope
    config.max_position_embeddings = int(original * factor)
    logger.info("rope_scaling=%s: factor %s, context %d -> %d positions.", kind, factor, original,
                config.max_position_embeddings)
    return config


def _quantized_base_settled(model):
    """A freshly loaded model as training and decoding need it (returned): for a quantized base, one CPU 4-bit kernel
    (`_one_cpu_kernel`) and its full-precision weights copied out of the checkpoint's memory map
    (`own_mapped_weights`); any other model unchanged."""
    if getattr(model, "hf_quantizer", None) is not None:
        own_mapped_weights(_one_cpu_kernel(model))
    return model


def own_mapped_weights(model) -> int:
    """Copy the weights a quantized base keeps in full precision (embeddings, a tied `lm_head`, norms, a `score`
    head), or that a bf16 teacher keeps in fp32 (`precision.bf16_frozen_linears`), into memory of their own;
    returns how many tensors were copied.

    transformers reads a safetensors checkpoint through a memory map, and a weight it does not convert is a view of
    that map. Quantizing reads every other weight through the same map, so the whole file's pages are resident,
    and they stay counted in the process's memory for as long as one view keeps the map open: on the bundled
    SmolLM2-135M the tied embedding (113 MB) kept all 538 MB of the fp32 file resident next to the 4-bit model
    (docs/qlora.md, "Memory"). Copies free the map. A full-precision load needs no copy: it keeps every weight in
    the map, whose pages are then its weights.
    """
    copied: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:  # a tied weight is one parameter, copied once
        if id(tensor) in copied or not tensor.is_floating_point() or tensor.device.type != "cpu":
            continue
        tensor.data = tensor.data.clone()
        copied.add(id(tensor))
    return len(copied)


# glibc's `mallopt` parameter for the size from which `malloc` maps memory of its own (and unmaps it on `free`).
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 * 1024


def fixed_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at its default 128 KiB for this process (a quantized base on a CPU); returns
    whether it was set.

    glibc raises the threshold (up to 32 MiB) each time a mapped block is freed, after which tensors of a few MB
    come from the heap, and a freed heap block stays part of the process. A QLoRA step allocates and frees a
    dequantized weight around every matmul, forward and backward, between the activations that live until the
    backward, and with a raised threshold the freed space grew to 2.4 GB of the 3.7 GB peak on the bundled model
    (docs/qlora.md, "Memory"). A fixed threshold keeps those blocks mapped, so a free returns them. Not done where
    the allocator is not glibc's, on GPUs, or when the user sets `MALLOC_MMAP_THRESHOLD_` (glibc's own variable,
    read at start-up, which this leaves alone).
    """
    import ctypes
    import ctypes.util

    if torch.cuda.is_available() or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        done = bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError, ValueError):  # no confstr name (not Linux), no libc to load
        return False
    if done:
        logger.info("Quantized base on a CPU: glibc's mmap threshold fixed at %d KiB, so the dequantized weights of "
                    "each step return their memory when freed (MALLOC_MMAP_THRESHOLD_ overrides).",
                    _MMAP_THRESHOLD_BYTES // 1024)
    return done


def _one_cpu_kernel(model):
    """Keep a 4-bit base on bitsandbytes' one matmul path (returns `model`).

    On a CPU with AVX512-BF16, bitsandbytes 0.50 switches a `Linear4bit` to another kernel the first time it runs in
    eval mode without gradients: it re-lays the weight out for that kernel, for good, and computes in bf16. Every
    later pass, training included, then takes that kernel, which has no backward (gradients to the layers below stop
    there, silently but for a torch warning) and differs from the training kernel by ~1e-2 in the hidden states: a
    rollout or an evaluation would change what the policy computes
    afterwards, the reference's log-probs would not match the policy's at step 0, and a resumed run would not repeat
    the straight one. So that switch is turned off on every quantized layer.
    """
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
    return model


def save_base_quantization(model, output_dir: str | os.PathLike) -> Path | None:
    """Write `base_quantization.json` beside a LoRA adapter saved in `output_dir` when `model`'s base was quantized
    as it loaded: the adapter learned corrections over the quantized weights, which `alignkit export` (merging into
    the full-precision base) reports. Returns the file written, or None."""
    from .heads import unwrap_model

    source = getattr(unwrap_model(model), _SOURCE_ATTR, None)
    if source is None or not source[0].quantization_bit or not (Path(output_dir) / "adapter_config.json").is_file():
        return None
    record = {key: getattr(source[0], key) for key in _QUANTIZATION_KEYS}
    path = Path(output_dir) / BASE_QUANTIZATION_FILE
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def read_base_quantization(adapter_dir: str | os.PathLike) -> dict | None:
    """The quantization keys of the base `adapter_dir`'s adapter was trained on (`save_base_quantization`), or None
    for one trained on a full-precision base (or a damaged record, which only informs)."""
    path = Path(adapter_dir) / BASE_QUANTIZATION_FILE
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("quantization_bit") else None


class _HeldRecords:
    """Log records held back from `logger`, to emit later (`release`) or drop."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.records: list[logging.LogRecord] = []

    def release(self) -> None:
        for record in self.records:
            self.logger.handle(record)
        self.records.clear()


@contextlib.contextmanager
def _load_report_held():
    """Hold back the weight-loading report transformers logs inside this block; `release()` (after the block)
    shows it, and an exception raised inside shows it at once."""
    report_logger = logging.getLogger("transformers.modeling_utils")
    held = _HeldRecords(report_logger)

    def hold(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            held.records.append(record)
            return False
        return True

    report_logger.addFilter(hold)
    try:
        yield held
    except BaseException:
        report_logger.removeFilter(hold)
        held.release()  # the report explains the failure (transformers raises right after logging it)
        raise
    finally:
        report_logger.removeFilter(hold)


@contextlib.contextmanager
def _peft_wrapping():
    """Around peft calls that wrap a model (`get_peft_model`, `PeftModel.from_pretrained`).

    peft 0.21's `PeftModel.__init__` reads `model.is_gradient_checkpointing`, which transformers 5 deprecated
    in favour of `is_activation_checkpointing`; every LoRA run would print that FutureWarning, about peft's
    code, which a user cannot act on. Only that warning, only here, is silenced.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def split_adapters(adapter_name_or_path: str | None) -> list[str]:
    """`a,b` -> ["a", "b"]; None or "" -> []."""
    return [a.strip() for a in (adapter_name_or_path or "").split(",") if a.strip()]


def _absolute(path: str | os.PathLike) -> str:
    return os.path.realpath(Path(path).expanduser())


def same_adapters(first: Sequence[str], second: Sequence[str]) -> bool:
    """True when two adapter chains name the same directories in the same order (compared as real paths)."""
    return [_absolute(a) for a in first] == [_absolute(b) for b in second]


def _read_record(adapter_dir: str | os.PathLike) -> dict:
    path = Path(adapter_dir) / BASE_ADAPTERS_FILE
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        record = None
    chain = record.get("base_adapters") if isinstance(record, dict) else None
    digests = record.get("sha256", [None] * len(chain)) if isinstance(chain, list) else None
    if (not isinstance(chain, list) or not all(isinstance(a, str) and a for a in chain)
            or not isinstance(digests, list) or len(digests) != len(chain)):
        raise ConfigError(f"{path}: expected {{\"base_adapters\": [adapter folders, in merge order], \"sha256\": "
                          "[their weights' digests]}; fix the file (or delete it if the adapter was trained on the "
                          "bare base).")
    return {"base_adapters": chain, "sha256": digests}


def read_base_adapters(adapter_dir: str | os.PathLike) -> tuple[str, ...]:
    """The adapters a run merged into the base before training the adapter in `adapter_dir`, in order.

    Read from `base_adapters.json` (`{"base_adapters": ["/abs/sft", ...], "sha256": [...]}`); () when the
    folder has none, which is what an adapter trained on the bare base (or saved by plain peft) means.

    Raises:
        ConfigError: the file is not that JSON shape (the message names it).
    """
    return tuple(_read_record(adapter_dir).get("base_adapters", ()))


def _weights_digest(adapter_dir: str | os.PathLike) -> str | None:
    """sha256 of the adapter's weights file (a few MB for LoRA), or None when it has none we know."""
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        path = Path(adapter_dir) / name
        if path.is_file():
            return _file_digest(path)
    return None


def _file_digest(path: Path) -> str | None:
    """sha256 of the file at `path`, read in blocks; None when there is no such file."""
    import hashlib

    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _warn_if_changed(adapter_dir: str) -> None:
    """Warn when an adapter recorded under `adapter_dir` now holds other weights than it was trained over
    (e.g. the SFT run re-run into the same output_dir): the result is not the model that was trained."""
    record = _read_record(adapter_dir)
    for base_adapter, recorded in zip(record.get("base_adapters", ()), record.get("sha256", ())):
        if recorded is not None and (Path(base_adapter) / "adapter_config.json").is_file() \
                and _weights_digest(base_adapter) != recorded:
            logger.warning("The adapter %s holds other weights than when %s was trained on top of it (the sha256 in %s "
                           "differs): it was retrained or overwritten since, so %s no longer gives the model it was "
                           "trained as. Retrain %s, or restore that adapter.", base_adapter, adapter_dir,
                           Path(adapter_dir) / BASE_ADAPTERS_FILE, adapter_dir, adapter_dir)


def save_base_adapters(model, output_dir: str | os.PathLike) -> Path | None:
    """Write `base_adapters.json` beside the adapter saved in `output_dir` when `model` has merged adapters.

    A LoRA adapter trained over merged adapters (an RM or DPO run started from an SFT adapter) is only right
    on that merged base; plain peft knows only `base_model_name_or_path`, so the chain is recorded here and
    `resolve_adapter_chain` puts it back. Paths are absolute; the sha256 of each one's weights file lets a
    later load warn when one was retrained in place. A full or freeze run saves the merged weights
    themselves (nothing to record); neither does a run that merged nothing.

    Returns:
        The file written, or None.
    """
    chain = merged_adapters(model)
    if not chain or not (Path(output_dir) / "adapter_config.json").is_file():
        return None
    chain = [_absolute(a) for a in chain]
    record = {"base_adapters": chain, "sha256": [_weights_digest(a) for a in chain]}
    path = Path(output_dir) / BASE_ADAPTERS_FILE
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def resolve_adapter_chain(adapters: Sequence[str]) -> list[str]:
    """The adapters to merge, in order, absolute: `adapters` with the chains their records name put first.

    An adapter whose folder records base adapters (`base_adapters.json`) was trained on the base with those
    merged. Given alone (`adapter_name_or_path=dpo`), its recorded chain is merged before it. Given after
    others (`sft,dpo`, the explicit form), those are used; when they are not the recorded chain (a moved
    folder, or a deliberate choice) a warning names both. A recorded adapter whose weights changed since
    (its sha256) is warned about too.

    Raises:
        ConfigError: a recorded adapter folder no longer exists, or an adapter's `adapter_config.json` or weights
            are missing or damaged (`read_adapter_config`, `weight_files.check_adapter_files`); the message names
            the folder and the fix.
    """
    chain: list[str] = []
    for adapter in adapters:
        recorded = read_base_adapters(adapter)
        if recorded and not chain:
            record = Path(adapter) / BASE_ADAPTERS_FILE
            for base_adapter in recorded:
                if not (Path(base_adapter) / "adapter_config.json").is_file():
                    raise ConfigError(
                        f"adapter_name_or_path: {adapter} was trained on top of the adapter {base_adapter} (recorded "
                        f"in {record}), which is no longer there. Put it back, or give the chain explicitly: "
                        f"adapter_name_or_path=<where it is now>,{adapter}."
                    )
            chain.extend(recorded)
            _warn_if_changed(adapter)
        elif recorded and not same_adapters(chain, recorded):
            logger.warning("adapter_name_or_path: %s was trained on top of %s (its %s) but is given after %s; using "
                           "the adapters given.", adapter, ", ".join(recorded), BASE_ADAPTERS_FILE, ", ".join(chain))
        elif recorded:
            _warn_if_changed(adapter)
        chain.append(_absolute(adapter))
    for adapter in chain:  # a cut-off save fails here, before the base loads, not inside peft
        read_adapter_config(adapter)
        check_adapter_files(adapter)
    return [_absolute(a) for a in chain]


def read_adapter_config(adapter_dir: str | os.PathLike) -> dict:
    """The adapter's `adapter_config.json`, or a ConfigError naming it (missing, not JSON, not an object)."""
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise ConfigError(
            f"adapter_name_or_path: {adapter_dir!r} holds no adapter_config.json; give the output_dir of a "
            "LoRA run (or one of its checkpoint-N folders)."
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # not JSON, or not UTF-8: a save cut short or a damaged copy
        config = err
    if not isinstance(config, dict):
        raise ConfigError(
            f"adapter_name_or_path: {path} is not a JSON object ({config}). The save or the copy did not finish: "
            "copy the adapter again, or give one of its run's checkpoint-N folders."
        )
    return config


def is_reward_adapter(adapter_dir: str | os.PathLike) -> bool:
    """True when the adapter belongs to a reward model (sequence classification with a `score` head)."""
    cfg = read_adapter_config(adapter_dir)
    return cfg.get("task_type") == "SEQ_CLS" or "score" in (cfg.get("modules_to_save") or [])


def check_adapter_base(model, adapter_dir: str, adapter_cfg: dict, head: Head) -> None:
    """Reject an adapter trained on another kind of model, before PEFT fails with a shape error."""
    # An SFT adapter may start a reward model (the decoder is shared), but a reward adapter needs its
    # score head, which a causal LM lacks.
    if head == "causal_lm" and is_reward_adapter(adapter_dir):
        raise ConfigError(
            f"adapter_name_or_path: {adapter_dir} is a reward-model adapter (score head), but this run loads a "
            "causal LM. Use an adapter from an sft/dpo/grpo/ppo run, or give it as a reward model instead "
            "(`reward_model`, loaded beside the policy as a named adapter)."
        )
    recorded = adapter_cfg.get("base_model_name_or_path")
    recorded_config = Path(recorded) / "config.json" if recorded else None
    if recorded_config is None or not recorded_config.is_file():
        return  # the recorded base is not here to compare with; the shape check in PEFT still applies
    base = json.loads(recorded_config.read_text(encoding="utf-8"))
    mine = model.config.to_dict()
    facts = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    differing = [f"{k}: {base.get(k)} vs {mine.get(k)}" for k in facts if base.get(k) != mine.get(k)]
    if differing:
        raise ConfigError(
            f"adapter_name_or_path: {adapter_dir} was trained on the base {recorded}, which does not match "
            f"model_name_or_path={model.config.name_or_path} ({'; '.join(differing)}). Set model_name_or_path "
            "to the model the adapter was trained on."
        )


def merge_adapters(model, adapter_dirs: list[str], *, head: Head = "causal_lm"):
    """Load each PEFT adapter in turn and merge it into the base weights; returns the plain model."""
    from peft import PeftConfig, PeftModel

    for adapter_dir in adapter_dirs:
        adapter_cfg = read_adapter_config(adapter_dir)
        check_adapter_base(model, adapter_dir, adapter_cfg, head)
        if str(adapter_cfg.get("init_lora_weights", "")).startswith("pissa"):
            raise ConfigError(
                f"adapter_name_or_path: {adapter_dir} is a PiSSA adapter, right only on the residual base its run "
                "computed, not on the original model_name_or_path. Give that run's pissa_converted folder (train "
                "with pissa_convert=true), which is plain LoRA on the original base."
            )
        peft_config = PeftConfig.from_pretrained(adapter_dir)
        if head == "reward" and peft_config.task_type != "SEQ_CLS":
            # An SFT adapter starting a reward model: its CAUSAL_LM wrapper expects generation methods a
            # sequence classifier lacks, and only its decoder weights are needed for the merge.
            peft_config.task_type = None
        try:
            with _peft_wrapping():
                peft_model = PeftModel.from_pretrained(model, adapter_dir, config=peft_config, is_trainable=False)
        except (RuntimeError, ValueError, KeyError) as err:
            # A state-dict error lists every mismatching tensor; the first one says enough.
            lines = [line.strip() for line in str(err).strip().splitlines()]
            detail = " ".join(lines[:2]) + (f" (and {len(lines) - 2} more)" if len(lines) > 2 else "")
            raise ConfigError(
                f"adapter_name_or_path: cannot apply {adapter_dir} (trained on "
                f"{adapter_cfg.get('base_model_name_or_path')!r}) to {model.config.name_or_path}: {detail}. "
                "Set model_name_or_path to the model the adapter was trained on."
            ) from None
        model = peft_model.merge_and_unload()
        logger.info("Merged adapter %s into the base weights.", adapter_dir)
    return model


def merged_base_dir(model_args: ModelArguments, adapter_dirs: Sequence[str], head: Head = "causal_lm") -> Path:
    """Where `ensure_merged_base` keeps the base of `model_args` with `adapter_dirs` merged (it may not exist yet).

    `$ALIGNKIT_HOME/merged/<key>`: the key is a sha256 over the base (a local folder by its real path and its files'
    names, sizes and modification times; a hub id by id and revision), each adapter's weights and
    `adapter_config.json` (so a retrained or re-configured adapter gets a new folder, never a stale one), the
    dtype and whether a reward head is merged.
    """
    import hashlib

    base = resolve_model_path(model_args)
    key: dict = {"dtype": str(resolve_dtype(model_args.infer_dtype)), "head": _merge_head(adapter_dirs, head),
                 "adapters": [[_weights_digest(a), _file_digest(Path(a) / "adapter_config.json")]
                              for a in adapter_dirs]}
    if Path(base).is_dir():
        key["base"] = [os.path.realpath(base)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns]
                                                  for f in sorted(Path(base).iterdir()) if f.is_file()]
    else:
        key["base"] = [base, model_args.model_revision]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return alignkit_home() / "merged" / f"{Path(base).name}-{digest}"


def ensure_merged_base(model_args: ModelArguments, adapter_dirs: Sequence[str], head: Head = "causal_lm") -> Path:
    """The folder of the base with `adapter_dirs` merged in order, building it first if no finished one exists.

    Built with ZeRO-3 switched off (the whole model in CPU memory for the merge, `zero3_switched_off`), by the first
    process to take the folder's lock (`bundled.build_folder_once`: the others wait, then read it; a killed build
    leaves nothing that is read). The folder is a plain model directory (`save_pretrained`, the tokenizer with the
    chat template of the last adapter, `alignkit_merged_base.json` naming the base and adapters). A reward adapter in
    the chain is merged with its score head (a sequence-classification checkpoint); otherwise the folder is a
    causal LM, which a reward run loads as it would load the base, with a fresh score head.

    Args:
        model_args: the run's model arguments (base, dtype, hub settings).
        adapter_dirs: the resolved chain (`resolve_adapter_chain`), absolute, in merge order.
        head: the head the run loads.
    """
    target = merged_base_dir(model_args, adapter_dirs, head)
    merge_head = _merge_head(adapter_dirs, head)

    quantized = model_args.quantization_bit
    why, how = ((f"quantization_bit={quantized}", "quantized") if quantized else ("DeepSpeed ZeRO-3", "partitioned"))

    def build(folder: Path) -> dict:
        logger.warning("%s: merging %s into %s once, in full precision with whole weights in CPU memory, into %s "
                       "(the run then loads it %s).", why, ", ".join(adapter_dirs),
                       model_args.model_name_or_path or resolve_model_path(model_args), target, how)
        with zero3_switched_off():
            full_precision = replace(model_args, quantization_bit=None, quantization_device_map=None)
            model = _load_base(full_precision, merge_head, head_comes_later=merge_head == "reward")
            model = merge_adapters(model, list(adapter_dirs), head=merge_head)
            tokenizer = load_tokenizer(model_args)  # with the last adapter's chat template
        try:
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        except OSError as err:
            raise _unwritable(target, err) from err
        record = {"base": resolve_model_path(model_args), "adapters": list(adapter_dirs), "head": merge_head}
        (folder / MERGED_BASE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        return record

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unwritable(target, err) from err
    return build_folder_once(target, build)


def _unwritable(target: Path, err: OSError) -> ConfigError:
    """The error for a merged base that cannot be written (an unwritable or full ALIGNKIT_HOME)."""
    return ConfigError(f"DeepSpeed ZeRO-3 or quantization_bit with adapter_name_or_path: cannot write the merged base into {target} ({err}). "
                       "Set ALIGNKIT_HOME to a writable folder with room for one copy of the model, or merge beforehand "
                       "(`alignkit export --model BASE --adapter ADAPTER --export-dir MERGED`) and train from "
                       "model_name_or_path: MERGED.")


def _merge_head(adapter_dirs: Sequence[str], head: Head) -> Head:
    """The head a merged base is built with: `reward` only when an adapter of the chain brings a score head."""
    return "reward" if head == "reward" and any(is_reward_adapter(a) for a in adapter_dirs) else "causal_lm"


def _merged_base_arguments(model_args: ModelArguments, folder: Path) -> ModelArguments:
    """`model_args` reading the merged base in `folder` (a local folder: no adapters, no hub revision)."""
    return replace(model_args, model_name_or_path=str(folder), adapter_name_or_path=None, model_revision="main")


def find_linear_modules(model, exclude: tuple[str, ...] = OUTPUT_HEADS) -> list[str]:
    """Sorted short names of every `nn.Linear` in `model` except the output heads (`lora_target: all`).

    On a model that already holds PEFT layers (a second adapter, e.g. PPO's critic), a LoRA-wrapped linear
    counts under its own name and the wrapper's inner modules (`base_layer`, `lora_A.default`, ...) are
    not listed.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    names: set[str] = set()
    wrapped: list[str] = []
    for full_name, module in model.named_modules():
        if any(full_name.startswith(prefix) for prefix in wrapped):
            continue
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            wrapped.append(full_name + ".")
            module = module.get_base_layer() if isinstance(module, BaseTunerLayer) else None
        short = full_name.split(".")[-1]
        if isinstance(module, nn.Linear) and short not in exclude:
            names.add(short)
    return sorted(names)


def add_lora(model, finetuning_args: FinetuningArguments, *, head: Head = "causal_lm"):
    """Wrap `model` in a fresh trainable LoRA adapter named "default"; returns the `PeftModel`."""
    from peft import LoraConfig, TaskType, get_peft_model

    from .lora_fused import fuse_lora_linears

    if finetuning_args.lora_target.strip() == "all":
        targets = find_linear_modules(model)
    else:
        targets = [t.strip() for t in finetuning_args.lora_target.split(",") if t.strip()]
        present = {name.split(".")[-1] for name, _ in model.named_modules()}
        missing = [t for t in targets if t not in present and not any(n.endswith(t) for n in present)]
        if missing:
            raise ConfigError(
                f"lora_target: {', '.join(missing)} not found in the model; its linear layers are "
                f"{', '.join(find_linear_modules(model))} (or use lora_target=all)."
            )
    vision_type = vision_language_type(model.config)
    if vision_type is not None:  # the named layers, outside the parts the freeze keys keep frozen
        targets = lora_target_pattern(model, vision_type, finetuning_args, targets)
    modules_to_save = [m.strip() for m in (finetuning_args.additional_target or "").split(",") if m.strip()]
    if head == "reward" and "score" not in modules_to_save:
        modules_to_save.append("score")  # a fresh score head must train in full, and is saved with the adapter
    lora_config = LoraConfig(
        task_type=TaskType.SEQ_CLS if head == "reward" else TaskType.CAUSAL_LM,
        r=finetuning_args.lora_rank,
        lora_alpha=finetuning_args.lora_alpha,
        lora_dropout=finetuning_args.lora_dropout,
        target_modules=targets,
        modules_to_save=modules_to_save or None,
        use_dora=finetuning_args.use_dora,
        use_rslora=finetuning_args.use_rslora,
        init_lora_weights=_lora_init(finetuning_args),
    )
    with _peft_wrapping():
        peft_model = get_peft_model(model, lora_config)
    fuse_lora_linears(peft_model)  # same arithmetic, fewer element-wise passes (`lora_fused`)
    if finetuning_args.loraplus_lr_ratio is not None:
        # Read by `StageTrainer.create_optimizer`, which builds peft's LoRA+ optimizer from it.
        setattr(peft_model.get_base_model(), LORAPLUS_ATTR,
                (finetuning_args.loraplus_lr_ratio, finetuning_args.loraplus_lr_embedding))
    return peft_model


def _lora_init(finetuning_args: FinetuningArguments) -> bool | str:
    """peft's `init_lora_weights`: its default (A random, B zero), or PiSSA's SVD (`pissa` = full, else fast SVD)."""
    if not finetuning_args.pissa_init:
        return True
    return "pissa" if finetuning_args.pissa_iter == -1 else f"pissa_niter_{finetuning_args.pissa_iter}"


def loraplus_settings(model) -> tuple[float, float] | None:
    """(loraplus_lr_ratio, loraplus_lr_embedding) when `model`'s adapter was set up for LoRA+, else None."""
    from .heads import unwrap_model

    return getattr(unwrap_model(model), LORAPLUS_ATTR, None)


def _decoder_layers(model) -> tuple[str, int]:
    """Name prefix and count of the decoder layer list (the ModuleList as long as num_hidden_layers)."""
    n_layers = getattr(model.config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layers:
            return name, n_layers
    raise ConfigError(
        f"finetuning_type=freeze: cannot find the {n_layers} decoder layers of {type(model).__name__}; "
        "use finetuning_type=lora or full."
    )


def freeze_all_but_last_layers(model, num_trainable: int, *, head: Head = "causal_lm") -> None:
    """Train only the last `num_trainable` decoder layers (and the `score` head of a reward model)."""
    prefix, n_layers = _decoder_layers(model)
    if num_trainable > n_layers:
        raise ConfigError(f"freeze_trainable_layers={num_trainable} but the model has only {n_layers} layers.")
    trainable = {str(i) for i in range(n_layers - num_trainable, n_layers)}
    layer_re = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    for name, param in model.named_parameters():
        match = layer_re.match(name)
        in_trainable_layer = match is not None and match.group(1) in trainable
        is_score = head == "reward" and name.split(".")[0] == "score"
        param.requires_grad_(in_trainable_layer or is_score)


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights are counted once. A ZeRO-3 partition counts its whole
    parameter (`ds_numel`, which `deepspeed.zero.Init` sets; the partition itself may hold nothing)."""
    params = list(model.parameters())  # `parameters()` yields a tied tensor once
    sizes = [(getattr(p, "ds_numel", None) or p.numel(), p.requires_grad) for p in params]
    return sum(n for n, trainable in sizes if trainable), sum(n for n, _ in sizes)
