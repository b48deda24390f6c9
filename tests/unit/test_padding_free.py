"""Padding-free forward: the flatten/unflatten helpers by hand, then SFT, RM and DPO equal to the padded path."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from alignkit.config import TrainingArguments
from alignkit.config.parse import parse_config
from alignkit.model.logprobs import forward_sequence_logps, forward_token_logps
from alignkit.model.padding_free import (
    first_token_unlabelled,
    flatten_padded,
    last_token_per_sequence,
    next_token_targets,
    row_layout,
    row_token_bound,
    segment_sum,
    unflatten_to_padded,
)
from alignkit.rewards.scoring import sequence_rewards
from alignkit.stages.dpo import DPOTrainer
from alignkit.stages.sft import SFTTrainer

PAD = 2
X = -100


# ---------------------------------------------------------------------------------------------------
# The pure helpers, by hand
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["right", "left"])
def test_flatten_padded_hand_computed(side):
    """Rows [11, 12, 13] and [21, 22] padded to 3 (pad id 2 is also a real token of row 1, as eos == pad).

    Flat row: 11 12 13 | 21 2 -> T = 5; positions restart at the boundary: 0 1 2 | 0 1;
    sequence_index 0 0 0 | 1 1; lengths [3, 2]. Labels travel with their tokens.
    """
    if side == "right":
        input_ids = torch.tensor([[11, 12, 13], [21, PAD, PAD]])
        attention_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        labels = torch.tensor([[X, 12, 13], [X, PAD, X]])
    else:
        input_ids = torch.tensor([[11, 12, 13], [PAD, 21, PAD]])
        attention_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
        labels = torch.tensor([[X, 12, 13], [X, X, PAD]])
    flat = flatten_padded(input_ids, attention_mask, labels, max_row_tokens=None)
    assert flat.input_ids.tolist() == [[11, 12, 13, 21, PAD]]
    assert flat.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert flat.labels.tolist() == [[X, 12, 13, X, PAD]]
    assert flat.sequence_index.tolist() == [0, 0, 0, 1, 1]
    assert flat.lengths.tolist() == [3, 2]
    assert flat.real.tolist() == attention_mask.bool().tolist()
    assert flat.slots.tolist() == [0, 1, 2, 3, 4]
    assert flatten_padded(input_ids, attention_mask, max_row_tokens=None).labels is None
    # Bounded by the longest sequence (3, the default): 3 | 2 + one padding slot.
    rows = flatten_padded(input_ids, attention_mask, labels)
    assert rows.input_ids.tolist() == [[11, 12, 13], [21, PAD, 0]]
    assert rows.position_ids.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert rows.labels.tolist() == [[X, 12, 13], [X, PAD, X]] if side == "right" else [[X, 12, 13], [X, X, X]]
    assert rows.slots.tolist() == [0, 1, 2, 3, 4]
    assert rows.sequence_index.tolist() == [0, 0, 0, 1, 1]


def test_row_layout_hand_computed():
    """lengths [3, 5, 2, 4], bound 6, best-fit decreasing.

    5 -> row 0 (1 left); 4 -> row 1 (2 left); 3 fits neither -> row 2 (3 left); 2 -> the tightest row
    with room, row 1 (0 left). Rows [5], [4, 2], [3]: row = [2, 0, 1, 1], start = [0, 0, 4, 0], width 6.
    Bound 0 (the longest, 5): 5 -> row 0; 4 -> row 1 (1 left); 3 -> row 2 (2 left); 2 -> row 2 (0 left):
    rows [5], [4], [3, 2]: row = [2, 0, 2, 1], start = [0, 0, 3, 0], width 5.
    None: one row in order of size, 5 4 3 2: row 0 for all, start = [9, 0, 12, 5], width 14.
    """
    lengths = torch.tensor([3, 5, 2, 4])
    row, start, num_rows, width = row_layout(lengths, 6)
    assert (row.tolist(), start.tolist(), num_rows, width) == ([2, 0, 1, 1], [0, 0, 4, 0], 3, 6)
    row, start, num_rows, width = row_layout(lengths, 0)
    assert (row.tolist(), start.tolist(), num_rows, width) == ([2, 0, 2, 1], [0, 0, 3, 0], 3, 5)
    row, start, num_rows, width = row_layout(lengths, None)
    assert (row.tolist(), start.tolist(), num_rows, width) == ([0, 0, 0, 0], [9, 0, 12, 5], 1, 14)


def test_packed_rows_hand_computed():
    """Sequences of 3, 5, 2, 4 tokens (ids 10s, 20s, 30s, 40s), default bound = longest = 5.

    Rows (see test_row_layout_hand_computed): [seq 1], [seq 3 + 1 padding slot], [seq 0, seq 2].
    Row padding holds id 0, label -100 and positions restarting at 0; from_rows undoes the layout.
    """
    lengths = [3, 5, 2, 4]
    input_ids = torch.zeros(4, 5, dtype=torch.long)
    attention_mask = torch.zeros(4, 5, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.arange(length) + 10 * (row + 1)
        attention_mask[row, :length] = 1
    flat = flatten_padded(input_ids, attention_mask, input_ids.masked_fill(attention_mask == 0, X))
    assert flat.input_ids.tolist() == [[20, 21, 22, 23, 24], [40, 41, 42, 43, 0], [10, 11, 12, 30, 31]]
    assert flat.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert flat.labels.tolist() == [[20, 21, 22, 23, 24], [40, 41, 42, 43, X], [10, 11, 12, 30, 31]]
    assert flat.slots.tolist() == [10, 11, 12, 0, 1, 2, 3, 4, 13, 14, 5, 6, 7, 8]
    assert flat.from_rows(flat.input_ids).tolist() == input_ids[attention_mask.bool()].tolist()
    assert flat.to_rows(flat.sequence_index, fill=-1).tolist() == [[1] * 5, [3, 3, 3, 3, -1], [0, 0, 0, 2, 2]]
    with pytest.raises(ValueError, match="packed layout"):
        flat.from_rows(torch.zeros(1, 14))


def test_row_token_bound_keeps_one_row_for_flash_and_per_sequence_attention():
    """eager: 0 (rows bounded by the longest sequence, block-diagonal mask); a flash-attention kernel: None (one row,
    whose position resets transformers turns into cu_seqlens only at batch size 1); sdpa, with transformers' gradient
    checkpointing or without: None (one row, each sequence attended alone by `per_sequence_sdpa`); sdpa with a layer
    in torch's `checkpoint_wrapper`: 0; a DDP-style `.module` unwrapped."""
    from types import SimpleNamespace

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for attention, checkpointing, wrapped, bound in [
            ("sdpa", False, False, None), ("sdpa", True, False, None), ("sdpa", False, True, 0),
            ("eager", False, False, 0), ("flash_attention_2", False, False, None),
            ("flash_attention_3", False, False, None)]:
        layer = torch.nn.Linear(1, 1)
        layer.gradient_checkpointing = checkpointing  # the flag transformers sets on the layers it checkpoints
        model = torch.nn.Sequential(checkpoint_wrapper(layer) if wrapped else layer)
        model.config = SimpleNamespace(_attn_implementation=attention)
        assert row_token_bound(model) == bound, (attention, checkpointing, wrapped)
        assert row_token_bound(SimpleNamespace(module=model)) == bound, attention


