"""Vision-language models on tiny random LLaVA / Idefics3 built in the test (`model.tiny.save_tiny_vlm`): image
rows in LLaMA-Factory's and TRL's shapes, bad images refused before the model loads, SFT with the vision tower frozen
(and not), image positions unlabelled, the adapter reloaded with plain peft generating from an image, and DPO
with images (first-step loss ln 2 with the reference equal to the policy)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from alignkit.constants import IGNORE_INDEX
from alignkit.errors import DataError
from alignkit.train import run_train
from tests.helpers import tiny_config

USER_Q = [("Who are they?", "Two players."), ("What colour is it?", "It is green."),
          ("How many are there?", "Three."), ("What is in the picture?", "The sea.")]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from alignkit.model.tiny import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="module", params=["llava", "idefics3"])
def any_vlm(request, tmp_path_factory):
    """(folder, architecture) of each architecture docs/multimodal.md says has run."""
    from alignkit.model.tiny import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp(f"tiny_{request.param}"), architecture=request.param), request.param


def write_png(path: Path, seed: int, size=(40, 30)) -> None:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    Image.fromarray(pixels).save(path)


def mllm_demo(folder: Path, rows: int = 4) -> Path:
    """LLaMA-Factory's `mllm_demo` layout: sharegpt `messages` with `<image>`, an `images` column of paths
    relative to dataset_dir, registered in dataset_info.json."""
    (folder / "mllm_demo_data").mkdir(parents=True, exist_ok=True)
    data = []
    for i in range(rows):
        write_png(folder / "mllm_demo_data" / f"{i}.png", seed=i)
        question, answer = USER_Q[i % len(USER_Q)]
        data.append({"messages": [{"role": "user", "content": f"<image>{question}"},
                                  {"role": "assistant", "content": answer}],
                     "images": [f"mllm_demo_data/{i}.png"]})
    (folder / "mllm_demo.json").write_text(json.dumps(data))
    (folder / "dataset_info.json").write_text(json.dumps({"mllm_demo": {
        "file_name": "mllm_demo.json", "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    return folder


def vlm_config(vlm_dir, tmp_path, **keys):
    values = dict(stage="sft", do_train=True, dataset="mllm_demo", dataset_dir=str(tmp_path), finetuning_type="lora",
                  lora_rank=4, cutoff_len=64, per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2, save_strategy="no",
                  report_to="none", logging_steps=1)
    values.update(keys)
    return tiny_config(vlm_dir, tmp_path / "out", **values)


def load_data(vlm_dir, tmp_path, kind="supervised", **keys):
    from alignkit.data import get_dataset
    from alignkit.model.loader import load_image_processing, load_tokenizer

    config = vlm_config(vlm_dir, tmp_path, **keys)
    tokenizer = load_tokenizer(config.model)
    images = load_image_processing(config.model, tokenizer)
    return get_dataset(config, tokenizer, kind, images=images)["train_dataset"], images


# ---------------------------------------------------------------------------------------------- data
def test_mllm_demo_rows_get_image_tokens_unlabelled(vlm_dir, tmp_path):
    dataset, images = load_data(vlm_dir, mllm_demo(tmp_path))
    assert len(dataset) == 4
    row = dataset[0]
    # 28x28 image, 14-pixel patches: 4 image tokens, where the <image> placeholder stood
    assert row["input_ids"].count(images.image_token_id) == 4
    assert row["images"] == [str(tmp_path / "mllm_demo_data" / "0.png")]
    assert all(label == IGNORE_INDEX for token, label in zip(row["input_ids"], row["labels"])
               if token == images.image_token_id)
    # train_on_prompt labels the prompt, never the image tokens
    prompt_trained, _ = load_data(vlm_dir, tmp_path, train_on_prompt=True, overwrite_cache=True)
    row = prompt_trained[0]
    image_labels = [label for token, label in zip(row["input_ids"], row["labels"]) if token == images.image_token_id]
    assert image_labels == [IGNORE_INDEX] * 4 and row["labels"][0] != IGNORE_INDEX


def test_trl_image_content_parts(vlm_dir, tmp_path):
    write_png(tmp_path / "cat.png", seed=7)
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}],
             "images": ["cat.png"]}]
    (tmp_path / "trl.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    dataset, images = load_data(vlm_dir, tmp_path, dataset="trl.jsonl")
    assert dataset[0]["input_ids"].count(images.image_token_id) == 4
    assert dataset[0]["images"] == [str(tmp_path / "cat.png")]


@pytest.mark.parametrize("problem", ["missing", "corrupt", "count"])
def test_bad_images_are_named_before_the_model_loads(vlm_dir, tmp_path, problem, monkeypatch):
    from alignkit.model import loader

    mllm_demo(tmp_path, rows=3)
    data = json.loads((tmp_path / "mllm_demo.json").read_text())
    if problem == "missing":
        data[1]["images"] = ["mllm_demo_data/nowhere.png"]
        expected = r"mllm_demo.json, row 2: field `images\[0\]`: image file .*nowhere.png does not exist"
    elif problem == "corrupt":
        (tmp_path / "mllm_demo_data" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
        expected = r"mllm_demo.json, row 2: field `images\[0\]`: image file .*1.png cannot be read as an image"
    else:
        data[1]["images"] = data[1]["images"] * 2
        expected = r"mllm_demo.json, row 2: field `images`: 2 image\(s\) but 1 <image> placeholder\(s\)"
    (tmp_path / "mllm_demo.json").write_text(json.dumps(data))
    monkeypatch.setattr(loader, "_load_base", lambda *a, **k: pytest.fail("the model loaded before the data check"))
    with pytest.raises(DataError, match=expected):
        run_train(vlm_config(vlm_dir, tmp_path))


def test_images_refused_for_a_text_only_model(tiny_model_dir, tmp_path):
    mllm_demo(tmp_path, rows=1)
    config = tiny_config(tiny_model_dir, tmp_path / "out", stage="sft", dataset="mllm_demo", dataset_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"maps `images`.*The model is text-only"):
        run_train(config)


# ---------------------------------------------------------------------------------------------- sft
class Snapshot(TrainerCallback):
    """Parameters at train begin and end."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.after = {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(snapshot, part):
    names = [n for n in snapshot.before if part in n]
    assert names, part
    return {n for n in names if not torch.equal(snapshot.before[n], snapshot.after[n])}


