"""The Hugging Face hub, seen from an offline-friendly loader: offline mode, reachability, the local cache.

Every loader of attnpatch that may touch the hub (:mod:`attnpatch.checkpoints`,
:mod:`attnpatch.clip_models`, :mod:`attnpatch.evals.vision.images`, :mod:`attnpatch.evals.clip`) asks
the same three questions before it does, so that an offline machine gets a clear error at once
instead of a minute of retries:

* is offline mode on? (:func:`hub_offline` for models, :func:`datasets_offline` for datasets;
  the variables are read at call time, while ``huggingface_hub`` reads them once at import);
* is a file already in the local hub cache? (:func:`cached_hub_file`);
* does the hub endpoint accept a TCP connection within a few seconds? (:func:`hub_reachable`,
  :func:`host_reachable` for another download host).

Nothing here is imported eagerly: ``huggingface_hub`` and ``socket`` are imported when a function runs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

__all__ = [
    "HUB_ID",
    "cached_hub_file",
    "datasets_offline",
    "env_true",
    "host_reachable",
    "hub_cached_or_reachable",
    "hub_offline",
    "hub_reachable",
]

#: What a Hugging Face hub id looks like: ``"name"`` or ``"org/name"``.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def env_true(var: str) -> bool:
    """Whether environment variable ``var`` is set to ``1``, ``ON``, ``YES`` or ``TRUE`` (any case)."""
    return os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """Whether offline mode is on for models: ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``."""
    return env_true("HF_HUB_OFFLINE") or env_true("TRANSFORMERS_OFFLINE")


def datasets_offline() -> bool:
    """Whether offline mode is on for datasets: ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE``."""
    return env_true("HF_HUB_OFFLINE") or env_true("HF_DATASETS_OFFLINE")


def host_reachable(url: str, timeout: float = 5.0) -> bool:
    """Whether ``url``'s host accepts a TCP connection within ``timeout`` seconds (a fast offline check)."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=timeout):
            return True
    except (OSError, TypeError):
        return False


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hugging Face hub endpoint (``huggingface_hub.constants.ENDPOINT``) accepts a TCP connection within ``timeout`` seconds."""
    try:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    except (ImportError, AttributeError):  # pragma: no cover
        endpoint = "https://huggingface.co"
    return host_reachable(endpoint, timeout)


def cached_hub_file(repo: str, filenames: Sequence[str]) -> str | None:
    """Local path of the first of ``filenames`` of hub repo ``repo`` found in the local hub cache, else ``None``."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return None
    for f in filenames:
        hit = try_to_load_from_cache(repo, f)
        if isinstance(hit, str):
            return hit
    return None


def hub_cached_or_reachable(repo_id: str, timeout: float = 5.0) -> bool:
    """Whether ``repo_id``'s config is in the local hub cache, or the hub endpoint accepts a TCP connection within ``timeout`` seconds."""
    try:
        if cached_hub_file(repo_id, ["config.json"]) is not None:
            return True
    except Exception:  # noqa: BLE001  # pragma: no cover - e.g. an id huggingface_hub refuses
        pass
    return hub_reachable(timeout)
