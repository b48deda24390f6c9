"""Tool calls in the OpenAI shape, read from and written to the chat template's own format.

A request's `tools` reach the prompt as the template writes tool signatures (`ChatFormatter.prompt_text(...,
tools=...)`: for the ChatML family one JSON object per line inside `<tools></tools>`), and the model answers a
call in the format the template writes calls in (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`;
the bare JSON object for `llama3`). `parse_tool_calls` reads that format back: the wrapper around `{call}` is
taken from the template (`BuiltinTemplate.tool_call`), or, for the tokenizer's own template, found by rendering a
probe call through it, so what the model was trained to write is what is parsed.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from ..data.template import ChatFormatter

_PROBE_NAME = "alignkit_probe_call"


def call_wrapper(formatter: ChatFormatter) -> tuple[str, str]:
    """(before, after): the text the template writes around one call's JSON; ("", "") for a bare JSON object.

    For the tokenizer's own template the probe call `{"name": "alignkit_probe_call", "arguments": {}}` is rendered
    and the text around its JSON object in the reply, up to the end-of-turn token, is taken: `<tool_call>\n` and
    `\n</tool_call>` for Qwen's.
    """
    if formatter.builtin is not None:
        before, _, after = formatter.builtin.tool_call.partition("{call}")
        return before, after
    probe = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}]}]
    prompt = formatter.render(probe[:1], add_generation_prompt=True)
    full = formatter.render(probe)
    reply = full[len(prompt):] if full.startswith(prompt) else full
    name_at = reply.find(_PROBE_NAME)
    start = reply.rfind("{", 0, name_at)
    if name_at < 0 or start < 0:
        return "", ""
    end = _json_end(reply, start)
    if end is None:
        return "", ""
    after = reply[end:]
    end_of_turn = formatter.tokenizer.decode(formatter.stop_token_ids()[:1])
    if end_of_turn and end_of_turn in after:
        after = after[:after.index(end_of_turn)]
    return reply[:start], after


def _json_end(text: str, start: int) -> Optional[int]:
    """The index just after the JSON value starting at `start`, or None if none parses there."""
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    return end


def parse_tool_calls(text: str, wrapper: tuple[str, str]) -> tuple[Optional[str], list[dict[str, Any]]]:
    """Split a reply into its text and its tool calls (OpenAI's `tool_calls` items).

    Each call is a JSON object `{"name": ..., "arguments": {...}}` after the wrapper's opening text (anywhere
    when the wrapper is empty, a bare object). A block that does not parse as such stays in the text.

    Example: with the ChatML wrapper, `'<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>'`
    gives `(None, [{"id": "call_...", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}])`.

    Returns:
        (content, calls): content is the remaining text stripped, None when nothing remains.
    """
    opening, closing = wrapper[0].strip(), wrapper[1].strip()
    calls, kept, position = [], [], 0
    while position < len(text):
        at = text.find(opening, position) if opening else text.find("{", position)
        if at < 0:
            break
        start = at + len(opening)
        while start < len(text) and text[start].isspace():
            start += 1
        end = _json_end(text, start) if text.startswith("{", start) else None
        call = _as_call(text[start:end]) if end is not None else None
        if call is None:
            kept.append(text[position:at + max(len(opening), 1)])
            position = at + max(len(opening), 1)
            continue
        kept.append(text[position:at])
        calls.append(call)
        position = end
        rest = text[position:]
        if closing and rest.lstrip().startswith(closing):
            position += len(rest) - len(rest.lstrip()) + len(closing)
    kept.append(text[position:])
    content = "".join(kept).strip()
    return (content or None), calls


class ToolCallStream:
    """`parse_tool_calls` as text arrives: content pieces are released as soon as they cannot be part of a call,
    each call once its JSON object is complete.

    Text that may still open a call (a tail that is a prefix of the wrapper's opening; from the opening, or from a
    `{` for a bare-JSON wrapper, until its object parses or cannot) is held back. Whitespace around the content is
    held too and dropped at its ends, so the pieces join into the content `parse_tool_calls` returns for the whole
    text, and its calls are the same calls (ids aside).

    Example (ChatML wrapper): `feed("Sure.\\n<tool")` gives `[("content", "Sure.")]`; `feed("_call>\\n{\"name\": \"f\",
    \"arguments\": {}}\\n</tool_call>")` gives `[("call", {... "name": "f", "arguments": "{}" ...})]`; `finish()` gives
    `[]`.
    """

    def __init__(self, wrapper: tuple[str, str]) -> None:
        self.opening, self.closing = wrapper[0].strip(), wrapper[1].strip()
        self.text = ""
        self.position = 0  # self.text[:position] is decided (released or dropped)
        self.after_call = False  # a call just ended: its closing text may follow
        self.started = False  # some content was released (leading whitespace is dropped before)
        self.space = ""  # whitespace decided as content but held until more content follows it

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        """Events `("content", text)` and `("call", tool_call)` that `piece` decides, in order."""
        self.text += piece
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        """The events of the held text at the end of the reply (an unfinished call stays content)."""
        return self._drain(final=True)

    def _content(self, text: str, events: list) -> None:
        body = text.rstrip()
        if body.strip():
            lead = self.space if self.started else ""
            events.append(("content", lead + (body if self.started else body.lstrip())))
            self.started, self.space = True, text[len(body):]
        else:
            self.space += text

    def _drain(self, final: bool) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        while self.position < len(self.text):
            rest = self.text[self.position:]
            if self.after_call and self.closing:
                stripped = rest.lstrip()
                if stripped.startswith(self.closing):
                    self.position += len(rest) - len(stripped) + len(self.closing)
                    self.after_call = False
                    continue
                if not final and self.closing.startswith(stripped):
                    break
            self.after_call = False
            at = rest.find(self.opening) if self.opening else rest.find("{")
            if at < 0:
                keep = 0 if final else _prefix_tail(rest, self.opening)
                self._content(rest[:len(rest) - keep], events)
                self.position += len(rest) - keep
                break
            self._content(rest[:at], events)
            self.position += at
            marker = len(self.opening) or 1  # the opening, or the bare object's "{" when there is none
            start = self.position + len(self.opening)
            while start < len(self.text) and self.text[start].isspace():
                start += 1
            end = _json_end(self.text, start) if self.text.startswith("{", start) else None
            if end is None and not final and (start == len(self.text) or self.text.startswith("{", start)):
                break  # the object may still be arriving
            call = _as_call(self.text[start:end]) if end is not None else None
            if call is None:
                self._content(self.text[self.position:self.position + marker], events)
                self.position += marker
                continue
            events.append(("call", call))
            self.position, self.after_call = end, True
        return events


def _prefix_tail(text: str, opening: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `opening` (0 for none)."""
    for size in range(min(len(opening) - 1, len(text)), 0, -1):
        if opening.startswith(text[-size:]):
            return size
    return 0


def _as_call(json_text: str) -> Optional[dict[str, Any]]:
    try:
        value = json.loads(json_text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def to_template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI request messages in the Hugging Face convention the templates render.

    An assistant message's `tool_calls` carry `arguments` as JSON text in OpenAI's shape and as an object in
    the templates'; a `tool` message keeps its content. Content given as a list of parts is joined from its
    text parts (the caller refuses other parts first, and writes image parts as `<image>` text parts).
    """
    out = []
    for message in messages:
        converted = {"role": message["role"], "content": content_text(message.get("content"))}
        if message.get("tool_calls"):
            converted["tool_calls"] = [
                {"type": "function", "function": {"name": call["function"]["name"],
                                                  "arguments": _arguments_object(call["function"].get("arguments"))}}
                for call in message["tool_calls"]]
        out.append(converted)
    return out


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _arguments_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}


__all__ = ["call_wrapper", "parse_tool_calls", "ToolCallStream", "to_template_messages", "content_text"]
