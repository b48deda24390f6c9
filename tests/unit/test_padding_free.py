"""Padding-free forward: the flatten/unflatten helpers by hand, then SFT, RM and DPO equal to the padded path."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from alignkit.hparams import TrainingArguments, parse_config
from alignkit.model.logprobs import forward_sequence_logps, forward_token_logps
from alignkit.model.padding_free import (
    first_token_unlabelled,
    flatten_padded,
    last_token_per_sequence,
    next_token_targets,
    segment_sum,
    unflatten_to_padded,
)
from alignkit.stages.dpo import DPOTrainer
from alignkit.stages.rm import sequence_rewards
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
    flat = flatten_padded(input_ids, attention_mask, labels)
    assert flat.input_ids.tolist() == [[11, 12, 13, 21, PAD]]
    assert flat.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert flat.labels.tolist() == [[X, 12, 13, X, PAD]]
    assert flat.sequence_index.tolist() == [0, 0, 0, 1, 1]
    assert flat.lengths.tolist() == [3, 2]
    assert flat.real.tolist() == attention_mask.bool().tolist()
    assert flatten_padded(input_ids, attention_mask).labels is None


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


def padded_batch(side: str, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    input_ids = torch.full((len(LENGTHS), width), PAD)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, X)
    for row, (length, prompt) in enumerate(zip(LENGTHS, PROMPTS)):
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


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_and_sequence_logps_equal_the_padded_forward(causal_lm, side):
    """Same per-token log-probs, masks, sums, counts and gradients; only labelled positions get logits."""
    batch = padded_batch(side)
    weights = torch.linspace(0.5, 1.5, len(LENGTHS))

    def run(padding_free: bool):
        causal_lm.zero_grad()
        logps, mask = forward_token_logps(causal_lm, **batch, padding_free=padding_free)
        sums, counts = forward_sequence_logps(causal_lm, **batch, padding_free=padding_free)
        (sums * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in causal_lm.named_parameters()}
        return logps.detach(), mask, sums.detach(), counts, grads

    padded, flat = run(False), run(True)
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


def _sft_trainer(model, tmp_path, padding_free: bool) -> SFTTrainer:
    args = TrainingArguments(output_dir=str(tmp_path / "sft"), report_to="none", use_cpu=True,
                             remove_unused_columns=False, padding_free=padding_free)
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
