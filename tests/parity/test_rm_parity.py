"""Parity with TRL 1.16 `RewardTrainer.compute_loss`: same tiny model, same pairs, same tokens.

The sequences are what TRL builds for conversational data (`apply_chat_template` of the whole chat, which
ends with ChatML's newline after `<|im_end|>`), so transformers' pooling at the last non-pad token -- what
TRL uses -- and our last-real-token gather pick the same position and the numbers must agree.
"""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, EvalPrediction

from alignkit.config.parse import parse_config
from alignkit.data import PairwiseCollator
from alignkit.stages.rm import RewardTrainer, compute_reward_eval_metrics

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.parity

PAIRS = [
    ("What is the capital of France?", "The capital of France is Paris.", "Tokyo.", 0.5),
    ("What is 12 plus 7?", "19", "12 plus 7 is 27, I think.", 0.0),
    ("Name a colour.", "green", "apple", 1.0),
    ("Why is the sky blue?", "Sunlight scatters off air molecules.", "It is not.", -0.5),
]


def _chat_ids(tokenizer, prompt: str, reply: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    return list(tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"])


@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_loss_and_accuracy_match_trl(tmp_path, tiny_model_dir, tiny_tokenizer, with_margin, center):
    from trl import RewardConfig
    from trl import RewardTrainer as TRLRewardTrainer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = tiny_tokenizer.pad_token_id
    with torch.no_grad():  # a non-trivial head so rewards differ clearly between sequences
        model.score.weight.normal_(std=1.0)
    ours_model = copy.deepcopy(model)

    trl_rows, our_rows = [], []
    for prompt, chosen, rejected, margin in PAIRS:
        chosen_ids, rejected_ids = _chat_ids(tiny_tokenizer, prompt, chosen), _chat_ids(tiny_tokenizer, prompt, rejected)
        assert chosen_ids[-1] != tiny_tokenizer.pad_token_id  # ChatML's trailing newline: pooling positions agree
        trl_row = {"chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
        our_row = {}
        for side, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
            our_row.update({f"{side}_input_ids": ids, f"{side}_attention_mask": [1] * len(ids), f"{side}_labels": ids})
        if with_margin:
            trl_row["margin"] = our_row["margin"] = margin
        trl_rows.append(trl_row)
        our_rows.append(our_row)

    trl_args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to="none", bf16=False, use_cpu=True,
                            center_rewards_coefficient=center, max_length=None)
    trl_trainer = TRLRewardTrainer(model=model, args=trl_args, train_dataset=Dataset.from_list(trl_rows),
                                   processing_class=tiny_tokenizer)
    trl_batch = trl_trainer.data_collator(trl_rows)
    model.train()
    with torch.no_grad():
        trl_loss = trl_trainer.compute_loss(model, trl_batch).item()
    trl_accuracy = trl_trainer._metrics["train"]["accuracy"][-1]
    trl_margin = trl_trainer._metrics["train"]["margin"][-1]

    config = parse_config({"stage": "rm", "output_dir": str(tmp_path / "ours"), "center_rewards_coefficient": center})
    ours = RewardTrainer(model=ours_model, args=config.training, data_collator=PairwiseCollator(tiny_tokenizer),
                         train_dataset=Dataset.from_list(our_rows), processing_class=tiny_tokenizer,
                         center_rewards_coefficient=config.method.center_rewards_coefficient)
    our_batch = ours.data_collator(our_rows)
    torch.testing.assert_close(our_batch["input_ids"], trl_batch["input_ids"])  # same layout: chosen rows first
    ours_model.train()
    with torch.no_grad():
        our_loss = ours.compute_loss(ours_model, our_batch).item()
        loss, logits, _ = ours.prediction_step(ours_model, our_batch, prediction_loss_only=False)
    our_metrics = compute_reward_eval_metrics(EvalPrediction(predictions=logits.numpy(), label_ids=None))

    assert our_loss == pytest.approx(trl_loss, abs=1e-5)
    assert loss.item() == pytest.approx(trl_loss, abs=1e-5)
    assert our_metrics["accuracy"] == pytest.approx(trl_accuracy, abs=1e-6)
    assert our_metrics["rewards/margins"] == pytest.approx(trl_margin, abs=1e-5)
    assert 0 < trl_accuracy < 1, "pairs should be ranked both ways so accuracy is informative"
