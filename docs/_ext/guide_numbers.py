"""The numbers on the pages that the guide's own files decide, computed from them.

docs/conf.py hands these to MyST as substitutions: a page writes {{ generic_checks }}
where it states how many checks ReFrame lists, and the number follows the files. The
tests hold each value to what it counts (tests/test_checks.py: the checks that ReFrame
really lists, and the GPUs of their job.sh files), show that it follows a change to the
files, and fail where a page writes one of these numbers by hand (tests/test_claims.py).
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def job_scripts(root: Path) -> dict[str, str]:
    """Every example's job.sh, by its folder under examples/ ("generic/fsdp")."""
    examples = root / "examples"
    return {
        str(p.parent.relative_to(examples)): p.read_text()
        for p in sorted(examples.glob("*/*/job.sh"))
    }


def asked(job_sh: str) -> tuple[int, int]:
    """The nodes a job.sh asks for, and the GPUs on each. Only --gpus-per-node is
    understood: a job.sh that asks for GPUs in another way (--gres, --gpus-per-task)
    or not at all stops the build, rather than be counted wrong."""
    nodes = re.search(r"^#SBATCH\s+--nodes=(\d+)", job_sh, re.M)
    gpus = re.search(r"^#SBATCH\s+--gpus-per-node=(?:\w+:)?(\d+)\s*$", job_sh, re.M)
    other = re.search(r"^#SBATCH\s+--(gres=\S*gpu|gpus-per-task)", job_sh, re.M)
    if gpus is None or other is not None:
        first = job_sh.splitlines()[:3]
        raise ValueError(
            f"a job.sh that asks for GPUs other than by --gpus-per-node: {first}"
        )
    return (int(nodes[1]) if nodes else 1), int(gpus[1])


def generic_checks(root: Path) -> list[str]:
    """The example each ReFrame check of the ddp-generic environment submits: one per
    folder of examples/generic and examples/launchers, and StagedDataJob's run of the
    template (checks/examples.py)."""
    folders = [n for n in job_scripts(root) if n.startswith(("generic/", "launchers/"))]
    return [*folders, "generic/template"]


def numbers(root: Path = ROOT) -> dict[str, str]:
    scripts = job_scripts(root)
    checks = generic_checks(root)
    gpus = [asked(scripts[name]) for name in checks]
    largest = max(gpus, key=lambda g: g[0] * g[1])
    return {
        "example_folders": str(len(scripts)),
        "generic_checks": str(len(checks)),
        "generic_check_gpus": str(sum(n * g for n, g in gpus)),
        "largest_check_gpus": str(largest[0] * largest[1]),
        "largest_check_nodes": str(largest[0]),
    }


if __name__ == "__main__":
    for name, value in numbers().items():
        print(f"{name} = {value}")
