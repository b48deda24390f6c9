"""A vision-language model under two processes (CPU, gloo): sft and dpo on image rows train as one process does.

The tiny random LLaVA of `alignkit.model.tiny.save_tiny_vlm` on LLaMA-Factory's `mllm_demo`-shaped rows with
generated PNGs (`tests/stages/test_multimodal.py`'s data): 1 process x batch 4 against 2 processes x batch 2, two
steps each. Each process collates the pixel values of its own rows (DPO: each pair's image for both replies), so the
per-step losses, the logged metrics and the final adapter must agree within 1e-5.
"""

from __future__ import annotations

import pytest

from tests.stages.test_multimodal import mllm_pairs

ROWS = 8  # 2 steps x 4 rows


@pytest.fixture(scope="module")
def vlm_data(tmp_path_factory):
    from alignkit.model.tiny import save_tiny_vlm

    model_dir = save_tiny_vlm(tmp_path_factory.mktemp("tiny_llava"))
    return str(model_dir), mllm_pairs(tmp_path_factory.mktemp("vlm_data"), rows=ROWS)


@pytest.mark.parametrize("stage,dataset", [("sft", "mllm_demo"), ("dpo", "mllm_pairs")])
def test_two_processes_train_a_vlm_as_one(dist, vlm_data, stage, dataset):
    model_dir, data_dir = vlm_data
    keys = dict(model_name_or_path=model_dir, dataset=dataset, dataset_dir=str(data_dir), max_steps=2,
                lora_target=None)
    single = dist.train(dist.config(stage, f"vlm_{stage}_1p", per_device_train_batch_size=4, **keys))
    double = dist.train(dist.config(stage, f"vlm_{stage}_2p", per_device_train_batch_size=2, **keys), nproc=2)
    print(f"\nvlm {stage}: per-step loss, 1 process x batch 4 vs 2 processes x batch 2\n"
          + dist.loss_table({"1 proc x 4": single, "2 procs x 2": double}))
    assert sorted(double.losses()) == [1, 2]
    dist.assert_same_losses(single, double, atol=1e-5)
    dist.assert_same_logs(single, double, atol=1e-5)
    dist.assert_same_weights(single, double, atol=1e-5)
    if stage == "dpo":
        import math
        assert single.losses()[1] == pytest.approx(math.log(2), abs=1e-6)
