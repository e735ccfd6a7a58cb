"""The one timer of the project: wall time that waits for the device's queued work.

A GPU runs kernels asynchronously: a host clock read right after a call returns measures its kernel
launches, not its work.  Every timer here synchronises the device before it starts and before it stops
(``torch.cuda.synchronize``; nothing to wait for on the CPU), so a GPU time is the time of the work.
``bench``, ``compare``, ``tune``, ``eval ruler`` (the prefill timer) and the image and text passes of the
vision and CLIP evals, the patch's attention timing and the break-even calibration
(:mod:`attnpatch.patchers.break_even`) all time through this module.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .errors import OptionError

__all__ = ["interleaved_speedup", "sync", "Stopwatch", "time_call", "median_seconds", "quietly"]


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU.

    ``device=None`` waits for every CUDA device this process has initialised (none on a CPU-only run).
    """
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                torch.cuda.synchronize(i)
        return
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Wall time of a ``with`` block in seconds (``.seconds``), with the device synchronised at both ends.

    Args:
        device: the device whose queued work the block's time includes; ``None`` waits for every
            initialised CUDA device (nothing on a CPU-only run).
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.seconds: float | None = None
        self._t0 = 0.0

    def start(self) -> None:
        sync(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        sync(self.device)
        self.seconds = time.perf_counter() - self._t0
        return self.seconds

    def __enter__(self) -> "Stopwatch":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def time_call(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1, device: torch.device | str | None = None) -> list[float]:
    """Wall time of ``fn()`` in seconds, ``repeats`` times after ``warmup`` untimed calls (device synchronised).

    Args:
        device: as :class:`Stopwatch`; ``None`` waits for every initialised CUDA device.

    Raises:
        OptionError: ``repeats < 1`` or ``warmup < 0``.
    """
    if repeats < 1 or warmup < 0:
        raise OptionError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1 and warmup >= 0")
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        with Stopwatch(device) as sw:
            fn()
        out.append(sw.seconds)
    return out


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device | str | None = None) -> float:
    """Median wall time (seconds) of ``repeats`` calls of ``fn`` after one untimed call, without autograd."""
    with torch.no_grad():
        return statistics.median(time_call(fn, repeats=repeats, warmup=1, device=device))


def interleaved_speedup(
    fn: Callable[[], Any], candidate: Callable[[], Any], *, repeats: int = 5, warmup: int = 1,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Speed-up of ``fn`` run inside the context ``candidate()`` (e.g. a patch) over ``fn`` alone, timed in pairs.

    Each pair times both calls back to back, in the order reference-candidate, then candidate-reference, and so on
    (ABBA), so a machine whose speed drifts during the measurement moves both sides of a pair alike; the
    speed-up is the median of the pairs' ratios, the spread their 25th-75th percentiles.  The context is entered
    outside the timer (patching is not timed); no autograd; the device is synchronised around each call.

    Args:
        fn: the work to time (e.g. one forward on a fixed batch).
        candidate: returns a context manager inside which ``fn`` runs the candidate (``lambda: patched(model, m)``).
        repeats: pairs; warmup: untimed calls of each before them.

    Returns:
        ``{"speedup": median ratio, "spread": [25th, 75th percentile], "best": the fastest reference time over the
        fastest candidate time (what a competing job disturbs least), "reference_s": [...], "candidate_s": [...]}``
        (seconds per pair, in pair order).

    Raises:
        OptionError: ``repeats < 1`` or ``warmup < 0``.
    """
    if repeats < 1 or warmup < 0:
        raise OptionError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1 and warmup >= 0")

    def ref() -> float:
        with Stopwatch(device) as sw:
            fn()
        return sw.seconds

    def cand() -> float:
        with candidate():
            with Stopwatch(device) as sw:
                fn()
        return sw.seconds

    ref_s: list[float] = []
    cand_s: list[float] = []
    with torch.no_grad():
        for _ in range(warmup):
            ref()
            cand()
        for i in range(repeats):
            if i % 2 == 0:
                ref_s.append(ref())
                cand_s.append(cand())
            else:
                cand_s.append(cand())
                ref_s.append(ref())
    ratios = sorted(r / c for r, c in zip(ref_s, cand_s) if c > 0)
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return {"speedup": statistics.median(ratios), "spread": [q[0], q[2]], "best": min(ref_s) / min(cand_s),
            "reference_s": ref_s, "candidate_s": cand_s}


def quietly(fn: Callable[[], Any]) -> Any:
    """``fn()`` with its warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "s >= N: exact attention" while the knob sweeps
        return fn()
