"""The image pass shared by the image evals (:mod:`attnpatch.evals.vision`, :mod:`attnpatch.evals.clip`).

:func:`run_image_pass` encodes a set of images in batches, dense and under each patched setting,
interleaved batch by batch (so every setting sees the same machine state), timing each forward
call. A batch is kept only once every setting has finished it, so a Ctrl-C (a
``KeyboardInterrupt``) leaves the results of whole batches: the pass then returns what was
finished with ``interrupted`` set, and the eval computes its result over those images and hands it
to :func:`finish`, which raises :class:`~attnpatch.evals.run.report.EvalInterrupted` carrying it.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import OptionError
from ...patchers.api import patch_info, patched, record_stats
from ...patchers.registry import get_method, validate_options
from ..run.distributed import Ranks
from ..run.report import EvalInterrupted, exact_modes
from ..run.resume import BatchStore
from ...timing import Stopwatch

__all__ = ["SettingRun", "ImagePass", "resolve_settings", "count_sampled_at", "run_image_pass", "finish", "throughput", "run_labels",
           "speedup_spread", "timing_summary"]

Settings = Sequence[tuple[str, dict[str, Any]]]


def resolve_settings(settings: Settings, model: torch.nn.Module | None = None, towers: Any = None) -> tuple[list[tuple[str, dict]], list[dict]]:
    """Validated ``(method, full options)`` pairs and the options as given.

    With ``model``, each setting is also patched onto it once (and removed), so a method or tower
    that does not fit fails before anything is encoded.

    Raises:
        UnknownMethodError / OptionError / UnsupportedModelError: a bad setting.
    """
    given = [dict(o) for _, o in settings]
    out = [(m, validate_options(get_method(m), dict(o))) for m, o in settings]
    if model is not None:
        for m, o in out:
            with patched(model, m, towers=towers, **o):
                pass
    return out, given


def count_sampled_at(layers: dict, counts: dict[int, int]) -> dict[int, int]:
    """Add, per image of one forward call's layer records, the first layer that used FNA landmarks to ``counts`` (layer -> images)."""
    first: dict[int, int] = {}
    for li in sorted(layers):
        lm = layers[li].landmarks
        if lm is not None:
            for bi in range(lm.shape[0]):
                if bi not in first and int(lm[bi, 0]) >= 0:
                    first[bi] = li
    for li in first.values():
        counts[li] = counts.get(li, 0) + 1
    return counts


@dataclass
class SettingRun:
    """What one patched setting produced over the finished batches.

    Attributes:
        outputs: ``encode``'s output, one per batch.
        extras: the ``after_setting`` hook's output, one per batch (empty without the hook).
        seconds: forward time of the timed calls.
        batch_seconds: the same, per batch; batch_speedups: dense's time over this setting's, per batch.
        sampled_at: layer -> images whose first FNA landmark layer it was (:func:`count_sampled_at`).
        modes: the attention modes the patched layers ran (``record_stats`` layer records).
        towers: the towers the patch routed (``patch_info(model)["towers"]``).
    """

    outputs: list = field(default_factory=list)
    extras: list = field(default_factory=list)
    seconds: float = 0.0
    batch_seconds: list[float] = field(default_factory=list)
    batch_speedups: list[float] = field(default_factory=list)
    sampled_at: dict[int, int] = field(default_factory=dict)
    modes: set[str] = field(default_factory=set)
    towers: Any = None


