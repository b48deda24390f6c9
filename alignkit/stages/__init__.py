"""The training stages, registered here and nowhere else.

Each stage is one module (`sft.py`, `rm.py`, `dpo.py`, `grpo.py`, `ppo.py`, `distill.py`, ...) holding its own keys
(a dataclass), its pure loss functions, its Trainer subclass and its `run_<stage>(config, callbacks)`. This table is
what the rest of alignkit reads: the config parser (`alignkit.config.parse`: which stages and keys exist, what to check)
and `alignkit train` (what to run). The data layer is below the stages and never reads it: a stage hands
`get_dataset` its data kind. Adding a stage means writing its module and one line here; the imports are
explicit, so an error inside a stage module surfaces as itself. The table is built on first use of `STAGES`; a
stage's own keys live in `arguments.py`, which imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Stage:
    """One entry of the registry.

    Attributes:
        name: the value of the `stage` key.
        data_kind: the examples the data layer builds for it: `text` (pretraining blocks), `supervised`
            (prompt + reply with a label mask), `preference` (chosen / rejected pairs), `unpaired` (one reply
            flagged desirable or not) or `prompt` (RL prompts). The stage module's `DATA_KIND`, which its run
            function hands to `data.get_dataset` (the data layer knows kinds, not stages).
        run: `run(config, callbacks)` trains / evaluates / predicts as the config says.
        arguments: the dataclass of the stage's own config keys (None: it has none); an instance arrives as
            `Config.method`.
        check: `check(config)` raises `ConfigError` for settings only this stage forbids (None: nothing).
    """

    name: str
    data_kind: str
    run: Callable[..., None]
    arguments: Optional[type] = None
    check: Optional[Callable[[Any], None]] = None


def _registry() -> dict[str, Stage]:
    """The table, its stage modules imported (torch, transformers: see `__getattr__`)."""
    from . import distill, dpo, grpo, kto, online_dpo, ppo, rloo, rm, sft

    return {
        "pt": Stage("pt", sft.PT_DATA_KIND, sft.run_pt, check=sft.check_config),
        "sft": Stage("sft", sft.SFT_DATA_KIND, sft.run_sft, check=sft.check_config),
        "rm": Stage("rm", rm.DATA_KIND, rm.run_rm, arguments=rm.RewardArguments),
        "dpo": Stage("dpo", dpo.DATA_KIND, dpo.run_dpo, arguments=dpo.DPOArguments, check=dpo.check_config),
        "kto": Stage("kto", kto.DATA_KIND, kto.run_kto, arguments=kto.KTOArguments, check=kto.check_config),
        "grpo": Stage("grpo", grpo.DATA_KIND, grpo.run_grpo, arguments=grpo.GRPOArguments, check=grpo.check_config),
        "rloo": Stage("rloo", rloo.DATA_KIND, rloo.run_rloo, arguments=rloo.RLOOArguments, check=grpo.check_config),
        "ppo": Stage("ppo", ppo.DATA_KIND, ppo.run_ppo, arguments=ppo.PPOArguments, check=ppo.check_config),
        "distill": Stage("distill", distill.DATA_KIND, distill.run_distill, arguments=distill.DistillArguments,
                         check=distill.check_config),
        "online_dpo": Stage("online_dpo", online_dpo.DATA_KIND, online_dpo.run_online_dpo,
                            arguments=online_dpo.OnlineDPOArguments, check=online_dpo.check_config),
    }


def __getattr__(name: str) -> Any:
    # `STAGES` is built on first use: the stage modules import torch and transformers, and the stages' own keys
    # (`arguments`, below this package) are checked without them (`alignkit.config.keytable.check_config_early`).
    if name != "STAGES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    stages = _registry()
    globals()["STAGES"] = stages  # the next lookup is a plain attribute
    return stages


__all__ = ["Stage", "STAGES"]
