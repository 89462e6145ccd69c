"""What makes the template fast on GPUs, and how it measures its speed: the speed
settings (bf16, channels_last, cuDNN's autotuner, pinned memory, torch.compile), the
throughput log, and `--benchmark N`.
"""

import contextlib
import json
import time

import torch
import torch.distributed as dist
from torch import Tensor


def speed_settings(args, device: torch.device) -> dict:
    """Sets each speed setting that was left to its default (None) to what pays on this
    device: on for GPUs, off for CPUs. Returns them all, for the log."""
    cuda = device.type == "cuda"
    bf16_ok = cuda and torch.cuda.get_device_capability(device) >= (8, 0)
    if args.bf16 and not bf16_ok:
        raise SystemExit(
            "error: --bf16 asks for bf16 autocast, which needs a GPU of compute "
            "capability 8.0 or newer (A100, H100, RTX 30xx and later); this process "
            f"has {torch.cuda.get_device_name(device) if cuda else 'a CPU'}. Leave it "
            "out to train in fp32."
        )
    for name, default in [("bf16", bf16_ok), ("channels_last", cuda),
                          ("cudnn_benchmark", cuda), ("pin_memory", cuda),
                          ("compile", False)]:  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, default)
    # cuDNN times several algorithms for each new input shape, then keeps the fastest.
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    settings = ("bf16", "channels_last", "cudnn_benchmark", "pin_memory", "compile")
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return {"device": device_name, **{name: getattr(args, name) for name in settings}}


def memory_layout(inputs, args):
    """Images channels last in memory (NHWC), the layout of the GPU's convolutions, when
    channels_last is on; inputs that are not images (not 4-D) as they are."""
    if args.channels_last and isinstance(inputs, Tensor) and inputs.dim() == 4:
        return inputs.contiguous(memory_format=torch.channels_last)
    return inputs


class TrainLog:
    """The mean loss since the last log line, the samples per second, and the share of
    the time spent waiting for data. The losses stay on the device until a line is
    logged: a .item() at every step would make the CPU wait for the GPU."""

    def __init__(self, device: torch.device, samples_per_step: int):
        self.device, self.samples_per_step = device, samples_per_step
        self.total = torch.zeros((), device=device)
        self.steps = 0
        self.restart_clock()

    def restart_clock(self):
        self.started, self.data_wait = time.perf_counter(), 0.0

    def add(self, loss: Tensor):
        self.total += loss.detach()
        self.steps += 1

    @contextlib.contextmanager
    def waiting_for_data(self):
        begin = time.perf_counter()
        yield
        self.data_wait += time.perf_counter() - begin

    def report(self) -> dict:
        """The numbers since the last report, over all processes; starts anew."""
        # The GPU may still run steps that this process queued: time them too.
        synchronize(self.device)
        elapsed = time.perf_counter() - self.started
        rate, wait = (
            self.steps * self.samples_per_step / elapsed,
            self.data_wait / elapsed,
        )
        sums = torch.stack([self.total / self.steps, self.total.new_tensor(rate)])
        sums = torch.cat([sums, self.total.new_tensor([wait])])
        dist.all_reduce(sums)  # one collective per line, for all three
        loss, total_rate, wait = sums.tolist()
        world_size = dist.get_world_size()
        self.total.zero_()
        self.steps = 0
        self.restart_clock()
        return {
            "loss": loss / world_size,
            "samples_per_s": total_rate / world_size,
            "total_samples_per_s": total_rate,
            "data_wait": wait / world_size,
        }


def benchmark(model, optimizer, loader, args, place, to_device, forward_loss):
    """Prints one `benchmark:` line of JSON. `to_device` and `forward_loss` are
    main.py's."""
    device, n = next(model.parameters()).device, args.benchmark
    # Untimed: the workers start, and the batches they prefetch (two each) are taken,
    # so that the timed ones are those the workers make while they are timed.
    untimed = max(2 * loader.num_workers, 1)
    if len(loader) < untimed + n:
        raise SystemExit(
            f"error: --benchmark {n} times {n} batches after {untimed} untimed ones, "
            f"but the training set has {len(loader)} batches of {loader.batch_size}. "
            "Ask for fewer."
        )
    batches = iter(loader)
    for _ in range(untimed):
        inputs, target = to_device(next(batches), device)
    rates = {}
    synchronize(device)
    begin = time.perf_counter()
    for _ in range(n):
        to_device(next(batches), device)
    synchronize(device)
    rates["input_samples_per_s"] = n * loader.batch_size / (time.perf_counter() - begin)
    del batches
    model.train()
    for timed in (False, True):  # untimed first: the autotuner and compiling
        synchronize(device)
        begin = time.perf_counter()
        for _ in range(n if timed else 3):
            forward_loss(model, inputs, target, args).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        synchronize(device)
    rates["step_samples_per_s"] = n * loader.batch_size / (time.perf_counter() - begin)
    record = {**speed_settings(args, device), "num_workers": loader.num_workers}
    record.update(rates, rank=place.rank, world_size=place.world_size)
    for name in ("model", "image_size"):  # where your section has them
        record[name] = getattr(args, name, None)
    record["batch_size"] = args.batch_size
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(f"benchmark: {json.dumps(record)}", flush=True)


def synchronize(device: torch.device):
    """Waits for the GPU to finish the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
