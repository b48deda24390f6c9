"""`alignkit api` on a loopback port with the tiny model and an adapter, driven by the `openai` client.

One server process serves the module (loading it is most of the cost); every request is bounded (`max_tokens`,
client timeouts). The tool-call test runs the app in-process with a scripted decoder, since a random model never
writes a call.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sse_starlette")
openai = pytest.importorskip("openai")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

KEY = "test-key"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _save_adapter(model_dir: str, out) -> str:
    """A LoRA adapter over the tiny model whose lora_B is random (as if trained, so it changes the replies)."""
    import torch

    from alignkit.config.parse import parse_config
    from alignkit.model.loader import load_model

    config = parse_config({"model_name_or_path": model_dir})
    torch.manual_seed(3)
    model = load_model(config.model, config.finetuning, is_trainable=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape) * 0.5)
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """(base_url, adapter_dir, log path) of `alignkit api` serving the tiny model as `tiny` and an adapter as `sft`."""
    import httpx

    root = tmp_path_factory.mktemp("api")
    adapter = _save_adapter(tiny_model_dir, root / "sft")
    port = _free_port()
    log = root / "server.log"
    env = {**os.environ, "ALIGNKIT_HOME": str(root / "home"), "ALIGNKIT_API_KEY": KEY}
    with open(log, "w") as stream:
        process = subprocess.Popen(
            [sys.executable, "-m", "alignkit", "api", "--model", tiny_model_dir, "--model-name", "tiny",
             "--adapter", f"sft={adapter}", "--port", str(port), "max_new_tokens=16"],
            stdout=stream, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=2).is_success:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"alignkit api did not start:\n{log.read_text()}")
            time.sleep(0.3)
        yield base_url, adapter, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0], api_key=KEY, timeout=60, max_retries=0)


def _chat_reply(model_dir: str, adapter, max_new_tokens: int) -> str:
    from alignkit.chat import chat

    overrides = [f"model_name_or_path={model_dir}", f"max_new_tokens={max_new_tokens}"]
    config = parse(overrides + ([f"adapter_name_or_path={adapter}"] if adapter else []))
    return chat(config.model, config.generating, prompt=MESSAGES[0]["content"], stream=io.StringIO())


def parse(overrides):
    from alignkit.config.parse import parse_config

    return parse_config({}, overrides)


def test_models_lists_the_base_and_the_adapter(client):
    assert [model.id for model in client.models.list().data] == ["tiny", "sft"]


@pytest.mark.parametrize("model", ["tiny", "sft"])
def test_greedy_reply_equals_alignkit_chat_and_the_stream_joins_to_it(client, server, tiny_model_dir, model):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12)
    expected = _chat_reply(tiny_model_dir, server[1] if model == "sft" else None, 12)
    assert reply.choices[0].message.content == expected
    assert reply.model == model and reply.object == "chat.completion"

    stream = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].usage.model_dump() == reply.usage.model_dump()


def test_max_tokens_ends_with_length_and_exact_usage(client, server, tiny_model_dir):
    from transformers import AutoTokenizer

    from alignkit.data.template import ChatFormatter
    from alignkit.model.generation import encode_prompts

    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=3)
    prompt_tokens = len(encode_prompts(ChatFormatter(AutoTokenizer.from_pretrained(tiny_model_dir)), [MESSAGES])[0])
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
        prompt_tokens, 3, prompt_tokens + 3)


def test_seeded_sampling_repeats_and_n_gives_n_choices(client):
    def sample():
        return client.chat.completions.create(model="sft", messages=MESSAGES, temperature=1.0, top_p=0.9, seed=7,
                                              n=2, max_tokens=8)

    first, second = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert 2 <= first.usage.completion_tokens <= 16


def test_stop_string_cuts_the_reply(client):
    def ask(**stop):  # seeded sampling: the same reply twice, and a random model's replies run long
        return client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=1, max_tokens=12,
                                              **stop).choices[0]

    text = ask().message.content
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = ask(stop=[stop, "never-in-the-reply"])
    assert cut.message.content == text[:text.find(stop)] and cut.finish_reason == "stop"


def test_errors_are_openai_shaped(client, server):
    bad_key = openai.OpenAI(base_url=server[0], api_key="wrong", timeout=30, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad_key.models.list()
    assert err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "tiny, sft" in err.value.body["message"]
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=5)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    assert err.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, n=100)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100_000)
    assert err.value.status_code == 413 and err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * (2 << 20)}])
    assert err.value.status_code == 413


def test_eight_concurrent_clients_complete_in_shared_decodes(server):
    results, failures = {}, []

    def ask(i: int) -> None:
        client = openai.OpenAI(base_url=server[0], api_key=KEY, timeout=120, max_retries=0)
        try:
            reply = client.chat.completions.create(
                model="sft" if i % 2 else "tiny", messages=[{"role": "user", "content": f"Count to {i}."}],
                temperature=0, max_tokens=6)
            results[i] = reply.choices[0].finish_reason
        except Exception as err:  # noqa: BLE001 - reported below
            failures.append(repr(err))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=150)
    assert not failures and sorted(results) == list(range(8))
    assert set(results.values()) <= {"stop", "length"}
    batches = [line for line in server[2].read_text().splitlines() if "decoding" in line and "requests of" in line]
    assert any(int(line.split("rows for ")[1].split()[0]) > 1 for line in batches), batches


def test_tool_calls_come_back_parsed(tiny_model_dir):
    """A scripted reply in the template's call format comes back as `tool_calls` (streamed and not)."""
    from starlette.testclient import TestClient

    from alignkit.config.parse import parse_config
    from alignkit.serve.app import create_app
    from alignkit.serve.engine import BatchEngine, ServedModels

    config = parse_config({"model_name_or_path": tiny_model_dir})
    models = ServedModels(config.model, {}, "chatml", "tiny")
    tokenizer = models.models["tiny"].formatter.tokenizer
    reply = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')
    seen_prompts = []

    def scripted(model, tokenizer_, input_ids, attention_mask, *, on_step, **kwargs):
        import torch

        seen_prompts.append(tokenizer.decode(input_ids[0][attention_mask[0].bool()]))
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + models.models["tiny"].stop_token_ids[:1]
        for step, token in enumerate(ids):
            if bool(on_step(step, torch.tensor([token] * input_ids.size(0))).all()):
                break

    engine = BatchEngine(models, decode_fn=scripted)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    with TestClient(create_app(engine)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        answer = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, max_tokens=300)
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools, max_tokens=300,
                                                     stream=True))
    assert "<tools>" in seen_prompts[0] and '"get_weather"' in seen_prompts[0]
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    # Streamed as OpenAI streams calls: per call a delta with index, id, type and name, then its arguments;
    # the openai library's own accumulator rebuilds the same message from the chunks.
    calls = [call for c in chunks if c.choices and c.choices[0].delta.tool_calls for call in c.choices[0].delta.tool_calls]
    assert [(call.index, call.id is not None, call.function.name) for call in calls] == [
        (0, True, "get_weather"), (0, False, None), (1, True, "get_weather"), (1, False, None)]
    assert calls[0].function.arguments == "" and calls[0].type == "function"
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(c)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Let me look."
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert "tool_call" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("wrapper", [("<tool_call>\n", "\n</tool_call>"), ("", "")])
@pytest.mark.parametrize("text", [
    'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": [1, "}"]}}\n</tool_call>\nDone. ',
    '{"name": "f", "arguments": {}}{"name": "g", "parameters": {"y": 2}}',
    'no call here, only <tool_ and { braces',
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}',  # cut off mid-call: stays text
    '<tool_call>\n{"not": "a call"}\n</tool_call> and {"name": "h"}',
])
def test_tool_call_stream_splits_as_the_whole_text_parses(text, wrapper):
    """Fed one character at a time, the stream's content pieces join into `parse_tool_calls`' content and its
    calls are the same calls."""
    from alignkit.serve.tools import ToolCallStream, parse_tool_calls

    stream = ToolCallStream(wrapper)
    events = [event for ch in text for event in stream.feed(ch)] + stream.finish()
    content, calls = parse_tool_calls(text, wrapper)
    assert ("".join(v for k, v in events if k == "content") or None) == content
    assert [v["function"] for k, v in events if k == "call"] == [c["function"] for c in calls]


