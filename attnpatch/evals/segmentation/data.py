"""Semantic-segmentation sets: Pascal VOC 2012, ADE20k as released, and a ``datasets`` dataset with a mask column.

Every layout becomes a :class:`SegmentationSplit`: images and label maps by index, with the labels read as
``int16`` arrays of class indices ``0 .. K-1`` and :data:`VOID` for pixels the metric ignores.

* **VOC** (``JPEGImages/<id>.jpg``, ``SegmentationClass/<id>.png`` palette PNGs whose index is the class,
  ``ImageSets/Segmentation/<split>.txt``; 255 is void).  Class names from ``classes.json`` beside them
  (``[{"index", "name"}]``) where present, else VOC 2012's 21.
* **ADE20k** as released (``ADEChallengeData2016/images/{training,validation}/*.jpg``,
  ``annotations/{training,validation}/*.png``): 0 is void, classes 1..150 become 0..149; names from
  ``objectInfo150.csv`` / ``objectInfo150.txt`` where present, else ``class1`` ...
* **datasets**: a hub id or a folder ``datasets.load_dataset`` reads, with an image column and a mask
  column (``image_column``, ``mask_column``; ``classnames`` gives the classes), ``void`` the ignored value.

:func:`load_segmentation_set` checks everything it can without a model before any model work: a missing
split file, an empty split, a mask whose size differs from its image (naming the file), and label
values outside the classes that are not void.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...errors import DataError, OptionError

__all__ = ["VOID", "VOC_CLASSES", "SegmentationSplit", "SegmentationSet", "load_segmentation_set", "detect_layout"]

#: The ignored label inside the eval (every layout's void is mapped to it).
VOID = -1

#: Pascal VOC 2012's 21 classes (index = pixel value; 255 is void).
VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow", "diningtable", "dog",
    "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)

LAYOUTS = ("voc", "ade20k", "datasets")


@dataclass
class SegmentationSplit:
    """One split: ``len``, :meth:`image` (RGB PIL image) and :meth:`labels` (``[H, W]`` int16, :data:`VOID` ignored).

    Attributes:
        name: what the messages call the split (``"<set>/<split>"``).
        ids: one name per item (a file stem, or ``"row <i>"``).
        sizes: ``(width, height)`` per item, of the image (equal to its mask's: checked on load).
    """

    name: str
    ids: list[str]
    sizes: list[tuple[int, int]]
    _image: Callable[[int], object] = field(repr=False)
    _labels: Callable[[int], np.ndarray] = field(repr=False)

    def __len__(self) -> int:
        return len(self.ids)

    def image(self, i: int):
        """Item ``i``'s image as an RGB PIL image."""
        return self._image(i)

    def labels(self, i: int) -> np.ndarray:
        """Item ``i``'s label map ``[H, W]`` int16: class indices, :data:`VOID` where ignored."""
        return self._labels(i)

    def __getitem__(self, i: int):
        return self.image(i)

    def subset(self, idx) -> "SegmentationSplit":
        """The items ``idx`` (in that order) as a split of their own (e.g. a calibration share of val)."""
        idx = [int(i) for i in idx]
        return SegmentationSplit(self.name, [self.ids[i] for i in idx], [self.sizes[i] for i in idx],
                                 lambda i, f=self._image: f(idx[i]), lambda i, f=self._labels: f(idx[i]))


@dataclass
class SegmentationSet:
    """A train split (the head and the memory bank are fitted on it), a val split (scored) and the classes.

    Attributes:
        name: the set (folder name or dataset id); layout: ``"voc"``, ``"ade20k"`` or ``"datasets"``.
        classes: class names, index = class.
        void: the void value of the source files, as the JSON records it.
    """

    name: str
    layout: str
    train: SegmentationSplit
    val: SegmentationSplit
    classes: list[str]
    void: int

    def describe(self) -> dict:
        return {"name": self.name, "layout": self.layout, "classes": list(self.classes), "void": self.void,
                "train_images": len(self.train), "val_images": len(self.val)}


def detect_layout(data: str) -> str:
    """``"voc"``, ``"ade20k"`` or ``"datasets"`` for a path or dataset id."""
    p = Path(data)
    if p.is_dir():
        if (p / "JPEGImages").is_dir() and (p / "SegmentationClass").is_dir():
            return "voc"
        if (p / "images").is_dir() and (p / "annotations").is_dir() or (p / "ADEChallengeData2016").is_dir():
            return "ade20k"
    return "datasets"


def _rgb(path: Path):
    from ..vision.image_io import to_rgb
    from PIL import Image

    try:
        with Image.open(path) as im:
            return to_rgb(im)
    except OSError as err:
        raise DataError(f"{path}: cannot decode the image ({err})") from None


def _mask_array(path: Path) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as im:
            if im.mode not in ("P", "L", "I", "I;16"):
                raise DataError(f"{path}: a label map must be a single-channel (palette or grayscale) PNG, got mode {im.mode}")
            return np.asarray(im)
    except OSError as err:
        raise DataError(f"{path}: cannot decode the label map ({err})") from None


def _size_of(path: Path) -> tuple[int, int]:
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size
    except OSError as err:
        raise DataError(f"{path}: cannot open ({err})") from None


def _map_labels(raw: np.ndarray, k: int, void: int, offset: int, where: str) -> np.ndarray:
    """Source values to class indices (``value - offset``), void to :data:`VOID`; refuse anything else."""
    lab = raw.astype(np.int32) - offset
    is_void = raw == void
    bad = ~is_void & ((lab < 0) | (lab >= k))
    if bad.any():
        vals = sorted(int(v) for v in np.unique(raw[bad]))[:8]
        allowed = f"{offset}..{offset + k - 1}" + (f" and {void} (void)" if void is not None else "")
        raise DataError(f"{where}: label values {vals} are neither classes nor void; allowed: {allowed}")
    out = lab.astype(np.int16)
    out[is_void] = VOID
    return out


def _check_files(name: str, pairs: Sequence[tuple[Path, Path]], k: int, void: int, offset: int) -> list[tuple[int, int]]:
    """Each image opens whole (a truncated file is refused, :func:`~attnpatch.evals.vision.image_io.check_image_files`),
    each mask exists and has its image's size, every label value is a class or void, and some pixel of the split is
    labelled.  Returns the sizes."""
    from ..vision.image_io import check_image_files

    check_image_files([str(img) for img, _ in pairs], name)
    sizes, labelled = [], False
    for img, mask in pairs:
        if not mask.is_file():
            raise DataError(f"{mask}: missing (the label map of {img.name})")
        si, sm = _size_of(img), _size_of(mask)
        if si != sm:
            raise DataError(f"{mask}: label map of {sm[0]}x{sm[1]} px for an image of {si[0]}x{si[1]} px ({img.name}); they must match")
        lab = _map_labels(_mask_array(mask), k, void, offset, str(mask))  # every mask is checked
        labelled = labelled or bool((lab != VOID).any())
        sizes.append(si)
    if not labelled:
        raise DataError(f"{name}: every label pixel is void; nothing to fit or score")
    return sizes


def _file_split(name: str, pairs: list[tuple[Path, Path]], k: int, void: int, offset: int) -> SegmentationSplit:
    if not pairs:
        raise DataError(f"{name}: the split is empty")
    sizes = _check_files(name, pairs, k, void, offset)
    return SegmentationSplit(
        name=name, ids=[img.stem for img, _ in pairs], sizes=sizes,
        _image=lambda i: _rgb(pairs[i][0]),
        _labels=lambda i: _map_labels(_mask_array(pairs[i][1]), k, void, offset, str(pairs[i][1])),
    )


def _limit(pairs: list, limit: int | None) -> list:
    return pairs if limit is None else pairs[:limit]


def _voc(root: Path, train: str, val: str, limit: int | None, classnames: Sequence[str] | None) -> SegmentationSet:
    if classnames:
        classes = list(classnames)
    elif (root / "classes.json").is_file():
        entries = json.loads((root / "classes.json").read_text())
        classes = [e["name"] for e in sorted(entries, key=lambda e: int(e["index"]))]
    else:
        classes = list(VOC_CLASSES)
    splits = []
    for split in (train, val):
        f = root / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not f.is_file():
            have = sorted(p.stem for p in (root / "ImageSets" / "Segmentation").glob("*.txt"))
            raise DataError(f"{f}: missing split file; the splits there: {', '.join(have) or 'none'}")
        ids = [ln.strip() for ln in f.read_text().splitlines() if ln.strip()]
        pairs = [(root / "JPEGImages" / f"{i}.jpg", root / "SegmentationClass" / f"{i}.png") for i in ids]
        splits.append(_file_split(f"{root.name}/{split}", _limit(pairs, limit), len(classes), 255, 0))
    return SegmentationSet(root.name, "voc", splits[0], splits[1], classes, 255)


def _ade_classes(root: Path) -> list[str] | None:
    for name in ("objectInfo150.csv", "objectInfo150.txt"):
        f = root / name
        if not f.is_file():
            continue
        import csv

        sep = "," if name.endswith(".csv") else "\t"
        rows = list(csv.reader(f.read_text().splitlines(), delimiter=sep))
        names = [r[-1].split(";")[0].strip() for r in rows[1:] if r]
        if len(names) == 150:
            return names
    return None


def _ade(root: Path, train: str, val: str, limit: int | None, classnames: Sequence[str] | None) -> SegmentationSet:
    if (root / "ADEChallengeData2016").is_dir():
        root = root / "ADEChallengeData2016"
    classes = list(classnames) if classnames else (_ade_classes(root) or _ade_classes(root.parent) or [f"class{i}" for i in range(1, 151)])
    splits = []
    for split in (train, val):
        d = root / "images" / split
        if not d.is_dir():
            have = sorted(p.name for p in (root / "images").iterdir() if p.is_dir())
            raise DataError(f"{d}: missing split folder; the splits there: {', '.join(have) or 'none'}")
        imgs = sorted(p for p in d.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        pairs = [(p, root / "annotations" / split / f"{p.stem}.png") for p in imgs]
        splits.append(_file_split(f"{root.name}/{split}", _limit(pairs, limit), len(classes), 0, 1))
    return SegmentationSet(root.name, "ade20k", splits[0], splits[1], classes, 0)


def _load_split(data: str, split: str):
    """Split ``split`` of a ``datasets`` dataset: a folder ``save_to_disk`` wrote, or what ``load_dataset`` reads."""
    import datasets

    p = Path(data)
    try:
        if (p / "dataset_dict.json").is_file():
            dd = datasets.load_from_disk(data)
            if split not in dd:
                raise DataError(f"{data}: no split {split!r}; its splits: {', '.join(dd)}")
            return dd[split]
        return datasets.load_dataset(data, split=split)
    except DataError:
        raise
    except Exception as err:  # datasets raises many kinds (ValueError for a missing split, FileNotFoundError, ...)
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"could not load split {split!r} of {data!r} ({type(err).__name__}: {msg})") from None


def _datasets(data: str, train: str, val: str, limit: int | None, image_column: str, mask_column: str,
              classnames: Sequence[str] | None, void: int) -> SegmentationSet:
    from ..vision.image_io import to_rgb

    if not classnames:
        raise OptionError(f"{data}: a datasets dataset needs --classnames (the class names, index = mask value)")
    k = len(classnames)
    splits = []
    for split in (train, val):
        ds = _load_split(data, split)
        for col in (image_column, mask_column):
            if col not in ds.column_names:
                raise DataError(f"{data}/{split}: no column {col!r}; its columns: {', '.join(ds.column_names)}")
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        if len(ds) == 0:
            raise DataError(f"{data}/{split}: the split is empty")
        sizes, labelled = [], False
        for i in range(len(ds)):
            row = ds[i]
            img, mask = row[image_column], np.asarray(row[mask_column])
            if mask.ndim != 2:
                raise DataError(f"{data}/{split} row {i}: the mask column holds a {mask.shape} array; expected a single-channel label map")
            if (mask.shape[1], mask.shape[0]) != img.size:
                raise DataError(f"{data}/{split} row {i}: label map of {mask.shape[1]}x{mask.shape[0]} px for an image of "
                                f"{img.size[0]}x{img.size[1]} px; they must match")
            lab = _map_labels(mask, k, void, 0, f"{data}/{split} row {i}")  # every mask is checked
            labelled = labelled or bool((lab != VOID).any())
            sizes.append(img.size)
        if not labelled:
            raise DataError(f"{data}/{split}: every label pixel is void; nothing to fit or score")

        def image(i, ds=ds):
            return to_rgb(ds[i][image_column])

        def labels(i, ds=ds, split=split):
            return _map_labels(np.asarray(ds[i][mask_column]), k, void, 0, f"{data}/{split} row {i}")

        splits.append(SegmentationSplit(f"{data}/{split}", [f"row {i}" for i in range(len(ds))], sizes, image, labels))
    return SegmentationSet(Path(data).name or data, "datasets", splits[0], splits[1], list(classnames), void)


def _looks_like_dataset(root: Path) -> bool:
    """A folder ``datasets`` can read: ``save_to_disk``'s, or one holding data files (parquet, arrow, csv, json)."""
    if (root / "dataset_dict.json").is_file() or (root / "dataset_info.json").is_file():
        return True
    return any(p.suffix in (".parquet", ".arrow", ".csv", ".json", ".jsonl") and p.name != "classes.json"
               for p in root.rglob("*") if p.is_file())


def load_segmentation_set(
    data: str,
    *,
    train_split: str | None = None,
    val_split: str | None = None,
    limit: int | None = None,
    image_column: str = "image",
    mask_column: str = "annotation",
    classnames: Sequence[str] | None = None,
    void: int = 255,
) -> SegmentationSet:
    """Read a segmentation set and check it, before any model work.

    Args:
        data: a VOC folder, an ADE20k folder (``ADEChallengeData2016`` or its parent), or a ``datasets`` hub id / folder.
        train_split, val_split: split names (default: ``train`` / ``val`` for VOC, ``training`` / ``validation``
            for ADE20k, ``train`` / ``validation`` for ``datasets``).
        limit: at most this many images per split (the first ones).
        image_column, mask_column, classnames, void: the ``datasets`` layout's columns, class names (index =
            mask value) and ignored value (VOC: 255; ADE20k: 0 is void and 1..150 are the classes, fixed).

    Returns:
        A :class:`SegmentationSet`.

    Raises:
        DataError: a missing split file or folder, an empty split, a missing, truncated or unreadable image or mask,
            a mask whose size differs from its image (the message names the file), label values that are neither
            classes nor void, a split whose every label pixel is void, a folder of no known layout.
        OptionError: a ``datasets`` set without ``classnames``, or ``limit`` not a positive int.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise OptionError(f"limit={limit!r}: must be a positive int (images per split)")
    layout = detect_layout(data)
    root = Path(data)
    if layout == "voc":
        return _voc(root, train_split or "train", val_split or "val", limit, classnames)
    if layout == "ade20k":
        return _ade(root, train_split or "training", val_split or "validation", limit, classnames)
    expected = ("expected a Pascal VOC folder (JPEGImages/, SegmentationClass/, ImageSets/Segmentation/), an ADE20k folder "
                "(ADEChallengeData2016/ or images/ and annotations/) or a datasets dataset (a hub id, or a folder save_to_disk wrote)")
    if root.exists() and not root.is_dir():
        raise DataError(f"{data}: not a folder; {expected}")
    voc_parts = ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation")
    if root.is_dir() and any((root / d).is_dir() for d in voc_parts[:2]):
        missing = [d + "/" for d in voc_parts if not (root / d).is_dir()]
        raise DataError(f"{data}: a Pascal VOC folder without {', '.join(missing)}; {expected}")
    if root.is_dir() and not _looks_like_dataset(root):
        have = ", ".join(sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())[:8]) or "nothing"
        raise DataError(f"{data}: not a segmentation set (it holds {have}); {expected}")
    if not root.exists() and (data.startswith((".", "/", "~")) or data.count("/") > 1 or "\\" in data):
        raise DataError(f"{data}: no such folder; {expected}")
    return _datasets(data, train_split or "train", val_split or "validation", limit, image_column, mask_column, classnames, void)