def test_activation_checkpointing_follows_transformers(tiny_model_dir):
    """`activation_checkpointing` answers what transformers' `is_activation_checkpointing` does, through a PEFT
    wrapper, as checkpointing is turned on and off after the first call."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from alignkit.model.padding_free import activation_checkpointing

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    for enable in (False, True, False, True):
        if enable:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_disable()
        assert activation_checkpointing(model) is enable is base.is_activation_checkpointing
        assert activation_checkpointing(base) is enable


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=33),
    bound=st.one_of(st.none(), st.integers(min_value=0, max_value=60)),
    left=st.booleans(),
)
def test_packed_layout_bounds_rows_and_keeps_every_token(lengths, bound, left):
    """Property: no row holds more than max(bound, longest) real tokens (None: one row); every real token
    appears exactly once, in order, each sequence whole in one row with positions 0..n-1; a sequence too long
    to share a row has one of its own; row padding is a block of its own (positions from 0, label -100)."""
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        columns = slice(width - length, width) if left else slice(0, length)
        input_ids[row, columns] = torch.arange(length) + 1000 * (row + 1)  # every token id unique
        attention_mask[row, columns] = 1
    flat = flatten_padded(input_ids, attention_mask, input_ids.clone(), max_row_tokens=bound)
    rows, row_width = flat.input_ids.shape
    capacity = sum(lengths) if bound is None else max(bound, max(lengths))
    occupied = torch.zeros(rows * row_width, dtype=torch.bool)
    occupied[flat.slots] = True
    assert flat.slots.unique().numel() == flat.slots.numel() == sum(lengths)  # nothing duplicated or lost
    assert occupied.view(rows, row_width).sum(-1).max() <= capacity
    assert row_width == occupied.view(rows, row_width).sum(-1).max()  # padded only to the widest row
    assert flat.from_rows(flat.input_ids).tolist() == input_ids[attention_mask.bool()].tolist()
    assert flat.from_rows(flat.labels).tolist() == input_ids[attention_mask.bool()].tolist()
    token_rows = flat.slots // row_width
    for sequence, length in enumerate(lengths):
        slots = flat.slots[flat.sequence_index == sequence]
        assert (slots.diff() == 1).all() and token_rows[flat.sequence_index == sequence].unique().numel() == 1
        assert flat.position_ids.view(-1)[slots].tolist() == list(range(length))
        if length + min(lengths[:sequence] + lengths[sequence + 1:], default=capacity) > capacity:
            # Too long to share a row with any other sequence (with a bound below the longest sequence the
            # rows widen to it, so a sequence longer than the bound shares only if a short one fits beside it).
            assert (token_rows == slots[0] // row_width).sum() == length  # alone in its row
    padding = ~occupied
    assert (flat.labels.view(-1)[padding] == X).all()
    padding_rows = padding.view(rows, row_width)
    for row in range(rows):
        tail = flat.position_ids[row][padding_rows[row]]
        assert tail.tolist() == list(range(tail.numel()))


def test_next_token_targets_stop_at_each_sequence_end():
    """labels 5 6 7 | 8 9 over sequences 0 0 0 | 1 1.

    Shift left by one: 6 7 8 9 -100; the last token of sequence 0 (position 2) would predict 8, the first
    token of sequence 1, so it gets -100: 6 7 -100 9 -100.
    """
    labels = torch.tensor([5, 6, 7, 8, 9])
    sequence_index = torch.tensor([0, 0, 0, 1, 1])
    assert next_token_targets(labels, sequence_index).tolist() == [6, 7, X, 9, X]


def test_first_token_unlabelled():
    """labels 5 6 7 | 8 9 | 4 over sequences 0 0 0 | 1 1 | 2: each sequence's first label -> -100.

    -100 6 7 | -100 9 | -100; shifting this by one (what a causal-LM loss does across the flat row) gives
    6 7 -100 9 -100 -, the targets of `next_token_targets`.
    """
    labels = torch.tensor([[5, 6, 7, 8, 9, 4]])
    sequence_index = torch.tensor([0, 0, 0, 1, 1, 2])
    assert first_token_unlabelled(labels, sequence_index).tolist() == [[X, 6, 7, X, 9, X]]
    assert labels.tolist() == [[5, 6, 7, 8, 9, 4]]  # a copy, the input is untouched


def test_segment_sum_and_last_token_hand_computed():
    """values 1 2 3 | 4 5 over sequences 0 0 0 | 1 1, and an empty sequence 2.

    sums: 1 + 2 + 3 = 6, 4 + 5 = 9, 0; d(sum_0 + 2 * sum_1)/d values = 1 1 1 2 2.
    Lengths [3, 2] -> last flat positions cumsum - 1 = [2, 4].
    """
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], requires_grad=True)
    sums = segment_sum(values, torch.tensor([0, 0, 0, 1, 1]), 3)
    assert sums.tolist() == [6.0, 9.0, 0.0]
    (sums[0] + 2 * sums[1]).backward()
    assert values.grad.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0]
    assert last_token_per_sequence(torch.tensor([3, 2])).tolist() == [2, 4]


def test_unflatten_to_padded_hand_computed():
    """Flat values 1 2 3 | 4 5 back into rows [*, 1, 2, 3] and [4, 5, *, *] (left, right padding), fill 0.

    The gradient of the sum of the padded tensor times [[9, 1, 1, 1], [2, 3, 9, 9]] reaches each flat
    value from its own cell: 1 1 1 2 3 (the 9s sit on padding).
    """
    real = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], requires_grad=True)
    padded = unflatten_to_padded(values, real)
    assert padded.tolist() == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 0.0, 0.0]]
    (padded * torch.tensor([[9.0, 1, 1, 1], [2, 3, 9, 9]])).sum().backward()
    assert values.grad.tolist() == [1.0, 1.0, 1.0, 2.0, 3.0]
    vectors = unflatten_to_padded(torch.arange(10.0).view(5, 2), real, fill=-1.0)
    assert vectors.shape == (2, 4, 2) and vectors[0, 0].tolist() == [-1.0, -1.0] and vectors[1, 1].tolist() == [8, 9]


# ---------------------------------------------------------------------------------------------------
# Tiny-model batches: padding-free equals padded
# ---------------------------------------------------------------------------------------------------

LENGTHS = (5, 11, 3, 8)  # different lengths, so there is padding on every row but one
PROMPTS = (2, 4, 0, 5)  # prompt tokens (-100) at the start of each row; row 2 is labelled from its first token,
# which a flat row must not predict from row 1's last token (padded, column 0 is never a target)


def padded_batch(side: str, seed: int = 0, lengths=LENGTHS, prompts=PROMPTS) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, X)
    for row, (length, prompt) in enumerate(zip(lengths, prompts)):
        tokens = torch.randint(3, 400, (length,), generator=generator)
        tokens[-1] = PAD  # a real eos == pad token at the end, as chat data has
        columns = slice(0, length) if side == "right" else slice(width - length, width)
        input_ids[row, columns] = tokens
        attention_mask[row, columns] = 1
        labels[row, columns] = torch.cat([torch.full((prompt,), X), tokens[prompt:]])
        if side == "left":
            # Left-padded, the padded forward would score a labelled first token from the padding before
            # it (padding-free rightly does not); no collator makes such rows, so keep it out of the check.
            labels[row, width - length] = X
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@pytest.fixture(scope="module")
def causal_lm(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                 init_lora_weights=False))
    return peft_model


def _logps_and_gradients(model, batch: dict[str, torch.Tensor], padding_free: bool):
    """Per-token log-probs, mask, sums, counts, and the gradients of a weighted sum of the sums."""
    model.zero_grad()
    logps, mask = forward_token_logps(model, **batch, padding_free=padding_free)
    sums, counts = forward_sequence_logps(model, **batch, padding_free=padding_free)
    (sums * torch.linspace(0.5, 1.5, sums.numel())).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logps.detach(), mask, sums.detach(), counts, grads


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_and_sequence_logps_equal_the_padded_forward(causal_lm, side):
    """Same per-token log-probs, masks, sums, counts and gradients; only labelled positions get logits."""
    batch = padded_batch(side)
    padded, flat = _logps_and_gradients(causal_lm, batch, False), _logps_and_gradients(causal_lm, batch, True)
    torch.testing.assert_close(flat[0], padded[0], atol=1e-5, rtol=0)
    assert torch.equal(flat[1], padded[1])
    torch.testing.assert_close(flat[2], padded[2], atol=1e-5, rtol=0)
    assert flat[3].tolist() == padded[3].tolist() == [n - max(p, 1) for n, p in zip(LENGTHS, PROMPTS)]
    for name, grad in padded[4].items():
        torch.testing.assert_close(flat[4][name], grad, atol=1e-5, rtol=1e-4, msg=name)

    rows_seen = []
    handle = causal_lm.lm_head.register_forward_hook(lambda _m, args, _o: rows_seen.append(args[0].shape[:-1]))
    with torch.no_grad():
        forward_sequence_logps(causal_lm, **batch, padding_free=True)
    handle.remove()
    assert rows_seen == [(1, sum(n - max(p, 1) for n, p in zip(LENGTHS, PROMPTS)))]  # one logit row per labelled token, nothing else


@pytest.mark.parametrize("side", ["right", "left"])
def test_sequence_rewards_equal_the_padded_forward(tiny_model_dir, side):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = PAD
    batch = padded_batch(side)
    padded = sequence_rewards(model, batch["input_ids"], batch["attention_mask"])
    padded.sum().backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    flat = sequence_rewards(model, batch["input_ids"], batch["attention_mask"], padding_free=True)
    flat.sum().backward()
    torch.testing.assert_close(flat, padded, atol=1e-5, rtol=0)
    assert padded.std() > 1e-3  # the rows score differently, so a misplaced gather would show
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def _sft_trainer(model, tmp_path, padding_free: bool, **keys) -> SFTTrainer:
    args = TrainingArguments(output_dir=str(tmp_path / "sft"), report_to="none", use_cpu=True,
                             remove_unused_columns=False, padding_free=padding_free, **keys)
    return SFTTrainer(model=model, args=args)


@pytest.mark.parametrize("side", ["right", "left"])
def test_sft_loss_and_gradients_equal_the_padded_loss(causal_lm, tmp_path, side):
    """Padding-free SFT loss equals the padded one, with the step's token count and without; eval logits
    come back in the padded layout for the accuracy metric."""
    batch = padded_batch(side)
    # The step's target tokens as the Trainer counts them (labels[:, 1:]), doubled as if a second
    # micro-batch followed: the loss must be divided by exactly this number in both paths.
    num_items = 2 * int((batch["labels"][:, 1:] != X).sum())
    results = {}
    for padding_free in (False, True):
        trainer = _sft_trainer(causal_lm, tmp_path, padding_free)
        causal_lm.zero_grad()
        loss = trainer.compute_loss(causal_lm, dict(batch), num_items_in_batch=torch.tensor(num_items))
        loss.backward()
        with torch.no_grad():
            eval_loss, outputs = trainer.compute_loss(causal_lm, dict(batch), return_outputs=True)
        grads = {n: p.grad.clone() for n, p in causal_lm.named_parameters()}
        results[padding_free] = (loss.detach(), eval_loss, outputs.logits, grads)
    (loss_p, eval_p, logits_p, grads_p), (loss_f, eval_f, logits_f, grads_f) = results[False], results[True]
    torch.testing.assert_close(loss_f, loss_p, atol=1e-5, rtol=0)
    torch.testing.assert_close(eval_f, eval_p, atol=1e-5, rtol=0)
    assert eval_p.item() == pytest.approx(2 * loss_p.item(), rel=1e-5)  # eval divides by its own count
    real = batch["attention_mask"].bool()
    assert logits_f.shape == logits_p.shape
    torch.testing.assert_close(logits_f[real], logits_p[real], atol=1e-4, rtol=0)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_sft_label_smoothing_padding_free_equals_transformers_label_smoother(causal_lm, tmp_path):
    """`label_smoothing_factor: 0.2`: the training loss of the padding-free step (which then keeps every logit of
    the packed row) and of the padded one equals transformers' `LabelSmoother` over the padded logits with the
    step's token count, with equal gradients; without the key the loss is the plain cross-entropy."""
    from transformers.trainer_pt_utils import LabelSmoother

    batch = padded_batch("right")
    num_items = torch.tensor(2 * int((batch["labels"][:, 1:] != X).sum()))
    with torch.no_grad():
        logits = causal_lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = LabelSmoother(epsilon=0.2)({"logits": logits}, batch["labels"], shift_labels=True,
                                      num_items_in_batch=num_items)
    grads = {}
    for padding_free in (False, True):
        trainer = _sft_trainer(causal_lm, tmp_path, padding_free, label_smoothing_factor=0.2)
        causal_lm.zero_grad()
        loss = trainer.compute_loss(causal_lm, dict(batch), num_items_in_batch=num_items)
        loss.backward()
        grads[padding_free] = {n: p.grad.clone() for n, p in causal_lm.named_parameters()}
        torch.testing.assert_close(loss.detach(), want, atol=1e-5, rtol=0)
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    plain = _sft_trainer(causal_lm, tmp_path, True).compute_loss(causal_lm, dict(batch), num_items_in_batch=num_items)
    assert abs(plain.item() - want.item()) > 1e-3


