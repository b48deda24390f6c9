"""export_model, chat and env_info on the tiny model, in-process."""

from __future__ import annotations

import io
import json

import pytest
import torch

from alignkit.chat import chat
from alignkit.config.parse import parse_config
from alignkit.env import env_info, format_env
from alignkit.errors import ConfigError
from alignkit.export import export_model
from alignkit.model import load_model


@pytest.fixture
def batch(tiny_tokenizer):
    enc = tiny_tokenizer(["The capital of France is Paris.", "Write a short poem"], return_tensors="pt", padding=True)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def test_export_merges_adapter_into_standalone_model(tiny_model_dir, tmp_path, batch, save_perturbed_adapter):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir = tmp_path / "adapter"
    with_adapter = save_perturbed_adapter(tiny_model_dir, adapter_dir)
    with torch.no_grad():
        expected = with_adapter(**batch).logits
        with with_adapter.disable_adapter():
            assert (with_adapter(**batch).logits - expected).abs().max() > 1e-2

    model_args = parse_config({"model_name_or_path": tiny_model_dir, "adapter_name_or_path": str(adapter_dir)}).model
    out = export_model(model_args, str(tmp_path / "merged"))
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()

    merged = AutoModelForCausalLM.from_pretrained(out)
    assert type(merged).__name__ == "LlamaForCausalLM" and merged.config.use_cache is True
    assert merged.generation_config.eos_token_id == merged.generation_config.pad_token_id == 2
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, expected, atol=1e-5, rtol=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and tokenizer.pad_token == "<|im_end|>"


def test_export_of_reward_adapter_is_sequence_classifier(tiny_model_dir, tmp_path, batch, save_perturbed_adapter):
    from transformers import AutoModelForSequenceClassification

    adapter_dir = tmp_path / "rm_adapter"
    with_adapter = save_perturbed_adapter(tiny_model_dir, adapter_dir, head="reward")
    with torch.no_grad():
        expected = with_adapter(**batch).logits

    model_args = parse_config({"model_name_or_path": tiny_model_dir, "adapter_name_or_path": str(adapter_dir)}).model
    out = export_model(model_args, str(tmp_path / "rm"))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    scorer = AutoModelForSequenceClassification.from_pretrained(out)
    assert scorer.config.num_labels == 1 and scorer.config.pad_token_id == 2
    with torch.no_grad():
        torch.testing.assert_close(scorer(**batch).logits, expected, atol=1e-5, rtol=0)


def test_export_refuses_non_empty_dir_unless_forced(tiny_model_dir, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "adapter_config.json").write_text("{}")  # a stale adapter would hijack from_pretrained
    (out / "notes.txt").write_text("keep me")
    model_args = parse_config({"model_name_or_path": tiny_model_dir}).model
    with pytest.raises(ConfigError, match=f"{out}.*not empty.*--force"):
        export_model(model_args, str(out))
    export_model(model_args, str(out), force=True)
    assert not (out / "adapter_config.json").exists()
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / "model.safetensors").is_file()


