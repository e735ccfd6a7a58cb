"""``attnpatch eval clip-benchmark``: CLIP_benchmark's own zero-shot classification and retrieval
(LAION-AI/CLIP_benchmark, the ``clip-benchmark`` extra) on a patched CLIP, dense and each setting side by side.

* :mod:`.runner` -- :func:`run_clip_benchmark` (load once; per setting patch, ``evaluate``, unpatch).
* :mod:`.data` -- :func:`load_bench_data`: CLIP_benchmark's dataset names or a local folder.
* :mod:`.encode` -- :class:`HarnessModel`, the ``encode_image`` / ``encode_text`` CLIP_benchmark calls, on any CLIP.
* :mod:`.shim` -- the numpy 2.4 fix of CLIP_benchmark 1.6.2's top-k accuracy (LAION-AI/CLIP_benchmark issue 147).
* :func:`upstream_result` -- one setting's result in the JSON layout ``clip_benchmark eval`` writes.
"""

from __future__ import annotations

from typing import Any

from ...errors import AttnpatchError
from .data import TASKS, BenchData, load_bench_data
from .encode import HarnessModel
from .runner import run_clip_benchmark, setting_label

__all__ = ["TASKS", "BenchData", "HarnessModel", "load_bench_data", "run_clip_benchmark", "setting_label", "require_clip_benchmark",
           "upstream_result"]

INSTALL_HINT = "attnpatch eval clip-benchmark needs CLIP_benchmark: pip install 'attnpatch[clip-benchmark]'"


def require_clip_benchmark() -> str:
    """CLIP_benchmark's version.

    Raises:
        AttnpatchError: ``clip_benchmark`` is not importable (one line: the install command).
    """
    try:
        import clip_benchmark  # noqa: F401
    except ImportError:
        raise AttnpatchError(INSTALL_HINT) from None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("clip_benchmark")
    except PackageNotFoundError:
        return "unknown"


def upstream_result(entry: dict[str, Any], *, dataset: str, model: str, pretrained: str, task: str, language: str, amp: bool) -> dict[str, Any]:
    """One setting in ``clip_benchmark eval``'s result layout (``{"dataset", "model", "pretrained", "task", "metrics",
    "language"}``), plus ``"amp"`` and the setting (``"method"``, ``"options"``, ``"towers"``; ``method`` ``None``
    for dense) so the file says what ran."""
    return {"dataset": dataset, "model": model, "pretrained": pretrained, "task": task, "metrics": entry["metrics"], "language": language,
            "amp": amp, "method": entry["method"], "options": entry["options"], "towers": entry["towers"]}