def _dpo_trainer(model, tmp_path, padding_free: bool, **keys) -> DPOTrainer:
    config = parse_config({"stage": "dpo", "output_dir": str(tmp_path / "dpo"), "use_cpu": True,
                           "padding_free": padding_free, "pref_beta": 0.5, **keys})
    return DPOTrainer(model=model, args=config.training, dpo_args=config.method)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_dpo_loss_metrics_and_gradients_equal_the_padded_path(causal_lm, tmp_path, side, finetuning):
    """Sigmoid DPO on 2 pairs (rows 0-1 chosen, 2-3 rejected) with a reference that differs from the policy
    (LoRA: the adapter, initialised non-zero, is disabled for it; full: a copy made before the policy's
    weights are perturbed): same loss, rewards, log-probs and gradients padded or padding-free."""
    batch = padded_batch(side, seed=3)
    results = {}
    for padding_free in (False, True):
        if finetuning == "lora":
            model = _lora(causal_lm)
            trainer = _dpo_trainer(model, tmp_path, padding_free)
        else:
            model = copy.deepcopy(causal_lm)
            trainer = _dpo_trainer(model, tmp_path, padding_free, finetuning_type="full")
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.02 * torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
        model.train()
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[padding_free] = (loss.detach(), metrics, grads)
    (loss_p, metrics_p, grads_p), (loss_f, metrics_f, grads_f) = results[False], results[True]
    torch.testing.assert_close(loss_f, loss_p, atol=1e-5, rtol=0)
    assert abs(metrics_p["rewards/margins"]) > 1e-3  # the reference differs from the policy
    assert metrics_f.keys() == metrics_p.keys()
    for key, value in metrics_p.items():
        assert metrics_f[key] == pytest.approx(value, abs=1e-5), key
    assert grads_f.keys() == grads_p.keys() and grads_p
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, atol=1e-5, rtol=1e-4, msg=name)


