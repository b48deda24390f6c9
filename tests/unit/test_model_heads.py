"""The model layer's heads: last-token selection by hand, reward reading through a separate head, the
value head (init, dtype, per-token values, file format, attachment) and the stand-alone reward model."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_config
from alignkit.data.collator import pad_sequences
from alignkit.errors import ConfigError
from alignkit.model.heads import (
    VALUE_HEAD_FILE,
    ValueHead,
    attach_value_head,
    gather_last_token_scores,
    last_hidden_states,
    last_token_index,
    load_value_head,
    save_value_head,
    token_values,
    values_from_hidden,
)
from alignkit.model.loader import find_linear_modules, load_model
from alignkit.rewards.reward_model import load_reward_model
from alignkit.rewards.scoring import head_rewards, sequence_rewards

PAD = 2
ROWS = [[5, 17, 40, 2, 9], [7, 8], [30, 31, 32, 33, 34, 35, 36]]


def _pad(rows, side):
    """[N, L] ids and attention mask, padded on `side` with the pad id (which is also a real token here)."""
    return pad_sequences(rows, PAD, side), pad_sequences([[1] * len(row) for row in rows], 0, side)


def test_last_token_index_right_left_and_no_padding():
    """Right padding [1,1,1,0] -> 2; left padding [0,1,1,1] -> 3; none [1,1,1,1] -> 3; [1,0,0,0] -> 0."""
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 3, 3, 0]


def test_gather_last_token_scores_ignores_token_ids():
    """Scores are 10*row + position; the picks are the rows' last real positions 2, 3, 3.

    row 0 (right-padded, last real 2): 0 + 2 = 2; row 1 (unpadded): 10 + 3 = 13;
    row 2 (left-padded [0, 0, 1, 1], last real 3): 20 + 3 = 23.
    No token id is looked at, so a real final eos that equals the pad id is still the one scored.
    """
    scores = torch.tensor([[0.0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]]).unsqueeze(-1)  # [N, L, 1]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]])
    assert gather_last_token_scores(scores, mask).tolist() == [2.0, 13.0, 23.0]



# ---------------------------------------------------------------------------------------------------
# Rewards through a separate head
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reward_model(tiny_model_dir):
    torch.manual_seed(0)  # the fresh score head is drawn at random
    config = tiny_config(tiny_model_dir)
    return load_model(config.model, config.finetuning, is_trainable=False, head="reward")


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("padding_free", [False, True])
def test_head_rewards_equal_the_models_own_score_head(reward_model, side, padding_free):
    """The decoder without its head, then `score` at the last real token = the model's own forward."""
    ids, mask = _pad(ROWS, side)
    with torch.no_grad():
        expected = sequence_rewards(reward_model, ids, mask)
        got = head_rewards(reward_model, reward_model.score, ids, mask, padding_free=padding_free)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert expected.std() > 1e-3


def test_last_hidden_states_skips_the_output_head(reward_model):
    ids, mask = _pad(ROWS, "right")
    calls = []
    handle = reward_model.score.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            hidden, flat = last_hidden_states(reward_model, ids, mask)
            flat_hidden, flat_batch = last_hidden_states(reward_model, ids, mask, padding_free=True)
    finally:
        handle.remove()
    assert calls == [] and flat is None
    assert hidden.shape == (3, 7, 64) and flat_hidden.shape == (1, sum(map(len, ROWS)), 64)
    torch.testing.assert_close(flat_hidden[0], hidden[mask.bool()], atol=1e-5, rtol=0)
    assert flat_batch.lengths.tolist() == [5, 2, 7]


# ---------------------------------------------------------------------------------------------------
# Value head
# ---------------------------------------------------------------------------------------------------


def test_value_head_starts_at_zero_in_float32():
    head = ValueHead(4)
    assert head.weight.dtype == head.bias.dtype == torch.float32
    assert not head.weight.any() and not head.bias.any()
    hidden = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    values = head(hidden)
    assert values.shape == (2, 3) and values.dtype == torch.float32 and not values.any()


