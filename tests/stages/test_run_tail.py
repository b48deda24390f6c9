"""What a run does around training (`run_stage_trainer`), on the tiny model: how often it evaluates, and
the loss plots of a resumed run."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from alignkit.callbacks import read_log
from alignkit.config.parse import parse_config
from alignkit.train import run_train


class EvaluationSteps(TrainerCallback):
    """The global step of every evaluation, in the loop or after it."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_evaluate(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def _sft_config(tiny_model_dir, tmp_path, **overrides):
    data = tmp_path / "sft.json"
    if not data.exists():
        rows = [{"instruction": f"What is {i} plus {i}?", "output": f"{i} plus {i} is {2 * i}."} for i in range(16)]
        data.write_text(json.dumps(rows))
    values = {"stage": "sft", "do_train": True, "model_name_or_path": tiny_model_dir, "dataset": str(data),
              "val_size": 4, "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4,
              "per_device_eval_batch_size": 4, "learning_rate": 1e-3, "lora_rank": 4, "cutoff_len": 64,
              "save_strategy": "no", "seed": 0, "disable_tqdm": True}
    values.update(overrides)
    return parse_config(values)


def test_a_run_that_evaluates_does_it_once_at_the_end(tiny_model_dir, tmp_path):
    """eval_steps=2 over 3 steps: transformers evaluates at step 2 and, ending, at step 3; that last one is the
    end-of-run evaluation (its metrics are eval_results.json), not repeated after training."""
    evaluations = EvaluationSteps()
    config = _sft_config(tiny_model_dir, tmp_path, do_eval=True, eval_strategy="steps", eval_steps=2, max_steps=3)
    run_train(config, callbacks=[evaluations])
    assert evaluations.steps == [2, 3]
    out = Path(config.training.output_dir)
    logged = [r for r in read_log(out) if "eval_loss" in r]
    assert [r["current_steps"] for r in logged] == [2, 3]
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_loss"] == logged[-1]["eval_loss"]
    assert json.loads((out / "all_results.json").read_text())["eval_loss"] == logged[-1]["eval_loss"]


def test_without_in_loop_evaluation_it_runs_after_training(tiny_model_dir, tmp_path):
    evaluations = EvaluationSteps()
    run_train(_sft_config(tiny_model_dir, tmp_path, do_eval=True, max_steps=2), callbacks=[evaluations])
    assert evaluations.steps == [2]
    assert (tmp_path / "out" / "eval_results.json").is_file()


def test_do_eval_false_does_not_evaluate_in_the_loop_either(tiny_model_dir, tmp_path):
    evaluations = EvaluationSteps()
    config = _sft_config(tiny_model_dir, tmp_path, do_eval=False, eval_strategy="steps", eval_steps=1, max_steps=2)
    run_train(config, callbacks=[evaluations])
    assert evaluations.steps == []
    assert not (tmp_path / "out" / "eval_results.json").exists()
    assert not [r for r in read_log(tmp_path / "out") if "eval_loss" in r]


def test_plots_after_a_resume_draw_no_run_summaries_and_no_single_points(tiny_model_dir, tmp_path, caplog):
    """Run 1 trains to step 2 and evaluates there; run 2 resumes to step 4 and evaluates only after training
    (eval_strategy no), so at plot time eval_loss holds one step. Each run logged its average `train_loss`."""
    first = _sft_config(tiny_model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=2, do_eval=True,
                        eval_strategy="steps", eval_steps=2, plot_loss=True)
    run_train(first)
    resumed = _sft_config(tiny_model_dir, tmp_path, max_steps=4, save_strategy="steps", save_steps=2, do_eval=True,
                          plot_loss=True)
    with caplog.at_level("INFO", logger="alignkit.callbacks"):
        run_train(resumed)
    out = tmp_path / "out"
    records = read_log(out)
    assert [r["current_steps"] for r in records if "train_loss" in r] == [2, 4]  # one summary per run
    assert [r["current_steps"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert (out / "training_loss.png").is_file()
    assert not (out / "training_train_loss.png").exists()
    assert not (out / "training_eval_loss.png").exists()
    assert "plot_loss: no plot of eval_accuracy, eval_loss: logged at fewer than 2 steps, and a curve needs 2." \
        in caplog.messages

