"""Labelled image sets and model preprocessing for the frozen-feature evals.

Image sets
----------
:func:`load_image_set` reads a Hugging Face ``datasets`` *imagefolder* directory (a local
folder), a hub dataset id, or -- with no argument -- the embedded default set described below.
Every loader goes through ``datasets.load_dataset``, so a folder laid out for ``datasets`` (e.g.
``classes.json`` + ``train/metadata.jsonl`` + JPEGs, the layout of the sets in
``shared/data/README.md``) loads the same way a user's own folder does. Images stay lazy: an
:class:`ImageSet` decodes one image per ``set[i]``.

The embedded default set (``load_image_set(None)``) is built by :mod:`.default_set`.

Modules
-------
This module holds the image sets (folder, hub dataset); the default set is built in
:mod:`.default_set`, reading and checking image files is in :mod:`.image_io`, preprocessing in
:mod:`.preprocess`, and the Hugging Face hub checks in :mod:`attnpatch.hub`.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import DataError, OptionError
from ...hub import HUB_ID, datasets_offline, hub_reachable
from ...log import Log, log_stderr
from .default_set import default_image_set_dir
from .image_io import check_image_files, decode_image, image_files

__all__ = [
    "ImageSet",
    "check_metadata_files",
    "iter_batches",
    "load_image_set",
]


# ----------------------------------------------------------------------------- image sets


@dataclass
class ImageSet:
    """A labelled image set whose images are decoded one at a time.

    Attributes:
        name: short name (folder name, hub id, or ``"default"``).
        labels: ``[N]`` int64 class label of each image (the dataset's ``label`` column as stored).
        class_names: ``class_names[label]`` is the class's name: from ``classes.json``
            (``[{index, name}]``) when the folder has one, else the ``ClassLabel`` names of the
            ``label`` feature, else ``str(label)`` (a list of length ``max(label) + 1``). Names and labels
            come from one source: a set whose ``classes.json`` disagrees with its class sub-folders or its
            ``class_name`` column is refused at load (see :func:`load_image_set`).
        source: the directory (resolved) or hub id the set was loaded from.
        split: the split that was loaded.
        rows: ``[N]`` int64 row of each image in the full split (differs from ``arange(N)`` only
            when ``limit`` selected a subset).
        dataset: the underlying ``datasets.Dataset`` (already restricted to ``rows``).
        image_column: name of the image column in ``dataset``.
        file_paths: ``[N]`` the image file of each image (``None`` where the image is stored as
            bytes, e.g. in a hub dataset), read once at load; used to name the file in errors.
    """

    name: str
    labels: np.ndarray
    class_names: list[str]
    source: str
    split: str
    rows: np.ndarray
    dataset: Any = field(repr=False)
    image_column: str = "image"
    file_paths: list | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int):
        """``(PIL.Image in mode RGB, int label)`` of image ``i`` (negative indices count from the end).

        Raises:
            IndexError: ``i`` out of range.
            DataError: the image cannot be decoded (e.g. a truncated JPEG); the message names its file.
        """
        n = len(self)
        if not isinstance(i, numbers.Integral) or isinstance(i, bool):
            raise TypeError(f"ImageSet index must be an int, got {type(i).__name__}")
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"image index {i} out of range for {n} images")
        return decode_image(self, j), int(self.labels[j])

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        for i in range(len(self)):
            yield self[i]

    def subset(self, idx) -> "ImageSet":
        """The images ``idx`` (a sequence of indices, in that order) as an image set of their own (e.g. a calibration
        split); labels, rows and files follow them."""
        import dataclasses

        idx = [int(i) for i in idx]
        return dataclasses.replace(self, labels=self.labels[idx], rows=self.rows[idx], dataset=self.dataset.select(idx),
                                   file_paths=None if self.file_paths is None else [self.file_paths[i] for i in idx])

    @property
    def num_classes(self) -> int:
        """Number of distinct labels present in the set."""
        return int(np.unique(self.labels).size)

    def column(self, name: str) -> list:
        """Values of a non-image metadata column (e.g. ``"class_name"``, ``"wnid"``), one per image.

        Raises:
            DataError: no such column, or it is the image column (use indexing for images).
        """
        if name == self.image_column:
            raise DataError(f"{name!r} is the image column; use set[i] to decode one image at a time")
        if name not in self.dataset.column_names:
            raise DataError(f"no column {name!r} in {self.name}; columns: {self.dataset.column_names}")
        return list(self.dataset.select_columns([name])[name])

    def files(self) -> list[str | None]:
        """Path of each image file (``None`` for images stored as bytes), without decoding anything."""
        import datasets

        undecoded = self.dataset.cast_column(self.image_column, datasets.Image(decode=False))
        return [(v or {}).get("path") for v in undecoded[self.image_column]]


def check_limit(limit) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, numbers.Integral) or limit < 1:
        raise OptionError(f"limit={limit!r}: must be a positive int (number of images) or None (all images)")
    return int(limit)


def _stratified_first(labels: np.ndarray, limit: int) -> np.ndarray:
    """Rows of a deterministic class-balanced subset of size ``limit`` (see :func:`load_image_set`)."""
    n = labels.shape[0]
    order = np.argsort(labels, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    sorted_labels = labels[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_labels)) + 1]
    group_start = np.repeat(starts, np.diff(np.r_[starts, n]))
    rank[order] = np.arange(n) - group_start
    pick = np.lexsort((np.arange(n), labels, rank))[:limit]  # primary key: rank within class
    return np.sort(pick)


def check_metadata_files(folder: str | os.PathLike) -> None:
    """Each ``metadata.jsonl`` of an imagefolder (in the folder or one level down) must hold one JSON
    object per line; the message names the file and line (``datasets`` names neither)."""
    folder = Path(folder)
    for meta in [folder / "metadata.jsonl", *sorted(folder.glob("*/metadata.jsonl"))]:
        if not meta.is_file():
            continue
        try:
            with open(meta, encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line.strip())
                    except ValueError as err:
                        raise DataError(f"{meta}: line {i} is not valid JSON ({err})") from None
                    if not isinstance(row, dict):
                        raise DataError(f"{meta}: line {i} is not a JSON object (got {type(row).__name__})")
        except UnicodeDecodeError as err:
            raise DataError(f"{meta}: not a UTF-8 text file ({err.reason} at byte {err.start})") from None
        except OSError as err:
            raise DataError(f"{meta}: cannot be read ({err.strerror or err})") from None


def load_hf_dataset(data: str, split: str, is_dir: bool):
    import datasets

    if is_dir:
        check_metadata_files(data)
    try:
        if is_dir:
            return datasets.load_dataset("imagefolder", data_dir=data, split=split)
        return datasets.load_dataset(data, split=split)
    except ValueError as err:
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"could not load split {split!r} of {data!r}: {msg}") from err
    except Exception as err:  # datasets raises many kinds (FileNotFoundError, DatasetNotFoundError, ConnectionError ...)
        msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
        where = "the imagefolder directory" if is_dir else "the Hugging Face hub dataset"
        raise DataError(f"could not load {where} {data!r} ({type(err).__name__}: {msg})") from err


def load_image_set(
    data: str | os.PathLike | None = None,
    split: str = "train",
    limit: int | None = None,
    log: Log = log_stderr,
) -> ImageSet:
    """Load a labelled image set.

    Args:
        data: one of

            * an existing directory in Hugging Face ``datasets`` *imagefolder* layout, loaded with
              ``datasets.load_dataset("imagefolder", data_dir=data, split=split)`` -- e.g.
              ``classes.json`` + ``train/metadata.jsonl`` (with an int ``label`` column) + images,
              or one sub-folder per class (labels inferred as a ``ClassLabel``);
            * a Hugging Face hub dataset id (``"name"`` or ``"org/name"``), loaded with
              ``datasets.load_dataset(data, split=split)``; it must have an image column and a
              ``label`` column. The hub endpoint is probed first (TCP, 5 s), so without network the
              call fails at once instead of retrying; with ``HF_HUB_OFFLINE=1`` /
              ``HF_DATASETS_OFFLINE=1`` only the local ``datasets`` cache is used;
            * ``None``: the embedded default set (21 photographs, 9 classes; see the module
              docstring), built on first use from two registry packages (:func:`default_image_set_dir`).
        split: split to load (imagefolder derives it from the ``train/``, ``test/`` ... folder names).
        limit: keep at most this many images. The subset is deterministic and class-stratified
            (round robin): images are ranked by their position within their own class (in dataset
            order), ties broken by label, then by row; the first ``limit`` are kept, in dataset
            order. So every class gets its first image before any class gets a second one, and
            ``limit = m * num_classes`` keeps the first ``m`` images of every class (of the classes
            with at least ``m``). ``None`` keeps all.
        log: receives one line per step (defaults to stderr).

    Returns:
        :class:`ImageSet` of ``N`` images; ``labels`` is ``[N]`` int64.

    Raises:
        DataError: ``data`` looks like a path but is no directory; a hub id that cannot be loaded
            (hub unreachable, not found, offline and not cached); an unknown ``split``; no image
            column; no ``label`` column (for a folder with a single class sub-folder the message
            says so: the evals need at least two classes); negative labels; no images; fewer than 2
            distinct classes (after ``limit``); a ``classes.json`` that disagrees with the labels' other
            source -- class sub-folders (labels from the sorted folder names) whose names are not the
            ``classes.json`` names in label order, or a ``class_name`` column (of the kept rows) naming a
            label otherwise (checked before the image files); an image file (of the kept rows) that is missing,
            not an image, or truncated (see :func:`check_image_files`; the message names it).
        OptionError: ``limit`` is not a positive int.
    """
    limit = check_limit(limit)
    if data is None:
        path = default_image_set_dir(log=log)
        name, source, is_dir = "default", str(path), True
    else:
        raw = os.fspath(data)
        path = Path(raw).expanduser()
        if path.is_dir():
            name, source, is_dir = path.resolve().name, str(path.resolve()), True
        elif path.exists() or not HUB_ID.match(raw) or raw.startswith((".", "~")):
            what = "is a file, not a directory" if path.exists() else f"does not exist ({path.resolve()})"
            raise DataError(
                f"data={raw!r} {what}: pass an imagefolder directory (e.g. classes.json + "
                f"train/metadata.jsonl + images), a hub dataset id, or nothing for the default set"
            )
        else:
            name, source, is_dir = raw, raw, False
            if not datasets_offline() and not hub_reachable():
                raise DataError(
                    f"data={raw!r} is not a local directory, and the Hugging Face hub cannot be reached to "
                    f"load it as a hub dataset id. Pass an imagefolder directory, nothing for the embedded "
                    f"default set, or set HF_HUB_OFFLINE=1 to use a copy in the local datasets cache."
                )
            source = raw
    log(f"loading image set {name} ({'directory' if is_dir else 'hub'} {source}, split {split}) ...")
    ds = load_hf_dataset(str(source), split, is_dir)

    import datasets

    image_cols = [c for c, f in ds.features.items() if isinstance(f, datasets.Image)]
    if not image_cols:
        raise DataError(f"{name}: no image column (features: {dict(ds.features)})")
    if ds.num_rows == 0:
        raise DataError(f"{name}: split {split!r} holds no images")
    files = image_files(ds, image_cols[0])
    if "label" not in ds.column_names:
        raise DataError(_no_label_message(name, ds.column_names, files, path if is_dir else None))
    labels = np.asarray(ds.data.column("label").to_numpy(zero_copy_only=False), dtype=np.int64)
    if labels.min() < 0:
        raise DataError(f"{name}: negative labels ({int((labels < 0).sum())} images, e.g. {int(labels.min())}); unlabelled images are not supported")
    rows = np.arange(labels.shape[0], dtype=np.int64)
    if limit is not None and limit < labels.shape[0]:
        rows = _stratified_first(labels, limit)
        ds = ds.select(rows.tolist())
        labels = labels[rows]
    files = [files[int(r)] for r in rows]
    if np.unique(labels).size < 2:
        raise DataError(
            f"{name}: {np.unique(labels).size} distinct class(es) in {labels.shape[0]} images"
            + (f" (limit={limit})" if limit is not None else "")
            + "; the frozen-feature evals need at least 2 classes"
        )
    # names and labels must agree before any long work (the image checks, the model load)
    class_names = _class_names(path if is_dir else None, ds, labels, name, files)
    check_image_files(files, name)  # a missing, unreadable or truncated file fails now, not mid-run
    log(f"{name}: {labels.shape[0]} images, {np.unique(labels).size} classes")
    return ImageSet(
        name=name, labels=labels, class_names=class_names, source=str(source), split=split,
        rows=rows, dataset=ds, image_column=image_cols[0], file_paths=files,
    )


def _no_label_message(name: str, columns: list, files: list, folder: Path | None) -> str:
    """Why a set has no ``label`` column; an imagefolder infers one only from two or more class sub-folders."""
    parents = sorted({str(Path(f).parent) for f in files if f})
    has_meta = folder is not None and ((folder / "metadata.jsonl").is_file() or any(folder.glob("*/metadata.jsonl")))
    if has_meta:
        return (
            f"{name}: no 'label' column (columns: {columns}): its metadata.jsonl has no int 'label' field; "
            f"add one (the class index of each image), or lay the images out in one sub-folder per class (at least two)"
        )
    if folder is not None and len(parents) == 1:
        parent = Path(parents[0])
        split_dirs = {"train", "test", "val", "valid", "validation", "dev", "eval"}
        where = (
            f"all {len(files)} images sit in one class sub-folder ({parent.name}/)"
            if parent.resolve() != folder.resolve() and parent.name.lower() not in split_dirs
            else f"all {len(files)} images sit in {parent}, with no class sub-folders"
        )
        return (
            f"{name}: no 'label' column, as there is only one class: {where}; the evals need at least two classes: "
            f"one sub-folder per class (at least two), or a metadata.jsonl with an int 'label' field"
        )
    return (
        f"{name}: no 'label' column (columns: {columns}); an imagefolder needs either a metadata.jsonl with an int "
        f"'label' field or one sub-folder per class (at least two classes)"
    )


def _read_classes_json(path: Path) -> dict[int, str]:
    """``{index: name}`` of a ``classes.json`` (a list of ``{index, name}`` objects, or ``{"index": name}``)."""
    try:
        entries = json.loads(path.read_text())
        if isinstance(entries, Mapping):
            entries = [{"index": int(k), "name": v} for k, v in entries.items()]
        return {int(e["index"]): str(e["name"]) for e in entries}
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: expected a list of {{index, name}} objects ({err})") from err


def _class_names(folder: Path | None, ds, labels: np.ndarray, name: str, files: list | None = None) -> list[str]:
    """``class_names[label]``, from one source that agrees with the labels (see :class:`ImageSet`).

    Labels come from a ``metadata.jsonl`` ``label`` column, or -- without one -- from the class sub-folders
    (a ``ClassLabel``, its names the sorted folder names), or from a hub dataset's ``label`` feature. Names come
    from ``classes.json`` when the folder has one, else from the ``ClassLabel``, else ``str(label)``. Where two
    of these disagree the set is refused (``DataError``): a ``classes.json`` whose names are not the class
    sub-folders' names in label order, or a ``class_name`` column (metadata.jsonl) that names a label other
    than ``classes.json`` does.
    """
    import datasets

    n = int(labels.max()) + 1
    feature = ds.features["label"]
    feat_names = [str(x) for x in feature.names] if isinstance(feature, datasets.ClassLabel) and feature.names else None
    classes_json = folder / "classes.json" if folder is not None else None
    if classes_json is not None and classes_json.is_file():
        names = _read_classes_json(classes_json)
        if feat_names is not None:
            _check_folders_match(classes_json, names, feat_names, folder)
        missing = sorted(set(np.unique(labels).tolist()) - set(names))
        if missing:
            raise DataError(f"{name}: labels {missing[:10]} have no entry in {classes_json}")
        if "class_name" in ds.column_names:
            _check_class_name_column(classes_json, names, ds, labels, files)
        return [names.get(i, str(i)) for i in range(max(n, max(names) + 1))]
    if feat_names:
        return feat_names
    return [str(i) for i in range(n)]


def _check_folders_match(classes_json: Path, names: dict[int, str], feat_names: list[str], folder: Path) -> None:
    """Labels inferred from class sub-folders (sorted folder names) and a ``classes.json`` must name the same classes
    in the same order; otherwise an image would carry another class's name (e.g. in zero-shot prompts)."""
    diffs = [(i, f, names.get(i)) for i, f in enumerate(feat_names) if names.get(i) != f]
    extra = sorted(i for i in names if not 0 <= i < len(feat_names))
    if not diffs and not extra:
        return
    shown = ", ".join(f"{f}/" for f in feat_names[:6]) + (", ..." if len(feat_names) > 6 else "")
    if diffs:
        i, f, c = diffs[0]
        what = f"label {i} is sub-folder {f}/ but {classes_json.name} names it {c!r}" if c is not None else \
            f"label {i} is sub-folder {f}/ but {classes_json.name} has no index {i}"
        more = f" ({len(diffs)} of {len(feat_names)} labels differ)" if len(diffs) > 1 else ""
    else:
        what, more = f"{classes_json.name} lists indices {extra[:5]} beyond the {len(feat_names)} class sub-folders", ""
    raise DataError(
        f"{classes_json} disagrees with the class sub-folders of {folder}, which give the labels (sorted folder names: "
        f"{shown}): {what}{more}; list the sub-folder names in that order in {classes_json.name}, remove it, "
        f"or give each image's label in a metadata.jsonl"
    )


def _check_class_name_column(classes_json: Path, names: dict[int, str], ds, labels: np.ndarray, files: list | None) -> None:
    """A ``class_name`` column (metadata.jsonl) next to the ``label`` column must name each label as ``classes.json`` does."""
    col = list(ds.select_columns(["class_name"])["class_name"])  # the kept rows (ds.data is the whole table)
    bad = [j for j, (lab, cn) in enumerate(zip(labels.tolist(), col)) if cn is not None and str(cn) != names.get(lab, str(cn))]
    if not bad:
        return
    j = bad[0]
    where = f" ({Path(files[j]).name})" if files and j < len(files) and files[j] else ""
    raise DataError(
        f"metadata.jsonl disagrees with {classes_json}: an image{where} has label {int(labels[j])}, which "
        f"{classes_json.name} names {names.get(int(labels[j]))!r}, but class_name {col[j]!r} ({len(bad)} of {len(col)} "
        f"images differ); make the label and class_name columns of metadata.jsonl agree with {classes_json.name}"
    )


def iter_batches(image_set: ImageSet, batch_size: int, preprocess: Callable, indices: Sequence[int] | None = None):
    """Yield ``(pixel_values [b, 3, R, R], labels [b] int64)`` over ``image_set`` in order.

    Args:
        image_set: the images.
        batch_size: images per batch (positive int).
        preprocess: e.g. a :class:`Preprocess` from :func:`make_preprocess`.
        indices: which images (default all), in the order given.

    Raises:
        OptionError: ``batch_size`` is not a positive int.
    """
    import torch

    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise OptionError(f"batch_size={batch_size!r}: must be a positive int")
    idx = list(range(len(image_set))) if indices is None else [int(i) for i in indices]
    for s in range(0, len(idx), batch_size):
        chunk = idx[s : s + batch_size]
        items = [image_set[i] for i in chunk]
        yield preprocess([im for im, _ in items]), torch.tensor([lab for _, lab in items], dtype=torch.int64)
