"""Semantic segmentation of a patched ViT against the same model unpatched, in one run.

1. **Fit**: the train images go through the model (unpatched; with ``fit="per-setting"`` also under each
   setting), and a bounded random sample of their patches (``max_patches``, :class:`~.heads.PatchSample`) is
   kept with its label shares.  On it the read-outs are fitted: the linear probe (or a released head,
   ``head``) and the dense k-NN memory bank (:mod:`.heads`).
2. **Score**: the val images go through the shared image pass (:func:`~attnpatch.evals.vision.image_pass.run_image_pass`):
   batch by batch, dense then each setting, each forward timed with the one synchronised stopwatch.  Right
   after each forward, untimed, each read-out predicts a class map at the label size and only per-image
   pixel counts are kept (:mod:`.metrics`), so features stream through.

With ``fit="unpatched"`` (the default) every setting is scored with the read-outs fitted on the unpatched
model's features, as a deployed head would see a patched backbone; ``fit="per-setting"`` fits each setting
on its own features.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import OptionError, UnsupportedModelError
from ...patchers.adapters import adapter_for
from ...patchers.api import patched
from ...patchers.registry import get_method
from ..run.distributed import Ranks
from ..run.resume import BatchStore
from ..vision.image_pass import finish, resolve_settings, run_image_pass, run_labels, throughput
from .data import SegmentationSet
from .heads import KnnBank, PatchSample, load_head, predict, train_linear_head
from .metrics import bootstrap_delta, image_counts, scores

__all__ = ["READOUTS", "FITS", "Fitted", "check_dense_methods", "square_preprocess", "fit_readouts", "run_segmentation"]

READOUTS = ("linear", "knn")
FITS = ("unpatched", "per-setting")


def check_dense_methods(methods: Sequence[str]) -> None:
    """Refuse, in one line, a method that cannot give one output per input patch (before any model loads).

    Raises:
        UnsupportedModelError: such a method (named, with the methods that can).
    """
    from ...patchers.registry import METHODS

    for m in methods:
        if not get_method(m).per_patch_output:
            able = ", ".join(n for n, meth in METHODS.items() if meth.per_patch_output and not meth.exact)
            raise UnsupportedModelError(f"{m}: changes the token count without a source map, so it has no output per input patch "
                                        f"for a dense task; methods that have one: {able}")


def square_preprocess(mean: Sequence[float], std: Sequence[float], resolution: int) -> Callable[[list], torch.Tensor]:
    """``list[PIL.Image] -> [B, 3, R, R]``: each image resized (bicubic, aspect not kept, so the label map lays
    over the whole input) to ``resolution`` and normalised ``(x / 255 - mean) / std``."""
    from PIL import Image

    m = torch.tensor(mean, dtype=torch.float32)[:, None, None]
    s = torch.tensor(std, dtype=torch.float32)[:, None, None]

    def fn(images: list) -> torch.Tensor:
        out = []
        for im in images:
            arr = np.asarray(im.convert("RGB").resize((resolution, resolution), Image.BICUBIC), dtype=np.float32) / 255.0
            out.append((torch.from_numpy(arr).permute(2, 0, 1) - m) / s)
        return torch.stack(out)

    return fn


def _check(readouts, fit, last, max_patches, batch_size, k, temperature, examples, probe_steps) -> None:
    bad = [r for r in readouts if r not in READOUTS]
    if bad or not readouts:
        raise OptionError(f"readouts={list(readouts)!r}: choose from {', '.join(READOUTS)}")
    if fit not in FITS:
        raise OptionError(f"fit={fit!r}: choose from {', '.join(FITS)}")
    for name, v in (("last", last), ("max_patches", max_patches), ("batch_size", batch_size), ("k", k), ("probe_steps", probe_steps)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise OptionError(f"{name}={v!r}: must be a positive int")
    if isinstance(examples, bool) or not isinstance(examples, numbers.Integral) or examples < 0:
        raise OptionError(f"examples={examples!r}: must be an int >= 0 (val images drawn side by side)")
    if not (isinstance(temperature, numbers.Real) and temperature > 0 and math.isfinite(temperature)):
        raise OptionError(f"temperature={temperature!r}: must be a positive number (softmax temperature of the k-NN vote)")


def _release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).  Each image's
    temporaries (label maps, pixels, features) come and go at sizes under glibc's adaptive mmap threshold, and the heap
    they fragment is not returned on its own: without this, the peak memory of a fit grew by about 0.5 MB per train
    image (docs/benchmarks/segmentation.md)."""
    import ctypes
    import ctypes.util

    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


