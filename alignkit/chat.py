"""`alignkit chat`: talk to a model (base + merged adapters) through the configured chat template.

With a prompt it answers once; without one it runs a loop that keeps the conversation history
(`clear` forgets it, `exit` quits). With `--image` files (a vision-language model), the images go with the first
user message: at its `<image>` placeholders, or before its text when it has none. With `--tools` and/or
`--environment-factory` the replies run GRPO's tool loop (`tool_turns`); an environment is one instance for the
conversation (`start_environment`). Prompts are rendered and stopped as everywhere else
(`model.generation`): the `template` key (the tokenizer's own when unset) and its end-of-turn token.
Tokens are written as they are generated: `generate` runs in a thread and feeds a
`TextIteratorStreamer`, which this thread drains.
"""

from __future__ import annotations

import json
import sys
from threading import Thread
from typing import Any, Callable, Iterator, Optional, Sequence, TextIO

import torch

from .data.template import ChatFormatter
from .config import FinetuningArguments, GeneratingArguments, ModelArguments
from .model.generation import encode_prompts, generate, pad_prompts
from .data.multimodal import IMAGE_PLACEHOLDER, ImageProcessing, open_image, tokenize_with_images
from .errors import ConfigError, RowError
from .model.loader import load_image_processing, load_model, load_tokenizer

EXIT_COMMAND = "exit"
CLEAR_COMMAND = "clear"


def build_messages(history: list[dict[str, str]], query: str, system: str | None) -> list[dict[str, str]]:
    """The conversation to send: optional system message, earlier turns, then the new user message."""
    messages = [{"role": "system", "content": system}] if system else []
    return messages + history + [{"role": "user", "content": query}]


def with_images(query: str, count: int) -> str:
    """The first user message of a chat with `count` images: `<image>` placeholders before the text unless it
    holds them already.

    Raises:
        ConfigError: the text holds placeholders, but not one per image.
    """
    held = query.count(IMAGE_PLACEHOLDER)
    if held == 0:
        return IMAGE_PLACEHOLDER * count + query
    if held != count:
        raise ConfigError(f"{count} image(s) given but the message holds {held} {IMAGE_PLACEHOLDER} placeholder(s); "
                          f"write one per image, or none to put the images before the text.")
    return query


def reply_pieces(model, formatter: ChatFormatter, messages: list[dict[str, str]],
                 generating_args: GeneratingArguments, images: Optional[ImageProcessing] = None,
                 image_paths: Sequence[str] = ()) -> Iterator[str]:
    """Generate the assistant's reply to `messages`, yielding it piece by piece as tokens are decoded.

    Args:
        model: the causal LM.
        formatter: the chat template (renders the prompt, gives the end-of-turn stop tokens).
        messages: the conversation, ending with the user's message.
        generating_args: decoding settings.
        images, image_paths: a vision-language model's processor and the conversation's images, in the order of its
            `<image>` placeholders.

    Yields:
        Successive pieces of the reply text (special tokens removed); an error of the generation is raised
        after the last piece.
    """
    from transformers import TextIteratorStreamer

    tokenizer = formatter.tokenizer
    pixels: dict[str, Any] = {}
    if image_paths:
        prompt_text = formatter.prompt_text(messages)
        prompt_ids = tokenize_with_images(tokenizer, [prompt_text], [images.expansion(p) for p in image_paths])
        pixels = images.pixel_inputs(image_paths)
    else:
        prompt_ids = encode_prompts(formatter, [messages])
    input_ids, attention_mask = pad_prompts(prompt_ids, tokenizer.pad_token_id)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            generate(model, tokenizer, input_ids, attention_mask, stop_token_ids=formatter.stop_token_ids(),
                     generation_kwargs=generating_args.to_generation_kwargs(), streamer=streamer, model_inputs=pixels)
        except BaseException as err:  # re-raised below; end the stream so the reader does not wait forever
            failure.append(err)
            streamer.end()

    thread = Thread(target=run, daemon=True)
    thread.start()
    yield from streamer
    thread.join()
    if failure:
        raise failure[0]


