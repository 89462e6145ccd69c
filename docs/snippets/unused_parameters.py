"""DDP's error for a parameter that took no part in the loss, and the fixes.

Run it with torchrun, on the CPU:
`torchrun --standalone --nproc-per-node=2 unused_parameters.py`. A model has a second
head that the loss uses only when asked. DDP (find_unused_parameters=False, the default)
waits for a gradient of every parameter before the step ends; the unused head never
gets one, and the next forward fails. Each rank prints, as JSON, the start of the error,
the parameters it names (with TORCH_DISTRIBUTED_DEBUG=INFO), and whether each fix trains
without an error.
"""

import gc
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)
        self.extra_head = torch.nn.Linear(8, 1)

    def forward(self, x, use_extra_head: bool):
        features = torch.relu(self.body(x))
        out = self.head(features)
        return out + self.extra_head(features) if use_extra_head else out


def train(model: torch.nn.Module, steps: int = 3) -> str | None:
    """Trains without the extra head; returns the error's message, or None."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for _ in range(steps):
            loss = model(torch.randn(4, 8), use_extra_head=False).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as error:
        return str(error)
    return None


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    error = train(DistributedDataParallel(TwoHeads()))
    # Fix 1: let DDP find the unused parameters at every step (a walk over the graph).
    found = train(DistributedDataParallel(TwoHeads(), find_unused_parameters=True))
    # Fix 2: a part that is never trained does not need gradients at all.
    frozen = TwoHeads()
    frozen.extra_head.requires_grad_(False)
    without_grad = train(DistributedDataParallel(frozen))
    named = [line for line in error.splitlines() if line.startswith("Parameters which")]
    record = {
        "rank": dist.get_rank(),
        "error": error.splitlines()[0],
        "names": named,
        "find_unused_parameters": found,
        "requires_grad_false": without_grad,
    }
    print(json.dumps(record), flush=True)
    # DDP's hooks keep each model, and with it the process group and gloo's last
    # finished work, alive until Python's final garbage collection. A gloo worker
    # thread that frees such work then needs Python, which is shutting down: the
    # process aborts ("terminate called without an active exception"), about one
    # run in ten on a loaded machine. Collect the models first, so that the group
    # ends here and its threads finish with it; the barrier keeps a rank from ending
    # the group while another is still in its last collective.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
