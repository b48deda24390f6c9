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

Templates: the tokenizer's own (`template` unset), or a built-in `chatml`, `llama3`, `plain` (base models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Optional

from .errors import DataError

Message = dict[str, str]


@dataclass(frozen=True)
class BuiltinTemplate:
    """A chat format written out as Python format strings (one per role) instead of Jinja.

    Attributes:
        prefix: text before the first message (e.g. a bos token).
        formats: role → format string with `{content}` (and `{role}`).
        generation_prompt: what opens the assistant's turn.
        reply: format of an assistant reply after the generation prompt (`{content}`, `{eos}`).
    """

    prefix: str
    formats: dict[str, str]
    generation_prompt: str
    reply: str

    def render(self, messages: list[Message], add_generation_prompt: bool, eos: str, bos: str,
               tools: Optional[str] = None) -> str:
        messages = _with_tools_in_system(messages, tools)
        text = self.prefix.format(bos=bos)
        for message in messages:
            if message["role"] == "assistant":
                text += self.generation_prompt + self.reply.format(content=message["content"], eos=eos)
            else:
                text += self.formats[message["role"]].format(content=message["content"], role=message["role"])
        if add_generation_prompt:
            text += self.generation_prompt
        return text


def _with_tools_in_system(messages: list[Message], tools: Optional[str]) -> list[Message]:
    """Built-in templates have no tool syntax of their own: tool definitions go at the end of the system turn."""
    if not tools:
        return messages
    note = "You may call these tools:\n" + tools
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}] + messages[1:]
    return [{"role": "system", "content": note}] + messages


BUILTIN_TEMPLATES: dict[str, BuiltinTemplate] = {
    "chatml": BuiltinTemplate(
        prefix="",
        formats={r: "<|im_start|>{role}\n{content}<|im_end|>\n" for r in ("system", "user", "tool")},
        generation_prompt="<|im_start|>assistant\n",
        reply="{content}<|im_end|>\n",
    ),
    "llama3": BuiltinTemplate(
        prefix="<|begin_of_text|>",
        formats={"system": "<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
                 "user": "<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
                 "tool": "<|start_header_id|>ipython<|end_header_id|>\n\n{content}<|eot_id|>"},
        generation_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n",
        reply="{content}<|eot_id|>",
    ),
    # For base models without a chat template: a readable transcript, the reply closed by the eos token
    # so the model learns where to stop.
    "plain": BuiltinTemplate(
        prefix="{bos}",
        formats={"system": "{content}\n\n", "user": "Human: {content}\n", "tool": "Observation: {content}\n"},
        generation_prompt="Assistant: ",
        reply="{content}{eos}\n",
    ),
}


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
        template: None, `chatml`, `llama3` or `plain`.
    """

    def __init__(self, tokenizer, template: Optional[str] = None) -> None:
        self.tokenizer = tokenizer
        self.name = template or "tokenizer"
        eos = tokenizer.eos_token or ""
        if template is None:
            if not getattr(tokenizer, "chat_template", None):
                raise DataError("the tokenizer has no chat template: set `template: plain` for a base model "
                                "(or `chatml` / `llama3`).")
            self._render: Callable[..., str] = self._render_tokenizer
        elif template in BUILTIN_TEMPLATES:
            builtin = BUILTIN_TEMPLATES[template]
            bos = tokenizer.bos_token if adds_bos(tokenizer) else ""
            self._render = lambda messages, add_generation_prompt, tools=None: builtin.render(
                messages, add_generation_prompt, eos=eos, bos=bos, tools=tools)
        else:
            raise DataError(f"template={template!r} is unknown; choose one of {', '.join(BUILTIN_TEMPLATES)} "
                            "or leave it unset to use the tokenizer's own chat template.")

    def _render_tokenizer(self, messages: list[Message], add_generation_prompt: bool,
                          tools: Optional[str] = None) -> str:
        kwargs = {}
        if tools:
            try:
                parsed = json.loads(tools)
                kwargs["tools"] = parsed if isinstance(parsed, list) else [parsed]
            except json.JSONDecodeError:
                kwargs["tools"] = [tools]
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)

    def render(self, messages: list[Message], add_generation_prompt: bool = False,
               tools: Optional[str] = None) -> str:
        """The conversation as text, as the model sees it."""
        return self._render(messages, add_generation_prompt, tools=tools)

    def chunks(self, messages: list[Message], tools: Optional[str] = None) -> list[tuple[str, bool]]:
        """Split a conversation into consecutive text chunks flagged `True` for assistant replies.

        The chunks concatenate to the rendered conversation up to the end of the last reply (its
        end-of-turn token and the template's text after it). Prompt chunks hold everything else: system prompt (also one the template injects), user turns,
        tool outputs and each turn's generation prompt.

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