def record_batches(monkeypatch, trainer_class, into: list):
    """Append to `into` every batch `trainer_class.compute_loss` is given."""
    original = trainer_class.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        into.append({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return original(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(trainer_class, "compute_loss", compute_loss)


def test_sft_lora_trains_the_language_model_only_and_reloads_with_peft(any_vlm, tmp_path, monkeypatch, caplog):
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from alignkit.callbacks import read_log
    from alignkit.model.multimodal import VISION_PARTS

    vlm_dir, architecture = any_vlm
    vision, projector, language = (part.split(".")[-1] for part in VISION_PARTS[architecture])
    from alignkit.stages.sft import SFTTrainer

    batches: list = []
    record_batches(monkeypatch, SFTTrainer, batches)
    snapshot = Snapshot()
    config = vlm_config(vlm_dir, mllm_demo(tmp_path))
    with caplog.at_level("INFO", logger="alignkit.data.multimodal"):
        run_train(config, callbacks=[snapshot])
    assert "packing and padding_free off" not in caplog.text and "padding_free off" in caplog.text
    losses = [r["loss"] for r in read_log(config.training.output_dir) if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    processor = AutoProcessor.from_pretrained(vlm_dir)
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    special = set(processor.tokenizer.all_special_ids) - {processor.tokenizer.eos_token_id}
    for batch in batches:
        assert "pixel_values" in batch
        assert (batch["input_ids"] == image_token).sum() == 2 * 4  # 2 rows, 4 tokens per image
        image_positions = torch.isin(batch["input_ids"], torch.tensor(sorted(special)))
        assert image_positions.any() and (batch["labels"][image_positions] == IGNORE_INDEX).all()
    assert not changed(snapshot, vision) and not changed(snapshot, projector)
    assert changed(snapshot, language) and all("lora_" in n for n in changed(snapshot, language))

    out = Path(config.training.output_dir)
    base = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    model = PeftModel.from_pretrained(base, out).eval()
    processor = AutoProcessor.from_pretrained(out)
    inputs = processor(text=["<|im_start|>user\n<image>Who are they?<|im_end|>\n<|im_start|>assistant\n"],
                       images=[[Image.open(tmp_path / "mllm_demo_data" / "0.png")]], return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > inputs["input_ids"].shape[1]


def test_sft_full_with_the_vision_tower_unfrozen(vlm_dir, tmp_path):
    snapshot = Snapshot()
    config = vlm_config(vlm_dir, mllm_demo(tmp_path), finetuning_type="full", freeze_vision_tower=False,
                        learning_rate=1e-3)
    run_train(config, callbacks=[snapshot])
    assert changed(snapshot, "vision_tower") and changed(snapshot, "language_model")
    assert not changed(snapshot, "multi_modal_projector")  # freeze_multi_modal_projector: true by default


def test_image_parts_refused_for_a_text_only_model(tiny_model_dir, tmp_path):
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
                          {"role": "assistant", "content": "A cat."}]}]
    (tmp_path / "trl.jsonl").write_text(json.dumps(rows[0]))
    config = tiny_config(tiny_model_dir, tmp_path / "out", stage="sft", dataset=str(tmp_path / "trl.jsonl"))
    with pytest.raises(DataError, match=r"trl.jsonl, line 1 has an image content part.*The model is text-only"):
        run_train(config)


# ---------------------------------------------------------------------------------------------- dpo
def mllm_pairs(folder: Path, rows: int = 4) -> Path:
    """LLaMA-Factory's multimodal preference rows: sharegpt prompt with `<image>`, chosen/rejected replies."""
    mllm_demo(folder, rows)
    data = []
    for i in range(rows):
        question, answer = USER_Q[i % len(USER_Q)]
        data.append({"conversations": [{"from": "human", "value": f"<image>{question}"}],
                     "chosen": {"from": "gpt", "value": answer}, "rejected": {"from": "gpt", "value": "I do not know."},
                     "images": [f"mllm_demo_data/{i}.png"]})
    (folder / "mllm_pairs.json").write_text(json.dumps(data))
    registry = json.loads((folder / "dataset_info.json").read_text())
    registry["mllm_pairs"] = {"file_name": "mllm_pairs.json", "formatting": "sharegpt", "ranking": True,
                              "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                                          "images": "images"}}
    (folder / "dataset_info.json").write_text(json.dumps(registry))
    return folder


def test_dpo_with_images_starts_at_ln2_and_trains(vlm_dir, tmp_path, monkeypatch):
    from alignkit.callbacks import read_log
    from alignkit.stages.dpo import DPOTrainer

    batches: list = []
    record_batches(monkeypatch, DPOTrainer, batches)
    config = vlm_config(vlm_dir, mllm_pairs(tmp_path), stage="dpo", dataset="mllm_pairs", pref_beta=0.1)
    run_train(config)
    losses = [r["loss"] for r in read_log(config.training.output_dir) if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # the reference is the policy at step 0
    first = batches[0]
    assert first["input_ids"].shape[0] == 4 and first["pixel_values"].shape == (4, 3, 28, 28)
    # row i (chosen) and row i + 2 (rejected) of a pair carry the same image
    assert torch.equal(first["pixel_values"][:2], first["pixel_values"][2:])


def test_stages_without_image_support_refuse_a_vision_language_model(vlm_dir, tmp_path, monkeypatch):
    from alignkit.errors import ConfigError
    from alignkit.model import loader

    pair = {"prompt": "Who are they?", "chosen": "Two players.", "rejected": "I do not know."}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(pair))
    monkeypatch.setattr(loader, "_load_base", lambda *a, **k: pytest.fail("the weights loaded before the check"))
    config = tiny_config(vlm_dir, tmp_path / "out", stage="rm", do_train=True, dataset=str(tmp_path / "pairs.jsonl"))
    with pytest.raises(ConfigError, match=r"is a vision-language model \(llava\); stages sft, dpo, kto, grpo and rloo "
                                          r"train those"):
        run_train(config)


def test_smolvlm_is_refused_with_why_before_the_weights_load(tmp_path, monkeypatch):
    """transformers' SmolVLM (model_type smolvlm) builds and runs here, but its processor does not (torchvision and
    num2words), so a SmolVLM folder is refused at its config, naming why and the SmolVLM checkpoints that do run."""
    from transformers import LlamaConfig, SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMVisionConfig

    from alignkit.errors import ConfigError
    from alignkit.model import loader
    from alignkit.model.tiny import build_tiny_tokenizer

    folder = tmp_path / "tiny_smolvlm"
    build_tiny_tokenizer().save_pretrained(folder)
    config = SmolVLMConfig(vision_config=SmolVLMVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                             num_attention_heads=2, image_size=56, patch_size=14),
                           text_config=LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4), scale_factor=2)
    SmolVLMForConditionalGeneration(config).save_pretrained(folder)  # the model is fine; no processor can be saved
    monkeypatch.setattr(loader, "_load_base", lambda *a, **k: pytest.fail("the weights loaded before the check"))
    config = vlm_config(folder, mllm_demo(tmp_path))
    with pytest.raises(ConfigError, match=r"type 'smolvlm'.*SmolVLMProcessor.*torchvision.*num2words.*model_type "
                                          r"idefics3 and run as Idefics3.*supported: idefics3, llava"):
        run_train(config)


def test_alpaca_rows_with_image_placeholders(vlm_dir, tmp_path):
    write_png(tmp_path / "a.png", seed=3)
    write_png(tmp_path / "b.png", seed=4)
    rows = [{"instruction": "<image>Compare with <image>.", "input": "Briefly.", "output": "Both are noise.",
             "images": ["a.png", "b.png"]}]
    (tmp_path / "alpaca.json").write_text(json.dumps(rows))
    dataset, images = load_data(vlm_dir, tmp_path, dataset="alpaca.json")
    assert dataset[0]["input_ids"].count(images.image_token_id) == 8
    assert dataset[0]["images"] == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]


