"""Tool-calling rollouts: the policy calls Python tools mid-completion and reads their results (TRL 1.16's semantics).

With `tools` (and/or `environment_factory`) set, a GRPO or RLOO rollout is a conversation: the policy generates a turn;
the turn's tool calls, written in the template's format (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
for ChatML/Qwen, a bare JSON object for llama3), are parsed and each is run; the results are appended as a tool turn
(the template's tool-response tokens) and the policy generates again, until a turn has no call, the completion would
pass `max_completion_length`, or `max_tool_calling_iterations` tool turns have run. Rows of a batch finish at
different turns; each turn generates only for the rows still calling.

What the rest of the stage sees (`ToolRollout`):
- one completion per row: every turn's tokens and every tool turn's tokens, concatenated (`completion_ids`), so
  `max_completion_length` counts the whole multi-turn completion, as TRL counts it;
- `tool_mask`: 1 on the policy's own tokens, 0 on tool-response tokens. Those are context: in the attention, out of
  the loss, the KL and the entropy (the stage multiplies its loss mask by it);
- `messages`: the completion as TRL's reward functions receive it, a list of assistant and tool messages.

Failures never stop the run: a call whose JSON does not parse, an unknown tool name, a tool that raises, one that
runs past `tool_timeout` (left behind in its daemon thread, as Python cannot stop a thread) all become a tool message
`{'error': '...'}` saying what went wrong (TRL's form) and count in `tools/failure_frequency`. A result longer than
`max_tool_output_chars` is cut, with a note saying so.

Trust: tools and environments are the user's own Python, imported like reward functions (`file.py:function`,
`module:function`). The model chooses only which of the given functions to call and with what arguments; nothing
here runs a shell or evaluates code on the model's behalf.

Parts:
- loading and checking (`load_tools`, `load_environment_factory`, `check_tool_keys`), before any model loads;
- `ToolCallFormat` / `parse_tool_calls`: the template's call syntax, found by rendering a probe call;
- `run_tool_call`: one call, timed, capped, never raising;
- `tool_suffix_ids`: the tokens of a tool turn, as the template renders it after a reply (TRL's slicing);
- `tool_rollout`: the multi-turn loop over a batch, given a function that generates one turn for some rows.
"""

from __future__ import annotations

import inspect
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..errors import ConfigError, RewardFunctionError

# Methods of an environment that are its contract with the trainer, not tools (TRL 1.16).
ENVIRONMENT_RESERVED = ("reset", "get_reward")
# The bucket of per-tool counts for calls that name no known tool (malformed JSON, unknown names).
UNKNOWN_TOOL = "unknown"


# ------------------------------------------------------------------------------------------ loading


def tool_schema(function: Callable[..., Any], spec: str = "") -> dict[str, Any]:
    """The JSON schema the prompt shows for a tool, from its type hints and docstring (transformers'
    `get_json_schema`, which TRL 1.16 uses through `apply_chat_template(tools=...)`).

    Raises:
        ConfigError: the function lacks a docstring, an argument description or a type hint.
    """
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as err:  # DocstringParsingException, TypeHintParsingException
        raise ConfigError(
            f"tools: {spec or function.__name__!r}: {err}. A tool needs type hints on every argument and a Google-style "
            "docstring with a one-line description and an `Args:` entry per argument (the prompt shows the model "
            "this schema).") from None


def _load(spec: str, config_dir: Optional[str], key: str) -> Any:
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{key}: {spec!r} is not `path/to/file.py:name` or `package.module:name`.")
    from ..rewards.functions import load_user_function

    try:
        return load_user_function(spec, config_dir, kind=key, require_kwargs=False)
    except RewardFunctionError as err:
        raise ConfigError(str(err)) from None


def load_tools(specs: Sequence[str], config_dir: Optional[str] = None) -> list[Callable[..., Any]]:
    """The functions `tools` names, each checked to give a schema; names must be unique.

    Raises:
        ConfigError: a spec does not import, is not a function, has no usable schema, or two share a name.
    """
    functions = []
    for spec in specs:
        function = _load(spec, config_dir, "tools")
        if not inspect.isfunction(function) and not inspect.ismethod(function):
            raise ConfigError(f"tools: {spec!r} is a {type(function).__name__}, not a function.")
        if inspect.iscoroutinefunction(function):
            raise ConfigError(f"tools: {spec!r} is an async function; give a plain function (wrap it with "
                              "asyncio.run).")
        tool_schema(function, spec)
        functions.append(function)
    _check_unique([f.__name__ for f in functions], "tools")
    return functions


