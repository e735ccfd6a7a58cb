"""Timing utilities of the benches: wall time, peak extra memory, scaling exponents, and a competing process.

Memory is the peak of what a call allocates on top of its inputs (bytes): on CUDA from the caching
allocator's peak statistics, on the CPU from the PyTorch profiler's allocation events (tensors
alive across operator boundaries; a kernel's internal scratch is not seen).

Any bench can run beside a competing PyTorch process (:func:`background_load`, ``--background-load``):
a second program keeping every core busy, as a data-loader worker or another job does, is where
small multi-threaded kernels stall (measurements under such a load: docs/benchmarks/contention.md).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch

from ...errors import AttnpatchError, OptionError

__all__ = ["peak_extra_bytes", "scaling_exponent", "background_load", "BACKGROUND_LOAD_LIMIT_S"]

BACKGROUND_LOAD_LIMIT_S = 900.0


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated by one call of ``fn()`` above what was allocated before it.

    CUDA: ``torch.cuda.max_memory_allocated`` after a reset.  CPU: the PyTorch profiler's
    memory events (each top-level operator's allocations at its start, frees as they happen),
    so buffers alive across operator boundaries are counted and a fused kernel's internal
    tiles are not.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del out
        return int(peak)
    from torch.profiler import ProfilerActivity, profile

    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    points = []
    for e in prof.events():
        if e.name == "[memory]" or (e.cpu_parent is None and e.cpu_memory_usage):
            points.append((e.time_range.start, e.cpu_memory_usage))
    points.sort(key=lambda p: p[0])
    cur = peak = 0
    for _, b in points:
        cur += b
        peak = max(peak, cur)
    return int(peak)


@contextlib.contextmanager
def _native_stderr_silenced():
    """Silence file descriptor 2 (some PyTorch builds' profiler logs its start and stop there from C++)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def scaling_exponent(lengths: Sequence[float], seconds: Sequence[float]) -> float | None:
    """Slope of the least-squares line through ``(log N, log t)``: time grows like ``N ** slope``.

    Returns ``None`` with fewer than two points.
    """
    pts = [(math.log(n), math.log(t)) for n, t in zip(lengths, seconds) if t and t > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else None


# ---------------------------------------------------------------------------------------------
# a competing process

_LOAD_CODE = """
import os, sys, time
end = time.monotonic() + float(sys.argv[1])
parent = int(sys.argv[2])
import torch
a = torch.randn(int(sys.argv[3]), int(sys.argv[3]))
a = torch.tanh(a @ a)
print("ready", torch.get_num_threads(), flush=True)
n = 0
while time.monotonic() < end and os.getppid() == parent:
    a = torch.tanh(a @ a)
    n += 1
"""


@contextlib.contextmanager
def background_load(limit_s: float | None = BACKGROUND_LOAD_LIMIT_S, *, size: int = 512, start_timeout_s: float = 120.0):
    """Run the block beside a competing PyTorch process: ``a = torch.tanh(a @ a)`` on ``size x size`` float32, looped.

    The process is what a data-loader worker or a second job does to a machine: a PyTorch
    program with PyTorch's default thread count (one per core) keeping every core busy.  It is
    a subprocess of this one, started before the block (the block begins once it has imported
    PyTorch and run its first product) and killed when the block ends or fails; it also stops
    itself after ``limit_s`` seconds and when this process goes away, so it never outlives a
    killed bench by more than one product.

    Yields a dict recorded in the bench JSON: ``command``, ``pid``, ``size``, ``threads`` (the
    competitor's torch threads), ``limit_s``, ``seconds`` (how long it ran beside the block) and
    ``alive_at_end`` (``False`` when the block outlived ``limit_s`` or the process died, so part
    of the bench ran without the load).  With ``limit_s=None`` nothing is started and it yields
    ``None``.

    Raises:
        OptionError: ``limit_s`` or ``size`` not positive.
        AttnpatchError: the process did not start within ``start_timeout_s``.
    """
    import subprocess
    import threading

    if limit_s is None:
        yield None
        return
    if not limit_s > 0 or size < 1:
        raise OptionError(f"background load: limit_s={limit_s}, size={size}: both must be positive")
    argv = [sys.executable, "-c", _LOAD_CODE, repr(float(limit_s)), str(os.getpid()), str(int(size))]
    info: dict[str, Any] = {
        "command": f"python -c 'a = torch.randn({size}, {size}); while True: a = torch.tanh(a @ a)' (default torch threads)",
        "size": int(size), "limit_s": float(limit_s),
    }
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    t0 = time.perf_counter()
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(start_timeout_s)
        if not line or not line[0].startswith("ready"):
            raise AttnpatchError(f"background load: the competing process did not start within {start_timeout_s:.0f} s")
        info.update(pid=proc.pid, threads=int(line[0].split()[1]))
        t0 = time.perf_counter()
        yield info
    finally:
        info["alive_at_end"] = proc.poll() is None
        info["seconds"] = time.perf_counter() - t0
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a killed process always goes
            pass
        if proc.stdout is not None:
            proc.stdout.close()