# ---------------------------------------------------------------------------------------------------
# Batch 32, long and short sequences mixed: several packed rows, equal to the padded path
# ---------------------------------------------------------------------------------------------------

_MIX = torch.Generator().manual_seed(7)
MIXED_LENGTHS = tuple(torch.randint(40, 65, (6,), generator=_MIX).tolist()
                      + torch.randint(3, 16, (26,), generator=_MIX).tolist())
MIXED_PROMPTS = tuple(min(int(p), n - 2) for p, n in zip(torch.randint(0, 6, (32,), generator=_MIX), MIXED_LENGTHS))


def mixed_batch(side: str) -> dict[str, torch.Tensor]:
    return padded_batch(side, seed=11, lengths=MIXED_LENGTHS, prompts=MIXED_PROMPTS)


def test_mixed_batch_packs_into_several_shared_rows():
    """The batch-32 mix really is packed: rows no wider than the longest sequence, several of them, and
    fewer rows than sequences (short ones share), so the tests below compare a multi-row layout."""
    batch = mixed_batch("right")
    flat = flatten_padded(batch["input_ids"], batch["attention_mask"])
    rows, width = flat.input_ids.shape
    assert width == max(MIXED_LENGTHS) and 1 < rows < len(MIXED_LENGTHS)


@pytest.mark.parametrize(("side", "attention"), [("right", "sdpa"), ("left", "sdpa"), ("right", "eager")])
def test_mixed_batch_logps_and_gradients_equal_the_padded_forward(causal_lm, tiny_model_dir, side, attention):
    """DPO's log-probs (per token and summed) and their gradients at batch 32, padded vs packed rows, with
    the sdpa and the eager attention (both build each row's block-diagonal mask from the position resets)."""
    if attention != "sdpa":
        causal_lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attention).eval()
    assert causal_lm.config._attn_implementation == attention
    batch = mixed_batch(side)
    padded, flat = _logps_and_gradients(causal_lm, batch, False), _logps_and_gradients(causal_lm, batch, True)
    torch.testing.assert_close(flat[0], padded[0], atol=1e-5, rtol=0)
    assert torch.equal(flat[1], padded[1])
    # Sums of ~60 log-probs of about -6 each: float32 summation order alone moves them by ~1e-4 (2e-7 relative).
    torch.testing.assert_close(flat[2], padded[2], atol=1e-5, rtol=1e-6)
    assert flat[3].tolist() == padded[3].tolist()
    for name, grad in padded[4].items():
        torch.testing.assert_close(flat[4][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def _count_sdpa_calls(monkeypatch) -> list[int]:
    """Patch transformers' sdpa function to record the query length of every call."""
    from transformers import AttentionInterface
    import transformers.integrations.sdpa_attention as sdpa_module

    calls: list[int] = []
    original = sdpa_module.sdpa_attention_forward

    def counting(module, query, *args, **kwargs):
        calls.append(query.size(2))
        return original(module, query, *args, **kwargs)

    # per_sequence_sdpa looks the function up in its module; the model's attention layers in the registry.
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", counting)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", counting)
    return calls


def test_per_sequence_attention_attends_each_sequence_alone(causal_lm, monkeypatch):
    """sdpa, no checkpointing: the batch-32 mix runs as one row and each of the 2 layers makes one sdpa call per
    sequence (in packing order), of that sequence's length (never the whole row); the model is back on sdpa afterwards."""
    from alignkit.model.padding_free import PER_SEQUENCE_ATTENTION, per_sequence_sdpa

    calls = _count_sdpa_calls(monkeypatch)
    batch = mixed_batch("right")
    forward_sequence_logps(causal_lm, **batch, padding_free=True)
    layers = causal_lm.config.num_hidden_layers
    assert len(calls) == len(MIXED_LENGTHS) * layers and sorted(calls) == sorted(list(MIXED_LENGTHS) * layers)
    assert causal_lm.config._attn_implementation == "sdpa" != PER_SEQUENCE_ATTENTION
    with pytest.raises(RuntimeError, match="packed_attention"):
        per_sequence_sdpa(None, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), None)


