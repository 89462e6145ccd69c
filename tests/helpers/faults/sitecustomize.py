"""Makes a checkpoint's write fail as a full disk does, without changing main.py.

Python imports this module at start-up from a folder on PYTHONPATH. It wraps os.fsync,
which every checkpoint write of the examples ends with (torch.distributed.checkpoint's
too): syncing a file whose path matches FAIL_SAVE, a regular expression (say
"step-00000004"), raises ENOSPC,
"No space left on device", as the storage would report it. Each process fails the
first FAIL_SAVE_TIMES such files (default 1), or all of them with "all".

Used by the tests of saves that fail (tests/test_resume.py).
"""

import errno
import os
import re

pattern = os.environ.get("FAIL_SAVE")
times = os.environ.get("FAIL_SAVE_TIMES", "1")
left = float("inf") if times == "all" else int(times)
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
    return fsync(fd)


os.fsync = failing_fsync
