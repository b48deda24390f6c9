"""Parity with TRL 1.16 on tiny random vision-language models (LLaVA and Idefics3, `model.tiny.save_tiny_vlm`).

The rows are TRL's conversational prompt-completion layout with `{"type": "image"}` content parts and an `images`
column. alignkit reads them through its own data layer (image files, the processor's image tokens spliced in,
labels on the reply only); TRL's `DataCollatorForVisionLanguageModeling` renders them through the processor on the
fly. The first test shows both build the same token ids, label masks and pixel values; then the first-step SFT loss
of both trainers on the same batch agrees within 1e-5 (full fine-tuning, the same weights). DPO: TRL's
`DPOTrainer` and ours build the same token ids and pixel values for image pairs (each reply with the prompt's
images) and give the same first-step loss and metrics, the reference being the same tiny VLM with other weights
(beta 1, so the loss is not ln 2 and a 0.1% change of the loss formula fails the test: checked once). GRPO: TRL's
`GRPOTrainer` and ours on the same image prompts and injected completions, with a KL term and a reward reading the
images, give the same loss and metrics over two steps (checked once to fail when the policy's log-prob pass does not
get the images).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from datasets import Dataset

from alignkit.config.parse import parse_config
from alignkit.constants import IGNORE_INDEX
from alignkit.data import get_dataset
from alignkit.data.collator import SupervisedCollator
from alignkit.data.multimodal import ImageCollator
from alignkit.model.loader import load_image_processing, load_tokenizer
from alignkit.stages.sft import SFTTrainer

pytestmark = pytest.mark.parity
trl = pytest.importorskip("trl")

EXAMPLES = [("Who are they?", "Two players."), ("What colour is it?", "It is green, like grass."),
            ("How many are there?", "Three."), ("What is in the picture?", "The sea at night.")]
TRAINING = {"learning_rate": 1e-3, "lr_scheduler_type": "constant", "weight_decay": 0.0, "max_grad_norm": 1.0,
            "seed": 0, "logging_steps": 1, "gradient_checkpointing": False, "bf16": False, "use_cpu": True,
            "report_to": "none", "save_strategy": "no", "disable_tqdm": True, "per_device_train_batch_size": 4}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from alignkit.model.tiny import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="module", params=["llava", "idefics3"])
def any_vlm_dir(request, tmp_path_factory):
    from alignkit.model.tiny import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp(f"tiny_{request.param}"), architecture=request.param)


def _images(batch):
    """The batch's images one per entry (Idefics3's processor nests them per row, ours per batch)."""
    pixels = batch["pixel_values"]
    return pixels.reshape(-1, *pixels.shape[-3:])


def rows(folder):
    from PIL import Image

    out = []
    for i, (question, answer) in enumerate(EXAMPLES):
        pixels = (np.random.default_rng(i).random((30 + 4 * i, 40, 3)) * 255).astype("uint8")
        Image.fromarray(pixels).save(folder / f"{i}.png")
        out.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                    "completion": [{"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                    "images": [f"{i}.png"]})
    return out


def _ours(vlm_dir, tmp_path, data):
    from transformers import AutoModelForImageTextToText

    (tmp_path / "vlm.json").write_text(json.dumps(data))
    config = parse_config({"stage": "sft", "do_train": True, "finetuning_type": "full", "freeze_vision_tower": False,
                           "freeze_multi_modal_projector": False, "model_name_or_path": str(vlm_dir),
                           "dataset": "vlm.json", "dataset_dir": str(tmp_path), "output_dir": str(tmp_path / "ours"),
                           **TRAINING})
    tokenizer = load_tokenizer(config.model)
    images = load_image_processing(config.model, tokenizer)
    dataset = get_dataset(config, tokenizer, "supervised", images=images)["train_dataset"]
    return SFTTrainer(model=AutoModelForImageTextToText.from_pretrained(vlm_dir), args=config.training,
                      data_collator=ImageCollator(SupervisedCollator(tokenizer), images), train_dataset=dataset,
                      processing_class=tokenizer)


def _theirs(vlm_dir, tmp_path, data):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig
    from trl import SFTTrainer as TRLSFTTrainer

    with_images = [dict(row, images=[Image.open(tmp_path / p).convert("RGB") for p in row["images"]]) for row in data]
    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_length=None, completion_only_loss=True, **TRAINING)
    return TRLSFTTrainer(model=AutoModelForImageTextToText.from_pretrained(vlm_dir), args=args,
                         train_dataset=Dataset.from_list(with_images), processing_class=AutoProcessor.from_pretrained(vlm_dir))


def _batches(ours, theirs):
    mine = ours._prepare_inputs(ours.data_collator([ours.train_dataset[i] for i in range(len(EXAMPLES))]))
    trl_batch = theirs._prepare_inputs(theirs.data_collator([theirs.train_dataset[i] for i in range(len(EXAMPLES))]))
    return mine, trl_batch


def _real(batch, name):
    """Each row's entries of `name` where the attention mask is 1 (both pad right, TRL flushes left)."""
    return [row[mask.bool()].tolist() for row, mask in zip(batch[name], batch["attention_mask"])]