def _check_unique(names: Sequence[str], key: str) -> None:
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise ConfigError(f"{key}: two tools are named {', '.join(repeated)}; the model calls tools by name, so "
                          "rename one.")


def environment_methods(environment: Any) -> list[Callable[..., Any]]:
    """An environment's tools: its public methods other than `reset` and `get_reward`, bound to it (TRL 1.16 lists
    them on the class, so properties are not evaluated)."""
    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ENVIRONMENT_RESERVED and not name.startswith("_")]


def load_environment_factory(spec: str, config_dir: Optional[str] = None,
                             tools: Sequence[Callable[..., Any]] = (), key: str = "environment_factory"
                             ) -> Callable[[], Any]:
    """The class (or factory) `environment_factory` names, probed once: it must build an instance with a `reset`
    method, whose public methods are tools with schemas, named apart from `tools`.

    Args:
        key: the setting named in the messages (`--environment-factory` for `alignkit eval` and `alignkit chat`).

    Raises:
        ConfigError: the spec does not import, the instance has no `reset`, a method has no usable schema.
    """
    factory = _load(spec, config_dir, key)
    try:
        instance = factory()
    except Exception as err:
        raise ConfigError(f"{key}: {spec!r}() raised {type(err).__name__}: {err}. It is called with no "
                          "arguments, once per rollout row.") from None
    if not callable(getattr(instance, "reset", None)):
        raise ConfigError(f"{key}: {spec!r} builds a {type(instance).__name__} without a `reset` method. "
                          "TRL's contract: reset(**row) -> str | None (text appended to the prompt's last message), "
                          "and each public method is a tool.")
    methods = environment_methods(instance)
    for method in methods:
        tool_schema(method, f"{spec}.{method.__name__}")
    _check_unique([f.__name__ for f in tools] + [m.__name__ for m in methods], key)
    return factory


def check_tool_keys(args: Any, config_dir: Optional[str] = None) -> Optional[Callable[[], Any]]:
    """Load and check `tools` and `environment_factory` (before any model loads); returns the factory (None without
    one); no-op when neither is set."""
    tools = load_tools(args.tools or [], config_dir)
    if args.environment_factory:
        return load_environment_factory(args.environment_factory, config_dir, tools)
    return None


def environment_reward(factory: Optional[Callable[[], Any]]) -> Optional[tuple[str, Callable[..., list]]]:
    """TRL 1.16's reward owned by the environment: when the class `factory` builds defines `get_reward` (no
    arguments, a float), `(class name, reward function)` where the function scores each completed rollout as
    `environments[i].get_reward()` (None, then NaN, for a row whose environment is of another class); TRL adds it as
    one more reward source of weight 1 named after the class, and `reward_funcs` may then be empty. None otherwise.

    Example: `class Counter` with `get_reward(self): return float(self.count)` -> `("Counter", f)` with
    `f(environments=[c1, c2]) == [c1.count, c2.count]`.
    """
    if factory is None:
        return None
    kind = factory if isinstance(factory, type) else type(factory())  # a class needs no instance to be read
    if not inspect.isfunction(getattr(kind, "get_reward", None)):
        return None

    def get_reward(environments, **kwargs):
        return [e.get_reward() if type(e) is kind else None for e in environments]

    return kind.__name__, get_reward


# ------------------------------------------------------------------------------------------ parsing


