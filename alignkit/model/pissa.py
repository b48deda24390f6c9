"""PiSSA's conversion to a plain LoRA adapter (`pissa_convert`), in LLaMA-Factory's folder layout.

A PiSSA adapter starts from the principal singular vectors of each base weight and the base keeps only the residual
(peft's `init_lora_weights="pissa"`), so the adapter saved in `output_dir` is right only on that residual base, which
no folder holds. peft converts it into a plain LoRA adapter on the original base (of twice the rank) given the
adapter as it was at step 0. So, as LLaMA-Factory lays it out: `output_dir/pissa_init` is the adapter at step 0
(written once: a resumed run keeps the first one), and at the end `output_dir/pissa_converted` is the converted
adapter, the one `alignkit export` and later stages take with the original `model_name_or_path`.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

PISSA_INIT_DIR = "pissa_init"
PISSA_CONVERTED_DIR = "pissa_converted"


class PissaConvertCallback(TrainerCallback):
    """Save the step-0 PiSSA adapter when training begins and the converted one when it ends (module docstring)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        init_dir = Path(args.output_dir) / PISSA_INIT_DIR
        if args.should_save and model is not None and not (init_dir / "adapter_config.json").is_file():
            model.save_pretrained(init_dir)
            logger.info("Saved the initial PiSSA adapter in %s (needed to convert the trained one).", init_dir)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not args.should_save or model is None:
            return
        init_dir = Path(args.output_dir) / PISSA_INIT_DIR
        converted = Path(args.output_dir) / PISSA_CONVERTED_DIR
        # peft subtracts the step-0 adapter and appends it to the trained one (rank 2r): plain LoRA on the original
        # base. It does not touch the model in memory. It loads the step-0 adapter beside the trained one to do so,
        # and warns that PiSSA should not sit beside another adapter: advice for users, about its own conversion.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="PiSSA changes the base weights", category=UserWarning)
            model.save_pretrained(converted, path_initial_model_for_weight_conversion=str(init_dir))
        logger.info("Saved the PiSSA adapter converted to plain LoRA on the original base in %s; merge that one "
                    "(`alignkit export --adapter %s`).", converted, converted)


__all__ = ["PISSA_CONVERTED_DIR", "PISSA_INIT_DIR", "PissaConvertCallback"]
