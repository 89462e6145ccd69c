"""A table of a sweep's runs: one row per checkpoint folder, from its newest checkpoint,
with the settings that differ between the runs (those that shape training: not the
folders, nor how often a run logs) and where each run stands.

    python summaries.py $SCRATCH/checkpoints/lr-sweep/task-*

A run still training shows its last save; `finished` says which runs are done.
"""

import sys
from pathlib import Path

import torch

RESULTS = ["epoch", "steps", "val_loss", "val_accuracy"]


def newest(folder: Path) -> dict | None:
    """The newest readable checkpoint's settings, arguments and progress; None if the
    folder has none. A run still training may be writing or deleting one meanwhile."""
    for path in sorted(folder.glob("step-*.pt"), reverse=True):
        try:
            # mmap: the tensors stay on disk; only the small records are read.
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except (OSError, RuntimeError, EOFError):
            continue
        return {key: state[key] for key in ("settings", "arguments", "progress")}
    return None


def table(folders: list[Path]) -> list[list[str]]:
    runs = {folder: newest(folder) for folder in folders}
    found = {folder: run for folder, run in runs.items() if run is not None}
    names = sorted(set().union(*(run["settings"] for run in found.values())))
    differ = [
        name
        for name in names
        if len({str(run["settings"].get(name)) for run in found.values()}) > 1
    ]
    rows = [["run", *differ, *RESULTS, "finished"]]
    for folder, run in runs.items():
        if run is None:
            rows.append([folder.name, *["-"] * (len(rows[0]) - 1)])
            continue
        arguments, progress = run["arguments"], run["progress"]
        # As main.py's finished(): all --train-steps done, or else all --epochs.
        if steps := arguments.get("train_steps"):
            finished = progress["steps"] >= steps
        else:
            finished = progress["epoch"] >= arguments["epochs"]
        values = [run["settings"].get(name) for name in differ]
        values += [progress[name] for name in RESULTS]
        rows.append([folder.name, *map(text, values), str(finished)])
    return rows


def text(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    folders = [Path(name) for name in sys.argv[1:]]
    if missing := [str(folder) for folder in folders if not folder.is_dir()]:
        sys.exit(f"error: no such folder: {', '.join(missing)}")
    rows = table(folders)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(
                cell.ljust(width) for cell, width in zip(row, widths, strict=True)
            )
        )
