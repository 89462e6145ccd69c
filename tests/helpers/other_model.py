"""The template with the language model's section (examples/generic/template/
language_model.py) in place of its section "Your model and data", as its docstring
tells a reader to make it: the section swapped, numpy imported, nothing else changed.
And token files for it to train on.

test_template.py trains, validates, stops and resumes the result, directly and under
Slurm; gpu_check.py runs it on a GPU with the GPU-only settings on.

    python tests/helpers/other_model.py FOLDER  # writes the template with it there
"""

import shutil
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "generic" / "template"
SECTION_START = "# ---- Your model and data"
SECTION_END = "# ---- Training"

# A tiny model and sequence: what the tests pass.
MODEL_ARGS = (
    "--vocab-size", "64", "--seq-len", "16", "--dim", "32", "--heads", "2",
    "--layers", "2",
)  # fmt: skip


def section(text: str) -> str:
    """The lines from the section's heading to the next section or the end. (A
    heading starts its line; the language model's docstring quotes them.)"""
    start = text.index("\n" + SECTION_START) + 1
    end = text.find("\n" + SECTION_END, start)
    return text[start : None if end == -1 else end + 1]


def write_language_model_template(folder: Path) -> Path:
    """A copy of the template folder in `folder`, main.py's section replaced."""
    shutil.copytree(TEMPLATE, folder)
    main = folder / "main.py"
    source = main.read_text()
    new = section((TEMPLATE / "language_model.py").read_text()).rstrip() + "\n\n\n"
    source = source.replace(section(source), new)
    main.write_text(
        source.replace("import torch\n", "import numpy as np\nimport torch\n", 1)
    )
    return folder


def write_token_files(folder: Path, train_sequences: int, val_sequences: int) -> Path:
    """train.bin and val.bin in `folder`: uint16 ids that count up by a stride that
    changes now and then, for --seq-len 16 and --vocab-size 64."""
    import numpy as np

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name, sequences in [("train.bin", train_sequences), ("val.bin", val_sequences)]:
        length = sequences * 16 + 1
        strides = np.repeat(rng.integers(1, 8, size=length // 32 + 1), 32)[:length]
        tokens = (rng.integers(64) + np.cumsum(strides)) % 64
        tokens.astype(np.uint16).tofile(folder / name)
    return folder


if __name__ == "__main__":
    print(write_language_model_template(Path(sys.argv[1])))