# ---------------------------------------------------------------------------------------------- chat
def test_chat_with_an_image_passes_its_pixels(vlm_dir, tmp_path, monkeypatch):
    import io

    from alignkit import chat as chat_module
    from alignkit.config import GeneratingArguments, ModelArguments
    from alignkit.errors import ConfigError

    write_png(tmp_path / "cat.png", seed=5)
    from tests.helpers import record_chat_generations

    seen = record_chat_generations(monkeypatch)
    model_args = ModelArguments(model_name_or_path=str(vlm_dir))
    reply = chat_module.chat(model_args, GeneratingArguments(max_new_tokens=3), prompt="What is it?",
                             images=[str(tmp_path / "cat.png")], stream=io.StringIO())
    assert isinstance(reply, str)
    input_ids, pixels = seen[0]
    assert pixels["pixel_values"].shape == (1, 3, 28, 28)
    assert (input_ids == chat_module.chat_images(model_args, [str(tmp_path / "cat.png")]).image_token_id).sum() == 4
    with pytest.raises(ConfigError, match=r"--image: image file .*nowhere.png does not exist"):
        chat_module.chat(model_args, GeneratingArguments(), prompt="Hi", images=[str(tmp_path / "nowhere.png")])
    with pytest.raises(ConfigError, match=r"2 image\(s\) given but the message holds 1 <image>"):
        chat_module.chat(model_args, GeneratingArguments(), prompt="<image> and?",
                         images=[str(tmp_path / "cat.png")] * 2, stream=io.StringIO())


