"""Data that a resumed run reads in the order that the interrupted run would have: the
sampler starts an epoch part-way, and each sample's random draws come from a seed of
its own. The DataLoader workers' fork server starts with the stop signals blocked.

The guide keeps one source of this file, examples/shared/resumable_data.py, and
copies it into every example that uses it (`nox -s copies`): edit that one.
"""

import itertools
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import random
import signal

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler


def start_fork_server():
    """Starts the fork server of the DataLoader workers with the stop signals blocked:
    Slurm signals every process of a step, and a worker killed by one would fail this
    process before it could save."""
    stop_signals = {signal.SIGTERM, signal.SIGUSR1}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        # The fork server needs multiprocessing's resource tracker, whose start unblocks
        # SIGTERM again: start the tracker first, then block once more.
        multiprocessing.resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)


class SeededSamples(Dataset):
    """The training set, each sample's random draws (torch's and Python's, as
    torchvision's transforms make) seeded by the run's seed, the epoch and the index
    alone: a resumed run's new workers make the very same batches. (Seed numpy's global
    generator here too if your transforms draw from it.)"""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key  # from ResumableSampler
        # A tuple of whole numbers hashes to the same number in every process and run.
        seed = hash((self.seed, epoch, index))
        python_state = random.getstate()
        # Training's own random numbers stay as they were: with num_workers 0, this runs
        # in the training process.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            try:
                return self.dataset[index]
            finally:
                random.setstate(python_state)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way: it skips the samples
    that the interrupted run already trained on, in the epoch's same order."""

    skip = 0

    def __iter__(self):
        # Each index with its epoch, for SeededSamples.
        indices = itertools.islice(super().__iter__(), self.skip, None)
        return ((self.epoch, index) for index in indices)

    def __len__(self):
        return max(self.num_samples - self.skip, 0)
