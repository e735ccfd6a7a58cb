"""Break-even lengths by measurement: from which input length a method's layer beats the model's own attention on the
device at hand (what ``min_len="auto"`` / ``min_tokens="auto"`` resolve to).

A method keeps a table of break-even lengths measured on some device types (the CPU).  On a device type without one,
the first patched forward that needs the value runs a short **calibration**: the method's layer and the model's own
attention (SDPA) on the method's documented synthetic input, timed side by side with the device synchronised, at a
ladder of lengths from short to long, within about :data:`BUDGET_SECONDS` seconds.  The break-even is the shortest
measured length from which the method was faster at every longer measured length; ``None`` (run the model's own
attention at every length) when it was slower at the longest length measured.  So the default is never slower than
the model's own attention on any device where the calibration could measure it, and is not switched off where it pays.

Where the value comes from, in order: the method's environment variable (a token count; ``never`` for no length),
the method's table for the device type, this process's earlier answer, the cache file, a calibration.  The cache
file is ``<cache>/break_even.json`` (:func:`attnpatch.fetch.cache_dir`: ``$ATTNPATCH_CACHE``, else
``~/.cache/attnpatch``), one entry per method setting, device name, dtype and head geometry; edit or delete it to
override or redo a calibration.  Under a multi-process launch local rank 0 measures (holding a lock on the cache)
and the other processes wait for its entry (at most :data:`WAIT_SECONDS`, then measure themselves), so the ranks
of a data-parallel run never measure at once.

Every value a run asked for is listed by :func:`resolved_break_evens`, which the result JSONs record
(``"break_even"``: value and source; the CLI starts a new list per command: :func:`begin_run`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..timing import median_seconds

__all__ = ["BUDGET_SECONDS", "BreakEven", "begin_run", "break_even_key", "calibrate", "device_name", "parse_env", "probe_inputs",
           "resolve_break_even", "resolved_break_evens", "cache_file"]

#: Wall-clock budget of one calibration (seconds): lengths whose estimated cost would pass it are not measured.
BUDGET_SECONDS = float(os.environ.get("ATTNPATCH_CALIBRATION_SECONDS", "10"))

#: How long a process other than local rank 0 waits for rank 0's calibration before measuring itself (seconds).
WAIT_SECONDS = 300.0

_RESOLVED: dict[str, "BreakEven"] = {}  # this process's answers (a memo, like functools.lru_cache), by key
_USED: dict[str, None] = {}  # the keys asked for since begin_run(), in order
_KEYS: dict[tuple, tuple[dict[str, Any], str]] = {}  # (method, setting, device, dtype, geometry) -> (key, its JSON)


@dataclass(frozen=True)
class BreakEven:
    """A resolved break-even length.

    Attributes:
        tokens: the length (tokens) from which the method runs; ``None``: it runs at no length (the model's own
            attention everywhere).
        source: ``"env:<VAR>"``, ``"table:<device type>"``, ``"cache:<path>"`` or ``"calibrated"``.
        key: what it was resolved for: method, setting, device name, dtype, heads, KV heads, head dim.
        timings: the calibration's ``[length, method seconds, dense seconds]`` rows (empty unless calibrated).
    """

    tokens: int | None
    source: str
    key: dict[str, Any]
    timings: tuple[tuple[int, float, float], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON form: ``{"tokens", "source", "timings", **key}``."""
        return {**self.key, "tokens": self.tokens, "source": self.source, "timings": [list(t) for t in self.timings]}


def device_name(device: torch.device) -> str:
    """The device's product name (``torch.cuda.get_device_name``), or ``"<type>"`` for other device types."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def break_even_key(method: str, setting: Mapping[str, Any], q: torch.Tensor, k: torch.Tensor) -> dict[str, Any]:
    """What a break-even depends on: the method and its setting, the device name, dtype and head geometry of
    ``q`` ``[B, H, N, D]`` and ``k`` ``[B, Hkv, N, D]``."""
    return {"method": method, "setting": {n: setting[n] for n in sorted(setting)}, "device": device_name(q.device),
            "dtype": str(q.dtype).removeprefix("torch."), "heads": int(q.shape[1]), "kv_heads": int(k.shape[1]),
            "head_dim": int(q.shape[-1])}


def cache_file() -> Path:
    """``<cache>/break_even.json`` (:func:`attnpatch.fetch.cache_dir`)."""
    from ..fetch import cache_dir

    return cache_dir() / "break_even.json"


def begin_run() -> None:
    """Start a new record of the break-evens a run asks for (the CLI calls it once per command; the measurements
    themselves stay cached for the process)."""
    _USED.clear()


def resolved_break_evens() -> list[dict[str, Any]]:
    """Every break-even asked for since :func:`begin_run` (since the process started, without one), as
    :meth:`BreakEven.as_dict`, in the order first asked."""
    return [_RESOLVED[k].as_dict() for k in _USED if k in _RESOLVED]


def probe_inputs(geometry, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q [1, H, 1, D], k [1, Hkv, 1, D])`` standing for a patched model's calls (uninitialised, one token: only
    device, dtype and geometry are read), so a method's ``prepare`` resolves its break-even at ``patch()`` time;
    ``None`` where the geometry (a :class:`~attnpatch.patchers.contract.ModelGeometry`) lacks heads or head size,
    or the model sits on ``meta``."""
    if not (geometry.heads and geometry.head_dim) or torch.device(device).type == "meta":
        return None
    q = torch.empty(1, geometry.heads, 1, geometry.head_dim, device=device, dtype=dtype)
    return q, q[:, : geometry.kv_heads or geometry.heads]


