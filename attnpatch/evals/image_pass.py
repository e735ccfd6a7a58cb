"""The image pass shared by the image evals (:mod:`attnpatch.evals.vision`, :mod:`attnpatch.evals.clip`).

:func:`run_image_pass` encodes a set of images in batches, dense and under each patched setting,
interleaved batch by batch (so every setting sees the same machine state), timing each forward
call. A batch is kept only once every setting has finished it, so a Ctrl-C (a
``KeyboardInterrupt``) leaves the results of whole batches: the pass then returns what was
finished with ``interrupted`` set, and the eval computes its result over those images and hands it
to :func:`finish`, which raises :class:`~attnpatch.evals.report.EvalInterrupted` carrying it.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import OptionError
from ..patchers.api import patch_info, patched, record_stats
from ..patchers.registry import get_method, validate_options
from .report import EvalInterrupted

__all__ = ["SettingRun", "ImagePass", "resolve_settings", "count_sampled_at", "run_image_pass", "finish", "throughput", "run_labels"]

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
        sampled_at: layer -> images whose first FNA landmark layer it was (:func:`count_sampled_at`).
        modes: the attention modes the patched layers ran (``record_stats`` layer records).
        towers: the towers the patch routed (``patch_info(model)["towers"]``).
    """

    outputs: list = field(default_factory=list)
    extras: list = field(default_factory=list)
    seconds: float = 0.0
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
        dense: dense ``encode`` output per batch; dense_seconds: their forward time.
        runs: one :class:`SettingRun` per setting, in order.
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


def _image_of(item):
    return item[0] if isinstance(item, tuple) else item  # labelled sets give (image, label)


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
) -> ImagePass:
    """Encode every image dense and under each setting, batch by batch and interleaved.

    Per batch: ``preprocess`` the images; on the first batch with ``warmup``, one untimed forward
    of one image, dense and per setting; the timed dense ``encode``; ``after_dense(x, start)``
    (untimed; its value goes to ``after_setting``); then per setting, under ``patched(model,
    method, towers=towers, **options)`` and ``record_stats(model)``, the timed ``encode`` and after
    it ``after_setting(method, options, x, start, dense_value)`` (untimed, kept per batch in
    :attr:`SettingRun.extras`).

    Args:
        model: the unpatched module the settings patch (left unpatched).
        images: ``len`` and ``[i]`` -> a PIL image or an ``(image, label)`` tuple.
        preprocess: list of PIL images -> ``[B, 3, R, R]``.
        encode: ``[B, 3, R, R]`` -> anything (kept per batch).
        settings: validated ``[(method, options), ...]`` (see :func:`resolve_settings`).
        batch_size: images per forward call (a positive int).
        towers: the towers each setting routes (``None``: the model's default).
        warmup: one untimed forward per setting on the first batch.
        progress: ``progress(images_done, images_total)`` after each batch.
        after_dense, after_setting: extra untimed work per batch (e.g. per-layer errors).

    Returns:
        :class:`ImagePass` over the finished batches; ``interrupted`` when a Ctrl-C stopped it.

    Raises:
        OptionError: ``batch_size`` not a positive int.
        EvalInterrupted: a Ctrl-C before the first batch finished (``partial`` ``None``).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise OptionError(f"batch_size={batch_size!r}: must be a positive int (images per forward call)")
    n = len(images)
    dense, dense_t = [], 0.0
    runs = [SettingRun() for _ in settings]
    tokens = resolution = None
    done = 0
    interrupted = False
    try:
        for start in range(0, n, batch_size):
            x = preprocess([_image_of(images[i]) for i in range(start, min(n, start + batch_size))])
            resolution = int(x.shape[-1])
            if warmup and start == 0:
                encode(x[:1])
                for m, o in settings:
                    with patched(model, m, towers=towers, **o):
                        encode(x[:1])
            # everything of this batch is collected first and kept only once the batch is complete,
            # so a Ctrl-C leaves the results of whole batches
            t0 = time.perf_counter()
            dense_b = encode(x)
            dt = time.perf_counter() - t0
            dense_extra = after_dense(x, start) if after_dense is not None else None
            per_run = []
            for m, o in settings:
                with patched(model, m, towers=towers, **o), record_stats(model) as rec:
                    tw = patch_info(model)["towers"]
                    t0 = time.perf_counter()
                    out = encode(x)
                    t_run = time.perf_counter() - t0
                extra = after_setting(m, o, x, start, dense_extra) if after_setting is not None else None
                per_run.append((tw, out, t_run, rec.forwards[0] if rec.forwards else {}, extra))
            # the batch is complete: keep it
            dense.append(dense_b)
            dense_t += dt
            for r, (tw, out, t_run, lay, extra) in zip(runs, per_run):
                r.towers = tw
                r.outputs.append(out)
                r.seconds += t_run
                if after_setting is not None:
                    r.extras.append(extra)
                tokens = next((lr.queries for lr in lay.values()), tokens)
                count_sampled_at(lay, r.sampled_at)
                r.modes.update(lr.mode for lr in lay.values())
            done += x.shape[0]
            if progress:
                progress(done, n)
    except KeyboardInterrupt as exc:
        if isinstance(exc, EvalInterrupted) or done == 0:
            raise EvalInterrupted(None, f"0/{n} images") from None
        interrupted = True
    return ImagePass(
        n=done, n_planned=n, batch_size=batch_size, interrupted=interrupted, resolution=resolution, tokens=tokens,
        dense=dense, dense_seconds=dense_t, runs=runs,
    )


def throughput(seconds: float, n: int, dense_seconds: float | None = None) -> dict[str, float | None]:
    """``{"seconds", "images_per_s"}`` (and ``"speedup"`` over ``dense_seconds`` when given) of ``n`` images."""
    out = {"seconds": seconds, "images_per_s": n / seconds if seconds else None}
    if dense_seconds is not None:
        out["speedup"] = dense_seconds / seconds if seconds else None
    return out


def run_labels(run: SettingRun) -> dict[str, Any]:
    """``{"sampled_at": {"<layer>": images}}``, plus ``"note"`` when every patched layer ran exact
    attention (``s >= N``) -- the last entries of every result row of an image eval."""
    row: dict[str, Any] = {"sampled_at": {str(k): v for k, v in sorted(run.sampled_at.items())}}
    if run.modes == {"dense:s>=N"}:
        row["note"] = "exact attention: s >= N tokens"
    return row


def finish(result: dict[str, Any], ip: ImagePass) -> dict[str, Any]:
    """Return ``result``, or, when the pass was interrupted, mark it (``"interrupted": True``,
    ``"n_images_planned"``) and raise :class:`EvalInterrupted` carrying it."""
    if ip.interrupted:
        result.update(interrupted=True, n_images_planned=ip.n_planned)
        raise EvalInterrupted(result, f"{ip.n}/{ip.n_planned} images")
    return result
