"""CLIP_benchmark's own zero-shot classification and retrieval on the unpatched model and on each setting.

The model is loaded once; for each setting it is patched, CLIP_benchmark's
``clip_benchmark.metrics.zeroshot_classification.evaluate`` or ``zeroshot_retrieval.evaluate`` runs on it
(through :class:`~attnpatch.evals.clipbench.encode.HarnessModel`), and it is unpatched. The scores
``evaluate`` ranked are kept as they pass (its ``run_classification`` logits, the text x image scores it hands
to ``batchify``), so every setting also gives per-sample predictions.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ...log import Log, log_stderr
from ...patchers.api import patch_info, patched, record_stats
from ..clip.metrics import check_ks, retrieval_predictions
from ..run.report import EvalInterrupted, setting_label
from ..vision.image_pass import exact_note, resolve_settings
from .data import BenchData
from .encode import HarnessModel
from .shim import numpy_shim

__all__ = ["run_clip_benchmark", "setting_label"]


@contextlib.contextmanager
def _kept_scores(kept: dict[str, Any]) -> Iterator[None]:
    """Keep what CLIP_benchmark ranks while its ``evaluate`` runs: ``kept["logits"]`` / ``kept["target"]``
    (``run_classification``'s return) and ``kept["scores"]`` / ``kept["positive"]`` (the first ``batchify`` call of
    ``zeroshot_retrieval.evaluate``: texts x images)."""
    from clip_benchmark.metrics import zeroshot_classification as zc
    from clip_benchmark.metrics import zeroshot_retrieval as zr

    run_classification, batchify = zc.run_classification, zr.batchify

    def keep_classification(*args, **kwargs):
        logits, target = run_classification(*args, **kwargs)
        kept.update(logits=logits, target=target)
        return logits, target

    def keep_batchify(func, x, y, *args, **kwargs):
        kept.setdefault("scores", x)
        kept.setdefault("positive", y)
        return batchify(func, x, y, *args, **kwargs)

    zc.run_classification, zr.batchify = keep_classification, keep_batchify
    try:
        with numpy_shim():
            yield
    finally:
        zc.run_classification, zr.batchify = run_classification, batchify


def _evaluate(data: BenchData, harness: HarnessModel, tokenizer, device: str, amp: bool, ks, batch_size: int) -> tuple[dict, dict]:
    from clip_benchmark.metrics import zeroshot_classification, zeroshot_retrieval

    kept: dict[str, Any] = {}
    with _kept_scores(kept), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "y_pred contains classes not in y_true")  # sklearn, inside CLIP_benchmark: noise
        if data.task == "zeroshot_classification":
            metrics = zeroshot_classification.evaluate(harness, data.loader(batch_size), tokenizer, data.classnames, data.templates,
                                                       device=device, amp=amp)
        else:
            metrics = zeroshot_retrieval.evaluate(harness, data.loader(batch_size), tokenizer, device=device, amp=amp,
                                                  recall_k_list=list(ks))
    return {k: float(v) for k, v in metrics.items()}, kept


def _predictions(task: str, kept: dict[str, Any]) -> tuple[Any, int, int | None]:
    """``(predictions, n_images, n_texts)`` from what :func:`_kept_scores` kept."""
    if task == "zeroshot_classification":
        return kept["logits"].argmax(1).tolist(), int(kept["target"].shape[0]), None
    scores, positive = kept["scores"].float(), kept["positive"]
    pred = retrieval_predictions(scores, positive.float().argmax(1))
    return pred, int(scores.shape[1]), int(scores.shape[0])


def _agreement(task: str, pred, dense) -> float:
    a, b = (pred, dense) if task == "zeroshot_classification" else (pred["t2i_top1"], dense["t2i_top1"])
    return sum(x == y for x, y in zip(a, b)) / len(a) if a else float("nan")


def run_clip_benchmark(
    bundle,
    data: BenchData,
    *,
    settings: Sequence[tuple[str, dict[str, Any]]],
    towers: Any = None,
    amp: bool = False,
    ks: Sequence[int] = (1, 5, 10),
    batch_size: int = 32,
    warmup: bool = True,
    on_setting: Callable[[dict[str, Any]], Any] | None = None,
    log: Log = log_stderr,
) -> dict[str, Any]:
    """CLIP_benchmark's zero-shot classification or retrieval, dense and each setting, on one loaded model.

    Args:
        bundle: a :class:`attnpatch.clip_models.ClipBundle` (open_clip or Hugging Face; left unpatched).
        data: a :class:`~attnpatch.evals.clipbench.data.BenchData` (its images through ``bundle.preprocess``).
        settings: ``[(method, options), ...]``, each run after dense.
        towers: towers each setting routes (``None``: the model's default, the image tower).
        amp: CLIP_benchmark's ``amp`` (``torch.autocast`` on the model's device: bfloat16 on a CPU, float16 on CUDA).
        ks: retrieval recall cut-offs (each at most the number of images, as CLIP_benchmark's ``torch.topk`` needs).
        batch_size: images per batch.
        warmup: one untimed image forward per setting first (a patch's one-time work stays out of the time).
        on_setting: called with each finished entry (dense first), e.g. to write its file.
        log: one line per step.

    Returns:
        ``{"eval": "clip-benchmark", "task", "dataset", "amp", "ks" (retrieval), "n_images", "n_texts"
        (retrieval), "n_classes" / "n_templates" (classification), "batch_size", "dense": entry, "runs":
        [entry, ...]}``; an entry is ``{"setting", "method" (``None`` for dense), "options", "shown_options",
        "towers", "metrics" (CLIP_benchmark's dict: ``acc1``, ``acc5``, ``mean_per_class_recall`` fractions in
        [0, 1], ``acc5`` NaN under 5 classes; or ``image_retrieval_recall@k``, ``text_retrieval_recall@k``),
        "predictions" (classification: ``[N]`` top-1 class of CLIP_benchmark's logits; retrieval:
        :func:`attnpatch.evals.clip.retrieval_predictions` of its scores), "image_seconds" (wall time in the image
        tower), "images_per_s"}``; a setting's entry adds ``"diff"`` (metric minus dense's), ``"note"`` (``"exact
        attention: <why>"`` when every patched layer ran exact attention at this resolution), ``"speedup"``
        (dense image seconds / its own) and ``"agreement"`` (top-1 equal to dense's: per image, or per text for
        retrieval).

    Raises:
        OptionError: bad ``ks`` (also a ``k`` above the image count, once known).
        UnknownMethodError / OptionError / UnsupportedModelError: a bad setting (before any image is encoded).
        EvalInterrupted: Ctrl-C; its ``partial`` holds the finished entries (``"interrupted": True``), or is
            ``None`` before dense finished.
    """
    from ...errors import OptionError

    settings, given = resolve_settings(settings, bundle.model, towers)
    ks = check_ks(ks)
    if data.task == "zeroshot_retrieval" and not data.iterable and max(ks) > len(data.dataset):
        raise OptionError(f"--ks {max(ks)}: above the {len(data.dataset)} images; CLIP_benchmark's recall@k needs k <= the image count")
    device = torch.device(bundle.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    harness = HarnessModel(bundle.model)
    result: dict[str, Any] = {"eval": "clip-benchmark", "task": data.task, "dataset": data.name, "split": data.split, "amp": bool(amp),
                              "batch_size": batch_size, "dense": None, "runs": []}
    if data.task == "zeroshot_retrieval":
        result["ks"] = ks
    else:
        result.update(n_classes=len(data.classnames), n_templates=len(data.templates))
    plan = [(None, {}, {})] + [(m, o, g) for (m, o), g in zip(settings, given)]
    done = 0
    try:
        for method, opts, shown in plan:
            label = setting_label(method, shown)
            with patched(bundle.model, method, towers=towers, **opts) if method else contextlib.nullcontext():
                modes: set[str] = set()
                if warmup or method:  # one image first: the patch's one-time work stays out of the time, and its modes
                    with torch.no_grad(), torch.autocast(device.type, enabled=amp), \
                            (record_stats(bundle.model) if method else contextlib.nullcontext()) as rec:
                        harness.encode_image(torch.zeros(1, 3, bundle.resolution, bundle.resolution, device=device))
                    modes = {lr.mode for fw in (rec.forwards if rec is not None else []) for lr in fw.values()}
                routed = patch_info(bundle.model)["towers"] if method else None
                harness.reset()
                log(f"{label}: CLIP_benchmark {data.task} ...")
                metrics, kept = _evaluate(data, harness, bundle.tokenizer, device.type, amp, ks, batch_size)
            pred, n_images, n_texts = _predictions(data.task, kept)
            entry = {"setting": label, "method": method, "options": opts, "shown_options": shown,
                     "towers": routed,
                     "metrics": metrics, "predictions": pred, "image_seconds": harness.image_seconds,
                     "images_per_s": harness.images / harness.image_seconds if harness.image_seconds else None}
            note = exact_note(modes) if method else None
            if note:  # every patched layer ran exact attention at this resolution: the table and the plot say so
                entry["note"] = note
            result.update(n_images=n_images, **({"n_texts": n_texts} if n_texts is not None else {}))
            if method is None:
                result["dense"] = entry
            else:
                dense = result["dense"]
                entry["diff"] = {k: v - dense["metrics"][k] if not (math.isnan(v) or math.isnan(dense["metrics"][k])) else float("nan")
                                 for k, v in metrics.items()}
                entry["speedup"] = dense["image_seconds"] / entry["image_seconds"] if entry["image_seconds"] else None
                entry["agreement"] = _agreement(data.task, pred, dense["predictions"])
                result["runs"].append(entry)
            done += 1
            log(f"{label}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            if on_setting is not None:
                on_setting(entry)
    except KeyboardInterrupt as exc:
        if isinstance(exc, EvalInterrupted):
            raise
        partial = None if result["dense"] is None else {**result, "interrupted": True, "n_settings_planned": len(plan)}
        raise EvalInterrupted(partial, f"{done}/{len(plan)} settings") from None
    return result
