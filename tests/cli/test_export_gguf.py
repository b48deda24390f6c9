"""`alignkit export --format gguf`: the merged model as one GGUF file that transformers loads back to the same logits.

On the tiny Llama model (the bundled SmolLM2's architecture) with a LoRA adapter merged in, and on tiny random
Qwen2/Qwen3 models: f32 within 1e-4 of the merged model's logits (0 here), f16 and q8_0 within the bounds below
(measured on these models: f16 about 3e-4 to 4e-4, q8_0 about 6e-3 to 9e-3 on logits of size ~1). The file's
metadata is read with gguf's own reader; the Ollama Modelfile's template renders what the chat template renders.
"""

from __future__ import annotations

import pytest
import torch

from alignkit.config.parse import parse_config
from alignkit.errors import ConfigError
from alignkit.export import export_model

gguf = pytest.importorskip("gguf")

PROMPT = "The capital of France is Paris. 中国的首都是北京。"
BOUNDS = {"f32": 1e-4, "f16": 2e-3, "q8_0": 3e-2}


def _logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits


def _field(reader, key):
    return reader.fields[key].contents()


def test_gguf_of_an_adapter_merged_into_the_tiny_model(tiny_model_dir, tmp_path, save_perturbed_adapter):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = tmp_path / "sft"
    save_perturbed_adapter(tiny_model_dir, adapter)
    model_args = parse_config({"model_name_or_path": tiny_model_dir, "adapter_name_or_path": str(adapter)}).model
    out = export_model(model_args, str(tmp_path / "merged"), gguf_type="f32", ollama=True)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    expected = _logits(merged, tokenizer)

    path = out / "merged-f32.gguf"
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32)
    assert (_logits(loaded, tokenizer) - expected).abs().max() <= BOUNDS["f32"]
    gguf_tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=path.name)
    assert gguf_tokenizer(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]

    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.chat_template") == tokenizer.chat_template
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == merged.config.vocab_size
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./merged-f32.gguf\n") and 'PARAMETER stop "<|im_end|>"' in modelfile
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "And you?"}]
    assert render_go_template(modelfile.split('TEMPLATE """')[1].split('"""')[0], conversation) == \
        tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert len(reader.tensors) == len([k for k in merged.state_dict() if k != "lm_head.weight"
                                       or not merged.config.tie_word_embeddings])


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_each_architecture_and_type_round_trips_through_transformers(model_type, tiny_model_dir, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from alignkit.gguf_export import write_gguf

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    if model_type == "llama":
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    else:
        # transformers reads a Qwen3 GGUF with Qwen3's head_dim of 128 (it maps no key_length for qwen3).
        config = AutoConfig.for_model(model_type, vocab_size=tokenizer.vocab_size + len(tokenizer.get_added_vocab()),
                                      hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      head_dim=128 if model_type == "qwen3" else 16, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path / model_type
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    expected = _logits(model, tokenizer)
    for gguf_type, bound in BOUNDS.items():
        path = write_gguf(model, folder, folder / f"model-{gguf_type}.gguf", gguf_type)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32)
        difference = float((_logits(loaded, tokenizer) - expected).abs().max())
        assert difference <= bound, (model_type, gguf_type, difference)
        assert gguf.GGUFReader(path).fields["general.file_type"].contents() == \
            {"f32": 0, "f16": 1, "q8_0": 7}[gguf_type]


def render_go_template(template: str, messages: list[dict[str, str]]) -> str:
    """Render the Go templates `ollama_template` writes, which have exactly this shape (Ollama itself is not here):
    LEAD[{{ if ne (index .Messages 0).Role "system" }}DEFAULT{{ end }}]{{ range .Messages }}BODY{{ end }}TAIL."""
    import re

    match = re.fullmatch(r'(.*?)(?:\{\{ if ne \(index \.Messages 0\)\.Role "system" \}\}(.*?)\{\{ end \}\})?'
                         r'\{\{ range \.Messages \}\}(.*?)\{\{ end \}\}(.*)', template, re.S)
    assert match, template
    lead, default, body, tail = match.groups()
    text = lead + (default if default and messages[0]["role"] != "system" else "")
    for message in messages:
        text += body.replace("{{ .Role }}", message["role"]).replace("{{ .Content }}", message["content"])
    return text + tail


@pytest.mark.parametrize("template", [None, "chatml", "smollm2", "qwen"])
@pytest.mark.parametrize("system", [None, "Be brief."])
def test_ollama_template_renders_what_the_chat_template_renders(tiny_tokenizer, template, system):
    from alignkit.data.template import ChatFormatter
    from alignkit.gguf_export import ollama_template

    formatter = ChatFormatter(tiny_tokenizer, template)
    conversation = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"}]
    assert render_go_template(ollama_template(formatter), conversation) == formatter.prompt_text(conversation)


def test_ollama_refuses_a_template_it_cannot_express(tiny_tokenizer, tiny_model_dir, tmp_path):
    from alignkit.data.template import ChatFormatter
    from alignkit.gguf_export import ollama_template

    with pytest.raises(ConfigError, match="cannot be written as an Ollama template"):
        ollama_template(ChatFormatter(tiny_tokenizer, "plain"))
    with pytest.raises(ConfigError, match="add --format gguf"):
        export_model(parse_config({"model_name_or_path": tiny_model_dir}).model, str(tmp_path / "o"), ollama=True)


def test_gguf_export_refuses_what_it_cannot_write_before_loading(tmp_path, reward_adapter_dir, tiny_model_dir):
    from transformers import GPT2Config, GPT2LMHeadModel

    from alignkit.gguf_export import permute_qk

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="supports the architectures llama, qwen2, qwen3"):
        export_model(parse_config({"model_name_or_path": str(tmp_path / "gpt2")}).model, str(tmp_path / "o1"),
                     gguf_type="f16")
    with pytest.raises(ConfigError, match="reward model"):
        export_model(parse_config({"model_name_or_path": tiny_model_dir,
                                   "adapter_name_or_path": str(reward_adapter_dir)}).model, str(tmp_path / "o2"),
                     gguf_type="f16")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    # One head of 4 rotary rows [a, b, c, d] (halves a b | c d) interleaved as llama.cpp wants: [a, c, b, d].
    rows = torch.arange(4.0).reshape(4, 1).numpy()
    assert permute_qk(rows, 1).ravel().tolist() == [0.0, 2.0, 1.0, 3.0]