def stream_reply(model, formatter: ChatFormatter, messages: list[dict[str, str]],
                 generating_args: GeneratingArguments, stream: TextIO, images: Optional[ImageProcessing] = None,
                 image_paths: Sequence[str] = ()) -> str:
    """Generate the assistant's reply to `messages`, writing it to `stream` piece by piece.

    Args:
        model: the causal LM.
        formatter: the chat template (renders the prompt, gives the end-of-turn stop tokens).
        messages: the conversation, ending with the user's message.
        generating_args: decoding settings.
        stream: where the reply is written.
        images, image_paths: as for `reply_pieces`.

    Returns:
        The reply text (special tokens removed).
    """
    pieces = []
    for piece in reply_pieces(model, formatter, messages, generating_args, images, image_paths):
        pieces.append(piece)
        stream.write(piece)
        stream.flush()
    stream.write("\n")
    stream.flush()
    return "".join(pieces)


def tool_turns(model, formatter: ChatFormatter, messages: list[dict[str, Any]], generating_args: GeneratingArguments,
               tools: list[Callable[..., Any]], *, max_iterations: Optional[int] = 5, tool_timeout: float = 5.0,
               max_tool_output_chars: int = 10_000) -> list[dict[str, Any]]:
    """The assistant's reply when it may call `tools`: the same loop as GRPO's tool rollouts (`rl.tools.ToolLoop`),
    greedy or sampled as `generating_args` says.

    `max_new_tokens` bounds each turn; the whole reply gets that times `max_iterations + 1` (6 turns without a cap).

    Returns:
        The reply's messages (assistant turns with their `tool_calls`, tool results), to add to the history.
    """
    from .rl.tools import ToolLoop

    tokenizer = formatter.tokenizer
    loop = ToolLoop(tools, None, formatter, formatter.stop_token_ids())
    _, row_tools, _, prompt_ids = loop.start([messages], [{}])
    kwargs = generating_args.to_generation_kwargs()
    per_turn = kwargs.get("max_new_tokens") or 512

    def generate_turn(contexts, rows, turn, max_new_tokens):
        input_ids, attention_mask = pad_prompts(contexts, tokenizer.pad_token_id)
        out = generate(model, tokenizer, input_ids, attention_mask, stop_token_ids=formatter.stop_token_ids(),
                       generation_kwargs={**kwargs, "max_new_tokens": min(per_turn, max_new_tokens)})
        return [row[:n].tolist() for row, n in zip(out.completion_ids, out.completion_mask.sum(1))]

    turns = (max_iterations if max_iterations is not None else 5) + 1
    rollout = loop.run(generate_turn, prompt_ids, row_tools, max_completion_length=per_turn * turns,
                       max_iterations=max_iterations, timeout=tool_timeout,
                       max_tool_output_chars=max_tool_output_chars)
    return rollout.messages[0]


