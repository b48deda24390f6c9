"""The OpenAI-compatible HTTP API: `/v1/models` and `/v1/chat/completions` on FastAPI.

Requests are checked here and then run by `engine.BatchEngine`; errors leave in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with these statuses:

- 400 `invalid_request_error`: a request the fields allow but the server cannot run (no messages, an image part for
  a text-only model or one that is not a base64 `data:` URL of an image, `n` above the limit, tools through a
  template that cannot write them);
- 401 a missing or wrong API key (when the server has one);
- 404 `model_not_found`: a model id that is not served;
- 413 a body over `max_body_bytes`, or a prompt whose tokens plus `max_tokens` exceed the model's context;
- 422 fields of the wrong type or range (pydantic's checks, in the same shape);
- 429 the engine's queue is full.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..data.multimodal import IMAGE_PLACEHOLDER, tokenize_with_images
from ..errors import DataError
from ..model.generation import encode_prompts
from .engine import BatchEngine, Job, QueueFull, ServedModel
from .tools import ToolCallStream, call_wrapper, parse_tool_calls, to_template_messages

MAX_CHOICES = 8  # most `n` per request
MAX_STOP = 4  # most stop strings, as OpenAI allows


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.type, "param": self.param, "code": self.code}})


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The fields of OpenAI's chat completion request this server reads; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[Message]
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None


def create_app(engine: BatchEngine, *, api_key: Optional[str] = None, max_tokens_default: int = 512,
               max_body_bytes: int = 1 << 20) -> FastAPI:
    """The FastAPI application over `engine`.

    Args:
        engine: runs the decodes; `engine.models.models` are the served ids.
        api_key: when set, every request needs `Authorization: Bearer <api_key>`.
        max_tokens_default: a request's `max_tokens` when it gives none (less where the context ends first).
        max_body_bytes: larger request bodies are refused (413) before they are read.
    """
    app = FastAPI(title="alignkit api", docs_url=None, redoc_url=None)
    models = engine.models

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return APIError(422, f"{param}: {first.get('msg', 'invalid value')}" if param else str(err),
                        param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        return APIError(err.status_code, str(err.detail), code=None).response()

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return APIError(401, "Incorrect API key provided. Send it as `Authorization: Bearer <key>` (the "
                                "server's --api-key or ALIGNKIT_API_KEY).", "authentication_error",
                                code="invalid_api_key").response()
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return APIError(413, f"request body of {length} bytes is over the server's limit of {max_body_bytes}.",
                            code="request_too_large").response()
        return await call_next(request)

    @app.get("/v1/models")
    async def list_models():
        created = int(time.time())
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "alignkit"} for model_id in models.models]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        served = models.models.get(body.model)
        if served is None:
            raise APIError(404, f"The model {body.model!r} does not exist; served: {', '.join(models.models)}.",
                           param="model", code="model_not_found")
        prompt_ids, tools_given, image_inputs = _prompt(served, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        context = models.context_length
        if context is not None and len(prompt_ids) + (max_tokens or 1) > context:
            raise APIError(413, f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens or 1}: "
                           f"more than the model's context of {context} tokens. Shorten the messages or lower "
                           "max_tokens.", param="messages", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = max_tokens_default if context is None else min(max_tokens_default, context - len(prompt_ids))
        if body.n > MAX_CHOICES:
            raise APIError(400, f"n={body.n}: at most {MAX_CHOICES} choices per request.", param="n")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP or any(not s for s in stop):
            raise APIError(400, f"stop: up to {MAX_STOP} non-empty strings.", param="stop")

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(served=served, prompt_ids=prompt_ids, n=body.n, max_tokens=max_tokens,
                  do_sample=body.temperature > 0, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                  stop=stop, emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                  image_inputs=image_inputs)
        try:
            engine.submit(job)
        except QueueFull:
            raise APIError(429, "the server's queue is full; retry shortly.", "rate_limit_error",
                           code="queue_full") from None
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        wrapper = call_wrapper(served.formatter) if tools_given else None
        if body.stream:
            return _stream(job, events, body, completion_id, created, wrapper)
        try:
            while True:
                kind, _, message = await events.get()
                if kind == "error":
                    raise APIError(500, message, "server_error")
                if kind == "done":
                    break
        except asyncio.CancelledError:
            job.cancelled = True
            raise
        choices = [_final_choice(choice, wrapper) for choice in job.choices]
        return {"id": completion_id, "object": "chat.completion", "created": created, "model": body.model,
                "choices": choices, "usage": _usage(job), "system_fingerprint": None}

    return app


def _prompt(served: ServedModel, body: ChatCompletionRequest) -> tuple[list[int], bool, Optional[dict[str, Any]]]:
    """The request's prompt token ids, whether tools were put into it, and the pixel inputs of its images (laid out
    by row, one row; None without images).

    OpenAI's image parts (`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`) go to a
    vision-language model as `alignkit chat --image` files do: each becomes the model's image tokens where the part
    stands, and its pixels go with the prompt."""
    if not body.messages:
        raise APIError(400, "messages is empty; give at least one message.", param="messages")
    given = [m.model_dump(exclude_none=True) for m in body.messages]
    images = []
    for i, message in enumerate(given):
        if not isinstance(message.get("content"), list):
            continue
        other = sorted({part.get("type", "?") for part in message["content"]} - {"text", "image_url"})
        if other:
            raise APIError(400, f"messages[{i}].content has {', '.join(other)} parts; this server takes text and "
                           "image_url parts.", param=f"messages[{i}].content")
        parts = []
        for j, part in enumerate(message["content"]):
            if part.get("type") == "image_url":
                param = f"messages[{i}].content[{j}].image_url"
                if served.images is None:
                    raise APIError(400, f"{param}: model {served.model_id!r} is text-only; image parts need a "
                                   "vision-language model (docs/multimodal.md).", param=param)
                images.append(_data_url_image(part.get("image_url"), param))
                part = {"type": "text", "text": IMAGE_PLACEHOLDER}
            parts.append(part)
        message["content"] = parts
    messages = to_template_messages(given)
    for message in messages:
        if message["role"] == "developer":
            message["role"] = "system"
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    if isinstance(body.tool_choice, dict):
        wanted = body.tool_choice.get("function", {}).get("name")
        tools = [t for t in body.tools or [] if t.get("function", {}).get("name") == wanted]
        if not tools:
            raise APIError(400, f"tool_choice names {wanted!r}, which is not in tools.", param="tool_choice")
    try:
        if served.images is not None:
            text = served.formatter.prompt_text(messages, tools=json.dumps(tools) if tools else None)
            placeholders = text.count(IMAGE_PLACEHOLDER)
            if placeholders != len(images):
                raise APIError(400, f"the messages hold {placeholders - len(images)} {IMAGE_PLACEHOLDER} text(s) "
                               "besides their image_url parts; this model reads that text as an image's place: send "
                               "images as image_url parts only.", param="messages")
            ids = tokenize_with_images(served.formatter.tokenizer, [text],
                                       [served.images.image_expansion(image) for image in images])[0]
        else:
            ids = encode_prompts(served.formatter, [messages], tools=[json.dumps(tools) if tools else None])[0]
    except APIError:
        raise
    except DataError as err:
        raise APIError(400, str(err), param="tools" if tools else "messages") from None
    except Exception as err:  # a Jinja template that raises on this conversation (roles out of order, ...)
        raise APIError(400, f"the chat template cannot render these messages: {err}", param="messages") from None
    return ids, bool(tools), served.images.row_pixel_inputs([images]) if images else None


def _data_url_image(image_url: Any, param: str):
    """The image of an `image_url` part: a base64 `data:` URL (this server fetches nothing), decoded (PIL)."""
    import base64
    import binascii
    import io

    from PIL import Image, UnidentifiedImageError

    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    header, _, data = (url or "").partition(",")
    if not (header.startswith("data:") and header.endswith(";base64")):
        raise APIError(400, f"{param}: give the image inline as a base64 data: URL (data:image/png;base64,...); this "
                       "server fetches no URLs.", param=param)
    try:
        with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as image:
            image.load()
            return image.convert("RGB")
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as err:
        raise APIError(400, f"{param}: the data URL does not hold an image PIL can read ({err}).",
                       param=param) from None


def _final_choice(choice, wrapper) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.text}
    finish_reason = choice.finish_reason
    if wrapper is not None:
        content, calls = parse_tool_calls(choice.text, wrapper)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish_reason = "tool_calls"
    return {"index": choice.index, "message": message, "finish_reason": finish_reason, "logprobs": None}


def _usage(job: Job) -> dict[str, int]:
    """Prompt tokens once per request (the `n` choices share the prompt); every generated token of every choice,
    the end-of-turn token included."""
    completion = sum(len(choice.tokens) for choice in job.choices)
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(job.prompt_ids) + completion}


def _stream(job: Job, events: asyncio.Queue, body: ChatCompletionRequest, completion_id: str, created: int, wrapper):
    """Server-sent events: a role chunk per choice, content deltas, a finish chunk per choice, usage, [DONE].

    With tools, each choice's text goes through a `ToolCallStream`: content is streamed as soon as it cannot be
    part of a call, and each call, once its JSON is complete, as OpenAI streams one: a delta with the call's
    `index`, `id`, `type` and `function.name` (arguments ""), then one with its `function.arguments`. The finish
    reason of a choice that called is `tool_calls`.
    """
    from sse_starlette.sse import EventSourceResponse

    def chunk(choices: list[dict[str, Any]], **extra) -> dict[str, str]:
        return {"data": json.dumps({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                    "model": body.model, "choices": choices, **extra})}

    async def produce():
        try:
            for choice in job.choices:
                yield chunk([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None}])
            splitters = {choice.index: ToolCallStream(wrapper) for choice in job.choices} if wrapper else {}
            calls = {choice.index: 0 for choice in job.choices}

            def deltas(index: int, decided: list[tuple[str, Any]]):
                for kind, value in decided:
                    if kind == "content":
                        yield chunk([{"index": index, "delta": {"content": value}, "finish_reason": None}])
                        continue
                    call = {"index": calls[index], "id": value["id"], "type": "function",
                            "function": {"name": value["function"]["name"], "arguments": ""}}
                    arguments = {"index": calls[index], "function": {"arguments": value["function"]["arguments"]}}
                    calls[index] += 1
                    for part in (call, arguments):
                        yield chunk([{"index": index, "delta": {"tool_calls": [part]}, "finish_reason": None}])

            while True:
                kind, index, text = await events.get()
                if kind == "error":
                    yield {"data": json.dumps({"error": {"message": text, "type": "server_error", "param": None,
                                                         "code": None}})}
                    return
                if kind == "done":
                    break
                if wrapper is None:
                    yield chunk([{"index": index, "delta": {"content": text}, "finish_reason": None}])
                else:
                    for event in deltas(index, splitters[index].feed(text)):
                        yield event
            for choice in job.choices:
                if wrapper is not None:
                    for event in deltas(choice.index, splitters[choice.index].finish()):
                        yield event
                finish_reason = "tool_calls" if calls[choice.index] else choice.finish_reason
                yield chunk([{"index": choice.index, "delta": {}, "finish_reason": finish_reason}])
            if body.stream_options is not None and body.stream_options.include_usage:
                yield chunk([], usage=_usage(job))
            yield {"data": "[DONE]"}
        except asyncio.CancelledError:  # the client went away: its rows stop at the next step
            job.cancelled = True
            raise

    return EventSourceResponse(produce(), ping=15)


__all__ = ["create_app", "APIError", "ChatCompletionRequest"]