def _first_step_loss(trainer, batch):
    num_items_in_batch = trainer._get_num_items_in_batch([batch], trainer.args.device)
    trainer.model.train()
    return trainer.compute_loss(trainer.model, batch, num_items_in_batch=num_items_in_batch)


def test_same_tokens_labels_and_pixels_as_trl(any_vlm_dir, tmp_path):
    vlm_dir = any_vlm_dir
    data = rows(tmp_path)
    mine, trl_batch = _batches(_ours(vlm_dir, tmp_path, data), _theirs(vlm_dir, tmp_path, data))
    assert _real(mine, "input_ids") == _real(trl_batch, "input_ids")
    assert _real(mine, "labels") == _real(trl_batch, "labels")
    assert torch.equal(_images(mine), _images(trl_batch))
    model_args = parse_config({"model_name_or_path": str(vlm_dir)}).model
    image_token = load_image_processing(model_args, load_tokenizer(model_args)).image_token_id
    assert (mine["labels"][mine["input_ids"] == image_token] == IGNORE_INDEX).all()


def test_first_step_sft_loss_matches_trl(any_vlm_dir, tmp_path):
    vlm_dir = any_vlm_dir
    data = rows(tmp_path)
    ours, theirs = _ours(vlm_dir, tmp_path, data), _theirs(vlm_dir, tmp_path, data)
    mine, trl_batch = _batches(ours, theirs)
    ours_loss, trl_loss = _first_step_loss(ours, mine), _first_step_loss(theirs, trl_batch)
    assert torch.isfinite(ours_loss)
    torch.testing.assert_close(ours_loss, trl_loss, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- dpo
PAIRS = [("Who are they?", "Two players.", "I do not know."), ("What colour is it?", "It is green.", "Tokyo."),
         ("How many are there?", "Three.", "The waves roll in and out again."),
         ("What is in the picture?", "The sea at night.", "apple, banana, cherry")]
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def vlm_reference_dir(tmp_path_factory):
    """The same tiny VLM with other weights, so the reference differs from the policy and the loss is not ln 2."""
    from alignkit.model.tiny import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm_reference"), seed=1)


def pair_rows(folder):
    images = [row["images"] for row in rows(folder)]
    return [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
             "chosen": [{"role": "assistant", "content": [{"type": "text", "text": chosen}]}],
             "rejected": [{"role": "assistant", "content": [{"type": "text", "text": rejected}]}], "images": paths}
            for (prompt, chosen, rejected), paths in zip(PAIRS, images)]