def test_per_sequence_attention_under_bf16_autocast_is_fp32_for_short_sequences(monkeypatch):
    """Under a CPU bf16 autocast, a sequence shorter than `FP32_ATTENTION_BELOW` attends in fp32 (autocast off) and
    a longer one in bf16; each output comes back in bf16 and equals plain causal sdpa over its own sequence."""
    import torch.nn.functional as F

    import alignkit.model.padding_free as padding_free
    import transformers.integrations.sdpa_attention as sdpa_module

    monkeypatch.setattr(padding_free, "FP32_ATTENTION_BELOW", 5)
    seen = []
    original = sdpa_module.sdpa_attention_forward

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((query.size(2), query.dtype, torch.is_autocast_enabled("cpu")))
        return original(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", recording)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 11, 4, generator=generator) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal, module.training = True, False
    token = padding_free._PACKED_STATE.set((None, [(0, 3), (3, 9), (9, 11)]))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = padding_free.per_sequence_sdpa(module, query, key, value.bfloat16(), None)
    finally:
        padding_free._PACKED_STATE.reset(token)
    assert seen == [(3, torch.float32, False), (6, torch.float32, True), (2, torch.float32, False)]
    assert out.dtype == torch.bfloat16 and out.shape == (1, 11, 2, 4)
    for (a, b), atol in (((0, 3), 1e-2), ((3, 9), 5e-2), ((9, 11), 1e-2)):
        want = F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value.bfloat16().float()[:, :, a:b],
                                              is_causal=True).transpose(1, 2)
        torch.testing.assert_close(out[:, a:b].float(), want, atol=atol, rtol=0)


def test_per_sequence_attention_runs_eagerly_under_torch_compile(causal_lm, monkeypatch):
    """`torch_compile: true` wraps the model in `torch.compile`. The per-sequence attention's loop over the batch's
    own lengths is left to eager Python (a graph break), so a compiled padding-free forward under a bf16 autocast,
    over batches of new lengths (dynamo's second compile traces the lengths as symbols), gives the eager forward's
    log-probs. Traced by dynamo, the autocast flag the loop computes from a length failed the second batch."""
    import torch._dynamo

    import alignkit.model.padding_free as padding_free

    monkeypatch.setattr(padding_free, "FP32_ATTENTION_BELOW", 6)  # both sides of the fp32 cut in each batch
    compiled = torch.compile(causal_lm, backend="eager")
    torch._dynamo.reset()
    try:
        for seed, lengths in ((0, LENGTHS), (1, (9, 6, 7, 12)), (2, (4, 13, 5, 8))):
            batch = padded_batch("right", seed=seed, lengths=lengths)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                want, counts = forward_sequence_logps(causal_lm, **batch, padding_free=True)
                got, got_counts = forward_sequence_logps(compiled, **batch, padding_free=True)
            assert got_counts.tolist() == counts.tolist()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        torch._dynamo.reset()


def _embedding_for_neftune(alpha: float) -> torch.nn.Embedding:
    embedding = torch.nn.Embedding(500, 16).train()
    embedding.neftune_noise_alpha = alpha
    return embedding


def test_neftune_noise_equals_transformers_hook_on_a_padded_batch():
    """On a padded batch alignkit's NEFTune hook draws what transformers' (TRL's and LLaMA-Factory's) draws: the
    same uniform noise in +-alpha / sqrt(L * d) from the same random state; none in eval mode."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    from alignkit.model.padding_free import neftune_noise

    embedding = _embedding_for_neftune(5.0)
    output = embedding(torch.randint(0, 50, (3, 7)))
    torch.manual_seed(3)
    ours = neftune_noise(embedding, None, output)
    torch.manual_seed(3)
    theirs = neftune_post_forward_hook(embedding, None, output)
    assert torch.equal(ours, theirs) and not torch.equal(ours, output)
    bound = 5.0 / (7 * 16) ** 0.5
    assert (ours - output).abs().max() <= bound and (ours - output).abs().max() > 0.9 * bound
    assert torch.equal(neftune_noise(embedding.eval(), None, output), output)


def test_neftune_noise_in_a_padding_free_forward_takes_the_padded_length(causal_lm):
    """Inside `packed_attention` the embeddings are one row of the batch's T real tokens; the noise keeps the padded
    batch's scale, alpha / sqrt(L * d) with L its width, not alpha / sqrt(T * d) (transformers' hook there)."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    from alignkit.model.padding_free import flatten_for_model, neftune_noise, packed_attention, padded_width

    batch = padded_batch("right")
    flat = flatten_for_model(causal_lm, batch["input_ids"], batch["attention_mask"])
    width, tokens = batch["input_ids"].size(1), flat.input_ids.size(1)
    assert tokens > width and padded_width() is None
    embedding = _embedding_for_neftune(5.0)
    output = embedding(flat.input_ids)
    with packed_attention(causal_lm, flat):
        assert padded_width() == width
        torch.manual_seed(3)
        ours = neftune_noise(embedding, None, output)
    assert padded_width() is None
    torch.manual_seed(3)
    want = output + torch.zeros_like(output).uniform_(-5.0 / (width * 16) ** 0.5, 5.0 / (width * 16) ** 0.5)
    torch.testing.assert_close(ours, want, atol=1e-7, rtol=0)
    torch.manual_seed(3)
    assert not torch.allclose(neftune_post_forward_hook(embedding, None, output), ours, atol=1e-4)


