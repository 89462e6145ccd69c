"""The Slurm test cluster as a ReFrame site file (checks/site_template.py says what
each setting means), for `reframe -C tests/sites/reframe_site.py -c checks/ -r`.

Each environment stands for a site: its jobs read that site's profile
(tests/sites/<site>/profile.sh) through BASH_ENV, as the tests' own submissions do
(slurm_lab.Lab.env), and each example's short run is its smoke run
(tests/helpers/smoke.py), so that the Slurm tests can read the jobs of this run.
"""

import sys
from pathlib import Path

SITES = Path(__file__).resolve().parent
sys.path.insert(0, str(SITES.parent / "helpers"))  # smoke.py

from smoke import EXAMPLES  # noqa: E402


def environment(site: str) -> dict:
    return {
        "name": site,
        "features": [f"ddp-{site}"],
        "env_vars": [
            ["BASH_ENV", str(SITES / site / "profile.sh")],
            # The Python that the profile's `conda activate` puts first on PATH: the
            # one running reframe, which has the examples' dependencies.
            ["LAB_PYTHON_BIN", str(Path(sys.executable).parent)],
            ["OMP_NUM_THREADS", "1"],
        ],
    }


# The smoke run of each example, the validation set it makes, for mp.spawn the
# processes it starts (its smoke run's --nprocs 2, not one per GPU of job.sh), and how
# often it logs the loss: at 8 processes, some smoke runs take one step an epoch, and
# log it once.
RUNS = {
    name: {
        "args": list(launch.args),
        "val_samples": launch.val_samples,
        "ranks": launch.world_size if launch.launcher == "python" else None,
        "losses_logged": 1,
    }
    for name, launch in EXAMPLES.items()
}

site_configuration = {
    "systems": [
        {
            "name": "lab",
            "descr": "the Slurm test cluster of tests/helpers/slurm_lab.py",
            "hostnames": [".*"],
            "modules_system": "nomod",
            "partitions": [
                {
                    "name": "nodes",
                    "descr": "cn1 and cn2",
                    # The test cluster keeps no accounting database.
                    "scheduler": "squeue",
                    "launcher": "local",
                    "environs": ["generic", "mila", "ibex"],
                    "max_jobs": 4,
                    "extras": {"ddp_runs": RUNS},
                }
            ],
        }
    ],
    "environments": [environment(site) for site in ["generic", "mila", "ibex"]],
    # Jobs of seconds: look at the queue twice a second, not every 10 s at most.
    "general": [{"poll_rate_min": 2}],
}
