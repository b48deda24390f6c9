"""alignkit: post-training of language models (pt, SFT, RM, DPO, KTO, GRPO, RLOO, PPO, distillation, online DPO)."""

import logging as _logging
import os as _os

# oneDNN (which runs every bf16 matmul on a CPU) and ideep, torch's layer above it, each keep a cache of up to 1024
# compiled kernels, one per input shape, up to about a megabyte each, never freed. Padding-free batches and rollouts
# change their token count every step, so under bf16 a run's heap grew by 20-35 MB a step and RSS by hundreds of MB
# over a run (docs/performance.md, "oneDNN's shape caches"). 64 entries hold every shape one step repeats across its
# layers (distillation's step time unchanged). Read at their first use, so set before any matmul; a value the user
# exported is kept.
for _name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    _os.environ.setdefault(_name, "64")

# bitsandbytes 0.50 (the qlora extra), imported by transformers whether or not a model is quantized, warns once per
# process on a CPU with AVX512-BF16 that it could not fetch an optional 4-bit kernel from the Hugging Face Hub (the
# `kernels` package); its own CPU kernels run instead (docs/qlora.md). Only that line is dropped, before any import
# of transformers can emit it.
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward"))
# Offline (HF_HUB_OFFLINE=1), `kernels` 0.19 warns first, for that same fetch, that it skips the repository's
# publisher check; the fetch then fails as above. Only that repository's line is dropped: a kernel the user asks
# for still gets the warning.
_logging.getLogger("kernels._internals.hf_hub").addFilter(
    lambda record: not record.getMessage().startswith(
        "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"))

# peft imports bitsandbytes (when installed) in every process, and bitsandbytes' import set up torch's compiler for
# four kernels a run rarely calls: 1.3-2 s of each start-up. That set-up now waits for a kernel's first call.
from .env import defer_compile_set_up_in_bitsandbytes as _defer

_defer()
