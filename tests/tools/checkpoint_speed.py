"""How long a checkpoint takes to save and to load, on this machine's disk.

Times the examples' own code, in one process: the FSDP2 step's Checkpoint (DCP, one
folder of shards, written in a thread from a copy in CPU memory, then renamed) and the
DDP steps' save_atomically() and mmap load (one file, written by rank 0), for the FSDP2
model at its default size and at a larger one, with AdamW's state after one step. Each
row gives the checkpoint's size and the seconds per GiB; the guide's pages quote them,
labelled with the machine they were measured on.

    python tests/tools/checkpoint_speed.py         # both sizes, in ./checkpoint-speed
    python tests/tools/checkpoint_speed.py --folder /scratch/me/speed --sizes default

Run it on the storage your checkpoints go to: a parallel file system differs from a
local disk by far more than one machine does from another.
"""

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# The helpers (smoke.py and the rest) sit in tests/helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from smoke import load_main  # noqa: E402

# The FSDP2 step's model sizes: its defaults (about 34 M parameters), a larger one, and
# a tiny one (the test that keeps this script working: tests/test_tools.py).
SIZES = {
    "default": [],
    "larger": [
        "--dim",
        "1024",
        "--layers",
        "24",
        "--heads",
        "16",
        "--vocab-size",
        "32768",
    ],
    "tiny": [
        "--dim",
        "64",
        "--layers",
        "2",
        "--heads",
        "2",
        "--vocab-size",
        "512",
        "--seq-len",
        "32",
    ],  # fmt: skip
}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folder", type=Path, default=Path("checkpoint-speed"))
    parser.add_argument(
        "--sizes", nargs="+", choices=list(SIZES), default=["default", "larger"]
    )
    options = parser.parse_args()
    os.environ.setdefault("TRAIN_ON_CPU", "1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    logging.basicConfig(level=logging.WARNING)
    fsdp = load_main("generic/fsdp")
    ddp = load_main("generic/checkpointing", "checkpoint_files.py")
    for size in options.sizes:
        folder = options.folder / size
        shutil.rmtree(folder, ignore_errors=True)
        args = fsdp.parse_args(["--synthetic-data", "--checkpoint-dir", str(folder),
                                "--keep-checkpoints", "1", *SIZES[size]])  # fmt: skip
        args.batch_size, args.accumulation_steps = 1, 1
        device = torch.device("cpu")
        model, optimizer, scheduler, progress, train_log = parts(fsdp, args, device)
        checkpoint = fsdp.Checkpoint(args)
        begin = time.perf_counter()
        checkpoint.save(model, optimizer, scheduler, progress, train_log)
        dcp_save = time.perf_counter() - begin
        [path] = fsdp.checkpoints(folder)
        gib = sum(f.stat().st_size for f in path.iterdir()) / 2**30
        drop_caches()
        model, optimizer, scheduler, progress, train_log = parts(fsdp, args, device)
        begin = time.perf_counter()
        checkpoint.load(model, optimizer, scheduler, progress, train_log)
        dcp_load = time.perf_counter() - begin

        # The same weights and optimizer state as one file, as the DDP steps write it.
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        state = {
            key: {name: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                  for name, v in value.items()} if key == "model" else value
            for key, value in state.items()
        }  # fmt: skip
        file = folder / "step-00000001.pt"
        begin = time.perf_counter()
        ddp.save_atomically(state, file)
        file_save = time.perf_counter() - begin
        file_gib = file.stat().st_size / 2**30
        # Loaded as the DDP steps load it, each tensor copied into the model's and the
        # optimizer's own, as load_state_dict() copies it.
        targets = [torch.empty_like(t) for t in tensors(state)]
        drop_caches()
        begin = time.perf_counter()
        loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        for target, tensor in zip(targets, tensors(loaded), strict=True):
            target.copy_(tensor)
        file_load = time.perf_counter() - begin
        row = {
            "size": size, "parameters": sum(p.numel() for p in model.parameters()),
            "dcp_gib": round(gib, 3), "dcp_save_s": round(dcp_save, 2),
            "dcp_load_s": round(dcp_load, 2),
            "dcp_save_s_per_gib": round(dcp_save / gib, 2),
            "dcp_load_s_per_gib": round(dcp_load / gib, 2),
            "file_gib": round(file_gib, 3), "file_save_s": round(file_save, 2),
            "file_load_s": round(file_load, 2),
            "file_save_s_per_gib": round(file_save / file_gib, 2),
        }  # fmt: skip
        print(f"checkpoint: {json.dumps(row)}", flush=True)
        shutil.rmtree(folder)
    dist.destroy_process_group()


def parts(fsdp, args, device):
    """The FSDP2 step's model, sharded over this one process, with AdamW's state
    after one step, and what its Checkpoint saves besides."""
    with torch.device("meta"):
        model = fsdp.build_model(args, args.vocab_size)
    model = fsdp.shard_model(model, device, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(args.vocab_size, (1, args.seq_len + 1))
    fsdp.loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler = fsdp.make_scheduler(args, optimizer, 100)
    return (
        model,
        optimizer,
        scheduler,
        fsdp.Progress(steps=1),
        fsdp.TrainLog(device, args),
    )


def tensors(state):
    """Every tensor in a nest of dicts and lists, in order."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from tensors(value)
    elif isinstance(state, list | tuple):
        for value in state:
            yield from tensors(value)


def drop_caches():
    """Empties the page cache, where root may, so that a load reads the disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        print("(not root: loads may come from the page cache)")


if __name__ == "__main__":
    main()
