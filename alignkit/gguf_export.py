"""A merged model as one GGUF file (llama.cpp, Ollama, LM Studio), written with the `gguf` library.

What llama.cpp's `convert_hf_to_gguf.py` does for these architectures, with the pieces the `gguf` package ships
(that script itself is not part of the package): `GGUFWriter` for the file, `TensorNameMap` for the tensor names,
`SpecialVocab` for the merges, special token ids and chat template, `quants.quantize` for Q8_0. What is left here
is the per-architecture knowledge the script holds:

- the architectures: `llama` (SmolLM2, Llama), `qwen2`, `qwen3` (`SUPPORTED`); another is refused by name;
- LLaMA's query and key rows are permuted into llama.cpp's rotary layout (`permute_qk`, the script's
  `LlamaModel.permute`; transformers' GGUF loader undoes it); Qwen keeps the NeoX layout unpermuted;
- the tokenizer is written as a GPT-2 BPE vocabulary (`tokenizer.ggml.model = gpt2`) with its merges, each token
  typed normal or control (special added tokens), and `tokenizer.ggml.pre` naming the pre-tokenizer;
- f16 and q8_0 keep one-dimensional tensors (norms, biases) in f32, as the script does; q8_0 applies to matrices
  whose rows are whole blocks of 32, the others stay f16.

transformers reads the file back (`from_pretrained(dir, gguf_file=...)`), which the tests use to check the logits.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError

logger = logging.getLogger(__name__)

# transformers model_type -> (GGUF architecture, tokenizer.ggml.pre)
SUPPORTED = {"llama": ("llama", "smollm"), "qwen2": ("qwen2", "qwen2"), "qwen3": ("qwen3", "qwen2")}
GGUF_TYPES = ("f32", "f16", "q8_0")


def check_supported(model_type: str) -> None:
    """Raise a ConfigError naming the supported architectures when `model_type` is not one of them."""
    if model_type not in SUPPORTED:
        raise ConfigError(f"GGUF export supports the architectures {', '.join(SUPPORTED)} (SmolLM2/Llama, Qwen2, "
                          f"Qwen3), not {model_type!r}; export without --format gguf and convert with llama.cpp's "
                          "convert_hf_to_gguf.py.")


def permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """LLaMA's q/k projection rows from Hugging Face's rotary layout (halves) to llama.cpp's (interleaved pairs).

    (out, in) rows are grouped per head as [first half | second half] of the rotary dimensions; llama.cpp wants
    them interleaved: row order per head 0, d/2, 1, d/2+1, ... Example for one head of 4 rows [a, b, c, d]:
    [a, c, b, d].
    """
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(model, folder: str | Path, path: str | Path, gguf_type: str = "f16") -> Path:
    """Write `model` (a merged causal LM) and the tokenizer saved in `folder` as one GGUF file at `path`.

    Args:
        model: a `PreTrainedModel` of a `SUPPORTED` architecture, adapters merged.
        folder: where the model's tokenizer (and chat template) were saved (`save_pretrained`).
        path: the file to write.
        gguf_type: `f32`, `f16` or `q8_0` (the tensor types; see the module docstring).

    Raises:
        ConfigError: an unsupported architecture or type.
    """
    import gguf
    from transformers import AutoTokenizer

    config = model.config
    check_supported(config.model_type)
    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type {gguf_type}: choose one of {', '.join(GGUF_TYPES)}.")
    arch_name, pre = SUPPORTED[config.model_type]
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch_name]
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch_name)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    writer.add_name(Path(str(config.name_or_path or "model")).name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    if arch_name == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config.vocab_size)
    if arch_name == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    _add_tokenizer(writer, AutoTokenizer.from_pretrained(folder), folder, pre, config.vocab_size)

    names = gguf.TensorNameMap(arch, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp reads the embedding as the output matrix when there is none
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            if "rotary_emb" in hf_name:
                continue
            raise ConfigError(f"GGUF export: no GGUF name for tensor {hf_name} of {config.model_type}.")
        data = tensor.detach().float().cpu().numpy()
        if arch_name == "llama" and hf_name.endswith("q_proj.weight"):
            data = permute_qk(data, n_head)
        elif arch_name == "llama" and hf_name.endswith("k_proj.weight"):
            data = permute_qk(data, n_kv)
        _add_tensor(writer, gguf, name, data, gguf_type)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    logger.info("Wrote %s (%s, %s).", path, arch_name, gguf_type)
    return path


def _add_tensor(writer, gguf, name: str, data: np.ndarray, gguf_type: str) -> None:
    if data.ndim <= 1 or gguf_type == "f32":
        writer.add_tensor(name, data.astype(np.float32))
    elif gguf_type == "q8_0" and data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        quantized = gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        writer.add_tensor(name, data.astype(np.float16))


def _add_tokenizer(writer, tokenizer, folder: str | Path, pre: str, vocab_size: int) -> None:
    """The GPT-2 BPE vocabulary, its merges, special ids and chat template (llama.cpp's `_set_vocab_gpt2`)."""
    import gguf

    if getattr(tokenizer, "backend_tokenizer", None) is None or \
            json_model_type(tokenizer) != "BPE":
        raise ConfigError("GGUF export writes byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen); this model's "
                          "tokenizer is another kind.")
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    special = set(tokenizer.all_special_ids)
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if index in special or _is_control(tokenizer, token)
                         else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special_vocab = gguf.SpecialVocab(Path(folder), load_merges=True, n_vocab=len(tokens))
    special_vocab.add_to_gguf(writer, quiet=True)


def json_model_type(tokenizer) -> Any:
    return json.loads(tokenizer.backend_tokenizer.to_str())["model"]["type"]


def _is_control(tokenizer, token: str) -> bool:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return any(added.content == token and added.special for added in decoder.values())


_MARK = "\x1fcontent\x1f"  # stands for a message's content while the chat template is probed


def ollama_template(formatter) -> str:
    """The chat template as an Ollama (Go) template, derived by rendering probe conversations through it.

    Templates of the common shape are covered: each message written as `prefix(role) + content + suffix`, the same
    for every role up to the role's name (ChatML and its family: SmolLM2, Qwen), text before the first message
    (a BOS), an optional default system message written when the conversation has none (SmolLM2's, Qwen's), and
    the generation prompt after the last message. The result reads

        LEAD{{ if ne (index .Messages 0).Role "system" }}DEFAULT{{ end }}
        {{ range .Messages }}PREFIX{{ .Content }}SUFFIX{{ end }}GENERATION      (one line)

    with `{{ .Role }}` in PREFIX where the role's name is.

    Raises:
        ConfigError: a template of another shape (per-role layouts beyond the name), which would need a hand-made
            Ollama template.
    """
    render = formatter.render

    def added(history: list[dict[str, str]], role: str) -> str:
        before, full = render(history), render(history + [{"role": role, "content": _MARK}])
        if not full.startswith(before):
            raise _unsupported(formatter, "a message changes how earlier ones are written")
        return full[len(before):]

    system_text = {"role": "system", "content": "S"}
    user_prefix, _, suffix = added([system_text], "user").partition(_MARK)
    assistant_prefix, _, assistant_suffix = added([system_text, {"role": "user", "content": "U"}],
                                                  "assistant").partition(_MARK)
    if "user" not in user_prefix or user_prefix.replace("user", "assistant") != assistant_prefix \
            or assistant_suffix != suffix:
        raise _unsupported(formatter, "user and assistant messages are laid out differently beyond the role's name")
    only_system = render([{"role": "system", "content": _MARK}])
    system_prefix = user_prefix.replace("user", "system")
    head, _, tail = only_system.partition(_MARK)
    if not head.endswith(system_prefix) or tail != suffix:
        raise _unsupported(formatter, "system messages are laid out differently from the others")
    lead = head[:len(head) - len(system_prefix)]
    user_block = user_prefix + _MARK + suffix
    no_system = render([{"role": "user", "content": _MARK}])
    if not (no_system.startswith(lead) and no_system.endswith(user_block)):
        raise _unsupported(formatter, "a conversation without a system message is written in another way")
    default = no_system[len(lead):len(no_system) - len(user_block)]
    question = [{"role": "user", "content": "U"}]
    generation = render(question, add_generation_prompt=True)[len(render(question)):]
    body = user_prefix.replace("user", "{{ .Role }}") + "{{ .Content }}" + suffix
    default_part = f'{{{{ if ne (index .Messages 0).Role "system" }}}}{default}{{{{ end }}}}' if default else ""
    return f"{lead}{default_part}{{{{ range .Messages }}}}{body}{{{{ end }}}}{generation}"


def _unsupported(formatter, why: str) -> ConfigError:
    return ConfigError(f"--ollama: the chat template {formatter.name!r} cannot be written as an Ollama template here "
                       f"({why}); export with --format gguf alone and write the Modelfile's TEMPLATE by hand.")


def ollama_modelfile(formatter, gguf_name: str) -> str:
    """An Ollama Modelfile for the GGUF file `gguf_name` beside it: FROM, the TEMPLATE (`ollama_template`) and a
    `stop` PARAMETER per end-of-turn token of the template (`ChatFormatter.stop_token_ids`)."""
    template = ollama_template(formatter)
    if '"""' in template:
        raise _unsupported(formatter, 'it contains """')
    stops = [formatter.tokenizer.decode([token]) for token in formatter.stop_token_ids()]
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in dict.fromkeys(stops) if stop]
    return "\n".join(lines) + "\n"


__all__ = ["SUPPORTED", "GGUF_TYPES", "check_supported", "permute_qk", "write_gguf", "ollama_template",
           "ollama_modelfile"]
