"""`alignkit chat`: talk to a model (base + merged adapters) through its chat template.

With a prompt it answers once; without one it runs a loop that keeps the conversation history
(`clear` forgets it, `exit` quits). Tokens are written as they are generated: `generate` runs in a
thread and feeds a `TextIteratorStreamer`, which this thread drains.
"""

from __future__ import annotations

import sys
from threading import Thread
from typing import Callable, TextIO

import torch

from .hparams import FinetuningArguments, GeneratingArguments, ModelArguments
from .model.loader import load_model, load_tokenizer

EXIT_COMMAND = "exit"
CLEAR_COMMAND = "clear"


def build_messages(history: list[dict[str, str]], query: str, system: str | None) -> list[dict[str, str]]:
    """The conversation to send: optional system message, earlier turns, then the new user message."""
    messages = [{"role": "system", "content": system}] if system else []
    return messages + history + [{"role": "user", "content": query}]


def stream_reply(model, tokenizer, messages: list[dict[str, str]], generating_args: GeneratingArguments,
                 stream: TextIO) -> str:
    """Generate the assistant's reply to `messages`, writing it to `stream` piece by piece.

    Returns:
        The reply text (special tokens removed).
    """
    from transformers import TextIteratorStreamer

    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = dict(**inputs, **generating_args.to_generation_kwargs(), streamer=streamer,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    failure: list[BaseException] = []

    def generate() -> None:
        try:
            with torch.inference_mode():
                model.generate(**kwargs)
        except BaseException as err:  # re-raised below; end the stream so the reader does not wait forever
            failure.append(err)
            streamer.end()

    thread = Thread(target=generate, daemon=True)
    thread.start()
    pieces = []
    for piece in streamer:
        pieces.append(piece)
        stream.write(piece)
        stream.flush()
    thread.join()
    if failure:
        raise failure[0]
    stream.write("\n")
    stream.flush()
    return "".join(pieces)


def chat(
    model_args: ModelArguments,
    generating_args: GeneratingArguments,
    *,
    prompt: str | None = None,
    system: str | None = None,
    stream: TextIO = sys.stdout,
    input_fn: Callable[[str], str] = input,
) -> str | None:
    """Answer `prompt` once, or hold an interactive conversation when `prompt` is None.

    Args:
        model_args: the model and the adapters (merged for speed).
        generating_args: decoding settings (greedy by default).
        prompt: a single user message; the reply is returned.
        system: an optional system message put before the conversation.
        stream: where replies (and the interactive prompts' echoes) are written.
        input_fn: reads one user line; `input` by default, replaceable in tests.

    Returns:
        The reply for a one-shot prompt, None after an interactive session.
    """
    tokenizer = load_tokenizer(model_args)
    model = load_model(model_args, FinetuningArguments(), is_trainable=False)
    if torch.cuda.is_available():
        model.to("cuda")
    if prompt is not None:
        return stream_reply(model, tokenizer, build_messages([], prompt, system), generating_args, stream)

    stream.write(f"Type `{CLEAR_COMMAND}` to forget the conversation, `{EXIT_COMMAND}` to quit.\n")
    history: list[dict[str, str]] = []
    while True:
        try:
            query = input_fn("\nUser: ").strip()
        except (EOFError, KeyboardInterrupt):
            break
        if query == EXIT_COMMAND:
            break
        if query == CLEAR_COMMAND:
            history = []
            stream.write("History cleared.\n")
            continue
        if not query:
            continue
        stream.write("Assistant: ")
        reply = stream_reply(model, tokenizer, build_messages(history, query, system), generating_args, stream)
        history += [{"role": "user", "content": query}, {"role": "assistant", "content": reply}]
    return None


__all__ = ["chat", "stream_reply", "build_messages"]