@dataclass(frozen=True)
class ToolCallFormat:
    """How a template writes one call: `open + JSON + close`, the arguments under `arguments_key`.

    ChatML/Qwen: `<tool_call>` ... `</tool_call>`, `arguments`; llama3: a bare JSON object, `parameters`.
    """

    open: str = "<tool_call>"
    close: str = "</tool_call>"
    arguments_key: str = "arguments"

    @classmethod
    def from_formatter(cls, formatter) -> "ToolCallFormat":
        """The format a `ChatFormatter` renders, found by rendering a probe call and reading what surrounds it.

        Raises:
            ConfigError: the template does not write tool calls (e.g. SmolLM2's own template).
        """
        call = {"type": "function", "function": {"name": "alignkit_probe", "arguments": {"x": 1}}}
        text = formatter.render([{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "", "tool_calls": [call]}])
        match = re.search(r'\{\s*"name"\s*:\s*"alignkit_probe"\s*,\s*"(\w+)"\s*:\s*\{\s*"x"\s*:\s*1\s*\}\s*\}', text)
        if match is None:
            raise ConfigError(
                f"tools: chat template {formatter.name!r} does not write tool calls, so the model could not call a tool."
                " Set `template: chatml` (Qwen-style <tool_call> tags; `qwen` for Qwen models) or another template "
                "that renders tool calls.")
        # The markers are the non-space text right around the JSON, special tokens (`<|...|>`) cut off.
        before, after = text[:match.start()].split(), text[match.end():].split()
        open_marker = before[-1].rsplit("|>", 1)[-1] if before else ""
        close_marker = after[0].split("<|", 1)[0] if after else ""
        return cls(open=open_marker, close=close_marker, arguments_key=match.group(1))


