"""Data parallelism on the CPU (gloo): 2 processes x batch b must equal 1 process x batch 2b."""

from __future__ import annotations



def test_sft_two_processes_equal_one(dist):
    single = dist.train(dist.config("sft", "sft_1p", per_device_train_batch_size=4))
    double = dist.train(dist.config("sft", "sft_2p", per_device_train_batch_size=2), nproc=2)
    print(dist.loss_table({"1 proc x 4": single, "2 procs x 2": double}))
    dist.assert_same_losses(single, double)
    dist.assert_same_weights(single, double)
