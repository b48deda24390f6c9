"""The shared stage trainer: exact metric means, grouping pairs by length, the stage registry and its keys."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from alignkit.config import TrainingArguments
from alignkit.config.parse import all_keys, parse_config
from alignkit.errors import ConfigError
from alignkit.stages import STAGES
from alignkit.stages.base import StageTrainer, weighted_means


def test_weighted_means_by_hand():
    """Batch means 1.0 over 4 examples and 4.0 over 2: (1*4 + 4*2) / 6 = 2.0; a key without count is left out."""
    assert weighted_means({"m": 12.0, "none": 3.0}, {"m": 6.0, "none": 0.0}) == {"m": 2.0}


def _trainer(tiny_model_dir, tmp_path, **args) -> StageTrainer:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    training = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True,
                                 remove_unused_columns=False, **args)
    return StageTrainer(model=model, args=training)


def test_eval_metrics_are_exact_over_the_set_and_train_over_the_window(tiny_model_dir, tmp_path):
    """A short last batch weighs what it holds: batches of 4 and 2 examples with means 1 and 4 give 2, not 2.5."""
    trainer = _trainer(tiny_model_dir, tmp_path)
    trainer.model.eval()
    trainer.record_metrics({"rewards/margins": torch.tensor([1.0, 1.0, 0.5, 1.5])}, num_examples=4)
    trainer.record_metrics({"rewards/margins": 4.0}, num_examples=2)
    logs = {"eval_loss": 0.5}
    trainer.log(logs)
    assert logs["eval_rewards/margins"] == pytest.approx(2.0)
    trainer.model.train()
    trainer.record_metrics({"logps/chosen": -3.0}, num_examples=2)
    logs = {"loss": 1.0}
    trainer.log(logs)
    assert logs["logps/chosen"] == pytest.approx(-3.0)
    assert "eval_rewards/margins" not in logs and "rewards/margins" not in logs  # each buffer emptied by its log
    logs = {"loss": 1.0}
    trainer.log(logs)
    assert not [key for key in logs if "/" in key]  # nothing recorded since the last log: nothing added


def test_metrics_of_some_rows_leave_out_the_repeated_rows_by_their_place_in_the_batch(tiny_model_dir, tmp_path,
                                                                                      monkeypatch):
    """A process's last evaluation batch of 4 rows holds 2 real ones (`real_rows` -> 2), then 2 repeats.

    Rows 0 and 2 are desirable (rewards 1.0 and 3.0): only row 0 is real, so rewards/chosen = 1.0 over 1 example.
    Rows 1 and 3 are undesirable (5.0, 7.0): row 1 alone, 5.0. A scalar counts for the 2 real rows. Without
    `rows`, [1, 5, 3, 7] over the batch keeps its first 2 values: (1 + 5) / 2 = 3.0.
    """
    trainer = _trainer(tiny_model_dir, tmp_path)
    trainer.model.eval()
    monkeypatch.setattr(trainer, "real_rows", lambda num_rows: 2 if num_rows == 4 else num_rows)
    desirable = torch.tensor([True, False, True, False])
    rewards = torch.tensor([1.0, 5.0, 3.0, 7.0])
    trainer.record_metrics({"rewards/chosen": rewards[desirable]}, 2, rows=desirable)
    trainer.record_metrics({"rewards/rejected": rewards[~desirable]}, 2, rows=~desirable)
    trainer.record_metrics({"kl": 0.5, "rewards/all": rewards}, 4)
    trainer.record_metrics({"logps/chosen": torch.tensor([-1.0])}, 1, rows=torch.tensor([False, False, False, True]))
    assert dict(trainer._metric_counts["eval"]) == {"rewards/chosen": [1.0], "rewards/rejected": [1.0], "kl": [2.0],
                                                    "rewards/all": [2.0]}  # a metric of repeats only: not kept
    logs = {}
    trainer.log(logs)
    assert logs["eval_rewards/chosen"] == 1.0 and logs["eval_rewards/rejected"] == 5.0
    assert logs["eval_kl"] == 0.5 and logs["eval_rewards/all"] == 3.0


def test_gather_real_rows_of_one_process_is_the_batch(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path)
    values, flags = torch.tensor([1.0, 2.0]), torch.tensor([True, False])
    assert trainer.gather_real_rows(values, flags) == (values, flags)


def test_length_grouping_for_pairs_adds_the_longer_side_as_length(tiny_model_dir, tmp_path):
    pairs = Dataset.from_dict({"chosen_input_ids": [[1, 2, 3], [1]], "rejected_input_ids": [[1], [1, 2, 3, 4]]})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    training = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True,
                                 remove_unused_columns=False, train_sampling_strategy="group_by_length")
    trainer = StageTrainer(model=model, args=training, train_dataset=pairs)
    assert trainer.train_dataset["length"] == [3, 4]
    rebalanced = StageTrainer(model=model, train_dataset=pairs, args=TrainingArguments(
        output_dir=str(tmp_path / "o3"), report_to="none", use_cpu=True, remove_unused_columns=False,
        train_sampling_strategy="batch_rebalance"))
    assert rebalanced.train_dataset["length"] == [3, 4]
    assert sorted(i for batch in rebalanced._get_train_sampler() for i in batch) == [0, 1]  # it reads the column
    plain = StageTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "o2"), report_to="none",
                                                             use_cpu=True), train_dataset=pairs)
    assert "length" not in plain.train_dataset.column_names


def test_group_by_length_key_reaches_the_sampler_for_every_stage():
    for stage in ("sft", "rm", "dpo"):
        config = parse_config({"stage": stage, "group_by_length": True})
        assert config.training.train_sampling_strategy == "group_by_length", stage


def test_full_finetuning_keeps_a_frozen_copy_only_when_asked(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path)
    assert trainer.ref_model is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    kept = StageTrainer(model=model, args=trainer.args, keep_reference_copy=True)
    assert kept.ref_model is not model and not any(p.requires_grad for p in kept.ref_model.parameters())
    with kept.reference() as reference:
        assert reference is kept.ref_model and not torch.is_grad_enabled()


def test_registry_is_the_only_list_of_stages():
    assert list(STAGES) == ["pt", "sft", "rm", "dpo", "kto", "grpo", "rloo", "ppo", "distill", "online_dpo"]
    assert {name: s.data_kind for name, s in STAGES.items()} == {
        "pt": "text", "sft": "supervised", "rm": "preference", "dpo": "preference", "kto": "unpaired",
        "grpo": "prompt", "rloo": "prompt", "ppo": "prompt", "distill": "prompt", "online_dpo": "prompt"}
    with pytest.raises(ConfigError, match="stage='reinforce' is not a stage"):
        parse_config({"stage": "reinforce"})


def test_stage_keys_belong_to_their_stage():
    """A DPO key with stage rm is an error that names the stage it belongs to; its own stage gets it as `method`."""
    with pytest.raises(ConfigError, match="pref_beta applies to stage dpo, not rm"):
        parse_config({"stage": "rm", "pref_beta": 0.2})
    assert parse_config({"stage": "rm", "center_rewards_coefficient": 0.01}).method.center_rewards_coefficient == 0.01
    assert parse_config({"stage": "sft"}).method is None


def test_help_keys_are_grouped_with_a_group_per_stage():
    groups = all_keys()
    assert "lora_rank" in groups["finetuning"]
    assert "padding_free" in groups["training"] and "learning_rate" in groups["training (transformers)"]
    assert set(groups["stage rm"]) == {"center_rewards_coefficient", "disable_dropout"}
    # Keys shared with an earlier stage's group (rm's `disable_dropout`) are listed there only.
    assert set(groups["stage dpo"]) == {"pref_beta", "pref_loss", "loss_weights", "pref_ftx", "dpo_label_smoothing",
                                        "simpo_gamma", "discopop_tau", "f_divergence_type",
                                        "f_alpha_divergence_coef", "precompute_ref_log_probs",
                                        "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"}
    every_key = [key for keys in groups.values() for key in keys]
    assert len(every_key) == len(set(every_key))  # each key listed once


@pytest.mark.parametrize("stage, trl_config", [("dpo", "DPOConfig"), ("kto", "KTOConfig"), ("rm", "RewardConfig")])
def test_disable_dropout_has_trls_default_and_zeroes_lora_dropout(stage, trl_config, tiny_model_dir, tmp_path):
    """TRL's `disable_dropout` (true for DPO, KTO and reward models): every dropout of the policy, LoRA's included,
    is 0 once the trainer is built, and the full fine-tuning reference copy is taken after; false keeps it."""
    import trl
    from peft import LoraConfig, get_peft_model

    from alignkit.stages.base import zero_dropout

    theirs = getattr(trl, trl_config)(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True)
    ours = parse_config({"stage": stage}).method
    assert ours.disable_dropout is theirs.disable_dropout is True
    assert parse_config({"stage": stage, "disable_dropout": False}).method.disable_dropout is False

    def lora_model():
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj"]))

    def dropouts(model):
        return {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    assert dropouts(StageTrainer(model=lora_model(), args=args, disable_dropout=True).model) == {0.0}
    assert 0.1 in dropouts(StageTrainer(model=lora_model(), args=args).model)
    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    full.add_module("extra_dropout", torch.nn.Dropout(0.2))  # the tiny Llama applies its dropout functionally
    assert dropouts(full) == {0.2}
    kept = StageTrainer(model=full, args=args, disable_dropout=True, keep_reference_copy=True)
    assert dropouts(kept.model) == dropouts(kept.ref_model) == {0.0}
    zero_dropout(full)  # idempotent
    assert dropouts(full) == {0.0}