@dataclass
class ParsedTurn:
    """One generated turn, split into text and calls.

    Attributes:
        content: the text before the first call (whitespace trimmed), as TRL's response parsers give it.
        calls: each call as `{"name": str, "arguments": dict}`, or `{"error": str}` where it could not be read.
    """

    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The turn as an assistant message (with `tool_calls` in Hugging Face's form when it calls)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self.calls if "error" not in c]
        if calls:
            message["tool_calls"] = calls
        return message


def _read_call(text: str, arguments_key: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return {"error": f"the tool call is not valid JSON ({err.msg} at character {err.pos}): {text[:200]}"}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return {"error": f'a tool call must be a JSON object {{"name": ..., "{arguments_key}": {{...}}}}: {text[:200]}'}
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if not isinstance(arguments, dict):
        return {"name": value["name"], "error": f"the arguments of tool {value['name']} must be a JSON object, got "
                                                f"{type(arguments).__name__}"}
    return {"name": value["name"], "arguments": arguments}


def parse_tool_calls(text: str, fmt: ToolCallFormat) -> ParsedTurn:
    """The calls of one turn (its text without the end-of-turn token), in the order written; several per turn.

    A last block left open (the turn cut off by the length limit, or ended without the closing marker) is a call
    when what follows its opening marker is a whole JSON object with a name, and text otherwise, as TRL 1.16's
    parser (transformers' `parse_response`) reads it; TRL then counts the call in `tools/call_frequency`. Without
    markers (llama3) the whole turn is the call when it is a JSON object with a name.

    Example (ChatML): `'Let me add.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>'` ->
    content "Let me add.", calls `[{"name": "add", "arguments": {"a": 1}}]`.
    """
    if not fmt.open:
        stripped = text.strip()
        if stripped.startswith("{") and '"name"' in stripped:
            return ParsedTurn("", [_read_call(stripped, fmt.arguments_key)])
        return ParsedTurn(stripped)
    pattern = re.escape(fmt.open) + r"\s*(.*?)\s*" + re.escape(fmt.close)
    blocks = list(re.finditer(pattern, text, flags=re.DOTALL))
    calls = [_read_call(b.group(1), fmt.arguments_key) for b in blocks]
    tail_start = blocks[-1].end() if blocks else 0
    opened = text.find(fmt.open, tail_start)
    first = blocks[0].start() if blocks else opened
    if opened >= 0:
        last = _read_call(text[opened + len(fmt.open):].strip(), fmt.arguments_key)
        if "error" not in last:
            calls.append(last)
        elif not blocks:
            return ParsedTurn(text.strip())
    if not calls:
        return ParsedTurn(text.strip())
    return ParsedTurn(text[:first].strip(), calls)


# ------------------------------------------------------------------------------------------ running


@dataclass
class ToolResult:
    """What one call gave: the tool message's `name` and `content`, and whether it failed."""

    name: str
    content: str
    failed: bool


def _cap(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return (text[:max_chars] + f"\n[output cut: the tool returned {len(text)} characters, the first {max_chars} are "
            "shown (max_tool_output_chars)]")


def run_tool_call(call: dict[str, Any], tools: dict[str, Callable[..., Any]], *, timeout: Optional[float],
                  max_chars: int) -> ToolResult:
    """Run one parsed call; never raises. Failures give TRL's message, `str({"error": "..."})`.

    Args:
        call: from `parse_tool_calls`.
        tools: the row's tools by name.
        timeout: seconds the call may take (None or 0: untimed, in this thread).
        max_chars: longest content kept (`max_tool_output_chars`).
    """
    from ..rewards.functions import CallTimedOut, call_with_timeout

    name = call.get("name", UNKNOWN_TOOL)
    if "error" in call:
        return ToolResult(name, str({"error": call["error"]}), True)  # bounded by `_read_call`
    if name not in tools:
        return ToolResult(name, str({"error": f"Tool {name} not found."}), True)
    try:
        result = call_with_timeout(tools[name], call["arguments"], timeout, name=f"tool {name}")
    except CallTimedOut:
        return ToolResult(name, str({"error": f"Tool {name} did not return within {timeout:g} s (tool_timeout)."}),
                          True)
    except Exception as err:  # noqa: BLE001 - the tool's failure is the model's feedback, not the run's
        return ToolResult(name, _cap(str({"error": str(err)}), max_chars), True)
    try:
        return ToolResult(name, _cap(str(result), max_chars), False)
    except Exception as err:  # noqa: BLE001 - a result whose str() raises
        return ToolResult(name, str({"error": f"the result of tool {name} cannot be shown as text: {err}"}), True)


def tool_suffix_ids(formatter, tool_messages: list[dict[str, Any]], stop_token_ids: Sequence[int]) -> list[int]:
    """The tokens that follow a calling turn's end-of-turn token: the tool turn(s) and the next generation prompt.

    As TRL 1.16 finds them: render a dummy conversation ending in a call, then the same with the tool messages and the
    generation prompt, and keep what the second adds after the first's last end-of-turn token (ChatML's newline after
    `<|im_end|>` belongs to the suffix). Tokenised whole and sliced, so the boundary is the template's own.

    Raises:
        ValueError: the template renders the dummy conversation differently once tool messages follow.
    """
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    tokenizer = formatter.tokenizer
    prefix = tokenizer(formatter.render(dummy), add_special_tokens=False)["input_ids"]
    full = tokenizer(formatter.render(dummy + tool_messages, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
    stops = set(int(t) for t in stop_token_ids)
    ends = [i for i, token in enumerate(prefix) if token in stops]
    if ends:
        prefix = prefix[:ends[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError(f"chat template {formatter.name!r} renders a conversation differently once tool results "
                         "follow it, so tool turns cannot be appended token by token; use `template: chatml`.")
    return full[len(prefix):]


# ------------------------------------------------------------------------------------------ the loop


@dataclass
class ToolRollout:
    """A batch of multi-turn completions (see the module docstring).

    Attributes:
        completion_ids: per row, every token after the prompt (turns and tool turns).
        tool_mask: per row, 1 on the policy's tokens, 0 on tool-response tokens (same lengths).
        messages: per row, the assistant and tool messages in order.
        calls: tool calls made over the batch; failures: those that failed.
        calls_per_tool, failures_per_tool: the same per tool name (`UNKNOWN_TOOL` for unreadable calls).
        turns: per row, the number of turns generated.
    """

    completion_ids: list[list[int]]
    tool_mask: list[list[int]]
    messages: list[list[dict[str, Any]]]
    calls: int = 0
    failures: int = 0
    calls_per_tool: Counter = field(default_factory=Counter)
    failures_per_tool: Counter = field(default_factory=Counter)
    turns: list[int] = field(default_factory=list)


# generate(contexts, rows, turn, max_new_tokens) -> new ids per context, each cut after its stop token.
TurnGenerator = Callable[[list[list[int]], list[int], int, int], list[list[int]]]


def tool_rollout(
    generate: TurnGenerator,
    prompt_ids: Sequence[Sequence[int]],
    row_tools: Sequence[dict[str, Callable[..., Any]]],
    *,
    decode: Callable[[list[int]], str],
    suffix_ids: Callable[[list[dict[str, Any]]], list[int]],
    call_format: ToolCallFormat,
    stop_token_ids: Sequence[int],
    max_completion_length: int,
    max_iterations: Optional[int] = None,
    max_context_length: Optional[int] = None,
    timeout: Optional[float] = None,
    max_tool_output_chars: int = 10_000,
) -> ToolRollout:
    """Generate, call tools, append their results, generate again, row by row until each row stops (TRL 1.16's loop).

    Per tool turn, for each row whose last turn called: every call runs (`run_tool_call`) and the tool messages are
    rendered (`suffix_ids`); a row whose completion would then pass `max_completion_length` (or whose context would
    reach `max_context_length`) keeps its completion as it was and stops, its tool messages dropped (the calls still
    count, as in TRL). The others generate their next turn together, with at most the completion budget they have
    left. A row stops when a turn has no call or after `max_iterations` tool turns (None: no cap).

    Args:
        generate: one turn for some rows: `(contexts, rows, turn, max_new_tokens) -> new ids` (each cut after its stop
            token); `rows` are indices into the batch (for per-row seeds), `turn` counts from 0.
        prompt_ids: the rendered prompts (with the tool schemas).
        row_tools: each row's tools by name.
        decode: token ids -> text, special tokens kept (the parser needs the markers).
        suffix_ids: tool messages -> their tokens (`tool_suffix_ids`).
        call_format: the template's call syntax.
        stop_token_ids: ids that end a turn (stripped before parsing).
        max_completion_length: the budget of the whole multi-turn completion.
        max_iterations: most tool turns per row (`max_tool_calling_iterations`).
        max_context_length: the model's longest sequence (prompt + completion).
        timeout, max_tool_output_chars: per call (`run_tool_call`).
    """
    stops = set(int(t) for t in stop_token_ids)
    prompts = [list(map(int, p)) for p in prompt_ids]
    count = len(prompts)
    out = ToolRollout([[] for _ in range(count)], [[] for _ in range(count)], [[] for _ in range(count)],
                      turns=[0] * count)

    def add_turn(row: int, ids: list[int]) -> Optional[ParsedTurn]:
        out.completion_ids[row] += ids
        out.tool_mask[row] += [1] * len(ids)
        out.turns[row] += 1
        if not ids:
            return None
        body = ids[:-1] if ids[-1] in stops else ids
        parsed = parse_tool_calls(decode(body), call_format)
        out.messages[row].append(parsed.message())
        return parsed

    first = generate(prompts, list(range(count)), 0, max_completion_length)
    pending = {}
    for row, ids in enumerate(first):
        parsed = add_turn(row, list(ids)[:max_completion_length])
        if parsed is not None and parsed.calls:
            pending[row] = parsed.calls
    iteration = 0
    while pending and (max_iterations is None or iteration < max_iterations):
        contexts, rows = [], []
        for row, calls in pending.items():
            results = []
            for call in calls:
                result = run_tool_call(call, row_tools[row], timeout=timeout, max_chars=max_tool_output_chars)
                known = result.name if result.name in row_tools[row] else UNKNOWN_TOOL
                out.calls += 1
                out.calls_per_tool[known] += 1
                if result.failed:
                    out.failures += 1
                    out.failures_per_tool[known] += 1
                results.append({"role": "tool", "name": result.name, "content": result.content})
            suffix = suffix_ids(results)
            completion = out.completion_ids[row] + suffix
            context_length = len(prompts[row]) + len(completion)
            if len(completion) > max_completion_length or (max_context_length is not None
                                                           and context_length >= max_context_length):
                continue  # no room for the results: the row ends with its calling turn
            out.completion_ids[row] = completion
            out.tool_mask[row] += [0] * len(suffix)
            out.messages[row] += results
            contexts.append(prompts[row] + completion)
            rows.append(row)
        if not rows:
            break
        budget = [max_completion_length - len(out.completion_ids[row]) for row in rows]
        new = generate(contexts, rows, iteration + 1, max(budget))
        pending = {}
        for row, ids, room in zip(rows, new, budget):
            parsed = add_turn(row, list(ids)[:room])
            if parsed is not None and parsed.calls:
                pending[row] = parsed.calls
        iteration += 1
    return out


def rollout_tensors(out: ToolRollout, prompt_ids: Sequence[Sequence[int]], pad_token_id: int,
                    stop_token_ids: Sequence[int]):
    """A `ToolRollout` as the stage's tensors: `(Generation, tool_mask [N, C])`.

    `completion_mask` is 1 on every token of the multi-turn completion (the attention), `tool_mask` 1 on the policy's
    own tokens; both 0 on the right padding. A row is `truncated` when its last token is not a stop token.
    """
    import torch

    from ..model.generation import Generation, pad_prompts

    stops = set(int(t) for t in stop_token_ids)
    width = max(1, max(len(ids) for ids in out.completion_ids))
    completion_ids = torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids in out.completion_ids],
                                  dtype=torch.long)
    lengths = torch.tensor([len(ids) for ids in out.completion_ids])
    completion_mask = (torch.arange(width) < lengths[:, None]).long()
    tool_mask = torch.tensor([mask + [0] * (width - len(mask)) for mask in out.tool_mask], dtype=torch.long)
    truncated = torch.tensor([not ids or ids[-1] not in stops for ids in out.completion_ids])
    prompts, prompt_mask = pad_prompts(prompt_ids, pad_token_id)
    texts = [m[-1]["content"] if m and m[-1]["role"] == "assistant" else "" for m in out.messages]
    return Generation(prompts, prompt_mask, completion_ids, completion_mask, truncated, texts), tool_mask


class ToolLoop:
    """A stage's tools and environments, set up once, and its rollouts (`tool_rollout`) round after round.

    Args:
        tools: the standalone tool functions (`load_tools`).
        environment_factory: a class or factory (`load_environment_factory`), or None. Instances are pooled, one per
            row of a rollout, built once and reset each round ("construct once, reset often", as TRL).
        formatter: the template (`ChatFormatter`): renders the prompts with the tool schemas, reads the call syntax
            (`ToolCallFormat.from_formatter`) and the tool turns (`tool_suffix_ids`).
        stop_token_ids: the template's end-of-turn ids.

    Attributes:
        tool_names: every tool's name (standalone, then the environment's methods), for the per-tool metrics.
        schemas: their JSON schemas, as the prompt shows them.
    """

    def __init__(self, tools: Sequence[Callable[..., Any]], environment_factory: Optional[Callable[[], Any]],
                 formatter, stop_token_ids: Sequence[int]) -> None:
        self.standalone = list(tools)
        self.environment_factory = environment_factory
        self.formatter = formatter
        self.stop_token_ids = list(stop_token_ids)
        self.call_format = ToolCallFormat.from_formatter(formatter)
        self.environment_pool: list[Any] = [environment_factory()] if environment_factory is not None else []
        methods = environment_methods(self.environment_pool[0]) if self.environment_pool else []
        self.tool_names = [f.__name__ for f in self.standalone + methods]
        self.schemas = [tool_schema(f) for f in self.standalone + methods]
        self._schemas_json = json.dumps(self.schemas)

    def environments(self, count: int) -> list[Any]:
        """`count` environment instances from the pool (grown as needed); [] without an environment_factory."""
        if self.environment_factory is None:
            return []
        while len(self.environment_pool) < count:
            self.environment_pool.append(self.environment_factory())
        return self.environment_pool[:count]

    def start(self, prompt_messages: Sequence[list[dict[str, Any]]], row_kwargs: Sequence[dict[str, Any]]
              ) -> tuple[list[list[dict[str, Any]]], list[dict[str, Callable[..., Any]]], list[Any], list[list[int]]]:
        """Reset each row's environment and render the prompts.

        Args:
            prompt_messages: each row's prompt.
            row_kwargs: each row's `reset` keyword arguments (the dataset row, with `prompt`).

        Returns:
            `(messages, row_tools, environments, prompt_ids)`: the prompts with each `reset` observation appended to
            the last message (TRL 1.16), each row's tools by name, the environments ([] without), the prompt ids.
        """
        environments = self.environments(len(prompt_messages))
        messages = [[dict(m) for m in row] for row in prompt_messages]
        row_tools = []
        for i, row in enumerate(messages):
            tools = {f.__name__: f for f in self.standalone}
            if environments:
                observation = environments[i].reset(**row_kwargs[i])
                if isinstance(observation, str):
                    row[-1]["content"] = row[-1]["content"] + observation
                tools.update({m.__name__: m for m in environment_methods(environments[i])})
            row_tools.append(tools)
        from ..model.generation import encode_prompts

        prompt_ids = encode_prompts(self.formatter, messages, [self._schemas_json] * len(messages))
        return messages, row_tools, environments, prompt_ids

    def run(self, generate: TurnGenerator, prompt_ids: Sequence[Sequence[int]],
            row_tools: Sequence[dict[str, Callable[..., Any]]], *, max_completion_length: int,
            max_iterations: Optional[int], timeout: Optional[float], max_tool_output_chars: int,
            max_context_length: Optional[int] = None) -> ToolRollout:
        """`tool_rollout` with this loop's template, parser and tool turns."""
        tokenizer = self.formatter.tokenizer
        return tool_rollout(
            generate, prompt_ids, row_tools,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            suffix_ids=lambda messages: tool_suffix_ids(self.formatter, messages, self.stop_token_ids),
            call_format=self.call_format, stop_token_ids=self.stop_token_ids,
            max_completion_length=max_completion_length, max_iterations=max_iterations,
            max_context_length=max_context_length, timeout=timeout or None,
            max_tool_output_chars=max_tool_output_chars)

    def metrics(self, out: ToolRollout, reduce_sum: Callable[[Any], Any], rows: int) -> dict[str, float]:
        """TRL 1.16's `tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failed calls per
        call), and the same per tool (`tools/<name>/call_frequency`, `tools/<name>/failure_frequency`; `unknown`:
        calls naming no tool or unreadable), over every process (`reduce_sum` sums a tensor over processes).

        Args:
            out: this process's rollout.
            reduce_sum: sums a float tensor over processes (identity with one).
            rows: completions over all processes.
        """
        import torch

        names = self.tool_names + [UNKNOWN_TOOL]
        counts = torch.tensor([out.calls, out.failures] + [out.calls_per_tool[n] for n in names]
                              + [out.failures_per_tool[n] for n in names], dtype=torch.float64)
        counts = reduce_sum(counts).tolist()
        calls, failures = counts[0], counts[1]
        per_calls, per_failures = counts[2:2 + len(names)], counts[2 + len(names):]
        metrics = {"tools/call_frequency": calls / rows,
                   "tools/failure_frequency": failures / calls if calls > 0 else 0.0}
        for name, called, failed in zip(names, per_calls, per_failures):
            if name == UNKNOWN_TOOL and not called:
                continue
            metrics[f"tools/{name}/call_frequency"] = called / rows
            metrics[f"tools/{name}/failure_frequency"] = failed / called if called > 0 else 0.0
        return metrics


def turn_seeds(seed: int, turn: int, rows: Sequence[int]) -> list[int]:
    """Sampling seeds of `rows` (indices in the round's global batch) for turn `turn` of a tool rollout.

    Turn 0 uses the round's row seeds (`rollout.row_seeds`), so a rollout whose rows never call samples what a run
    without tools samples; later turns derive a seed of their own per row and turn, so a row's completion does not
    depend on which other rows are still calling, nor on the number of processes. Example: seed 7, turn 0, row 3 ->
    `rollout_seed(7, 3)`; turn 2 -> `rollout_seed(rollout_seed(7, 3), 2)`.
    """
    from .rollout import rollout_seed

    return [rollout_seed(seed, row) if turn == 0 else rollout_seed(rollout_seed(seed, row), turn) for row in rows]


__all__ = ["ENVIRONMENT_RESERVED", "UNKNOWN_TOOL", "tool_schema", "load_tools", "environment_methods",
           "load_environment_factory", "check_tool_keys", "ToolCallFormat", "ParsedTurn", "parse_tool_calls",
           "ToolResult", "run_tool_call", "tool_suffix_ids", "ToolRollout", "TurnGenerator", "tool_rollout",
           "rollout_tensors", "ToolLoop", "turn_seeds"]