# The random tiny model answers every greedy prompt with newlines, which would make replies
# indistinguishable; sampling with a fixed seed gives distinct, reproducible replies instead.
SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def _reference_reply(model_dir, messages, generating_args, seed=0):
    """The same decoding done directly with transformers, from the same seed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**inputs, **generating_args.to_generation_kwargs(), pad_token_id=2, eos_token_id=2)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_chat_one_shot_streams_and_returns_reply(tiny_model_dir):
    config = parse_config({"model_name_or_path": tiny_model_dir, "max_new_tokens": 12, **SAMPLING})
    stream = io.StringIO()
    torch.manual_seed(0)
    reply = chat(config.model, config.generating, prompt="What is 12 plus 7?", system="Answer briefly.", stream=stream)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 12 plus 7?"}]
    assert reply.strip() and reply == _reference_reply(tiny_model_dir, messages, config.generating)
    assert stream.getvalue() == reply + "\n"


def test_chat_interactive_keeps_history_and_clears_it(tiny_model_dir, monkeypatch):
    import alignkit.chat as chat_module

    # The random tiny model's replies barely depend on the context, so the conversation each turn
    # sends is checked where it enters generation.
    sent, replies = [], []
    real_stream_reply = chat_module.stream_reply

    def recording_stream_reply(model, tokenizer, messages, generating_args, stream):
        sent.append([dict(m) for m in messages])
        replies.append(real_stream_reply(model, tokenizer, messages, generating_args, stream))
        return replies[-1]

    monkeypatch.setattr(chat_module, "stream_reply", recording_stream_reply)
    config = parse_config({"model_name_or_path": tiny_model_dir, "max_new_tokens": 8, **SAMPLING})
    lines = iter(["Name a colour", "Translate to French", "clear", "", "Translate to French", "exit", "never read"])
    stream = io.StringIO()
    assert chat(config.model, config.generating, system="Be brief.", stream=stream,
                input_fn=lambda _prompt: next(lines)) is None
    assert next(lines) == "never read"  # `exit` stopped the loop

    system = {"role": "system", "content": "Be brief."}
    colour, french = {"role": "user", "content": "Name a colour"}, {"role": "user", "content": "Translate to French"}
    assert sent == [
        [system, colour],
        [system, colour, {"role": "assistant", "content": replies[0]}, french],
        [system, french],  # after `clear`; the empty line was skipped
    ]
    assert all(r.strip() for r in replies)
    text = stream.getvalue()
    assert f"Assistant: {replies[0]}\nAssistant: {replies[1]}\nHistory cleared.\nAssistant: {replies[2]}\n" in text


def test_chat_raises_generation_errors_instead_of_hanging(tiny_model_dir, monkeypatch):
    from transformers import LlamaForCausalLM

    def broken_generate(self, **kwargs):
        raise RuntimeError("generation failed")

    monkeypatch.setattr(LlamaForCausalLM, "generate", broken_generate)
    config = parse_config({"model_name_or_path": tiny_model_dir, "max_new_tokens": 4})
    with pytest.raises(RuntimeError, match="generation failed"):
        chat(config.model, config.generating, prompt="hi", stream=io.StringIO())


def test_env_info_names_versions_and_device():
    import importlib.metadata
    import importlib.util
    import platform

    info = env_info()
    libraries = ["transformers", "peft", "datasets", "accelerate"]
    if importlib.util.find_spec("trl") is not None:  # optional: left out when not installed
        libraries.append("trl")
    assert list(info) == ["alignkit", "python", "platform", "torch", *libraries, "device", "device_count",
                          "bf16_supported", "num_threads"]
    for name in ["alignkit", *libraries]:
        assert info[name] == importlib.metadata.version(name), name
    assert info["torch"] == torch.__version__ and info["python"] == platform.python_version()
    assert info["num_threads"] == torch.get_num_threads()
    if torch.cuda.is_available():
        assert info["device"] == f"cuda: {torch.cuda.get_device_name(0)}"
        assert info["device_count"] == torch.cuda.device_count()
    else:
        assert (info["device"], info["device_count"]) == ("cpu", 1)
    # One aligned `- key: value` line per entry, keys padded to the longest ("bf16_supported", 14 letters).
    assert format_env(info).splitlines() == [f"- {key:<14}: {value}" for key, value in info.items()]


def test_export_and_chat_of_an_adapter_trained_over_sft_need_only_that_adapter(tiny_model_dir, tmp_path, batch,
                                                                              save_perturbed_adapter):
    """A DPO/GRPO/PPO-style adapter trained over the merged SFT adapter records it (`base_adapters.json`):
    `--adapter dpo` exports and chats as the model it was trained as, the same as the explicit `sft,dpo`."""
    from transformers import AutoModelForCausalLM

    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    save_perturbed_adapter(tiny_model_dir, sft, seed=3)
    trained = save_perturbed_adapter(tiny_model_dir, dpo, seed=4, over=sft)
    with torch.no_grad():
        expected = trained(**batch).logits
    replies = []
    for given in (str(dpo), f"{sft},{dpo}"):
        config = parse_config({"model_name_or_path": tiny_model_dir, "adapter_name_or_path": given,
                               "max_new_tokens": 8, **SAMPLING})
        out = export_model(config.model, str(tmp_path / f"export{len(replies)}"))
        with torch.no_grad():
            torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out)(**batch).logits, expected,
                                       atol=1e-5, rtol=0)
        torch.manual_seed(0)
        replies.append(chat(config.model, config.generating, prompt="Name a colour.", stream=io.StringIO()))
    assert replies[0].strip() and replies[0] == replies[1]
    (dpo / "base_adapters.json").unlink()  # what loading `dpo` alone gave before the record: the bare base under it
    config = parse_config({"model_name_or_path": tiny_model_dir, "adapter_name_or_path": str(dpo)})
    bare = load_model(config.model, config.finetuning, is_trainable=False)
    with torch.no_grad():
        assert (bare(**batch).logits - expected).abs().max() > 1e-2


def test_chat_from_a_pipe_echoes_each_line_and_ends_without_a_dangling_prompt(tiny_model_dir, monkeypatch):
    """Issue 32: `alignkit chat < questions.txt` printed `User: ` once more after the last reply. From a pipe the
    lines are read without a prompt and echoed, so the output is the conversation and ends with its last reply."""
    monkeypatch.setattr("sys.stdin", io.StringIO("Name a colour\n\nTranslate to French\n"))
    config = parse_config({"model_name_or_path": tiny_model_dir, "max_new_tokens": 4, **SAMPLING})
    stream = io.StringIO()
    assert chat(config.model, config.generating, stream=stream) is None
    text = stream.getvalue()
    assert "\nUser: Name a colour\nAssistant: " in text and "\nUser: Translate to French\nAssistant: " in text
    assert text.count("User: ") == 2 and text.endswith("\n") and not text.rstrip().endswith("User:")
