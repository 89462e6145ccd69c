"""Lightning as its own documentation starts it on Slurm: `srun python main.py`, and
the Trainer forms the process group itself, meeting rank 0 at MASTER_ADDR, the job's
first node. A tiny model on random numbers: only the meeting matters here.

`python main.py SECONDS STEPS FOLDER`: give up the meeting after SECONDS (Lightning's
default is 30 minutes), train STEPS steps, keep Lightning's files in FOLDER.
tests/test_frameworks.py runs it where Slurm 26.05 puts rank 0 on another node than
the first, to show the hang that launchers/lightning avoids, and with a SIGTERM, to
show what Lightning's own Slurm support does with it."""

import os
import sys
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        inputs, target = batch
        return torch.nn.functional.mse_loss(self.layer(inputs), target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    seconds, steps, folder = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["SLURM_NTASKS_PER_NODE"]),
        num_nodes=int(os.environ["SLURM_NNODES"]),
        strategy=DDPStrategy(timeout=timedelta(seconds=seconds)),
        max_steps=steps,
        max_epochs=-1,
        default_root_dir=folder,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    print(f"trained: rank {trainer.global_rank} on {os.uname().nodename}", flush=True)
