"""The snippets on the concepts and troubleshooting pages
give the results the pages state."""

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from page_text import DOCS
from smoke import base_env, decode_records

SNIPPETS = Path(__file__).resolve().parent.parent / "docs" / "snippets"


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_collectives_give_the_documented_results(world_size, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={world_size}", str(SNIPPETS / "collectives.py"),
         str(tmp_path)],
        env=base_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # The processes share torchrun's stdout, where their lines can run into each other.
    records = sorted(decode_records(result.stdout, '{"rank"'), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == list(range(world_size))
    total = world_size * (world_size + 1) / 2  # 1 + 2 + ... + world_size
    for r in records:
        assert r["world_size"] == world_size
        assert r["all_reduce"] == total
        assert r["reduce"] == (total if r["rank"] == 0 else None)
        assert r["broadcast"] == 100.0
        assert r["all_gather"] == [10.0 * k for k in range(world_size)]
        assert r["barrier"] is True


def test_sampler_pitfalls_show_what_the_troubleshooting_page_says():
    sys.path.insert(0, str(SNIPPETS))
    try:
        import sampler_pitfalls as pitfalls
    finally:
        sys.path.remove(str(SNIPPETS))
    # Without set_epoch, every epoch repeats the first
    # epoch's order; with it, each differs.
    without = pitfalls.epoch_orders(100, epochs=3, call_set_epoch=False)
    assert without[0] == without[1] == without[2]
    with_set_epoch = pitfalls.epoch_orders(100, epochs=3, call_set_epoch=True)
    assert with_set_epoch[0] != with_set_epoch[1] != with_set_epoch[2]
    assert sorted(without[0]) == sorted(set(without[0]))
    # 25 samples over 2 and 3 ranks: padding counts 26 and 27; strided shards count 25.
    assert pitfalls.samples_validated(25, 2) == 26
    assert pitfalls.samples_validated(25, 3) == 27
    assert pitfalls.samples_validated_exactly(25, 2) == 25
    assert pitfalls.samples_validated_exactly(25, 3) == 25


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_restart_changes_the_last_bits_only_beyond_two_processes(world_size):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={world_size}", str(SNIPPETS / "resume_bits.py")],
        env=base_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    [record] = decode_records(result.stdout, '{"world_size"')
    assert record["world_size"] == world_size
    # Two numbers add up the same in either order; four do not, and the first step after
    # a restart adds them in another order unless DDP keeps a single one.
    if world_size == 2:
        assert record["differing"] == []
    else:
        assert record["differing"], record
    assert record["differing_with_one_order"] == []


def test_an_unused_parameter_gives_ddps_error_and_each_fix_removes_it():
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node=2", str(SNIPPETS / "unused_parameters.py")],
        # As the page advises, so that the message names the parameters too.
        env={**base_env(), "TORCH_DISTRIBUTED_DEBUG": "INFO"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = sorted(decode_records(result.stdout, '{"rank"'), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        # The troubleshooting page's heading quotes the start of the message.
        assert r["error"].startswith(
            "Expected to have finished reduction in the prior iteration before "
            "starting a new one. This error indicates that your module has parameters "
            "that were not used in producing loss."
        ), r["error"]
        names = "extra_head.bias, extra_head.weight"
        assert r["names"] == [
            f"Parameters which did not receive grad for rank {r['rank']}: {names}"
        ]
        assert r["find_unused_parameters"] is None
        assert r["requires_grad_false"] is None


def test_py_spy_reads_native_frames_only_without_nonblocking():
    # The page's advice for C++ frames: --native in place of stacks.sh's --nonblocking,
    # as py-spy refuses the two together. No Slurm needed: a sleeping Python process.
    page = " ".join((DOCS / "troubleshooting.md").read_text().split())
    assert "replace `--nonblocking` with `--native`" in page
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(1)
        pid = str(sleeper.pid)
        both = subprocess.run(
            [py_spy, "dump", "--native", "--nonblocking", "--pid", pid],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert both.returncode != 0
        assert "--nonblocking" in both.stdout + both.stderr
        native = subprocess.run(
            [py_spy, "dump", "--native", "--pid", pid],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert native.returncode == 0, native.stderr
        # A C frame under the Python one: the libc call that time.sleep makes.
        assert re.search(r"^\s+\w*sleep \(libc\.so", native.stdout, re.M), native.stdout
    finally:
        sleeper.kill()
