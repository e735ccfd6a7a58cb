"""Caption sets: images with one or more captions each, for image-text retrieval."""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import DataError
from ...log import Log, log_stderr

__all__ = ["CAPTION_COLUMNS", "CaptionSet", "load_caption_set"]


CAPTION_COLUMNS = ("caption", "captions", "sentences", "txt", "text", "raw")


@dataclass
class CaptionSet:
    """Images with one or more captions each, decoded lazily.

    Attributes:
        name: folder name or hub id.
        source: resolved directory or hub id.
        split: the split loaded.
        captions: ``captions[i]`` is the list of captions of image ``i``.
        rows: ``[N]`` int64 row of each image in the full split.
        dataset: the underlying ``datasets.Dataset`` (restricted to ``rows``).
        image_column: name of the image column.
        caption_column: name of the caption column.
        file_paths: ``[N]`` the image file of each image (``None`` where stored as bytes), to name it in errors.
    """

    name: str
    source: str
    split: str
    captions: list[list[str]]
    rows: np.ndarray
    dataset: Any = field(repr=False)
    image_column: str = "image"
    caption_column: str = "caption"
    file_paths: list | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, i: int):
        """Image ``i`` as an RGB PIL image (alpha composited onto white).

        Raises:
            IndexError: ``i`` out of range.
            DataError: the image cannot be decoded (e.g. a truncated JPEG); the message names its file.
        """
        from ..vision.image_io import decode_image

        n = len(self)
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"CaptionSet index must be an int, got {type(i).__name__}")
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"image index {i} out of range for {n} images")
        return decode_image(self, j)

    @property
    def texts(self) -> list[str]:
        """Every caption, image by image (``[Nt]``)."""
        return [c for cs in self.captions for c in cs]

    @property
    def text_to_image(self) -> np.ndarray:
        """``[Nt]`` int64: the image of each caption in :attr:`texts`."""
        return np.repeat(np.arange(len(self.captions), dtype=np.int64), [len(c) for c in self.captions])


def _captions_of(value, row: int, column: str, name: str) -> list[str]:
    if isinstance(value, str):
        caps = value.splitlines()  # CLIP_benchmark's webdataset retrieval sets: one caption per line
    elif isinstance(value, (list, tuple)):
        caps = []
        for v in value:
            if isinstance(v, dict):  # Karpathy-style {"raw": ...} sentences
                v = v.get("raw", v.get("caption", v.get("text")))
            if not isinstance(v, str):
                raise DataError(f"{name}: row {row}, column {column!r}: expected strings, got {type(v).__name__}")
            caps.append(v)
    else:
        raise DataError(f"{name}: row {row}, column {column!r}: expected a string or a list of strings, got {type(value).__name__}")
    caps = [c.strip() for c in caps if c and c.strip()]
    if not caps:
        raise DataError(f"{name}: row {row} has no caption in column {column!r}")
    return caps


