"""ReFrame checks of the guide's examples: each job.sh, submitted as a reader copies it.

One check per example folder (examples/<cluster>/<name>/job.sh): ExampleJob, and
FabricCheck for the fabric check, whose speeds have their own performance log. Their
runs train on synthetic data: StagedDataJob runs the template's copy of a dataset to
every node, on a small archive of images that it makes. Each
one copies the folder and keeps the #SBATCH lines of job.sh, except the job name, the
time limit and the dependency, which the check sets. It runs `bash job.sh` with a short
run's arguments inside the allocation: job.sh starts its own processes as it does for a
reader. The site file (a copy of site_template.py) adds the partition and account, and
picks the examples to run.

Sanity: job.sh exited with status 0; every rank printed its summary, on the nodes and
in the number job.sh asks for; the loss is finite and falls; the validation counted
every sample once; the ranks agree. Performance: samples/s per GPU for the examples
that log it (the template example and FSDP2), bus bandwidth for the fabric check.

    reframe -C site.py -c checks/ -r
"""

import io
import json
import math
import random
import re
import tarfile
from collections import Counter
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
FABRIC = "generic/fabric"
# The examples whose speed the checks read, with the nodes to themselves (--exclusive).
TIMED = ("generic/template", "generic/fsdp", FABRIC)

# A short run of each example on synthetic data, long enough for a speed reading, and
# the size of the validation set those arguments make (main.py's make_datasets()).
# A site file can set others (extras "ddp_runs", see site_template.py). With job.sh's
# 8 GPUs of 128 images each, 102400 images are 100 steps: the loss is logged 4 times.
# A short warm-up, so that the learning rate reaches its peak within the run.
IMAGES = (
    "--synthetic-data", "--epochs", "1", "--max-steps", "100", "--log-every", "25",
    "--warmup-steps", "5",
)  # fmt: skip
SHORT_RUNS = {
    "generic": {"args": [*IMAGES, "--synthetic-size", "102400"], "val_samples": 2048},
    "launchers": {"args": [*IMAGES, "--synthetic-size", "102400"], "val_samples": 2048},
    "ibex": {"args": [*IMAGES, "--synthetic-size", "102400"], "val_samples": 2048},
    # Mila's main.py holds out 10% of the set for validation.
    "mila": {"args": [*IMAGES, "--synthetic-size", "120000"], "val_samples": 12000},
    # Global batches of 256 sequences, 32 a GPU: a speed of throughput, not latency.
    "generic/fsdp": {
        "args": [
            *IMAGES,
            "--synthetic-size",
            "32768",
            "--global-batch-size",
            "256",
            "--log-every",
            "10",
        ],
        "val_samples": 3276,
    },  # fmt: skip
    FABRIC: {"args": [], "val_samples": None},
}
# StagedDataJob's run: the template on a small image archive that the check makes,
# 5 classes of 40 training and 8 validation images of 32x32 pixels, 2 epochs.
STAGED_CLASSES, STAGED_TRAIN, STAGED_VAL, STAGED_SIZE = 5, 40, 8, 32
STAGED_RUN = {
    "args": [
        "--model", "resnet18", "--image-size", "32", "--batch-size", "4",
        "--epochs", "2", "--warmup-steps", "2", "--log-every", "2",
        "--num-workers", "1",
    ],
    "val_samples": STAGED_CLASSES * STAGED_VAL,
}  # fmt: skip
# Clusters whose examples need that cluster's environment (modules, conda, data paths);
# the launcher variants are generic.
SITE_OF = {"launchers": "generic"}


def job_sh_options(text: str) -> list[str]:
    """job.sh's #SBATCH options, but for the job name, the time limit and the
    dependency (job.sh's singleton would queue a run of the checks behind another)."""
    return [
        line.removeprefix("#SBATCH").strip()
        for line in text.splitlines()
        if line.startswith("#SBATCH")
        and not re.match(r"#SBATCH\s+--(job-name|time|dependency)\b", line)
    ]


