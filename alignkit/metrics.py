"""Evaluation metrics for SFT: BLEU-4 and ROUGE-1/2/L on generated text, token accuracy on logits.

The text metrics follow the recipe LLaMA-Factory reports, so numbers can be compared across the two:
ROUGE F1 on jieba word segments (which splits Chinese into words and leaves English words whole),
BLEU-4 on characters with NLTK's smoothing method 3, both per example, scaled to 0-100 and averaged.
nltk, jieba and rouge-chinese come with the `metrics` extra and are imported only when used.

Token accuracy is computed from argmax ids (`argmax_logits` as the Trainer's
`preprocess_logits_for_metrics`), so an evaluation never holds the eval set's full logits in memory.
Each `compute_metrics` here is an `EvalMetric`: it sums per batch, so transformers' `batch_eval_metrics`
(called once per batch) gives what one call over the whole set gives.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .constants import IGNORE_INDEX
from .errors import ConfigError

SIMILARITY_KEYS = ("bleu-4", "rouge-1", "rouge-2", "rouge-l")


def _import_text_metrics():
    """Import the optional text-metric libraries, or say which extra provides them."""
    try:
        import jieba
        from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
        from rouge_chinese import Rouge
    except ImportError as err:
        raise ConfigError(
            f"BLEU/ROUGE need nltk, jieba and rouge-chinese ({err.name} is missing): "
            "pip install 'alignkit[metrics]', or set predict_with_generate=false."
        ) from None
    jieba.setLogLevel(logging.WARNING)  # jieba prints its dictionary loading at INFO
    return jieba, Rouge, sentence_bleu, SmoothingFunction


def similarity_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean BLEU-4 and ROUGE-1/2/L F1 (each x100) of predictions against one reference each.

    Args:
        predictions: generated texts.
        references: the reference texts, same length as `predictions`.

    Returns:
        `{"bleu-4", "rouge-1", "rouge-2", "rouge-l"}`, each the mean over examples, or 0.0 for no examples.
        An empty prediction or reference scores 0 on ROUGE (the library rejects empty strings).
    """
    totals = similarity_totals(predictions, references)
    return _similarity_means(totals, len(predictions))


