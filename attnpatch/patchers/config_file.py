"""Saved configs (``patch(model, method, config=PATH)``): the JSON file's reading, writing and geometry check.

A config is ``{"method": NAME, "options": {...}, "geometry": {...}, ...notes}``.  This module reads and
writes the file and compares its recorded geometry with a model's; it does not validate options
(that is the registry's :func:`~attnpatch.patchers.registry.validate_options`, which reads configs
through :func:`load_config`, and :func:`~attnpatch.patchers.registry.write_config`, which validates
and then calls :func:`save_config`).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import OptionError
from .contract import Method, ModelGeometry

__all__ = ["GEOMETRY_FIELDS", "load_config", "save_config", "check_config_geometry"]

#: Geometry fields a saved config may record and :func:`check_config_geometry` compares.
GEOMETRY_FIELDS = ("num_layers", "heads", "kv_heads", "head_dim")


def save_config(path: str | Path, method: str, options: dict[str, Any], geometry: ModelGeometry | None = None,
                **extra: Any) -> Path:
    """Write ``{"method", "options", "geometry", ...extra}`` as JSON to ``path`` (parent folders created).

    ``options`` must be a complete, validated option dict of ``method`` (see
    :func:`~attnpatch.patchers.registry.write_config`, which validates them and calls this); tuples are
    written as JSON lists, infinities as ``Infinity``.  Of ``geometry`` the fields of :data:`GEOMETRY_FIELDS`
    that are known are recorded; ``extra`` holds plain data (what was measured, how it was chosen).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the file cannot be written.
        TypeError: ``options`` or ``extra`` hold something JSON cannot represent (nothing is written then).
    """
    data: dict[str, Any] = {"method": method, "options": options}
    if geometry is not None:
        data["geometry"] = {k: v for k, v in asdict(geometry).items() if k in GEOMETRY_FIELDS and v is not None}
    data.update(extra)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")  # serialised whole before the file is opened
    return path


def load_config(path: str | Path, method: Method | None = None) -> dict[str, Any]:
    """Read a saved config (``config=PATH``): ``{"method": NAME, "options": {...}, "geometry": {...}}``.

    Infinite floats may be written as JSON's ``Infinity``.  Only ``options`` (and ``geometry``, checked
    by :func:`check_config_geometry` at ``patch()``) are used; other keys are notes.

    Raises:
        OptionError: the file is missing or not such a JSON object, or it is for a method other than ``method``.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise OptionError(f"config={str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OptionError(f"config={str(path)!r}: not a readable JSON config ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("options"), dict) or not isinstance(data.get("method"), str):
        raise OptionError(f"config={str(path)!r}: expected a JSON object with \"method\" (a name) and \"options\" (an object)")
    geo = data.get("geometry")
    if geo is not None and (not isinstance(geo, dict) or any(
            not isinstance(geo.get(k, 0), int) or isinstance(geo.get(k), bool) for k in GEOMETRY_FIELDS)):
        raise OptionError(f"config={str(path)!r}: \"geometry\" must be an object of integers ({', '.join(GEOMETRY_FIELDS)})")
    if method is not None and data["method"] != method.name:
        raise OptionError(f"config={str(path)!r} is a config for method {data['method']!r}, not {method.name!r}")
    return data


def check_config_geometry(path: str | Path, geometry: ModelGeometry, model_name: str, *,
                          data: dict[str, Any] | None = None) -> None:
    """Refuse a saved config whose recorded geometry differs from the model's.

    Args:
        path: the config file (named in the message).
        geometry: the model's :class:`ModelGeometry`.
        model_name: how the message names the model.
        data: the file's content as :func:`load_config` returned it, where the caller has read it
            already (the file is then not read again); ``None`` reads ``path``.

    Raises:
        OptionError: a recorded field (layers, heads, KV heads, head size) differs; the message gives both;
            or (``data=None``) the file cannot be read as a config.
    """
    saved = (load_config(path) if data is None else data).get("geometry") or {}
    have = asdict(geometry)
    diff = [f"{k} {saved[k]} (model: {have[k]})" for k in GEOMETRY_FIELDS if k in saved and have.get(k) is not None and saved[k] != have[k]]
    if diff:
        raise OptionError(f"config={str(path)!r} was made for another model: {', '.join(diff)}; {model_name} does not fit it")
