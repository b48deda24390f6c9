"""The rm stage end to end on the tiny model: training, metrics, outputs, reload, resume, scoring, bad data."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, TrainerCallback

from alignkit.callbacks import read_log
from alignkit.config.parse import parse_config
from alignkit.errors import DataError
from alignkit.rewards.scoring import RewardScorer
from alignkit.score import score_file
from alignkit.train import run_train
from tests.helpers import tiny_config

PAIRS = [
    ("What is the capital of France?", "The capital of France is Paris.", "The capital of France is Tokyo."),
    ("What is 12 plus 7?", "12 plus 7 is 19.", "12 plus 7 is 27."),
    ("Name a colour.", "green", "apple"),
    ("List three fruits.", "apple, banana, cherry", "green, blue, red"),
    ("Translate to French: good morning.", "Bonjour.", "Good morning."),
    ("Why is the sky blue?", "Sunlight scatters off air molecules.", "Because it is."),
    ("What is 9 times 3?", "It is 27.", "It is 19."),
    ("Tom has 5 apples and buys 3 more. How many?", "8", "5"),
]


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _pref_rows(pairs=PAIRS, **extra) -> list[dict]:
    return [{"prompt": p, "chosen": c, "rejected": r, **extra} for p, c, r in pairs]


def _config(tmp_path, model_dir, out="out", **overrides):
    values = {
        "stage": "rm",
        "model_name_or_path": model_dir,
        "dataset": _write_jsonl(tmp_path / "train.jsonl", _pref_rows()),
        "eval_dataset": _write_jsonl(tmp_path / "eval.jsonl", _pref_rows(PAIRS[:4])),
        "output_dir": str(tmp_path / out),
        "do_train": True,
        "do_eval": True,
        "max_steps": 3,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 3,
        "learning_rate": 1e-3,
        "lora_rank": 4,
        "cutoff_len": 64,
        "save_strategy": "no",
        "seed": 0,
    }
    values.update(overrides)
    return tiny_config(**values)


def test_lora_run_logs_metrics_writes_outputs_and_trains_only_adapter_and_head(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, do_predict=True)
    run_train(config)
    out = Path(config.training.output_dir)

    records = [r for r in read_log(out) if "loss" in r]
    assert [r["current_steps"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-5)
        assert r["rewards/accuracies"] in (0.0, 0.5, 1.0)  # 2 pairs a step
        # The step's loss is the mean of -log sigmoid(margin) over its 2 pairs; that function is convex, so
        # the mean is at least its value at the mean margin (Jensen), with equality only for equal margins.
        assert r["loss"] >= -torch.nn.functional.logsigmoid(torch.tensor(r["rewards/margins"])).item() - 1e-6

    # Evaluation over the 4 held-out pairs (a batch of 3 and one of 1) equals what the per-pair scores of
    # generated_predictions.jsonl (the same model, written to 6 decimals) give by hand.
    eval_results = json.loads((out / "eval_results.json").read_text())
    predictions = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 4
    # Beside the two scores (LLaMA-Factory's keys), the text they score, decoded in dataset order.
    for (prompt, chosen_text, rejected_text), p in zip(PAIRS[:4], predictions):
        assert set(p) == {"prompt", "chosen_response", "rejected_response", "chosen", "rejected"}
        assert p["prompt"] == f"user\n{prompt}\nassistant\n"  # ChatML with its special tokens dropped
        assert (p["chosen_response"], p["rejected_response"]) == (chosen_text + "\n", rejected_text + "\n")
    chosen = torch.tensor([p["chosen"] for p in predictions], dtype=torch.float64)
    rejected = torch.tensor([p["rejected"] for p in predictions], dtype=torch.float64)
    expected = {
        "eval_loss": -torch.nn.functional.logsigmoid(chosen - rejected).mean().item(),
        "eval_accuracy": (chosen > rejected).double().mean().item(),
        "eval_rewards/chosen": chosen.mean().item(),
        "eval_rewards/rejected": rejected.mean().item(),
        "eval_rewards/margins": (chosen - rejected).mean().item(),
    }
    for key, value in expected.items():
        assert eval_results[key] == pytest.approx(value, abs=1e-5), key

    adapter = load_file(out / "adapter_model.safetensors")
    assert any("score" in name for name in adapter), "the trained score head must be saved with the adapter"
    lora_b = {name: tensor for name, tensor in adapter.items() if "lora_B" in name}
    # Every LoRA B (2 layers x 7 linear modules) moved from its zero start.
    assert len(lora_b) == 2 * 7 and all(tensor.abs().sum() > 0 for tensor in lora_b.values())
    # The base decoder is frozen: none of its weights is in the adapter file.
    assert not any("embed_tokens" in name or name.endswith("q_proj.weight") for name in adapter)

    # Reload: plain transformers + peft, its own pooling (pad_token_id set, pad == eos), one right-padded
    # batch of all eight sequences, gives the scores of our eval predictions.
    from peft import PeftModel

    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    pad_id = base.config.pad_token_id = base.config.eos_token_id
    plain = PeftModel.from_pretrained(base, str(out)).eval()
    scorer = RewardScorer(out)
    sequences, expected = [], []
    for (prompt, chosen, rejected), pred in zip(PAIRS[:4], predictions):
        sequences += [scorer.encode(prompt, chosen), scorer.encode(prompt, rejected)]
        expected += [pred["chosen"], pred["rejected"]]
    width = max(map(len, sequences))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        scores = plain(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert scores.tolist() == pytest.approx(expected, abs=1e-4)


class PredictionBatches(TrainerCallback):
    """How many batches went through `prediction_step`, in evaluation and prediction together."""

    def __init__(self) -> None:
        self.count = 0

    def on_prediction_step(self, args, state, control, **kwargs):
        self.count += 1


def test_prediction_takes_the_scores_of_the_end_of_run_evaluation(tmp_path, tiny_model_dir, capsys):
    """Issue 30: the loop evaluates the 4 held-out pairs at its last step, that is the end-of-run evaluation,
    and prediction on the same pairs takes its scores instead of scoring them again: one batch in all. The
    metrics print once; predict_results.json holds them under predict_ names."""
    batches = PredictionBatches()
    config = _config(tmp_path, tiny_model_dir, do_predict=True, eval_strategy="steps", eval_steps=3,
                     per_device_eval_batch_size=4)
    run_train(config, callbacks=[batches])
    assert batches.count == 1
    out = Path(config.training.output_dir)
    eval_results = json.loads((out / "eval_results.json").read_text())
    predict_results = json.loads((out / "predict_results.json").read_text())
    for key in ("loss", "accuracy", "rewards/margins"):
        assert predict_results[f"predict_{key}"] == eval_results[f"eval_{key}"]
    predictions = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 4
    assert eval_results["eval_accuracy"] == pytest.approx(sum(p["chosen"] > p["rejected"] for p in predictions) / 4)
    printed = capsys.readouterr().out
    assert printed.count("***** eval metrics *****") == 1 and "predict metrics" not in printed


def test_batch_eval_metrics_gives_the_same_metrics_and_predictions(tmp_path, tiny_model_dir):
    """`batch_eval_metrics: true` (transformers' key; LLaMA-Factory's metrics take it): the metrics are summed batch
    by batch (eval batches of 3 over 4 pairs) and equal the whole set's; the evaluation keeps no predictions, so
    prediction scores the pairs itself, to the same file."""
    results = {}
    for batched in (False, True):
        batches = PredictionBatches()
        config = _config(tmp_path, tiny_model_dir, f"out_{batched}", do_predict=True, batch_eval_metrics=batched)
        run_train(config, callbacks=[batches])
        out = Path(config.training.output_dir)
        results[batched] = (json.loads((out / "eval_results.json").read_text()),
                            (out / "generated_predictions.jsonl").read_text(), batches.count)
    (whole, file, count), (batched, batched_file, batched_count) = results[False], results[True]
    assert {k: v for k, v in batched.items() if "runtime" not in k and "per_second" not in k} == pytest.approx(
        {k: v for k, v in whole.items() if "runtime" not in k and "per_second" not in k}, abs=1e-6)
    assert batched_file == file and count == 2 and batched_count == 4


def test_margin_column_changes_the_loss(tmp_path, tiny_model_dir):
    """Same model, same pairs, lr 0: a margin of 1 on every pair must raise the loss (the chosen reward
    has to beat the rejected by one more unit)."""
    losses = []
    for name, rows in (("plain", _pref_rows()), ("margin", _pref_rows(margin=1.0))):
        data = _write_jsonl(tmp_path / f"{name}.jsonl", rows)
        config = _config(tmp_path, tiny_model_dir, out=name, dataset=data, eval_dataset=data, do_train=False,
                         do_eval=True)
        run_train(config)
        losses.append(json.loads((Path(config.training.output_dir) / "eval_results.json").read_text())["eval_loss"])
    assert losses[1] > losses[0]


def test_full_finetuning_saves_a_plain_sequence_classification_model(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, finetuning_type="full", max_steps=2, do_eval=False)
    run_train(config)
    out = config.training.output_dir
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.num_labels == 1
    scorer = RewardScorer(out)
    prompt, chosen, _ = PAIRS[0]
    assert model.config.pad_token_id == model.config.eos_token_id  # pad == eos, as in SmolLM2
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([scorer.encode(prompt, chosen)])).logits[0, 0].item()
    assert scorer.score([prompt], [chosen])[0] == pytest.approx(plain, abs=1e-5)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    assert not torch.allclose(base.model.embed_tokens.weight, model.model.embed_tokens.weight)



def test_resumed_run_matches_uninterrupted_run(tmp_path, tiny_model_dir, stop_after_step):
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, do_eval=False, logging_steps=1)
    straight = _config(tmp_path, tiny_model_dir, out="straight", **common)
    run_train(straight)

    interrupted = _config(tmp_path, tiny_model_dir, out="resumed", **common)
    run_train(interrupted, callbacks=[stop_after_step(2)])
    assert (Path(interrupted.training.output_dir) / "checkpoint-2").is_dir()
    resumed = _config(tmp_path, tiny_model_dir, out="resumed", **common)
    run_train(resumed)  # finds checkpoint-2 in output_dir and resumes from it
    assert resumed.training.resume_from_checkpoint.endswith("checkpoint-2")

    def final(config):
        out = Path(config.training.output_dir)
        losses = {r["current_steps"]: r["loss"] for r in read_log(out) if "loss" in r}
        return losses, load_file(out / "adapter_model.safetensors")

    losses_a, weights_a = final(straight)
    losses_b, weights_b = final(resumed)
    assert losses_b[4] == pytest.approx(losses_a[4], abs=1e-6)
    assert losses_b[3] == pytest.approx(losses_a[3], abs=1e-6)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], atol=1e-6, rtol=0)


def test_accumulated_micro_batches_equal_one_batch(tmp_path, tiny_model_dir):
    """Two steps of 4 pairs, as one batch of 4 and as 1 pair x 4 micro-batches: the same logged losses and the
    same trained adapter and score head (what the trainer's hint on accumulation says)."""
    def run(batch, accumulation):
        # SGD: the update is the gradient (Adam's first steps would turn float noise in a near-zero gradient into
        # a full-size step).
        config = _config(tmp_path, tiny_model_dir, out=f"{batch}x{accumulation}", do_eval=False, max_steps=2,
                         per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, optim="sgd",
                         learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0)
        run_train(config)
        out = Path(config.training.output_dir)
        return ([r["loss"] for r in read_log(out) if "loss" in r], load_file(out / "adapter_model.safetensors"))

    (losses_one, weights_one), (losses_acc, weights_acc) = run(4, 1), run(1, 4)
    assert len(losses_one) == 2 and losses_acc == pytest.approx(losses_one, abs=1e-6)
    assert weights_one.keys() == weights_acc.keys()
    for name in weights_one:
        torch.testing.assert_close(weights_acc[name], weights_one[name], atol=1e-6, rtol=1e-5, msg=name)


def test_identical_and_vanishing_pairs_are_dropped_with_a_warning(tmp_path, tiny_model_dir, caplog):
    """With cutoff_len 24: a 731-token prompt leaves int(24 * 12 / 743) = 0 response tokens; two replies that
    differ only after their first 24 tokens become identical once cut."""
    rows = _pref_rows() + [
        {"prompt": "Name a colour.", "chosen": "green", "rejected": "green"},
        {"prompt": "You are a helpful assistant. " * 80, "chosen": "The waves roll in and out again.",
         "rejected": "The sky is blue, the sea is green."},
        {"prompt": "hi", "chosen": "The capital of France is Paris. " * 5 + "Yes",
         "rejected": "The capital of France is Paris. " * 5 + "No"},
    ]
    data = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    config = _config(tmp_path, tiny_model_dir, dataset=data, eval_dataset=None, do_eval=False, max_steps=1,
                     cutoff_len=24)
    with caplog.at_level(logging.WARNING):
        run_train(config)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "Dropped 3 of 11 train" in messages
    assert "chosen and rejected are identical;" in messages or "chosen and rejected are identical." in messages
    assert "identical within cutoff_len=24" in messages
    assert "no response token fits in cutoff_len=24" in messages


def test_sft_data_for_rm_is_a_clear_error(tmp_path, tiny_model_dir):
    data = _write_jsonl(tmp_path / "sft.jsonl", [{"instruction": "Name a colour.", "output": "green"}])
    config = _config(tmp_path, tiny_model_dir, dataset=data, eval_dataset=None, do_eval=False)
    with pytest.raises(DataError, match=r"stage rm needs preference pairs.*`chosen`.*`rejected`"):
        run_train(config)


def test_score_file_ranks_like_eval_and_handles_messages_and_padding_sides(tmp_path, tiny_model_dir):
    config = _config(tmp_path, tiny_model_dir, do_eval=False, do_predict=True)
    run_train(config)
    out = Path(config.training.output_dir)
    predictions = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]

    rows = []
    for prompt, chosen, rejected in PAIRS[:4]:
        rows.append({"prompt": prompt, "response": chosen, "id": len(rows)})
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": rejected}]})
    src = _write_jsonl(tmp_path / "to_score.jsonl", rows)
    n = score_file(out, src, tmp_path / "scored.jsonl", batch_size=3, cutoff_len=64)
    scored = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert n == 8 and scored[0]["id"] == 0 and "messages" in scored[1]
    for i, p in enumerate(predictions):
        assert scored[2 * i]["score"] == pytest.approx(p["chosen"], abs=1e-4)
        assert scored[2 * i + 1]["score"] == pytest.approx(p["rejected"], abs=1e-4)

    left = RewardScorer(out, padding_side="left", batch_size=4)
    assert left.score([p for p, _, _ in PAIRS[:4]], [c for _, c, _ in PAIRS[:4]]) == pytest.approx(
        [p["chosen"] for p in predictions], abs=1e-4)


