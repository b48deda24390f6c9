"""BLEU-4, ROUGE-1/2/L and token accuracy against numbers worked out by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from alignkit.metrics import (
    IGNORE_INDEX,
    argmax_logits,
    decode_token_ids,
    similarity_metrics,
    token_accuracy_metric,
    similarity_scores,
    token_accuracy,
)


def test_english_prefix_prediction():
    """pred "the cat sat", reference "the cat sat down".

    ROUGE on words: hyp [the, cat, sat], ref [the, cat, sat, down].
      rouge-1: overlap 3, P = 3/3, R = 3/4, F = 2PR/(P+R) = 1.5/1.75 = 0.857142... -> 85.7143
      rouge-2: hyp bigrams 2, ref bigrams 3, overlap 2: P = 1, R = 2/3, F = (4/3)/(5/3) = 0.8 -> 80.0
      rouge-l: LCS = 3 words, same P and R as rouge-1 -> 85.7143
    BLEU on characters: the prediction is a prefix of the reference, so every n-gram precision p1..p4 is 1;
      brevity penalty with c = 11 chars, r = 16 chars: exp(1 - 16/11) = exp(-5/11) = 0.634736... -> 63.4736
    """
    scores = similarity_scores(["the cat sat"], ["the cat sat down"])
    assert scores["rouge-1"] == pytest.approx(85.7143, abs=1e-3)
    assert scores["rouge-2"] == pytest.approx(80.0, abs=1e-3)
    assert scores["rouge-l"] == pytest.approx(85.7143, abs=1e-3)
    assert scores["bleu-4"] == pytest.approx(100 * math.exp(-5 / 11), abs=1e-3)


def test_chinese_one_word_differs():
    """pred 今天天气很好, reference 今天天气不好.

    jieba words: hyp [今天天气, 很, 好], ref [今天天气, 不好].
      rouge-1: overlap 1, P = 1/3, R = 1/2, F = 2(1/6)/(5/6) = 0.4 -> 40.0
      rouge-2: hyp bigrams {今天天气 很, 很 好}, ref {今天天气 不好}: no overlap -> 0.0
      rouge-l: LCS = 1 word -> 40.0
    BLEU on characters (6 vs 6, brevity penalty 1):
      p1: 今 天 天 气 很 好 vs ref counts 今1 天2 气1 不1 好1 -> 5/6
      p2: 今天 天天 天气 气很 很好 vs 今天 天天 天气 气不 不好 -> 3/5
      p3: 今天天 天天气 天气很 气很好 vs 今天天 天天气 天气不 气不好 -> 2/4
      p4: 今天天气 天天气很 天气很好 vs 今天天气 天天气不 天气不好 -> 1/3
      BLEU = (5/6 * 3/5 * 1/2 * 1/3) ** (1/4) = (1/12) ** 0.25 = 0.537285 -> 53.7285
    """
    scores = similarity_scores(["今天天气很好"], ["今天天气不好"])
    assert scores["rouge-1"] == pytest.approx(40.0, abs=1e-3)
    assert scores["rouge-2"] == pytest.approx(0.0, abs=1e-3)
    assert scores["rouge-l"] == pytest.approx(40.0, abs=1e-3)
    assert scores["bleu-4"] == pytest.approx(100 * (1 / 12) ** 0.25, abs=1e-3)


def test_scores_are_means_over_examples_and_empty_prediction_scores_zero():
    """Three examples: the two above and an empty prediction (0 on every metric).

    rouge-1 = (85.7143 + 40 + 0) / 3 = 41.9048;  bleu-4 = (63.4736 + 53.7285 + 0) / 3 = 39.0674
    """
    scores = similarity_scores(["the cat sat", "今天天气很好", ""], ["the cat sat down", "今天天气不好", "abc"])
    assert scores["rouge-1"] == pytest.approx((85.7143 + 40.0) / 3, abs=1e-3)
    assert scores["rouge-2"] == pytest.approx(80.0 / 3, abs=1e-3)
    assert scores["bleu-4"] == pytest.approx((100 * math.exp(-5 / 11) + 100 * (1 / 12) ** 0.25) / 3, abs=1e-3)


def test_identical_text_scores_100():
    scores = similarity_scores(["the cat sat on the mat"], ["the cat sat on the mat"])
    assert all(v == pytest.approx(100.0, abs=1e-3) for v in scores.values()), scores


def test_length_mismatch_raises():
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        similarity_scores(["a", "b"], ["a"])


def test_token_accuracy_shifts_and_skips_ignored():
    """Row 0: predictions at t=0..2 are [5, 6, 9], targets labels[1:] = [5, 6, 7] -> 2 of 3 right.
    Row 1: targets [-100, 4, -100] -> only t=1 counts; prediction 4 -> right.
    Accuracy = (2 + 1) / (3 + 1) = 0.75 (the last prediction of each row has no target).
    """
    predicted = np.array([[5, 6, 9, 1], [0, 4, 3, 3]])
    labels = np.array([[IGNORE_INDEX, 5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 4, IGNORE_INDEX]])
    assert token_accuracy(predicted, labels) == pytest.approx(0.75)
    assert token_accuracy_metric()(SimpleNamespace(predictions=predicted, label_ids=labels)) == {"accuracy": 0.75}
    assert token_accuracy(predicted, np.full_like(labels, IGNORE_INDEX)) == 0.0


def test_argmax_logits_reduces_vocab_dim():
    logits = torch.tensor([[[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]]])
    assert argmax_logits((logits,)).tolist() == [[1, 0]]


def test_similarity_metrics_decodes_padded_ids(tiny_tokenizer):
    """Rows padded with -100 (the Trainer's cross-batch padding) decode to the text alone."""
    ids = tiny_tokenizer("The capital of France is Paris.")["input_ids"]
    padded = np.array([ids + [IGNORE_INDEX] * 3])
    assert decode_token_ids(tiny_tokenizer, padded) == ["The capital of France is Paris."]
    metrics = similarity_metrics(tiny_tokenizer)(SimpleNamespace(predictions=padded, label_ids=padded))
    assert set(metrics) == {"bleu-4", "rouge-1", "rouge-2", "rouge-l"}
    assert metrics["bleu-4"] == pytest.approx(100.0, abs=1e-3)


def test_metrics_batch_by_batch_equal_the_whole_set(tiny_tokenizer):
    """`batch_eval_metrics: true`: the Trainer calls compute_metrics per batch (tensors), `compute_result` true at the
    last; the result equals one call over the whole set, and the next evaluation starts afresh."""
    predicted = np.array([[5, 6, 9, 1], [0, 4, 3, 3], [2, 2, 2, 2]])
    labels = np.array([[IGNORE_INDEX, 5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 4, IGNORE_INDEX], [IGNORE_INDEX, 2, 1, 2]])
    metric = token_accuracy_metric()
    # (2 + 1 + 2) / (3 + 1 + 3)
    assert metric(SimpleNamespace(predictions=predicted, label_ids=labels)) == {"accuracy": pytest.approx(5 / 7)}
    for _ in range(2):
        assert metric(SimpleNamespace(predictions=torch.tensor(predicted[:2]), label_ids=torch.tensor(labels[:2])),
                      compute_result=False) is None
        assert metric(SimpleNamespace(predictions=torch.tensor(predicted[2:]), label_ids=torch.tensor(labels[2:])),
                      compute_result=True) == {"accuracy": pytest.approx(5 / 7)}

    texts = ["The capital of France is Paris.", "Two plus two is four.", "Water boils at 100 degrees."]
    references = ["Paris is the capital of France.", "Two plus two is four.", "Ice melts at 0 degrees."]

    def padded(rows):
        ids = [tiny_tokenizer(t)["input_ids"] for t in rows]
        width = max(map(len, ids))
        return np.array([row + [IGNORE_INDEX] * (width - len(row)) for row in ids])

    similarity = similarity_metrics(tiny_tokenizer)
    whole = similarity(SimpleNamespace(predictions=padded(texts), label_ids=padded(references)))
    assert 0 < whole["rouge-1"] < 100
    similarity(SimpleNamespace(predictions=padded(texts[:1]), label_ids=padded(references[:1])), compute_result=False)
    batched = similarity(SimpleNamespace(predictions=padded(texts[1:]), label_ids=padded(references[1:])))
    assert batched == whole
