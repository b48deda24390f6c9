"""Reward functions: built-ins against hand-computed values (accuracy on messy model outputs), user
functions by module and by file, the errors a bad function gives, and the NaN-aware weighted sum."""

from __future__ import annotations

import math
import sys
import textwrap
from fractions import Fraction

import pytest
import torch

from alignkit.errors import ConfigError
from alignkit.rewards import (
    RewardFunction,
    RewardFunctionArguments,
    RewardFunctions,
    RewardFunctionError,
    build_reward_functions,
    combine_rewards,
)
from alignkit.rewards.builtin import (
    DEFAULT_FORMAT_PATTERN,
    accuracy_reward,
    extract_final_answer,
    format_reward,
    length_reward,
)

# --------------------------------------------------------------------------------------------- accuracy

# (completion as a small model writes it, the row's answer, expected reward)
MESSY = [
    ("There are 16 passengers.", "16", 1.0),
    ("12 + 7 = 19, then 19 - 3 = 16. So there are 16 passengers on the bus now.", "16", 1.0),
    ("Each friend gets 5 sweets.", "5", 1.0),
    ("It costs $5.", "5", 1.0),
    ("The total is 1,000 apples", "1000", 1.0),
    ("The total is 1,000 apples", "1,000", 1.0),
    ("The temperature drops to -4 degrees.", "-4", 1.0),
    ("The temperature drops to \u22124 degrees.", "-4", 1.0),  # Unicode minus
    ("Half of 7 is 3.5 litres", "3.5", 1.0),
    ("3.50", "3.5", 1.0),
    (r"We compute 50 / 10 = 5. Therefore \boxed{5} sweets, not 10.", "5", 1.0),  # boxed wins over the last number
    (r"<think>60 minutes times 3 hours is 180</think> The answer is \boxed{180}.", "180", 1.0),
    (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
    ("The answer is 3/4 of the cake", "3/4", 1.0),
    ("The answer is 12. Check: 12 = 5 + 7", "12", 1.0),  # "answer is" before the last "="
    ("5 + 7 = 12 apples (there were 2 baskets)\nSo 5 + 7 = 12", "12", 1.0),  # "= X" on the last line
    ("Step 1: 8 + 11 = 19\nStep 2: 19 - 3 = 16\n**16**", "16", 1.0),
    ("The answer is 15 passengers.", "16", 0.0),
    ("16 passengers got on, 3 got off, so 13 remain?", "16", 0.0),  # the last number, 13
    ("I am not sure how to solve this.", "16", 0.0),  # no number at all
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # GSM8K answer column
    (r"\boxed{16", "16", 1.0),  # cut-off box: not a box, so the last number
    ("Answer: 1,234,567", "1234567", 1.0),
    ("x2 + y3: the answer is 7", "7", 1.0),
    ("10 - 4 = 6", "6", 1.0),
    ("Paris is the capital.", "16", 0.0),
    (r"\boxed{Paris}", "Paris", 1.0),  # a text answer compares as text
    ([{"role": "assistant", "content": "So 4 * 5 = 20."}], "20", 1.0),  # conversational shape
    # Tails of the bundled SmolLM2-135M-Instruct's greedy answers to demo_math_eval prompts (all wrong).
    ("Sara reads 10 more pages, so she reads 372 - 10 = 370 pages.\nTherefore, Sara has read 370 pages.\n"
     "#### 370\nThe answer is: 370", "454", 0.0),
    ("Sara reads 10 more pages, so she reads 372 - 10 = 370 pages.\n#### 370\nThe answer is: 370", "370", 1.0),
    ("Now, we divide the total number of sweets by the number of friends: 55 / 11 = 4.\n\nSo, each friend gets 4 "
     "sweets.", "4", 1.0),
    ("Ravi shares 24 sweets, so each friend gets 24/3 = 9 sweets.", "9", 1.0),  # "= 9", not the fraction 24/3
    ("So, Mei has 11 - 7 = 6 books left on the shelf.\n\nThe answer is 6.", "4", 0.0),
]


@pytest.mark.parametrize("completion,answer,expected", MESSY)
def test_accuracy_on_messy_outputs(completion, answer, expected):
    assert accuracy_reward([completion], answer=[answer]) == [expected]


def test_accuracy_without_an_answer_is_none():
    assert accuracy_reward(["16", "16", "16"], answer=[None, "", "16"]) == [None, None, 1.0]
    assert accuracy_reward(["16"]) == [None]
    assert accuracy_reward(["16"], answer=[16]) == [1.0]  # numeric column


def test_accuracy_of_a_tool_conversation_reads_its_last_assistant_message():
    """Joined, the tool results and the answer run together ("18" + "2" + "18" -> 18218); the answer is the last
    assistant turn, and a conversation that ends without one (cut after its calls) has no answer of its own."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": {"a": 9, "b": 9}}}]}
    answered = [call, {"role": "tool", "name": "add", "content": "18"}, {"role": "tool", "name": "add", "content": "2"},
                {"role": "assistant", "content": "18"}]
    wrong = [call, {"role": "tool", "name": "add", "content": "18"}, {"role": "assistant", "content": "It is 17."}]
    unanswered = [{"role": "assistant", "content": "Let me add 9 and 9."}, {"role": "tool", "content": "18"}]
    assert accuracy_reward([answered, wrong, unanswered], answer=["18"] * 3) == [1.0, 0.0, 0.0]


def test_final_answer_preference_order():
    text = "2 + 3 = 5, the answer is 5. \\boxed{6} then 7 = 8"
    assert extract_final_answer(text) == 6  # boxed first
    assert extract_final_answer("the answer is 5; later 7 = 8") == 5  # then "answer is"
    assert extract_final_answer("first 1 = 2\n3 + 4 = 7 and 9 more") == 7  # then "=" on the last line
    assert extract_final_answer("1, 2, 3") == 3  # then the last number
    assert extract_final_answer("1,00") == 0  # "1,00" is not a thousands group: 1 and 00
    assert extract_final_answer(r"\boxed{\dfrac{-1}{3}}") == Fraction(-1, 3)


# ----------------------------------------------------------------------------------------------- format


def test_format_default_pattern_full_match():
    completions = [
        "<think>\n12 + 4 = 16\n</think>\nThe answer is 16.",  # 1: the layout
        "  <think>x</think> 16  \n",  # 1: surrounding whitespace is stripped
        "Sure! <think>x</think> 16",  # 0: text before <think>
        "<think>x 16",  # 0: never closed
        "<think>x</think>",  # 0: no answer after it
        "<think>x</think>\n   ",  # 0: only whitespace after it
        "<think>a</think><think>b</think> 16",  # 0: a second block
        [{"role": "assistant", "content": "<think>r</think>A"}],  # 1: conversational shape
    ]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_format_custom_pattern_is_anchored_at_both_ends():
    assert format_reward(["Answer: 5", "Answer: 5 apples", "The Answer: 5"], pattern=r"Answer: \d+") == [1.0, 0.0, 0.0]
    assert format_reward(["line1\nAnswer: 5"], pattern=r".*Answer: \d+") == [1.0]  # DOTALL: . crosses lines
    assert DEFAULT_FORMAT_PATTERN.startswith("<think>")


# ----------------------------------------------------------------------------------------------- length


def test_length_soft_overlong_penalty_hand_computed():
    """L_max = 100, W = 20, so the penalty starts after 80 tokens:
    L=50 -> 0; L=80 -> 0; L=90 -> (80-90)/20 = -0.5; L=95 -> -15/20 = -0.75; L=100 (stopped) -> -1;
    cut off -> -1 (default) or the configured value."""
    ids = [[1] * n for n in (50, 80, 90, 95, 100, 100)]
    truncated = [False, False, False, False, False, True]
    assert length_reward(ids, max_length=100, window=20, truncated=truncated) == [0.0, 0.0, -0.5, -0.75, -1.0, -1.0]
    assert length_reward(ids, max_length=100, window=20, truncated=truncated, truncated_reward=-2.0)[-1] == -2.0
    # Without flags, a completion of L_max tokens counts as cut off.
    assert length_reward([[1] * 100, [1] * 99], max_length=100, window=20, truncated_reward=-3.0) == [-3.0, -0.95]
    with pytest.raises(ValueError, match="window"):
        length_reward(ids, max_length=10, window=20)


def test_length_reward_through_build_uses_the_stage_max_completion_length():
    """L_max = 10 (max_completion_length), default window = 10 // 5 = 2: L=8 -> 0, L=9 -> (8-9)/2 = -0.5."""
    args = RewardFunctionArguments(reward_funcs=["length"])
    rewards = build_reward_functions(args, max_completion_length=10)
    out = rewards(["p"] * 3, ["a", "b", "c"], {}, completion_ids=[[1] * 8, [1] * 9, [1] * 10],
                  truncated=[False, False, True])
    assert out[:, 0].tolist() == [0.0, -0.5, -1.0]
    with pytest.raises(ConfigError, match="L_max"):
        build_reward_functions(args)
    args = RewardFunctionArguments(reward_funcs=["length"], length_reward_max_tokens=100, length_reward_window=20,
                                   length_reward_truncated=-2.0)
    out = build_reward_functions(args)(["p", "p"], ["a", "b"], {}, completion_ids=[[1] * 90, [1] * 3],
                                       truncated=[False, True])
    assert out[:, 0].tolist() == [-0.5, -2.0]


# ---------------------------------------------------------------------------------------------- combine


def test_combine_rewards_hand_computed():
    """weights [1, 0.5, 2]:
    row 0: 1*1 + 0.5*0 + 2*0.25 = 1.5
    row 1: NaN skipped -> 0.5*1 + 2*(-1) = -1.5
    row 2: only the first: 1*0.5 = 0.5
    row 3: every function skipped -> NaN (TRL: unscorable), not 0."""
    nan = math.nan
    per_function = torch.tensor([[1.0, 0.0, 0.25], [nan, 1.0, -1.0], [0.5, nan, nan], [nan, nan, nan]])
    total = combine_rewards(per_function, torch.tensor([1.0, 0.5, 2.0]))
    assert total[:3].tolist() == [1.5, -1.5, 0.5]
    assert math.isnan(total[3].item())
    with pytest.raises(ValueError):
        combine_rewards(per_function, torch.tensor([1.0, 2.0]))


def test_combine_matches_trl_nansum():
    generator = torch.Generator().manual_seed(0)
    per_function = torch.randn(16, 3, generator=generator)
    per_function[per_function > 1.0] = math.nan
    weights = torch.tensor([0.3, -1.0, 2.0])
    expected = (per_function * weights.unsqueeze(0)).nansum(dim=1)  # TRL 1.16 GRPO's expression
    expected[torch.isnan(per_function).all(dim=1)] = math.nan
    torch.testing.assert_close(combine_rewards(per_function, weights), expected, equal_nan=True)


# ----------------------------------------------------------------------------------------- arguments


def test_arguments_parse_strings_and_check_weights():
    args = RewardFunctionArguments(reward_funcs="accuracy, format", reward_weights="1.0,0.5")
    assert args.reward_funcs == ["accuracy", "format"] and args.reward_weights == [1.0, 0.5]
    with pytest.raises(ConfigError, match="one weight per function"):
        RewardFunctionArguments(reward_funcs=["accuracy"], reward_weights=[1.0, 2.0])
    with pytest.raises(ConfigError, match="Did you mean `accuracy`"):
        RewardFunctionArguments(reward_funcs=["acuracy"])
    with pytest.raises(ConfigError, match="function name"):
        RewardFunctionArguments(reward_funcs=["mymodule:"])
    with pytest.raises(ConfigError, match="regular expression"):
        RewardFunctionArguments(reward_funcs=["format"], format_reward_pattern="(unclosed")
    with pytest.raises(ConfigError, match="at least one reward function"):
        build_reward_functions(RewardFunctionArguments())


def test_call_shape_dtype_names_and_weights():
    args = RewardFunctionArguments(reward_funcs=["accuracy", "format", "accuracy"], reward_weights=[1, 2, 3])
    rewards = build_reward_functions(args)
    assert rewards.names == ["accuracy", "format", "accuracy_2"]  # unique metric names
    assert rewards.weights.dtype == torch.float32 and rewards.weights.tolist() == [1.0, 2.0, 3.0]
    out = rewards(["q1", "q2"], ["<think>r</think> 16", "7"], {"answer": ["16", None]})
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    assert out[0].tolist() == [1.0, 1.0, 1.0]
    assert math.isnan(out[1, 0].item()) and out[1, 1].item() == 0.0


# ------------------------------------------------------------------------------------------ user functions

USER_FILE = """
    def count_words(prompts, completions, completion_ids=None, answer=None, **kwargs):
        return [float(len(c.split())) for c in completions]

    def skip_first(prompts, completions, **kwargs):
        return [None] + [1.0] * (len(completions) - 1)

    def raises_on_bad(prompts, completions, **kwargs):
        return [1.0 / (0 if c == "bad" else 1) for c in completions]

    def too_few(prompts, completions, **kwargs):
        return [1.0]

    def returns_string(prompts, completions, **kwargs):
        return [1.0, "high"]

    def returns_nan(prompts, completions, **kwargs):
        return [0.5, float("nan")]

    def no_kwargs(prompts, completions):
        return [1.0] * len(completions)

    def sees_columns(prompts, completions, difficulty, **kwargs):
        return [float(d) for d in difficulty]

    NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_file(tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    path = folder / "my_rewards.py"
    path.write_text(textwrap.dedent(USER_FILE), encoding="utf-8")
    return path


def _build(spec, config_dir=None):
    return build_reward_functions(RewardFunctionArguments(reward_funcs=[spec]), config_dir=config_dir)


def test_user_function_from_a_file_relative_to_the_config_dir(user_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # cwd holds no my_rewards.py: the config folder is looked in first
    rewards = _build("my_rewards.py:count_words", config_dir=str(user_file.parent))
    assert rewards.names == ["count_words"]
    assert rewards(["p", "p"], ["one two", "a b c"], {"answer": ["1", "2"]})[:, 0].tolist() == [2.0, 3.0]
    # Relative to the current directory, and absolute.
    assert _build("configs/my_rewards.py:count_words").names == ["count_words"]
    assert _build(f"{user_file}:skip_first")(["p", "p"], ["a", "b"], {})[:, 0].isnan().tolist() == [True, False]


def test_user_function_from_a_module(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    sys.modules.pop("my_rewards", None)
    rewards = _build("my_rewards:sees_columns")
    assert rewards(["p", "p"], ["a", "b"], {"difficulty": [3, 4]})[:, 0].tolist() == [3.0, 4.0]


@pytest.mark.parametrize("spec,message", [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'.*PYTHONPATH.*file.py:function"),
    ("missing.py:f", "file not found.*missing.py.*config file's folder"),
    ("my_rewards.py:count_wrds", "has no `count_wrds`.*Did you mean `count_words`"),
    ("my_rewards.py:NOT_A_FUNCTION", "is a int, not a function"),
    ("my_rewards.py:no_kwargs", r"must accept \*\*kwargs"),
])
def test_user_function_import_errors(user_file, spec, message):
    with pytest.raises(RewardFunctionError, match=message):
        _build(spec, config_dir=str(user_file.parent))


def test_a_file_that_fails_to_import_is_named(tmp_path):
    (tmp_path / "broken.py").write_text("import numpy\nraise RuntimeError('boom')\n", encoding="utf-8")
    with pytest.raises(RewardFunctionError, match=r"broken.py:f.*raised RuntimeError: boom"):
        _build("broken.py:f", config_dir=str(tmp_path))


@pytest.mark.parametrize("function,message", [
    ("raises_on_bad", r"raises_on_bad raised ZeroDivisionError: .* on row 1 of 2 \(prompt 'q1', completion 'bad'"),
    ("too_few", "too_few returned 1 values for 2 completions"),
    ("returns_string", r"returns_string: row 1 got 'high', which is not a number.*Row 1: prompt 'q1', completion 'bad'"),
    ("returns_nan", r"returns_nan: row 1 got nan, which is not finite. Return a finite float, or None"),
])
def test_bad_user_functions_name_the_function_and_the_first_bad_row(user_file, function, message):
    rewards = _build(f"my_rewards.py:{function}", config_dir=str(user_file.parent))
    with pytest.raises(RewardFunctionError, match=message):
        rewards(["q0", "q1"], ["good", "bad"], {"answer": ["1", "2"]})


def test_columns_reach_user_functions_and_lengths_are_checked(user_file):
    rewards = _build("my_rewards.py:sees_columns", config_dir=str(user_file.parent))
    with pytest.raises(RewardFunctionError, match="sees_columns raised TypeError.*difficulty"):
        rewards(["q"], ["c"], {})  # the column the function needs is absent
    with pytest.raises(ValueError, match="column 'difficulty' has 1 values for 2"):
        rewards(["q", "q"], ["c", "c"], {"difficulty": [1]})


def test_shared_keywords_reach_every_function_unsliced():
    """TRL gives reward functions `trainer_state`; callers pass such values once, not per row."""
    seen = []

    def spy(prompts, completions, trainer_state=None, **kwargs):
        seen.append((trainer_state, kwargs["answer"]))
        return [1.0 / len(c) for c in completions]  # raises on an empty completion

    rewards = RewardFunctions([RewardFunction("spy", "spy", spy)], [1.0])
    state = {"global_step": 3}
    rewards(["q0", "q1"], ["ab", "abcd"], {"answer": ["1", "2"]}, trainer_state=state)
    assert seen == [(state, ["1", "2"])]
    with pytest.raises(RewardFunctionError, match=r"spy raised ZeroDivisionError.*row 1 of 2.*answer='2'"):
        rewards(["q0", "q1"], ["ab", ""], {"answer": ["1", "2"]}, trainer_state=state)
    assert seen[-1] == (state, ["2"])  # the row-by-row search slices columns, never the shared state
    with pytest.raises(ValueError, match="clash"):
        rewards(["q"], ["a"], {"answer": ["1"]}, answer="x")


def test_a_stage_arguments_class_can_subclass_the_reward_keys():
    from dataclasses import dataclass, field

    @dataclass
    class StageArguments(RewardFunctionArguments):
        max_completion_length: int = field(default=16)

    args = StageArguments(reward_funcs="accuracy,length", reward_weights=[1, 0.5])
    assert args.reward_funcs == ["accuracy", "length"] and args.reward_weights == [1.0, 0.5]
    rewards = build_reward_functions(args)  # L_max from the stage's max_completion_length: 16, W = 3
    out = rewards(["q"], ["5"], {"answer": ["5"]}, completion_ids=[[1] * 14], truncated=[False])
    assert out[0].tolist() == [1.0, pytest.approx(-1 / 3)]  # (16 - 3 - 14) / 3


def test_reward_arguments_convert_command_line_strings():
    from alignkit.evaluate import reward_arguments

    args = reward_arguments(["accuracy", "length"], {"reward_weights": "1,0.5", "length_reward_window": "4",
                                                     "length_reward_truncated": "-2"})
    assert args.reward_weights == [1.0, 0.5] and args.length_reward_window == 4
    assert args.length_reward_truncated == -2.0


# ------------------------------------------------------------------------------------------------- timeouts

SLOW_FILE = """
    import signal
    import threading

    import torch

    release = threading.Event()  # the test sets it, so no worker thread outlives the test
    calls = []

    def waits(prompts, completions, **kwargs):
        calls.append((threading.current_thread() is threading.main_thread(), torch.is_grad_enabled()))
        if any(c == "hang" for c in completions):
            release.wait(60)
        return [1.0] * len(completions)

    def raises_then_hangs_on_its_row(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("batch")
        if completions[0] == "hang":
            release.wait(60)
        return [1.0]

    def sets_an_alarm(prompts, completions, **kwargs):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        return [1.0] * len(completions)
"""


@pytest.fixture
def slow_module(tmp_path):
    (tmp_path / "slow_rewards.py").write_text(textwrap.dedent(SLOW_FILE), encoding="utf-8")
    modules = []

    def build(function, **keys):
        rewards = build_reward_functions(RewardFunctionArguments(reward_funcs=[f"slow_rewards.py:{function}"], **keys),
                                         config_dir=str(tmp_path))
        modules.append(sys.modules[rewards.functions[0].function.__module__])
        return rewards

    yield build
    for module in modules:
        module.release.set()


def test_a_reward_function_that_does_not_return_stops_with_the_rows_it_held(slow_module):
    import time

    rewards = slow_module("waits", reward_timeout=0.3)
    start = time.monotonic()
    expected = (r"reward function waits did not return within reward_timeout=0\.3 s, scoring rows 0-2 of 3 \(prompt "
                r"of row 0: 'q0'\).*left running in a background thread.*last checkpoint resumes.*"
                r"slow_rewards\.py:waits.*raise reward_timeout")
    with pytest.raises(RewardFunctionError, match=expected):
        rewards(["q0", "q1", "q2"], ["ok", "hang", "ok"], {})
    assert time.monotonic() - start < 10


def test_timed_calls_run_in_a_worker_with_the_callers_grad_mode_and_untimed_ones_here(slow_module):
    timed = slow_module("waits")  # the default reward_timeout
    assert RewardFunctionArguments().reward_timeout == 300.0
    with torch.no_grad():
        assert timed(["q"], ["ok"], {}).tolist() == [[1.0]]
    untimed = slow_module("waits", reward_timeout=0)
    assert untimed(["q"], ["ok"], {}).tolist() == [[1.0]]
    calls = sys.modules[timed.functions[0].function.__module__].calls
    assert calls == [(False, False), (True, True)]
    assert build_reward_functions(RewardFunctionArguments(reward_funcs=["accuracy"])).functions[0].timeout is None
    with pytest.raises(ConfigError, match="reward_timeout=-1.0 must be a number of seconds >= 0"):
        RewardFunctionArguments(reward_funcs=["accuracy"], reward_timeout=-1.0)


def test_the_row_search_after_an_error_is_timed_too(slow_module):
    rewards = slow_module("raises_then_hangs_on_its_row", reward_timeout=0.3)
    with pytest.raises(RewardFunctionError, match=r"did not return within reward_timeout=0\.3 s, scoring row 1 of 2"):
        rewards(["q0", "q1"], ["ok", "hang"], {})


def test_a_function_that_needs_the_main_thread_is_told_how(slow_module):
    with pytest.raises(RewardFunctionError, match=r"sets_an_alarm raised ValueError: .*main thread.*reward_timeout: 0"):
        slow_module("sets_an_alarm")(["q"], ["ok"], {})
    assert slow_module("sets_an_alarm", reward_timeout=None)(["q"], ["ok"], {}).tolist() == [[1.0]]
