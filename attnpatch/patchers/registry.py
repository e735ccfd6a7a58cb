"""The registry of attention methods and the validation of their options.

Methods live one per file in :mod:`attnpatch.patchers.methods` and register themselves with
:func:`register_method` when that package imports them; :func:`get_method` / :func:`list_methods`
look them up; :func:`validate_options` turns user options (with the pseudo-options ``preset`` and
``config``) into a method's complete option dict; :func:`write_config` validates options and saves
them as a config file.

The method contract (:class:`~.contract.Method`, :class:`~.contract.ModelGeometry`, ...) lives in
:mod:`.contract`, the config file's reading and geometry check in :mod:`.config_file`; both are
re-exported here, where callers imported them before the split.  The table in docs/methods.md is
:mod:`.method_table` (above this module).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import OptionError, UnknownMethodError
from .config_file import check_config_geometry, load_config, save_config
from .contract import MODEL_FEATURES, MODEL_KINDS, ExactLimit, Knob, Method, ModelGeometry, Option, Preset

__all__ = [
    "METHODS", "register_method", "get_method", "list_methods", "validate_options", "resolve_options", "write_config",
    # re-exported (defined in .contract / .config_file)
    "Option", "Method", "ExactLimit", "Knob", "Preset", "ModelGeometry", "MODEL_FEATURES", "MODEL_KINDS",
    "load_config", "check_config_geometry",
]


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add ``method`` to the registry.

    Raises:
        ValueError: a method of that name is already registered, or one of its presets sets an
            unknown option or a value its option refuses.
    """
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    for name, p in method.presets.items():
        try:
            validate_options(method, dict(p.options))
        except OptionError as e:
            raise ValueError(f"method {method.name!r}, preset {name!r}: {e}") from None
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The registered method called ``name``.

    Raises:
        UnknownMethodError: no such method; the message lists the registered ones.
    """
    if name not in METHODS:
        raise UnknownMethodError(f"unknown method {name!r}; registered methods: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def list_methods() -> list[dict[str, Any]]:
    """Every registered method as a plain dict (see :meth:`Method.describe`), sorted by name."""
    return [METHODS[n].describe() for n in sorted(METHODS)]


def validate_options(method: Method, options: dict[str, Any]) -> dict[str, Any]:
    """:func:`resolve_options` without the config file's content: the complete option dict.

    Raises:
        The errors of :func:`resolve_options`.
    """
    return resolve_options(method, options)[0]


def resolve_options(method: Method, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Fill defaults, check names, types and declared ranges, and build the method config once
    for its cross-option checks.

    The pseudo-option ``preset`` (a name of :attr:`Method.presets`) puts the preset's values in
    place of the defaults; the pseudo-option ``config`` (the path of a JSON config, see
    :func:`load_config`) puts its saved options over those; the other options given win over both.

    Returns:
        ``(options, config)``: the complete option dict (defaults included; ``preset`` replaced by the
        values it stands for; ``config`` kept beside the values it stands for, so that passing the dict on
        to ``patch()`` still checks the model against the config's recorded geometry), and the config file's
        content as :func:`~attnpatch.patchers.config_file.load_config` read it (``None`` without ``config``),
        so that ``patch()`` checks its geometry without reading the file again.

    Raises:
        OptionError: unknown option name (the message lists the allowed ones), unknown preset (the
            message lists the method's presets), a config file that cannot be read, is for another
            method or holds a bad option (the message names the file), a preset beside a config, wrong type or out-of-range value (the message
            names the value and what is allowed).
    """
    options = dict(options)
    base = {n: o.default for n, o in method.options.items()}
    config = None
    loaded = None
    if "config" in options and "config" in method.pseudo_options:  # else refused below as unknown
        config = options.pop("config")
        if isinstance(config, Path):
            config = str(config)
        if not isinstance(config, str):
            raise OptionError(f"config={config!r}: must be the path of a JSON config (a string)")
        if "preset" in options:
            raise OptionError(
                f"preset={options['preset']!r} and config={config!r}: give one of them (a saved config holds every option; "
                "options given beside a config win over it)"
            )
        loaded = load_config(config, method)
        saved = loaded["options"]
        if "config" in saved:
            raise OptionError(f"config={config!r}: its options name another config ({saved['config']!r}); a config cannot")
        try:
            base = validate_options(method, saved)
        except OptionError as e:
            raise OptionError(f"config={config!r}: {e}") from None
    if "preset" in options:
        name = options.pop("preset")
        if not method.presets:
            raise OptionError(f"preset={name!r}: method {method.name!r} has no presets")
        if not isinstance(name, str) or name not in method.presets:
            raise OptionError(f"preset={name!r} for method {method.name!r}: allowed: {', '.join(method.presets)}")
        for n, v in method.presets[name].options.items():
            base[n] = method.options[n].coerce(v)
    unknown = sorted(set(options) - set(method.options))
    if unknown:
        names = list(method.options) + method.pseudo_options
        allowed = f"allowed: {', '.join(names)}" if names else "it takes no options"
        raise OptionError(f"unknown option(s) {', '.join(unknown)} for method {method.name!r}; {allowed}")
    full = base
    for n, v in options.items():
        full[n] = method.options[n].coerce(v)
    method.build_config(full)  # cross-option checks live in the config's constructor
    if config is not None:
        full["config"] = config  # kept, so that patch() checks the model against the geometry the config records
    return full, loaded


def write_config(path: str | Path, method: Method | str, options: dict[str, Any], geometry: ModelGeometry | None = None,
                 **extra: Any) -> Path:
    """Write ``{"method", "options", "geometry", ...extra}`` as JSON to ``path``, for ``patch(model, method, config=path)``.

    ``options`` are validated first (:func:`validate_options`); ``geometry`` is the model's
    (:class:`ModelGeometry`, e.g. :func:`attnpatch.model_geometry`) when the options name its layers or
    heads, so that loading them on another model is refused; ``extra`` holds plain data (what was
    measured, how it was chosen).  The file is written by :func:`~attnpatch.patchers.config_file.save_config`.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        UnknownMethodError: ``method`` is a name no method is registered under.
        OptionError: an option is invalid, or (with ``geometry``) does not fit the model (a layer it lacks, a
            per-layer schedule of another length).
    """
    if isinstance(method, str):
        method = get_method(method)
    full = validate_options(method, options)
    full.pop("config", None)
    if geometry is not None and method.check is not None:  # what patch() would refuse on this model, refused now
        method.check(method.make_config(full), geometry)
    return save_config(path, method.name, full, geometry, **extra)
