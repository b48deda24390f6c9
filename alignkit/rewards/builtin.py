"""The built-in reward functions: `accuracy` (math answers), `format` (a regex layout), `length` (overlong).

Each is a pure function of the completions (and the row's columns), with TRL's reward-function signature
(`completions`, dataset columns and anything else as keyword arguments) and one value per completion:
a float, or None where the function does not apply (TRL turns None into NaN and leaves it out of the
means; `combine_rewards` sums the other functions).

A completion is either a string (standard rows) or TRL's conversational shape, a list of messages
`[{"role": "assistant", "content": text}]`; `completion_text` reads both.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Optional, Sequence

# ------------------------------------------------------------------------------------------ completions


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, a list of messages as their contents joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        return "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in completion)
    raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}.")


def final_answer_text(completion: Any) -> str:
    """The text a completion's final answer is read from: of a message list, its last assistant message's content
    (after tool calls, the answer the model wrote once it had the results: the tool results and the calling turns'
    numbers are not the model's answer, and joined they would run together, "18" + "2" + "18" reading as 18218);
    otherwise `completion_text`.

    Example: `[{"role": "assistant", "content": "", "tool_calls": [...]}, {"role": "tool", "content": "17"},
    {"role": "assistant", "content": "The answer is 17."}]` -> "The answer is 17."
    """
    if isinstance(completion, (list, tuple)):
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
                return str(message.get("content", ""))
    return completion_text(completion)


# --------------------------------------------------------------------------------------------- accuracy

# One number as models write it: an optional minus (ASCII or U+2212), digits with optional thousands
# separators ("1,000" but not "1,00"), an optional decimal part, an optional "/denominator". The
# look-behind keeps digits glued to letters ("x2", "H2O") and the "5" of "3.5" from counting alone, and
# lets "3-5" read as 3 and 5 rather than 3 and -5.
_NUMBER = r"(?<![\w.])[-\u2212]?(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?![\d.]))?"
_NUMBER_RE = re.compile(_NUMBER)
# "answer is 16", "Answer: $16", "final answer = **16**", GSM8K's "#### 16".
_ANSWER_PHRASE_RE = re.compile(
    r"(?:answer\s*(?:is|:|=)|####)\s*(?:is\s*)?[:=]?\s*[*_$\\(]*\s*(" + _NUMBER + r")", re.IGNORECASE)
_EQUALS_RE = re.compile(r"=\s*[*_$\\(]*\s*(" + _NUMBER + r")")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([-\u2212]?\d+)\s*\}\s*\{\s*(\d+)\s*\}")


def parse_number(text: str) -> Optional[Fraction]:
    """The value of one number written as `_NUMBER` matches it ("1,000", "-3.5", "3/4"), exactly.

    Returns None for anything else (and for a zero denominator).
    """
    text = text.strip().replace("\u2212", "-").replace(",", "")
    try:
        if "/" in text:
            numerator, denominator = (part.strip() for part in text.split("/", 1))
            if Fraction(denominator) == 0:
                return None
            return Fraction(numerator) / Fraction(denominator)
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _last_boxed(text: str) -> Optional[str]:
    r"""Content of the last `\boxed{...}` (or `\fbox{...}`), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None  # unclosed: a cut-off completion has no boxed answer


def _numbers(text: str) -> list[Fraction]:
    values = [parse_number(m.group(0)) for m in _NUMBER_RE.finditer(_FRAC_RE.sub(r"\1/\2", text))]
    return [v for v in values if v is not None]


def extract_final_answer(text: str) -> Optional[Fraction | str]:
    r"""The final answer a completion gives, picked in this order of preference:

    1. the last `\boxed{...}`: its last number (`\frac{a}{b}` read as a/b), or its text when it holds no number;
    2. the last "answer is X" / "answer: X" / "answer = X" / "#### X";
    3. the last "= X" in the completion's last non-empty line;
    4. the last number anywhere.

    Args:
        text: the completion.

    Returns:
        A `Fraction` (exact value of the number as written), the boxed text when a box holds no number,
        or None when the completion holds no number.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        values = _numbers(boxed)
        return values[-1] if values else boxed.strip()
    text = _FRAC_RE.sub(r"\1/\2", text)
    phrases = _ANSWER_PHRASE_RE.findall(text)
    if phrases:
        return parse_number(phrases[-1])
    lines = [line for line in text.splitlines() if line.strip()]
    if lines:
        equals = _EQUALS_RE.findall(lines[-1])
        if equals:
            return parse_number(equals[-1])
    values = _numbers(text)
    return values[-1] if values else None


def parse_reference_answer(answer: Any) -> Optional[Fraction | str]:
    """The row's `answer` column as a value: a number, numeric text ("1,000", "$5", GSM8K's "... #### 72"),
    or other text (compared as text). None or blank text: the row has no answer."""
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):
        return Fraction(answer) if math.isfinite(answer) else None
    text = str(answer).strip()
    if not text:
        return None
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    value = extract_final_answer(text)
    return value if value is not None else text


def _normalise_text(text: str) -> str:
    return re.sub(r"[\s$.]+|\\text\{|\}", "", text).lower()


def answers_match(predicted: Optional[Fraction | str], reference: Fraction | str, rel_tol: float = 1e-6) -> bool:
    """Numbers: equal within `rel_tol` relative (0.333333 matches 1/3 only to 1e-6). Text: equal after
    dropping spaces, dollar signs, full stops and `\\text{}` and lower-casing."""
    if predicted is None:
        return False
    if isinstance(reference, Fraction):
        if not isinstance(predicted, Fraction):
            return False
        return predicted == reference or math.isclose(float(predicted), float(reference), rel_tol=rel_tol)
    predicted_text = predicted if isinstance(predicted, str) else str(predicted)
    return _normalise_text(predicted_text) == _normalise_text(reference)


def accuracy_reward(completions: Sequence[Any], answer: Optional[Sequence[Any]] = None,
                    **kwargs: Any) -> list[Optional[float]]:
    r"""1.0 where the completion's final answer equals the row's `answer`, else 0.0; None without an answer.

    A tool conversation's final answer is its last assistant message (`final_answer_text`).

    The final answer is chosen by `extract_final_answer` (`\boxed{}`, then "answer is X", then "= X" on
    the last line, then the last number). Thousands separators, units and trailing text ("16 passengers.",
    "$5", "5 sweets"), negative numbers, decimals and fractions are read; numbers compare as values
    (`answers_match`).

    Example: answer "16"; "12 + 7 = 19, 19 - 3 = 16. There are 16 passengers." -> 1.0 (last line's
    "= 16"? no "=" there, so the last number, 16); "The answer is 1,000 apples" with answer "1000" -> 1.0.

    Args:
        completions: N completions (strings or message lists).
        answer: N reference answers (the dataset's `answer` column); absent: every reward is None.

    Returns:
        N values in {1.0, 0.0, None}.
    """
    if answer is None:
        return [None] * len(completions)
    rewards: list[Optional[float]] = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = parse_reference_answer(reference)
        if expected is None:
            rewards.append(None)
            continue
        rewards.append(1.0 if answers_match(extract_final_answer(final_answer_text(completion)), expected) else 0.0)
    return rewards


# ----------------------------------------------------------------------------------------------- format

# Reasoning inside one <think>...</think> block, then a non-empty answer; neither part may open or close
# another think block.
DEFAULT_FORMAT_PATTERN = r"<think>(?:(?!</?think>).)+</think>(?:(?!</?think>).)+"


def format_reward(completions: Sequence[Any], *, pattern: str = DEFAULT_FORMAT_PATTERN,
                  **kwargs: Any) -> list[float]:
    r"""1.0 where the whole completion matches `pattern`, else 0.0.

    Full-match semantics: the completion with leading and trailing whitespace removed must match the
    pattern from its first to its last character (`re.fullmatch`), with `re.DOTALL` (`.` also matches
    newlines). So the default, `<think>(?:(?!</?think>).)+</think>(?:(?!</?think>).)+`, gives 1.0 for
    "<think>\n12 + 4 = 16\n</think>\nThe answer is 16." and 0.0 for text before `<think>`, a missing
    `</think>`, a second think block, or nothing after `</think>`. Write `.*` at either end of your own
    pattern to allow text before or after.

    Args:
        completions: N completions (strings or message lists).
        pattern: the regular expression (the `format_reward_pattern` key).

    Returns:
        N values in {1.0, 0.0}.
    """
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]


# ----------------------------------------------------------------------------------------------- length


def length_reward(completion_ids: Sequence[Sequence[int]], *, max_length: int, window: int,
                  truncated: Optional[Sequence[bool]] = None, truncated_reward: float = -1.0,
                  **kwargs: Any) -> list[float]:
    r"""DAPO's soft overlong penalty (Yu et al. 2025, eq. 13), and a fixed penalty for cut-off completions.

    With L the completion's length in tokens (its stop token included), `L_max = max_length` and
    `W = window`:

        reward = truncated_reward                 if the completion was cut off,
                 0                                if L <= L_max - W,
                 ((L_max - W) - L) / W            if L_max - W < L <= L_max   (from 0 down to -1).

    Hand-computed, L_max = 100, W = 20: L = 80 -> 0; L = 90 -> (80 - 90) / 20 = -0.5; L = 100 without
    being cut off (it stopped on its last allowed token) -> -1.0; cut off -> `truncated_reward` (-1.0 by
    default). Shorter completions are not rewarded, only long ones penalised.

    Args:
        completion_ids: N completions' token ids (real tokens only, no padding).
        max_length: L_max, the generation limit (`max_completion_length`).
        window: W in [1, L_max], the soft-penalty window below L_max.
        truncated: N flags, True where generation hit L_max without a stop token. None: a completion of
            L_max tokens or more counts as cut off (without the flags a stop on the last token cannot be told
            apart).
        truncated_reward: the reward of a cut-off completion.

    Returns:
        N floats in [min(-1, truncated_reward), 0].
    """
    if not 1 <= window <= max_length:
        raise ValueError(f"length reward: window={window} must be in [1, max_length={max_length}].")
    if truncated is not None and len(truncated) != len(completion_ids):
        raise ValueError(f"length reward: {len(truncated)} truncated flags for {len(completion_ids)} completions.")
    start = max_length - window
    rewards = []
    for i, ids in enumerate(completion_ids):
        length = len(ids)
        cut_off = bool(truncated[i]) if truncated is not None else length >= max_length
        if cut_off:
            rewards.append(float(truncated_reward))
        elif length <= start:
            rewards.append(0.0)
        else:
            rewards.append(max(-1.0, (start - length) / window))
    return rewards


BUILTIN_NAMES = ("accuracy", "format", "length")

__all__ = [
    "BUILTIN_NAMES",
    "DEFAULT_FORMAT_PATTERN",
    "accuracy_reward",
    "answers_match",
    "completion_text",
    "final_answer_text",
    "extract_final_answer",
    "format_reward",
    "length_reward",
    "parse_number",
    "parse_reference_answer",
]