def _fit(model, adapter, data: SegmentationSet, preprocess, settings, *, fit, last, max_patches, batch_size, seed, progress):
    """Patch samples of the train split: ``{None: dense}`` plus, per setting with ``fit="per-setting"``, ``{j: ...}``."""
    k = len(data.classes)
    n = len(data.train)
    samples = {None: PatchSample(max_patches, n, k, seed)}
    if fit == "per-setting":
        samples.update({j: PatchSample(max_patches, n, k, seed) for j in range(len(settings))})
    for start in range(0, n, batch_size):
        idx = list(range(start, min(n, start + batch_size)))
        x = preprocess([data.train.image(i) for i in idx])
        labels = [data.train.labels(i) for i in idx]
        runs = [(None, None)] + ([(j, s) for j, s in enumerate(settings)] if fit == "per-setting" else [])
        for j, s in runs:
            if s is None:
                feats = adapter.patch_tokens(model, x, last)
            else:
                with patched(model, s[0], **s[1]):
                    feats = adapter.patch_tokens(model, x, last)
            for b, i in enumerate(idx):
                samples[j].add(i, feats[b], labels[b])
        del x, labels, feats
        _release_freed_memory()
        if progress:
            progress("fit", idx[-1] + 1, n)
    return samples


@dataclass
class Fitted:
    """Read-outs fitted on a train split: ``heads[j][readout]`` (``j`` ``None``: dense's, else a setting's index with
    ``fit="per-setting"``), the probe's ``training`` record per fit and the train patches kept (``counts``)."""

    heads: dict[Any, dict[str, Any]]
    training: dict[str, dict]
    counts: dict[Any, int]


def _fit_heads(model, adapter, data, preprocess, settings, readouts, *, fit, last, max_patches, batch_size, seed, progress,
               k, temperature, fixed_head, probe_steps) -> Fitted:
    samples = _fit(model, adapter, data, preprocess, settings, fit=fit, last=last, max_patches=max_patches,
                   batch_size=batch_size, seed=seed, progress=progress)
    heads: dict[Any, dict[str, Any]] = {}
    training: dict[str, dict] = {}
    for j, sample in samples.items():
        xs, ys, ws = sample.arrays()
        heads[j] = {}
        if "linear" in readouts and fixed_head is not None:
            heads[j]["linear"] = fixed_head
        elif "linear" in readouts:
            heads[j]["linear"], training["dense" if j is None else str(j)] = train_linear_head(xs, ys, ws, steps=probe_steps, seed=seed)
        if "knn" in readouts:
            heads[j]["knn"] = KnnBank(xs, ys, k=k, temperature=temperature)
        del xs, ys, ws
    return Fitted(heads, training, {j: s.count for j, s in samples.items()})


def fit_readouts(model: torch.nn.Module, data: SegmentationSet, preprocess: Callable[[list], torch.Tensor], *,
                 readouts: Sequence[str] = READOUTS, last: int = 1, max_patches: int = 100_000, k: int = 30,
                 temperature: float = 0.02, batch_size: int = 8, probe_steps: int = 2000, seed: int = 0,
                 progress: Callable[[str, int, int], None] | None = None) -> Fitted:
    """The read-outs :func:`run_segmentation` fits with ``fit="unpatched"``, fitted once on the unpatched model's train
    features, for several :func:`run_segmentation` calls (``fitted=``) on the same train split (e.g. a tuner's rounds).

    Raises:
        OptionError: a bad option; UnsupportedModelError: a model without patch tokens.
    """
    _check(readouts, "unpatched", last, max_patches, batch_size, k, temperature, 0, probe_steps)
    adapter = adapter_for(model)
    return _fit_heads(model, adapter, data, preprocess, [], readouts, fit="unpatched", last=last, max_patches=max_patches,
                      batch_size=batch_size, seed=seed, progress=progress, k=k, temperature=temperature,
                      fixed_head=None, probe_steps=probe_steps)


