"""The models `alignkit api` serves and the batching decode loop behind every request.

`ServedModels` loads the base model once and each `--adapter NAME=DIR` onto it as a named PEFT adapter, so one
copy of the base weights serves every model id: the base with the adapters disabled, an adapter switched in
(`model.adapters.use_adapter`). Each id has its own chat formatter, since training saves its template beside the
adapter (`load_tokenizer` reads it).

`BatchEngine` runs generation in one worker thread. Requests wait in a bounded queue (a full one is refused, HTTP
429); the worker takes the oldest and with it every waiting request for the same model id and the same decoding
knobs (greedy, or the same temperature and top_p), up to `max_batch_rows` completion rows, and decodes them as one
batch through the rollout decoder (`model.generation.generate_with_decode`: left-padded prompts, a shared prompt
prefilled once for `n` > 1, packed weights with the adapter merged on a CPU). Each row draws from its own
generator (`seed` + choice index when the request gives a seed), so a seeded request's tokens do not depend on
what it was batched with. After each step the decoder calls back (`on_step`): rows are stopped there at a stop
string or their own `max_tokens`, and the new text goes out to streaming clients.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..config import FinetuningArguments, ModelArguments
from ..data.collator import padding_token_id
from ..data.template import ChatFormatter
from ..errors import ConfigError
from ..model.generation import generate_with_decode, pad_prompts
from ..model.loader import load_image_processing, load_model, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """One model id: the adapter to switch in (None: the base), the formatter of its chat template, and for a
    vision-language model its processor (`data.multimodal.ImageProcessing`; None for a text-only one)."""

    model_id: str
    adapter: Optional[str]
    formatter: ChatFormatter
    stop_token_ids: list[int]
    images: Optional[Any] = None


class ServedModels:
    """The base model and its named adapters, loaded once (see the module docstring).

    Args:
        model_args: the base (`model_name_or_path`; None: the bundled model). Its `adapter_name_or_path` must be
            empty: adapters are given by name.
        adapters: {model id: adapter directory}.
        template: the chat template for every id (None: each one's tokenizer's own, as saved with the adapter).
        base_id: the base's model id.
        default_system: the system prompt of requests without one, in place of `template`'s (which it needs).

    Raises:
        ConfigError: an adapter directory that is missing, a reward model's adapter, an adapter trained over
            other adapters, or one trained on another base; an id used twice.
    """

    def __init__(self, model_args: ModelArguments, adapters: dict[str, str], template: Optional[str],
                 base_id: str, default_system: Optional[str] = None) -> None:
        from ..model.loader import is_reward_adapter, read_base_adapters

        if base_id in adapters:
            raise ConfigError(f"--adapter {base_id}=...: {base_id!r} is the base model's id; name the adapter "
                              "otherwise.")
        for name, folder in adapters.items():
            if not (Path(folder) / "adapter_config.json").is_file():
                raise ConfigError(f"--adapter {name}={folder}: no adapter_config.json there; give a LoRA adapter "
                                  "directory (a LoRA run's output_dir).")
            if is_reward_adapter(folder):
                raise ConfigError(f"--adapter {name}={folder} is a reward model's adapter; `alignkit api` serves "
                                  "causal LMs (score with `alignkit score`).")
            if read_base_adapters(folder):
                raise ConfigError(f"--adapter {name}={folder} was trained over other adapters "
                                  f"({', '.join(read_base_adapters(folder))}); merge them with `alignkit export "
                                  "--adapter ...` and serve the export as --model with this adapter's own run "
                                  "exported too, or serve each chain's export separately.")
        self.models: dict[str, ServedModel] = {}
        self.models[base_id] = self._served(base_id, None, model_args, template, default_system)
        for name, folder in adapters.items():
            self.models[name] = self._served(name, folder, model_args, template, default_system)
        self.model = load_model(model_args, FinetuningArguments(), is_trainable=False)
        if adapters:
            from peft import PeftModel

            names = list(adapters)
            self.model = PeftModel.from_pretrained(self.model, adapters[names[0]], adapter_name=names[0])
            for name in names[1:]:
                self.model.load_adapter(adapters[name], adapter_name=name)
            self.model.requires_grad_(False)
            self.model.eval()
        if torch.cuda.is_available():
            self.model.to("cuda")
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None

    @staticmethod
    def _served(model_id: str, adapter: Optional[str], model_args: ModelArguments,
                template: Optional[str], default_system: Optional[str] = None) -> ServedModel:
        from dataclasses import replace

        tokenizer = load_tokenizer(replace(model_args, adapter_name_or_path=adapter))
        formatter = ChatFormatter(tokenizer, template, default_system)
        return ServedModel(model_id, adapter, formatter, formatter.stop_token_ids(),
                           load_image_processing(model_args, tokenizer))

    def weights_for(self, served: ServedModel):
        """A context in which `self.model` computes `served`'s model: its adapter alone, or none."""
        from contextlib import nullcontext

        from ..model.adapters import use_adapter

        if served.adapter is None:
            return self.model.disable_adapter() if hasattr(self.model, "disable_adapter") else nullcontext()
        return use_adapter(self.model, served.model_id)


