"""KTO's pure pieces: the loss and KL estimate (hand-computed), the mismatched-row rotation, unpaired data
conversion from LLaMA-Factory's kto_tag rows and TRL's prompt/completion/label rows, and their errors."""

from __future__ import annotations

import csv
import json
import logging

import pytest
import torch
from datasets import Dataset

from alignkit.config.parse import parse_config
from alignkit.data import UnpairedCollator, get_dataset
from alignkit.data.formats import DatasetAttr, convert_row
from alignkit.errors import DataError
from alignkit.errors import RowError
from alignkit.errors import ConfigError
from alignkit.stages.kto import kl_estimate, kto_loss, rotated_partners, with_mismatched_rows
from tests.helpers import tiny_config


# ---------------------------------------------------------------------------------------------- loss
def test_kto_loss_by_hand():
    """beta = 2, log-ratios h = [0.5, -0.5, 0] (policy - reference), desirable [T, F, T], z0 = 0.5,
    w_d = 2, w_u = 0.5:
    row 0 (desirable):   beta * (h - z0) = 2 * 0     = 0  -> 2   * (1 - sigmoid(0))  = 2   * 0.5       = 1.0
    row 1 (undesirable): beta * (z0 - h) = 2 * 1     = 2  -> 0.5 * (1 - sigmoid(2))  = 0.5 * 0.1192029 = 0.0596015
    row 2 (desirable):   beta * (h - z0) = 2 * -0.5  = -1 -> 2   * (1 - sigmoid(-1)) = 2   * 0.7310586 = 1.4621172
    rewards = beta * h = [1, -1, 0]."""
    policy, reference = torch.tensor([-1.5, -2.5, -2.0]), torch.tensor([-2.0, -2.0, -2.0])
    desirable = torch.tensor([True, False, True])
    losses, rewards = kto_loss(policy, reference, desirable, torch.tensor(0.5), beta=2.0, desirable_weight=2.0,
                               undesirable_weight=0.5)
    assert losses.tolist() == pytest.approx([1.0, 0.0596015, 1.4621172], abs=1e-6)
    assert rewards.tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_apo_zero_unpaired_loss_by_hand():
    """Same inputs, loss_type apo_zero_unpaired (z0 unused), unit weights:
    row 0: 1 - sigmoid(2 * 0.5)  = 1 - 0.7310586 = 0.2689414
    row 1: sigmoid(2 * -0.5)     = 0.2689414
    row 2: 1 - sigmoid(2 * 0)    = 0.5."""
    policy, reference = torch.tensor([-1.5, -2.5, -2.0]), torch.tensor([-2.0, -2.0, -2.0])
    losses, _ = kto_loss(policy, reference, torch.tensor([True, False, True]), 123.0, beta=2.0,
                         loss_type="apo_zero_unpaired")
    assert losses.tolist() == pytest.approx([0.2689414, 0.2689414, 0.5], abs=1e-6)


def test_kto_loss_gradient_reaches_only_the_policy_and_pushes_the_right_way():
    policy = torch.tensor([-2.0, -2.0], requires_grad=True)
    losses, _ = kto_loss(policy, torch.tensor([-2.0, -2.0]), torch.tensor([True, False]), 0.0, beta=0.1)
    losses.sum().backward()
    assert policy.grad[0] < 0 < policy.grad[1]  # raise the desirable reply, lower the undesirable one


def test_kl_estimate_by_hand():
    """diffs [-3 - -4, -5 - -5] = [1, 0] -> mean 0.5; diffs [-1, -2] -> mean -1.5 -> clamped to 0."""
    assert kl_estimate(torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -5.0])).item() == pytest.approx(0.5)
    assert kl_estimate(torch.tensor([-3.0, -5.0]), torch.tensor([-2.0, -3.0])).item() == 0.0
    x = torch.tensor([-1.0, -3.0], requires_grad=True)
    assert not kl_estimate(x, torch.zeros(2)).requires_grad


