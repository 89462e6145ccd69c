"""A tiny synthetic TinyImageNet, in the real dataset's on-disk layout.

    root/wnids.txt                            one class ID (WordNet ID) per line
    root/words.txt                            class ID, tab, its name
    root/train/<wnid>/images/<wnid>_<i>.JPEG  64x64 JPEGs, one folder per class
    root/train/<wnid>/<wnid>_boxes.txt        bounding boxes (unused)
    root/val/images/val_<j>.JPEG              every validation image in one folder
    root/val/val_annotations.txt              file, tab, class ID, tab, bounding box

The Ibex examples read it with their real loading code: ImageFolder for train/, and the
annotations file for val/. make_folders() writes the simpler layout of one folder per
class, train/ and val/ alike, for the generic examples. Each class has
its own colour, so a model can learn it quickly.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from PIL import Image

SIZE = 64


def make(
    root: Path, classes: int = 5, train_per_class: int = 12, val_per_class: int = 5
):
    """Writes the dataset under `root`; returns {validation file name: class ID}."""
    rng = random.Random(0)
    wnids = [f"n{9000000 + i:08d}" for i in range(classes)]
    colours = {w: tuple(rng.randrange(256) for _ in range(3)) for w in wnids}
    root.mkdir(parents=True, exist_ok=True)
    (root / "wnids.txt").write_text("".join(f"{w}\n" for w in wnids))
    (root / "words.txt").write_text(
        "".join(f"{w}\tsynthetic class {w}\n" for w in wnids)
    )

    for wnid in wnids:
        images = root / "train" / wnid / "images"
        images.mkdir(parents=True, exist_ok=True)
        boxes = []
        for i in range(train_per_class):
            name = f"{wnid}_{i}.JPEG"
            _image(colours[wnid], rng).save(images / name, "JPEG")
            boxes.append(f"{name}\t0\t0\t{SIZE - 1}\t{SIZE - 1}\n")
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text("".join(boxes))

    # Validation classes are interleaved in a random order, as in the real file.
    val_classes = [w for w in wnids for _ in range(val_per_class)]
    rng.shuffle(val_classes)
    (root / "val" / "images").mkdir(parents=True, exist_ok=True)
    truth, lines = {}, []
    for j, wnid in enumerate(val_classes):
        name = f"val_{j}.JPEG"
        _image(colours[wnid], rng).save(root / "val" / "images" / name, "JPEG")
        truth[name] = wnid
        lines.append(f"{name}\t{wnid}\t0\t0\t{SIZE - 1}\t{SIZE - 1}\n")
    (root / "val" / "val_annotations.txt").write_text("".join(lines))
    return truth


def make_folders(
    root: Path, classes: int = 5, train_per_class: int = 26, val_per_class: int = 5
):
    """Writes train/<class>/ and val/<class>/ under `root`:
    the layout ImageFolder reads.

    That is the generic examples' input, as for ImageNet once its
    validation images are sorted into class folders.
    """
    rng = random.Random(1)
    for c in range(classes):
        colour = tuple(rng.randrange(256) for _ in range(3))
        for split, count in (("train", train_per_class), ("val", val_per_class)):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                _image(colour, rng).save(folder / f"{split}_{c}_{i}.JPEG", "JPEG")


def _image(colour: tuple[int, int, int], rng: random.Random) -> Image.Image:
    noise = bytes(rng.randrange(256) for _ in range(SIZE * SIZE * 3))
    return Image.blend(
        Image.new("RGB", (SIZE, SIZE), colour),
        Image.frombytes("RGB", (SIZE, SIZE), noise),
        0.3,
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/helpers/tinyimagenet.py DIR")
    make(Path(sys.argv[1]))
    print(f"synthetic TinyImageNet written to {sys.argv[1]}")
