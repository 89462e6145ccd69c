"""Collectives that go wrong on purpose, for the triage tests: one rank stuck outside
a collective (`--stuck`), or ranks calling different collectives (`--mismatch`)."""

import argparse
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stuck", action="store_true")
    parser.add_argument("--mismatch", action="store_true")
    parser.add_argument("--heartbeat", type=Path, help="where the stuck rank counts")
    args = parser.parse_args()
    rank, world_size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    serves = os.environ["SLURM_NODEID"] == "0" and os.environ["SLURM_LOCALID"] == "0"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=serves, timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    total = torch.ones(1)
    dist.all_reduce(total)
    host = os.uname().nodename
    print(f"rank {rank} on {host}: ready, {int(total)} ranks", flush=True)
    if args.stuck and rank == 1:
        load_batch(args.heartbeat)
    if args.mismatch and rank == 1:
        dist.broadcast(total, src=0)
    else:
        dist.all_reduce(total)
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


def load_batch(heartbeat: Path):
    """Stands for a rank that never reaches the next collective: a read from a file
    system that does not answer, a deadlock in a DataLoader worker. It counts in
    `heartbeat`, so that a test can see it still runs."""
    beats = 0
    while True:
        beats += 1
        # Whole, by a rename: write_text() empties the file first, and a read in
        # between would find it empty.
        heartbeat.with_suffix(".tmp").write_text(str(beats))
        heartbeat.with_suffix(".tmp").replace(heartbeat)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