def asked(text: str) -> tuple[int, int]:
    """The nodes job.sh asks for, and the processes it starts on each: one per GPU."""
    nodes = re.search(r"^#SBATCH\s+--nodes=(\d+)", text, re.M)
    gpus = re.search(r"^#SBATCH\s+--gpus-per-node=(?:\w+:)?(\d+)", text, re.M)
    return (int(nodes[1]) if nodes else 1), (int(gpus[1]) if gpus else 1)


def summaries(output: str) -> list[dict]:
    """The `summary: {...}` records that the processes print, sorted by rank."""
    decoder, found = json.JSONDecoder(), []
    for match in re.finditer("summary: ", output):
        try:
            found.append(decoder.raw_decode(output, match.end())[0])
        except json.JSONDecodeError:
            continue
    return sorted(found, key=lambda s: s.get("rank", 0))


def exit_problems(output: str) -> list[str]:
    """Whether job.sh ended, with status 0: the line the check's batch script prints
    after it (a job that reached its time limit prints none)."""
    status = re.findall(r"^job.sh exit status: (\d+)$", output, re.M)
    if not status:
        return ["job.sh did not end: it reached the time limit, or was killed"]
    if status[-1] != "0":
        return [f"job.sh exited with status {status[-1]}"]
    return []


def problems(
    output: str, ranks: int, val_samples: int | None, nodes: int = 1, losses_logged=2
) -> list[str]:
    """What is wrong with a run's output; an empty list when nothing is.

    The ranks must run on `nodes` nodes, as many on each. The loss must fall from the
    first log line to the last, and be logged `losses_logged` times or more: the first
    and last log lines are one where it is logged once.
    """
    found = summaries(output)
    seen = [s.get("rank", 0) for s in found]
    if seen != list(range(ranks)):
        return [f"summaries from ranks {seen}, expected 0 to {ranks - 1}"]
    wrong = []
    per_host = Counter(s.get("host") for s in found)
    if len(per_host) != nodes or len(set(per_host.values())) != 1:
        wrong.append(f"ranks per node {dict(per_host)}, expected {nodes} alike")
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
    `network`, NCCL's name for it as its `via NET/<name>/...` lines print it: IB (for
    InfiniBand and RoCE), Socket, or a plugin's, such as "AWS Libfabric". "IB" also
    takes the IBext plugins (`via NET/IBext_v8/...`)."""
    used = sorted(set(re.findall(r"via NET/([^/\n]+)/", output)))
    if not used:
        return [f"no NCCL line `via NET/{network}`: is NCCL_DEBUG=INFO set?"]
    if any(not name.startswith(network) for name in used):
        return [f"NCCL connected the nodes over {used}, not only {network}"]
    return []


class JobSh(rfm.RunOnlyRegressionTest):
    """An example's job.sh, run as a reader runs it, on a short run."""

    valid_systems = ["*"]
    num_tasks = None  # the tasks are job.sh's own #SBATCH lines
    time_limit = "15m"
    executable = "bash"
    # The batch script runs no `set -e`: this line follows job.sh whatever its end.
    postrun_cmds = ['echo "job.sh exit status: $?"']
    tags = {"ddp-guide"}
    # NCCL's name for the network the nodes must use ("IB"); empty: not checked.
    # Set by the partition's extras (site_template.py), or `-S nccl_network=IB`.
    nccl_network = variable(str, value="")

    @run_after("init")
    def use_the_examples_cluster(self):
        cluster = self.example.split("/")[0]
        # An environment of the site file serves the examples of the clusters its
        # "features" name: ddp-generic, ddp-mila, ddp-ibex.
        self.valid_prog_environs = [f"+ddp-{SITE_OF.get(cluster, cluster)}"]
        self.sourcesdir = str(EXAMPLES_DIR / self.example)
        self.descr = f"examples/{self.example}/job.sh"
        # A speed reading needs the nodes to itself: no other job on its GPUs and
        # network adapters.
        self.exclusive_access = self.example in TIMED
        if self.example == FABRIC:
            self.perf_variables = {"busbw": self.busbw()}
        elif self.example in TIMED:
            self.perf_variables = {"samples_per_s_per_gpu": self.samples_per_s()}
        else:  # the steps are lessons: they log no speed
            self.perf_variables = {}

    @property
    def run_settings(self) -> dict:
        site_runs = self.current_partition.extras.get("ddp_runs", {})
        cluster = self.example.split("/")[0]
        for key in (self.example, cluster):
            if key in site_runs:
                return site_runs[key]
        return SHORT_RUNS.get(self.example, SHORT_RUNS[cluster])

    @run_before("run")
    def submit_job_sh(self):
        text = (EXAMPLES_DIR / self.example / "job.sh").read_text()
        # After the site's access options: where both set one, job.sh's wins.
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
        mine = references.get(self.example, {})
        unknown = set(mine) - set(self.perf_variables)
        if unknown:
            raise ValueError(
                f"ddp_references[{self.example!r}] names {sorted(unknown)}; "
                f"its speeds are {sorted(self.perf_variables)}"
            )
        self.reference = {"*": mine}

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
        nodes, per_node = asked((EXAMPLES_DIR / self.example / "job.sh").read_text())
        output = self.output()
        wrong = exit_problems(output) + problems(
            output,
            settings.get("ranks") or nodes * per_node,
            settings.get("val_samples"),
            nodes,
            settings.get("losses_logged", 2),
        )
        if self.example in TIMED and self.example != FABRIC and not self.rates():
            wrong.append("no log line with samples/s: give the run more steps")
        if self.example == FABRIC and self.nccl_network:
            wrong += network_problems(output, self.nccl_network)
        if wrong:
            raise SanityError("; ".join(wrong))
        return True

    def rates(self) -> list[str]:
        return re.findall(r"([\d.]+) samples/s per process", self.output())

    @performance_function("samples/s")
    def samples_per_s(self):
        """The last log line's samples/s per process: one process per GPU."""
        return float(self.rates()[-1])

    @performance_function("GB/s")
    def busbw(self):
        """Rank 0's bus bandwidth at the largest message size."""
        return summaries(self.output())[0]["results"][-1]["busbw_gbps"]