def load_caption_set(
    data: str | os.PathLike, split: str | None = None, caption_column: str | None = None, limit: int | None = None,
    log: Log = log_stderr,
) -> CaptionSet:
    """Load an image-caption set through ``datasets``.

    Args:
        data: an ``imagefolder`` directory whose ``metadata.jsonl`` has a caption column (e.g.
            ``shared/data/tuxpaint-captions``), a directory of webdataset shards (``<split>/*.tar``
            with ``.jpg`` + ``.txt`` members, CLIP_benchmark's layout), or a Hugging Face hub dataset id, e.g.
            ``clip-benchmark/wds_flickr30k`` / ``clip-benchmark/wds_mscoco_captions`` (Karpathy
            test splits, CLIP_benchmark's own copies: ``jpg`` images, ``txt`` captions one per
            line). The hub is probed first (TCP, 5 s) unless ``HF_HUB_OFFLINE`` /
            ``HF_DATASETS_OFFLINE`` is set, so an offline machine fails at once.
        split: split to load; ``None`` = ``"train"`` for an imagefolder directory (its split for a
            ``train/`` folder), ``"test"`` for webdataset shards and hub ids.
        caption_column: the caption column; ``None`` = the first of :data:`CAPTION_COLUMNS`
            present. A value may be one string (split into lines: one caption per line) or a list
            of strings (or of ``{"raw": ...}`` dicts).
        limit: keep the first ``limit`` images (dataset order), all their captions.
        log: one line per step.

    Returns:
        :class:`CaptionSet`.

    Raises:
        DataError: not a directory nor a loadable hub id (hub unreachable, unknown split), no image
            column, no caption column (the message lists the columns), an image without captions, an
            image file that is missing, not an image or truncated (the message names it).
        OptionError: ``limit`` not a positive int.
    """
    from ...hub import HUB_ID, env_true, hub_reachable
    from ..vision.images import check_limit, load_hf_dataset
    from ..vision.image_io import check_image_files, image_files

    import datasets

    limit = check_limit(limit)
    raw = os.fspath(data)
    path = Path(raw).expanduser()
    wds = False
    if path.is_dir():
        name, source, is_dir = path.resolve().name, str(path.resolve()), True
        wds = any(path.glob("*.tar")) or any(path.glob("*/*.tar"))  # a local copy of a webdataset set
    elif path.exists() or not HUB_ID.match(raw) or raw.startswith((".", "~")):
        what = "is a file, not a directory" if path.exists() else f"does not exist ({path.resolve()})"
        raise DataError(f"data={raw!r} {what}: pass an imagefolder directory with a caption column, or a hub dataset id")
    else:
        name, source, is_dir = raw, raw, False
        if not (env_true("HF_HUB_OFFLINE") or env_true("HF_DATASETS_OFFLINE")) and not hub_reachable():
            raise DataError(
                f"data={raw!r} is not a local directory, and the Hugging Face hub cannot be reached to load it as a "
                f"hub dataset id. Pass an imagefolder directory (images + metadata.jsonl with a caption column), or "
                f"set HF_HUB_OFFLINE=1 to use a copy in the local datasets cache."
            )
    split = split or ("train" if is_dir and not wds else "test")
    kind = "webdataset directory" if wds else "directory" if is_dir else "hub"
    log(f"loading caption set {name} ({kind} {source}, split {split}) ...")
    ds = load_hf_dataset(source, split, is_dir and not wds)  # datasets detects the webdataset layout by itself
    image_cols = [c for c, f in ds.features.items() if isinstance(f, datasets.Image)]
    if not image_cols:
        raise DataError(f"{name}: no image column (features: {dict(ds.features)})")
    if caption_column is None:
        caption_column = next((c for c in CAPTION_COLUMNS if c in ds.column_names), None)
        if caption_column is None:
            raise DataError(f"{name}: no caption column among {list(CAPTION_COLUMNS)} (columns: {ds.column_names}); pass caption_column")
    elif caption_column not in ds.column_names:
        raise DataError(f"{name}: caption_column={caption_column!r} is not a column (columns: {ds.column_names})")
    n = ds.num_rows if limit is None else min(limit, ds.num_rows)
    if n == 0:
        raise DataError(f"{name}: split {split!r} holds no images")
    files = image_files(ds, image_cols[0])[:n]
    if n < ds.num_rows:
        ds = ds.select(range(n))
    values = ds.data.column(caption_column).to_pylist()[:n]
    captions = [_captions_of(v, i, caption_column, name) for i, v in enumerate(values)]
    check_image_files(files, name)  # a missing, unreadable or truncated file fails now, not mid-run
    log(f"{name}: {n} images, {sum(map(len, captions))} captions")
    return CaptionSet(
        name=name, source=source, split=split, captions=captions, rows=np.arange(n, dtype=np.int64), dataset=ds,
        image_column=image_cols[0], caption_column=caption_column, file_paths=files,
    )
