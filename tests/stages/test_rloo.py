"""RLOO's rollout inside GRPO's trainer, on the tiny model with the parity harness's injected completions (the loss
and metrics against TRL are in tests/parity/test_rloo_parity.py): which no-grad scoring passes a round runs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import alignkit.stages.grpo as grpo
from alignkit.stages.rloo import RLOOTrainer
from tests.helpers import Injector
from tests.parity.test_grpo_parity import _completions, _no_collect_per_train, _run_ours

_no_collect_per_train = _no_collect_per_train  # skip Trainer's per-train gc.collect, as the harness does


@pytest.mark.parametrize("beta, scoring_passes", [(0.0, 0), (0.05, 1)])
def test_scoring_passes_follow_the_kl(beta, scoring_passes, tiny_model_dir, tmp_path, monkeypatch):
    """With the KL folded into the reward (beta 0.05, TRL's default) the rollout reads the policy's log-probs: with
    one slice and one iteration (the defaults) it runs the slice's training forward itself and the loss
    backpropagates it, so a round runs one no-grad pass (the reference's) and one forward with gradients; run
    apart (the no-grad old log-probs pass, then the training forward) the losses are the same. With beta 0 and one
    iteration no scoring pass runs, and the slice's own forward stands in for the old log-probs (ratio 1, so no
    completion is clipped)."""
    passes = []
    original = grpo.completion_logps

    def counted(*args, **kwargs):
        passes.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo, "completion_logps", counted)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def run(out):
        return _run_ours(tiny_model_dir, tokenizer, Injector(_completions(tokenizer)), out, monkeypatch,
                         stage="rloo", trainer_class=RLOOTrainer, return_trainer=True, beta=beta, num_iterations=1)

    logs, trainer = run(tmp_path / "shared")
    rounds = len(logs)
    assert passes.count(False) == scoring_passes * rounds and passes.count(True) == rounds
    (batch,) = trainer._buffer
    assert ("old_logps" in batch) == (beta != 0)
    if beta == 0:
        assert all(logs[step]["clip_ratio/region_mean"] == 0 for step in logs)
        return
    passes.clear()
    with monkeypatch.context() as patch:
        patch.setattr(RLOOTrainer, "training_forward_in_rollout", lambda self: False)
        apart, _ = run(tmp_path / "apart")
    assert passes == [False, False, True] * rounds  # old log-probs, reference, training forward
    for step in logs:
        for key in ("loss", "kl", "reward", "clip_ratio/region_mean"):
            assert logs[step][key] == pytest.approx(apart[step][key], abs=1e-6), (step, key)


def test_accumulation_alone_does_not_change_the_update(tiny_model_dir, tmp_path, caplog):
    """RLOO's loss is a mean over the micro-batch's completions divided by the accumulation steps: 8 x 1 and 4 x 2
    (the same 8 completions, SGD) log the same losses and save the same adapter, and the 4 x 2 run is told so."""
    from safetensors.torch import load_file

    from alignkit.train import run_train
    from tests.stages.test_grpo import _config, _losses

    outs, hints = [], []
    for batch, accumulation in ((8, 1), (4, 2)):
        out = tmp_path / f"b{batch}"
        caplog.clear()
        with caplog.at_level("INFO", logger="alignkit.stages.base"):
            run_train(_config(tiny_model_dir, tmp_path, out, stage="rloo", per_device_train_batch_size=batch,
                              gradient_accumulation_steps=accumulation, max_steps=2, optim="sgd"))
        hints.append([r.getMessage() for r in caplog.records if "gradient_accumulation_steps=1" in r.getMessage()])
        outs.append(out)
    assert hints[0] == [] and len(hints[1]) == 1 and "generation_batch_size=8" in hints[1][0]
    first, second = (_losses(o) for o in outs)
    assert first.keys() == second.keys() == {1, 2}
    assert [first[s] for s in first] == pytest.approx([second[s] for s in first], abs=1e-5)
    a, b = (load_file(str(o / "adapter_model.safetensors")) for o in outs)
    assert max((a[name] - b[name]).abs().max().item() for name in a) < 1e-5
    # The loss is about 0 at ratio 1 (leave-one-out advantages sum to 0 per group); its gradient is not.
    assert any("lora_B" in name and a[name].abs().max().item() > 1e-4 for name in a)  # trained from zero
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=0)