@dataclass
class Choice:
    """One completion row of a request: its tokens so far, its text, and why it ended."""

    index: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already streamed
    finish_reason: Optional[str] = None


@dataclass
class Job:
    """One chat completion request as the engine runs it.

    `events` receives `("delta", choice_index, text)` as text is decided, `("done", None, None)` at the end, or
    `("error", None, message)`; `emit` puts them where the caller reads (the server's event loop).
    """

    served: ServedModel
    prompt_ids: list[int]
    n: int
    max_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    seed: Optional[int]
    stop: list[str]
    emit: Callable[[tuple], None]
    image_inputs: Optional[dict[str, Any]] = None  # the prompt's pixel inputs laid out by row (one row)
    choices: list[Choice] = field(default_factory=list)
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(self.n)]

    def send(self, event: tuple) -> None:
        """`emit(event)`; a reader that is gone (its event loop closed) cancels the job instead of failing the batch."""
        try:
            self.emit(event)
        except RuntimeError:
            self.cancelled = True

    @property
    def batch_key(self) -> tuple:
        """Jobs with the same key can share one decode: the same weights and the same logits processors. A request
        with images decodes alone (its pixel inputs are padded by their own processor call)."""
        sampling = (self.temperature, self.top_p) if self.do_sample else ()
        alone = (id(self),) if self.image_inputs is not None else ()
        return (self.served.model_id, self.do_sample, *sampling, *alone)


class QueueFull(Exception):
    """The engine's queue holds `max_queue` requests already."""


