"""Chat templates and the position-based split of a conversation into prompt and response chunks.

Labels are built from positions, never by comparing ids with the pad token (pad == eos in SmolLM2, and
the eos that ends a reply must be learned). For each assistant turn i the conversation is rendered twice:
`messages[:i]` with the generation prompt, and `messages[:i+1]`; the first must be a prefix of the second,
and the difference is the reply: its content, the end-of-turn token, and whatever the template writes
after it (ChatML's newline), exactly as LLaMA-Factory's and TRL's chat data train it. Keeping that tail
matters for reward models: with pad == eos, plain transformers scores a sequence at its last token that is
not the pad token, so a sequence ending in `<|im_end|>\n` is scored at the newline, where we train the
reward too. Chunks are tokenised separately
and concatenated, so every mask boundary falls exactly between tokens, and a prompt is tokenised the same
way it will be at generation time.

Templates: the tokenizer's own (`template` unset), or a built-in one (`BUILTIN_TEMPLATES`): `chatml`,
`qwen`, `qwen3`, `smollm2`, `llama3`, `default`, `plain`. LLaMA-Factory's template names for these
families are accepted as they are (`TEMPLATE_ALIASES`: `qwen3_nothink` and `smollm` are ChatML); its
other names are refused with the list of supported ones (`llama2`, `mistral` and `empty` have no
built-in here).

Tool calling (LLaMA-Factory's `tools` column, `function_call` and `observation` turns) follows the
Hugging Face message convention, so a tokenizer's own template renders it natively: an assistant message
may carry `tool_calls` (`[{"type": "function", "function": {"name", "arguments"}}]`, content "") and tool
results are `tool` messages. The ChatML family writes it in Qwen2.5's layout: the tool signatures one
JSON object per line inside `<tools></tools>` at the end of the system turn, each call as
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` in the assistant turn (trained, it is the
model's output), each result as a user turn wrapped in `<tool_response></tool_response>` (not trained).

Special tokens: a built-in template whose special tokens (`<|start_header_id|>` for llama3, ...) the
tokenizer does not have as single tokens is refused (`ChatFormatter` raises), never trained as text.
LLaMA-Factory adds such tokens and resizes the embeddings instead; we do not, because the new rows start
random: a short fine-tune would teach the model a format it has never seen through untrained embeddings
while the format its weights know (its own template's tokens) is at hand; under LoRA the whole embedding
and output matrices would have to be trained and saved with every adapter (for SmolLM2, 28M parameters
beside an adapter of under 5M), and every later consumer (chat, export, reward scoring, a second stage)
would have to resize the base in the same way before loading the adapter. The error names the missing
tokens and the template to use instead.

What is saved: training installs the built-in template into the tokenizer as Jinja (`jinja_template`),
so the tokenizer saved with the model (or adapter) renders exactly what was trained, and `alignkit chat`
with `template` unset uses that format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from ..errors import DataError

Message = dict[str, Any]


def _split_slot(fmt: str, eos: str, bos: str) -> tuple[str, str]:
    """A format string with one `{content}` slot → (text before, text after), eos and bos filled in.

    Plain replacement, not `str.format`: format strings hold literal braces (JSON examples) and the
    content is never parsed.
    """
    before, _, after = fmt.replace("{eos}", eos).replace("{bos}", bos).partition("{content}")
    return before, after


def tool_lines(tools: list[dict[str, Any]]) -> str:
    """Tool signatures one JSON object per line, each wrapped as `{"type": "function", "function": ...}`
    unless it is already (the form Hugging Face chat templates and Qwen2.5 take)."""
    wrapped = [t if t.get("type") == "function" else {"type": "function", "function": t} for t in tools]
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in wrapped)


@dataclass(frozen=True)
class BuiltinTemplate:
    """A chat format written out as format strings (one per role, each with one `{content}` slot).

    `render` (Python) and `jinja` (the same format as a Jinja chat template for the saved tokenizer) are
    two writings of this one description; a test checks they agree.

    Attributes:
        prefix: text before the first message (`{bos}` for the tokenizer's bos when it uses one).
        system, user, tool: the turn of each role; `{eos}` is the tokenizer's eos token.
        generation_prompt: what opens the assistant's turn.
        reply: an assistant reply after the generation prompt.
        special_tokens: tokens the format writes that the tokenizer must have as single special tokens.
        default_system: system text used when the conversation has none ("" for none).
        tools_prompt: appended to the system text when tools are given (after a blank line); `{tools}`
            is replaced by `tool_lines`.
        tool_call: one function call in a reply; `{call}` is the JSON of name and arguments.
        arguments_key: the key the call's arguments go under (`parameters` for Llama 3).
        empty_thought: put before a reply that has no `</think>` (Qwen3's thinking template trains an empty
            thought on replies without one, as LLaMA-Factory's `qwen3` does).
        drop_thoughts: remove each reply's thought (everything up to its last `</think>`, and the newlines after),
            as Qwen3's own template does with past turns (thinking switched off: `enable_thinking: false`).
    """

    prefix: str
    system: str
    user: str
    tool: str
    generation_prompt: str
    reply: str
    special_tokens: tuple[str, ...] = ()
    default_system: str = ""
    tools_prompt: str = ""
    tool_call: str = "<tool_call>\n{call}\n</tool_call>"
    arguments_key: str = "arguments"
    empty_thought: str = ""
    drop_thoughts: bool = False

    def _body(self, message: Message) -> str:
        body = message.get("content") or ""
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            call_json = json.dumps({"name": function["name"], self.arguments_key: function["arguments"]},
                                   ensure_ascii=False)
            calls.append(self.tool_call.replace("{call}", call_json))
        if calls:
            body = body + "\n" + "\n".join(calls) if body else "\n".join(calls)
        if self.drop_thoughts and "</think>" in body:
            body = body.split("</think>")[-1].lstrip("\n")
        if self.empty_thought and "</think>" not in body:
            body = self.empty_thought + body
        return body

    def render(self, messages: list[Message], add_generation_prompt: bool, eos: str, bos: str,
               tools: Optional[list[dict[str, Any]]] = None) -> str:
        """The conversation as text (see `ChatFormatter.render`); `tools` are parsed tool signatures."""
        slot = {name: _split_slot(getattr(self, name), eos, bos)
                for name in ("system", "user", "tool", "reply")}
        start = 1 if messages and messages[0]["role"] == "system" else 0
        system = messages[0]["content"] if start else self.default_system
        if tools:
            before, after = _split_slot(self.tools_prompt.replace("{tools}", "{content}"), eos, bos)
            section = before + tool_lines(tools) + after
            system = system + "\n\n" + section if system else section
        text = _split_slot(self.prefix, eos, bos)[0]
        if system:
            text += slot["system"][0] + system + slot["system"][1]
        for message in messages[start:]:
            role = message["role"]
            if role == "assistant":
                text += self.generation_prompt + slot["reply"][0] + self._body(message) + slot["reply"][1]
            else:
                before, after = slot[role if role in ("system", "tool") else "user"]
                text += before + message["content"] + after
        if add_generation_prompt:
            text += self.generation_prompt
        return text

    def jinja(self, eos: str, bos: str) -> str:
        """This format as a Jinja chat template rendering exactly what `render` does (with the tokenizer's
        `eos`/`bos` written in), for `tokenizer.chat_template`."""
        def lit(text: str) -> str:  # a Jinja string literal (Jinja reads JSON's escapes)
            return json.dumps(text)

        s_before, s_after = (lit(t) for t in _split_slot(self.system, eos, bos))
        u_before, u_after = (lit(t) for t in _split_slot(self.user, eos, bos))
        t_before, t_after = (lit(t) for t in _split_slot(self.tool, eos, bos))
        r_before, r_after = (lit(t) for t in _split_slot(self.reply, eos, bos))
        tp_before, tp_after = (lit(t) for t in _split_slot(self.tools_prompt.replace("{tools}", "{content}"), eos, bos))
        c_before, _, c_after = self.tool_call.partition("{call}")
        gen = lit(self.generation_prompt)
        return "".join([
            "{%- set sys = namespace(text=", lit(self.default_system), ", start=0) -%}",
            "{%- if messages and messages[0]['role'] == 'system' -%}",
            "{%- set sys.text = messages[0]['content'] -%}{%- set sys.start = 1 -%}{%- endif -%}",
            "{%- if tools -%}{%- set ns = namespace(lines=[]) -%}{%- for tool in tools -%}",
            "{%- if tool['type'] == 'function' -%}{%- set ns.lines = ns.lines + [tool | tojson] -%}",
            "{%- else -%}{%- set ns.lines = ns.lines + [{'type': 'function', 'function': tool} | tojson] -%}",
            "{%- endif -%}{%- endfor -%}",
            "{%- set section = ", tp_before, " + ns.lines | join('\\n') + ", tp_after, " -%}",
            "{%- set sys.text = (sys.text + '\\n\\n' + section) if sys.text else section -%}{%- endif -%}",
            "{{- ", lit(_split_slot(self.prefix, eos, bos)[0]), " -}}",
            "{%- if sys.text -%}{{- ", s_before, " + sys.text + ", s_after, " -}}{%- endif -%}",
            "{%- for message in messages[sys.start:] -%}",
            "{%- if message['role'] == 'assistant' -%}",
            "{%- set m = namespace(body=message['content'] or '', calls=[]) -%}",
            "{%- for call in message['tool_calls'] or [] -%}",
            "{%- set f = call['function'] if call['function'] is defined else call -%}",
            "{%- set m.calls = m.calls + [", lit(c_before), " + {'name': f['name'], ", lit(self.arguments_key),
            ": f['arguments']} | tojson + ", lit(c_after), "] -%}{%- endfor -%}",
            "{%- if m.calls -%}{%- set m.body = (m.body + '\\n' + m.calls | join('\\n')) if m.body ",
            "else m.calls | join('\\n') -%}{%- endif -%}",
            "{%- if ", lit(self.drop_thoughts), " and '</think>' in m.body -%}",
            "{%- set m.body = m.body.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}",
            "{%- if ", lit(self.empty_thought), " and '</think>' not in m.body -%}",
            "{%- set m.body = ", lit(self.empty_thought), " + m.body -%}{%- endif -%}",
            "{{- ", gen, " + ", r_before, " + m.body + ", r_after, " -}}",
            "{%- elif message['role'] == 'tool' -%}{{- ", t_before, " + message['content'] + ", t_after, " -}}",
            "{%- elif message['role'] == 'system' -%}{{- ", s_before, " + message['content'] + ", s_after, " -}}",
            "{%- else -%}{{- ", u_before, " + message['content'] + ", u_after, " -}}{%- endif -%}",
            "{%- endfor -%}",
            "{%- if add_generation_prompt -%}{{- ", gen, " -}}{%- endif -%}",
        ])


# The tool instructions are written for this project; the layout (signatures in <tools></tools>, calls in
# <tool_call></tool_call>, results in <tool_response></tool_response>) is the one Qwen2.5 was trained on.
_QWEN_TOOLS_PROMPT = (
    "# Tools\n\nYou can call the functions described below, one JSON signature per line inside "
    "<tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, reply with a JSON object "
    "holding its name and arguments inside <tool_call></tool_call> XML tags, one block per call:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
)
_CHATML = dict(
    prefix="",
    system="<|im_start|>system\n{content}<|im_end|>\n",
    user="<|im_start|>user\n{content}<|im_end|>\n",
    tool="<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n",
    generation_prompt="<|im_start|>assistant\n",
    reply="{content}<|im_end|>\n",
    special_tokens=("<|im_start|>", "<|im_end|>"),
    tools_prompt=_QWEN_TOOLS_PROMPT,
)
# Base-model transcripts write tools as the ChatML family does, in plain text.
_TEXT_TOOLS = dict(tools_prompt=_QWEN_TOOLS_PROMPT)

BUILTIN_TEMPLATES: dict[str, BuiltinTemplate] = {
    "chatml": BuiltinTemplate(**_CHATML),
    # Qwen2 / Qwen2.5 (LLaMA-Factory `qwen`): ChatML with Qwen's default system prompt.
    "qwen": BuiltinTemplate(**dict(_CHATML, default_system="You are Qwen, created by Alibaba Cloud. "
                                                           "You are a helpful assistant.")),
    # Qwen3 with thinking (LLaMA-Factory `qwen3`): ChatML, replies without a thought get an empty one.
    "qwen3": BuiltinTemplate(**dict(_CHATML, special_tokens=("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
                                    empty_thought="<think>\n\n</think>\n\n")),
    # Qwen3 with thinking switched off (LLaMA-Factory's `qwen3` with `enable_thinking: false`, which selects this
    # one): thoughts are dropped from replies and the empty thought closes the generation prompt, untrained.
    "qwen3_no_thinking": BuiltinTemplate(**dict(
        _CHATML, special_tokens=("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
        generation_prompt=_CHATML["generation_prompt"] + "<think>\n\n</think>\n\n", drop_thoughts=True)),
    # SmolLM2 (LLaMA-Factory `smollm2`): ChatML with the default system prompt SmolLM2's own template writes
    # (without the final full stop LLaMA-Factory's copy adds: the model was tuned on its own).
    "smollm2": BuiltinTemplate(**dict(_CHATML, default_system="You are a helpful AI assistant named SmolLM, "
                                                              "trained by Hugging Face")),
    "llama3": BuiltinTemplate(
        prefix="<|begin_of_text|>",
        system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
        user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
        tool="<|start_header_id|>ipython<|end_header_id|>\n\n{content}<|eot_id|>",
        generation_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n",
        reply="{content}<|eot_id|>",
        special_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        # Llama 3.1's JSON tool calling: a call is a bare JSON object with `parameters`, results come back
        # in the `ipython` role.
        tools_prompt=("You can call the functions described below, one JSON signature per line:\n{tools}\n\n"
                      "To call a function, reply with only a JSON object of the form {\"name\": <function-name>, "
                      "\"parameters\": <args-json-object>}."),
        tool_call="{call}",
        arguments_key="parameters",
    ),
    # LLaMA-Factory's `default`: a Human/Assistant transcript whose every turn ends with eos.
    "default": BuiltinTemplate(
        prefix="", system="System: {content}{eos}\n", user="Human: {content}{eos}\n",
        tool="Human: {content}{eos}\n", generation_prompt="Assistant:", reply="{content}{eos}\n", **_TEXT_TOOLS),
    # For base models without a chat template: a readable transcript, the reply closed by the eos token
    # so the model learns where to stop.
    "plain": BuiltinTemplate(
        prefix="{bos}", system="{content}\n\n", user="Human: {content}\n", tool="Observation: {content}\n",
        generation_prompt="Assistant: ", reply="{content}{eos}\n", **_TEXT_TOOLS),
}
# LLaMA-Factory template names that are one of the built-ins under another name.
TEMPLATE_ALIASES = {"qwen3_nothink": "chatml", "smollm": "chatml"}
# LLaMA-Factory names with no built-in here, and what to use instead.
_NOT_BUILT_IN = {
    "empty": "it writes turns without separators and replies without an end token, so the model never learns "
             "to stop; use `plain` (a Human/Assistant transcript whose replies end with eos)",
    "llama2": "use the tokenizer's own template (leave `template` unset)",
    "mistral": "use the tokenizer's own template (leave `template` unset)",
}


DEFAULT_SYSTEM_NEEDS_A_TEMPLATE = (
    "default_system replaces a built-in template's default system prompt, and the tokenizer's own template (used "
    "while `template` is unset) writes its own: set `template` too (smollm2 for the bundled model, chatml, qwen, "
    "llama3, ...), or give the rows a system message instead.")


def resolve_template(name: str) -> tuple[str, BuiltinTemplate]:
    """The built-in template a `template` value names (a built-in or a LLaMA-Factory alias).

    Raises:
        DataError: an unknown or unsupported name, listing the accepted ones.
    """
    builtin = TEMPLATE_ALIASES.get(name, name)
    if builtin in BUILTIN_TEMPLATES:
        return builtin, BUILTIN_TEMPLATES[builtin]
    accepted = ", ".join(list(BUILTIN_TEMPLATES) + list(TEMPLATE_ALIASES))
    why = f" ({_NOT_BUILT_IN[name]})" if name in _NOT_BUILT_IN else ""
    raise DataError(f"template={name!r} is not built in{why}. Choose one of {accepted}, or leave it unset to "
                    "use the tokenizer's own chat template.")


def missing_special_tokens(tokenizer, tokens: tuple[str, ...]) -> list[str]:
    """The `tokens` the tokenizer does not have as single added/special tokens (they would be split into
    plain-text pieces)."""
    known = set(tokenizer.get_added_vocab()) | set(tokenizer.all_special_tokens)
    return [t for t in tokens
            if t not in known or len(tokenizer(t, add_special_tokens=False)["input_ids"]) != 1]


def parse_tools(tools: Optional[str]) -> Optional[list[dict[str, Any]]]:
    """A row's `tools` text (JSON: one signature object or a list of them) as a list; None when empty.

    Raises:
        ValueError: the text is not JSON objects (`formats` checks rows with the same rule first).
    """
    if not tools or not tools.strip():
        return None
    parsed = json.loads(tools)
    parsed = [parsed] if isinstance(parsed, dict) else parsed
    if not isinstance(parsed, list) or not all(isinstance(t, dict) for t in parsed):
        raise ValueError("expected a JSON object or a list of JSON objects (function signatures)")
    return parsed or None


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer itself opens a text with bos. Some declare a bos they never use (SmolLM2's GGUF
    tokenizer names `<|im_start|>`), so the declared token alone does not decide."""
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


class ChatFormatter:
    """Renders conversations with one template and splits them into prompt/response chunks by position.

    Args:
        tokenizer: the model's tokenizer (its chat template is used when `template` is None).
        template: None, a built-in name (`BUILTIN_TEMPLATES`) or a LLaMA-Factory alias of one.
        default_system: the `default_system` key (LLaMA-Factory's): the system text of conversations without
            one, in place of the built-in template's own; None keeps the template's.

    Raises:
        DataError: an unknown template, or a built-in whose special tokens the tokenizer lacks; `default_system`
            with the tokenizer's own template.
    """

    def __init__(self, tokenizer, template: Optional[str] = None, default_system: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.name = template or "tokenizer"
        self.builtin: Optional[BuiltinTemplate] = None
        self._renders_tools: Optional[bool] = None  # whether the tokenizer's template writes tools and calls
        eos = tokenizer.eos_token or ""
        if template is None:
            if default_system is not None:
                raise DataError(DEFAULT_SYSTEM_NEEDS_A_TEMPLATE)
            if not getattr(tokenizer, "chat_template", None):
                raise DataError("the tokenizer has no chat template: set `template: plain` for a base model "
                                "(or `chatml` / `llama3`).")
            self._render: Callable[..., str] = self._render_tokenizer
            return
        resolved, builtin = resolve_template(template)
        if default_system is not None:
            builtin = replace(builtin, default_system=default_system)
        missing = missing_special_tokens(tokenizer, builtin.special_tokens)
        if missing:
            own = "this tokenizer's own template (leave `template` unset)"
            same = [n for n, t in BUILTIN_TEMPLATES.items() if not missing_special_tokens(tokenizer, t.special_tokens)
                    and t.special_tokens]
            instead = f"use template: {' or '.join(same)} or leave `template` unset" if same else f"use {own}"
            raise DataError(
                f"template={template!r} writes the special token(s) {', '.join(missing)}, which this tokenizer does "
                "not have as single tokens: they would be trained as plain-text pieces, a format the model's weights "
                f"do not know. The template must match the model's tokens: {instead}. (alignkit does "
                "not add tokens and resize embeddings as LLaMA-Factory does; see alignkit/data/template.py.)")
        self.name = template if resolved == template else f"{template} ({resolved})"
        self.builtin = builtin
        self._bos = tokenizer.bos_token if adds_bos(tokenizer) else ""
        self._render = lambda messages, add_generation_prompt, tools=None: builtin.render(
            messages, add_generation_prompt, eos=eos, bos=self._bos, tools=tools)

    def jinja_template(self) -> Optional[str]:
        """The built-in template as Jinja for `tokenizer.chat_template` (None for the tokenizer's own)."""
        if self.builtin is None:
            return None
        return self.builtin.jinja(eos=self.tokenizer.eos_token or "", bos=self._bos)

    def _render_tokenizer(self, messages: list[Message], add_generation_prompt: bool,
                          tools: Optional[list[dict[str, Any]]] = None) -> str:
        if tools or any(m.get("tool_calls") for m in messages):
            self._check_tokenizer_renders_tools()
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)

    def _check_tokenizer_renders_tools(self) -> None:
        """Tool data through a tokenizer template that ignores `tools` or `tool_calls` (SmolLM2's does) would
        silently train without them: refuse instead."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"type": "function", "function": {"name": "alignkit_probe_call", "arguments": {}}}]}]
            tools = [{"type": "function", "function": {"name": "alignkit_probe_tool", "parameters": {}}}]
            try:
                text = self.tokenizer.apply_chat_template(probe, tools=tools, tokenize=False)
            except Exception:  # a template that raises on tools does not support them either
                text = ""
            self._renders_tools = "alignkit_probe_call" in text and "alignkit_probe_tool" in text
        if not self._renders_tools:
            raise DataError(
                "the data holds tool definitions or function calls, but the tokenizer's own chat template does not "
                "write them (they would be dropped from training). Set `template: chatml` (ChatML with Qwen-style "
                "<tools>/<tool_call>/<tool_response> tags; `qwen` for Qwen models) or another built-in template "
                "whose tokens this tokenizer has.")

    def render(self, messages: list[Message], add_generation_prompt: bool = False,
               tools: Optional[str] = None) -> str:
        """The conversation as text, as the model sees it; `tools` is a row's tool signatures as JSON text."""
        return self._render(messages, add_generation_prompt, tools=parse_tools(tools))

    def chunks(self, messages: list[Message], tools: Optional[str] = None) -> list[tuple[str, bool]]:
        """Split a conversation into consecutive text chunks flagged `True` for assistant replies.

        The chunks concatenate to the rendered conversation up to the end of the last reply (its
        end-of-turn token and the template's text after it). Prompt chunks hold everything else: system
        prompt (also one the template injects, and the tool signatures), user turns, tool results and each
        turn's generation prompt. Function calls are assistant replies, so they are trained.

        Raises:
            DataError: the template renders a prefix of the conversation differently from the whole
                (then response positions cannot be found); choose another `template`.
        """
        out: list[tuple[str, bool]] = []
        consumed = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            full = self.render(messages[: i + 1], tools=tools)
            if not before.startswith(consumed) or not full.startswith(before):
                raise DataError(
                    f"chat template {self.name!r} renders the conversation up to turn {i} differently when "
                    "more turns follow, so assistant replies cannot be located by position. Set `template` "
                    f"to one of {', '.join(BUILTIN_TEMPLATES)}.")
            out.append((before[len(consumed):], False))
            reply = full[len(before):]
            out.append((reply, True))
            consumed = before + reply
        return [(text, trained) for text, trained in out if text]

    def prompt_text(self, messages: list[Message], tools: Optional[str] = None) -> str:
        """The prompt for generation: the conversation followed by the assistant's generation prompt."""
        return self.render(messages, add_generation_prompt=True, tools=tools)

    def stop_token_ids(self) -> list[int]:
        """Ids at which generation stops: the template's end-of-turn token, then eos if it differs.

        ChatML gives `<|im_end|>`, llama3 `<|eot_id|>`, plain the eos token. The end-of-turn token is read
        from the template itself (the first token it writes after a reply's content), so the tokenizer's
        own template is covered too.

        Raises:
            DataError: the template ends a turn with text that is not a special token of this tokenizer
                (generation could never stop on it); choose a template that matches the tokenizer.
        """
        probe = "alignkit-reply-probe"
        rendered = self.render([{"role": "user", "content": "1"}, {"role": "assistant", "content": probe}])
        tail = rendered[rendered.rfind(probe) + len(probe):].strip()
        ids: list[int] = []
        if tail:
            first = self.tokenizer(tail, add_special_tokens=False)["input_ids"][0]
            special = set(self.tokenizer.all_special_ids) | set(self.tokenizer.get_added_vocab().values())
            if first not in special:
                raise DataError(
                    f"template {self.name!r} ends an assistant turn with {tail!r}, which is not a special token of "
                    "this tokenizer, so generation could not stop there. Set `template` to one whose tokens the "
                    f"tokenizer has ({', '.join(BUILTIN_TEMPLATES)}, or unset for the tokenizer's own).")
            ids.append(first)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def reply_text(self, prompt: list[Message], reply: str, tools: Optional[str] = None) -> str:
        """The text of one assistant reply to `prompt` (its content and end-of-turn token)."""
        chunks = self.chunks(prompt + [{"role": "assistant", "content": reply}], tools=tools)
        return chunks[-1][0]