def test_first_step_dpo_loss_with_images_matches_trl(vlm_dir, vlm_reference_dir, tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import DPOConfig
    from trl import DPOTrainer as TRLDPOTrainer

    from alignkit.data.collator import PairwiseCollator
    from alignkit.stages.dpo import DPOTrainer

    data = pair_rows(tmp_path)
    with_images = [dict(row, images=[Image.open(tmp_path / p).convert("RGB") for p in row["images"]]) for row in data]
    args = DPOConfig(output_dir=str(tmp_path / "trl"), loss_type=["sigmoid"], beta=1.0, max_length=None,
                     precompute_ref_log_probs=False, padding_free=False, **TRAINING)
    theirs = TRLDPOTrainer(model=AutoModelForImageTextToText.from_pretrained(vlm_dir),
                           ref_model=AutoModelForImageTextToText.from_pretrained(vlm_reference_dir), args=args,
                           train_dataset=Dataset.from_list(with_images),
                           processing_class=AutoProcessor.from_pretrained(vlm_dir))
    trl_batch = theirs._prepare_inputs(theirs.data_collator([theirs.train_dataset[i] for i in range(len(PAIRS))]))
    theirs.model.train()
    their_loss = theirs.compute_loss(theirs.model, trl_batch).item()
    their_metrics = {k: theirs._metrics["train"][k][-1] for k in DPO_METRICS}

    (tmp_path / "pairs.json").write_text(json.dumps(data))
    config = parse_config({"stage": "dpo", "do_train": True, "finetuning_type": "full", "pref_beta": 1.0,
                           "model_name_or_path": str(vlm_dir), "dataset": "pairs.json", "dataset_dir": str(tmp_path),
                           "output_dir": str(tmp_path / "ours"), **TRAINING})
    tokenizer = load_tokenizer(config.model)
    images = load_image_processing(config.model, tokenizer)
    dataset = get_dataset(config, tokenizer, "preference", images=images)["train_dataset"]
    ours = DPOTrainer(model=AutoModelForImageTextToText.from_pretrained(vlm_dir),
                      ref_model=AutoModelForImageTextToText.from_pretrained(vlm_reference_dir), args=config.training,
                      dpo_args=config.method, train_dataset=dataset, processing_class=tokenizer,
                      data_collator=ImageCollator(PairwiseCollator(tokenizer), images, pairwise=True))
    mine = ours._prepare_inputs(ours.data_collator([dataset[i] for i in range(len(PAIRS))]))
    assert _real(mine, "input_ids") == _real(trl_batch, "input_ids")
    assert torch.equal(_images(mine), _images(trl_batch))
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, mine).item()
    our_metrics = {k: ours._metrics["train"][k][-1] for k in DPO_METRICS}

    assert our_loss == pytest.approx(their_loss, rel=0, abs=1e-5)
    assert their_metrics["rewards/margins"] != pytest.approx(0.0, abs=1e-3)  # a non-trivial comparison
    for key in DPO_METRICS:
        assert our_metrics[key] == pytest.approx(their_metrics[key], rel=1e-5, abs=1e-5), key


# ---------------------------------------------------------------------------------------------- grpo
GRPO_METRICS = ("loss", "reward", "reward_std", "frac_reward_zero_std", "rewards/image_reward/mean",
                "rewards/image_reward/std", "completions/mean_length", "completions/clipped_ratio", "entropy", "kl",
                "clip_ratio/region_mean")
GRPO_KEYS = {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 6, "max_steps": 2,
             "learning_rate": 0.5, "optim": "sgd", "lr_scheduler_type": "constant", "logging_steps": 1,
             "use_cpu": True, "shuffle_dataset": False, "save_strategy": "no", "seed": 0, "beta": 0.04,
             "report_to": "none"}


def image_reward(prompts, completions, completion_ids, images, **kwargs):
    """Depends on each row's image (its mean pixel), on the image parts of its structured prompt and on the tokens."""
    return [float(np.asarray(row[0], dtype=np.float64).mean()) / 255
            + sum(part["type"] == "image" for message in prompt for part in message["content"])
            + len(ids) % 3 / 2 for prompt, row, ids in zip(prompts, images, completion_ids)]


def _grpo_completions(tokenizer, prompt_ids, special):
    """Fixed completions (4 per prompt) of ordinary tokens: stopped at eos or cut at 6 tokens, alternating."""
    generator = torch.Generator().manual_seed(7)
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    table = {}
    for p, ids in enumerate(prompt_ids):
        rows = []
        for j in range(4):
            stopped = (p + j) % 2 == 0
            length = 2 + (p + 2 * j) % 4 if stopped else 6
            body = ordinary[torch.randint(len(ordinary), (length,), generator=generator)].tolist()
            rows.append(body[:-1] + [tokenizer.eos_token_id] if stopped else body)
        table[tuple(ids)] = rows
    return table