class BatchEngine:
    """The worker thread that batches waiting requests into decodes (see the module docstring).

    Args:
        models: what is served.
        max_batch_rows: most completion rows (sum of `n`) decoded together.
        max_queue: most requests waiting; one more is refused (`QueueFull`).
        batch_wait: seconds the worker waits after taking a request for others to arrive and join it.
        decode_fn: `generate_with_decode` or a stand-in with its signature (tests script the tokens with it).
    """

    def __init__(self, models: ServedModels, *, max_batch_rows: int = 16, max_queue: int = 64,
                 batch_wait: float = 0.01, decode_fn: Callable[..., Any] = generate_with_decode) -> None:
        self.models = models
        self.max_batch_rows = max_batch_rows
        self.batch_wait = batch_wait
        self.decode_fn = decode_fn
        self.waiting: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.held: list[Job] = []  # taken from the queue but of another batch key than the last batch
        self.batches: list[int] = []  # rows of each decode run, for the log and the tests
        self._thread = threading.Thread(target=self._work, name="alignkit-api-decode", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; raises `QueueFull` when `max_queue` requests wait already."""
        try:
            self.waiting.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def _next_batch(self) -> list[Job]:
        first = self.held.pop(0) if self.held else self.waiting.get()
        time.sleep(self.batch_wait)
        while True:
            try:
                self.held.append(self.waiting.get_nowait())
            except queue.Empty:
                break
        batch, rows, rest = [first], first.n, []
        for job in self.held:
            if job.batch_key == first.batch_key and rows + job.n <= self.max_batch_rows:
                batch.append(job)
                rows += job.n
            else:
                rest.append(job)
        self.held = rest
        return [job for job in batch if not job.cancelled]

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if not batch:
                continue
            try:
                self._decode(batch)
            except Exception as err:  # one failing batch must not end the server: its clients get the error
                logger.exception("decoding a batch of %d requests failed", len(batch))
                for job in batch:
                    job.send(("error", None, f"generation failed: {err}"))
                continue
            for job in batch:
                job.send(("done", None, None))

    def _decode(self, batch: list[Job]) -> None:
        first = batch[0]
        served = first.served
        tokenizer = served.formatter.tokenizer
        rows = [(job, choice) for job in batch for choice in job.choices]
        prompts = [job.prompt_ids for job, _ in rows]
        input_ids, attention_mask = pad_prompts(prompts, padding_token_id(tokenizer))
        generators = None
        if first.do_sample:
            generators = [torch.Generator(device=next(self.models.model.parameters()).device).manual_seed(
                (job.seed + choice.index) if job.seed is not None else random.getrandbits(63)) for job, choice in rows]
        stops = set(served.stop_token_ids)
        self.batches.append(len(rows))
        logger.info("decoding %d rows for %d requests of %s", len(rows), len(batch), served.model_id)

        def on_step(step: int, tokens: torch.Tensor) -> torch.Tensor:
            finished = torch.zeros(len(rows), dtype=torch.bool)
            for i, (job, choice) in enumerate(rows):
                if choice.finish_reason is not None:
                    finished[i] = True
                    continue
                if job.cancelled:
                    choice.finish_reason = "cancelled"
                    finished[i] = True
                    continue
                token = int(tokens[i])
                choice.tokens.append(token)
                if token in stops:
                    choice.finish_reason = "stop"
                    self._flush(job, choice, tokenizer, final=True)
                elif len(choice.tokens) >= job.max_tokens:
                    choice.finish_reason = "length"
                    self._flush(job, choice, tokenizer, final=True)
                else:
                    self._flush(job, choice, tokenizer, final=False)
                finished[i] = choice.finish_reason is not None
            return finished

        images = {}
        if first.image_inputs is not None:  # alone in its batch (`batch_key`): its n rows share the prompt's images
            images["image_inputs"] = {key: value.expand(len(rows), *value.shape[1:])
                                      for key, value in first.image_inputs.items()}
        with self.models.weights_for(served):
            self.decode_fn(self.models.model, tokenizer, input_ids, attention_mask,
                           stop_token_ids=served.stop_token_ids, generation_kwargs=_generation_kwargs(batch),
                           generator=generators, on_step=on_step, **images)
        for job, choice in rows:
            if choice.finish_reason is None:  # the decoder ended at its own limit
                choice.finish_reason = "length"
                self._flush(job, choice, tokenizer, final=True)

    @staticmethod
    def _flush(job: Job, choice: Choice, tokenizer, final: bool) -> None:
        """Decode the row's tokens, cut at a stop string, and emit the text that can no longer change."""
        text = tokenizer.decode(choice.tokens, skip_special_tokens=True)
        hold = 0
        for stop in job.stop:
            at = text.find(stop)
            if at >= 0:
                text, final = text[:at], True
                choice.finish_reason = "stop"
        if not final:
            if text.endswith("\ufffd"):  # a character whose bytes are not all decoded yet
                return
            # Keep back a tail that could still become a stop string.
            hold = max((k for stop in job.stop for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        choice.text = text
        ready = len(text) - hold
        if ready > choice.sent:
            job.send(("delta", choice.index, text[choice.sent:ready]))
            choice.sent = ready


def _generation_kwargs(batch: list[Job]) -> dict[str, Any]:
    first = batch[0]
    kwargs: dict[str, Any] = {"max_new_tokens": max(job.max_tokens for job in batch), "do_sample": first.do_sample}
    if first.do_sample:
        kwargs.update(temperature=first.temperature, top_p=first.top_p)
    return kwargs


__all__ = ["ServedModel", "ServedModels", "Choice", "Job", "QueueFull", "BatchEngine"]