@rfm.simple_test
class ExampleJob(JobSh):
    example = parameter([name for name in EXAMPLES if name != FABRIC])


@rfm.simple_test
class FabricCheck(JobSh):
    example = parameter([FABRIC])


@rfm.simple_test
class StagedDataJob(JobSh):
    """The template's job.sh on files, not synthetic data: each node unpacks a small
    image archive, which the check makes in its stage folder, and the job trains on it.
    The stage folder must be on storage that every node reads, as ReFrame's usually is.
    """

    example = "generic/template"

    @run_after("init")
    def time_nothing(self):
        self.perf_variables = {}  # too short a run for a speed reading
        self.exclusive_access = False

    @property
    def run_settings(self) -> dict:
        return STAGED_RUN

    @run_before("run")
    def make_the_archive(self):
        archive = Path(self.stagedir) / "images.tar"
        write_image_archive(archive)
        # job.sh's DATA_ARCHIVE, unless the environment names another.
        self.env_vars["DATA_ARCHIVE"] = str(archive)

    @sanity_function
    def every_rank_trained_and_agrees(self):
        if "Unpacked the dataset in" not in self.output():
            raise SanityError("job.sh did not unpack the dataset")
        return super().every_rank_trained_and_agrees()


def write_image_archive(path: Path):
    """An image folder as an uncompressed tar, with train/ and val/ at its top and a
    folder per class in each, as the template's job.sh wants its dataset. Each class
    is a colour under random noise, which a model tells apart in a few steps. PPM
    images: torchvision reads them, and they need no imaging library to write."""
    draw = random.Random(0)
    size = STAGED_SIZE
    with tarfile.open(path, "w") as tar:
        for part, count in (("train", STAGED_TRAIN), ("val", STAGED_VAL)):
            for label in range(STAGED_CLASSES):
                colour = [(label * 50 + channel * 90) % 256 for channel in range(3)]
                for index in range(count):
                    pixels = bytes(
                        min(255, max(0, value + draw.randint(-40, 40)))
                        for _ in range(size * size)
                        for value in colour
                    )
                    data = f"P6 {size} {size} 255\n".encode() + pixels
                    member = tarfile.TarInfo(f"{part}/class{label}/{index}.ppm")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