def test_chat_image_refused_for_a_text_only_model(tiny_model_dir, tmp_path):
    from alignkit.chat import chat_images
    from alignkit.config import ModelArguments
    from alignkit.errors import ConfigError

    write_png(tmp_path / "cat.png", seed=5)
    with pytest.raises(ConfigError, match="--image needs a vision-language model; .* is text-only"):
        chat_images(ModelArguments(model_name_or_path=str(tiny_model_dir)), [str(tmp_path / "cat.png")])


# ---------------------------------------------------------------------------------------------- kto
def test_kto_with_images_starts_at_one_half_and_trains(vlm_dir, tmp_path, monkeypatch):
    from alignkit.callbacks import read_log
    from alignkit.stages.kto import KTOTrainer

    mllm_demo(tmp_path)
    data = json.loads((tmp_path / "mllm_demo.json").read_text())
    for i, row in enumerate(data):
        row["kto_tag"] = i % 2 == 0
    (tmp_path / "mllm_kto.json").write_text(json.dumps(data))
    registry = json.loads((tmp_path / "dataset_info.json").read_text())
    registry["mllm_kto"] = dict(registry["mllm_demo"], file_name="mllm_kto.json",
                                columns=dict(registry["mllm_demo"]["columns"], kto_tag="kto_tag"))
    (tmp_path / "dataset_info.json").write_text(json.dumps(registry))
    batches: list = []
    record_batches(monkeypatch, KTOTrainer, batches)
    config = vlm_config(vlm_dir, tmp_path, stage="kto", dataset="mllm_kto")
    run_train(config)
    losses = [r["loss"] for r in read_log(config.training.output_dir) if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # reference = policy at step 0: every reward and z0 are 0, each row's loss 1 - sigmoid(0)
    assert losses[0] == pytest.approx(0.5, abs=1e-6)
    first = batches[0]
    assert first["pixel_values"].shape == (2, 3, 28, 28)
    image_token = json.loads((Path(vlm_dir) / "config.json").read_text())["image_token_index"]
    # a mismatched (KL) row keeps its own prompt, so its own image tokens, matching the row's pixels
    assert ((first["kl_input_ids"] == image_token).sum(-1) == 4).all()


def test_skip_invalid_rows_skips_a_row_with_a_missing_image(vlm_dir, tmp_path, caplog):
    mllm_demo(tmp_path, rows=3)
    data = json.loads((tmp_path / "mllm_demo.json").read_text())
    data[1]["images"] = ["mllm_demo_data/nowhere.png"]
    (tmp_path / "mllm_demo.json").write_text(json.dumps(data))
    dataset, _ = load_data(vlm_dir, tmp_path, skip_invalid_rows=True)
    assert len(dataset) == 2 and "nowhere.png does not exist" in caplog.text


def test_freeze_keys_choose_the_lora_targets(vlm_dir):
    from transformers import AutoModelForImageTextToText

    from alignkit.config import FinetuningArguments
    from alignkit.errors import ConfigError
    from alignkit.model.loader import add_lora

    model = add_lora(AutoModelForImageTextToText.from_pretrained(vlm_dir),
                     FinetuningArguments(lora_target="all", freeze_multi_modal_projector=False))
    adapted = {name.split(".lora_A")[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    assert any("multi_modal_projector" in n for n in adapted) and any("language_model" in n for n in adapted)
    assert not any("vision_tower" in n or "lm_head" in n for n in adapted)
    everything_frozen = FinetuningArguments(freeze_language_model=True)
    with pytest.raises(ConfigError, match="are all true: nothing would train"):
        add_lora(AutoModelForImageTextToText.from_pretrained(vlm_dir), everything_frozen)


# ---------------------------------------------------------------------------------------------- grpo, rloo
# Records what TRL 1.16's GRPOTrainer would hand a reward function for an image batch: the `images` keyword (each
# row's images) and the prompts in the structured shape with the images in their parts.
IMAGE_REWARD_SOURCE = '''
import json, os

def image_reward(prompts, completions, completion_ids, images, **kwargs):
    with open(os.environ["IMAGE_REWARD_LOG"], "a") as log:
        for prompt, row_images in zip(prompts, images):
            log.write(json.dumps({"sizes": [list(image.size) for image in row_images],
                                  "modes": [image.mode for image in row_images],
                                  "parts": [[part["type"] if part["type"] == "text" else type(part["image"]).__name__
                                             for part in message["content"]] for message in prompt]}) + "\\n")
    return [float(sum(ids) % 5) for ids in completion_ids]
'''


def grpo_config(vlm_dir, folder, stage="grpo", **keys):
    (folder / "image_reward.py").write_text(IMAGE_REWARD_SOURCE)
    values = dict(stage=stage, reward_funcs=[f"{folder / 'image_reward.py'}:image_reward"],
                  per_device_train_batch_size=4, num_generations=2, max_completion_length=4, learning_rate=5e-2,
                  lr_scheduler_type="constant", seed=0, use_cpu=True, disable_tqdm=True)
    values.update(keys)
    return vlm_config(vlm_dir, folder, **values)


@pytest.mark.parametrize("stage", ["grpo", "rloo"])
def test_online_stages_with_images(any_vlm, stage, tmp_path, monkeypatch):
    """2 steps with images on each architecture: finite losses, the vision tower bit-identical, each rollout and
    log-prob pass given the rows' own pixels, no image token generated, reward functions given the images."""
    from alignkit.callbacks import read_log
    from alignkit.data.multimodal import ImageProcessing
    from alignkit.model.multimodal import VISION_PARTS
    from alignkit.rl import rollout
    from alignkit.stages import grpo as grpo_module
    from alignkit.stages import online as online_module

    vlm_dir, architecture = any_vlm
    vision, projector, language = (part.split(".")[-1] for part in VISION_PARTS[architecture])
    monkeypatch.setenv("IMAGE_REWARD_LOG", str(tmp_path / "rewards.jsonl"))
    scored: list = []
    original = rollout.completion_logps

    def recording_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs):
        scored.append((prompt_ids, completion_ids, completion_mask, kwargs.get("image_inputs")))
        return original(model, prompt_ids, prompt_mask, completion_ids, completion_mask, **kwargs)

    monkeypatch.setattr(grpo_module, "completion_logps", recording_logps)
    sampled: list = []
    original_sample = online_module.sample_completions

    def recording_sample(model, tokenizer, prompt_ids, **kwargs):
        sampled.append(kwargs.get("image_inputs"))
        return original_sample(model, tokenizer, prompt_ids, **kwargs)

    monkeypatch.setattr(online_module, "sample_completions", recording_sample)
    snapshot = Snapshot()
    config = grpo_config(vlm_dir, mllm_demo(tmp_path), stage=stage, beta=0.1 if stage == "grpo" else 0.05,
                         log_completions=True)
    run_train(config, callbacks=[snapshot])

    losses = [r["loss"] for r in read_log(config.training.output_dir) if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert not changed(snapshot, vision) and not changed(snapshot, projector)
    assert changed(snapshot, language) and all("lora_" in n for n in changed(snapshot, language))
    processor = ImageProcessing(__import__("transformers").AutoProcessor.from_pretrained(vlm_dir), architecture,
                                589824, 1024)
    image_ids = torch.tensor(processor.image_token_ids)
    assert processor.image_token_id in processor.image_token_ids
    # each rollout's prefill got the rows' pixels (decode passes them to the model: tests/unit/test_generation.py)
    assert len(sampled) == 2 and all(s is not None and (s["image_counts"] == 1).all() for s in sampled)
    assert len(scored) >= 4  # reference (grpo) or old (rloo) log-probs at rollout, then the policy's in each step
    for prompt_ids, completion_ids, completion_mask, image_inputs in scored:
        assert image_inputs is not None and (image_inputs["image_counts"] == 1).all()
        assert ((prompt_ids == processor.image_token_id).sum(1) == 4).all()  # 4 image tokens per prompt
        assert not torch.isin(completion_ids[completion_mask.bool()], image_ids).any()
        # the 2 completions of a prompt carry its image; different prompts different images
        pixels = image_inputs["pixel_values"].flatten(1)
        same_prompt = (prompt_ids[:, None] == prompt_ids[None]).all(-1)
        same_pixels = (pixels[:, None] == pixels[None]).all(-1)
        assert torch.equal(same_prompt, same_pixels)
    records = [json.loads(line) for line in (tmp_path / "rewards.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4  # 2 rounds of 2 prompts x 2 completions
    assert all(r["modes"] == ["RGB"] and r["sizes"] == [[40, 30]] for r in records)  # the files' images, unresized
    # the prompt [{"role": "user", "content": "<image>Who are they?"}] as TRL structures it, the image in its part
    assert all(r["parts"] == [["Image", "text"]] for r in records)
    # completions.jsonl keeps that shape with the image's path in its part
    logged = [json.loads(line)
              for line in (Path(config.training.output_dir) / "completions.jsonl").read_text().splitlines()]
    assert len(logged) == 8
    first_part = logged[0]["prompt"][0]["content"][0]
    assert first_part["type"] == "image" and first_part["image"].startswith(str(tmp_path / "mllm_demo_data"))
    assert (Path(config.training.output_dir) / "preprocessor_config.json").is_file() or \
        (Path(config.training.output_dir) / "processor_config.json").is_file()


def test_online_stages_refuse_what_does_not_take_images_before_the_model_loads(vlm_dir, tmp_path, monkeypatch):
    from alignkit.errors import ConfigError
    from alignkit.model import loader

    tools_file = Path(__file__).parents[1] / "tool_functions.py"
    monkeypatch.setattr(loader, "_load_base", lambda *a, **k: pytest.fail("the weights loaded before the check"))
    config = grpo_config(vlm_dir, mllm_demo(tmp_path), tools=[f"{tools_file}:add"], template="chatml")
    with pytest.raises(ConfigError, match="with a vision-language model does not take tools / environment_factory"):
        run_train(config)


# ---------------------------------------------------------------------------------------------- api
def _image_part(path: Path) -> dict:
    import base64

    data = base64.b64encode(path.read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def test_api_takes_openai_image_parts_and_answers_as_chat_does(vlm_dir, tiny_model_dir, tmp_path):
    """`alignkit api` on the tiny LLaVA: an image_url part (base64 data URL) becomes the image's tokens and pixels, and
    the greedy reply equals `alignkit chat --image`'s; bad image parts are refused in OpenAI's error shape."""
    import io

    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from alignkit import chat as chat_module
    from alignkit.config import GeneratingArguments, ModelArguments
    from alignkit.model.generation import generate_with_decode
    from alignkit.serve.app import create_app
    from alignkit.serve.engine import BatchEngine, ServedModels

    write_png(tmp_path / "cat.png", seed=5)
    model_args = ModelArguments(model_name_or_path=str(vlm_dir))
    expected = chat_module.chat(model_args, GeneratingArguments(max_new_tokens=6, do_sample=False),
                                prompt="What is it?", images=[str(tmp_path / "cat.png")], stream=io.StringIO())
    seen = []

    def recording_decode(model, tokenizer, input_ids, attention_mask, **kwargs):
        seen.append((input_ids, kwargs.get("image_inputs")))
        return generate_with_decode(model, tokenizer, input_ids, attention_mask, **kwargs)

    engine = BatchEngine(ServedModels(model_args, {}, None, "llava"), decode_fn=recording_decode)
    image_token = engine.models.models["llava"].images.image_token_id
    messages = [{"role": "user",
                 "content": [_image_part(tmp_path / "cat.png"), {"type": "text", "text": "What is it?"}]}]
    with TestClient(create_app(engine)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        answer = client.chat.completions.create(model="llava", messages=messages, temperature=0, max_tokens=6, n=2)
        # (the random model's greedy reply is degenerate, so the pixels are checked directly below)
        assert [choice.message.content for choice in answer.choices] == [expected] * 2
        input_ids, image_inputs = seen[0]
        assert ((input_ids == image_token).sum(1) == 4).all()  # 2 rows (n=2), 4 image tokens each
        assert image_inputs["pixel_values"].shape == (2, 1, 3, 28, 28)
        own = engine.models.models["llava"].images.pixel_inputs([str(tmp_path / "cat.png")])["pixel_values"]
        assert torch.equal(image_inputs["pixel_values"][0], own) and torch.equal(image_inputs["pixel_values"][1], own)
        bad = [("http://example.com/cat.png", "give the image inline as a base64 data: URL"),
               ("data:image/png;base64,bm90IGFuIGltYWdl", "does not hold an image PIL can read")]
        for url, message in bad:
            parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="llava", messages=[{"role": "user", "content": parts}],
                                               max_tokens=2)
            assert message in err.value.body["message"]
            assert err.value.body["param"] == "messages[0].content[0].image_url"
        with pytest.raises(openai.BadRequestError, match=r"1 <image> text\(s\) besides their image_url parts"):
            client.chat.completions.create(model="llava", max_tokens=2, messages=[
                {"role": "user", "content": [_image_part(tmp_path / "cat.png"), {"type": "text", "text": "<image>?"}]}])
    text_only = BatchEngine(ServedModels(ModelArguments(model_name_or_path=str(tiny_model_dir)), {}, None, "tiny"))
    with TestClient(create_app(text_only)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="model 'tiny' is text-only; image parts need a vision"):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)


def test_grpo_with_images_resumes_mid_generation_batch(vlm_dir, tmp_path, monkeypatch):
    """`num_iterations: 2` trains step 2 on step 1's buffered batch: resumed from checkpoint-1, that batch (its
    pixel inputs by row among the buffered slices) comes back from the checkpoint, nothing is generated again, and
    step 2's loss equals the uninterrupted run's."""
    import shutil

    from alignkit.callbacks import read_log
    from alignkit.stages import online as online_module

    monkeypatch.setenv("IMAGE_REWARD_LOG", str(tmp_path / "rewards.jsonl"))
    keys = dict(beta=0.1, num_iterations=2, save_strategy="steps", save_steps=1)
    whole = grpo_config(vlm_dir, mllm_demo(tmp_path), **keys)
    run_train(whole)
    losses = {r["current_steps"]: r["loss"] for r in read_log(whole.training.output_dir) if "loss" in r}
    out = tmp_path / "resumed"
    shutil.copytree(Path(whole.training.output_dir) / "checkpoint-1", out / "checkpoint-1")
    sampled = []
    original = online_module.sample_completions
    monkeypatch.setattr(online_module, "sample_completions",
                        lambda *args, **kwargs: sampled.append(1) or original(*args, **kwargs))
    resumed = grpo_config(vlm_dir, tmp_path, output_dir=str(out), resume_from_checkpoint=str(out / "checkpoint-1"),
                          **keys)
    run_train(resumed)
    again = {r["current_steps"]: r["loss"] for r in read_log(out) if "loss" in r}
    assert not sampled
    assert again[2] == pytest.approx(losses[2], abs=1e-6) and losses[2] != losses[1]
