"""ReFrame checks of the guide's examples: each job.sh, submitted as a reader copies it.

One check per example folder (examples/<site>/<name>/job.sh). Each one copies the
folder, keeps the #SBATCH lines of job.sh (but its job name and time limit, which the
check sets) and runs `bash job.sh` with a short run's arguments inside the allocation,
so that job.sh starts its own processes as it does for a reader. The site file
(site_template.py) adds the partition, account and environment.

Sanity: every rank printed its summary, the loss is finite and falls, the validation
counted every sample once, and the ranks agree. Performance: samples/s per GPU for the
examples that log it (the template and FSDP2), bus bandwidth for the fabric check.

    reframe -C site.py -c checks/ -r
"""

import json
import math
import re
from pathlib import Path

import reframe as rfm
from reframe.core.backends import getlauncher
from reframe.core.builtins import (
    parameter,
    performance_function,
    run_after,
    run_before,
    sanity_function,
    variable,
)
from reframe.core.exceptions import SanityError

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = sorted(
    str(p.parent.relative_to(EXAMPLES_DIR)) for p in EXAMPLES_DIR.glob("*/*/job.sh")
)

# A short run of each example on synthetic data, long enough for a speed reading, and
# the size of the validation set those arguments make (main.py's make_datasets()).
# A site file can set others (extras "ddp_runs", see site_template.py).
# With job.sh's 8 GPUs, an epoch of 51200 images is 50 steps of 128 images per GPU: the
# loss is logged 5 times.
IMAGES = "--synthetic-data", "--epochs", "1", "--max-steps", "100", "--log-every", "10"
SHORT_RUNS = {
    "generic": {"args": [*IMAGES, "--synthetic-size", "51200"], "val_samples": 1024},
    "launchers": {"args": [*IMAGES, "--synthetic-size", "51200"], "val_samples": 1024},
    "ibex": {"args": [*IMAGES, "--synthetic-size", "51200"], "val_samples": 1024},
    # Mila's main.py holds out 10% of the set for validation.
    "mila": {"args": [*IMAGES, "--synthetic-size", "50000"], "val_samples": 5000},
    "generic/fsdp": {"args": [*IMAGES, "--synthetic-size", "8192"], "val_samples": 819},
    "generic/fabric": {"args": [], "val_samples": None},
}
# Sites whose examples need that site's environment (modules, conda, data paths); the
# launcher variants are generic.
SITE_OF = {"launchers": "generic"}


def job_sh_options(text: str) -> list[str]:
    """job.sh's #SBATCH lines, as they are, but for the job name and time limit."""
    return [
        line
        for line in text.splitlines()
        if line.startswith("#SBATCH")
        and not re.match(r"#SBATCH\s+--(job-name|time)\b", line)
    ]


def ranks_asked(text: str) -> int:
    """The processes job.sh starts: one per GPU it asks for, on every node."""
    nodes = re.search(r"^#SBATCH\s+--nodes=(\d+)", text, re.M)
    gpus = re.search(r"^#SBATCH\s+--gpus-per-node=(?:\w+:)?(\d+)", text, re.M)
    return (int(nodes[1]) if nodes else 1) * (int(gpus[1]) if gpus else 1)


def summaries(output: str) -> list[dict]:
    """The `summary: {...}` records that the processes print, sorted by rank."""
    decoder, found = json.JSONDecoder(), []
    for match in re.finditer("summary: ", output):
        try:
            found.append(decoder.raw_decode(output, match.end())[0])
        except json.JSONDecodeError:
            continue
    return sorted(found, key=lambda s: s.get("rank", 0))


def problems(
    output: str, ranks: int, val_samples: int | None, losses_logged: int = 2
) -> list[str]:
    """What is wrong with a run's output; an empty list when nothing is. The loss must
    fall from the first log line to the last, and be logged `losses_logged` times or
    more: the first and last log lines are one where it is logged once."""
    found = summaries(output)
    seen = [s.get("rank", 0) for s in found]
    if seen != list(range(ranks)):
        return [f"summaries from ranks {seen}, expected 0 to {ranks - 1}"]
    wrong = []
    logged = len(re.findall(r"step \d+ \| loss ", output))
    if "first_loss" in found[0] and logged < losses_logged:
        wrong.append(
            f"the loss was logged on {logged} line(s), fewer than {losses_logged}: "
            "too few to see it fall; give the run more steps (ddp_runs, site file)"
        )
    for s in found:
        rank = s.get("rank", 0)
        if s.get("world_size", ranks) != ranks:
            wrong.append(f"rank {rank}: world size {s['world_size']}, not {ranks}")
        losses = [s.get(k) for k in ("first_loss", "last_loss", "val_loss")]
        if "first_loss" in s and not all(
            isinstance(x, float) and math.isfinite(x) for x in losses
        ):
            wrong.append(f"rank {rank}: a loss is not a finite number: {losses}")
        elif logged > 1 and not s["last_loss"] < s["first_loss"]:
            wrong.append(
                f"rank {rank}: the loss did not fall: "
                f"{s['first_loss']} then {s['last_loss']}"
            )
        if val_samples is not None and s.get("val_samples") != val_samples:
            wrong.append(
                f"rank {rank}: validation counted {s.get('val_samples')} samples, "
                f"not {val_samples}"
            )
        for r in s.get("results", []):  # the fabric check's timings
            if ranks > 1 and not (
                math.isfinite(r["busbw_gbps"]) and r["busbw_gbps"] > 0
            ):
                wrong.append(f"rank {rank}: bus bandwidth {r['busbw_gbps']} at {r}")
    numbers = [{k: v for k, v in s.items() if k not in ("rank", "host")} for s in found]
    if any(n != numbers[0] for n in numbers):
        wrong.append(f"the ranks disagree: {numbers}")
    return wrong