def similarity_totals(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """`similarity_scores`' sums over the examples (each example's score rounded to 4 places, x100)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references.")
    jieba, Rouge, sentence_bleu, SmoothingFunction = _import_text_metrics()
    rouge = Rouge()
    smoothing = SmoothingFunction().method3
    totals = dict.fromkeys(SIMILARITY_KEYS, 0.0)
    for prediction, reference in zip(predictions, references):
        hypothesis_words = " ".join(jieba.cut(prediction)).split()
        reference_words = " ".join(jieba.cut(reference)).split()
        if hypothesis_words and reference_words:
            scores = rouge.get_scores(" ".join(hypothesis_words), " ".join(reference_words))[0]
            for key in ("rouge-1", "rouge-2", "rouge-l"):
                totals[key] += round(scores[key]["f"] * 100, 4)
        bleu = sentence_bleu([list(reference)], list(prediction), smoothing_function=smoothing) if prediction else 0.0
        totals["bleu-4"] += round(bleu * 100, 4)
    return totals


def _similarity_means(totals: dict[str, float], count: int) -> dict[str, float]:
    return {key: round(value / max(count, 1), 4) for key, value in totals.items()}


def token_accuracy(predicted_ids: np.ndarray, labels: np.ndarray) -> float:
    """Share of target tokens the model ranks first, with the causal shift applied.

    Args:
        predicted_ids: (batch, seq) argmax ids; position t predicts token t + 1.
        labels: (batch, seq) targets, IGNORE_INDEX where no loss is taken (prompt, padding).

    Returns:
        correct / counted over every position with `labels[:, 1:] != IGNORE_INDEX`, or 0.0 if there is none.
    """
    correct, total = token_counts(predicted_ids, labels)
    return correct / total if total else 0.0


def token_counts(predicted_ids: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
    """`token_accuracy`'s (correct, counted) target tokens."""
    predicted = np.asarray(predicted_ids)[:, :-1]
    targets = np.asarray(labels)[:, 1:]
    counted = targets != IGNORE_INDEX
    return int(((predicted == targets) & counted).sum()), int(counted.sum())


class EvalMetric:
    """A Trainer `compute_metrics` that sums over batches.

    The Trainer calls it once with the whole evaluation set, or, under `batch_eval_metrics: true`, once per batch
    with `compute_result` true at the last (transformers' protocol; LLaMA-Factory's metrics take it too): `update`
    adds a batch to the running state, `finish` turns the state into the metrics, which are the same either way.

    Args:
        update: `update(state, predictions, labels)`, numpy arrays of one batch (or of all of them).
        finish: `finish(state) -> metrics`; the state then starts afresh for the next evaluation.
    """

    def __init__(self, update: Callable[[dict, np.ndarray, np.ndarray], None],
                 finish: Callable[[dict], dict[str, float]]) -> None:
        self._update, self._finish = update, finish
        self._state: dict[str, Any] = {}

    def __call__(self, eval_prediction, compute_result: bool = True) -> Optional[dict[str, float]]:
        self._update(self._state, _numpy(eval_prediction.predictions), _numpy(eval_prediction.label_ids))
        if not compute_result:
            return None
        state, self._state = self._state, {}
        return self._finish(state)


def _numpy(values: Any) -> Any:
    """A batch's tensors (`batch_eval_metrics`) as numpy; the whole set's arrays as they are."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    if isinstance(values, (tuple, list)):
        return type(values)(_numpy(v) for v in values)
    return values


def _add_token_counts(state: dict, predicted_ids: np.ndarray, labels: np.ndarray) -> None:
    correct, total = token_counts(predicted_ids, labels)
    state["correct"] = state.get("correct", 0) + correct
    state["total"] = state.get("total", 0) + total


def token_accuracy_metric() -> EvalMetric:
    """`compute_metrics` for loss-based evaluation: `{"accuracy": ...}` from argmax ids and labels."""
    return EvalMetric(_add_token_counts,
                      lambda state: {"accuracy": state["correct"] / state["total"] if state.get("total") else 0.0})


def argmax_logits(logits: torch.Tensor | tuple, labels: torch.Tensor | None = None) -> torch.Tensor:
    """`preprocess_logits_for_metrics`: keep only argmax ids, (batch, seq, vocab) -> (batch, seq)."""
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return logits.argmax(dim=-1)


def decode_token_ids(tokenizer: Any, ids: np.ndarray, skip_special_tokens: bool = True) -> list[str]:
    """Decode rows padded with IGNORE_INDEX (the Trainer's padding across batches) to text."""
    ids = np.asarray(ids)
    ids = np.where(ids == IGNORE_INDEX, tokenizer.pad_token_id, ids)
    return tokenizer.batch_decode(ids.tolist(), skip_special_tokens=skip_special_tokens)


def similarity_metrics(tokenizer: Any) -> EvalMetric:
    """`compute_metrics` for generation-based evaluation: decodes, then `similarity_scores`."""
    _import_text_metrics()  # fail before evaluation starts, not after generating for the whole set

    def update(state: dict, predicted_ids: np.ndarray, label_ids: np.ndarray) -> None:
        predictions = [text.strip() for text in decode_token_ids(tokenizer, predicted_ids)]
        references = [text.strip() for text in decode_token_ids(tokenizer, label_ids)]
        totals = state.setdefault("totals", dict.fromkeys(SIMILARITY_KEYS, 0.0))
        for key, value in similarity_totals(predictions, references).items():
            totals[key] += value
        state["count"] = state.get("count", 0) + len(predictions)

    return EvalMetric(update, lambda state: _similarity_means(state.get("totals", dict.fromkeys(SIMILARITY_KEYS, 0.0)),
                                                              state.get("count", 0)))