def test_values_from_hidden_by_hand():
    """w = (1, 2), b = 0.5; hidden rows (1, 0), (0, 1), (2, 2) -> 1.5, 2.5, 6.5.

    Padded (left, mask 0 1 1): [0, 2.5, 6.5]. Flat (one row of the two real tokens, from the same mask):
    values 2.5, 6.5 scattered back to their padded positions: [0, 2.5, 6.5].
    """
    from alignkit.model.padding_free import flatten_padded

    head = ValueHead(2)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 2.0]]))
        head.bias.fill_(0.5)
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]])
    mask = torch.tensor([[0, 1, 1]])
    assert values_from_hidden(head, hidden, mask).tolist() == [[0.0, 2.5, 6.5]]
    flat = flatten_padded(torch.tensor([[9, 5, 6]]), mask)
    assert values_from_hidden(head, hidden[:, 1:], mask, flat).tolist() == [[0.0, 2.5, 6.5]]


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_values_padded_and_padding_free_equal_each_row_alone(tiny_model_dir, side):
    config = tiny_config(tiny_model_dir)
    policy = load_model(config.model, config.finetuning, is_trainable=True)
    policy.eval()
    head = attach_value_head(policy)
    torch.manual_seed(0)
    with torch.no_grad():
        head.weight.normal_()
        head.bias.fill_(0.25)
    ids, mask = _pad(ROWS, side)
    with torch.no_grad():
        padded = token_values(policy, head, ids, mask)
        flat = token_values(policy, head, ids, mask, padding_free=True)
        for i, row in enumerate(ROWS):
            alone = token_values(policy, head, torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))[0]
            torch.testing.assert_close(padded[i][mask[i].bool()], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(flat, padded, atol=1e-5, rtol=0)
    assert not padded[mask == 0].any() and not flat[mask == 0].any()
    assert padded.dtype == torch.float32 and padded[mask.bool()].std() > 1e-3


def test_value_head_file_round_trip_and_format(tmp_path):
    from safetensors import safe_open

    head = ValueHead(8)
    with torch.no_grad():
        head.weight.copy_(torch.arange(8.0).unsqueeze(0))
        head.bias.fill_(-1.5)
    path = save_value_head(head, tmp_path)
    assert path == tmp_path / VALUE_HEAD_FILE
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["bias", "weight"]
        assert f.metadata() == {"format": "pt", "hidden_size": "8"}
        assert f.get_tensor("weight").shape == (1, 8) and f.get_tensor("bias").dtype == torch.float32
    loaded = load_value_head(tmp_path, hidden_size=8)
    assert torch.equal(loaded.weight, head.weight) and torch.equal(loaded.bias, head.bias)
    with pytest.raises(ValueError, match="hidden size 8, the model 64"):
        load_value_head(tmp_path, hidden_size=64)
    with pytest.raises(FileNotFoundError, match="value_head.safetensors does not exist"):
        load_value_head(tmp_path / "elsewhere")


def test_attached_value_head_trains_and_is_never_a_lora_target(tiny_model_dir):
    """`v_head` (in OUTPUT_HEADS) is what `attach_value_head` builds: on the LoRA policy it trains beside the
    adapter, and a critic adapter added afterwards with `lora_target: all` leaves it alone."""
    from peft import LoraConfig

    config = tiny_config(tiny_model_dir)
    policy = load_model(config.model, config.finetuning, is_trainable=True)
    head = attach_value_head(policy)
    assert policy.get_base_model().v_head is head
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert {"base_model.model.v_head.weight", "base_model.model.v_head.bias"} <= trainable

    targets = find_linear_modules(policy.get_base_model())
    assert "v_head" not in targets and "q_proj" in targets
    policy.add_adapter("critic", LoraConfig(r=4, target_modules=targets))
    assert not any("v_head" in n and "lora_" in n for n, _ in policy.named_parameters())
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    with pytest.raises(ValueError, match="hidden size 8, the model 64"):
        attach_value_head(policy, ValueHead(8))


# ---------------------------------------------------------------------------------------------------
# A reward model on its own (reward_model_type: full, alignkit score)
# ---------------------------------------------------------------------------------------------------


def test_load_reward_model_from_lora_and_full_dirs(tiny_model_dir, tmp_path, save_perturbed_adapter):
    ids, mask = _pad(ROWS, "right")
    rm_dir = tmp_path / "rm"
    trained = save_perturbed_adapter(tiny_model_dir, rm_dir, head="reward")
    with torch.no_grad():
        expected = sequence_rewards(trained, ids, mask)

    from_lora = load_reward_model(rm_dir)
    assert not from_lora.training and not any(p.requires_grad for p in from_lora.parameters())
    with torch.no_grad():
        torch.testing.assert_close(sequence_rewards(from_lora, ids, mask), expected, atol=1e-5, rtol=0)

    full_dir = tmp_path / "exported"
    from_lora.save_pretrained(full_dir)
    from_full = load_reward_model(full_dir, like=tiny_config(tiny_model_dir, infer_dtype="float32").model)
    assert type(from_full).__name__ == "LlamaForSequenceClassification"
    with torch.no_grad():
        torch.testing.assert_close(sequence_rewards(from_full, ids, mask), expected, atol=1e-5, rtol=0)

    save_perturbed_adapter(tiny_model_dir, tmp_path / "sft")
    with pytest.raises(ConfigError, match="without a score head"):
        load_reward_model(tmp_path / "sft")
    with pytest.raises(ConfigError, match="is not a directory"):
        load_reward_model(tmp_path / "nowhere")