def test_kto_arguments_are_checked():
    with pytest.raises(ConfigError, match="pref_beta=0.0 must be > 0"):
        parse_config({"stage": "kto", "pref_beta": 0})
    with pytest.raises(ConfigError, match="kto_rejected_weight=-1.0 must be > 0"):
        parse_config({"stage": "kto", "kto_rejected_weight": -1})
    with pytest.raises(ConfigError, match="kto_chosen_weight applies to stage kto, not dpo"):
        parse_config({"stage": "dpo", "kto_chosen_weight": 0.5})
    method = parse_config({"stage": "kto"}).method
    # TRL 1.16 KTOConfig's and LLaMA-Factory's defaults
    assert (method.pref_beta, method.kto_chosen_weight, method.kto_rejected_weight, method.pref_ftx,
            method.loss_type) == (0.1, 1.0, 1.0, 0.0, "kto")


# ---------------------------------------------------------------------------------------------- KL rows
def test_rotated_partners_rotate_within_groups():
    """TRL's rotation: (x1, yn), (x2, y1), ... within each group; a group of one keeps its own reply."""
    assert rotated_partners(5, 2) == [1, 0, 3, 2, 4]
    assert rotated_partners(4, 4) == [3, 0, 1, 2]
    assert rotated_partners(3, 3) == rotated_partners(3, 10)


def test_mismatched_rows_pair_each_prompt_with_a_neighbours_reply():
    rows = Dataset.from_dict({"input_ids": [[1, 2, 10], [3, 20, 21], [4, 5, 6, 30]],
                              "labels": [[-100, -100, 10], [-100, 20, 21], [-100, -100, -100, 30]],
                              "desirable": [True, False, True]})
    out = with_mismatched_rows(rows, group_size=3)
    assert out["kl_input_ids"] == [[1, 2, 30], [3, 10], [4, 5, 6, 20, 21]]
    assert out["kl_labels"] == [[-100, -100, 30], [-100, 10], [-100, -100, -100, 20, 21]]
    # One example per device: the whole dataset is the group (LLaMA-Factory's neighbour pairing).
    assert with_mismatched_rows(rows, group_size=1)["kl_input_ids"] == out["kl_input_ids"]
    # A prompt and a borrowed reply longer than max_length are cut as cutoff_len cuts a row (`infer_seqlen`:
    # prompt 3 and reply 2 in 4 tokens -> reply int(4 * 2 / 5) = 1 token, prompt the other 3).
    cut = with_mismatched_rows(rows, 3, max_length=4)
    assert (cut["kl_input_ids"][2], cut["kl_labels"][2]) == ([4, 5, 6, 20], [-100, -100, -100, 20])


def test_unpaired_collator_pads_both_row_sets_and_the_flags(tiny_tokenizer):
    features = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7], "desirable": True,
                 "kl_input_ids": [5, 9], "kl_labels": [-100, 9]},
                {"input_ids": [8, 9], "attention_mask": [1, 1], "labels": [-100, 9], "desirable": False,
                 "kl_input_ids": [8, 6, 7], "kl_labels": [-100, 6, 7]}]
    batch = UnpairedCollator(tiny_tokenizer)(features)
    pad = tiny_tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, pad]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    assert batch["kl_input_ids"].tolist() == [[5, 9, pad], [8, 6, 7]]
    assert batch["kl_attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["kl_labels"].tolist() == [[-100, 9, -100], [-100, 6, 7]]
    assert batch["desirable"].tolist() == [True, False]


# ---------------------------------------------------------------------------------------------- data
LF_ATTR = DatasetAttr(name="kto", load_from="file", path="", formatting="sharegpt",
                      columns={"messages": "messages", "kto_tag": "label"},
                      tags={"role_tag": "role", "content_tag": "content", "user_tag": "user",
                            "assistant_tag": "assistant"})


def test_llamafactory_sharegpt_row_with_kto_tag():
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "green"}],
           "label": False}
    example = convert_row(row, LF_ATTR, "sharegpt", "unpaired")
    assert example["prompt"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                 {"role": "user", "content": "Name a colour."}]
    assert (example["completion"], example["desirable"]) == ("green", False)


def test_alpaca_row_with_mapped_kto_tag_and_csv_text_flags():
    attr = DatasetAttr(name="a", load_from="file", path="", formatting="alpaca",
                       columns={"prompt": "prompt", "response": "completion", "kto_tag": "good"})
    for flag, expected in ((True, True), ("false", False), ("TRUE", True), (0, False), (1, True)):
        example = convert_row({"prompt": "Hi", "completion": "Hello!", "good": flag}, attr, "alpaca", "unpaired")
        assert example["desirable"] is expected, flag
        assert example["prompt"] == [{"role": "user", "content": "Hi"}] and example["completion"] == "Hello!"
    with pytest.raises(RowError, match=r"good.*expected true \(desirable\) or false"):
        convert_row({"prompt": "Hi", "completion": "Hello!", "good": "maybe"}, attr, "alpaca", "unpaired")


