"""Reward functions for the online stages (GRPO, PPO): the config keys, the specs, the calls, the sum.

`reward_funcs` lists specs, each one of:

- a built-in name: `accuracy`, `format`, `length` (`alignkit.rewards.builtin`);
- a user function, `package.module:function` (imported from the Python path) or
  `path/to/file.py:function` (a relative path is looked up in the folder of the config file first, then
  in the current directory); the function has TRL's signature, `f(prompts, completions, completion_ids,
  **kwargs)` with the dataset's other columns (e.g. `answer`) as keyword arguments, and returns one float
  or None per completion;
- a reward model: the output_dir of a `stage: rm` run (or an exported reward model), see
  `alignkit.rewards.model`.

`build_reward_functions` turns the specs into a `RewardFunctions`, whose call gives an `[N, F]` float32
tensor (NaN where a function returned None), and `combine_rewards` their weighted sum. Every value a
function returns is checked as it comes back: a function that raises, returns the wrong number of values,
or something that is not a finite number or None stops the run with a `RewardFunctionError` naming the
function and the first bad row.

A user function that never returns would hang the run: each call of one runs in a worker thread that is given
`reward_timeout` seconds (`call_with_timeout`). A call that takes longer stops the run with a
`RewardFunctionError` naming the function and the rows it was scoring; the run's last checkpoint stays as it
was, so the same command resumes once the function is fixed. Python cannot stop a thread, so the stuck call is
left running in a daemon thread, which does not keep the process alive: `alignkit train` and `alignkit eval`
exit as soon as the error is reported. A worker thread rather than a subprocess because a function does not
have to be picklable (a `file.py:function` is imported under a private module name), may close over large
objects, and keeps its module's state between calls, as it does without a timeout; the cost is a thread start
per call, microseconds against a generation round. Built-ins and reward models are alignkit's own code and run
in the calling thread, untimed.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import ConfigError, RewardFunctionError
from ..files import resolve_config_path
from .arguments import RewardFunctionArguments, require_reward_funcs
from .builtin import BUILTIN_NAMES, accuracy_reward, format_reward, length_reward


# ------------------------------------------------------------------------------------------ user functions


def _resolve_file(path_text: str, spec: str, config_dir: Optional[str], kind: str = "reward function") -> Path:
    try:
        return resolve_config_path(path_text, config_dir)
    except FileNotFoundError as err:
        raise RewardFunctionError(f"{kind} {spec!r}: file not found ({err}). Relative paths are "
                                  "resolved against the config file's folder, then the current directory.") from None


def _import_file(path: Path, spec: str, kind: str = "reward function"):
    # A name unique per file, so two reward files called `rewards.py` do not replace each other.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    module_name = f"alignkit_user_rewards.{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardFunctionError(f"{kind} {spec!r}: {path} cannot be imported as a Python file.")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    # The file's own folder is on the path while it runs, so it can import modules beside it.
    sys.path.insert(0, str(path.parent))
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise RewardFunctionError(f"{kind} {spec!r}: importing {path} raised {type(err).__name__}: {err}. "
                                  "Fix the file so that `python " + str(path) + "` runs.") from err
    finally:
        sys.path.remove(str(path.parent))
    return module


def load_user_function(spec: str, config_dir: Optional[str] = None, *, kind: str = "reward function",
                       require_kwargs: bool = True) -> Callable[..., Any]:
    """Import the function a `module:function` or `file.py:function` spec names.

    Args:
        spec: `package.module:function` or `path/to/file.py:function`.
        config_dir: folder of the config file; relative file paths are looked up there first, then in the
            current directory.
        kind: what the object is, for messages (`tool` and `environment_factory` load this way too).
        require_kwargs: refuse a function without `**kwargs` (reward functions get the dataset's columns).

    Raises:
        RewardFunctionError: the module or file does not import, has no such function, or the function
            does not take `**kwargs` (TRL passes the dataset's columns as keyword arguments).
    """
    target, _, function_name = spec.rpartition(":")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    if is_file:
        path = _resolve_file(target, spec, config_dir, kind)
        module = _import_file(path, spec, kind)
        where = str(path)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as err:
            raise RewardFunctionError(
                f"{kind} {spec!r}: cannot import module {target!r} ({err}). Install the package or add its "
                "folder to PYTHONPATH, or name a file instead: `path/to/file.py:function`.") from err
        except Exception as err:
            raise RewardFunctionError(f"{kind} {spec!r}: importing {target!r} raised "
                                      f"{type(err).__name__}: {err}.") from err
        where = f"module {target}"
    function = getattr(module, function_name, None)
    if function is None:
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)
        close = difflib.get_close_matches(function_name, available, n=1)
        if close:
            hint = f" Did you mean `{close[0]}`?"
        else:
            hint = f" It defines: {', '.join(available)}." if available else ""
        raise RewardFunctionError(f"{kind} {spec!r}: {where} has no `{function_name}`.{hint}")
    if not callable(function):
        raise RewardFunctionError(f"{kind} {spec!r}: `{function_name}` in {where} is a "
                                  f"{type(function).__name__}, not a function.")
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        parameters = None  # builtins without a signature: trust them
    if require_kwargs and parameters is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        raise RewardFunctionError(
            f"{kind} {spec!r}: `{function_name}` must accept **kwargs: it is called as "
            "f(prompts=..., completions=..., completion_ids=..., **dataset_columns) (TRL's signature). "
            f"Add `**kwargs` to its parameters.")
    return function


# --------------------------------------------------------------------------------------- checked calls


def _preview(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _row_kwargs(kwargs: dict[str, Any], row: int, per_row: set[str]) -> dict[str, Any]:
    return {k: (v[row:row + 1] if k in per_row and v is not None else v) for k, v in kwargs.items()}


def check_reward_values(name: str, values: Any, num_rows: int, prompts: Sequence[Any],
                        completions: Sequence[Any]) -> list[float]:
    """One function's output as floats (NaN for None), or a `RewardFunctionError` naming the first bad row.

    Accepted per completion: an int, float, bool, numpy number or 0-d tensor that is finite, or None
    (the function does not apply: NaN here, left out of the means as in TRL). NaN and infinities are
    refused: return None to skip a completion.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist() if values.dim() <= 1 else values
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise RewardFunctionError(f"reward function {name} returned {type(values).__name__} {_preview(values)}; it "
                                  f"must return a list of {num_rows} floats (or None), one per completion.")
    if len(values) != num_rows:
        raise RewardFunctionError(f"reward function {name} returned {len(values)} values for {num_rows} completions; "
                                  "return exactly one float (or None) per completion, in order.")
    out: list[float] = []
    for row, value in enumerate(values):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if value is None:
            out.append(math.nan)
            continue
        number = float(value) if isinstance(value, numbers.Real) else None
        if number is None or not math.isfinite(number):
            problem = "not a number" if number is None else "not finite"
            raise RewardFunctionError(
                f"reward function {name}: row {row} got {_preview(value)}, which is {problem}. Return a finite "
                f"float, or None to skip a completion. Row {row}: prompt {_preview(prompts[row])}, completion "
                f"{_preview(completions[row])}.")
        out.append(number)
    # Checked again as the float32 the rewards are kept in: a finite float beyond float32's range (1e39) is inf there.
    overflow = torch.isinf(torch.tensor(out, dtype=torch.float32))
    if overflow.any():
        row = int(overflow.nonzero()[0])
        raise RewardFunctionError(
            f"reward function {name}: row {row} got {_preview(values[row])}, which is beyond float32's range "
            f"(|r| <= 3.4e38) and would become infinite. Return a smaller float, or None to skip a completion. "
            f"Row {row}: prompt {_preview(prompts[row])}, completion {_preview(completions[row])}.")
    return out


class CallTimedOut(Exception):
    """`call_with_timeout`: the call did not return in time (it is still running in its thread)."""


def call_with_timeout(function: Callable[..., Any], kwargs: dict[str, Any], timeout: Optional[float],
                      name: str = "call") -> Any:
    """`function(**kwargs)` in a daemon worker thread given `timeout` seconds; None or 0: called here, untimed.

    Python cannot stop a thread, so a call that overruns is abandoned: it goes on running (a daemon thread does
    not keep the process alive) and the caller gets `CallTimedOut`, on which it should stop. What the function
    returns, or raises, is handed back as if it had been called here, and it runs with the caller's per-thread
    torch state (grad mode, current CUDA device).

    Raises:
        CallTimedOut: no return within `timeout` seconds.
    """
    if not timeout:
        return function(**kwargs)
    outcome: dict[str, Any] = {}
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                outcome["value"] = function(**kwargs)
        except BaseException as err:  # noqa: BLE001 - handed back to the caller's thread below
            outcome["error"] = err

    worker = threading.Thread(target=run, name=f"alignkit {name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise CallTimedOut(f"{name} did not return within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@dataclass
class RewardFunction:
    """One named reward function and how to call it.

    Attributes:
        name: used in metric names (`rewards/<name>/mean`) and errors.
        spec: what the user wrote in `reward_funcs`.
        function: called as `function(prompts=..., completions=..., completion_ids=..., **columns)`.
        timeout: seconds a call may take (`reward_timeout`, `call_with_timeout`); None: untimed.
    """

    name: str
    spec: str
    function: Callable[..., Any]
    timeout: Optional[float] = None

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Optional[list],
                 columns: dict[str, list], shared: Optional[dict[str, Any]] = None) -> list[float]:
        kwargs = {"prompts": list(prompts), "completions": list(completions), "completion_ids": completion_ids,
                  **columns, **(shared or {})}
        try:
            values = self._call(kwargs)
        except CallTimedOut:
            raise self._timed_out(kwargs, range(len(prompts)), len(prompts)) from None
        except RewardFunctionError:
            raise
        except Exception as err:
            per_row = {"prompts", "completions", "completion_ids", *columns}
            raise self._locate_failure(err, kwargs, len(prompts), per_row) from err
        return check_reward_values(self.name, values, len(prompts), prompts, completions)

    def _call(self, kwargs: dict[str, Any]) -> Any:
        return call_with_timeout(self.function, kwargs, self.timeout, name=f"reward function {self.name}")

    def _timed_out(self, kwargs: dict[str, Any], rows: range, num_rows: int) -> RewardFunctionError:
        where = f"row {rows[0]}" if len(rows) == 1 else f"rows {rows[0]}-{rows[-1]}"
        return RewardFunctionError(
            f"reward function {self.name} did not return within reward_timeout={self.timeout:g} s, scoring {where} "
            f"of {num_rows} (prompt of row {rows[0]}: {_preview(kwargs['prompts'][rows[0]])}). Python cannot stop "
            "the call, so it is left running in a background thread and the run stops here; its last checkpoint "
            f"resumes with the same command. Fix the function ({self.spec}) if it hangs (an endless loop, a network "
            "call without a timeout of its own), or raise reward_timeout if it is only slow.")

    def _locate_failure(self, err: Exception, kwargs: dict[str, Any], num_rows: int,
                        per_row: set[str]) -> RewardFunctionError:
        """The batch call raised: call the function on one row at a time to name the first row that fails."""
        first = f"{type(err).__name__}: {err}"
        for row in range(num_rows):
            try:
                self._call(_row_kwargs(kwargs, row, per_row))
            except CallTimedOut:
                return self._timed_out(kwargs, range(row, row + 1), num_rows)
            except Exception as row_err:  # noqa: BLE001 - any exception is the user's bug to report
                hint = ""
                if self.timeout and "main thread" in str(row_err):  # e.g. signal.alarm, refused in a worker thread
                    hint = (" (the call runs in a worker thread, for reward_timeout; reward_timeout: 0 calls it in the "
                            "main thread, untimed)")
                return RewardFunctionError(
                    f"reward function {self.name} raised {type(row_err).__name__}: {row_err}{hint} on row {row} of "
                    f"{num_rows} (prompt {_preview(kwargs['prompts'][row])}, completion "
                    f"{_preview(kwargs['completions'][row])}{_column_preview(kwargs, row, per_row)}). Fix the "
                    f"function ({self.spec}) or return None for rows it cannot score.")
        return RewardFunctionError(f"reward function {self.name} raised {first} on a batch of {num_rows} rows, though "
                                   f"no row alone raised. Fix the function ({self.spec}).")


def _column_preview(kwargs: dict[str, Any], row: int, per_row: set[str]) -> str:
    extra = [f"{k}={_preview(v[row], 40)}" for k, v in kwargs.items()
             if k in per_row and k not in ("prompts", "completions", "completion_ids")]
    return (", " + ", ".join(extra)) if extra else ""


class RewardFunctions:
    """The reward functions of a run, called together.

    Attributes:
        names: one per function, unique (`rewards/<name>/mean`).
        weights: [F] float32, the `reward_weights`.
        functions: the `RewardFunction`s, in `reward_funcs` order.
    """

    def __init__(self, functions: list[RewardFunction], weights: Sequence[float]) -> None:
        if len(functions) != len(weights):
            raise ValueError(f"{len(functions)} reward functions but {len(weights)} weights.")
        self.functions = functions
        self.names = [f.name for f in functions]
        self.weights = torch.tensor(list(weights), dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.functions)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], columns: Optional[dict[str, list]] = None,
                 *, completion_ids: Optional[Sequence[Sequence[int]]] = None,
                 truncated: Optional[Sequence[bool]] = None, **shared: Any) -> torch.Tensor:
        """Every function's reward for every completion.

        Args:
            prompts: N prompts (strings, or message lists for conversational rows).
            completions: N completions (strings, or `[{"role": "assistant", "content": text}]`).
            columns: the dataset's other columns, each a list of N values (passed as keyword arguments).
            completion_ids: N lists of token ids (real tokens only; the `length` reward needs them).
            truncated: N flags, True where a completion hit the length limit without stopping (the `length`
                reward's cut-off case); passed to user functions as the `truncated` keyword too.
            **shared: keyword arguments passed to every function as they are, not per row (e.g.
                `trainer_state=self.state`, which TRL gives its reward functions).

        Returns:
            [N, F] float32 on the CPU, NaN where a function returned None.

        Raises:
            RewardFunctionError: a function raised, returned the wrong number of values, or a non-number.
        """
        num_rows = len(prompts)
        if len(completions) != num_rows:
            raise ValueError(f"{num_rows} prompts but {len(completions)} completions.")
        columns = dict(columns or {})
        for key, values in columns.items():
            if len(values) != num_rows:
                raise ValueError(f"column {key!r} has {len(values)} values for {num_rows} completions.")
        if completion_ids is not None:
            completion_ids = [list(map(int, ids)) for ids in completion_ids]
        if truncated is not None:
            columns["truncated"] = [bool(t) for t in truncated]
        rewards = torch.empty(num_rows, len(self.functions), dtype=torch.float32)
        clash = sorted(set(shared) & (set(columns) | {"prompts", "completions", "completion_ids"}))
        if clash:
            raise ValueError(f"shared keyword(s) {clash} clash with the per-row arguments of the same name.")
        for column, function in enumerate(self.functions):
            rewards[:, column] = torch.tensor(function(prompts, completions, completion_ids, columns, shared),
                                              dtype=torch.float32)
        return rewards


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The reward of each completion: the weighted sum over functions, NaN (a None) counted as absent.

    As TRL 1.16's GRPO (`(rewards_per_func * weights).nansum(dim=1)`), and a completion that every function
    skipped stays NaN (TRL marks it unscorable: left out of the baselines, advantage 0) instead of being
    summed to 0.

    Args:
        per_function: [N, F] rewards, NaN where a function returned None.
        weights: [F] weights.

    Returns:
        [N] rewards.
    """
    if per_function.dim() != 2 or weights.shape != (per_function.shape[1],):
        raise ValueError(f"per_function must be [N, F] and weights [F]; got {tuple(per_function.shape)} and "
                         f"{tuple(weights.shape)}.")
    total = (per_function * weights.to(per_function)).nansum(dim=1)
    return total.masked_fill(torch.isnan(per_function).all(dim=1), math.nan)


# -------------------------------------------------------------------------------------------- building


def _builtin(name: str, args: RewardFunctionArguments, max_completion_length: Optional[int]) -> Callable[..., Any]:
    if name == "accuracy":
        return accuracy_reward
    if name == "format":
        pattern = args.format_reward_pattern

        def format_(completions, **kwargs):
            return format_reward(completions, pattern=pattern)

        return format_
    max_length = args.length_reward_max_tokens or max_completion_length
    if max_length is None:
        raise ConfigError("reward `length` needs L_max: set length_reward_max_tokens (or max_completion_length).")
    window = args.length_reward_window or max(1, max_length // 5)
    if window > max_length:
        raise ConfigError(f"length_reward_window={window} is larger than L_max={max_length}; give a window of at "
                          "most L_max tokens.")
    truncated_reward = args.length_reward_truncated

    def length_(completions, completion_ids=None, truncated=None, **kwargs):
        if completion_ids is None:
            raise RewardFunctionError("reward `length` needs completion_ids (the completions' token ids); the "
                                      "caller passed none.")
        return length_reward(completion_ids, max_length=max_length, window=window, truncated=truncated,
                             truncated_reward=truncated_reward)

    return length_


def _unique_names(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def check_reward_functions(args: RewardFunctionArguments, *, config_dir: Optional[str] = None,
                           max_completion_length: Optional[int] = None, key: str = "reward_funcs") -> None:
    """What `build_reward_functions` would refuse that needs no model: call it before the model loads.

    Each built-in gets its settings checked, each user function is imported and looked up (module, file,
    function name, `**kwargs`), and each reward model folder is found and checked for a trained score head
    (`reward_model.check_reward_model_dir`); so does PPO's `reward_model` when `args` has one, under that key.

    Args:
        args: the stage's arguments (a `RewardFunctionArguments` subclass).
        config_dir: folder of the config file, where relative paths are looked up first.
        max_completion_length: L_max of the `length` reward, as `build_reward_functions` takes it.
        key: the key or flag that gave `reward_funcs`, for the messages (`alignkit eval` gives `--reward`).

    Raises:
        ConfigError: a bad setting, no such reward model folder, or one without a trained score head.
        RewardFunctionError: a user function does not import.
    """
    from .model import resolve_reward_model_dir
    from .reward_model import check_reward_model_dir

    reward_model = getattr(args, "reward_model", None)
    if reward_model:
        check_reward_model_dir(resolve_reward_model_dir(reward_model, config_dir, key="reward_model"),
                               key="reward_model")
    if max_completion_length is None:
        max_completion_length = getattr(args, "max_completion_length", None)
    for spec in args.reward_funcs:
        if spec in BUILTIN_NAMES:
            _builtin(spec, args, max_completion_length)
        elif ":" in spec:
            load_user_function(spec, config_dir)
        else:
            check_reward_model_dir(resolve_reward_model_dir(spec, config_dir, key=key), key=key)


def build_reward_functions(
    args: RewardFunctionArguments,
    *,
    model: Any = None,
    formatter: Any = None,
    model_args: Any = None,
    config_dir: Optional[str] = None,
    max_completion_length: Optional[int] = None,
) -> RewardFunctions:
    """Turn `reward_funcs` into callable, checked reward functions.

    Args:
        args: the stage's arguments (a `RewardFunctionArguments` subclass).
        model: the policy (a PeftModel under LoRA); reward-model specs on its base share it.
        formatter: the run's `ChatFormatter`; reward models score text rendered with it.
        model_args: the run's `ModelArguments` (dtype, attention kernel for a reward model loaded on its own).
        config_dir: folder of the config file, where relative `file.py:function` paths are looked up first.
        max_completion_length: L_max of the `length` reward when `length_reward_max_tokens` is unset
            (default: `args.max_completion_length` when the stage has that key).

    Raises:
        ConfigError: no reward function, or a setting a built-in needs is missing.
        RewardFunctionError: a user function does not import.
    """
    require_reward_funcs(args)
    if max_completion_length is None:
        max_completion_length = getattr(args, "max_completion_length", None)
    functions, names, timeouts = [], [], []
    for spec in args.reward_funcs:
        if spec in BUILTIN_NAMES:
            function, name = _builtin(spec, args, max_completion_length), spec
        elif ":" in spec:
            function = load_user_function(spec, config_dir)
            name = getattr(function, "__name__", None) or spec.rpartition(":")[2]
        else:
            from .model import load_reward_function

            function = load_reward_function(spec, args, model=model, formatter=formatter, model_args=model_args,
                                            config_dir=config_dir)
            name = function.name
        functions.append(function)
        names.append(name)
        timeouts.append(args.reward_timeout if ":" in spec else None)  # only the user's code is timed
    weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(functions)
    return RewardFunctions([RewardFunction(name, spec, function, timeout) for name, spec, function, timeout
                            in zip(_unique_names(names), args.reward_funcs, functions, timeouts)], weights)


__all__ = [
    "CallTimedOut",
    "RewardFunction",
    "RewardFunctionArguments",
    "RewardFunctionError",
    "RewardFunctions",
    "build_reward_functions",
    "call_with_timeout",
    "check_reward_functions",
    "check_reward_values",
    "combine_rewards",
    "load_user_function",
]
