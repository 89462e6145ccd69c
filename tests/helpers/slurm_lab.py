"""A real Slurm cluster on this machine: a controller and two nodes, of one of three
Slurm versions.

Each node is a slurmd in its own network, UTS and mount namespace, so it has its own
hostname and IP address, as on a real cluster: `hostname -I`, `scontrol show hostnames`,
`srun -w` and a MASTER_ADDR of the first node behave as they would there, and ranks on
two nodes talk over TCP. Fake typed GPUs (character devices standing in for
/dev/nvidia*) and node features make the scripts' `--gpus-per-node`, `--gpus` and
`--constraint` requests valid as written.

Three Slurm versions, chosen by `Lab(version=...)`:
- 24.11 (the default), what most clusters run today: Debian 13's (trixie) packages, in
  a Debian 13 root made once with debootstrap and kept in /var/cache. Its daemons and
  commands run inside that root, with the host folders that jobs use mounted at the
  same paths: /proc, /sys, /dev, /tmp, /etc/hosts, the project and the Python. The
  nodes enter it by pivot_root; `Lab.env()` puts wrappers first on PATH that run the
  client commands (sbatch, srun, ...) there by chroot.
- 26.05, the newest: Debian forky's packages, in a forky root made the same way, with
  Apptainer 1.4 from Debian sid for the container example.
- 22.05: Debian 12's packages, installed on this machine itself.

A site profile (tests/sites/<name>/) supplies what a cluster gives its jobs: the
`module` and `conda` commands and dataset folders. The cluster's TaskProlog gives every
job `$SLURM_TMPDIR`, which the profiles of sites without one remove. The job scripts are
submitted unchanged.

Used by the test suite, and by hand as root, with a Python that has the examples'
dependencies (the profiles hand it to the jobs), e.g. .nox/tests/bin/python:

    python tests/helpers/slurm_lab.py up [22.05|24.11|26.05]  # start, print exports
    python tests/helpers/slurm_lab.py down                    # stop, remove it all
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import container_image
import tinyimagenet

STATE = Path("/tmp/ddp-slurm-lab")
PROJECT = Path(__file__).resolve().parents[2]
SITES = PROJECT / "tests" / "sites"
# Two networks, as on clusters whose nodes have Ethernet and
# InfiniBand: each node has an address on both, and `hostname -I`
# lists them in this order. Names resolve to the first.
NETWORKS = {"eth0": ("ddplab0", "10.77.0"), "ib0": ("ddplab1", "10.78.0")}
BRIDGE_ADDR = "10.77.0.1"  # the controller, on the first network
NODES = {"cn1": "10.77.0.11", "cn2": "10.77.0.12"}
HOSTS_TAG = "# ddp-slurm-lab"
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
COMMANDS = [
    "slurmctld",
    "slurmd",
    "munged",
    "mungekey",
    "sbatch",
    "nsenter",
    "unshare",
    "ip",
]

# Each version, and the Debian release whose packages
# provide it: None is this machine's own.
VERSIONS = {"22.05": None, "24.11": "trixie", "26.05": "forky"}
DEFAULT_VERSION = "24.11"
ROOTS = Path("/var/cache/ddp-slurm-lab")
DEBOOTSTRAP_SCRIPTS = Path("/usr/share/debootstrap/scripts")
# The nodes' leaf switches in the order topology.conf lists them: cn2's first. From
# Slurm 26.05, srun numbers the tasks of a step with more tasks than nodes in this
# order, so rank 0 runs on cn2, while the job's first node by name (MASTER_ADDR in the
# scripts) is cn1 (tests/test_slurm_versions.py).
SWITCH_ORDER = ["cn2", "cn1"]
# What a root holds beyond Debian's minimal base: Slurm and munge, the
# commands that the job scripts and tests run on a node, and the
# shared libraries that the host's Python and its extension modules
# load (run from the root, they find the root's /lib, not the host's).
ROOT_PACKAGES = [
    *PACKAGES, "hostname", "iproute2", "procps",
    "libffi8", "libssl3t64", "libsqlite3-0", "libbz2-1.0", "liblzma5", "zlib1g",
    "libncursesw6", "libreadline8t64", "libgdbm6t64", "libuuid1", "libstdc++6",
    "libgomp1", "libexpat1",
]  # fmt: skip
ROOT_COMMANDS = ["debootstrap", "chroot", "nsenter", "unshare", "ip"]
# Client commands that Lab.env() runs inside the root.
CLIENTS = [
    "sbatch",
    "srun",
    "salloc",
    "scontrol",
    "sinfo",
    "squeue",
    "scancel",
    "sacct",
    "sstat",
]
INSIDE_MARK = (
    ".ddp-slurm-lab-root"  # a file at the root's top: "this process runs inside"
)
OLD_ROOT = "/.host"  # where a node's pivot_root puts the host's root, then unmounts it
# Packages from Debian sid for a root of another suite: Apptainer 1.4 is in sid only.
FROM_SID = {"forky": ["apptainer"]}
# The container example's image, in $SCRATCH (its job.sh's default).
IMAGE = "images/pytorch-25.12.sif"

# The cgroup (v1) controllers that a node of a lab with cgroups gets of its own.
CGROUP_CONTROLLERS = ["freezer", "cpuset", "memory", "devices", "cpuacct"]
# The partitions whose jobs a job of `main` preempts, and how.
PREEMPTIBLE = {
    "preemptible": "PreemptMode=REQUEUE",
    "graced": "PreemptMode=REQUEUE GraceTime=20",
    "cancelled": "PreemptMode=CANCEL",
}
# Folders that the sites' job scripts read, each shown to the
# nodes by a bind mount inside their mount namespace: mount
# point -> source (relative sources are in the cluster's state).
SITE_MOUNTS = {
    "/network/datasets": SITES / "mila" / "datasets",
    "/ibex/user": Path("ibex-user"),
    "/ibex/ai/reference/CV/tinyimagenet": Path("tinyimagenet"),
    # Generic scripts activate a virtual environment in the submitting user's home.
    str(Path.home() / "venvs" / "ddp"): SITES / "generic" / "venv",
}


class LabUnavailable(RuntimeError):
    """The cluster cannot start here; the message says why."""


# A job's state as `scontrol show job` prints it. While one of Slurm's flags is set, it
# prints the flag in place of the job's own state: COMPLETING while the job's processes
# and epilog end, REQUEUED, CONFIGURING, SIGNALING, STAGE_OUT, and so on. A requeue
# counts the restart as it sets PENDING and COMPLETING together (_job_requeue_op in
# Slurm's source, 22.05 to 26.05): a requeued job is COMPLETING with its Restarts
# counted until its processes end, as CI saw on 22.05. A state read once, right after
# another field changed, can be one of these: Lab.wait_for_state() waits them out.
ENDED = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "BOOT_FAIL", "DEADLINE",
})  # fmt: skip
# Where a job stays until a person acts: held after a requeue.
HELD = frozenset({"REQUEUE_HOLD", "SPECIAL_EXIT"})


class StillWaiting(AssertionError):
    """A job did not reach the state waited for in time; `info` is its last record."""

    def __init__(self, message: str, info: dict[str, str]):
        super().__init__(message)
        self.info = info


@dataclass
class Job:
    job_id: str
    state: str
    exit_code: str
    node_list: str
    output: str
    elapsed: float
    # For a job of a ReFrame check (Lab.run_checks): its stage folder, where job.sh ran
    # and left its checkpoints, and the check's verdict: "pass", or why it failed.
    workdir: Path | None = None
    check: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "COMPLETED" and self.exit_code == "0:0"


@dataclass
class Lab:
    version: str = DEFAULT_VERSION
    state: Path = STATE
    # proctrack/cgroup and task/cgroup, as most clusters track a job's processes, each
    # node in a cgroup (v1) hierarchy of its own; else proctrack/linuxproc, task/none.
    cgroups: bool = False
    procs: list[subprocess.Popen] = field(default_factory=list)
    _node_scripts: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.version not in VERSIONS:
            raise LabUnavailable(
                f"no Slurm {self.version} here; the test cluster runs "
                f"{', '.join(list(VERSIONS)[:-1])} or {list(VERSIONS)[-1]}"
            )

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    @property
    def root(self) -> Path | None:
        """The Debian root that holds this version's Slurm,
        or None for the host's own."""
        suite = VERSIONS[self.version]
        return None if suite is None else ROOTS / f"debian-{suite}"

    @property
    def has_apptainer(self) -> bool:
        """Whether jobs can run containers: Apptainer is in this version's root."""
        return VERSIONS[self.version] in FROM_SID

    def at_least(self, version: str) -> bool:
        """Whether this cluster's Slurm is `version` ("23.11") or newer."""
        return tuple(map(int, self.version.split("."))) >= tuple(
            map(int, version.split("."))
        )

    @property
    def bin(self) -> Path:
        """Where the commands that run inside the root are
        (the root version's PATH entry)."""
        return self.state / "bin"

    def env(self, site: str | None = None, **extra: str) -> dict[str, str]:
        """The environment to submit from: this cluster's
        config, plus a site's profile."""
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))
        }
        env["SLURM_CONF"] = str(self.conf)
        if self.root is not None:
            env["PATH"] = f"{self.bin}:{env.get('PATH', os.defpath)}"
        # Job scripts name the user's folders with $USER
        # and $HOME, which CI may not set.
        env.setdefault("USER", pwd.getpwuid(os.getuid()).pw_name)
        env.setdefault("HOME", str(Path.home()))
        if site is not None:
            profile = SITES / site
            env["BASH_ENV"] = str(profile / "profile.sh")
            # The Python that the profile's `conda activate` puts first on PATH: this
            # one, which has the examples' dependencies.
            env["LAB_PYTHON_BIN"] = str(Path(sys.executable).parent)
        env.update(extra)
        return env

    # ------------------------------------------------------------
    # Start and stop

    def up(self, timeout: float = 60.0) -> None:
        check_can_start(self.version)
        self.down()  # whatever a crashed run left behind
        self.state.mkdir(parents=True)
        try:
            if self.root is not None:
                self._write_root_commands()
            self._check_version()
            self._write_config()
            self._make_site_data()
            self._start_munge()
            self._start_network()
            self._start_daemons()
            self._wait_for_nodes(timeout)
        except BaseException:
            self.down()  # no daemon, mount or namespace outlives a start that failed
            raise

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
            # What still runs on a node: a job step's slurmstepd that was finishing
            # as slurmd stopped, and what it started.
            pids = subprocess.run(
                ["ip", "netns", "pids", f"ddplab-{name}"],
                capture_output=True,
                text=True,
            ).stdout.split()
            if pids:
                subprocess.run(["kill", "-9", *pids], capture_output=True)
            subprocess.run(
                ["ip", "netns", "delete", f"ddplab-{name}"], capture_output=True
            )
            for iface in NETWORKS:
                subprocess.run(
                    ["ip", "link", "delete", veth(name, iface)], capture_output=True
                )
        for bridge, _ in NETWORKS.values():
            subprocess.run(["ip", "link", "delete", bridge], capture_output=True)
        for controller in CGROUP_CONTROLLERS:  # a lab with cgroups: its nodes' own
            with contextlib.suppress(LabUnavailable):
                for own in own_cgroup(controller).glob("ddplab-*"):
                    deepest_first = ["find", own, "-depth", "-type", "d"]
                    subprocess.run([*deepest_first, "-delete"], capture_output=True)
        hosts = Path("/etc/hosts")
        lines = hosts.read_text().splitlines(keepends=True)
        kept = [line for line in lines if HOSTS_TAG not in line]
        if kept != lines:
            hosts.write_text("".join(kept))
        _remove_made_dirs()
        shutil.rmtree(self.state, ignore_errors=True)

    def _write_config(self) -> None:
        s = self.state
        for sub in ["ctld", "spool", "log", "gpus", "munge", "local-disk"]:
            (s / sub).mkdir()
        for name in NODES:
            (s / "nodes" / name / "local-disk").mkdir(parents=True)
        # Slurm only accepts GPUs backed by character
        # devices; copies of /dev/null will do.
        for i in range(8):
            os.mknod(s / "gpus" / f"nvidia{i}", 0o666 | 0o020000, os.makedev(1, 3))
        host = socket.gethostname()
        preemptible = "\n".join(
            f"PartitionName={name} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 "
            + settings
            for name, settings in PREEMPTIBLE.items()
        )
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
ProctrackType={"proctrack/cgroup" if self.cgroups else "proctrack/linuxproc"}
TaskPlugin={"task/cgroup" if self.cgroups else "task/none"}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
TopologyPlugin=topology/tree
GresTypes=gpu
# Finished jobs stay in `scontrol show job` for an hour: a
# test may wait for one, then another.
MinJobAge=3600
SchedulerParameters=batch_sched_delay=0
EnforcePartLimits=ALL
KillWait=30
# A node that stops answering is DOWN within about a minute (300 s by default): the
# tests of a lost node wait for Slurm to notice.
SlurmdTimeout=30
TaskProlog={SITES / "task_prolog.sh"}
{node_lines}
# Preemption, as clusters with partitions of two priorities have it: a job of `main`
# preempts jobs of the others, which requeue it at once, after a grace time of 20 s, or
# cancel it (tests/test_slurm_events.py). No job of `main` is ever preempted.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=2
{preemptible}
"""
        )
        # The network, as most clusters with a fast one describe it: a leaf switch per
        # node here, listed in SWITCH_ORDER, as a generated topology.conf may list them.
        (s / "topology.conf").write_text(
            "".join(
                f"SwitchName=leaf{i} Nodes={node}\n"
                for i, node in enumerate(SWITCH_ORDER, start=1)
            )
            + f"SwitchName=spine Switches=leaf[1-{len(SWITCH_ORDER)}]\n"
        )
        # Nothing constrained: the nodes claim 32 CPUs of the machine's 2, and their
        # GPUs are copies of /dev/null. Here the cgroups track the processes.
        (s / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nConstrainCores=no\nConstrainDevices=no\n"
            "ConstrainRAMSpace=no\n"
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
        # Generic: an image folder where the generic job.sh files look for ImageNet,
        # and the archive of it that the template copies to each node.
        data = self.state / "scratch" / "data"
        tinyimagenet.make_folders(data / "imagenet")
        with tarfile.open(data / "imagenet.tar", "w") as archive:
            for part in ["train", "val"]:
                archive.add(data / "imagenet" / part, arcname=part)
        # Ibex: the user's own miniconda, at /ibex/user/$USER/miniconda3.
        user = self.env()["USER"]
        (self.state / "ibex-user" / user).mkdir(parents=True)
        (self.state / "ibex-user" / user / "miniconda3").symlink_to(
            SITES / "ibex" / "miniconda3"
        )
        # Ibex: TinyImageNet, small and synthetic, in the real on-disk layout.
        tinyimagenet.make(self.state / "tinyimagenet")
        # Generic, the container example: its image, where its job.sh looks for it (a
        # folder, which Apptainer runs as a sandbox image whatever its name).
        if self.has_apptainer:
            assert self.root is not None
            container_image.make(self.root, self.state / "scratch" / IMAGE)

    def _start_munge(self) -> None:
        m = self.state / "munge"
        m.chmod(0o755)  # clients on every node reach the socket through this folder
        _run([*self._inside("mungekey"), "--create", f"--keyfile={m}/munge.key"])
        os.chmod(m / "munge.key", 0o600)
        _run(
            [
                *self._inside("munged"),
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
        # The log lives as long as the lab, not a with block.
        log = open(self.state / "log" / "daemons.out", "ab")  # noqa: SIM115
        ctld = subprocess.Popen(
            [*self._inside("slurmctld"), "-D", "-f", str(self.conf)],
            env=env, stdout=log, stderr=log,
        )  # fmt: skip
        self.procs.append(ctld)
        empty = self.state / "empty"
        empty.write_text("")
        # Inside the root, the node's folders are the root's: mount there.
        top = "" if self.root is None else str(self.root)
        mounts = self._root_mounts()
        for mountpoint, source in SITE_MOUNTS.items():
            _make_dirs(Path(top + mountpoint))
            target = shlex.quote(top + mountpoint)
            mounts.append(
                f"mount --bind {shlex.quote(str(self.state / source))} {target}"
            )
        # A node enters its root by pivot_root, as a container runtime does: Apptainer
        # refuses to start under chroot ("weak chrooted environment").
        root = shlex.quote(top)
        enter_root = [
            f"mount --rbind {root} {root}",
            f"cd {root}",
            f"pivot_root . {OLD_ROOT.lstrip('/')}",
            f"umount -l {OLD_ROOT}",
        ]
        local_disk = shlex.quote(f"{top}{self.state / 'local-disk'}")
        for name in NODES:
            # In the node's own UTS and mount namespaces: its hostname, the sites'
            # dataset folders, a local disk of its own (the same path on every node,
            # as a real node's /tmp is), and no resolv.conf, since DNS is unreachable
            # from here and every lookup would stall for 10 s before falling back to
            # /etc/hosts.
            own_disk = shlex.quote(str(self.state / "nodes" / name / "local-disk"))
            self._node_scripts[name] = "; ".join(
                [
                    "set -e",
                    f"hostname {name}",
                    *mounts,
                    f"mount --bind {own_disk} {local_disk}",
                    f"mount --bind {empty} {top}/etc/resolv.conf",
                    *(self._cgroup_mounts(top) if self.cgroups else []),
                    *(enter_root if self.root is not None else []),
                    f"exec slurmd -D -N {name} -f {self.conf}",
                ]
            )
            self.start_node(name)

    def _cgroup_mounts(self, top: str) -> list[str]:
        """Shell commands that show a node, in its own cgroup namespace, the machine's
        cgroup (v1) hierarchies from its own cgroup down, as a node's root."""
        cgroup = f"{top}/sys/fs/cgroup"
        return [
            f"mount -t tmpfs cgroups {cgroup}",
            *(f"mkdir {cgroup}/{c} && mount -t cgroup -o {c} cgroup {cgroup}/{c}"
              for c in CGROUP_CONTROLLERS),
            f"mkdir {cgroup}/systemd",
            f"mount -t cgroup -o none,name=systemd cgroup {cgroup}/systemd",
        ]  # fmt: skip

    def start_node(self, name: str) -> None:
        """Starts the node's slurmd, in the node's namespaces: at `up`, or after
        `crash_node`, as a node that boots again."""
        cmd = ["nsenter", f"--net=/run/netns/ddplab-{name}", "unshare", "--uts",
               "--mount"]  # fmt: skip
        if self.cgroups:
            # Into a cgroup of its own in each hierarchy, then a cgroup namespace: the
            # node sees that cgroup as the root, and the nodes' jobs stay apart.
            join = []
            for c in CGROUP_CONTROLLERS:
                own = own_cgroup(c) / f"ddplab-{name}"
                own.mkdir(exist_ok=True)
                if c == "cpuset":
                    for key in ("cpuset.cpus", "cpuset.mems"):
                        (own / key).write_text((own.parent / key).read_text())
                join.append(f"echo $$ > {own}/cgroup.procs")
            cmd = ["sh", "-c", "; ".join([*join, 'exec "$@"']), "sh", *cmd, "--cgroup"]
        with open(self.state / "log" / "daemons.out", "ab") as log:
            self.procs.append(
                subprocess.Popen(
                    [*cmd, "sh", "-c", self._node_scripts[name]],
                    env=self.env(),
                    stdout=log,
                    stderr=log,
                )  # fmt: skip
            )

    @contextlib.contextmanager
    def controller_away(self):
        """slurmctld stopped for the block: it keeps its port and answers nothing, as a
        controller does while it hangs or restarts. Each client call waits for its
        MessageTimeout, then fails."""
        pid = int((self.state / "slurmctld.pid").read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def crash_node(self, name: str) -> None:
        """Ends every process of the node at once, slurmd and the jobs' processes
        alike, as a node that fails does: nothing is told, and slurmctld hears no more
        from it."""
        pids = subprocess.run(
            ["ip", "netns", "pids", f"ddplab-{name}"], capture_output=True, text=True
        ).stdout.split()
        subprocess.run(["kill", "-9", *pids], capture_output=True)
        for proc in self.procs:
            if str(proc.pid) in pids:
                proc.wait()

    # ------------------------------------------------------------
    # The root of a version that is not the host's

    def _inside(self, command: str) -> list[str]:
        """How to run a daemon's `command` of this version:
        inside its root, or as it is."""
        if self.root is None:
            return [command]
        return [str(self.bin / "in-root"), f"/usr/sbin/{command}"]

    def _root_mounts(self) -> list[str]:
        """Shell commands that show the root the host
        folders its commands and jobs use."""
        if self.root is None:
            return []
        project = PROJECT
        python = [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()]
        for prefix in python:
            # Debian's own Python lives in /usr, which
            # would hide the root's /usr, Slurm and all.
            if prefix in (Path("/"), Path("/usr")):
                raise LabUnavailable(
                    f"Slurm {self.version} runs jobs inside {self.root}, which cannot "
                    f"be shown the Python in {prefix}: use one installed elsewhere "
                    "(pyenv, uv, conda)"
                )
        commands = [
            f"mount --rbind {d} {self.root}{d}"
            for d in ["/proc", "/sys", "/dev", "/tmp"]
        ]
        commands.append(f"mount --bind /etc/hosts {self.root}/etc/hosts")
        seen: list[Path] = [Path("/tmp")]
        for folder in [project, *python, Path(tempfile.gettempdir()).resolve()]:
            if any(folder.is_relative_to(s) for s in seen):
                continue
            seen.append(folder)
            inside = shlex.quote(f"{self.root}{folder}")
            commands += [
                f"mkdir -p {inside}",
                f"mount --bind {shlex.quote(str(folder))} {inside}",
            ]
        return commands

    def _write_root_commands(self) -> None:
        """Mounts the host folders for the root, once, and
        writes the commands that use them.

        A process that does nothing holds a mount namespace with the root's
        bind mounts, so that they exist nowhere else and vanish with it.
        `in-root` runs a command inside the root, in that namespace; each
        client command (sbatch, ...) has a wrapper that calls it.
        """
        assert self.root is not None
        self.bin.mkdir()
        pidfile = self.state / "root-mounts.pid"
        mounts = [*self._root_mounts(), f"echo $$ > {pidfile}", "exec sleep infinity"]
        errors = self.state / "root-mounts.err"
        with open(errors, "w") as err:
            self.procs.append(
                subprocess.Popen(["unshare", "--mount", "--propagation", "private",
                                  "sh", "-e", "-c", "\n".join(mounts)], stderr=err)
            )  # fmt: skip
        deadline = time.monotonic() + 10
        while not pidfile.exists() or not pidfile.read_text().strip():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise LabUnavailable(
                    f"could not mount the host folders in {self.root}: "
                    f"{errors.read_text()}"
                )
            time.sleep(0.05)
        in_root = self.bin / "in-root"
        in_root.write_text(
            f"""\
#!/bin/sh
# Runs a command of Slurm {self.version} inside {self.root}, in the caller's folder,
# with the host folders that jobs use at the same paths. Written by slurm_lab.py.
set -e
if [ -e /{INSIDE_MARK} ]; then exec "$@"; fi  # already inside, as a job's srun is
exec nsenter --mount="/proc/$(cat {pidfile})/ns/mnt" chroot {self.root} /bin/sh -c '
    if ! cd "$0" 2>/dev/null; then
        echo "slurm_lab: $0 is not visible inside {self.root}:" \\
            "run from the project or /tmp" >&2
        exit 1
    fi
    exec "$@"' "$PWD" "$@"
"""
        )
        in_root.chmod(0o755)
        for name in CLIENTS:
            wrapper = self.bin / name
            wrapper.write_text(f'#!/bin/sh\nexec {in_root} /usr/bin/{name} "$@"\n')
            wrapper.chmod(0o755)

    def _check_version(self) -> None:
        out = _run([*self._inside("slurmctld"), "-V"]).split()
        found = out[-1] if out else "?"
        if not found.startswith(self.version + "."):
            where = "this machine" if self.root is None else str(self.root)
            raise LabUnavailable(f"the Slurm of {where} is {found}, not {self.version}")

    # ------------------------------------------------------------

    def _wait_for_nodes(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise LabUnavailable(
                        f"a Slurm daemon exited at start:\n{self.logs()}"
                    )
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                env=self.env(),
                capture_output=True,
                text=True,
            ).stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            if states and all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.3)
        raise LabUnavailable(
            f"the nodes did not become idle in {timeout:.0f} s:\n{self.logs()}"
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted((self.state / "log").glob("*"))
        )

    # ------------------------------------------------------------
    # Jobs

    def sbatch(
        self, script: Path, *args: str, site: str, workdir: Path, options=(), **extra
    ) -> str:
        """Submits `script` unchanged, from its own folder, and returns the job ID.

        `options` go to sbatch (they override the script's
        #SBATCH lines), `args` to the script.
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
        """Polls the job every 0.2 s (sbatch --wait polls
        far less often) until it ends."""
        start = time.monotonic()
        stacks = None
        out = workdir / f"slurm-{job_id}.out"
        try:
            info = self.wait_for_state(job_id, *ENDED, timeout=timeout, log=out)
        except StillWaiting as waiting:
            info = waiting.info
            # Where each process is stuck, for the report, before the job is cancelled.
            stacks = job_stacks(job_id)
            # The report, with the stacks, even if the job will not end.
            with contextlib.suppress(AssertionError):
                self.cancel(job_id)
        except AssertionError:
            # Held: out of the queue, so that it takes nothing from the next test.
            self.cancel(job_id)
            raise
        output = out.read_text(errors="replace") if out.exists() else ""
        if stacks is not None:
            output += f"\n--- still running after {timeout:.0f} s; stacks:\n{stacks}"
        return Job(
            job_id=job_id,
            state=info.get("JobState", "UNKNOWN"),
            exit_code=info.get("ExitCode", "?"),
            node_list=info.get("NodeList", ""),
            output=output,
            elapsed=time.monotonic() - start,
        )

    def run_checks(
        self, names: list[str], prefix: Path, command: list[str]
    ) -> dict[str, Job]:
        """Runs the ReFrame checks of checks/examples.py for the examples `names` (or
        checks, by class name: "StagedDataJob") with `command` (reframe, its site file
        and options), from the project's folder; returns each one's job. Everything
        ReFrame writes goes under `prefix`."""
        report = prefix / "report.json"
        # ReFrame matches -n against a check's name without spaces:
        # "ExampleJob%example=generic/multi_node", "FabricCheck%example=generic/fabric".
        selection = [
            f"-n%example={name}$" if "/" in name else f"-n^{name}$" for name in names
        ]
        result = subprocess.run(
            [*command, *selection, "--prefix", str(prefix), "--keep-stage-files",
             "--report-file", str(report)],
            cwd=PROJECT, env=self.env(),
            capture_output=True, text=True,
        )  # fmt: skip
        assert report.exists(), (
            f"reframe ended without a report:\n{result.stdout}{result.stderr}"
        )
        found = {}
        for case in json.loads(report.read_text())["runs"][0]["testcases"]:
            stage = Path(case["stagedir"])
            output = "".join(
                (stage / name).read_text(errors="replace")
                for name in (case["job_stdout"], case["job_stderr"])
                if name and (stage / name).exists()
            )
            info = self.job_info(case["jobid"]) if case["jobid"] else {}
            verdict = case["result"]
            if verdict != "pass":
                verdict = f"{verdict} in {case['fail_phase']}: {case['fail_reason']}"
            # An example's check, by its example; another, by its class.
            key = case["example"] if "%example=" in case["name"] else case["name"]
            found[key] = Job(
                job_id=str(case["jobid"]),
                state=info.get("JobState", "UNKNOWN"),
                exit_code=info.get("ExitCode", "?"),
                node_list=info.get("NodeList", ""),
                output=output,
                elapsed=case["time_run"] or 0.0,
                workdir=stage,
                check=verdict,
            )
        missing = set(names) - found.keys()
        assert not missing, f"no check ran for {missing}:\n{result.stdout}"
        return found

    def wait_for_state(
        self, job_id: str, *states: str, timeout: float, restarts: int | None = None,
        log: Path | None = None,
    ) -> dict[str, str]:  # fmt: skip
        """Polls the job every 0.2 s until one read of it shows one of `states` (and
        `restarts` restarts, if given), and returns that read.

        A job on its way somewhere (COMPLETING, REQUEUED, ...) is waited for, never
        taken for where it goes. One that ends or is held otherwise fails at once, as
        does one that slurmctld no longer knows: its record, and `log`'s text, say how.
        """
        wanted = " or ".join(states) + (
            "" if restarts is None else f" with Restarts={restarts}"
        )
        deadline = time.monotonic() + timeout
        while True:
            info, error = self._read_job(job_id)
            # A job that has left slurmctld's memory cannot be waited for: say so. A
            # controller too busy to answer in time is asked again.
            assert "Invalid job id" not in error, (
                f"job {job_id} is unknown to slurmctld (over MinJobAge, or never "
                f"existed): {error}"
            )
            state = info.get("JobState", f"unread ({error.strip()})")
            if state in states and restarts in (None, int(info.get("Restarts", -1))):
                return info
            ended = state in ENDED | HELD
            if not ended and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            told = f"{state}, not {wanted}"
            record = " ".join(f"{key}={value}" for key, value in info.items())
            if log is not None and log.exists():
                record += f"\n--- {log}\n{log.read_text(errors='replace')}"
            if ended:
                raise AssertionError(f"job {job_id} is {told}: {record}")
            raise StillWaiting(
                f"job {job_id} is still {told} after {timeout:.0f} s: {record}", info
            )

    def cancel(self, *job_ids: str, timeout: float = 60) -> None:
        """Cancels the jobs and waits until each has ended: a cancelled job is
        COMPLETING, its CPUs still taken, until its processes end, and a job submitted
        meanwhile waits for them. A job that slurmctld has forgotten is over."""
        subprocess.run(["scancel", *job_ids], env=self.env(), capture_output=True)
        for job_id in job_ids:
            if "Invalid job id" not in self._read_job(job_id)[1]:
                self.wait_for_state(job_id, *ENDED, timeout=timeout)

    def job_info(self, job_id: str) -> dict[str, str]:
        """The job's record, as `scontrol show job` prints it; empty if it failed."""
        return self._read_job(job_id)[0]

    def _read_job(self, job_id: str) -> tuple[dict[str, str], str]:
        """The job's record, and what scontrol said on stderr."""
        result = subprocess.run(
            ["scontrol", "show", "job", "-o", job_id],
            env=self.env(),
            capture_output=True,
            text=True,
        )
        info = dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)
        return info, result.stderr


