"""One rank of the FSDP2 example, run by its own main(),
recording each step for the tests.

test_fsdp.py starts this once per rank, with the variables that srun gives a task, as
smoke.py starts main.py. At every training step, all ranks gather the full parameters
the step starts from and the gradients it computes, from their shards, and rank 0
writes them, a list over steps, to the file named by the first argument. The other
arguments are main.py's; they must include --num-workers 0: DataLoader workers could
not import the example's classes from this module.

With FSDP_REFERENCE=1, in one process, the model is trained without
FSDP2: the reference. With FSDP_AVG_AS_SUM=1, the reduce-scatter of
gradients sums where FSDP2 asks it to average: the silent bug that
test_fsdp.py must catch (pytorch#162338: gloo once did just that).
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from smoke import load_main

fsdp = load_main("generic/fsdp")
out = sys.argv.pop(1)
steps = []

accumulate_gradients = fsdp.accumulate_gradients


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def recording_accumulate_gradients(model, batches, args, train_log):
    # full_tensor() gathers a tensor from every rank's shard: all
    # ranks take part. On one rank it may return the tensor
    # itself, which later steps change in place: hence the copies.
    named = list(model.named_parameters())
    # The weights that the step starts from, and the gradients it computes.
    params = {name: whole(p).detach().clone() for name, p in named}
    loss = accumulate_gradients(model, batches, args, train_log)
    grads = {name: whole(p.grad).clone() for name, p in named}
    steps.append({"grads": grads, "params": params})
    return loss


fsdp.accumulate_gradients = recording_accumulate_gradients

if os.environ.get("FSDP_AVG_AS_SUM") == "1":
    # FSDP2 reduce-scatters gradients with
    # dist.reduce_scatter_single: make its average a sum.
    reduce_scatter = dist.reduce_scatter_single

    def summing_reduce_scatter(*args, op=dist.ReduceOp.SUM, **kwargs):
        if op == dist.ReduceOp.AVG:
            op = dist.ReduceOp.SUM
        return reduce_scatter(*args, op=op, **kwargs)

    dist.reduce_scatter_single = summing_reduce_scatter

if os.environ.get("FSDP_REFERENCE") == "1":
    # The reference for the others: the model without FSDP2, in one process, starting
    # from the weights that FSDP2 would start from.
    shard_model = fsdp.shard_model

    def plain_model(model, device, args):
        sharded = shard_model(model, device, args)
        plain = fsdp.build_model(args, args.vocab_size)
        plain.load_state_dict(
            {name: p.full_tensor() for name, p in sharded.named_parameters()}
        )
        return plain

    fsdp.shard_model = plain_model
    fsdp.local_sizes = lambda model, optimizer: {}

fsdp.main()
if dist.get_rank() == 0:
    torch.save(steps, out)
gc.collect()
dist.destroy_process_group()