def test_trainer_attaches_alignkits_neftune_hook_for_training_only(causal_lm, tmp_path):
    """`neftune_noise_alpha`: the Trainer's own hook stays off; alignkit's is on the input embeddings while training
    runs, with the alpha, and gone after."""
    from alignkit.model.padding_free import neftune_noise

    trainer = _sft_trainer(causal_lm, tmp_path, True, neftune_noise_alpha=5.0)
    assert trainer.neftune_noise_alpha is None and trainer._neftune_alpha == 5.0
    embeddings = causal_lm.get_input_embeddings()
    with trainer._neftune():
        assert [hook.__name__ for hook in embeddings._forward_hooks.values()] == ["neftune_noise"]
        assert embeddings.neftune_noise_alpha == 5.0
    assert not embeddings._forward_hooks and not hasattr(embeddings, "neftune_noise_alpha")
    assert neftune_noise.__module__ == "alignkit.model.padding_free"


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_reruns_each_sequence_alone(causal_lm, monkeypatch, reentrant):
    """Under transformers' gradient checkpointing a layer reruns its forward during backward, after `packed_attention`
    has ended; its wrapped checkpoint function reruns it under the same per-sequence attention. Every sdpa call is one
    sequence's own (never the whole row): the token log-probs' forward, the sums' forward and the sums' rerun, three
    rounds; the model is back on sdpa afterwards; log-probs and gradients equal the padded forward's."""
    model = copy.deepcopy(causal_lm)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    batch = mixed_batch("right")
    padded = _logps_and_gradients(model, batch, False)
    calls = _count_sdpa_calls(monkeypatch)
    flat = _logps_and_gradients(model, batch, True)
    assert sorted(calls) == sorted(list(MIXED_LENGTHS) * model.config.num_hidden_layers * 3)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(flat[0], padded[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(flat[2], padded[2], atol=1e-5, rtol=1e-6)
    for name, grad in padded[4].items():
        torch.testing.assert_close(flat[4][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # Checkpointing turned off and on again installs a new checkpoint function: it is wrapped again.
    model.gradient_checkpointing_disable()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    calls.clear()
    again = _logps_and_gradients(model, batch, True)
    assert sorted(calls) == sorted(list(MIXED_LENGTHS) * model.config.num_hidden_layers * 3)
    for name, grad in padded[4].items():
        torch.testing.assert_close(again[4][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_checkpoint_wrapper_keeps_the_masked_rows_and_equal_gradients(causal_lm, monkeypatch):
    """torch's `checkpoint_wrapper` (FSDP's or accelerate's activation checkpointing) reruns a layer outside
    `packed_attention`, where the replaying wrapper does not reach: such a model keeps rows bounded by the longest
    sequence with transformers' block-diagonal mask (sdpa calls as wide as a row, forward and rerun alike), and its
    log-probs and gradients equal the padded forward's."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    model = copy.deepcopy(causal_lm)
    assert row_token_bound(model) is None  # before the wrapping (the trainer wraps after the model has run)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: type(module).__name__.endswith("DecoderLayer"))
    model.train()
    assert row_token_bound(model) == 0
    assert row_token_bound(copy.deepcopy(model)) == 0  # found already wrapped
    batch = mixed_batch("right")
    padded = _logps_and_gradients(model, batch, False)
    calls = _count_sdpa_calls(monkeypatch)
    flat = _logps_and_gradients(model, batch, True)
    assert calls and set(calls) == {max(MIXED_LENGTHS)}
    torch.testing.assert_close(flat[0], padded[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(flat[2], padded[2], atol=1e-5, rtol=1e-6)
    for name, grad in padded[4].items():
        torch.testing.assert_close(flat[4][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_mixed_batch_sequence_rewards_equal_the_padded_forward(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = PAD
    batch = mixed_batch("right")
    weights = torch.linspace(0.5, 1.5, len(MIXED_LENGTHS))
    padded = sequence_rewards(model, batch["input_ids"], batch["attention_mask"])
    (padded * weights).sum().backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    flat = sequence_rewards(model, batch["input_ids"], batch["attention_mask"], padding_free=True)
    (flat * weights).sum().backward()
    torch.testing.assert_close(flat, padded, atol=1e-5, rtol=0)
    assert padded.std() > 1e-3
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_mixed_batch_sft_loss_and_gradients_equal_the_padded_loss(causal_lm, tmp_path):
    """SFT training loss (labelled positions only) and evaluation loss/logits (the whole packed layout
    through `sft_loss`) at batch 32, padded vs packed rows."""
    batch = mixed_batch("right")
    results = {}
    for padding_free in (False, True):
        trainer = _sft_trainer(causal_lm, tmp_path, padding_free)
        causal_lm.zero_grad()
        loss = trainer.compute_loss(causal_lm, dict(batch))
        loss.backward()
        with torch.no_grad():
            eval_loss, outputs = trainer.compute_loss(causal_lm, dict(batch), return_outputs=True)
        results[padding_free] = (loss.detach(), eval_loss, outputs.logits,
                                 {n: p.grad.clone() for n, p in causal_lm.named_parameters()})
    (loss_p, eval_p, logits_p, grads_p), (loss_f, eval_f, logits_f, grads_f) = results[False], results[True]
    torch.testing.assert_close(loss_f, loss_p, atol=1e-5, rtol=0)
    torch.testing.assert_close(eval_f, eval_p, atol=1e-5, rtol=0)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(logits_f[real], logits_p[real], atol=1e-4, rtol=0)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, atol=1e-5, rtol=1e-4, msg=name)


# ---------------------------------------------------------------------------------------------- row width by cost
def test_layout_cost_by_hand():
    """Sizes [3, 2], slot cost 10: capacity 3 gives rows [3], [2] of width 3: 2 * 3 * (10 + 3) = 78;
    capacity 5 one row of width 5: 1 * 5 * (10 + 5) = 75."""
    from alignkit.model.padding_free import cheapest_row_capacity, layout_cost

    assert layout_cost([3, 2], 3, 10.0)[0] == 78
    assert layout_cost([3, 2], 5, 10.0)[0] == 75
    assert cheapest_row_capacity([3, 2], 10.0) == 5  # one row is cheaper
    # A slot cost of 1: capacity 3 costs 2 * 3 * 4 = 24, one row 5 * 6 = 30; 24 < 0.75 * 30 = 22.5 is false,
    # so the padding of two rows is not worth it: one row.
    assert cheapest_row_capacity([3, 2], 1.0) == 5
    # [4, 4] with slot cost 0: rows of 4 cost 2 * 4 * 4 = 32, one row 8 * 8 = 64: 32 < 48, rows of 4.
    assert cheapest_row_capacity([4, 4], 0.0) == 4


def test_attention_slot_cost_of_smollm2_shape_by_hand():
    """q, o: 576 x 576 each; k, v: 576 x 192 each; gated MLP 3 x 576 x 1536: P = 3,538,944 weights per layer;
    2P / (4 * 9 * 64) = 3072 attention pairs per token slot."""
    from types import SimpleNamespace

    from alignkit.model.padding_free import attention_slot_cost

    config = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                             intermediate_size=1536)
    assert attention_slot_cost(SimpleNamespace(config=config)) == 3072
    assert attention_slot_cost(SimpleNamespace(config=SimpleNamespace())) is None


def test_cost_picks_one_row_for_a_few_short_chats_and_narrow_rows_for_long_batches():
    """The two regimes of issue 11 on the SmolLM2 shape: the benchmark's 8 short chats (708 tokens, one row:
    708 * (3072 + 708) = 2.68M against 4 rows of 230: 4 * 230 * (3072 + 230) = 3.04M) and 32 sequences of 512
    (one row would square 16384 tokens)."""
    from alignkit.model.padding_free import cheapest_row_capacity

    chats = [230, 120, 90, 73, 70, 60, 55, 10]
    assert sum(chats) == 708
    assert cheapest_row_capacity(chats, 3072.0) == 708
    assert cheapest_row_capacity([512] * 32, 3072.0) == 512


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.floats(0.5, 5000))
def test_cost_choice_is_one_row_or_a_clear_saving(sizes, slot_cost):
    """Several rows only when they cost under 3/4 of one row, and then no more than rows of the longest."""
    from alignkit.model.padding_free import MULTI_ROW_MAX_COST_SHARE, cheapest_row_capacity, layout_cost

    chosen = cheapest_row_capacity(sizes, slot_cost)
    total = sum(sizes)
    assert max(sizes) <= chosen <= total
    one_row = layout_cost(sizes, total, slot_cost)[0]
    if chosen < total:
        assert layout_cost(sizes, chosen, slot_cost)[0] < MULTI_ROW_MAX_COST_SHARE * one_row
        assert layout_cost(sizes, chosen, slot_cost)[0] <= layout_cost(sizes, max(sizes), slot_cost)[0]
    else:
        assert layout_cost(sizes, max(sizes), slot_cost)[0] >= MULTI_ROW_MAX_COST_SHARE * one_row


def test_flatten_with_slot_cost_keeps_every_token_and_equal_logps(causal_lm):
    """The cost-chosen layout gives the same per-token log-probs as the padded batch."""
    from alignkit.model.logprobs import forward_token_logps

    batch = padded_batch("right")
    padded, mask = forward_token_logps(causal_lm, **batch, padding_free=False)
    packed, packed_mask = forward_token_logps(causal_lm, **batch, padding_free=True)
    assert torch.equal(mask, packed_mask)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------
# Shared prefixes: a sequence's prefix shared with an earlier one runs once
# ---------------------------------------------------------------------------------------------------


def test_shared_prefixes_hand_computed():
    """Sequences [5 6 7], [5 6 8 9], [5 6 7 1], [4], [5 6 7]: 1 shares [5 6] with 0; 2 shares [5 6 7] with 0 (only
    [5 6] with 1); 3 shares nothing; 4 equals 0 but keeps its last token, so shares [5 6] (the first such host, 0)."""
    from alignkit.model.padding_free import shared_prefixes

    sequences = [[5, 6, 7], [5, 6, 8, 9], [5, 6, 7, 1], [4], [5, 6, 7]]
    flat_ids = torch.tensor([t for s in sequences for t in s])
    host, shared = shared_prefixes(flat_ids, torch.tensor([len(s) for s in sequences]))
    assert host.tolist() == [-1, 0, 0, -1, 0]
    assert shared.tolist() == [0, 2, 3, 0, 2]


@pytest.mark.parametrize("side", ["right", "left"])
def test_flatten_with_shared_prefixes_hand_computed(side):
    """Rows [10 11 12], [10 11 13 14], [10 11 13 15], [20]: row 1 shares [10 11] with row 0, row 2 shares
    [10 11 13] with row 1, whose own 13 sits at slot 3 (a chain: 10 and 11 resolve to row 0's slots).

    The one row holds each sequence's own tokens in order: 10 11 12 | 13 14 | 15 | 20, positions 0 1 2 | 2 3 | 3 | 0.
    Slots in flat order: row 0: 0 1 2; row 1: 0 1 3 4; row 2: 0 1 3 5; row 3: 6. from_rows undoes the layout."""
    sequences = [[10, 11, 12], [10, 11, 13, 14], [10, 11, 13, 15], [20]]
    input_ids = torch.full((4, 4), PAD)
    attention_mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(sequences):
        columns = slice(0, len(tokens)) if side == "right" else slice(4 - len(tokens), 4)
        input_ids[row, columns] = torch.tensor(tokens)
        attention_mask[row, columns] = 1
    labels = input_ids.masked_fill(attention_mask == 0, X)
    flat = flatten_padded(input_ids, attention_mask, labels, max_row_tokens=None, share_prefixes=True)
    assert flat.input_ids.tolist() == [[10, 11, 12, 13, 14, 15, 20]]
    assert flat.position_ids.tolist() == [[0, 1, 2, 2, 3, 3, 0]]
    assert flat.labels.tolist() == [[10, 11, 12, 13, 14, 15, 20]]
    assert flat.slots.tolist() == [0, 1, 2, 0, 1, 3, 4, 0, 1, 3, 5, 6]
    assert flat.shared.tolist() == [0, 2, 3, 0]
    assert flat.from_rows(flat.input_ids).tolist() == input_ids[attention_mask.bool()].tolist()
    with pytest.raises(ValueError, match="shared prefixes"):
        flat.to_rows(flat.sequence_index)
    # Rows bounded by width (eager attention, checkpointing), or nothing shared: the plain layout.
    assert flatten_padded(input_ids, attention_mask, share_prefixes=True).shared is None
    assert flatten_padded(input_ids[[0, 3]], attention_mask[[0, 3]], max_row_tokens=None,
                          share_prefixes=True).shared is None


def shared_prefix_batch(side: str) -> dict[str, torch.Tensor]:
    """A preference-like batch: rows 0-2 chosen, 3-5 rejected; rows 3 and 4 repeat their chosen row's first tokens
    (the prompt, and for row 4 one reply token more); row 2 starts like row 0 (as a template's system prompt
    does) and row 5 repeats row 2's first 3 tokens, 2 of them row 0's (a chain). Labels start after each prompt."""
    batch = padded_batch(side, seed=5, lengths=(9, 12, 6, 7, 10, 8), prompts=(4, 5, 2, 4, 6, 2))
    real = batch["attention_mask"].bool()
    rows = [batch["input_ids"][r][real[r]] for r in range(6)]
    rows[3][:4] = rows[0][:4]
    rows[4][:6] = rows[1][:6]
    rows[2][:2] = rows[0][:2]
    rows[5][:3] = rows[2][:3]
    for r in range(6):
        batch["input_ids"][r][real[r]] = rows[r]
        labels = batch["labels"][r][real[r]]
        batch["labels"][r][real[r]] = torch.where(labels == X, X, rows[r])
    return batch


@pytest.mark.parametrize(("side", "finetuning", "checkpointing"), [
    ("right", "lora", False), ("left", "lora", False), ("right", "full", False), ("left", "full", False),
    ("right", "lora", True), ("left", "full", True)])
def test_shared_prefix_logps_and_gradients_equal_the_padded_forward(causal_lm, side, finetuning, checkpointing):
    """Per-token and summed log-probs and their gradients with shared prefixes equal the padded forward's, and
    the decoder runs fewer tokens than the batch holds; under gradient checkpointing too, whose reruns gather each
    sequence's context again."""
    from alignkit.model.padding_free import flatten_for_model

    model = _lora(causal_lm) if finetuning == "lora" else copy.deepcopy(causal_lm)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    batch = shared_prefix_batch(side)
    flat = flatten_for_model(model, batch["input_ids"], batch["attention_mask"])
    assert flat.shared is not None and flat.shared.tolist() == [0, 0, 2, 4, 6, 3]
    assert flat.input_ids.size(1) == int(batch["attention_mask"].sum()) - 15
    padded, packed = _logps_and_gradients(model, batch, False), _logps_and_gradients(model, batch, True)
    torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=0)
    assert torch.equal(packed[1], padded[1])
    torch.testing.assert_close(packed[2], padded[2], atol=1e-5, rtol=0)
    assert torch.equal(packed[3], padded[3])
    for name, grad in padded[4].items():
        torch.testing.assert_close(packed[4][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # Deterministic: the repeated slots' gradients are summed in one order.
    again = _logps_and_gradients(model, batch, True)
    assert all(torch.equal(again[4][name], grad) for name, grad in packed[4].items())


def test_shared_prefix_rewards_and_gradients_equal_the_padded_forward(tiny_model_dir):
    """A reward model's pairs (chosen rows first) score the same with their prompts run once."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = PAD
    batch = shared_prefix_batch("right")
    results = []
    for padding_free in (False, True):
        model.zero_grad()
        rewards = sequence_rewards(model, batch["input_ids"], batch["attention_mask"], padding_free=padding_free)
        (rewards * torch.linspace(0.5, 1.5, 6)).sum().backward()
        results.append((rewards.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (padded, padded_grads), (packed, packed_grads) = results
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    assert padded.std() > 1e-3
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prefix_layout_refused_without_per_sequence_attention(tiny_model_dir):
    """Eager attention would attend the shared row through a block-diagonal mask: refused, not silently wrong."""
    from alignkit.model.padding_free import flatten_for_model, packed_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    batch = shared_prefix_batch("right")
    assert flatten_for_model(model, batch["input_ids"], batch["attention_mask"]).shared is None
    flat = flatten_padded(batch["input_ids"], batch["attention_mask"], max_row_tokens=None, share_prefixes=True)
    with pytest.raises(RuntimeError, match="per-sequence attention"):
        with packed_attention(model, flat):
            pass


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=12))
def test_shared_prefixes_match_a_brute_force_search(sequences):
    """Property: each sequence's host is the first earlier sequence with the longest common prefix, and it shares
    that prefix up to its own length less one (few token values, so prefixes often coincide)."""
    from alignkit.model.padding_free import shared_prefixes

    flat_ids = torch.tensor([t for s in sequences for t in s])
    host, shared = shared_prefixes(flat_ids, torch.tensor([len(s) for s in sequences]))
    for j, sequence in enumerate(sequences):
        best, take = -1, 0
        for i in range(j):
            common = 0
            while common < min(len(sequence), len(sequences[i])) and sequence[common] == sequences[i][common]:
                common += 1
            if min(common, len(sequence) - 1) > take:
                best, take = i, min(common, len(sequence) - 1)
        assert (host[j].item(), shared[j].item()) == (best, take), j
