"""Why a resumed DDP run can differ from an uninterrupted one in the last bits.

Run it with torchrun, on the CPU:
`torchrun --standalone --nproc-per-node=4 resume_bits.py`. Each process trains a small
model for STEPS steps, once without a break and once "restarted" after each possible
step: the model and optimizer are rebuilt from their state, as a resumed job does, and
wrapped in a new DistributedDataParallel. Rank 0 prints, as JSON, the restart steps
after which the final weights differ from the uninterrupted run's.

A new DDP (find_unused_parameters=False, the default) sums the first step's gradients in
one bucket, in the order of model.parameters(). From the second step on, it sums them in
the order backward() produced them. Floating-point addition depends on order, and the
gradient of each element goes to another position of the buffer that gloo (or NCCL)
reduces; with 3 processes or more, that changes how it is summed.
find_unused_parameters=True keeps the first order for good, at the cost of a graph
traversal per step, so every restart sums exactly as the uninterrupted run does.
"""

import gc
import json

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

STEPS = 20


def train(batches, restart_after: int | None, **ddp_options) -> torch.Tensor:
    """The final weights after training on `batches`,
    rebuilt after step `restart_after`."""
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp_model = DistributedDataParallel(model, **ddp_options)
    for step, (x, y) in enumerate(batches):
        if step == restart_after:
            # What a resumed job does: new objects, loaded from the checkpointed state.
            model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
            model = torch.nn.Linear(20, 1)
            model.load_state_dict(model_state)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            optimizer.load_state_dict(optimizer_state)
            ddp_model = DistributedDataParallel(model, **ddp_options)
        optimizer.zero_grad()
        F.mse_loss(ddp_model(x), y).backward()
        optimizer.step()
    return model.weight.detach().clone()


def differing_restarts(batches, **ddp_options) -> list[int]:
    """The restart steps whose run ends with other weights
    than the uninterrupted run's."""
    uninterrupted = train(batches, None, **ddp_options)
    return [
        step
        for step in range(1, STEPS)
        if not torch.equal(train(batches, step, **ddp_options), uninterrupted)
    ]


def main():
    dist.init_process_group("gloo")
    # Each process its own data, as with a DistributedSampler.
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [
        (torch.rand(8, 20, generator=generator), torch.rand(8, 1, generator=generator))
        for _ in range(STEPS)
    ]
    result = {
        "world_size": dist.get_world_size(),
        "differing": differing_restarts(batches),
        "differing_with_one_order": differing_restarts(
            batches, find_unused_parameters=True
        ),
    }
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)
    # The DDP objects sit in reference cycles that keep the process
    # group alive. Collected at the interpreter's exit instead,
    # after the group, gloo's threads can abort the process.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
