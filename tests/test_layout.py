"""How the examples are laid out, read from their files, not run: the shared modules,
one source copied into the folders; the checkpointing programs' shared parts alike; a
main() that reads as a table of contents; files that stay light, and steps whose diffs
stay small. (What the examples do when they run is tested in test_examples.py and the
others.)"""

import ast
import itertools
import re
import subprocess

import copies
from smoke import EXAMPLES, EXAMPLES_DIR, load_main

# Every example: one file structure, and one source for its machinery.
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


# The machinery that every example needs lives in modules beside main.py, each with one
# source in examples/shared/, which `nox -s copies` (tests/tools/copies.py) copies into
# the folders that import it.
SHARED = copies.shared_modules()


def test_every_copy_of_a_shared_module_is_its_source():
    # Byte for byte: a fix is one edit, which the session carries to every folder. This
    # fails, too, where `nox -s copies` would change anything.
    assert copies.stale() == []


def test_every_example_takes_its_rank_and_device_from_the_modules():
    # The single-GPU steps run one process, with no process group: devices.py alone.
    single = {"generic/single_gpu", "mila/single_gpu"}
    assert copies.shared_modules().keys() == {
        "ranks", "devices", "stopping", "resumable_data", "checkpoint_files",
        "checkpoints",
    }  # fmt: skip
    for name in STRUCTURED:
        held = {copy.stem for copy in copies.wanted(EXAMPLES_DIR / name)}
        assert held >= ({"devices"} if name in single else {"devices", "ranks"}), name


def definitions_in(source: str) -> dict[str, str]:
    """The source of each top-level function and class, by name."""
    return {
        node.name: ast.get_source_segment(source, node)
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }


def test_no_main_py_defines_again_what_a_shared_module_holds():
    for name in STRUCTURED:
        held = copies.wanted(EXAMPLES_DIR / name).values()
        shared_names = {n for path in held for n in definitions_in(path.read_text())}
        again = shared_names & definitions_in(main_source(name)).keys()
        assert not again, f"{name}: defines {sorted(again)}; import them instead"


def test_each_module_stays_light():
    # A module is read whole where it first appears: about three screens at most.
    for path in [*SHARED.values(), *EXAMPLES_DIR.glob("*/*/*.py")]:
        if path.name != "main.py":
            lines = path.read_text().count("\n")
            assert lines <= 250, f"{path.relative_to(EXAMPLES_DIR)}: {lines} lines"


# The checkpointing programs (step 4 and those built on it) stop, save and resume
# through the same modules: how the ranks agree to stop or save and the job is requeued
# (stopping.py), the data's order on resume (resumable_data.py), atomic writes
# (checkpoint_files.py), and, for DDP, the checkpoints themselves (checkpoints.py). The
# tests of a save in one of them hold for all.
CHECKPOINTING = [
    name for name in STRUCTURED if (EXAMPLES_DIR / name / "stopping.py").exists()
]


def test_the_checkpointing_programs_stop_and_save_the_same_way():
    # With the container step: step 4's main.py in a container.
    assert len(CHECKPOINTING) == 5, CHECKPOINTING
    for name in CHECKPOINTING:
        held = {copy.stem for copy in copies.wanted(EXAMPLES_DIR / name)}
        assert {"stopping", "resumable_data", "checkpoint_files"} <= held, name
        # FSDP2 writes sharded checkpoints: its own kind, in its main.py.
        assert ("checkpoints" in held) == (name != "generic/fsdp"), name


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
    # Rank first, local rank second: an edit of setup() must never swap them, which
    # nothing would show on one node. (Its one source: every copy is the same bytes.)
    place = load_main("shared", "ranks.py").Place(rank=5, local_rank=1, world_size=8)
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
# diff changes (`diff -U0` of main.py against the step before, + and - lines), with no
# hunk of a generic step's diff over 110 lines. A budget only comes down. The aim where
# the file holds more today: FSDP2 900, with a checkpoint module of its own.
LINES = {
    "generic/single_gpu": 330, "mila/single_gpu": 330, "generic/multi_gpu": 375,
    "generic/multi_node": 375, "generic/checkpointing": 470, "generic/template": 650,
    "generic/fsdp": 1193, "launchers/lightning": 520, "launchers/accelerate": 376,
    "mila/checkpointing": 480,
}  # fmt: skip
DIFFS = {
    ("generic/single_gpu", "generic/multi_gpu"): 90,
    ("generic/multi_gpu", "generic/multi_node"): 15,
    ("generic/multi_node", "generic/checkpointing"): 140,
    ("generic/checkpointing", "generic/template"): 274,
    # Mila's step 1 unpacks its archive alone; step 2 adds the barrier that lets one
    # process of each node do it for the others. (+3 in both lines' step 1 -> 2 for the
    # refusal of a launch of several processes, test_examples.py.)
    ("mila/single_gpu", "mila/multi_gpu"): 102,
    ("mila/multi_gpu", "mila/multi_node"): 15,
    ("mila/multi_node", "mila/checkpointing"): 145,
    # The frameworks' examples against the step they train as (test_frameworks.py).
    ("generic/multi_node", "launchers/lightning"): 308,
    ("generic/multi_node", "launchers/accelerate"): 40,
}
GENERIC_STEPS = ["single_gpu", "multi_gpu", "multi_node", "checkpointing", "template"]


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


def test_no_step_adds_a_whole_file_in_one_hunk():
    # A step's diff is its lesson: no hunk of more than 110 changed lines, which would
    # be a file pasted in. (Up to step 4; the template's speed settings are new
    # functions, 113 lines in one hunk.)
    for before, after in itertools.pairwise(GENERIC_STEPS[:4]):
        diff = subprocess.run(
            ["diff", "-U0", EXAMPLES_DIR / "generic" / before / "main.py",
             EXAMPLES_DIR / "generic" / after / "main.py"],
            capture_output=True, text=True,
        ).stdout  # fmt: skip
        for hunk in re.split(r"^@@.*$", diff, flags=re.MULTILINE)[1:]:
            changed = [
                line for line in hunk.splitlines() if line.startswith(("+", "-"))
            ]
            assert len(changed) <= 110, f"{before} -> {after}: a hunk of {len(changed)}"
