"""trainer_log.jsonl records and loss plots."""

import json
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState, TrainingArguments

from alignkit.callbacks import LOG_FILE, LogCallback, plot_loss, read_log, smooth


def test_smooth_hand_computed():
    """weight 0.5: [1, 3, 5] -> [1, 0.5*1+0.5*3 = 2, 0.5*2+0.5*5 = 3.5]."""
    assert smooth([1.0, 3.0, 5.0], weight=0.5) == pytest.approx([1.0, 2.0, 3.5])


def test_log_callback_writes_one_record_per_log(tmp_path, monkeypatch):
    """The clock reads 100 s at train begin, 102 s at step 1 and 105 s at step 2 (of 10), with 100 tokens a step:
    step 1: elapsed 2 s, remaining 2 / 1 step x 9 steps = 18 s, 100 tokens / 2 s = 50 tokens/s;
    step 2: elapsed 5 s, remaining 5 / 2 x 8 = 20 s, 100 tokens / 3 s = 33.33 tokens/s."""
    import alignkit.callbacks as callbacks_module

    clock = iter([100.0, 102.0, 105.0])
    monkeypatch.setattr(callbacks_module, "time", SimpleNamespace(time=lambda: next(clock)))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    state = TrainerState()
    state.max_steps = 10
    cb = LogCallback()
    cb.on_train_begin(args, state, TrainerControl())
    for step in (1, 2):
        state.global_step = step
        state.epoch = step / 10
        state.num_input_tokens_seen = 100 * step
        cb.on_log(args, state, TrainerControl(), logs={"loss": 2.0 / step, "learning_rate": 1e-4, "rewards/chosen": 0.5,
                                                          "train_runtime": 1.0 * step})
    records = read_log(tmp_path)
    assert len(records) == 2
    first = records[0]
    assert first["current_steps"] == 1 and first["total_steps"] == 10 and first["percentage"] == 10.0
    assert first["loss"] == 2.0 and first["rewards/chosen"] == 0.5 and first["learning_rate"] == 1e-4
    assert (first["elapsed_time"], first["remaining_time"], first["tokens_per_second"]) == (2.0, 18.0, 50.0)
    second = records[1]
    assert (second["elapsed_time"], second["remaining_time"], second["tokens_per_second"]) == (5.0, 20.0, 33.33)
    assert first["total_tokens"] == 100 and second["total_tokens"] == 200 and second["percentage"] == 20.0
    assert "train_runtime" not in first  # running speed metrics stay out of step records
    assert (tmp_path / LOG_FILE).read_text().count("\n") == 2