def test_score_file_names_the_line_and_missing_field(tmp_path, tiny_model_dir):
    src = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "hi", "response": "hello"}, {"prompt": "hi"}])
    with pytest.raises(DataError, match=r"bad.jsonl line 2: missing `response`"):
        score_file(tiny_model_dir, src, tmp_path / "o.jsonl")


def test_exported_reward_adapter_scores_the_same(tmp_path, tiny_model_dir):
    from alignkit.export import export_model
    from alignkit.config import ModelArguments

    config = _config(tmp_path, tiny_model_dir, do_eval=False, max_steps=2)
    run_train(config)
    out = config.training.output_dir
    exported = export_model(ModelArguments(model_name_or_path=tiny_model_dir, adapter_name_or_path=out),
                            str(tmp_path / "exported"))
    prompts, responses = [p for p, _, _ in PAIRS[:3]], [c for _, c, _ in PAIRS[:3]]
    assert RewardScorer(exported).score(prompts, responses) == pytest.approx(
        RewardScorer(out).score(prompts, responses), abs=1e-5)


def test_rm_trained_from_an_sft_adapter_scores_in_alignkit_score_as_in_training(tmp_path, tiny_model_dir):
    """SFT 2 steps, then an RM from that adapter 2 steps: the RM's folder (and checkpoints) record the SFT
    adapter, and `alignkit score` merges it under the RM again, so its scores are the run's predictions. Before
    the record, the RM was scored on the bare base (about 0.9 off on this setup)."""
    from alignkit.model.loader import BASE_ADAPTERS_FILE

    sft_rows = [{"instruction": p, "output": c} for p, c, _ in PAIRS]
    sft = parse_config({"stage": "sft", "model_name_or_path": tiny_model_dir, "do_train": True,
                        "dataset": _write_jsonl(tmp_path / "sft.jsonl", sft_rows), "output_dir": str(tmp_path / "sft"),
                        "max_steps": 2, "per_device_train_batch_size": 2, "learning_rate": 5e-2, "lora_rank": 4,
                        "cutoff_len": 64, "save_strategy": "no", "seed": 0})
    run_train(sft)
    config = _config(tmp_path, tiny_model_dir, out="rm_sft", adapter_name_or_path=str(tmp_path / "sft"),
                     do_eval=False, do_predict=True, max_steps=2, learning_rate=5e-2, save_strategy="steps",
                     save_steps=1)
    run_train(config)
    out = Path(config.training.output_dir)
    for folder in (out, out / "checkpoint-1", out / "checkpoint-2"):
        record = json.loads((folder / BASE_ADAPTERS_FILE).read_text())
        assert record["base_adapters"] == [str((tmp_path / "sft").resolve())]

    predictions = [json.loads(line) for line in (out / "generated_predictions.jsonl").read_text().splitlines()]
    prompts = [p for p, _, _ in PAIRS[:4]]
    trained = [[p["chosen"] for p in predictions], [p["rejected"] for p in predictions]]
    scorer = RewardScorer(out, cutoff_len=64)
    scored = [scorer.score(prompts, [c for _, c, _ in PAIRS[:4]]), scorer.score(prompts, [r for _, _, r in PAIRS[:4]])]
    torch.testing.assert_close(torch.tensor(scored), torch.tensor(trained), atol=1e-5, rtol=0)
    # The SFT adapter matters: without it (the bare base under the RM adapter) the scores are others.
    (out / BASE_ADAPTERS_FILE).unlink()
    bare = RewardScorer(out, cutoff_len=64).score(prompts, [c for _, c, _ in PAIRS[:4]])
    assert max(abs(a - b) for a, b in zip(bare, trained[0])) > 1e-2
