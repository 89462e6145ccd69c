"""A model and data of another kind for the template's section "Your model and data":
sequences of 12 steps of 6 features (3-D batches, where images are 4-D), classified by a
GRU into 3 classes. Nothing else of main.py changes.

test_template.py trains, validates, stops and resumes the result on CPUs; gpu_check.py
runs it on a GPU with the GPU-only settings on.

    python tests/other_model.py FOLDER    # writes the template with it into FOLDER
"""

import shutil
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent / "examples" / "generic" / "template"

SEQUENCE_SECTION = """

def build_model(args, num_classes: int) -> nn.Module:
    return SequenceClassifier(features=6, hidden=32, classes=num_classes)


def make_datasets(args) -> tuple[Dataset, Dataset, int]:
    return Sequences(args.synthetic_size, 0), Sequences(50, args.synthetic_size), 3


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


def to_device(batch, device: torch.device) -> tuple[Tensor, Tensor]:
    inputs, target = batch
    return inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)


def correct(output: Tensor, target: Tensor) -> Tensor:
    return output.argmax(-1).eq(target).sum()


class SequenceClassifier(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        self.gru = nn.GRU(features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.gru(x)[0][:, -1])


class Sequences(Dataset):
    def __init__(self, length: int, first_seed: int):
        self.length, self.first_seed = length, first_seed

    def __len__(self):
        return self.length

    def __getitem__(self, index: int):
        label = index % 3
        noise = torch.randn(12, 6, generator=torch.Generator().manual_seed(
            self.first_seed + index))
        return noise + label, label


"""


def write_sequence_template(folder: Path) -> Path:
    """A copy of the template in `folder`, its section "Your model and data" replaced
    by SEQUENCE_SECTION, and nothing else changed."""
    shutil.copytree(TEMPLATE, folder)
    source = (folder / "main.py").read_text()
    start = source.index("# ---- Your model and data")
    start = source.index("\n", start) + 1
    end = source.index("# ---- Training")
    (folder / "main.py").write_text(source[:start] + SEQUENCE_SECTION + source[end:])
    return folder


if __name__ == "__main__":
    print(write_sequence_template(Path(sys.argv[1])))