def test_trl_unpaired_rows_text_and_conversational():
    text = convert_row({"prompt": "Hi", "completion": "Hello!", "label": True}, DatasetAttr("t", "file", ""), "trl",
                       "unpaired")
    chat = convert_row({"prompt": [{"role": "user", "content": "Hi"}],
                        "completion": [{"role": "assistant", "content": "Hello!"}], "label": True},
                       DatasetAttr("t", "file", ""), "trl", "unpaired")
    assert text == chat == {"prompt": [{"role": "user", "content": "Hi"}], "tools": None, "desirable": True,
                            "completion": "Hello!"}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _config(tmp_path, dataset, **keys):
    return tiny_config(**{"stage": "kto", "dataset": dataset, "dataset_dir": str(tmp_path), "cutoff_len": 64, **keys})


def test_get_dataset_tokenises_unpaired_rows(tmp_path, tiny_tokenizer):
    data = _write(tmp_path / "kto.jsonl", [{"prompt": "Hi", "completion": "Hello!", "label": True},
                                          {"prompt": "Name a colour.", "completion": "apple", "label": False}])
    out = get_dataset(_config(tmp_path, data), tiny_tokenizer, "unpaired")["train_dataset"]
    assert out["desirable"] == [True, False]
    first = out[0]
    reply = [t for t in first["labels"] if t != -100]
    assert tiny_tokenizer.decode(reply).startswith("Hello!")
    assert first["input_ids"][-len(reply):] == reply and len(first["input_ids"]) == len(first["labels"])


def test_missing_flag_column_names_the_file_and_the_fix(tmp_path, tiny_tokenizer):
    data = _write(tmp_path / "sft.jsonl", [{"prompt": "Hi", "completion": "Hello!"}])
    with pytest.raises(DataError, match=r"sft.jsonl: stage kto needs a desirable/undesirable flag.*`label`.*kto_tag"):
        get_dataset(_config(tmp_path, data), tiny_tokenizer, "unpaired")


def test_bad_flag_names_file_row_and_field(tmp_path, tiny_tokenizer):
    data = _write(tmp_path / "kto.jsonl", [{"prompt": "Hi", "completion": "Hello!", "label": True},
                                          {"prompt": "Yo", "completion": "Hey", "label": "good"}])
    with pytest.raises(DataError, match=r"kto.jsonl, line 2: .*label.*expected true \(desirable\).*'good'"):
        get_dataset(_config(tmp_path, data), tiny_tokenizer, "unpaired")


def test_registry_kto_tag_and_csv_flags(tmp_path, tiny_tokenizer):
    with (tmp_path / "kto.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["instruction", "output", "tag"])
        writer.writeheader()
        writer.writerows([{"instruction": "Hi", "output": "Hello!", "tag": "true"},
                          {"instruction": "Yo", "output": "nonsense", "tag": "false"}])
    (tmp_path / "dataset_info.json").write_text(json.dumps({"k": {"file_name": "kto.csv", "columns": {
        "prompt": "instruction", "response": "output", "kto_tag": "tag"}}}))
    out = get_dataset(_config(tmp_path, "k"), tiny_tokenizer, "unpaired")["train_dataset"]
    assert out["desirable"] == [True, False]


def test_only_one_kind_of_reply_is_warned_about(tiny_model_dir, tiny_tokenizer, tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    from alignkit.stages.kto import KTOTrainer

    rows = Dataset.from_dict({"input_ids": [[1, 2, 3]] * 2, "labels": [[-100, 2, 3]] * 2, "desirable": [True] * 2})
    config = parse_config({"stage": "kto", "output_dir": str(tmp_path), "use_cpu": True,
                           "per_device_train_batch_size": 2})
    with caplog.at_level(logging.WARNING, logger="alignkit.stages.kto"):
        KTOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=config.training,
                   kto_args=config.method, data_collator=UnpairedCollator(tiny_tokenizer), train_dataset=rows)
    assert "only desirable replies" in caplog.text