def network_problems(output: str, network: str) -> list[str]:
    """With NCCL_DEBUG=INFO, whether the connections between nodes went over
    `network` (NCCL's name for it: IB, or Socket). "IB" also takes the IBext
    plugins: NCCL prints `via NET/IBext_v8/...` for them."""
    used = sorted(set(re.findall(r"via NET/([A-Za-z]+)", output)))
    if not used:
        return [f"no NCCL line `via NET/{network}`: is NCCL_DEBUG=INFO set?"]
    if any(not name.startswith(network) for name in used):
        return [f"NCCL connected the nodes over {used}, not only {network}"]
    return []


@rfm.simple_test
class ExampleJob(rfm.RunOnlyRegressionTest):
    """An example's job.sh, run as a reader runs it, on a short run."""

    example = parameter(EXAMPLES)
    valid_systems = ["*"]
    num_tasks = None  # the tasks are job.sh's own #SBATCH lines
    time_limit = "15m"
    executable = "bash"
    tags = {"ddp-guide"}
    # NCCL's name for the network the nodes must use ("IB"); empty: not checked.
    # Set by the partition's extras (site_template.py), or `-S nccl_network=IB`.
    nccl_network = variable(str, value="")

    @run_after("init")
    def use_the_examples_site(self):
        site = self.example.split("/")[0]
        # An environment of the site file serves the examples of the sites its
        # "features" name: ddp-generic, ddp-mila, ddp-ibex.
        self.valid_prog_environs = [f"+ddp-{SITE_OF.get(site, site)}"]
        self.sourcesdir = str(EXAMPLES_DIR / self.example)
        self.descr = f"examples/{self.example}/job.sh"
        if self.example == "generic/fabric":
            self.perf_variables = {"busbw": self.busbw()}
        elif self.example in ("generic/template", "generic/fsdp"):
            self.perf_variables = {"samples_per_s_per_gpu": self.samples_per_s()}
        else:  # the steps are lessons: they log no speed
            self.perf_variables = {}

    @property
    def run_settings(self) -> dict:
        site_runs = self.current_partition.extras.get("ddp_runs", {})
        site = self.example.split("/")[0]
        for key in (self.example, site):
            if key in site_runs:
                return site_runs[key]
        return SHORT_RUNS.get(self.example, SHORT_RUNS[site])

    @run_before("run")
    def submit_job_sh(self):
        text = (EXAMPLES_DIR / self.example / "job.sh").read_text()
        self.job.options += job_sh_options(text)
        # job.sh starts the processes itself (srun, torchrun): the batch script
        # runs it once, as sbatch would.
        self.job.launcher = getlauncher("local")()
        args = list(self.run_settings["args"])
        if "--checkpoint-dir" in (EXAMPLES_DIR / self.example / "main.py").read_text():
            # A fresh folder: a second run of the checks must not resume the first.
            args += ["--checkpoint-dir", f"{self.stagedir}/checkpoints"]
        self.executable_opts = ["job.sh", *args]
        self.nccl_network = self.nccl_network or self.current_partition.extras.get(
            "ddp_nccl_network", ""
        )

    @run_before("performance")
    def set_references(self):
        references = self.current_partition.extras.get("ddp_references", {})
        self.reference = {"*": references.get(self.example, {})}

    def output(self) -> str:
        """The job's stdout and stderr: main.py logs to stderr."""
        stage = Path(self.stagedir)
        return "".join(
            (stage / name).read_text(errors="replace")
            for name in (self.job.stdout, self.job.stderr)
            if (stage / name).exists()
        )

    @sanity_function
    def every_rank_trained_and_agrees(self):
        settings = self.run_settings
        ranks = settings.get("ranks") or ranks_asked(
            (EXAMPLES_DIR / self.example / "job.sh").read_text()
        )
        output = self.output()
        wrong = problems(
            output, ranks, settings.get("val_samples"), settings.get("losses_logged", 2)
        )
        if self.example == "generic/fabric" and self.nccl_network:
            wrong += network_problems(output, self.nccl_network)
        if wrong:
            raise SanityError("; ".join(wrong))
        return True

    @performance_function("samples/s")
    def samples_per_s(self):
        """The last log line's samples/s per process: one process per GPU."""
        rates = re.findall(r"([\d.]+) samples/s per process", self.output())
        return float(rates[-1])

    @performance_function("GB/s")
    def busbw(self):
        """Rank 0's bus bandwidth at the largest message size."""
        return summaries(self.output())[0]["results"][-1]["busbw_gbps"]
