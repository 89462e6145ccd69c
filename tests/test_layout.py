"""How the examples are laid out, read from their files, not run: one plumbing, the
same in every main.py; the checkpointing programs' shared parts alike; a main() that
reads as a table of contents; files that stay light, and steps whose diffs stay small.
(What the examples do when they run is tested in test_examples.py and the others.)"""

import ast
import re
import subprocess

from smoke import EXAMPLES, EXAMPLES_DIR, load_main

# Every example: one file structure, and one plumbing.
STRUCTURED = list(EXAMPLES)


def main_source(name: str) -> str:
    return (EXAMPLES_DIR / name / "main.py").read_text()


def test_every_example_folder_has_a_smoke_run():
    folders = {
        str(p.parent.relative_to(EXAMPLES_DIR)) for p in EXAMPLES_DIR.glob("**/main.py")
    }
    assert folders == set(EXAMPLES), (
        "add new examples to EXAMPLES in tests/helpers/smoke.py"
    )


def test_every_process_group_forks_its_workers_from_a_server():
    # A DataLoader worker fork()ed from a process that runs a process group's threads
    # can hang before it starts, on Python up to 3.11.9 (see "Training hangs when
    # validation begins" on the troubleshooting page). Every example with both must
    # start its workers from a server.
    both = [
        path.parent.relative_to(EXAMPLES_DIR)
        for path in sorted(EXAMPLES_DIR.glob("**/main.py"))
        if "DistributedDataParallel(" in (source := path.read_text())
        and re.search(r"num_workers", source)
    ]
    # Mila's and Ibex's multi-process steps, the generic steps 2 to 5, the launchers'
    assert len(both) >= 12, both
    for folder in both:
        source = (EXAMPLES_DIR / folder / "main.py").read_text()
        assert 'multiprocessing.set_start_method("forkserver", force=True)' in source, (
            folder
        )


# The plumbing section: what every example needs, the same in every file that has it.
PLUMBING = "# ---- Plumbing: the same in every example"


PLUMBING_NAMES = [
    "Place", "setup", "find_place", "rendezvous", "use_gpus", "get_device",
    "get_num_workers", "end_with_rank",
]  # fmt: skip


def plumbing(name: str) -> dict[str, str]:
    """The source of each definition in the example's plumbing section, by name."""
    source = (EXAMPLES_DIR / name / "main.py").read_text()
    assert PLUMBING in source, f"{name}: no plumbing section"
    section = source[source.index(PLUMBING) :]
    tree = ast.parse(section)
    return {
        node.name: ast.get_source_segment(section, node)
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }


def test_the_plumbing_is_the_same_in_every_example():
    reference = plumbing("generic/single_gpu")
    assert list(reference) == PLUMBING_NAMES
    for name in STRUCTURED:
        # Byte for byte: a fix in one copy must reach every other.
        assert plumbing(name) == reference, f"{name}: its plumbing differs"


# The checkpointing programs' own parts that must not drift apart: how the ranks agree
# to stop or save, and how a stop signal is noted.
CHECKPOINTING = [name for name in STRUCTURED if "class Checkpoint" in main_source(name)]


SHARED_BY_CHECKPOINTING = [
    "Agreement", "note_stop_signal", "catch_stop_signals", "start_fork_server",
    "ResumableSampler", "SeededSamples", "save_atomically", "requeue", "slurm_ends",
    "stop_for_good", "changes",
]  # fmt: skip


def definitions(name: str) -> dict[str, str]:
    source = main_source(name)
    return {
        node.name: ast.get_source_segment(source, node)
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }


# What the DDP ones share besides: their checkpoints, written and read the same way.
# The tests of a save in one of them hold for all three.
SHARED_BY_DDP_CHECKPOINTING = ["Checkpoint", "checkpoints", "readable_checkpoint"]


def test_the_checkpointing_programs_stop_and_save_the_same_way():
    assert len(CHECKPOINTING) == 5, CHECKPOINTING  # with the container step: step 4's
    reference = definitions("generic/checkpointing")
    for name in CHECKPOINTING:
        mine = definitions(name)
        shared = SHARED_BY_CHECKPOINTING
        if name != "generic/fsdp":
            shared = [*shared, *SHARED_BY_DDP_CHECKPOINTING]
        for part in shared:
            assert mine[part] == reference[part], f"{name}: its {part} differs"


