"""load_tokenizer / load_model on the tiny model: targets, trainable counts, heads, adapter merging, errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from alignkit.config.parse import parse_config
from tests.helpers import tiny_config
from alignkit.errors import ConfigError
from alignkit.model import load_model, load_tokenizer, resolve_model_path
from alignkit.model.loader import count_parameters, find_linear_modules, resolve_dtype


def _trainable_names(model):
    return [name for name, p in model.named_parameters() if p.requires_grad]


@pytest.fixture
def batch(tiny_tokenizer):
    enc = tiny_tokenizer(["The capital of France is Paris.", "What is 12 plus 7?"], return_tensors="pt",
                         padding=True)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def test_tokenizer_has_pad_and_right_padding(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    # A tokenizer saved without a pad token gets its eos as pad.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(f"{tiny_model_dir}/{name}")
    loaded = load_tokenizer(tiny_config(tmp_path).model)
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"
    assert loaded.padding_side == "right"


def test_lora_all_targets_every_linear_but_the_head(tiny_model_dir):
    config = tiny_config(tiny_model_dir)
    model = load_model(config.model, config.finetuning, is_trainable=True)
    wrapped = {name.split(".")[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not any("lm_head" in n or "embed" in n for n in _trainable_names(model))
    assert all("lora_" in n for n in _trainable_names(model))
    # r=8 on 2 layers, hidden 64, intermediate 128, 2 KV heads of 16: A is r x in, B is out x r.
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
    expected = 2 * sum(8 * fan_in + 8 * fan_out for fan_in, fan_out in shapes.values())
    assert count_parameters(model)[0] == expected
    assert model.config.use_cache is False


def test_lora_explicit_targets_and_unknown_target(tiny_model_dir):
    config = tiny_config(tiny_model_dir, lora_target="q_proj,v_proj", lora_rank=4)
    model = load_model(config.model, config.finetuning, is_trainable=True)
    assert {n.split(".")[-4] for n in _trainable_names(model)} == {"q_proj", "v_proj"}
    config = tiny_config(tiny_model_dir, lora_target="qkv_proj")
    with pytest.raises(ConfigError, match="qkv_proj.*not found.*q_proj"):
        load_model(config.model, config.finetuning, is_trainable=True)


def test_full_and_freeze_trainable_counts(tiny_model_dir):
    config = tiny_config(tiny_model_dir, finetuning_type="full")
    model = load_model(config.model, config.finetuning, is_trainable=True)
    trainable, total = count_parameters(model)
    assert trainable == total == sum(p.numel() for p in model.parameters())

    config = tiny_config(tiny_model_dir, finetuning_type="freeze", freeze_trainable_layers=1)
    model = load_model(config.model, config.finetuning, is_trainable=True)
    names = _trainable_names(model)
    assert names and all(n.startswith("model.layers.1.") for n in names)
    layer_size = sum(p.numel() for p in model.model.layers[1].parameters())
    assert count_parameters(model)[0] == layer_size


def test_inference_model_is_frozen_and_in_eval_mode(tiny_model_dir):
    config = tiny_config(tiny_model_dir)
    model = load_model(config.model, config.finetuning, is_trainable=False)
    assert count_parameters(model)[0] == 0 and not model.training
    assert type(model).__name__ == "LlamaForCausalLM"


def test_reward_head_lora_trains_score_in_full(tiny_model_dir, batch):
    config = tiny_config(tiny_model_dir)
    model = load_model(config.model, config.finetuning, is_trainable=True, head="reward")
    base = model.get_base_model()
    assert type(base).__name__ == "LlamaForSequenceClassification"
    assert base.config.num_labels == 1 and base.config.pad_token_id == 2
    score_names = [n for n in _trainable_names(model) if "score" in n]
    assert score_names and all("modules_to_save" in n for n in score_names)
    assert "score" not in find_linear_modules(base)
    assert model(**batch).logits.shape == (2, 1)


def test_reward_head_freeze_trains_score(tiny_model_dir):
    config = tiny_config(tiny_model_dir, finetuning_type="freeze", freeze_trainable_layers=1)
    model = load_model(config.model, config.finetuning, is_trainable=True, head="reward")
    names = _trainable_names(model)
    assert "score.weight" in names
    assert all(n.startswith("model.layers.1.") or n == "score.weight" for n in names)


def test_adapter_is_merged_and_fresh_adapter_disabled_reproduces_it(tiny_model_dir, tmp_path, batch, save_perturbed_adapter):
    adapter_dir = tmp_path / "sft_adapter"
    trained = save_perturbed_adapter(tiny_model_dir, adapter_dir)
    with torch.no_grad():
        expected = trained(**batch).logits
        with trained.disable_adapter():
            base_logits = trained(**batch).logits
    assert (expected - base_logits).abs().max() > 1e-2  # the adapter really changes the model

    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(adapter_dir))
    model = load_model(config.model, config.finetuning, is_trainable=True)
    model.eval()
    # The new adapter is a fresh one: zero effect at step 0, and disabling it leaves the merged SFT model.
    assert all(not p.abs().sum() for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad(), model.disable_adapter():
        reference = model(**batch).logits
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=0)

    inference = load_model(config.model, config.finetuning, is_trainable=False)
    with torch.no_grad():
        torch.testing.assert_close(inference(**batch).logits, expected, atol=1e-5, rtol=0)


def test_reward_adapter_merge_restores_score(tiny_model_dir, tmp_path, batch, save_perturbed_adapter):
    adapter_dir = tmp_path / "rm_adapter"
    trained = save_perturbed_adapter(tiny_model_dir, adapter_dir, head="reward")
    with torch.no_grad():
        trained.base_model.model.score.modules_to_save["default"].weight.add_(1.0)
        trained.save_pretrained(adapter_dir)
        expected = trained(**batch).logits
    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(adapter_dir))
    model = load_model(config.model, config.finetuning, is_trainable=False, head="reward")
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected, atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="reward-model adapter"):
        load_model(config.model, config.finetuning, is_trainable=False)


def test_adapter_for_another_base_is_rejected(tiny_model_dir, tmp_path, save_perturbed_adapter):
    from alignkit.model.tiny import build_tiny_model, build_tiny_tokenizer

    other_dir = tmp_path / "wider"
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(len(tokenizer), hidden_size=32).save_pretrained(other_dir)
    tokenizer.save_pretrained(other_dir)
    adapter_dir = tmp_path / "adapter"
    save_perturbed_adapter(other_dir, adapter_dir)

    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(adapter_dir))
    with pytest.raises(ConfigError, match=r"does not match.*hidden_size: 32 vs 64"):
        load_model(config.model, config.finetuning, is_trainable=True)

    # When the recorded base is gone, PEFT's shape error is turned into the same advice.
    cfg_path = adapter_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = "/nowhere/else"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="cannot apply.*model_name_or_path to the model the adapter"):
        load_model(config.model, config.finetuning, is_trainable=True)


def test_missing_adapter_config_is_named(tiny_model_dir, tmp_path):
    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(tmp_path))
    with pytest.raises(ConfigError, match="holds no adapter_config.json"):
        load_model(config.model, config.finetuning, is_trainable=True)


def test_offline_hub_id_fails_at_once_with_advice(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = parse_config({"model_name_or_path": "someone/not-a-cached-model", "cache_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="neither a local directory nor reachable offline.*smollm2-135m-instruct"):
        resolve_model_path(config.model)
    with pytest.raises(ConfigError, match="not a model directory"):
        resolve_model_path(parse_config({"model_name_or_path": "./no/such/dir"}).model)


@pytest.fixture
def online_hub(monkeypatch):
    """The hub as if online, at `endpoint(url)` (a local address: nothing leaves this machine); the one
    question per model that `resolve_model_path` asks is forgotten before and after."""
    from huggingface_hub import constants

    from alignkit.model import loader

    for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    loader._check_on_hub.cache_clear()
    yield lambda url: monkeypatch.setattr(constants, "ENDPOINT", url)
    loader._check_on_hub.cache_clear()


def test_a_missing_folder_is_named_before_the_hub_is_asked(online_hub, tmp_path, monkeypatch):
    """`models/X` beside a `models/` folder is a mistyped path; `owner/name` with no such folder is asked of the
    hub once: no answer (a closed local port) or no such model is a ConfigError naming the key and the fix,
    not a minute of download retries and an OSError traceback."""
    import http.server
    import socket
    import threading

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    online_hub(f"http://127.0.0.1:{closed}")
    with pytest.raises(ConfigError, match="'models/X' is not a model directory"):
        resolve_model_path(parse_config({"model_name_or_path": "models/X"}).model)
    with pytest.raises(ConfigError, match="'owner/name' is not a folder here.*hub cannot be reached.*HF_HUB_OFFLINE=1"):
        resolve_model_path(parse_config({"model_name_or_path": "owner/name", "cache_dir": str(tmp_path)}).model)

    class NoSuchRepo(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # what the hub answers for a model it does not have
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NoSuchRepo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        online_hub(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(ConfigError, match="'owner/other' is not a folder here.*nor a model on the hub"):
            resolve_model_path(parse_config({"model_name_or_path": "owner/other", "cache_dir": str(tmp_path)}).model)
    finally:
        server.shutdown()
        server.server_close()


def test_auto_dtype_is_fp32_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_dtype("auto") == torch.float16
    assert resolve_dtype("bfloat16") == torch.bfloat16


def test_find_linear_modules_skips_output_heads():
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(2, 2))
    model.add_module("lm_head", nn.Linear(2, 2))
    model.add_module("score", nn.Linear(2, 1))
    assert find_linear_modules(model) == ["proj"]


def test_sft_adapter_can_start_a_reward_model(tiny_model_dir, tmp_path, batch, save_perturbed_adapter):
    adapter_dir = tmp_path / "sft_adapter"
    save_perturbed_adapter(tiny_model_dir, adapter_dir)
    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(adapter_dir))
    sft_merged = load_model(config.model, config.finetuning, is_trainable=False)
    reward = load_model(config.model, config.finetuning, is_trainable=True, head="reward")
    reward.eval()
    # The reward model's decoder is the SFT model's merged decoder (its fresh LoRA is a no-op at step 0).
    with torch.no_grad():
        expected = sft_merged.model(**batch).last_hidden_state
        got = reward.get_base_model().model(**batch).last_hidden_state
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    with torch.no_grad():
        plain = load_model(tiny_config(tiny_model_dir).model, config.finetuning, is_trainable=False).model(**batch)
    assert (plain.last_hidden_state - expected).abs().max() > 1e-2


@pytest.fixture
def load_reports():
    """The weight-loading reports transformers logs (its logger does not propagate to pytest's caplog)."""
    import logging

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            if "LOAD REPORT" in record.getMessage():
                self.messages.append(record.getMessage())

    handler = Collect()
    report_logger = logging.getLogger("transformers.modeling_utils")
    report_logger.addHandler(handler)
    yield handler.messages
    report_logger.removeHandler(handler)


def test_no_missing_score_table_where_the_head_is_trained_or_loaded(tiny_model_dir, tmp_path, load_reports,
                                                                    save_perturbed_adapter):
    """transformers reports `score.weight MISSING` whenever a causal LM checkpoint becomes a classifier. Shown
    only where it matters: not when the head is trained next (rm training) or loaded from the adapter
    (scoring), and the head then really is the adapter's."""
    from safetensors.torch import load_file

    from alignkit.rewards.reward_model import load_reward_model

    config = tiny_config(tiny_model_dir)
    load_model(config.model, config.finetuning, is_trainable=True, head="reward")
    assert load_reports == []

    adapter_dir = tmp_path / "rm"
    trained = save_perturbed_adapter(tiny_model_dir, adapter_dir, head="reward")
    with torch.no_grad():
        trained.base_model.model.score.modules_to_save["default"].weight.add_(1.0)
    trained.save_pretrained(adapter_dir)
    scorer = load_reward_model(adapter_dir)
    assert load_reports == []
    saved = {name: tensor for name, tensor in load_file(adapter_dir / "adapter_model.safetensors").items()
             if "score" in name}
    assert len(saved) == 1
    torch.testing.assert_close(scorer.score.weight, next(iter(saved.values())), atol=0, rtol=0)

    # A plain causal LM as a reward model to score with would get a random head: refused before it loads
    # (tests/fault/test_reward_model_heads.py); loaded as a classifier anyway, the report says so.
    with pytest.raises(ConfigError, match="no trained score head"):
        load_reward_model(tiny_model_dir)
    load_model(config.model, config.finetuning, is_trainable=False, head="reward")
    assert len(load_reports) == 1 and "score.weight" in load_reports[0] and "MISSING" in load_reports[0]


def test_lora_wrapping_does_not_print_peft_deprecation_warning(tiny_model_dir):
    """peft reads transformers' deprecated `is_gradient_checkpointing`; that FutureWarning is not the user's."""
    import warnings

    config = tiny_config(tiny_model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model(config.model, config.finetuning, is_trainable=True)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    # The filter is scoped to our peft calls: the warning itself still reaches anyone else who asks.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_model(config.model, config.finetuning, is_trainable=False).is_gradient_checkpointing
    assert [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_base_adapters_are_recorded_and_put_back_before_the_adapter(tiny_model_dir, tmp_path, batch,
                                                                   save_perturbed_adapter, monkeypatch, caplog):
    """An adapter trained over a merged SFT adapter records it (absolute path); loading the adapter alone merges
    the SFT adapter first, so it gives the model it was trained as; the explicit `sft,dpo` form gives the same."""
    from alignkit.model.loader import BASE_ADAPTERS_FILE, merged_adapters, read_base_adapters, save_base_adapters

    monkeypatch.chdir(tmp_path)  # a relative adapter_name_or_path is recorded as an absolute path
    save_perturbed_adapter(tiny_model_dir, tmp_path / "sft", seed=3)
    trained = save_perturbed_adapter(tiny_model_dir, tmp_path / "dpo", seed=4, over="sft")
    sft_abs = str((tmp_path / "sft").resolve())
    record = json.loads((tmp_path / "dpo" / BASE_ADAPTERS_FILE).read_text())
    assert record["base_adapters"] == [sft_abs] and len(record["sha256"]) == 1 and len(record["sha256"][0]) == 64
    assert read_base_adapters(tmp_path / "dpo") == (sft_abs,)
    with torch.no_grad():
        expected = trained(**batch).logits

    for given in ("dpo", "sft,dpo"):
        caplog.clear()
        config = tiny_config(tiny_model_dir, adapter_name_or_path=given)
        model = load_model(config.model, config.finetuning, is_trainable=False)
        assert merged_adapters(model) == (sft_abs, str((tmp_path / "dpo").resolve()))
        with torch.no_grad():
            torch.testing.assert_close(model(**batch).logits, expected, atol=1e-5, rtol=0)
        assert "trained on top of" not in caplog.text  # the explicit chain is the recorded one: no warning
    with torch.no_grad():  # without the SFT adapter under it, the same adapter is another model
        bare = load_model(tiny_config(tiny_model_dir).model, config.finetuning, is_trainable=False)
        assert (bare(**batch).logits - expected).abs().max() > 1e-2

    # A run that merged nothing, or saved full weights, has nothing to record.
    assert save_base_adapters(bare, tmp_path / "dpo") is None
    assert save_base_adapters(model, tmp_path / "no_adapter_here") is None
    # A chain three deep: an adapter over dpo records sft and dpo, and alone brings both back.
    save_perturbed_adapter(tiny_model_dir, tmp_path / "third", seed=5, over="dpo")
    assert read_base_adapters(tmp_path / "third") == (sft_abs, str((tmp_path / "dpo").resolve()))


def test_a_moved_base_adapter_is_named_and_the_explicit_chain_still_loads(tiny_model_dir, tmp_path, batch,
                                                                         save_perturbed_adapter, caplog):
    save_perturbed_adapter(tiny_model_dir, tmp_path / "sft", seed=3)
    trained = save_perturbed_adapter(tiny_model_dir, tmp_path / "dpo", seed=4, over=tmp_path / "sft")
    with torch.no_grad():
        expected = trained(**batch).logits
    (tmp_path / "sft").rename(tmp_path / "sft_moved")

    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(tmp_path / "dpo"))
    with pytest.raises(ConfigError, match=r"trained on top of the adapter .*/sft \(recorded in .*/dpo/base_adapters"
                                          r".json\), which is no longer there.*adapter_name_or_path=<where"):
        load_model(config.model, config.finetuning, is_trainable=False)

    config = tiny_config(tiny_model_dir, adapter_name_or_path=f"{tmp_path / 'sft_moved'},{tmp_path / 'dpo'}")
    model = load_model(config.model, config.finetuning, is_trainable=False)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected, atol=1e-5, rtol=0)
    assert "was trained on top of" in caplog.text and "using the adapters given" in caplog.text


def test_a_malformed_base_adapters_file_is_named(tiny_model_dir, tmp_path, save_perturbed_adapter):
    from alignkit.model.loader import BASE_ADAPTERS_FILE

    save_perturbed_adapter(tiny_model_dir, tmp_path / "dpo")
    (tmp_path / "dpo" / BASE_ADAPTERS_FILE).write_text('{"base_adapters": "sft"}')
    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(tmp_path / "dpo"))
    with pytest.raises(ConfigError, match=r"dpo/base_adapters.json: expected \{\"base_adapters\""):
        load_model(config.model, config.finetuning, is_trainable=False)


def test_a_base_adapter_retrained_in_place_is_warned_about(tiny_model_dir, tmp_path, save_perturbed_adapter, caplog):
    """The SFT run re-run into the same folder after the DPO run: the path still exists, but the weights under the
    DPO adapter are not those it was trained on; the record's sha256 tells, and loading says so."""
    save_perturbed_adapter(tiny_model_dir, tmp_path / "sft", seed=3)
    save_perturbed_adapter(tiny_model_dir, tmp_path / "dpo", seed=4, over=tmp_path / "sft")
    config = tiny_config(tiny_model_dir, adapter_name_or_path=str(tmp_path / "dpo"))
    load_model(config.model, config.finetuning, is_trainable=False)
    assert "other weights" not in caplog.text
    save_perturbed_adapter(tiny_model_dir, tmp_path / "sft", seed=9)
    for given in (str(tmp_path / "dpo"), f"{tmp_path / 'sft'},{tmp_path / 'dpo'}"):
        caplog.clear()
        config = tiny_config(tiny_model_dir, adapter_name_or_path=given)
        load_model(config.model, config.finetuning, is_trainable=False)
        assert f"The adapter {tmp_path / 'sft'} holds other weights than when {tmp_path / 'dpo'} was trained" in caplog.text
