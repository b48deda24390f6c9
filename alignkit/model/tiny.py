"""A tiny random causal LM and tokenizer, built locally in about a second.

Tests and the benchmark's quick mode use it instead of a hub model: 2 layers, hidden 64, a byte-level
BPE tokenizer trained on a few sentences (English and Chinese) with a ChatML chat template and, as in
the bundled SmolLM2 model, pad == eos == `<|im_end|>`, so label masking cannot lean on the pad token.
"""

from __future__ import annotations

import os
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML whose message content may also be a list of parts (`{"type": "image"}` -> `<image>`, `{"type": "text"}`), as
# processors' templates take them (TRL renders such messages through the processor).
VLM_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Write a short poem about the sea. The waves roll in and out again.",
    "What is 12 plus 7? 12 plus 7 is 19. What is 9 times 3? It is 27.",
    "Translate to French: good morning. Bonjour.",
    "Explain why the sky is blue: sunlight scatters off air molecules.",
    "You are a helpful assistant. Answer briefly and correctly.",
    "List three fruits: apple, banana, cherry. Name a colour: green.",
    "Tom has 5 apples and buys 3 more. How many apples does he have? 8",
    "中国的首都是北京。今天天气很好，我们去公园散步吧。",
    "请用一句话介绍你自己。我是一个乐于助人的助手。",
    "system user assistant question answer response prompt chosen rejected",
    "0123456789 + - * / = ( ) . , ! ? : ; ' \" \n",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tiny_tokenizer(vocab_size: int = 512):
    """A `PreTrainedTokenizerFast` with ChatML template; eos = pad = `<|im_end|>` (id 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "right"
    return fast


def build_tiny_model(vocab_size: int, seed: int = 0, hidden_size: int = 64, num_layers: int = 2):
    """A randomly initialised `LlamaForCausalLM` with tied embeddings, like SmolLM2 in miniature."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = 2
    model.generation_config.eos_token_id = 2
    return model


def save_tiny_model(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write a tiny model + tokenizer directory loadable with `from_pretrained`; returns the path."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), seed=seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_tiny_vlm(path: str | os.PathLike, seed: int = 0, architecture: str = "llava") -> Path:
    """Write a tiny random vision-language model with its processor to `path`, loadable with
    `AutoModelForImageTextToText` / `AutoProcessor`; both have 2-layer vision towers and a 2-layer Llama, and give
    4 image tokens per image.

    Args:
        architecture: `llava` (CLIP tower on 28x28 images, `LlavaProcessor`) or `idefics3` (SigLIP-style tower on
            56x56 images, pixel shuffle by 2, `Idefics3Processor` without image splitting).
    """
    import torch
    from transformers import LlamaConfig
    from transformers.utils import logging as hf_logging

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    extra = ["<fake_token_around_image>", "<global-img>"] if architecture == "idefics3" else []
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_start|>", "<image>", *extra]})
    tokenizer.chat_template = VLM_CHATML_TEMPLATE
    text_config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                              max_position_embeddings=1024, bos_token_id=None, eos_token_id=2, pad_token_id=2)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "requires torchvision ... falling back to the PIL backend": expected here
    try:
        if architecture == "llava":
            from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration,
                                      LlavaProcessor)

            image_processor = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
            processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                       vision_feature_select_strategy="default", image_token="<image>",
                                       num_additional_image_tokens=1, chat_template=tokenizer.chat_template)
            config = LlavaConfig(
                vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
                text_config=text_config, image_token_index=image_token_id, vision_feature_layer=-1,
                vision_feature_select_strategy="default", tie_word_embeddings=True)
            model_class = LlavaForConditionalGeneration
        elif architecture == "idefics3":
            from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                                      Idefics3Processor, Idefics3VisionConfig)

            image_processor = Idefics3ImageProcessor(size={"longest_edge": 56}, max_image_size={"longest_edge": 56},
                                                     do_image_splitting=False)
            processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                          chat_template=tokenizer.chat_template)
            config = Idefics3Config(
                vision_config=Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=2, image_size=56, patch_size=14),
                text_config=text_config, image_token_id=image_token_id, scale_factor=2, tie_word_embeddings=True,
                pad_token_id=2)
            model_class = Idefics3ForConditionalGeneration
        else:
            raise ValueError(f"architecture={architecture!r}: expected 'llava' or 'idefics3'.")
    finally:
        hf_logging.set_verbosity(verbosity)
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.pad_token_id = 2
    model.generation_config.eos_token_id = 2
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