def test_plot_loss_writes_png_per_series(tmp_path):
    lines = [{"current_steps": i, "loss": 3.0 - i * 0.1, "eval_loss": None, "rewards/margins": i * 0.1,
              "eval_runtime": 1.0 * i}
             for i in range(1, 6)]
    lines.append({"current_steps": 5, "eval_loss": 2.0})
    (tmp_path / LOG_FILE).write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    written = plot_loss(tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["training_loss.png", "training_rewards_margins.png"]  # eval_loss has one point only
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_plot_loss_skips_run_summaries_and_series_of_one_step(tmp_path, caplog):
    """A run stopped at step 2 and resumed to 4: each run logged its summary (`train_loss`, the run's average,
    with `train_runtime`), and the first evaluated twice at step 2 (as runs before the one-evaluation fix
    did). The summaries are no curve; eval_loss has one step, so no plot; the loss curve has 4 steps."""
    lines = [{"current_steps": i, "loss": 3.0 - 0.1 * i} for i in (1, 2)]
    lines += [{"current_steps": 2, "eval_loss": 2.5, "eval_runtime": 0.1},
              {"current_steps": 2, "train_loss": 2.85, "train_runtime": 1.0, "total_flos": 0},
              {"current_steps": 2, "eval_loss": 2.5, "eval_runtime": 0.1}]
    lines += [{"current_steps": i, "loss": 3.0 - 0.1 * i} for i in (3, 4)]
    lines += [{"current_steps": 4, "train_loss": 2.65, "train_runtime": 1.0, "total_flos": 0}]
    (tmp_path / LOG_FILE).write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    with caplog.at_level("INFO", logger="alignkit.callbacks"):
        written = plot_loss(tmp_path)
    assert [p.name for p in written] == ["training_loss.png"]
    assert not (tmp_path / "training_train_loss.png").exists() and not (tmp_path / "training_eval_loss.png").exists()
    assert [r.getMessage() for r in caplog.records] == [
        "plot_loss: no plot of eval_loss: logged at fewer than 2 steps, and a curve needs 2."]


def test_divergence_guard_warns_once_when_finite_weights_explode(tmp_path, caplog):
    """Weights of norm 5 (3-4-0-0) before the first step: a step that keeps them within 1000x (x 999) says
    nothing; one past it (norm 5 x 1001) warns once, naming the step, both norms and learning_rate; later steps
    stay quiet. Nothing is non-finite, so training goes on."""
    import logging

    import torch

    from alignkit.callbacks import DivergenceGuard

    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    model.weight.grad = torch.ones_like(model.weight)
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", learning_rate=1e6)
    state, guard = TrainerState(), DivergenceGuard()
    caplog.set_level(logging.WARNING, logger="alignkit.callbacks")
    for step, scale in enumerate((999.0, 1001.0 / 999.0, 10.0)):
        state.global_step = step
        guard.on_pre_optimizer_step(args, state, TrainerControl(), model=model)
        with torch.no_grad():
            model.weight.mul_(scale)
        guard.on_optimizer_step(args, state, TrainerControl(), model=model)
        warnings = [r.getMessage() for r in caplog.records if "diverging" in r.getMessage()]
        assert len(warnings) == (0 if step == 0 else 1)
    assert "at step 2" in warnings[0] and "from 5 to 5e+03" in warnings[0] and "learning_rate (now 1e+06)" in warnings[0]


def test_a_logging_step_prints_as_one_line_of_rounded_numbers():
    """Issue 32: transformers printed {'loss': '1.069', ...} (numbers as strings) or 17-digit floats."""
    from alignkit.callbacks import format_log_line

    logs = {"loss": 1.0689021110534669, "grad_norm": 0.51234567, "learning_rate": 0.0003, "epoch": 0.13333333,
            "num_input_tokens_seen": 4096, "train_runtime": 160.5, "train_tokens_per_second": 23.11,
            "total_flos": 123456.0}
    assert format_log_line(logs, 5, 30) == "step 5/30  loss 1.069  grad_norm 0.5123  learning_rate 0.0003  epoch 0.1333"
    summary = {"train_runtime": 61.234, "train_loss": 0.4}  # the run's summary keeps its speed
    assert format_log_line(summary, 30, 0) == "step 30  train_runtime 61.23  train_loss 0.4"


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_trainers_built_under_readable_logs_print_those_lines(tmp_path, capsys, disable_tqdm):
    import torch
    import transformers.trainer as hf_trainer
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from alignkit.callbacks import readable_trainer_logs

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", disable_tqdm=disable_tqdm)
    with readable_trainer_logs():
        trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
    assert (hf_trainer.DEFAULT_PROGRESS_CALLBACK, hf_trainer.PrinterCallback) == (ProgressCallback, PrinterCallback)
    printers = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, (ProgressCallback, PrinterCallback))]
    assert len(printers) == 1 and type(printers[0]) not in (ProgressCallback, PrinterCallback)
    state = TrainerState(max_steps=4, global_step=2)
    printers[0].on_train_begin(args, state, TrainerControl())
    printers[0].on_log(args, state, TrainerControl(), logs={"loss": 0.123456})
    printers[0].on_train_end(args, state, TrainerControl())
    assert "step 2/4  loss 0.1235" in capsys.readouterr().out.splitlines()
