"""Parity with TRL 1.16's DPOTrainer: same tiny policy and reference, same tokens -> same loss and rewards.

The policy and the reference differ (the reference is the tiny model with another seed), so the
log-ratios are not zero and the loss is not the trivial log 2 of step 0. TRL's dataset is built from the
same conversations with the same chat template; our batch is then assembled from TRL's own token ids.
"""

from __future__ import annotations

import pytest
from datasets import Dataset
from transformers import AutoModelForCausalLM

from alignkit.config.parse import parse_config
from alignkit.data import PairwiseCollator
from alignkit.model.tiny import build_tiny_model
from alignkit.stages.dpo import DPOTrainer

pytestmark = pytest.mark.parity
trl = pytest.importorskip("trl")

PAIRS = [
    ("What is 12 plus 7?", "12 plus 7 is 19.", "It is 27."),
    ("The capital of France?", "The capital of France is Paris.", "Tokyo."),
    ("Name a colour.", "green", "apple, banana, cherry"),
    ("Translate to French: good morning.", "Bonjour.", "The waves roll in and out again."),
]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@pytest.fixture(scope="module")
def reference_dir(tiny_model_dir, tmp_path_factory):
    """A second tiny model with the same vocabulary and other weights, to serve as the reference."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = tmp_path_factory.mktemp("tiny_reference")
    build_tiny_model(len(tokenizer), seed=1).save_pretrained(path)
    return str(path)


def _trl_trainer(tiny_model_dir, reference_dir, tiny_tokenizer, loss_type, beta, tmp_path, **options):
    from trl import DPOConfig, DPOTrainer as TRLDPOTrainer

    conversations = Dataset.from_list([
        {"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
         "rejected": [{"role": "assistant", "content": r}]} for p, c, r in PAIRS
    ])
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"), loss_type=[loss_type] if isinstance(loss_type, str) else list(loss_type),
        beta=beta, bf16=False, fp16=False, **options,
        gradient_checkpointing=False, padding_free=False, precompute_ref_log_probs=False, use_cpu=True,
        report_to="none", per_device_train_batch_size=len(PAIRS), max_length=None, dataset_num_proc=None,
    )
    return TRLDPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        ref_model=AutoModelForCausalLM.from_pretrained(reference_dir),
        args=args, train_dataset=conversations, processing_class=tiny_tokenizer,
    )


# (pref_loss, beta, TRL's other DPOConfig keys): every loss type of TRL 1.16's DPOTrainer, a weighted sum (MPO's),
# and the f-divergences. TRL's `label_smoothing` is our `dpo_label_smoothing`; the rest keep TRL's names.
CASES = [
    ("sigmoid", 0.1, {}), ("ipo", 0.1, {}), ("hinge", 0.5, {}),
    ("exo_pair", 0.5, {"label_smoothing": 0.1}), ("nca_pair", 0.5, {}), ("robust", 0.5, {"label_smoothing": 0.2}),
    ("bco_pair", 0.5, {}), ("sppo_hard", 0.5, {}), ("aot", 0.5, {"label_smoothing": 0.1}),
    ("aot_unpaired", 0.5, {"label_smoothing": 0.1}), ("apo_zero", 0.5, {}), ("apo_down", 0.5, {}),
    ("discopop", 0.5, {}), ("discopop", 0.5, {"discopop_tau": 2.0}), ("sft", 0.1, {}), ("sigmoid_norm", 0.5, {}),
    (["sigmoid", "bco_pair", "sft"], 0.1, {"loss_weights": [0.8, 0.2, 1.0]}),
    (["robust", "apo_zero"], 0.5, {"label_smoothing": 0.1}),
    ("sigmoid", 0.5, {"f_divergence_type": "forward_kl"}), ("sigmoid", 0.5, {"f_divergence_type": "js_divergence"}),
    ("hinge", 0.5, {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}),
    ("ipo", 0.1, {"f_divergence_type": "js_divergence"}),
    ("discopop", 0.5, {"f_divergence_type": "forward_kl"}),
]


def _name(case):
    loss, beta, options = case
    return "+".join([loss] if isinstance(loss, str) else loss) + "".join(f"-{v}" for v in options.values())


@pytest.mark.parametrize(("loss_type", "beta", "options"), CASES, ids=[_name(case) for case in CASES])
def test_first_step_loss_and_metrics_match_trl(tiny_model_dir, reference_dir, tiny_tokenizer, tmp_path,
                                               loss_type, beta, options):
    theirs = _trl_trainer(tiny_model_dir, reference_dir, tiny_tokenizer, loss_type, beta, tmp_path, **options)
    rows = [theirs.train_dataset[i] for i in range(len(PAIRS))]
    theirs.model.train()
    their_loss = theirs.compute_loss(theirs.model, theirs._prepare_inputs(theirs.data_collator(rows))).item()
    their_metrics = {k: theirs._metrics["train"][k][-1] for k in METRICS}

    # The same token ids in our dataset layout: prompt + response, labels -100 on the prompt.
    features = []
    for row in rows:
        feature = {}
        for side in ("chosen", "rejected"):
            ids = row["prompt_ids"] + row[f"{side}_ids"]
            feature[f"{side}_input_ids"] = ids
            feature[f"{side}_attention_mask"] = [1] * len(ids)
            feature[f"{side}_labels"] = [-100] * len(row["prompt_ids"]) + row[f"{side}_ids"]
        features.append(feature)
    ours_options = {("dpo_label_smoothing" if key == "label_smoothing" else key): value
                    for key, value in options.items()}
    config = parse_config({"stage": "dpo", "pref_loss": loss_type, "pref_beta": beta, "finetuning_type": "full",
                           "output_dir": str(tmp_path / "ours"), "use_cpu": True, **ours_options})
    ours = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        ref_model=AutoModelForCausalLM.from_pretrained(reference_dir),
        args=config.training, dpo_args=config.method, data_collator=PairwiseCollator(tiny_tokenizer),
        train_dataset=Dataset.from_list(features),
    )
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, ours._prepare_inputs(ours.data_collator(features))).item()
    our_metrics = {k: ours._metrics["train"][k][-1] for k in METRICS}

    assert our_loss == pytest.approx(their_loss, rel=1e-5, abs=1e-5)
    assert their_metrics["rewards/margins"] != pytest.approx(0.0, abs=1e-3)  # a non-trivial comparison
    # `sft` alone reads no reference, so alignkit runs none and logs the reference-free losses' rewards (beta times
    # the average log-prob) where TRL logs beta times the log-ratio to a reference it computes anyway.
    reference_free = loss_type == "sft"
    for key in METRICS if not reference_free else ("logps/chosen", "logps/rejected"):
        assert our_metrics[key] == pytest.approx(their_metrics[key], rel=1e-5, abs=1e-5), key