@dataclass
class ImagePass:
    """The result of :func:`run_image_pass` over the finished batches.

    Attributes:
        n: images finished (whole batches); n_planned: images in the set; batch_size: images per forward call.
        interrupted: the pass stopped at a Ctrl-C after at least one finished batch.
        resolution: input side in pixels of the last batch; tokens: tokens per image seen by the
            patched layers (``None`` when no setting recorded any).
        dense: dense ``encode`` output per batch; dense_seconds: their forward time; dense_batch_seconds: per batch.
        runs: one :class:`SettingRun` per setting, in order.
        ranks: per process of the run, ``{"rank", "batches" (first image index of each batch it encoded),
            "images", "wall_s", "dense_s_median", "seconds_median" (per setting; medians over its batches, seconds)}``.
        resumed_batches: batches read back from the store of an earlier run (``--resume``).
    """

    n: int
    n_planned: int
    batch_size: int
    interrupted: bool
    resolution: int | None
    tokens: int | None
    dense: list
    dense_seconds: float
    runs: list[SettingRun]
    ranks: list[dict[str, Any]] = field(default_factory=list)
    dense_batch_seconds: list[float] = field(default_factory=list)
    resumed_batches: int = 0


def _image_of(item):
    return item[0] if isinstance(item, tuple) else item  # labelled sets give (image, label)


def _batch(model, images, preprocess, encode, settings, start, stop, *, towers, warmup, after_dense, after_setting, reduce=None,
           turn: int = 0) -> dict[str, Any]:
    """One batch, dense then each setting (see :func:`run_image_pass`), as a picklable record: ``dense``,
    ``dense_seconds``, ``resolution``, ``tokens``, and per setting ``towers``, ``output``, ``seconds``,
    ``extra``, ``sampled_at``, ``modes``."""
    x = preprocess([_image_of(images[i]) for i in range(start, stop)])
    if warmup:
        encode(x[:1])
        for m, o in settings:
            with patched(model, m, towers=towers, **o):
                encode(x[:1])
    # the timed forwards first, in an order that rotates with the batch, so that dense and each setting take every
    # place in the sequence equally often (a fixed order favours or penalises whoever follows dense); each output's
    # untimed reduce and hooks after them, in the canonical order (dense first)
    timed: dict[int, tuple[Any, float, Any, dict]] = {}
    order = list(range(-1, len(settings)))
    shift = turn % len(order)
    for j in order[shift:] + order[:shift]:
        if j < 0:
            with Stopwatch() as sw:
                out = encode(x)
            timed[j] = (out, sw.seconds, None, {})
            continue
        m, o = settings[j]
        with patched(model, m, towers=towers, **o), record_stats(model) as rec:
            tw = patch_info(model)["towers"]
            with Stopwatch() as sw:
                out = encode(x)
        timed[j] = (out, sw.seconds, tw, rec.forwards[0] if rec.forwards else {})
    dense_b, dt = timed[-1][0], timed[-1][1]
    if reduce is not None:
        dense_b = reduce(None, dense_b, x, start)
    dense_extra = after_dense(x, start) if after_dense is not None else None
    runs, tokens = [], None
    for j, (m, o) in enumerate(settings):
        out, t_run, tw, lay = timed.pop(j)
        if reduce is not None:
            out = reduce(j, out, x, start)
        extra = after_setting(m, o, x, start, dense_extra) if after_setting is not None else None
        tokens = next((lr.queries for lr in lay.values()), tokens)
        runs.append({
            "towers": tw, "output": out, "seconds": t_run, "extra": extra,
            "sampled_at": count_sampled_at(lay, {}), "modes": sorted({lr.mode for lr in lay.values()}),
        })
    return {"start": start, "stop": stop, "resolution": int(x.shape[-1]), "tokens": tokens, "dense": dense_b, "dense_seconds": dt, "runs": runs}


