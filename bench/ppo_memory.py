"""An SFT run shaped like a PPO run, to compare their peak memory: `python -m bench.ppo_memory PPO_DIR OUT_DIR`.

PPO's peak memory is judged against SFT's "with the same batch size and lengths" (one base model for policy,
reference, reward model and critic should cost little more than training one adapter). The fairest SFT twin
trains on PPO's own rollouts: each prompt with the response PPO sampled for it, from the run's
`completions.jsonl` (`log_completions: true`), so every sequence has exactly a PPO sequence's prompt + response
length. This writes those rows (`OUT_DIR/ppo_rollouts.jsonl`, openai `messages`) and an SFT config with the PPO
config's model, SFT adapter, LoRA settings, batch size and cutoff_len (`OUT_DIR/sft_like_ppo.yaml`), then
prints the two commands to measure:

    /usr/bin/time -v alignkit train examples/ppo_lora.yaml           # "Maximum resident set size"
    /usr/bin/time -v alignkit train OUT_DIR/sft_like_ppo.yaml

Peak memory is reached within a few steps, so the SFT config runs `--steps` steps (default 10).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# Keys copied from the PPO config: what decides the model in memory and the shape of a training batch.
SHARED_KEYS = ("model_name_or_path", "adapter_name_or_path", "template", "finetuning_type", "lora_rank",
               "lora_alpha", "lora_dropout", "lora_target", "cutoff_len", "per_device_train_batch_size",
               "gradient_accumulation_steps", "seed", "padding_free")


def rollout_rows(completions_file: Path) -> list[dict[str, Any]]:
    """One openai-format row per PPO completion record: the prompt's messages, then the sampled response."""
    rows = []
    for line_no, line in enumerate(completions_file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        prompt = record["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        completion = record.get("completion")
        if isinstance(completion, list) and completion:  # a conversational row: TRL's [{"role": "assistant", ...}]
            completion = completion[-1].get("content")
        if not isinstance(completion, str):
            raise ValueError(f"{completions_file}:{line_no}: no `completion` text; is this a PPO completions.jsonl?")
        rows.append({"messages": messages + [{"role": "assistant", "content": completion}]})
    if not rows:
        raise ValueError(f"{completions_file} holds no completions; run PPO with log_completions: true.")
    return rows


def sft_config(ppo_config: dict[str, Any], dataset: str, output_dir: str, steps: int) -> dict[str, Any]:
    """The SFT config: the PPO config's SHARED_KEYS, PPO's rollouts as data, `steps` steps, nothing saved."""
    config = {key: ppo_config[key] for key in SHARED_KEYS if key in ppo_config}
    config.update(stage="sft", do_train=True, dataset=dataset, output_dir=output_dir, overwrite_output_dir=True,
                  max_steps=steps, save_strategy="no", logging_steps=1, learning_rate=1.0e-4)
    return config


def main(argv: list[str] | None = None) -> int:
    import yaml

    p = argparse.ArgumentParser(prog="python -m bench.ppo_memory", description=__doc__.splitlines()[0])
    p.add_argument("ppo_dir", help="output_dir of a PPO run with log_completions: true")
    p.add_argument("out_dir", help="where the rollout data and the SFT config go")
    p.add_argument("--ppo-config", default="examples/ppo_lora.yaml", help="the PPO run's config (batch, lengths)")
    p.add_argument("--steps", type=int, default=10, help="SFT steps (peak memory is reached early)")
    opts = p.parse_args(argv)
    out = Path(opts.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = rollout_rows(Path(opts.ppo_dir) / "completions.jsonl")
    data_file = out / "ppo_rollouts.jsonl"
    data_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    ppo_config = yaml.safe_load(Path(opts.ppo_config).read_text(encoding="utf-8"))
    config = sft_config(ppo_config, str(data_file), str(out / "sft_out"), opts.steps)
    config_file = out / "sft_like_ppo.yaml"
    config_file.write_text(f"# alignkit train {config_file}\n# SFT on {len(rows)} PPO rollouts of {opts.ppo_dir}: "
                           "the same batch size and sequence lengths as that PPO run.\n"
                           + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    print(f"/usr/bin/time -v alignkit train {opts.ppo_config}\n/usr/bin/time -v alignkit train {config_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
