"""KTO evaluation under two processes (CPU, gloo, tiny model): the same metrics as one process.

KTO's statistics span the batch (the reference point z0 from the mismatched rows, the reward margin as the
difference of two means), so two processes x eval batch 4 must report what one process x eval batch 8 reports:
z0 and the margin formed over both processes' rows, and the rows accelerate repeats to fill the last round left
out. The eval set holds 37 rows: the 2-process run's last round has 5 real rows (4 on process 0, 1 on process 1)
and 3 repeats.

Training: KTO's mismatched rows are grouped by a step's rows over all processes (per-device batch x processes),
and z0 is formed over every process's rows, so 2 processes x batch 2 train as 1 process x batch 4 (the same
per-step losses, metrics and final adapter within 1e-5).

The evaluations resume from the final checkpoint of that 2-process training run (the trained LoRA adapter; the
reference is the adapter disabled): 1 process x training batch 4 (which groups the eval set's mismatched rows:
4 x 1) and eval batch 8, against 2 processes x training batch 2 (2 x 2) and eval batch 4. The 2-process
evaluation reads its reference log-probs from columns computed once (`precompute_ref_log_probs`: the main
process computes and writes them, the other reads the file), the 1-process one runs the reference on the fly.
Both training runs also evaluate at steps 2 and 4; the second evaluation takes the reference's outputs kept from
the first, and equals the fresh evaluations of the same weights.
"""

from __future__ import annotations

import json

EVAL_ROWS = 37
KEYS = {"max_samples": EVAL_ROWS, "eval_dataset": "demo_kto_eval"}


def test_two_processes_train_kto_as_one_and_evaluate_as_one_without_the_repeated_rows(dist):
    # Both evaluate at steps 2 and 4; the step-4 evaluation takes the reference's outputs kept from step 2
    # (`StageTrainer.kept_reference`, every process agreeing per batch).
    during = {"eval_strategy": "steps", "eval_steps": 2, **KEYS}
    single_train = dist.train(dist.config("kto", "kto_train_1p", per_device_train_batch_size=4,
                                          per_device_eval_batch_size=8, **during))
    trained = dist.train(dist.config("kto", "kto_train_2p", save_steps=4, per_device_train_batch_size=2,
                                     per_device_eval_batch_size=4, **during), nproc=2)
    print("\nkto: per-step loss, 1 process x batch 4 vs 2 processes x batch 2\n"
          + dist.loss_table({"1 proc x 4": single_train, "2 procs x 2": trained}))
    dist.assert_same_losses(single_train, trained, atol=1e-5)
    dist.assert_same_logs(single_train, trained, atol=1e-5)  # kl, rewards, margins, grad norms
    dist.assert_same_weights(single_train, trained, atol=1e-5)

    checkpoint = trained.out / "checkpoint-4"
    assert checkpoint.is_dir()
    evaluate = {"do_eval": True, "resume_from_checkpoint": str(checkpoint), **KEYS}
    single = dist.train(dist.config("kto", "kto_eval_1p", per_device_train_batch_size=4,
                                    per_device_eval_batch_size=8, **evaluate))
    double = dist.train(dist.config("kto", "kto_eval_2p", per_device_train_batch_size=2,
                                    per_device_eval_batch_size=4, precompute_ref_log_probs=True, **evaluate), nproc=2)
    assert double.output.count("Computing reference log-probs of the eval dataset") == 1, double.output[-4000:]
    assert double.output.count("Reading reference log-probs of the eval dataset") == 1
    results = [json.loads((run.out / "eval_results.json").read_text()) for run in (single, double)]
    # The evaluation's own figures (`epoch` and the token count are the resumed training state's; timing varies).
    timing = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
    keys = sorted(k for k in results[0] if k.startswith("eval_") and k not in timing)
    assert keys == sorted(k for k in results[1] if k.startswith("eval_") and k not in timing)
    assert {"eval_loss", "eval_kl", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins",
            "eval_logps/chosen", "eval_logps/rejected"} <= set(keys)
    assert abs(results[0]["eval_rewards/margins"]) > 0  # the policy has left the reference
    print("\nkto eval: 1 process x batch 8 vs 2 processes x batch 4\n"
          + "\n".join(f"{k}: {results[0][k]:.8f} | {results[1][k]:.8f}" for k in keys))
    different = {k: (results[0][k], results[1][k]) for k in keys if abs(results[0][k] - results[1][k]) > 1e-5}
    assert not different, f"evaluation differs between 1 and 2 processes: {different}"
    # The training runs' step-4 evaluations (kept reference outputs) equal the fresh ones of the same weights
    # (checkpoint-4 is the final step), with 1 and with 2 processes.
    for run in (single_train, trained):
        during_eval = [r for r in run.log() if "eval_loss" in r]
        assert [r["current_steps"] for r in during_eval] == [2, 4]
        kept = {k: during_eval[-1][k] for k in keys if k in during_eval[-1]}
        assert set(kept) == set(keys) - {"eval_model_preparation_time"}
        different = {k: (v, results[0][k]) for k, v in kept.items() if abs(v - results[0][k]) > 1e-5}
        assert not different, f"the step-4 evaluation differs from a fresh one: {different}"
