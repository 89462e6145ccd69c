"""A real Slurm cluster on this machine: one controller and two compute nodes.

Each node is a slurmd in its own network, UTS and mount namespace, so it has its own hostname
and IP address, as on a real cluster: `hostname -I`, `scontrol show hostnames`, `srun -w` and a
MASTER_ADDR of the first node behave as they would there, and ranks on two nodes talk over TCP.
Fake typed GPUs (character devices standing in for /dev/nvidia*) and node features make the
scripts' `--gpus-per-node`, `--gpus` and `--constraint` requests valid as written.

A site profile (tests/sites/<name>/) supplies what a cluster gives its jobs: the `module` and
`conda` commands, dataset folders, and `$SLURM_TMPDIR`. The job scripts are submitted unchanged.

Used by the test suite, and by hand as root, with a Python that has the examples' dependencies
(the profiles hand it to the jobs), e.g. .nox/tests/bin/python:

    python tests/slurm_lab.py up      # install (apt) if needed, start, print SLURM_CONF
    python tests/slurm_lab.py down    # stop everything and remove what `up` made
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tinyimagenet

STATE = Path("/tmp/ddp-slurm-lab")
SITES = Path(__file__).parent / "sites"
# Two networks, as on clusters whose nodes have Ethernet and InfiniBand: each node has an
# address on both, and `hostname -I` lists them in this order. Names resolve to the first.
NETWORKS = {"eth0": ("ddplab0", "10.77.0"), "ib0": ("ddplab1", "10.78.0")}
BRIDGE_ADDR = "10.77.0.1"  # the controller, on the first network
NODES = {"cn1": "10.77.0.11", "cn2": "10.77.0.12"}
HOSTS_TAG = "# ddp-slurm-lab"
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
COMMANDS = ["slurmctld", "slurmd", "munged", "mungekey", "sbatch", "nsenter", "unshare", "ip"]

# Folders that the sites' job scripts read, each shown to the nodes by a bind mount inside
# their mount namespace: mount point -> source (relative sources are in the cluster's state).
SITE_MOUNTS = {
    "/network/datasets": SITES / "mila" / "datasets",
    "/ibex/user": Path("ibex-user"),
    "/ibex/ai/reference/CV/tinyimagenet": Path("tinyimagenet"),
    # Generic scripts activate a virtual environment in the submitting user's home.
    str(Path.home() / "venvs" / "ddp"): SITES / "generic" / "venv",
}


class LabUnavailable(RuntimeError):
    """The cluster cannot start here; the message says why."""


@dataclass
class Job:
    job_id: str
    state: str
    exit_code: str
    node_list: str
    output: str
    elapsed: float

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == "0:0"


@dataclass
class Lab:
    state: Path = STATE
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    def env(self, site: str | None = None, **extra: str) -> dict[str, str]:
        """The environment to submit from: this cluster's config, plus a site's profile."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        # Job scripts name the user's folders with $USER and $HOME, which CI may not set.
        env.setdefault("USER", pwd.getpwuid(os.getuid()).pw_name)
        env.setdefault("HOME", str(Path.home()))
        if site is not None:
            profile = SITES / site
            env["BASH_ENV"] = str(profile / "profile.sh")
            # The Python that the profile's `conda activate` puts first on PATH: this one,
            # which has the examples' dependencies.
            env["LAB_PYTHON_BIN"] = str(Path(sys.executable).parent)
        env.update(extra)
        return env

    # ----------------------------------------------------------------------------------------
    # Start and stop

    def up(self, timeout: float = 60.0) -> None:
        check_can_start()
        self.down()  # whatever a crashed run left behind
        self.state.mkdir(parents=True)
        self._write_config()
        self._make_site_data()
        self._start_munge()
        self._start_network()
        self._start_daemons()
        self._wait_for_nodes(timeout)

    def down(self) -> None:
        """Stops every daemon and removes namespaces, bridge, hosts lines and state."""
        for pidfile in self.state.glob("**/*.pid") if self.state.exists() else []:
            _kill(pidfile)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.procs.clear()
        # Daemons started by an earlier run of this module whose pid files are gone.
        subprocess.run(["pkill", "-9", "-f", f"{self.state}/"], capture_output=True)
        for name in NODES:
            subprocess.run(["ip", "netns", "delete", f"ddplab-{name}"], capture_output=True)
            for iface in NETWORKS:
                subprocess.run(["ip", "link", "delete", veth(name, iface)], capture_output=True)
        for bridge, _ in NETWORKS.values():
            subprocess.run(["ip", "link", "delete", bridge], capture_output=True)
        hosts = Path("/etc/hosts")
        lines = hosts.read_text().splitlines(keepends=True)
        kept = [line for line in lines if HOSTS_TAG not in line]
        if kept != lines:
            hosts.write_text("".join(kept))
        _remove_made_dirs()
        shutil.rmtree(self.state, ignore_errors=True)

    def _write_config(self) -> None:
        s = self.state
        for sub in ["ctld", "spool", "log", "gpus", "munge", "tmp"]:
            (s / sub).mkdir()
        # Slurm only accepts GPUs backed by character devices; copies of /dev/null will do.
        for i in range(8):
            os.mknod(s / "gpus" / f"nvidia{i}", 0o666 | 0o020000, os.makedev(1, 3))
        host = socket.gethostname()
        node_lines = "\n".join(
            f"NodeName={name} NodeAddr={addr} CPUs=32 RealMemory=256000 "
            "Gres=gpu:rtx8000:4,gpu:a100:4 Feature=rtx8000,a100 State=UNKNOWN"
            for name, addr in NODES.items()
        )
        (s / "slurm.conf").write_text(
            f"""\
ClusterName=ddplab
SlurmctldHost={host}({BRIDGE_ADDR})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={s}/munge/munge.socket.2
CredType=cred/munge
StateSaveLocation={s}/ctld
SlurmdSpoolDir={s}/spool/%n
SlurmctldPidFile={s}/slurmctld.pid
SlurmdPidFile={s}/spool/%n.pid
SlurmctldLogFile={s}/log/slurmctld.log
SlurmdLogFile={s}/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
GresTypes=gpu
# Finished jobs stay in `scontrol show job` for an hour: a test may wait for one, then another.
MinJobAge=3600
SchedulerParameters=batch_sched_delay=0
EnforcePartLimits=ALL
KillWait=30
TaskProlog={Path(__file__).parent / "sites" / "task_prolog.sh"}
{node_lines}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )
        (s / "gres.conf").write_text(
            "AutoDetect=off\n"
            f"Name=gpu Type=rtx8000 File={s}/gpus/nvidia[0-3]\n"
            f"Name=gpu Type=a100 File={s}/gpus/nvidia[4-7]\n"
        )

    def _make_site_data(self) -> None:
        """What the site profiles need beyond their committed files."""
        # Mila and generic: $SCRATCH, which their profiles export.
        (self.state / "scratch").mkdir()
        # Ibex: the user's own miniconda, at /ibex/user/$USER/miniconda3.
        user = self.env()["USER"]
        (self.state / "ibex-user" / user).mkdir(parents=True)
        (self.state / "ibex-user" / user / "miniconda3").symlink_to(SITES / "ibex" / "miniconda3")
        # Ibex: TinyImageNet, small and synthetic, in the real on-disk layout.
        tinyimagenet.make(self.state / "tinyimagenet")

    def _start_munge(self) -> None:
        m = self.state / "munge"
        m.chmod(0o755)  # clients on every node reach the socket through this folder
        _run(["mungekey", "--create", f"--keyfile={m}/munge.key"])
        os.chmod(m / "munge.key", 0o600)
        _run(
            [
                "munged",
                "--force",
                f"--socket={m}/munge.socket.2",
                f"--key-file={m}/munge.key",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ]
        )

    def _start_network(self) -> None:
        for bridge, prefix in NETWORKS.values():
            _run(["ip", "link", "add", bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{prefix}.1/24", "dev", bridge])
            _run(["ip", "link", "set", bridge, "up"])
        for name, addr in NODES.items():
            ns = f"ddplab-{name}"
            inside = ["ip", "-n", ns]
            _run(["ip", "netns", "add", ns])
            _run([*inside, "link", "set", "lo", "up"])
            host_part = addr.rsplit(".", 1)[1]
            for iface, (bridge, prefix) in NETWORKS.items():
                pair = ["ip", "link", "add", veth(name, iface), "type", "veth"]
                _run([*pair, "peer", "name", iface, "netns", ns])
                _run(["ip", "link", "set", veth(name, iface), "master", bridge, "up"])
                _run([*inside, "addr", "add", f"{prefix}.{host_part}/24", "dev", iface])
                _run([*inside, "link", "set", iface, "up"])
            _run([*inside, "route", "add", "default", "via", BRIDGE_ADDR])
        with open("/etc/hosts", "a") as hosts:
            for name, addr in NODES.items():
                hosts.write(f"{addr} {name} {HOSTS_TAG}\n")

    def _start_daemons(self) -> None:
        env = self.env()
        log = open(self.state / "log" / "daemons.out", "ab")  # noqa: SIM115 (lives with the lab)
        ctld = subprocess.Popen(
            ["slurmctld", "-D", "-f", str(self.conf)], env=env, stdout=log, stderr=log
        )
        self.procs.append(ctld)
        empty = self.state / "empty"
        empty.write_text("")
        mounts = []
        for mountpoint, source in SITE_MOUNTS.items():
            _make_dirs(Path(mountpoint))
            mounts.append(f"mount --bind {self.state / source} {mountpoint}")
        for name in NODES:
            # In the node's own UTS and mount namespaces: its hostname, the sites' dataset
            # folders, and no resolv.conf, since DNS is unreachable from here and every lookup
            # would stall for 10 s before falling back to /etc/hosts.
            script = "; ".join(
                [
                    "set -e",
                    f"hostname {name}",
                    f"mount --bind {empty} /etc/resolv.conf",
                    *mounts,
                    f"exec slurmd -D -N {name} -f {self.conf}",
                ]
            )
            cmd = ["nsenter", f"--net=/run/netns/ddplab-{name}", "unshare", "--uts", "--mount"]
            self.procs.append(
                subprocess.Popen([*cmd, "sh", "-c", script], env=env, stdout=log, stderr=log)
            )

    def _wait_for_nodes(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise LabUnavailable(f"a Slurm daemon exited at start:\n{self.logs()}")
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(), capture_output=True, text=True
            ).stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            if states and all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.3)
        raise LabUnavailable(f"the nodes did not become idle in {timeout:.0f} s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted((self.state / "log").glob("*"))
        )

    # ----------------------------------------------------------------------------------------
    # Jobs

    def sbatch(
        self, script: Path, *args: str, site: str, workdir: Path, options=(), **extra
    ) -> str:
        """Submits `script` unchanged, from its own folder, and returns the job ID.

        `options` go to sbatch (they override the script's #SBATCH lines), `args` to the script.
        """
        out = _run(
            [
                "sbatch",
                "--parsable",
                f"--chdir={script.parent}",
                f"--output={workdir}/slurm-%j.out",
                *options,
                str(script),
                *args,
            ],
            env=self.env(site, **extra),
            cwd=script.parent,
        )
        return out.strip().split(";")[0]

    def wait(self, job_id: str, workdir: Path, timeout: float) -> Job:
        """Polls the job every 0.2 s (sbatch --wait polls far less often) until it ends."""
        start = time.monotonic()
        info: dict[str, str] = {}
        stacks = None
        while time.monotonic() - start < timeout:
            info = self.job_info(job_id)
            # A job that has left slurmctld's memory cannot be waited for: say so at once.
            assert info, f"job {job_id} is unknown to slurmctld (over MinJobAge, or never existed)"
            if info.get("JobState") in {
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
            }:
                break
            time.sleep(0.2)
        else:
            # Where each process is stuck, for the report, before the job is cancelled.
            stacks = job_stacks(job_id)
            subprocess.run(["scancel", job_id], env=self.env(), capture_output=True)
        out = workdir / f"slurm-{job_id}.out"
        output = out.read_text(errors="replace") if out.exists() else ""
        if stacks is not None:
            output += f"\n--- still running after {timeout:.0f} s; stacks:\n{stacks}"
        return Job(
            job_id=job_id,
            state=info.get("JobState", "UNKNOWN") if info else "UNKNOWN",
            exit_code=info.get("ExitCode", "?"),
            node_list=info.get("NodeList", ""),
            output=output,
            elapsed=time.monotonic() - start,
        )

    def job_info(self, job_id: str) -> dict[str, str]:
        result = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            env=self.env(),
            capture_output=True,
            text=True,
        )
        return dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)


def job_processes(job_id: str) -> list[tuple[int, str, set[str]]]:
    """PID, command line and environment of each process of job `job_id` on this machine."""
    processes = []
    for proc in Path("/proc").iterdir():
        try:
            environ = set((proc / "environ").read_bytes().decode(errors="replace").split("\0"))
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if f"SLURM_JOB_ID={job_id}" in environ:
            processes.append((int(proc.name), cmdline, environ))
    return processes


def job_stacks(job_id: str) -> str:
    """The Python and native stacks of the job's Python processes, by py-spy, if installed."""
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        return "(py-spy is not installed)"
    dumps = []
    for pid, cmdline, _ in job_processes(job_id):
        if "python" in cmdline:
            dump = subprocess.run(
                [py_spy, "dump", "--native", "--pid", str(pid)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            dumps.append(f"--- {pid}: {cmdline}\n{dump.stdout}{dump.stderr}")
    return "\n".join(dumps)


def check_can_start() -> None:
    """Installs Slurm and munge with apt if needed; says why when the cluster cannot start."""
    if os.geteuid() != 0:
        raise LabUnavailable(
            "the Slurm test cluster needs root (namespaces, a bridge, daemons as root)"
        )
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        if shutil.which("apt-get") is None:
            raise LabUnavailable(f"{', '.join(missing)} missing and there is no apt-get")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", *PACKAGES, "iproute2", "util-linux"],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        missing = [c for c in COMMANDS if shutil.which(c) is None]
        if missing:
            raise LabUnavailable(f"still missing after apt-get install: {', '.join(missing)}")


def _run(cmd: list[str], **kwargs) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise LabUnavailable(f"`{' '.join(cmd)}` failed: {result.stderr.strip()}")
    return result.stdout


def _kill(pidfile: Path) -> None:
    with contextlib.suppress(ValueError, IndexError, ProcessLookupError, PermissionError):
        os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)


def _make_dirs(path: Path) -> None:
    """Creates `path` and notes each folder it made, so that `down` removes just those."""
    missing = [p for p in [path, *path.parents] if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    with open(STATE / "made_dirs", "a") as made:
        made.writelines(f"{p}\n" for p in missing)


def veth(node: str, iface: str) -> str:
    """The host's end of a node's interface."""
    return f"ddp{iface[0]}-{node}"


def _remove_made_dirs() -> None:
    made = STATE / "made_dirs"
    if not made.exists():
        return
    for line in made.read_text().splitlines():  # deepest first, as written
        with contextlib.suppress(OSError):
            Path(line).rmdir()


if __name__ == "__main__":
    if sys.argv[1:] == ["up"]:
        lab = Lab()
        lab.up()
        print(f"Slurm test cluster up, nodes {', '.join(NODES)}. To use it:")
        print(f"export SLURM_CONF={lab.conf}")
    elif sys.argv[1:] == ["down"]:
        Lab().down()
    else:
        sys.exit(__doc__)
