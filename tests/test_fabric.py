"""The fabric check (examples/generic/fabric): all_reduce timed on every rank, with
nccl-tests' bandwidths, and a sum whose answer is known."""

import argparse
import subprocess

import pytest
import torch
import torch.distributed as dist
from page_text import page_command
from smoke import check_run, load_main

FABRIC = "generic/fabric"


def test_every_rank_times_every_size_and_the_ranks_agree(smoke_run):
    run = smoke_run(FABRIC)
    assert check_run(run) == [], run.output
    world_size = run.launch.world_size
    assert [s["rank"] for s in run.summaries] == list(range(world_size))
    for rank in range(world_size):
        assert f"[{rank}/{world_size}] Running on" in run.output
    # --max-bytes 256K from 1 KiB by 4: five sizes, each timed.
    sizes = [1024, 4096, 16384, 65536, 262144]
    for s in run.summaries:
        assert s["backend"] == "gloo"
        assert [r["bytes"] for r in s["results"]] == sizes
        for r in s["results"]:
            assert r["time_us"] > 0
            assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
            assert r["busbw_gbps"] == pytest.approx(
                r["algbw_gbps"] * 2 * (world_size - 1) / world_size
            )
    # Rank 0 prints the table, a row per size.
    rows = [line for line in run.output.splitlines() if "[0/2]" in line]
    assert sum(any(f" {size} " in row for row in rows) for size in sizes) == 5


def test_bandwidths_and_sizes_follow_nccl_tests():
    fabric = load_main(FABRIC)
    # doc/PERFORMANCE.md of NVIDIA/nccl-tests: busbw = algbw * 2 (n - 1) / n.
    assert fabric.bus_bandwidth(10.0, 8) == pytest.approx(17.5)
    assert fabric.bus_bandwidth(10.0, 2) == pytest.approx(10.0)
    assert fabric.bus_bandwidth(10.0, 1) == 0.0  # one process sends nothing
    sizes = fabric.message_sizes(2**10, 2**30, 4)
    assert sizes[0] == 1024 and sizes[-1] == 2**30 and len(sizes) == 11
    assert fabric.message_sizes(8, 100, 2) == [8, 16, 32, 64]


@pytest.mark.parametrize(
    ("text", "value"), [("4096", 4096), ("64K", 65536), ("16m", 2**24), ("1G", 2**30)]
)
def test_sizes_are_read_in_bytes_k_m_and_g(text, value):
    assert load_main(FABRIC).size_in_bytes(text) == value


@pytest.mark.parametrize(
    ("text", "message"),
    [("ten", "is not a size"), ("6", "not a whole number of 4-byte"), ("0", "not a")],
)
def test_a_bad_size_is_refused_with_the_reason(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        load_main(FABRIC).size_in_bytes(text)


def test_a_sum_that_comes_out_wrong_stops_with_the_rank_and_what_to_do():
    # One real process, which believes it is rank 0 of 2: its all_reduce adds only
    # its own 1, not the 1 + 2 that two processes would give.
    fabric = load_main(FABRIC)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensor = torch.empty(16)
        place = load_main(FABRIC, "ranks.py").Place
        fabric.check_sum(tensor, place(0, 0, 1))  # the truth: passes
        assert (tensor == 1).all()
        with pytest.raises(SystemExit, match=r"rank 0: .* 16 wrong \(expected 3"):
            fabric.check_sum(tensor, place(0, 0, 2))
    finally:
        dist.destroy_process_group()


# NCCL's start-up lines about the network, in the format NCCL_DEBUG=INFO writes them
# (host:pid:tid [device] NCCL INFO ...): two processes over InfiniBand, one that fell
# back to sockets, a plugin's name, connections, and one unrelated line.
NCCL_LINES = """\
gpu1:101:101 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB ib0:10.1.0.1<0>
gpu1:101:101 [0] NCCL INFO Using network IB
gpu1:102:102 [1] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB ib0:10.1.0.1<0>
gpu1:102:102 [1] NCCL INFO Using network IB
gpu2:201:201 [0] NCCL INFO NET/IB : No device found.
gpu2:201:201 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>
gpu2:201:201 [0] NCCL INFO Using network Socket
gpu2:201:201 [0] NCCL INFO cudaDriverVersion 13000
gpu1:101:130 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM
gpu1:102:131 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA
gpu2:201:230 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [receive] via NET/Socket/0
gpu1:101:101 [0] NCCL INFO Using network IBext_v8
"""


def test_the_pages_grep_counts_each_network_line(tmp_path):
    command = page_command("fabric.md", "grep ")
    (tmp_path / "slurm-12345.out").write_text("summary: {}\n" + NCCL_LINES)
    result = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    counts = {
        line.split(None, 1)[1]: int(line.split()[0])
        for line in result.stdout.splitlines()
    }
    assert counts == {
        "NET/IB : Using [0]mlx5_0:1/IB [RO]": 2,
        "NET/IB : No device found.": 1,
        "NET/Socket : Using [0]eth0:10.0.0.2<0>": 1,
        "Using network IB": 2,
        "Using network IBext_v8": 1,
        "Using network Socket": 1,
        "via NET/IB/0/GDRDMA": 1,
        "via NET/Socket/0": 1,
        "via P2P/CUMEM": 1,
    }