def test_the_language_models_read_token_files_the_same_way():
    # The template's language model section and the FSDP2 step pick the token files'
    # integer type alike (tests/test_template.py runs both).
    section = (EXAMPLES_DIR / "generic/template/language_model.py").read_text()
    segments = [
        ast.get_source_segment(source, node)
        for source in (section, main_source("generic/fsdp"))
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == "token_dtype"
    ]
    assert len(segments) == 2 and segments[0] == segments[1]


def test_setup_gives_one_named_tuple_in_one_order():
    # Rank first, local rank second: a copy of setup() moved between files must never
    # swap them, which nothing would show on one node.
    for name in STRUCTURED:
        place = load_main(name).Place(rank=5, local_rank=1, world_size=8)
        assert tuple(place) == (5, 1, 8) and place.local_rank == 1


def test_every_main_is_a_table_of_contents():
    for path in sorted(EXAMPLES_DIR.glob("**/main.py")):
        name = str(path.parent.relative_to(EXAMPLES_DIR))
        if name not in STRUCTURED:
            continue
        [main] = [
            node
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and node.name == "main"
        ]
        # About a screen: the calls in order, with the comments that say why.
        assert main.end_lineno - main.lineno + 1 <= 60, f"{name}: main() too long"


# The most lines a reader opens whole (`wc -l` of main.py), and the most lines a step's
# diff changes (`diff -U0` of main.py against the step before, + and - lines). The aims:
# step 1 480, multi-node 530, step 4 850, template 950, FSDP2 1,250; diffs 1->2 120,
# 2->3 30, 3->4 300, 4->5 250. Where the behaviour that the tests hold takes more, the
# budget is what the file holds now. A budget grows only with a behaviour that a new
# test holds: +6 in every file for srun's variables under pyxis, +5 more in the
# checkpointing files for the requeue asked of job.sh (tests/test_containers.py), +1
# in the files that start the fork server at once (+1 in their diffs), for no server
# with no workers (tests/test_examples.py); +105 in the DDP checkpointing files and
# their diffs, +87 in FSDP2's, for the losses that Slurm's real events and a reader's
# own arguments showed (plain settings, unreadable checkpoints, leftovers, later steps
# kept, saves that block, storage that fails to read, requeues after SIGTERM alone and
# past a controller away, changed arguments logged, the token files' type): tests in
# test_checkpoint_files.py, test_slurm_events.py, test_resume.py, test_template.py.
LINES = {
    "generic/single_gpu": 508, "mila/single_gpu": 510, "generic/multi_node": 555,
    "generic/checkpointing": 1096, "generic/template": 1278, "generic/fsdp": 1617,
    "launchers/lightning": 706, "launchers/accelerate": 563,
}  # fmt: skip
DIFFS = {
    ("generic/single_gpu", "generic/multi_gpu"): 120,
    ("generic/multi_gpu", "generic/multi_node"): 30,
    ("generic/multi_node", "generic/checkpointing"): 585,
    ("generic/checkpointing", "generic/template"): 274,
    ("mila/single_gpu", "mila/multi_gpu"): 120,
    ("mila/multi_gpu", "mila/multi_node"): 30,
    ("mila/multi_node", "mila/checkpointing"): 591,
    # The frameworks' examples against the step they train as (test_frameworks.py).
    ("generic/multi_node", "launchers/lightning"): 303,
    ("generic/multi_node", "launchers/accelerate"): 40,
}


def test_each_main_py_stays_within_its_budget_of_lines():
    for name, most in LINES.items():
        lines = main_source(name).count("\n")
        assert lines <= most, f"{name}: {lines} lines, more than {most}"


def test_each_step_changes_few_lines_of_the_one_before():
    for (before, after), most in DIFFS.items():
        diff = subprocess.run(
            ["diff", "-U0", EXAMPLES_DIR / before / "main.py",
             EXAMPLES_DIR / after / "main.py"],
            capture_output=True, text=True,
        ).stdout  # fmt: skip
        changed = [
            line for line in diff.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++ ", "--- "))
        ]  # fmt: skip
        assert len(changed) <= most, f"{before} -> {after}: {len(changed)} lines"
