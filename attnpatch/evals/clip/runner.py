"""CLIP eval runners, dense vs patched image tower: zero-shot classification and image-text retrieval.

:func:`run_zeroshot_eval` and :func:`run_retrieval_eval` compute, in one pass over the images,
batch by batch and interleaved, the dense image embeddings and those of each patched setting
(:func:`attnpatch.evals.vision.image_pass.run_image_pass`; forward calls timed: images/s; preprocessing
not timed); text embeddings are computed once with the text tower dense (again under the patch
only for a setting that routes the text tower).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...log import Log, log_stderr
from ...patchers.api import patch_info, patched
from ..vision.image_pass import ImagePass, SettingRun, finish, resolve_settings, run_image_pass, run_labels, throughput
from ..run.report import EvalInterrupted
from ...timing import Stopwatch
from .captions import CaptionSet
from .metrics import (
    check_ks, classification_metrics, retrieval_chance, retrieval_metrics, retrieval_predictions, retrieval_recall,
    zeroshot_accuracy, zeroshot_classifier,
)
from .prompts import zeroshot_prompts

__all__ = ["run_zeroshot_eval", "run_retrieval_eval"]



def _image_pass(bundle, images, settings, towers, batch_size: int, warmup: bool, progress, ranks=None, store=None) -> ImagePass:
    """Dense and patched image embeddings of every image, interleaved batch by batch, with forward times
    (in a data-parallel run each process encodes its share; every process gets all)."""
    ip = run_image_pass(
        bundle.model, images, bundle.preprocess, bundle.encode_image, settings,
        batch_size=batch_size, towers=towers, warmup=warmup, progress=progress, ranks=ranks, store=store,
    )
    if ip.tokens is None:
        ip.tokens = bundle.vision_tokens()
    return ip


def _text_pass(bundle, texts: list[str], settings, towers, text_batch_size: int) -> tuple[torch.Tensor, float, list[torch.Tensor | None]]:
    """Dense text embeddings, and per setting the patched ones when that setting routes the text tower."""
    with Stopwatch() as sw:
        dense = bundle.encode_text(texts, batch_size=text_batch_size)
    secs = sw.seconds
    per = []
    for m, o in settings:
        with patched(bundle.model, m, towers=towers, **o):
            routes_text = "text" in patch_info(bundle.model)["towers"]
            per.append(bundle.encode_text(texts, batch_size=text_batch_size) if routes_text else None)
    return dense, secs, per


def _unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x.float(), dim=-1)


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def _row_common(m, o, g, r: SettingRun, emb, dense_emb, dense_t, n) -> dict[str, Any]:
    cc = _cos(emb, dense_emb)
    return {
        "method": m, "options": o, "shown_options": g, "towers": r.towers, **throughput(r.seconds, n, dense_t),
        "embed_cosine": float(cc.mean()), "embed_cosine_min": float(cc.min()), **run_labels(r),
    }


def _zeroshot_keys(acc: dict[str, Any], emb, clf, labels, c: int) -> dict[str, Any]:
    """``{"metrics": CLIP_benchmark's keys, "predictions": [N] top-1 class per image}`` of one setting."""
    top5 = acc["top5"] if "top5" in acc else zeroshot_accuracy(emb, clf, labels, (5,))["top5"]
    return {"metrics": classification_metrics(labels, acc["predictions"], top5, c), "predictions": acc["predictions"].tolist()}


def _text_or_interrupt(fn, *args):
    try:
        return fn(*args)
    except KeyboardInterrupt as exc:
        if isinstance(exc, EvalInterrupted):
            raise
        raise EvalInterrupted(None, "text embeddings") from None


def run_zeroshot_eval(
    bundle,
    images,
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    settings: Sequence[tuple[str, dict[str, Any]]],
    towers: Any = None,
    batch_size: int = 32,
    text_batch_size: int = 256,
    ks: Sequence[int] = (1, 5),
    warmup: bool = True,
    progress: Callable[[int, int], None] | None = None,
    ranks=None,
    store=None,
    log: Log = log_stderr,
) -> dict[str, Any]:
    """Zero-shot classification, dense vs patched image tower, on the same images in one run.

    Args:
        bundle: a :class:`attnpatch.clip_models.ClipBundle` (left unpatched).
        images: a labelled set (``len``, ``labels`` ``[N]``, ``[i] -> (PIL image, label)``), e.g.
            :func:`attnpatch.evals.vision.images.load_image_set`.
        classnames: ``classnames[label]`` (e.g. :func:`resolve_classnames`).
        templates: prompt templates with ``{}`` (e.g. :func:`resolve_templates`).
        settings: ``[(method, options), ...]`` compared with dense.
        towers: towers each setting routes (``None``: the model's default, the image tower).
        batch_size: images per forward call; text_batch_size: prompts per forward call.
        ks: top-k cut-offs.
        warmup: one untimed forward per setting before timing.
        progress: ``progress(images_done, images_total)``.
        ranks, store: a data-parallel run and the kept batches of ``--resume``, as :func:`attnpatch.evals.vision.run_feature_eval`.
        log: one line per step.

    Returns:
        ``{"eval": "zeroshot", "n_images", "n_classes", "n_templates", "templates", "resolution"
        (pixels), "tokens" (image-tower tokens N), "batch_size", "text_seconds", "chance"
        ({"top<k>": k / C}), "dense": {"top<k>", "seconds", "images_per_s", "metrics", "predictions"}, "runs": [{"method",
        "options", "towers", "top<k>", "metrics", "predictions", "agreement" (top-1 prediction equal to dense, fraction),
        "embed_cosine" / "embed_cosine_min" (image embedding vs dense, mean / min over images),
        "seconds", "images_per_s", "speedup", "sampled_at"}]}``. Seconds are model forward time. ``"metrics"``
        holds CLIP_benchmark's keys (:func:`~attnpatch.evals.clip.metrics.classification_metrics`: ``acc1``,
        ``acc5``, ``mean_per_class_recall``), ``"predictions"`` the ``[N]`` top-1 class of each image.

    Raises:
        OptionError: bad templates, ks or batch sizes; UnknownMethodError / OptionError /
            UnsupportedModelError for a bad setting (checked before any image is encoded).
        DataError: fewer class names than labels.
        EvalInterrupted: Ctrl-C (a ``KeyboardInterrupt``); its ``partial`` is the result over the
            images of the finished batches (``"interrupted": True``, ``"n_images_planned"``), or
            ``None`` before the first batch finished.
    """
    settings, given = resolve_settings(settings, bundle.model, towers)
    labels = np.asarray(images.labels)
    names = list(classnames)
    templates, prompts = zeroshot_prompts(names, list(templates), labels)
    ks = check_ks(ks)
    log(f"zero-shot classifier: {len(names)} classes x {len(templates)} templates = {len(prompts)} prompts ...")
    text, text_s, per_text = _text_or_interrupt(_text_pass, bundle, prompts, settings, towers, text_batch_size)
    clf = zeroshot_classifier(text, len(names))
    log(f"text embeddings in {text_s:.1f} s")
    ip = _image_pass(bundle, images, settings, towers, batch_size, warmup, progress, ranks, store)
    n, dense_emb = ip.n, torch.cat(ip.dense)
    dense = zeroshot_accuracy(dense_emb, clf, labels[:n], ks)
    c = len(names)
    result: dict[str, Any] = {
        "eval": "zeroshot", "n_images": n, "n_classes": c, "n_templates": len(templates), "templates": templates,
        "resolution": ip.resolution, "tokens": ip.tokens, "batch_size": batch_size, "text_seconds": text_s,
        "chance": {f"top{k}": min(k, c) / c for k in ks},
        "dense": {**{f"top{k}": dense[f"top{k}"] for k in ks}, **throughput(ip.dense_seconds, n),
                  **_zeroshot_keys(dense, dense_emb, clf, labels[:n], c)},
        "runs": [],
    }
    for (m, o), g, r, pt in zip(settings, given, ip.runs, per_text):
        emb = torch.cat(r.outputs)
        clf_r = clf if pt is None else zeroshot_classifier(pt, c)
        acc = zeroshot_accuracy(emb, clf_r, labels[:n], ks)
        row = _row_common(m, o, g, r, emb, dense_emb, ip.dense_seconds, n)
        row.update({f"top{k}": acc[f"top{k}"] for k in ks})
        row.update(_zeroshot_keys(acc, emb, clf_r, labels[:n], c))
        row["agreement"] = float(np.mean(acc["predictions"] == dense["predictions"]))
        result["runs"].append(row)
    return finish(result, ip)


def run_retrieval_eval(
    bundle,
    captions: CaptionSet,
    *,
    settings: Sequence[tuple[str, dict[str, Any]]],
    towers: Any = None,
    batch_size: int = 32,
    text_batch_size: int = 256,
    ks: Sequence[int] = (1, 5, 10),
    warmup: bool = True,
    progress: Callable[[int, int], None] | None = None,
    ranks=None,
    store=None,
    log: Log = log_stderr,
) -> dict[str, Any]:
    """Image<->text retrieval recall@k, dense vs patched image tower, on the same images in one run.

    Args:
        bundle: a :class:`attnpatch.clip_models.ClipBundle` (left unpatched).
        captions: a :class:`CaptionSet` (e.g. :func:`load_caption_set`).
        settings: ``[(method, options), ...]`` compared with dense.
        towers: towers each setting routes (``None``: the model's default, the image tower).
        batch_size: images per forward call; text_batch_size: captions per forward call.
        ks: recall cut-offs.
        warmup: one untimed forward per setting before timing.
        progress: ``progress(images_done, images_total)``.
        ranks, store: a data-parallel run and the kept batches of ``--resume``, as :func:`attnpatch.evals.vision.run_feature_eval`.
        log: one line per step.

    Returns:
        ``{"eval": "retrieval", "n_images", "n_texts", "ks", "resolution", "tokens",
        "batch_size", "text_seconds", "chance" (:func:`retrieval_chance`), "dense":
        {"t2i_recall@<k>", "i2t_recall@<k>", "seconds", "images_per_s", "metrics", "predictions"}, "runs": [{"method",
        "options", "towers", the recalls, "metrics", "predictions", "t2i_top1_agreement" (each text's top-1 image equals
        dense's, fraction), "embed_cosine", "embed_cosine_min", "seconds", "images_per_s",
        "speedup", "sampled_at"}]}``; recall definitions in :func:`retrieval_recall`;
        ``"metrics"`` the recalls under CLIP_benchmark's keys (:func:`~attnpatch.evals.clip.metrics.retrieval_metrics`),
        ``"predictions"`` the per-query ranks (:func:`~attnpatch.evals.clip.metrics.retrieval_predictions`).

    Raises:
        OptionError: bad ks or batch sizes; UnknownMethodError / OptionError /
            UnsupportedModelError for a bad setting.
        EvalInterrupted: Ctrl-C (a ``KeyboardInterrupt``); its ``partial`` is the result over the
            images of the finished batches and their captions (``"interrupted": True``,
            ``"n_images_planned"``), or ``None`` before the first batch finished.
    """
    settings, given = resolve_settings(settings, bundle.model, towers)
    ks = check_ks(ks)
    texts, t2i = captions.texts, captions.text_to_image
    log(f"text embeddings of {len(texts)} captions ...")
    text, text_s, per_text = _text_or_interrupt(_text_pass, bundle, texts, settings, towers, text_batch_size)
    log(f"text embeddings in {text_s:.1f} s")
    ip = _image_pass(bundle, captions, settings, towers, batch_size, warmup, progress, ranks, store)
    n, dense_emb = ip.n, torch.cat(ip.dense)
    if n < len(captions):  # interrupted: the captions of the finished images only
        keep = torch.from_numpy(t2i < n)
        texts, t2i, text = [t for t, k in zip(texts, keep.tolist()) if k], t2i[t2i < n], text[keep]
        per_text = [None if pt is None else pt[keep] for pt in per_text]
    metric_keys = [f"t2i_recall@{k}" for k in ks] + [f"i2t_recall@{k}" for k in ks]
    dense = retrieval_recall(dense_emb, text, t2i, ks)
    dense_top1 = (text @ dense_emb.T).argmax(1)
    result: dict[str, Any] = {
        "eval": "retrieval", "n_images": n, "n_texts": len(texts), "ks": ks, "resolution": ip.resolution,
        "tokens": ip.tokens, "batch_size": batch_size, "text_seconds": text_s, "chance": retrieval_chance(t2i, n, ks),
        "dense": {**{k: dense[k] for k in metric_keys}, **throughput(ip.dense_seconds, n), "metrics": retrieval_metrics(dense),
                  "predictions": retrieval_predictions(_unit(text) @ _unit(dense_emb).T, t2i)},
        "runs": [],
    }
    for (m, o), g, r, pt in zip(settings, given, ip.runs, per_text):
        emb = torch.cat(r.outputs)
        tx = text if pt is None else pt
        rec = retrieval_recall(emb, tx, t2i, ks)
        row = _row_common(m, o, g, r, emb, dense_emb, ip.dense_seconds, n)
        row.update({k: rec[k] for k in metric_keys})
        row.update(metrics=retrieval_metrics(rec), predictions=retrieval_predictions(_unit(tx) @ _unit(emb).T, t2i))
        row["t2i_top1_agreement"] = float(((tx @ emb.T).argmax(1) == dense_top1).float().mean())
        result["runs"].append(row)
    return finish(result, ip)