def job_processes(job_id: str) -> list[tuple[int, str, set[str]]]:
    """PID, command line and environment of each process of
    job `job_id` on this machine."""
    processes = []
    for proc in Path("/proc").iterdir():
        try:
            environ = set(
                (proc / "environ").read_bytes().decode(errors="replace").split("\0")
            )
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if f"SLURM_JOB_ID={job_id}" in environ:
            processes.append((int(proc.name), cmdline, environ))
    return processes


def job_stacks(job_id: str) -> str:
    """The Python and native stacks of the job's Python
    processes, by py-spy, if installed."""
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


def check_can_start(version: str = DEFAULT_VERSION) -> None:
    """Installs what `version` needs if it is missing; says
    why when the cluster cannot start.

    The host's own version comes from apt; another
    version's root is made with debootstrap.
    """
    if os.geteuid() != 0:
        raise LabUnavailable(
            "the Slurm test cluster needs root (namespaces, a bridge, daemons as root)"
        )
    suite = VERSIONS[version]
    commands, packages = (
        (COMMANDS, [*PACKAGES, "iproute2", "util-linux"])
        if suite is None
        else (ROOT_COMMANDS, ["debootstrap", "iproute2", "util-linux", "coreutils"])
    )
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        if shutil.which("apt-get") is None:
            raise LabUnavailable(
                f"{', '.join(missing)} missing and there is no apt-get"
            )
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", *packages],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        missing = [c for c in commands if shutil.which(c) is None]
        if missing:
            raise LabUnavailable(
                f"still missing after apt-get install: {', '.join(missing)}"
            )
    if suite is not None:
        make_root(suite)


