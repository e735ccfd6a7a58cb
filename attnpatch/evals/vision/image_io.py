"""Image files of a set: decoding one image to RGB, and checking files before a run without decoding them all.

:func:`check_image_files` refuses a missing, unreadable or truncated file up front, naming it;
:func:`decode_image` names the file when an image fails later; :func:`to_rgb` is the one RGB
conversion every image goes through (alpha onto white, 16-bit grayscale scaled, not clipped).
The image sets that read files through it: :mod:`attnpatch.evals.vision.images`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...errors import AttnpatchError, DataError, first_line

__all__ = ["WIDE_GRAY_MODES", "check_image_files", "decode_image", "image_files"]


def decode_image(image_set, j: int):
    """Row ``j`` of ``image_set.dataset`` decoded as an RGB PIL image, or a :class:`DataError` naming its file."""
    try:
        return to_rgb(image_set.dataset[j][image_set.image_column])
    except (KeyboardInterrupt, AttnpatchError):
        raise
    except Exception as err:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError ... on a bad file
        files = getattr(image_set, "file_paths", None)
        where = files[j] if files and files[j] else f"{image_set.name}: image {j} (row {int(image_set.rows[j])})"
        raise DataError(
            f"{where}: cannot decode the image ({type(err).__name__}: {first_line(err)}); remove it from the set "
            f"(or replace it) and run again"
        ) from None


def image_files(ds, column: str) -> list:
    """The file path of each row's image (``None`` where it is stored as bytes), without decoding anything.

    Reads the ``path`` field of the image column's Arrow storage (the rows of ``ds.data``, so call it
    before ``select``)."""
    col = ds.data.column(column)
    out: list = []
    for chunk in col.chunks:
        try:
            paths = chunk.field("path").to_pylist()
            stored = chunk.field("bytes").is_valid().to_pylist()
        except (KeyError, AttributeError, TypeError):
            return [None] * len(ds.data)
        out.extend(None if has_bytes else p for p, has_bytes in zip(paths, stored))
    return out


_TAIL = 4096


def _looks_truncated(path: str, fmt: str | None) -> bool:
    """Whether the end of the file lacks the format's end marker (cheap: reads the last few KB)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - _TAIL))
        tail = f.read()
        if fmt == "JPEG":
            return b"\xff\xd9" not in tail
        if fmt == "PNG":
            return b"IEND" not in tail[-64:]
        if fmt == "GIF":
            return not tail.rstrip(b"\x00").endswith(b"\x3b")
        if fmt == "WEBP":
            f.seek(4)
            riff = int.from_bytes(f.read(4), "little")
            return riff + 8 > size
    return False


def check_image_files(files: Sequence, name: str = "") -> None:
    """Check image files before a run, without decoding them all: each must exist and open as an
    image (its header is read), and a JPEG / PNG / GIF / WebP must end with its format's end marker
    (a truncated file does not). Only a file whose end looks wrong is decoded, to confirm (so
    trailing bytes after a valid image are accepted). Damage in the middle of a file is caught when
    the image is decoded (:func:`decode_image` names the file then).

    Args:
        files: image paths; ``None`` entries (images stored as bytes) are skipped.
        name: the set's name, for the message.

    Raises:
        DataError: one line naming the first bad file, what is wrong, and how many bad files there are.
    """
    from PIL import Image

    bad: list[tuple[str, str]] = []
    for path in files:
        if not path:
            continue
        why = None
        if not os.path.isfile(path):
            why = "the file does not exist"
        elif os.path.getsize(path) == 0:
            why = "an empty file (0 bytes)"
        else:
            try:
                with Image.open(path) as im:
                    fmt = im.format
                    if _looks_truncated(path, fmt):
                        try:
                            im.load()
                        except Exception as err:  # noqa: BLE001
                            why = f"a truncated or corrupt {fmt} file ({first_line(err)})"
            except (KeyboardInterrupt, AttnpatchError):
                raise
            except Exception as err:  # noqa: BLE001 - PIL.UnidentifiedImageError, OSError, SyntaxError ...
                why = f"not an image file PIL can read ({type(err).__name__}: {first_line(err)})"
        if why:
            bad.append((str(path), why))
    if bad:
        path, why = bad[0]
        more = f"; {len(bad) - 1} more bad image file(s): {', '.join(Path(p).name for p, _ in bad[1:4])}" if len(bad) > 1 else ""
        meta = " and its row in metadata.jsonl" if (Path(path).parent / "metadata.jsonl").is_file() else ""
        raise DataError(f"{path}: {why}; remove it{meta} from the set (or replace it) and run again{more}")


#: PIL modes of 16-bit (and 32-bit integer) grayscale images, e.g. a 16-bit PNG or TIFF.
WIDE_GRAY_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def to_rgb(img):
    """RGB copy of a PIL image; alpha is composited onto opaque white (as in ``shared/data``).

    16-bit grayscale (PIL modes :data:`WIDE_GRAY_MODES`: ``I;16``, ``I;16B``, ``I;16L``, ``I;16N``,
    and ``I``, as which older Pillow opens a 16-bit PNG) is scaled to 8 bits as ``round(v / 257)``
    (0 -> 0, 65535 -> 255; values above 65535 of a 32-bit ``I`` image clip to 255), then copied to
    the three channels. (PIL's own ``convert("RGB")`` clips instead of scaling, which turns a
    typical 16-bit image almost entirely white.)
    """
    from PIL import Image

    if img.mode in WIDE_GRAY_MODES:
        wide = np.asarray(img).astype(np.float64)
        gray = np.clip(np.rint(wide / 257.0), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        bg.alpha_composite(rgba)
        return bg.convert("RGB")
    if img.mode != "RGB":
        return img.convert("RGB")
    img.load()
    return img
