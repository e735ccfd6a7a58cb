"""Frozen-feature evals of a patched ViT against the same model unpatched, in one run.

One pass over the images computes, batch by batch and interleaved (so every setting sees the
same machine state), the dense features and the features of each patched setting, timing each
forward call (seconds; landmark selection included); it is the image pass the CLIP evals use too
(:func:`attnpatch.evals.vision.image_pass.run_image_pass`).  From the features:

* ``knn``: leave-one-out k-NN top-1/top-5 (DINO's weighted vote, :func:`attnpatch.evals.vision.metrics.knn_classify`);
* ``linear_probe``: logistic regression, stratified cross-validation;
* ``retrieval``: image-to-image same-class retrieval, recall@1/5 and mAP@R;
* ``fidelity``: cosine similarity of the final CLS token and of the mean patch token (patched vs
  dense, per image), k-NN prediction agreement, and per layer the relative Frobenius error
  ``||H_patched - H_exact||_F / ||H_exact||_F`` of the attention output, measured
  *teacher-forced* (each layer gets the exact model's inputs, so its own error is isolated) and
  *free-running* (the patched model's own inputs; errors accumulate), on the first
  ``layer_error_images`` images.

All metrics use the final CLS token (after the model's last norm) as the image feature.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...errors import DataError, OptionError
from ...patchers.adapters import adapter_for
from ...patchers.api import patched, record_stats
from ...patchers.registry import get_method
from .image_pass import ImagePass, finish, resolve_settings, run_image_pass, run_labels, throughput
from ..run.distributed import Ranks
from ..run.report import EvalInterrupted
from ..run.resume import BatchStore

__all__ = ["TASKS", "encode", "patch_size", "token_count", "run_feature_eval"]

TASKS = ("fidelity", "knn", "linear_probe", "retrieval")


def encode(
    model: torch.nn.Module, pixel_values: torch.Tensor, layers: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Final CLS token and mean patch token (and, with ``layers``, intermediate CLS tokens) of a ViT encoder,
    as the model's adapter reads them (:meth:`~attnpatch.patchers.adapter.Adapter.encode`).

    Args:
        model: a single-tower vision encoder any adapter handles (transformers DINOv2 / ViT / CLIP vision, timm ViT).
        pixel_values: ``[B, 3, H, W]``.
        layers: block indices whose output CLS token (through the model's final norm) is returned as well.

    Returns:
        ``(cls [B, C], patch_mean [B, C])`` float32 on CPU (with ``layers``: ``(cls, patch_mean, {layer: [B, C]})``).

    Raises:
        UnsupportedModelError: no adapter handles the model, or it is not a single-tower vision encoder.
    """
    return adapter_for(model).encode(model, pixel_values, layers)


def patch_size(model: torch.nn.Module) -> int:
    """Side in pixels of the vision tower's square patches, as its adapter reads it.

    Raises:
        UnsupportedModelError: no adapter handles the model, or it cannot tell the patch size.
    """
    return adapter_for(model).patch_size(model)


def token_count(model: torch.nn.Module, resolution: int) -> int:
    """Tokens the attention sees on a square ``resolution`` input (patches, CLS and registers), as the model's
    adapter counts them (:meth:`~attnpatch.patchers.adapter.Adapter.token_count`).

    Raises:
        UnsupportedModelError: see :func:`patch_size`; OptionError: ``resolution`` below one patch.
    """
    return adapter_for(model).token_count(model, resolution)


def _cos(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).numpy()


