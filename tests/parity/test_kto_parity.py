"""Parity with TRL 1.16's KTOTrainer: same tiny policy and reference, same tokens -> same loss and metrics.

The policy and the reference differ (the policy is the tiny model built with another seed, the reference
the tiny model itself: this way round the batch's KL estimate is positive, not clamped to 0), so
log-ratios and the KL estimate are not zero. TRL tokenises the conversational rows and builds its mismatched KL
completions itself; our batch reuses TRL's prompt and completion ids, and our own rotation must give the
same mismatched rows as TRL's `KL_completion_ids`. The batch holds 4 desirable and 2 undesirable replies.
"""

from __future__ import annotations

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM

from alignkit.config.parse import parse_config
from alignkit.data import UnpairedCollator
from alignkit.model.tiny import build_tiny_model
from alignkit.stages.kto import KTOTrainer

pytestmark = pytest.mark.parity
trl = pytest.importorskip("trl")

ROWS = [
    ("What is 12 plus 7?", "12 plus 7 is 19.", True),
    ("The capital of France?", "Tokyo.", False),
    ("Name a colour.", "green", True),
    ("Translate to French: good morning.", "Bonjour.", True),
    ("Write a short poem about the sea.", "8", False),
    ("How many apples does Tom have?", "Tom has 8 apples.", True),
]
METRICS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def policy_dir(tiny_model_dir, tmp_path_factory):
    """A second tiny model with the same vocabulary and other weights, to serve as the policy."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = tmp_path_factory.mktemp("tiny_kto_reference")
    build_tiny_model(len(tokenizer), seed=1).save_pretrained(path)
    return str(path)


def _trl_trainer(policy_dir, tiny_model_dir, tiny_tokenizer, tmp_path, **kto):
    from trl import KTOConfig, KTOTrainer as TRLKTOTrainer

    rows = Dataset.from_list([
        {"prompt": [{"role": "user", "content": p}], "completion": [{"role": "assistant", "content": c}],
         "label": label} for p, c, label in ROWS
    ])
    args = KTOConfig(
        output_dir=str(tmp_path / "trl"), bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True,
        report_to="none", per_device_train_batch_size=len(ROWS), max_length=None, dataset_num_proc=None,
        **{"precompute_ref_log_probs": False, **kto},
    )
    return TRLKTOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_dir),
        ref_model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=args, train_dataset=rows, processing_class=tiny_tokenizer,
    )


@pytest.mark.parametrize(("loss_type", "beta", "desirable_weight", "undesirable_weight", "precompute"), [
    ("kto", 0.1, 1.0, 1.0, False),
    ("kto", 0.5, 1.0, 1.5, False),  # imbalanced: 4 desirable, 2 undesirable, the undesirable ones weighed up
    ("kto", 2.0, 0.6, 1.0, False),
    ("apo_zero_unpaired", 0.1, 1.2, 1.0, False),
    # precompute_ref_log_probs on both sides: the reference's log-probs (and the KL rows') come from the columns
    ("kto", 0.5, 1.0, 1.5, True),
    ("apo_zero_unpaired", 0.1, 1.2, 1.0, True),
])
def test_first_step_loss_and_metrics_match_trl(policy_dir, tiny_model_dir, tiny_tokenizer, tmp_path, loss_type,
                                               beta, desirable_weight, undesirable_weight, precompute):
    theirs = _trl_trainer(policy_dir, tiny_model_dir, tiny_tokenizer, tmp_path, loss_type=loss_type, beta=beta,
                          desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                          precompute_ref_log_probs=precompute)
    assert ("ref_logps" in theirs.train_dataset.column_names) == precompute
    rows = [theirs.train_dataset[i] for i in range(len(ROWS))]
    theirs.model.train()
    their_loss = theirs.compute_loss(theirs.model, theirs._prepare_inputs(theirs.data_collator(rows))).item()
    their_metrics = {k: theirs._metrics["train"][k][-1] for k in METRICS if theirs._metrics["train"][k]}

    # TRL's token ids in our layout: prompt + reply, labels -100 on the prompt.
    features = [{"input_ids": r["prompt_ids"] + r["completion_ids"],
                 "attention_mask": [1] * (len(r["prompt_ids"]) + len(r["completion_ids"])),
                 "labels": [-100] * len(r["prompt_ids"]) + r["completion_ids"], "desirable": r["label"]}
                for r in rows]
    config = parse_config({"stage": "kto", "loss_type": loss_type, "pref_beta": beta,
                           "kto_chosen_weight": desirable_weight, "kto_rejected_weight": undesirable_weight,
                           "finetuning_type": "full", "output_dir": str(tmp_path / "ours"), "use_cpu": True,
                           "per_device_train_batch_size": len(ROWS), "precompute_ref_log_probs": precompute})
    ours = KTOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_dir),
        ref_model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        args=config.training, kto_args=config.method, data_collator=UnpairedCollator(tiny_tokenizer),
        train_dataset=Dataset.from_list(features),
    )
    our_rows = [ours.train_dataset[i] for i in range(len(ROWS))]
    if precompute:  # the reference is never run in the step: its log-probs come from TRL's and our columns alike
        assert our_rows[0]["ref_logps"] == pytest.approx(rows[0]["ref_logps"], abs=1e-5)
        ours.ref_model = theirs.ref_model = None
    if loss_type == "kto":  # our rotation builds TRL's mismatched rows
        assert [r["kl_input_ids"] for r in our_rows] == [r["prompt_ids"] + r["KL_completion_ids"] for r in rows]
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, ours._prepare_inputs(ours.data_collator(our_rows))).item()
    our_metrics = {k: ours._metrics["train"][k][-1] for k in METRICS}

    print(f"\n{loss_type} beta={beta} w=({desirable_weight}, {undesirable_weight}) |loss diff|="
          f"{abs(our_loss - their_loss):.2e} " + " ".join(
              f"|{k} diff|={abs(our_metrics[k] - their_metrics[k]):.2e}" for k in their_metrics))
    assert our_loss == pytest.approx(their_loss, rel=1e-5, abs=1e-5)
    assert their_metrics["rewards/margins"] != pytest.approx(0.0, abs=1e-3)  # a non-trivial comparison
    if loss_type == "kto":
        assert their_metrics["kl"] > 1e-3  # z0 is not clamped to 0 here: the KL pass matters
    assert set(their_metrics) == set(METRICS)
    for key in METRICS:
        assert our_metrics[key] == pytest.approx(their_metrics[key], rel=1e-5, abs=1e-5), key


def test_unpaired_rows_tokenise_to_trls_ids(policy_dir, tiny_model_dir, tiny_tokenizer, tmp_path):
    """From the same conversational rows our data layer gives TRL's prompt + completion ids and labels, so
    the loss parity above holds from the data file on, not only from TRL's tokens."""
    import json

    from alignkit.data import get_dataset

    theirs = _trl_trainer(policy_dir, tiny_model_dir, tiny_tokenizer, tmp_path)
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}],
                                        "completion": [{"role": "assistant", "content": c}], "label": label}) + "\n"
                            for p, c, label in ROWS))
    ours = get_dataset(parse_config({"stage": "kto", "dataset": str(data), "cutoff_len": 1024}), tiny_tokenizer,
                       "unpaired")["train_dataset"]
    for i, row in enumerate(theirs.train_dataset):
        assert ours[i]["input_ids"] == row["prompt_ids"] + row["completion_ids"]
        assert ours[i]["labels"] == [-100] * len(row["prompt_ids"]) + row["completion_ids"]
        assert ours[i]["desirable"] == row["label"]
