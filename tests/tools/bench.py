"""Samples/s of the generic template (step 5), as each speed
setting is turned on in turn.

Each row runs `main.py --benchmark N` as a single process, with one more
setting than the row before, and reports two rates: the input pipeline alone
(DataLoader to GPU, no training), and the training step alone, on one batch
already on the GPU: the ceiling. Training runs at about the smaller of the
two. Rows of settings that this machine cannot use are left out: those for
GPUs without a GPU, and bf16 on GPUs older than compute capability 8.0.

    nox -s bench                  # ResNet-50 at 224 px, synthetic images
    nox -s bench -- --csv bench.csv -- --data-dir /path/to/imagenet
    python tests/tools/bench.py --steps 20 -- --model resnet18 --batch-size 64

Arguments after `--` go to main.py. With --data-dir, the input pipeline decodes and
augments your JPEGs, which is what it costs in training; synthetic images cost next to
nothing to make. Run it on a GPU node. Compute nodes often cannot reach the package
index: create the session's environment on a login node first
(`nox -s bench --install-only`), then reuse it in a job step,
`srun --ntasks=1 --gpus=1 --cpus-per-task=8 nox -R -s bench`, say.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "generic" / "template"

# The settings in the order the rows turn them on, each row
# keeping those above it: the arguments that turn it off, those
# that turn it on, and what it needs ("gpu", "bf16" or None).
SETTINGS = [
    ("DataLoader workers", ["--num-workers", "0"], [], None),
    ("pinned memory", ["--no-pin-memory"], [], "gpu"),
    ("channels_last", ["--no-channels-last"], [], "gpu"),
    ("cudnn.benchmark", ["--no-cudnn-benchmark"], [], "gpu"),
    ("bf16 autocast", ["--no-bf16"], ["--bf16"], "bf16"),
    ("torch.compile", [], ["--compile"], "gpu"),
]
# Variables that would make main.py take this process for one task of a launch.
LAUNCH_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def rows() -> list[tuple[str, list[str], str | None]]:
    """(label, main.py arguments, what it needs) of each
    row: everything off, then one more on."""
    table = []
    for k in range(len(SETTINGS) + 1):
        on = [arg for _, _, on_args, _ in SETTINGS[:k] for arg in on_args]
        off = [arg for _, off_args, _, _ in SETTINGS[k:] for arg in off_args]
        label = "everything off" if k == 0 else f"+ {SETTINGS[k - 1][0]}"
        table.append((label, on + off, SETTINGS[k - 1][3] if k > 0 else None))
    return table


def capabilities() -> set[str]:
    """What this machine offers the rows: "gpu", and "bf16"
    on compute capability 8.0 or newer."""
    import torch

    if os.environ.get("TRAIN_ON_CPU") == "1" or not torch.cuda.is_available():
        return set()
    return {"gpu", "bf16"} if torch.cuda.get_device_capability() >= (8, 0) else {"gpu"}


def run_row(settings: list[str], steps: int, main_args: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    command = [
        sys.executable,
        "main.py",
        "--benchmark",
        str(steps),
        *settings,
        *main_args,
    ]
    result = subprocess.run(
        command, cwd=EXAMPLE, env=env, capture_output=True, text=True
    )
    line = next(
        (ln for ln in result.stdout.splitlines() if ln.startswith("benchmark: ")), None
    )
    if result.returncode != 0 or line is None:
        sys.exit(f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
    return json.loads(line[len("benchmark: ") :])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=50, help="timed batches per measurement"
    )
    parser.add_argument("--csv", type=Path, help="also write the table to this file")
    parser.add_argument("main_args", nargs="*", help="arguments for main.py, after --")
    args = parser.parse_args()
    main_args = args.main_args
    if "--data-dir" not in main_args and "--synthetic-data" not in main_args:
        main_args = ["--synthetic-data", *main_args]

    has = capabilities()
    gpu = "gpu" in has
    records = []
    for label, settings, needs in rows():
        if needs is not None and needs not in has:
            continue
        record = run_row(settings, args.steps, main_args)
        record["setting"] = label
        records.append(record)
        print(f"{label}: {json.dumps(record)}", file=sys.stderr, flush=True)

    import torch

    first = records[0]
    print(
        f"{first['model']}, {first['image_size']} px, batch {first['batch_size']}, "
        f"{first['device']}, torch {torch.__version__}, CUDA {torch.version.cuda}"
        + ("" if gpu else "; no GPU: the GPU-only rows are left out")
        + (
            ""
            if not gpu or "bf16" in has
            else "; no bf16 on this GPU: its row is left out"
        )
    )
    columns = ["setting", "num_workers", "input_samples_per_s", "step_samples_per_s"]
    if gpu:
        columns.append("peak_memory_gib")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for record in records:
        cells = [
            f"{record[c]:.1f}" if isinstance(record[c], float) else str(record[c])
            for c in columns
        ]
        print("| " + " | ".join(cells) + " |")
    if args.csv:
        with args.csv.open("w", newline="") as f:
            fields = ["setting", *sorted(records[0].keys() - {"setting"})]
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