def _local_rank() -> int:
    """This process's rank on its machine under a multi-process launch (``LOCAL_RANK``, as torchrun and accelerate
    set it), else 0."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def calibrate(
    case: Callable[[int], tuple[Callable[[], Any], Callable[[], Any]]],
    lengths: Sequence[int],
    device: torch.device,
    *,
    budget: float | None = None,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    timer: Callable[[Callable[[], Any], int, torch.device], float] = median_seconds,
) -> tuple[int | None, tuple[tuple[int, float, float], ...]]:
    """Measure the break-even length.

    Args:
        case: ``n -> (method_call, dense_call)`` on the method's synthetic input of ``n`` tokens.
        lengths: increasing lengths to try (tokens).
        device: where the calls run (synchronised around each timed call).
        budget: seconds (``None``: :data:`BUDGET_SECONDS`, read at the call); a length is measured only while the
            time spent, plus the estimated cost of that length
            (the previous length's cost scaled by the length ratio squared), stays within it.
        repeats: timed calls per side and length (median), after one untimed warm-up call each
            (:func:`attnpatch.timing.median_seconds`).
        clock, timer: injectable for tests.

    Returns:
        ``(tokens, rows)``: the shortest measured length from which the method was faster at every longer measured
        length (``None`` when it was not faster at the longest one measured, or nothing fit the budget), and the
        ``(length, method seconds, dense seconds)`` rows measured.
    """
    budget = BUDGET_SECONDS if budget is None else budget
    start = clock()
    rows: list[tuple[int, float, float]] = []
    last_cost, last_n = 0.0, None
    for n in lengths:
        if last_n is not None:
            estimate = last_cost * (n / last_n) ** 2
            if clock() - start + estimate > budget:
                break
        t0 = clock()
        method_call, dense_call = case(n)
        t_method = timer(method_call, repeats, device)  # after a warm-up call (kernel compilation, caches)
        t_dense = timer(dense_call, repeats, device)
        rows.append((int(n), float(t_method), float(t_dense)))
        last_cost, last_n = clock() - t0, n
        if clock() - start > budget:
            break
    tokens = None
    for n, tm, td in reversed(rows):
        if tm < td:
            tokens = n
        else:
            break
    return tokens, tuple(rows)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path.lock`` (``fcntl``; a no-op where it is missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else []


def parse_env(var: str, value: str) -> int | None:
    """A break-even override: a token count >= 0, or ``never`` (``None``); raises ``OptionError`` naming ``var``."""
    from ..errors import OptionError

    if value.strip().lower() == "never":
        return None
    try:
        tokens = int(value)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise OptionError(f"{var}={value!r}: must be a token count >= 0 or 'never'")
    return tokens


def resolve_break_even(
    method: str,
    setting: Mapping[str, Any],
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    table: Mapping[str, int],
    env: str,
    lengths: Sequence[int],
    case: Callable[[int], tuple[Callable[[], Any], Callable[[], Any]]],
) -> BreakEven:
    """The break-even length of ``method`` with ``setting`` for inputs like ``q`` / ``k`` on their device.

    Args:
        method: the method's name.
        setting: the options the speed depends on (the break-even option itself left out).
        q, k: ``[B, H, N, D]`` / ``[B, Hkv, N, D]`` of the call that asks (device, dtype and geometry are read).
        table: measured break-even lengths by device type (``{"cpu": 600}``).
        env: the environment variable that overrides it on every device (tokens, or ``never``).
        lengths: the calibration's ladder (tokens, increasing).
        case: ``n -> (method_call, dense_call)`` on the method's synthetic input (see :func:`calibrate`).

    Raises:
        OptionError: the environment variable holds neither a token count nor ``never``.
    """
    fast = (method, tuple(sorted(setting.items())), q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1])
    if fast not in _KEYS:  # the key and its JSON once per setting and geometry: a patched layer asks on every call
        key = break_even_key(method, setting, q, k)
        _KEYS[fast] = key, json.dumps(key, sort_keys=True, default=str)
    key, memo = _KEYS[fast]
    _USED[memo] = None
    if os.environ.get(env) is not None:
        found = BreakEven(parse_env(env, os.environ[env]), f"env:{env}", key)
        _RESOLVED[memo] = found
        return found
    if q.device.type in table:
        found = BreakEven(int(table[q.device.type]), f"table:{q.device.type}", key)
        _RESOLVED[memo] = found
        return found
    if memo in _RESOLVED and _RESOLVED[memo].source.startswith(("calibrated", "cache:")):
        return _RESOLVED[memo]
    path = cache_file()
    want = json.loads(memo)

    def cached() -> BreakEven | None:
        for entry in _read(path):
            if {n: entry.get(n) for n in key} == want:
                return BreakEven(entry.get("tokens"), f"cache:{path}", key, tuple(tuple(r) for r in entry.get("timings", ())))
        return None

    found = None
    if _local_rank() != 0:  # under a multi-process launch, local rank 0 measures; the others wait for its entry
        deadline = time.monotonic() + WAIT_SECONDS
        while found is None and time.monotonic() < deadline:
            found = cached()
            if found is None:
                time.sleep(0.2)
    if found is None:
        with _locked(path):  # one process measures; another one arriving meanwhile reads its entry
            found = cached()
            if found is None:
                with torch.no_grad():
                    tokens, rows = calibrate(case, lengths, q.device)
                found = BreakEven(tokens, "calibrated", key, rows)
                entries = [e for e in _read(path) if {n: e.get(n) for n in key} != want] + [found.as_dict()]
                tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
                tmp.write_text(json.dumps(entries, indent=2))
                os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
    _RESOLVED[memo] = found
    return found
