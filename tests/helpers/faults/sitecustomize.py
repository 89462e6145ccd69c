"""Makes a checkpoint's write fail as a full disk does, or block as storage that stops
answering does, without changing main.py.

Python imports this module at start-up from a folder on PYTHONPATH. It wraps os.fsync,
which every checkpoint write of the examples ends with (torch.distributed.checkpoint's
too):
- syncing a file whose path matches FAIL_SAVE, a regular expression (say
  "step-00000004"), raises ENOSPC, "No space left on device", as the storage would
  report it. Each process fails the first FAIL_SAVE_TIMES such files (default 1), or
  all of them with "all";
- syncing a file whose path matches STALL_SAVE blocks for STALL_SECONDS (default 20)
  first, as a write to Lustre or a hard-mounted NFS does while a server is away. With
  STALL_SAVE_WHEN, a file's path, only once that file exists (a test makes it).

COLLECTIVE_TIMEOUT, in seconds, replaces torch.distributed's default timeout of a group
(10 minutes with NCCL, 30 with gloo), so that a test can outlast it in seconds.

Used by the tests of saves that fail or block (tests/test_resume.py,
tests/test_slurm_events.py).
"""

import errno
import os
import re
import time

pattern = os.environ.get("FAIL_SAVE")
times = os.environ.get("FAIL_SAVE_TIMES", "1")
left = float("inf") if times == "all" else int(times)
stall = os.environ.get("STALL_SAVE")
stall_when = os.environ.get("STALL_SAVE_WHEN")
stall_seconds = float(os.environ.get("STALL_SECONDS", "20"))
fsync = os.fsync


def failing_fsync(fd):
    global left
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        path = ""
    if pattern and re.search(pattern, path) and left > 0:
        left -= 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    now = stall_when is None or os.path.exists(stall_when)
    if stall and re.search(stall, path) and now:
        time.sleep(stall_seconds)
    return fsync(fd)


os.fsync = failing_fsync

if "COLLECTIVE_TIMEOUT" in os.environ:
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    short = timedelta(seconds=float(os.environ["COLLECTIVE_TIMEOUT"]))
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = short