def run_segmentation(
    model: torch.nn.Module,
    data: SegmentationSet,
    preprocess: Callable[[list], torch.Tensor],
    *,
    settings: Sequence[tuple[str, dict[str, Any]]],
    readouts: Sequence[str] = READOUTS,
    fit: str = "unpatched",
    last: int = 1,
    max_patches: int = 100_000,
    k: int = 30,
    temperature: float = 0.02,
    head: str | None = None,
    batch_size: int = 8,
    probe_steps: int = 2000,
    seed: int = 0,
    resamples: int = 1000,
    examples: int = 4,
    warmup: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
    ranks: Ranks | None = None,
    store: BatchStore | None = None,
    fitted: Fitted | None = None,
) -> dict[str, Any]:
    """Dense vs patched semantic segmentation: mIoU, per-class IoU, pixel accuracy, agreement with dense, speed.

    Args:
        model: an unpatched ViT any adapter reads patch tokens of (HF DINOv2 / ViT / CLIP / SigLIP vision, timm
            ViT, open_clip ViT); left unpatched.
        data: a :class:`~.data.SegmentationSet` (:func:`~.data.load_segmentation_set`).
        preprocess: list of PIL images -> ``[B, 3, R, R]`` (:func:`square_preprocess`).
        settings: ``[(method, options), ...]`` compared with dense; each must give one output per input patch.
        readouts: ``"linear"`` (linear probe, or ``head``) and/or ``"knn"`` (dense k-NN).
        fit: ``"unpatched"`` (read-outs fitted on the unpatched model's train features, applied to every setting) or
            ``"per-setting"`` (each setting fitted on its own).
        last: how many of the last blocks' outputs are concatenated (DINOv2's protocol: 1 or 4).
        max_patches: train patches kept for the probe's sample and the k-NN bank (per fit; memory
            ``max_patches * C * last * 2`` bytes each).
        k, temperature: the k-NN's neighbours and softmax temperature.
        head: a released DINOv2 linear head file used as the linear read-out instead of training one (``fit="unpatched"``).
        batch_size: images per forward call; probe_steps: the probe's AdamW steps (batches of 1024 patches); seed: sampling
            and training seed.
        resamples: bootstrap resamples of the val images for the mIoU differences' 95 % intervals.
        examples: val images whose predictions are kept for the side-by-side figure.
        warmup: one untimed forward per setting before timing.
        progress: ``progress(phase, done, total)`` with phase ``"fit"`` (train images) or ``"score"`` (val images).
        ranks, store: a data-parallel run's place and a ``--resume`` store (the val pass).
        fitted: read-outs fitted earlier on the same train split (:func:`fit_readouts`): no train pass (``fit`` must be
            ``"unpatched"`` and ``readouts`` among the fitted ones).

    Returns:
        ``{"n_images", "n_train", "resolution" (px), "tokens", "fit", "readouts", "last", "classes", "max_patches",
        "patches" {fit: count}, "dense": {readout: scores, "seconds", "images_per_s"}, "runs": [{"method", "options",
        readout: {scores, "miou_delta" {delta, low, high}}, "seconds", "images_per_s", "speedup", ...}],
        "examples": {"ids", "labels", "dense" {readout: [maps]}, "runs": [{readout: [maps]}]}}``; scores as
        :func:`~.metrics.scores` (mIoU and IoU in 0..1), times in seconds of feature extraction.

    Raises:
        OptionError: a bad option; UnsupportedModelError: a model without patch tokens, a method without per-patch
        output; DataError: a bad ``head`` file; EvalInterrupted: Ctrl-C (see :func:`~attnpatch.evals.vision.image_pass.finish`).
    """
    _check(readouts, fit, last, max_patches, batch_size, k, temperature, examples, probe_steps)
    if head is not None and (fit != "unpatched" or "linear" not in readouts):
        raise OptionError("head: a released linear head is the linear read-out of every setting; it needs fit='unpatched' and the 'linear' read-out")
    check_dense_methods([m for m, _ in settings])
    adapter = adapter_for(model)
    settings, given = resolve_settings(settings, model)
    kcls = len(data.classes)
    probe_x = preprocess([data.val.image(0)])
    channels = adapter.patch_tokens(model, probe_x, last).shape[-1]  # refuses a model without patch tokens, at once
    fixed_head = load_head(head, channels, kcls) if head is not None else None

    if fitted is None:
        fitted = _fit_heads(model, adapter, data, preprocess, settings, readouts, fit=fit, last=last,
                            max_patches=max_patches, batch_size=batch_size, seed=seed, progress=progress, k=k,
                            temperature=temperature, fixed_head=fixed_head, probe_steps=probe_steps)
    elif fit != "unpatched" or set(readouts) - set(fitted.heads[None]):
        raise OptionError(f"fitted: read-outs fitted once ({', '.join(fitted.heads[None])}) apply with fit='unpatched' "
                          f"to those read-outs only; asked: fit={fit!r}, readouts {', '.join(readouts)}")
    heads, training, samples = fitted.heads, fitted.training, fitted.counts

    val = data.val
    dense_preds: dict[int, dict[str, np.ndarray]] = {}  # per val image of the batch: its labels and dense's maps

    def reduce(j, feats, x, start):
        fitted = heads[None] if j is None or fit == "unpatched" else heads[j]
        rows = []
        for b in range(feats.shape[0]):
            i = start + b
            if j is None:  # each label map is decoded once, by dense's call, and kept for the settings of the batch
                dense_preds[i] = {"labels": val.labels(i)}
            lab = dense_preds[i]["labels"]
            row = {}
            for r in readouts:
                with torch.no_grad():
                    pred = predict(fitted[r](feats[b:b + 1])[0], lab.shape)
                if j is None:
                    dense_preds[i][r] = pred
                row[r] = image_counts(pred, lab, kcls, None if j is None else dense_preds[i][r])
                if i < examples:
                    row[r]["map"] = pred
            if j is not None and j == len(settings) - 1:
                dense_preds.pop(i, None)
            rows.append(row)
        if j is None and not settings:
            dense_preds.clear()
        _release_freed_memory()
        return rows

    ip = run_image_pass(
        model, val, preprocess, lambda x: adapter.patch_tokens(model, x, last), settings, batch_size=batch_size, warmup=warmup,
        progress=(lambda d, t: progress("score", d, t)) if progress else None, reduce=reduce, ranks=ranks, store=store,
    )
    dense_rows = [row for batch in ip.dense for row in batch]
    result: dict[str, Any] = {
        "n_images": ip.n, "n_train": len(data.train), "resolution": ip.resolution, "tokens": ip.tokens, "batch_size": batch_size,
        "fit": fit, "readouts": list(readouts), "last": last, "classes": list(data.classes), "max_patches": max_patches,
        "patches": {("dense" if j is None else str(j)): c for j, c in samples.items()},
        "knn": {"k": k, "temperature": temperature} if "knn" in readouts else None,
        "linear": ({"head": str(head)} if head is not None else {"trained_on": "patch sample", "training": training})
        if "linear" in readouts else None,
        "data": data.describe(),
        "dense": {**{r: scores([row[r] for row in dense_rows], data.classes) for r in readouts},
                  **throughput(ip.dense_seconds, ip.n)},
        "runs": [],
    }
    for (m, o), g, run in zip(settings, given, ip.runs):
        rows = [row for batch in run.outputs for row in batch]
        entry: dict[str, Any] = {"method": m, "options": o, "given_options": g, "shown_options": g}
        for r in readouts:
            entry[r] = {**scores([row[r] for row in rows], data.classes),
                        "miou_delta": bootstrap_delta([row[r] for row in rows], [row[r] for row in dense_rows],
                                                      resamples=resamples, seed=seed)}
        entry.update(throughput(run.seconds, ip.n, ip.dense_seconds))
        entry.update(run_labels(run))
        result["runs"].append(entry)
    shown = list(range(min(examples, ip.n)))
    result["examples"] = {
        "ids": [val.ids[i] for i in shown],
        "dense": {r: [dense_rows[i][r]["map"] for i in shown] for r in readouts},
        "runs": [{r: [row[r]["map"] for row in [x for b in run.outputs for x in b][: len(shown)]] for r in readouts} for run in ip.runs],
    }
    for rows in [dense_rows] + [[x for b in run.outputs for x in b] for run in ip.runs]:
        for row in rows:
            for r in readouts:
                row[r].pop("map", None)
    return finish(result, ip)