def tool_turn_lines(reply: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A tool reply (`tool_turns`) as lines to show, in order: `("text", ...)` for what the model wrote,
    `("call", '-> add({"a": 2, "b": 3})')` for each call, `("result", "[add] 5")` for each tool result."""
    lines = []
    for message in reply:
        if message["role"] == "tool":
            lines.append(("result", f"[{message['name']}] {message['content']}"))
            continue
        if message["content"]:
            lines.append(("text", message["content"]))
        for call in message.get("tool_calls", []):
            lines.append(("call", f"-> {call['function']['name']}({json.dumps(call['function']['arguments'])})"))
    return lines


def tool_reply(model, formatter: ChatFormatter, messages: list[dict[str, Any]], generating_args: GeneratingArguments,
               tools: list[Callable[..., Any]], stream: TextIO, *, max_iterations: Optional[int] = 5,
               tool_timeout: float = 5.0, max_tool_output_chars: int = 10_000) -> list[dict[str, Any]]:
    """`tool_turns`, each turn's text and calls and each tool result written to `stream` in order once the reply is
    complete (`tool_turn_lines`).

    Returns:
        The reply's messages, to add to the history.
    """
    reply = tool_turns(model, formatter, messages, generating_args, tools, max_iterations=max_iterations,
                       tool_timeout=tool_timeout, max_tool_output_chars=max_tool_output_chars)
    for _, line in tool_turn_lines(reply):
        stream.write(line + "\n")
    stream.flush()
    return reply


def start_environment(environment: Any, messages: list[dict[str, Any]]) -> tuple[str, Optional[str]]:
    """Reset the conversation's environment at its first message, as training resets a row's before its rollout:
    `reset(prompt=messages)` (a chat has no dataset columns), a string it returns appended to that message.

    Args:
        environment: the instance (`environment_factory()`).
        messages: the conversation so far: the system message, if any, and the first user message.

    Returns:
        `(content, observation)`: the first user message's text as the model is to see it (and as the history keeps
        it), and the observation (None when `reset` returned none).
    """
    observation = environment.reset(prompt=[dict(m) for m in messages])
    if not isinstance(observation, str):
        return messages[-1]["content"], None
    return messages[-1]["content"] + observation, observation


def load_chat_model(model_args: ModelArguments, template: str | None = None) -> tuple[Any, ChatFormatter]:
    """The model (base + merged adapters, eval mode, on the GPU when there is one) and its chat formatter.

    A template the tokenizer cannot stop on fails before the model loads.
    """
    tokenizer = load_tokenizer(model_args)
    formatter = ChatFormatter(tokenizer, template)
    formatter.stop_token_ids()
    model = load_model(model_args, FinetuningArguments(), is_trainable=False)
    if torch.cuda.is_available():
        model.to("cuda")
    return model, formatter


def chat_images(model_args: ModelArguments, image_paths: Sequence[str], source: str = "--image") -> Optional[ImageProcessing]:
    """The model's processor for `--image` files (None without them), read before the weights load.

    Args:
        source: where the images come from, for the messages (the board's chat says its own).

    Raises:
        ConfigError: a text-only model, or a file that is missing or not an image.
    """
    if not image_paths:
        return None
    images = load_image_processing(model_args, load_tokenizer(model_args))
    if images is None:
        raise ConfigError(f"{source} needs a vision-language model; {model_args.model_name_or_path or 'the bundled model'}"
                          " is text-only (docs/multimodal.md).")
    check_images(image_paths, source)
    return images


def check_images(image_paths: Sequence[str], source: str = "--image") -> None:
    """Raise a ConfigError naming `source` and the file when one of `image_paths` is missing or not an image."""
    for path in image_paths:
        try:
            open_image(path)
        except RowError as err:
            raise ConfigError(f"{source}: {err.problem}") from None


def _read_piped_line(_prompt: str) -> str:
    """One line of standard input read from a pipe: no prompt (there is nobody to prompt), EOFError at its end."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line


def chat(
    model_args: ModelArguments,
    generating_args: GeneratingArguments,
    *,
    prompt: str | None = None,
    system: str | None = None,
    template: str | None = None,
    stream: TextIO = sys.stdout,
    input_fn: Callable[[str], str] | None = None,
    images: Sequence[str] | None = None,
    tools: list[str] | None = None,
    environment_factory: str | None = None,
) -> str | None:
    """Answer `prompt` once, or hold an interactive conversation when `prompt` is None.

    Args:
        model_args: the model and the adapters (merged for speed).
        generating_args: decoding settings (greedy by default).
        prompt: a single user message; the reply is returned.
        system: an optional system message put before the conversation.
        template: the chat template (a built-in name, see `alignkit.data.template`; None: the tokenizer's own,
            which for a trained adapter is the template saved with it).
        stream: where replies (and the interactive prompts' echoes) are written.
        input_fn: reads one user line, given the prompt to show. None: `input` on a terminal; from a pipe
            (`alignkit chat < questions.txt`), standard input's lines without a prompt, each echoed after it is
            read, so that the transcript reads as a conversation and does not end in a dangling `User: `.
        images: image files for the first user message (a vision-language model); they stay in the history until
            `clear`.
        tools: `file.py:function` / `module:function` specs the model may call (`tool_reply`, GRPO's tool loop);
            checked before the model loads. The template must write tool calls (e.g. `template=chatml`).
        environment_factory: `file.py:Class` / `module:Class` (TRL's contract, as GRPO's `environment_factory`),
            alone or with `tools`, checked before the model loads. One instance serves the conversation: it is reset
            at the conversation's first message (`start_environment`; again at the first message after `clear`),
            the observation is appended to that message and shown as `[reset] ...`, and its public methods are tools
            for every reply, its state carried from one message to the next.

    Returns:
        The reply for a one-shot prompt, None after an interactive session.
    """
    image_paths = list(images or [])
    if image_paths and (tools or environment_factory):
        raise ConfigError("alignkit chat: --image with --tools or --environment-factory is not supported yet (the "
                          "tool loop generates from text only); use one of them.")
    processing = chat_images(model_args, image_paths)
    functions = environment = None
    if tools or environment_factory:
        from .rl.tools import ToolCallFormat, environment_methods, load_environment_factory, load_tools

        functions = load_tools(tools or [])
        if environment_factory:
            environment = load_environment_factory(environment_factory, tools=functions,
                                                   key="--environment-factory")()
            functions += environment_methods(environment)  # bound to the one instance: its state is the chat's
        ToolCallFormat.from_formatter(ChatFormatter(load_tokenizer(model_args), template))
    model, formatter = load_chat_model(model_args, template)
    image_arguments = (processing, image_paths) if image_paths else ()

    def answer(history: list[dict[str, Any]], query: str, speaker: str = "") -> tuple[str, list[dict[str, Any]]]:
        """The reply to `query` (written after `speaker`, and after the environment's observation on a new
        conversation) and the messages to add to the history: the user's, as the model saw it, and the reply's."""
        messages = build_messages(history, query, system)
        if environment is not None and not history:  # a new conversation
            query, observation = start_environment(environment, messages)
            messages[-1]["content"] = query
            if observation is not None:
                stream.write(f"[reset] {observation.strip()}\n")
        stream.write(speaker)
        asked = [{"role": "user", "content": query}]
        if functions is None:
            reply = stream_reply(model, formatter, messages, generating_args, stream, *image_arguments)
            return reply, asked + [{"role": "assistant", "content": reply}]
        turns = tool_reply(model, formatter, messages, generating_args, functions, stream)
        return (turns[-1]["content"] if turns and turns[-1]["role"] == "assistant" else ""), asked + turns

    if prompt is not None:
        return answer([], with_images(prompt, len(image_paths)) if image_paths else prompt)[0]

    stream.write(f"Type `{CLEAR_COMMAND}` to forget the conversation, `{EXIT_COMMAND}` to quit.\n")
    piped = input_fn is None and not sys.stdin.isatty()
    if input_fn is None:
        input_fn = _read_piped_line if piped else input
    history: list[dict[str, str]] = []
    while True:
        try:
            query = input_fn("\nUser: ").strip()
        except (EOFError, KeyboardInterrupt):
            if not piped:
                stream.write("\n")  # end the `User: ` line the terminal shows, so the shell's prompt starts afresh
            break
        if piped and query:
            stream.write(f"\nUser: {query}\n")
        if query == EXIT_COMMAND:
            break
        if query == CLEAR_COMMAND:
            history, image_paths, image_arguments = [], [], ()
            stream.write("History cleared.\n")
            continue
        if not query:
            continue
        if image_paths and not history:  # the images go with the first message
            query = with_images(query, len(image_paths))
        history += answer(history, query, "Assistant: ")[1]
    return None


__all__ = ["chat", "stream_reply", "reply_pieces", "tool_reply", "tool_turns", "tool_turn_lines", "start_environment",
           "load_chat_model", "chat_images", "check_images", "with_images", "build_messages"]
