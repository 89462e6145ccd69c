"""Notes each SIGTERM and SIGUSR1 it gets in a file, with what it is: a task that srun
started, its child (as a DataLoader worker is), or a worker that torchrun started.

    probe.py FILE task      # starts a child of its own, then waits
    probe.py FILE worker    # under torchrun

Used by tests/test_process_tracking.py: which processes of a step a signal reaches.
"""

import signal
import subprocess
import sys
import time

out, role = sys.argv[1], sys.argv[2]


def note(signum, frame):
    with open(out, "a") as f:
        f.write(f"{role} {signal.Signals(signum).name}\n")


for signum in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(signum, note)
if role == "task":
    child = subprocess.Popen([sys.executable, __file__, out, "child"])
with open(out, "a") as f:
    f.write(f"{role} ready\n")
for _ in range(600):
    time.sleep(0.1)