def _layer_errors(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> dict[int, np.ndarray]:
    out = {}
    for li in sorted(set(a) & set(b)):
        x, y = a[li].float(), b[li].float()
        if x.shape != y.shape:  # a method that merged tokens before this layer: no token-wise comparison
            continue
        num = (x - y).flatten(1).norm(dim=-1)
        out[li] = (num / y.flatten(1).norm(dim=-1).clamp(min=1e-30)).cpu().numpy()
    return out


def _metrics(
    feats: np.ndarray, labels: np.ndarray, tasks: Sequence[str], knn_k: int, folds: int, seed: int, probe_max_iter: int = 1000,
) -> dict[str, Any]:
    from . import metrics as frozen

    out: dict[str, Any] = {}
    if "knn" in tasks or "fidelity" in tasks:
        r = frozen.knn_classify(feats, labels, k=knn_k)
        out.update(knn_top1=r["top1"], knn_top5=r["top5"], _knn_pred=r["predictions"])
    if "linear_probe" in tasks:
        r = frozen.linear_probe(feats, labels, folds=folds, seed=seed, max_iter=probe_max_iter)
        out.update(linear_probe=r["mean"], linear_probe_std=r["std"], linear_probe_folds=r["folds"],
                   linear_probe_converged=bool(r["converged"]))
    if "retrieval" in tasks:
        r = frozen.image_retrieval(feats, labels, ks=(1, 5))
        out.update(map_at_r=r["map_at_r"], recall_at_1=r["recall@1"], recall_at_5=r["recall@5"])
    return out


def _warn_unconverged(setting: str, metrics: dict[str, Any], probe_max_iter: int) -> None:
    """One ``attnpatch:`` warning when the linear probe of ``setting`` stopped at its iteration limit."""
    if metrics.get("linear_probe_converged") is False:
        warnings.warn(
            f"attnpatch: linear probe of {setting}: the logistic regression did not converge within max_iter={probe_max_iter} "
            f"iterations in at least one fold (\"linear_probe_converged\": false), so its accuracy may be understated; "
            f"raise the limit (eval linear-probe --max-iter {probe_max_iter * 10}); the features are already standardised per fold",
            RuntimeWarning, stacklevel=2,
        )


def run_feature_eval(
    model: torch.nn.Module,
    images,
    preprocess: Callable[[list], torch.Tensor],
    *,
    settings: Sequence[tuple[str, dict[str, Any]]],
    tasks: Sequence[str] = TASKS,
    batch_size: int = 16,
    layer_error_images: int = 32,
    knn_k: int = 20,
    folds: int = 5,
    seed: int = 0,
    probe_max_iter: int = 1000,
    warmup: bool = True,
    compute_metrics: bool = True,
    return_features: bool = False,
    feature_layers: Sequence[int] = (),
    progress: Callable[[int, int], None] | None = None,
    ranks: Ranks | None = None,
    store: BatchStore | None = None,
) -> dict[str, Any]:
    """Dense vs patched frozen-feature metrics and throughput, on the same images in one run.

    Args:
        model: an unpatched ViT encoder (see :func:`encode`); left unpatched.
        images: a labelled image set (``len``, ``[i] -> (PIL image, label)``, ``labels`` ``[N]``),
            e.g. :func:`attnpatch.evals.vision.images.load_image_set`.
        preprocess: list of PIL images -> ``[B, 3, R, R]`` (e.g. :func:`attnpatch.evals.vision.preprocess.make_preprocess`).
        settings: ``[(method, options), ...]`` patched settings compared with dense.
        tasks: subset of :data:`TASKS`.
        batch_size: images per forward call.
        layer_error_images: per-layer errors (teacher-forced and free-running) are measured on
            the first this many images (each costs two extra forward calls per setting).
        knn_k, folds, seed: k-NN neighbours, linear-probe folds, seed.
        probe_max_iter: L-BFGS iteration limit of the linear probe per fold
            (:func:`attnpatch.evals.vision.metrics.linear_probe`'s ``max_iter``). A setting whose probe hit it in
            any fold gets ``"linear_probe_converged": False`` (``True`` otherwise) and one ``attnpatch:``
            ``RuntimeWarning`` naming the setting.
        warmup: run one untimed forward per setting on the first batch before timing.
        compute_metrics: compute k-NN / linear-probe / retrieval metrics and k-NN agreement
            (needs faiss and scikit-learn); ``False`` leaves them to the caller (see ``return_features``).
        return_features: add ``"features": {"labels" [N], "dense" [N, C], "runs": [[N, C], ...]}``
            (final CLS tokens, numpy float32) to the result, plus ``"layers": {layer: {"dense",
            "runs"}}`` for ``feature_layers``.
        feature_layers: also collect the CLS token of these blocks' outputs (final norm applied)
            for ``return_features`` (metrics are computed on the final CLS token).
        progress: called as ``progress(images_done, images_total)``.
        ranks: this process's place in a data-parallel run (:mod:`attnpatch.evals.run.distributed`): it encodes its
            share of the batches, every process gets all features, and the metrics (computed on every process
            from the gathered features) equal a one-process run's.
        store: where finished batches are kept and read back from (``--resume``, :class:`~attnpatch.evals.run.resume.BatchStore`).

    Returns:
        ``{"n_images", "resolution" (pixels), "tokens", "batch_size", "dense": {metrics,
        "knn_predictions" (per image, with k-NN), "seconds", "images_per_s"}, "runs": [{"method", "options", metrics, "seconds",
        "images_per_s", "speedup", "cls_cosine", "cls_cosine_min", "patch_cosine",
        "knn_agreement", "layer_error_teacher" (list per layer), "layer_error_free",
        "approximated_layers", "mean_layer_error_teacher", "mean_layer_error_free" (means over
        the approximated layers; a method that merges tokens, ToMe, has no layer errors: ``[]`` and
        ``None``, since its layers see other tokens than dense's), "sampled_at" (layer -> images)}],
        "world_size", "ranks" (per process: the batches it encoded, its median forward times), "resumed_batches"}``.
        Times are seconds of model forward calls (landmark selection included), summed over the processes.

    Raises:
        OptionError: unknown task; UnknownMethodError / OptionError for a bad setting.
        DataError: ``linear_probe`` asked on fewer than 2 classes of at least 2 images (before any image is encoded).
        EvalInterrupted: Ctrl-C (a ``KeyboardInterrupt``) during the run. Its ``partial`` is the
            result over the images of the finished batches (``n_images`` of them, metrics computed
            on those; ``"interrupted": True``, ``"n_images_planned"``; ``"metrics_error"`` when
            they were too few for a metric), or ``None`` before the first batch finished.
    """
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise OptionError(f"unknown task(s) {bad}; allowed: {', '.join(TASKS)}")
    if compute_metrics and "linear_probe" in tasks:  # the labels are known now: refuse before the image pass
        _, counts = np.unique(np.asarray(images.labels), return_counts=True)
        if int((counts >= 2).sum()) < 2:
            raise DataError(
                f"linear probe needs at least 2 classes with at least 2 images each; these {int(counts.sum())} images have "
                f"{int((counts >= 2).sum())} such class(es) ({int((counts < 2).sum())} single-image classes): raise --limit "
                "or use a set with more images per class"
            )
    settings, given = resolve_settings(settings)
    model.eval()
    fl = tuple(feature_layers)

    def enc(x):
        out = encode(model, x, fl)
        return out if fl else (*out, {})

    def need_layers(start: int) -> bool:
        return "fidelity" in tasks and start < layer_error_images

    def dense_outputs(x, start):
        if not need_layers(start):
            return None
        with patched(model, "dense"), record_stats(model, capture=True) as rec:
            encode(model, x)
        return rec.outputs[0]

    def layer_errors(m, o, x, start, dense_out):
        """Per-layer errors of setting ``(m, o)`` on batch ``x``: (teacher-forced, free-running); none for a
        method that merges tokens (its layers see other tokens than dense's, so no layer error compares them)."""
        if not need_layers(start) or get_method(m).block_hook is not None:
            return {}, {}
        with patched(model, m, **o), record_stats(model, teacher_forced=True) as rec_t:
            encode(model, x)
        teacher = {li: lr.rel_error.numpy() for li, lr in rec_t.forwards[0].items() if lr.rel_error is not None}
        with patched(model, m, **o), record_stats(model, capture=True) as rec_f:
            encode(model, x)
        return teacher, _layer_errors(rec_f.outputs[0], dense_out)

    ip = run_image_pass(
        model, images, preprocess, enc, settings, batch_size=batch_size, warmup=warmup, progress=progress,
        after_dense=dense_outputs, after_setting=layer_errors, ranks=ranks, store=store,
    )
    labels = np.asarray(images.labels)[:ip.n]
    args = (ip, tasks, settings, given, labels, fl)
    try:
        result = _feature_result(*args, compute_metrics, return_features, knn_k, folds, seed, probe_max_iter)
    except KeyboardInterrupt:
        raise EvalInterrupted(None, f"{ip.n}/{ip.n_planned} images") from None
    except (DataError, OptionError) as err:
        if not ip.interrupted:
            raise
        # the finished images may be too few for a metric (e.g. one class so far): keep the rest
        result = _feature_result(*args, False, return_features, knn_k, folds, seed, probe_max_iter)
        result["metrics_error"] = str(err)
    return finish(result, ip)


def _per_layer(batches: list[dict[int, np.ndarray]]) -> dict[int, list[np.ndarray]]:
    """``{layer: [per-batch errors, ...]}`` from one ``{layer: errors}`` dict per batch."""
    out: dict[int, list[np.ndarray]] = {}
    for d in batches:
        for li, e in d.items():
            out.setdefault(li, []).append(e)
    return out


def _feature_result(
    ip: ImagePass, tasks, settings, given, labels, fl, compute_metrics, return_features, knn_k, folds, seed,
    probe_max_iter: int = 1000,
) -> dict[str, Any]:
    """The result dict of :func:`run_feature_eval` from the image pass's per-batch features
    (``encode`` outputs ``(cls, patch_mean, {layer: cls_l})``; extras ``(teacher, free)`` errors)."""
    n = ip.n
    dcls = torch.cat([b[0] for b in ip.dense])
    dense_metrics = _metrics(dcls.numpy(), labels, tasks, knn_k, folds, seed, probe_max_iter) if compute_metrics else {}
    _warn_unconverged("dense", dense_metrics, probe_max_iter)
    dense_pred = dense_metrics.pop("_knn_pred", None)
    if dense_pred is not None:
        dense_metrics["knn_predictions"] = np.asarray(dense_pred).tolist()
    result: dict[str, Any] = {
        "n_images": n,
        "resolution": ip.resolution,
        "tokens": ip.tokens,
        "batch_size": ip.batch_size,
        "tasks": list(tasks),
        "dense": {**dense_metrics, **throughput(ip.dense_seconds, n)},
        "runs": [],
    }
    for (m, o), r, g in zip(settings, ip.runs, given):
        pcls = torch.cat([b[0] for b in r.outputs])
        met = _metrics(pcls.numpy(), labels, tasks, knn_k, folds, seed, probe_max_iter) if compute_metrics else {}
        shown = ", ".join(f"{k}={v}" for k, v in g.items())
        _warn_unconverged(f"{m}" + (f" ({shown})" if shown else ""), met, probe_max_iter)
        pred = met.pop("_knn_pred", None)
        if pred is not None:
            met["knn_predictions"] = np.asarray(pred).tolist()
        row: dict[str, Any] = {"method": m, "options": o, "shown_options": g, **met, **throughput(r.seconds, n, ip.dense_seconds)}
        if "fidelity" in tasks:
            cc = _cos(pcls, dcls)
            row.update(
                cls_cosine=float(cc.mean()),
                cls_cosine_min=float(cc.min()),
                patch_cosine=float(_cos(torch.cat([b[1] for b in r.outputs]), torch.cat([b[1] for b in ip.dense])).mean()),
                knn_agreement=float(np.mean(pred == dense_pred)) if pred is not None else None,
            )
            teacher, free = _per_layer([e[0] for e in r.extras]), _per_layer([e[1] for e in r.extras])
            te = [float(np.concatenate(teacher[li]).mean()) for li in sorted(teacher)]
            # free-running errors need the same tokens as dense: None after a layer that merged tokens (tome)
            fe = [float(np.concatenate(free[li]).mean()) if li in free else None for li in sorted(teacher)]
            approx = [i for i, e in enumerate(te) if e > 0]  # layers the method approximated
            fa = [fe[i] for i in approx if fe[i] is not None]
            row.update(
                layer_error_teacher=te,
                layer_error_free=fe,
                approximated_layers=approx,
                mean_layer_error_teacher=(float(np.mean([te[i] for i in approx])) if approx else 0.0) if te else None,
                mean_layer_error_free=(float(np.mean(fa)) if fa else (0.0 if not approx else None)) if te else None,
            )
        row.update(run_labels(r))
        result["runs"].append(row)
    if return_features:
        def layer(batches, li):
            return torch.cat([b[2][li] for b in batches]).numpy()

        result["features"] = {
            "labels": labels, "dense": dcls.numpy(), "runs": [torch.cat([b[0] for b in r.outputs]).numpy() for r in ip.runs],
            "layers": {li: {"dense": layer(ip.dense, li), "runs": [layer(r.outputs, li) for r in ip.runs]} for li in fl},
        }
    return result
