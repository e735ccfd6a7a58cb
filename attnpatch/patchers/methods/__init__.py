"""The attention methods, one module each; every module of this package is imported, and registers
its method with :func:`~attnpatch.patchers.registry.register_method`, when the package is imported.

A new method is one new file here (its config with the option declarations, forward, check,
capabilities, exact limit and, optionally, bench hook; see ``dense.py`` for the smallest one):
:func:`discover` finds it, nothing else needs an edit.  Modules whose name starts with ``_`` hold
shared helpers and are imported only by the methods that use them.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

__all__ = ["discover"]


def discover(package: str = __name__, path: list[str] | None = None) -> list[ModuleType]:
    """Import every module of ``package`` (this one by default) whose name does not start with ``_``, in name order.

    Args:
        package: dotted name of the package the modules belong to.
        path: the folders to scan (default: the package's ``__path__``).

    Returns:
        The imported modules (importing one registers its method).
    """
    if path is None:
        path = list(importlib.import_module(package).__path__)
    names = sorted(info.name for info in pkgutil.iter_modules(path) if not info.name.startswith("_"))
    return [importlib.import_module(f"{package}.{name}") for name in names]


discover()
