"""alignkit: post-training of language models (pt, SFT, RM, DPO, KTO, GRPO, RLOO, PPO, distillation, online DPO)."""

import logging as _logging

# bitsandbytes 0.50 (the qlora extra), imported by transformers whether or not a model is quantized, warns once per
# process on a CPU with AVX512-BF16 that it could not fetch an optional 4-bit kernel from the Hugging Face Hub (the
# `kernels` package); its own CPU kernels run instead (docs/qlora.md). Only that line is dropped, before any import
# of transformers can emit it.
_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward"))