def test_tool_call_stream_releases_content_before_the_reply_ends():
    from alignkit.serve.tools import ToolCallStream

    stream = ToolCallStream(("<tool_call>\n", "\n</tool_call>"))
    assert stream.feed("Hello there") == [("content", "Hello there")]
    assert stream.feed(" <tool") == []  # may open a call: held
    assert stream.feed('_call>\n{"name": "f", "argu') == []  # the call is still arriving
    [(kind, call)] = stream.feed('ments": {}}\n</tool_call>')
    assert kind == "call" and call["function"] == {"name": "f", "arguments": "{}"}
    assert stream.finish() == []


def test_tool_call_format_round_trips_through_the_template(tiny_tokenizer):
    from alignkit.data.template import ChatFormatter
    from alignkit.serve.tools import call_wrapper, parse_tool_calls

    for template in ("chatml", "llama3", None):
        try:
            formatter = ChatFormatter(tiny_tokenizer, template)
        except Exception:  # noqa: BLE001 - a template whose tokens the tiny tokenizer lacks
            continue
        messages = [{"role": "user", "content": "q"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}]
        try:
            full = formatter.render(messages)
        except Exception:  # noqa: BLE001 - the tokenizer's own template without tool support
            continue
        reply = full[len(formatter.render(messages[:1], add_generation_prompt=True)):]
        content, calls = parse_tool_calls(reply.split("<|im_end|>")[0], call_wrapper(formatter))
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("add", {"a": 1, "b": 2})], template
        assert content is None


def test_cli_refuses_bad_adapters_before_loading(tmp_path, capsys):
    from alignkit.errors import ConfigError
    from alignkit.serve import is_loopback, parse_adapters

    assert parse_adapters(["a=/x", "/y/b/"]) == {"a": "/x", "b": "/y/b/"}
    with pytest.raises(ConfigError, match="given twice"):
        parse_adapters(["a=/x", "a=/y"])
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")
    from alignkit.cli import main

    assert main(["api", "--adapter", f"x={tmp_path}"]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


def test_default_system_is_the_system_prompt_of_requests_without_one(tiny_model_dir):
    """`alignkit api ... template=chatml default_system=...`: each served id's formatter writes it where a request's
    messages bring no system message."""
    from alignkit.config.parse import parse_config
    from alignkit.serve.engine import ServedModels

    config = parse_config({"model_name_or_path": tiny_model_dir, "template": "chatml", "default_system": "Be terse."})
    models = ServedModels(config.model, {}, config.data.template, "tiny", config.data.default_system)
    text = models.models["tiny"].formatter.render([{"role": "user", "content": "Hi"}], True)
    assert text.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")