def run_image_pass(
    model: torch.nn.Module,
    images,
    preprocess: Callable[[list], torch.Tensor],
    encode: Callable[[torch.Tensor], Any],
    settings: Sequence[tuple[str, dict[str, Any]]],
    *,
    batch_size: int,
    towers: Any = None,
    warmup: bool = True,
    progress: Callable[[int, int], None] | None = None,
    after_dense: Callable[[torch.Tensor, int], Any] | None = None,
    after_setting: Callable[[str, dict[str, Any], torch.Tensor, int, Any], Any] | None = None,
    reduce: Callable[[int | None, Any, torch.Tensor, int], Any] | None = None,
    ranks: Ranks | None = None,
    store: BatchStore | None = None,
) -> ImagePass:
    """Encode every image dense and under each setting, batch by batch and interleaved.

    Per batch: ``preprocess`` the images; on the first batch a process runs, with ``warmup``, one
    untimed forward of one image, dense and per setting; then the timed ``encode`` of dense and of each setting
    (under ``patched(model, method, towers=towers, **options)`` and ``record_stats(model)``), in an order that
    rotates by one place per batch, so that each takes every place after the others equally often; then, untimed,
    ``after_dense(x, start)`` (its value goes to ``after_setting``) and per setting ``after_setting(method, options,
    x, start, dense_value)`` (kept per batch in :attr:`SettingRun.extras`).  The per-batch times stay in
    :attr:`ImagePass.dense_batch_seconds` and :attr:`SettingRun.batch_seconds`: each setting's per-batch speed-ups
    give its spread (:func:`run_labels`), dense's give the machine's drift (:func:`finish`).

    In a data-parallel run (``ranks`` of several processes, :mod:`attnpatch.evals.run.distributed`) each
    process encodes its contiguous share of the batches and every process receives all of them in
    the original order, so the result is the one-process result (timings aside: ``seconds`` are the
    forward times summed over all processes, :attr:`ImagePass.ranks` has each process's own).  With a
    ``store``, each finished batch is written to it, and batches already there (``store.load()``,
    a resumed run) are read back instead of encoded.

    Args:
        model: the unpatched module the settings patch (left unpatched).
        images: ``len`` and ``[i]`` -> a PIL image or an ``(image, label)`` tuple.
        preprocess: list of PIL images -> ``[B, 3, R, R]``.
        encode: ``[B, 3, R, R]`` -> anything picklable (kept per batch).
        settings: validated ``[(method, options), ...]`` (see :func:`resolve_settings`).
        batch_size: images per forward call (a positive int).
        towers: the towers each setting routes (``None``: the model's default).
        warmup: one untimed forward per setting on the first batch.
        progress: ``progress(images_done, images_total)`` after each batch, counting this process's
            images (and those read back from ``store``).
        after_dense, after_setting: extra untimed work per batch (e.g. per-layer errors).
        reduce: ``reduce(setting_index, output, x, start)`` (``None`` for dense), untimed, after the batch's timed
            ``encode`` calls: what is kept of the output instead of the output itself (a dense eval keeps per-image
            counts, not features); dense's reduce runs before the settings' of the same batch.
        ranks: this process's place in a data-parallel run (default: one process).
        store: where finished batches are kept for ``--resume`` (:class:`BatchStore`).

    Returns:
        :class:`ImagePass` over the finished batches; ``interrupted`` when a Ctrl-C stopped it.

    Raises:
        OptionError: ``batch_size`` not a positive int.
        EvalInterrupted: a Ctrl-C before the first batch finished (``partial`` ``None``), or in a
            data-parallel run (the finished batches are in ``store`` for ``--resume``).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise OptionError(f"batch_size={batch_size!r}: must be a positive int (images per forward call)")
    r = ranks or Ranks()
    n = len(images)
    starts = list(range(0, n, batch_size))
    kept = store.load() if store is not None else {}
    # batches an earlier run kept: every process reads the ones it can see; each is sent on by the first
    # process holding it (a folder shared by the processes, or one per machine)
    holders = r.gather(sorted(kept))
    have = {s for h in holders for s in h}
    own = {s: b for s, b in kept.items() if next(k for k, h in enumerate(holders) if s in h) == r.rank}
    todo = [s for s in starts if s not in have]
    mine = [todo[i] for i in r.shard(len(todo))]
    size = sum(min(n, s + batch_size) - s for s in mine)
    done = sum(min(n, s + batch_size) - s for s in have) if r.main else 0
    total = done + size
    local: dict[int, dict[str, Any]] = {}
    interrupted = False
    t_wall = time.perf_counter()
    try:
        for k, start in enumerate(mine):
            b = _batch(
                model, images, preprocess, encode, settings, start, min(n, start + batch_size), towers=towers,
                warmup=warmup and k == 0, after_dense=after_dense, after_setting=after_setting, reduce=reduce,
                turn=start // batch_size,
            )
            # the batch is complete: keep it (a Ctrl-C leaves the results of whole batches)
            local[start] = b
            if store is not None:
                store.save(b)
            done += b["stop"] - start
            if progress:
                progress(done, total)
    except KeyboardInterrupt as exc:
        if isinstance(exc, EvalInterrupted) or r.distributed or not (local or have):
            if not r.distributed:
                raise EvalInterrupted(None, f"0/{n} images") from None
            where = f"; the finished batches are in {store.path} for --resume" if store is not None and (local or have) else ""
            raise EvalInterrupted(None, f"{len(local)}/{len(mine)} batches of process {r.rank}{where}") from None
        interrupted = True
    wall = time.perf_counter() - t_wall
    mine_info = {
        "rank": r.rank, "batches": sorted(local), "images": sum(b["stop"] - b["start"] for b in local.values()),
        "wall_s": wall, "dense_s_median": _median([b["dense_seconds"] for b in local.values()]),
        "seconds_median": [_median([b["runs"][j]["seconds"] for b in local.values()]) for j in range(len(settings))],
    }
    every: dict[int, dict[str, Any]] = {}
    per_rank = []
    for part, info in r.gather(({**own, **local}, mine_info)):
        every.update(part)
        per_rank.append(info)
    return _assemble(every, starts, n, batch_size, settings, interrupted, per_rank, resumed=sorted(have))


def _median(xs: list[float]) -> float | None:
    import statistics

    return statistics.median(xs) if xs else None


def _assemble(every: dict[int, dict[str, Any]], starts, n, batch_size, settings, interrupted, per_rank, resumed) -> ImagePass:
    """The :class:`ImagePass` of the finished batches in image order (after a Ctrl-C: the batches before the first
    unfinished one, so the images are a prefix of the set)."""
    dense, dense_t, dense_bs = [], 0.0, []
    runs = [SettingRun() for _ in settings]
    tokens = resolution = None
    done = 0
    for start in starts:
        b = every.get(start)
        if b is None:
            break
        dense.append(b["dense"])
        dense_t += b["dense_seconds"]
        dense_bs.append(b["dense_seconds"])
        resolution = b["resolution"]
        tokens = b["tokens"] if b["tokens"] is not None else tokens
        for run, br in zip(runs, b["runs"]):
            run.towers = br["towers"]
            run.outputs.append(br["output"])
            run.seconds += br["seconds"]
            run.batch_seconds.append(br["seconds"])
            run.batch_speedups.append(b["dense_seconds"] / br["seconds"] if br["seconds"] > 0 else float("nan"))
            if br["extra"] is not None:
                run.extras.append(br["extra"])
            for li, c in br["sampled_at"].items():
                run.sampled_at[li] = run.sampled_at.get(li, 0) + c
            run.modes.update(br["modes"])
        done = b["stop"]
    return ImagePass(
        n=done, n_planned=n, batch_size=batch_size, interrupted=interrupted or done < n, resolution=resolution, tokens=tokens,
        dense=dense, dense_seconds=dense_t, runs=runs, ranks=per_rank, resumed_batches=len(resumed),
        dense_batch_seconds=dense_bs,
    )


def throughput(seconds: float, n: int, dense_seconds: float | None = None) -> dict[str, float | None]:
    """``{"seconds", "images_per_s"}`` (and ``"speedup"`` over ``dense_seconds`` when given) of ``n`` images."""
    out = {"seconds": seconds, "images_per_s": n / seconds if seconds else None}
    if dense_seconds is not None:
        out["speedup"] = dense_seconds / seconds if seconds else None
    return out


def run_labels(run: SettingRun) -> dict[str, Any]:
    """``{"sampled_at": {"<layer>": images}}`` and the speed-up's spread (:func:`speedup_spread`), plus ``"note"`` when every patched layer ran exact attention, saying
    why (``s >= N``; fewer tokens than ``min_tokens``, the device's break-even length) -- the last entries of every
    result row of an image eval."""
    row: dict[str, Any] = {"sampled_at": {str(k): v for k, v in sorted(run.sampled_at.items())}}
    row.update(speedup_spread(run.batch_speedups))
    note = exact_note(run.modes)
    if note:
        row["note"] = note
    return row


#: Fewest batches from which a speed-up's spread is reported.
SPREAD_MIN_BATCHES = 3
#: Dense's median batch time in the last third of a pass over the first third beyond this factor (either way): the
#: machine's speed drifted.
DRIFT_LIMIT = 1.15


def _quantile(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.quantile(np.asarray(xs, dtype=float), q))


def speedup_spread(batch_speedups: list[float]) -> dict[str, Any]:
    """``{"speedup_spread": [25th, 75th percentile] of the per-batch speed-ups, "speedup_within_noise": whether 1.0
    lies inside that range}`` (both ``None`` below :data:`SPREAD_MIN_BATCHES` batches): the run's own spread, in
    which a speed-up is not told apart from none."""
    xs = [x for x in batch_speedups if x == x]
    if len(xs) < SPREAD_MIN_BATCHES:
        return {"speedup_spread": None, "speedup_within_noise": None}
    lo, hi = _quantile(xs, 0.25), _quantile(xs, 0.75)
    return {"speedup_spread": [lo, hi], "speedup_within_noise": bool(lo <= 1.0 <= hi)}


def timing_summary(dense_batch_seconds: list[float]) -> dict[str, Any]:
    """``{"batches", "dense_first_s", "dense_last_s" (median seconds of dense's batches in the first and the last third
    of the pass), "drift" (last over first), "drifted" (beyond :data:`DRIFT_LIMIT` either way)}``; the thirds need at
    least 6 batches (else ``None``)."""
    k = len(dense_batch_seconds)
    out: dict[str, Any] = {"batches": k, "dense_first_s": None, "dense_last_s": None, "drift": None, "drifted": False}
    if k >= 6:
        third = k // 3
        first, last = _quantile(dense_batch_seconds[:third], 0.5), _quantile(dense_batch_seconds[-third:], 0.5)
        drift = last / first if first > 0 else None
        out.update(dense_first_s=first, dense_last_s=last, drift=drift,
                   drifted=bool(drift is not None and not 1 / DRIFT_LIMIT <= drift <= DRIFT_LIMIT))
    return out


def exact_note(modes) -> str | None:
    """``"exact attention: <why>"`` when every mode a setting's patched layers ran (``record_stats`` layer records'
    ``mode``) is a hand-back to exact attention (``dense:...``), else ``None``."""
    modes = exact_modes(modes)
    if not modes:
        return None
    why = {"dense:s>=N": "s >= N tokens", "dense:short": "N below min_tokens (the break-even length)",
           "dense:r=0": "r = 0 (nothing merged)", "dense:schedule": "every layer 0 in the schedule"}
    return "exact attention: " + "; ".join(why.get(m, m.removeprefix("dense:")) for m in modes)


def finish(result: dict[str, Any], ip: ImagePass) -> dict[str, Any]:
    """Return ``result`` with how the pass ran (``"world_size"``, ``"ranks"``: :attr:`ImagePass.ranks`,
    ``"resumed_batches"``, ``"timing"``: :func:`timing_summary` of dense's batches), or, when the pass was interrupted, mark it (``"interrupted": True``,
    ``"n_images_planned"``) and raise :class:`EvalInterrupted` carrying it."""
    result.update(world_size=len(ip.ranks) or 1, ranks=ip.ranks, resumed_batches=ip.resumed_batches,
                  timing=timing_summary(ip.dense_batch_seconds))
    if ip.interrupted:
        result.update(interrupted=True, n_images_planned=ip.n_planned)
        raise EvalInterrupted(result, f"{ip.n}/{ip.n_planned} images")
    return result