def make_root(suite: str) -> Path:
    """A Debian `suite` root with Slurm, made once (about a
    minute) and kept in ROOTS."""
    root = ROOTS / f"debian-{suite}"
    # The mark names what the root was made with: a root
    # made with other packages is made anew.
    mark = f"Debian {suite} root of slurm_lab.py, packages {packages_digest()}\n"
    if (root / INSIDE_MARK).exists() and (root / INSIDE_MARK).read_text() == mark:
        return root
    # Made beside its final place and renamed when complete: an interrupted run leaves
    # no half-made root that a later run would take for a whole one.
    partial = ROOTS / f"debian-{suite}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    ROOTS.mkdir(parents=True, exist_ok=True)
    # A debootstrap older than the suite has no script of its name; Debian's testing
    # and unstable suites are made as sid is.
    scripts = DEBOOTSTRAP_SCRIPTS
    script = scripts / suite if (scripts / suite).exists() else scripts / "sid"
    result = subprocess.run(
        ["debootstrap", "--variant=minbase", f"--include={','.join(ROOT_PACKAGES)}",
         suite, str(partial), "http://deb.debian.org/debian", str(script)],
        capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        log = partial / "debootstrap" / "debootstrap.log"
        detail = (
            log.read_text(errors="replace")[-2000:] if log.exists() else result.stderr
        )
        shutil.rmtree(partial, ignore_errors=True)
        raise LabUnavailable(f"debootstrap of Debian {suite} failed:\n{detail}")
    if extra := FROM_SID.get(suite):
        _install_from_sid(partial, extra)
    # Mount points for the host's files, which a minimal base may lack.
    for name in ["hosts", "resolv.conf"]:
        (partial / "etc" / name).touch()
    (partial / OLD_ROOT.lstrip("/")).mkdir()
    (partial / INSIDE_MARK).write_text(mark)
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    return root


def _install_from_sid(root: Path, packages: list[str]) -> None:
    """Installs `packages` into `root` from Debian sid, with the root's own suite
    for their dependencies."""
    (root / "etc/apt/sources.list.d/sid.list").write_text(
        "deb http://deb.debian.org/debian sid main\n"
    )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # A testing suite's Release file may be past its Valid-Until date.
    apt = ["chroot", str(root), "apt-get", "-o", "Acquire::Check-Valid-Until=false"]
    for args in (["update", "-qq"], ["install", "-y", "-qq", "--no-install-recommends",
                                     "-t", "sid", *packages], ["clean"]):  # fmt: skip
        result = subprocess.run([*apt, *args], capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise LabUnavailable(
                f"installing {', '.join(packages)} from Debian sid into {root} failed:"
                f"\n{result.stdout[-1500:]}{result.stderr[-1500:]}"
            )


def packages_digest() -> str:
    packages = [*ROOT_PACKAGES, *(p for ps in FROM_SID.values() for p in ps)]
    return hashlib.sha256(" ".join(packages).encode()).hexdigest()[:12]


def _run(cmd: list[str], **kwargs) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise LabUnavailable(f"`{' '.join(cmd)}` failed: {result.stderr.strip()}")
    return result.stdout


def _kill(pidfile: Path) -> None:
    with contextlib.suppress(
        ValueError, IndexError, ProcessLookupError, PermissionError
    ):
        os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)


def _make_dirs(path: Path) -> None:
    """Creates `path` and notes each folder it made, so
    that `down` removes just those."""
    missing = [p for p in [path, *path.parents] if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    with open(STATE / "made_dirs", "a") as made:
        made.writelines(f"{p}\n" for p in missing)


def own_cgroup(controller: str) -> Path:
    """The folder of this process's cgroup in a cgroup (v1) hierarchy: the nodes' go
    below it, within whatever limits it has."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return Path("/sys/fs/cgroup", controller) / path.lstrip("/")
    raise LabUnavailable(f"no cgroup (v1) hierarchy of {controller} here")


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
    if sys.argv[1:2] == ["up"] and len(sys.argv) <= 3:
        lab = Lab(*sys.argv[2:])
        lab.up()
        print(
            f"Slurm {lab.version} test cluster up, nodes {', '.join(NODES)}. To use it:"
        )
        print(f"export SLURM_CONF={lab.conf}")
        if lab.root is not None:
            print(f'export PATH="{lab.bin}:$PATH"')
    elif sys.argv[1:] == ["down"]:
        Lab().down()
    else:
        sys.exit(__doc__)
