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

__all__ = ["sync", "Stopwatch", "time_call", "median_seconds", "quietly"]


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


def quietly(fn: Callable[[], Any]) -> Any:
    """``fn()`` with its warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "s >= N: exact attention" while the knob sweeps
        return fn()
