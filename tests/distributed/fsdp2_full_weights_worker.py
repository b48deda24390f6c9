"""Worker for `test_full_weights_gathers_fsdp2_shards_once_per_generation` (run by torchrun, 2 CPU processes, gloo).

Shards the tiny model with FSDP2 (`fully_shard` on each decoder layer and the root), greedily generates the same
tokens with and without `alignkit.model.distributed.full_weights`, counts FSDP2's all-gathers in each case, and
has rank 0 print one JSON line per rank (gathered, so the lines of two processes cannot interleave).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from transformers import AutoModelForCausalLM

from alignkit.model.distributed import full_weights, sharding_of

NEW_TOKENS = 6


def main(model_dir: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    whole = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    sharded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)

    gathers = [0]
    original = _fsdp_param_group.foreach_all_gather

    def counting(*args, **kwargs):
        gathers[0] += 1
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counting
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = whole.generate(ids, **kwargs)
        sharded.reshard()
        gathers[0] = 0
        per_forward = sharded.generate(ids, **kwargs)
        without = gathers[0]
        sharded.reshard()
        gathers[0] = 0
        with full_weights(sharded) as model:
            gathered = model.generate(ids, **kwargs)
        with_block = gathers[0]
    # A block entered before the model's first forward (a run's first rollout) must leave FSDP2's root as FSDP2
    # sets it at that forward: not resharded after forward, so its weights (output layer, a value head) stay whole
    # for code that reads them after the model's call.
    fresh = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for layer in fresh.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    with torch.no_grad():
        with full_weights(fresh):
            pass
        fresh(ids)
    root_whole = not isinstance(fresh.lm_head.weight, DTensor)
    weight = sharded.model.layers[0].self_attn.q_proj.weight
    report = {
        "rank": dist.get_rank(), "sharding": sharding_of(sharded), "fsdp_modules": 1 + len(sharded.model.layers),
        "gathers_per_forward": without, "gathers_in_block": with_block,
        "same_tokens": gathered.tolist() == expected.tolist() == per_forward.tolist(),
        "local_rows_after": weight.to_local().shape[0], "rows": weight.shape[0],
        "root_whole_after_forward": root_whole,
    }
    # Gathered and printed by rank 0 alone: two processes printing at once can interleave on one line.
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        for line in reports:
            print(json.dumps(line), flush=True)
    dist.destroy_process_group()
    # As `alignkit train` does under torchrun (alignkit.cli._exit_without_teardown): gloo workers can abort in
    # the interpreter's C++ teardown after finishing, which would fail this finished run.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
