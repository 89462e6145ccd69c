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


def test_copies_finds_and_writes_every_stale_copy(tmp_path, monkeypatch):
    # nox -s copies on a small tree: a module that imports another, a folder that
    # imports the first, a stale copy, a missing one, and one that nothing imports.
    import copies

    shared, folder, other = (tmp_path / p for p in ("shared", "a/step", "a/other"))
    for path in (shared, folder, other):
        path.mkdir(parents=True)
    (shared / "ranks.py").write_text("import devices\nRANKS = 1\n")
    (shared / "devices.py").write_text("DEVICES = 1\n")
    (folder / "main.py").write_text("from ranks import RANKS\n")
    (folder / "ranks.py").write_text("RANKS = 0\n")  # an edit of a copy
    (other / "main.py").write_text("print()\n")
    (other / "devices.py").write_text("DEVICES = 1\n")  # imported by nothing
    monkeypatch.setattr(copies, "EXAMPLES_DIR", tmp_path)
    monkeypatch.setattr(copies, "SHARED_DIR", shared)
    assert sorted(copies.stale()) == [
        "a/other/devices.py: no file imports it",
        "a/step/devices.py: differs from shared/devices.py",
        "a/step/ranks.py: differs from shared/ranks.py",
    ]
    assert len(copies.write()) == 3 and copies.stale() == []
    assert (folder / "ranks.py").read_text() == (shared / "ranks.py").read_text()
    assert not (other / "devices.py").exists()
