"""The tools beside the tests (tests/tools/) still run, in a short form. Their numbers
are measured on purpose, by hand; here only that each works and reports sane ones.
(bench.py is run by tests/test_template.py, screenshots.py by
tests/test_site_in_browser.py; gpu_check.py needs a GPU: tests/test_gpu_mode.py.)"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

from smoke import base_env

TOOLS = Path(__file__).resolve().parent / "tools"


def test_checkpoint_speed_times_both_kinds_of_checkpoint(tmp_path):
    # The tiny model: both checkpoints hold its weights and AdamW's state, so they
    # are about the same size, and each save and load takes some time.
    result = subprocess.run(
        [sys.executable, str(TOOLS / "checkpoint_speed.py"), "--folder", str(tmp_path),
         "--sizes", "tiny"],
        env=base_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    [row] = [
        json.loads(line)
        for line in re.findall(r"^checkpoint: (\{.*\})$", result.stdout, re.M)
    ]
    assert row["size"] == "tiny" and row["parameters"] > 0, row
    for key in ("dcp_save_s", "dcp_load_s", "file_save_s", "file_load_s"):
        assert math.isfinite(row[key]) and row[key] >= 0, row
    # A GiB in 3 decimals: a tiny model's checkpoint rounds to 0.00x GiB.
    assert row["dcp_gib"] > 0 and row["file_gib"] > 0, row
    assert not list(tmp_path.iterdir()), "the tool left its checkpoints behind"