def test_grpo_with_images_matches_trl(vlm_dir, tmp_path, monkeypatch):
    """TRL's GRPOTrainer and ours on the same tiny LLaVA (full fine-tuning, SGD), the same 4 image prompts and the
    same injected completions, a KL term (beta 0.04, so the reference pass takes the images too) and a reward that
    reads each row's image and structured prompt: the same prompt token ids (the injected table is keyed by them),
    the same loss and metrics at both steps within 1e-5 (step 2 follows an update)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from alignkit.rewards import RewardFunction, RewardFunctions
    from alignkit.stages.grpo import GRPOTrainer
    from tests.helpers import Injector, inject_completions

    data = [{"prompt": row["prompt"], "images": row["images"]} for row in rows(tmp_path)]
    (tmp_path / "prompts.json").write_text(json.dumps(data))
    config = parse_config({"stage": "grpo", "model_name_or_path": str(vlm_dir), "dataset": "prompts.json",
                           "dataset_dir": str(tmp_path), "reward_funcs": "accuracy", "finetuning_type": "full",
                           "freeze_vision_tower": False, "freeze_multi_modal_projector": False,
                           "output_dir": str(tmp_path / "ours"), "disable_tqdm": True, **GRPO_KEYS})
    tokenizer = load_tokenizer(config.model)
    images = load_image_processing(config.model, tokenizer)
    dataset = get_dataset(config, tokenizer, "prompt", images=images)["train_dataset"]
    special = set(images.image_token_ids) | set(tokenizer.all_special_ids)
    table = _grpo_completions(tokenizer, dataset["input_ids"], special)

    processor = AutoProcessor.from_pretrained(vlm_dir)
    with_images = [dict(row, images=[Image.open(tmp_path / p).convert("RGB") for p in row["images"]]) for row in data]
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), bf16=False, gradient_checkpointing=False, **GRPO_KEYS)
    theirs_trainer = trl.GRPOTrainer(model=str(vlm_dir), reward_funcs=[image_reward], args=args,
                                     train_dataset=Dataset.from_list(with_images), processing_class=processor)
    trl_injector = Injector(table)
    theirs_trainer._generate_single_turn = lambda prompt_ids, *a, **k: (trl_injector(prompt_ids), None)
    theirs_trainer.train()
    theirs = {r["step"]: r for r in theirs_trainer.state.log_history if "loss" in r}

    our_injector = Injector(table)
    stop_ids = [tokenizer.eos_token_id]
    inject_completions(monkeypatch, tokenizer, our_injector, stop_ids)
    rewards = RewardFunctions([RewardFunction("image_reward", "image_reward", image_reward)], [1.0])
    ours_trainer = GRPOTrainer(model=AutoModelForImageTextToText.from_pretrained(vlm_dir), args=config.training,
                               grpo_args=config.method, reward_functions=rewards, stop_token_ids=stop_ids,
                               processing_class=tokenizer, train_dataset=dataset, images=images)
    ours_trainer.train()
    ours = {r["step"]: r for r in ours_trainer.state.log_history if "loss" in r}

    assert trl_injector.calls == our_injector.calls == 2
    assert sorted(theirs) == sorted(ours) == [1, 2]
    largest = 0.0
    for step in theirs:
        for key in GRPO_METRICS:
            assert key in theirs[step] and key in ours[step], (step, key)
            assert ours[step][key] == pytest.approx(theirs[step][key], abs=1e-5), (step, key)
            largest = max(largest, abs(ours[step][key] - theirs[step][key]))
    print(f"max |ours - TRL| over {len(GRPO_METRICS)} metrics x 2 steps: {largest:.3g}")
    assert ours[2]["loss"] != ours[1]["loss"] and ours[1]["kl"] == 0.0 and ours[2]["kl"] > 0
