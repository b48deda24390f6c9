"""`sequence_rewards` on a tiny sequence-classification model: padding-safe, PEFT-safe, and equal to what
plain transformers gives for one unpadded sequence."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from alignkit.model.heads import find_score_head
from alignkit.rewards.scoring import sequence_rewards

PAD = 2  # the tiny tokenizer's pad == eos == <|im_end|>


@pytest.fixture(scope="module")
def reward_model(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = PAD
    return model.eval()


def _hf_score(model, ids: list[int]) -> float:
    """What a plain-transformers user gets for one unpadded sequence."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def _pad(rows: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(map(len, rows))
    ids, mask = [], []
    for row in rows:
        fill = [PAD] * (length - len(row))
        ones, zeros = [1] * len(row), [0] * len(fill)
        ids.append(row + fill if side == "right" else fill + row)
        mask.append(ones + zeros if side == "right" else zeros + ones)
    return torch.tensor(ids), torch.tensor(mask)


# Sequences ending in a non-pad token, like a ChatML turn ("...<|im_end|>\n").
ROWS = [[5, 17, 40, 2, 9], [7, 8], [30, 31, 32, 33, 34, 35, 36]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_unpadded_plain_transformers(reward_model, side):
    ids, mask = _pad(ROWS, side)
    with torch.no_grad():
        ours = sequence_rewards(reward_model, ids, mask)
    expected = torch.tensor([_hf_score(reward_model, row) for row in ROWS])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_sequence_ending_in_eos_is_scored_at_the_eos(reward_model):
    """With pad == eos, HF pools a sequence ending in eos at the token *before* it; we take the eos."""
    row = [5, 17, 40, 9, PAD]
    ids, mask = _pad([row, [7, 8]], "right")
    with torch.no_grad():
        ours = sequence_rewards(reward_model, ids, mask)[0].item()
        per_token = reward_model.score(reward_model.model(input_ids=torch.tensor([row])).last_hidden_state)[0, :, 0]
    assert ours == pytest.approx(per_token[-1].item(), abs=1e-5)
    assert _hf_score(reward_model, row) == pytest.approx(per_token[-2].item(), abs=1e-5)  # HF's choice
    assert abs(per_token[-1].item() - per_token[-2].item()) > 1e-4  # so the test can tell them apart


def test_through_peft_wrapper_with_trained_head(tiny_model_dir):
    """LoRA + `score` in modules_to_save: the hook sees the adapter's head copy, which we then change."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    base.config.pad_token_id = PAD
    model = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, target_modules="all-linear"))
    head = find_score_head(model)
    with torch.no_grad():
        head.modules_to_save["default"].weight.add_(1.0)  # make the adapter's head differ from the base's
    model.eval()
    ids, mask = _pad(ROWS, "right")
    with torch.no_grad():
        ours = sequence_rewards(model, ids, mask)
        expected = torch.tensor([model(input_ids=torch.tensor([row])).logits[0, 0].item() for row in ROWS])
        with model.disable_adapter():
            base_scores = sequence_rewards(model, ids, mask)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, base_scores, atol=1e-3)


def test_gradients_flow_to_head_and_adapter(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", r=4, target_modules="all-linear"))
    ids, mask = _pad(ROWS, "right")
    sequence_rewards(model, ids, mask).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert any("score" in n and g is not None and g.abs().sum() > 0 for n, g in grads.items())
    # lora_B: lora_A gets no gradient at init because B starts at zero.
    assert any("lora_B" in n and g is not None and g.abs().sum() > 0 for n, g in grads.items())


def test_causal_lm_is_rejected_with_a_clear_error(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(TypeError, match="no `score` head.*num_labels=1"):
        sequence_rewards(model, torch.tensor([[5, 6]]), torch.tensor([[1, 1]]))
