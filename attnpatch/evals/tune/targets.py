"""What the agreement search (:mod:`.search`) measures, one target each: k-NN top-1 agreement of a ViT's CLS
features, segmentation prediction agreement of its patch features, zero-shot agreement of a CLIP image tower, and
RULER scores equal to dense for a causal LM's prefill; each with its ``tune_*`` entry point (calibration split,
search, held-out report)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...errors import OptionError
from ...patchers.api import patched
from ...timing import quietly
from .search import DEFAULT_DEPTHS, check_deadline, families_of, search_agreement

__all__ = ["knn_agreement", "tune_knn_agreement", "seg_agreement", "tune_seg_agreement", "zeroshot_agreement",
           "tune_zeroshot_agreement", "ruler_agreement", "tune_ruler_agreement"]


def _batches(n: int, size: int) -> list[list[int]]:
    """Indices ``0 .. n-1`` in consecutive batches of ``size`` (the last one shorter), as the evals batch them."""
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def knn_agreement(model, images, preprocess, *, batch_size: int = 8, knn_k: int = 20) -> Callable:
    """``measure(settings, deadline=None) -> [k-NN top-1 agreement with dense, ...]`` over the labelled image set
    ``images``: each image's k-NN prediction among the others (``knn_k`` neighbours,
    :func:`attnpatch.evals.vision.metrics.knn_classify` on the final CLS, as ``eval knn``) compared with dense's.
    Dense's features are computed once, at the first call; each call encodes the images under each setting (no timing:
    the search times its winners apart), checking ``deadline`` (:func:`~.search.check_deadline`) before each batch."""
    import numpy as np
    import torch

    from ..vision.metrics import knn_classify
    from ..vision.runner import encode

    labels = np.asarray(images.labels)
    batches = _batches(len(images), batch_size)
    dense_pred: list = []

    def features(deadline: float | None = None) -> np.ndarray:
        out = []
        with torch.no_grad():
            for b in batches:
                check_deadline(deadline)
                out.append(encode(model, preprocess([images[i][0] for i in b]))[0])
        return torch.cat(out).numpy()

    def measure(settings: list[tuple[str, dict[str, Any]]], deadline: float | None = None) -> list[float]:
        if not dense_pred:
            dense_pred.append(np.asarray(knn_classify(features(), labels, k=knn_k)["predictions"]))
        out = []
        for m, o in settings:
            with patched(model, m, **o):
                feats = quietly(lambda: features(deadline))
            pred = np.asarray(knn_classify(feats, labels, k=knn_k)["predictions"])
            out.append(float(np.mean(pred == dense_pred[0])))
        return out

    return measure


def tune_knn_agreement(model, calibration, held_out, preprocess, method: str, *, target: float = 0.99,
                       given: dict[str, Any] | None = None, batch_size: int = 8, knn_k: int = 20,
                       max_candidates: int = 24, repeats: int = 5, depths: Sequence[float] = DEFAULT_DEPTHS,
                       max_minutes: float | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """:func:`search_agreement` on k-NN top-1 agreement with dense over the ``calibration`` images, then the chosen
    setting measured on the disjoint ``held_out`` images (its agreement and speed-up there).

    Args:
        model: an unpatched ViT encoder; calibration, held_out: labelled image sets (``len``, ``[i]``, ``labels``).
        preprocess: list of PIL images -> ``[B, 3, R, R]`` at the resolution tuned for.
        method: a method of :func:`searchable_methods`; given: options every candidate keeps (e.g. ``s`` of ``tome+fna``).
        target: k-NN top-1 agreement with dense to reach on the calibration split, in ``[0, 1]``.
        batch_size, knn_k: as ``attnpatch eval knn``; max_candidates, repeats, depths, max_minutes: the search's bounds
            (:func:`search_agreement`).

    Returns:
        :func:`search_agreement`'s result with ``"method"``, ``"tokens"``, ``"calibration"`` and ``"held_out"`` (image
        counts) and ``"held_out_result"``: ``{"knn_agreement", "knn_top1", "dense_knn_top1", "cls_cosine", "speedup",
        "speedup_spread"}`` of the chosen setting (``None`` when the exact model was chosen).
    """
    from ...patchers.api import model_geometry
    from ..vision.runner import encode, run_feature_eval, token_count

    if len(calibration) < 2 or len(held_out) < 2:
        raise OptionError(f"{len(calibration)} calibration and {len(held_out)} held-out images: k-NN agreement needs at "
                          "least 2 in each")
    x = preprocess([calibration[i][0] for i in range(min(batch_size, len(calibration)))])
    tokens = token_count(model, int(x.shape[-1]))
    fams = families_of(method, model_geometry(model).num_layers, tokens, given, depths)
    res = search_agreement(model, method, knn_agreement(model, calibration, preprocess, batch_size=batch_size, knn_k=knn_k),
                           lambda: encode(model, x), target=target, families=fams, max_candidates=max_candidates,
                           repeats=repeats, max_minutes=max_minutes, progress=progress)
    chosen = res["chosen"]
    held = None
    if not chosen.get("exact"):
        out = quietly(lambda: run_feature_eval(model, held_out, preprocess, settings=[(method, chosen["options"])],
                                               tasks=("fidelity", "knn"), batch_size=batch_size, layer_error_images=0,
                                               knn_k=knn_k))
        run = out["runs"][0]
        held = {"knn_agreement": run["knn_agreement"], "knn_top1": run.get("knn_top1"),
                "dense_knn_top1": out["dense"].get("knn_top1"), "cls_cosine": run.get("cls_cosine"),
                "speedup": run.get("speedup"), "speedup_spread": run.get("speedup_spread")}
    return {"method": method, "tokens": tokens, "resolution": int(x.shape[-1]), "calibration": len(calibration),
            "held_out": len(held_out), **res, "held_out_result": held}


def seg_agreement(model, data, preprocess, fitted, *, readout: str = "linear", batch_size: int = 8) -> Callable:
    """``measure(settings, deadline=None) -> [segmentation prediction agreement with dense, ...]`` over ``data``'s val
    split: the share of non-void pixels where a setting's class map equals dense's, as ``eval segmentation`` reports it (the
    read-out ``fitted`` once on the unpatched model's train features, :func:`attnpatch.evals.segmentation.fit_readouts`;
    the patch tokens of the last block, class maps upsampled to each label map's size).  Dense's maps are computed
    once, at the first call, and kept (their non-void pixels, one byte each with fewer than 256 classes); each call encodes
    the val images under each setting only (no timing: the search times its winners apart), checking ``deadline``
    (:func:`~.search.check_deadline`) before each batch.

    Raises:
        UnsupportedModelError: a setting's method without per-patch output (at the call).
    """
    import numpy as np
    import torch

    from ...patchers.adapters import adapter_for
    from ..segmentation.data import VOID
    from ..segmentation.heads import predict
    from ..segmentation.runner import check_dense_methods

    adapter = adapter_for(model)
    head = fitted.heads[None][readout]
    val = data.val
    small = np.uint8 if len(data.classes) < 256 else np.int16
    batches = _batches(len(val), batch_size)
    kept: list[np.ndarray] = []  # per val image: dense's classes on its non-void pixels

    def maps(deadline: float | None = None):
        """``(index, class map, non-void mask)`` of each val image under the model as it is."""
        for b in batches:
            check_deadline(deadline)
            with torch.no_grad():
                feats = adapter.patch_tokens(model, preprocess([val.image(i) for i in b]))
                for j, i in enumerate(b):
                    labels = val.labels(i)
                    yield i, predict(head(feats[j:j + 1])[0], labels.shape), labels != VOID

    def measure(settings: list[tuple[str, dict[str, Any]]], deadline: float | None = None) -> list[float]:
        check_dense_methods([m for m, _ in settings])
        if not kept:
            kept.extend(pred[ok].astype(small) for _, pred, ok in maps())
        valid = sum(d.size for d in kept)
        out = []
        for m, o in settings:
            with patched(model, m, **o):
                agree = quietly(lambda: sum(int((pred[ok].astype(small) == kept[i]).sum()) for i, pred, ok in maps(deadline)))
            out.append(agree / valid if valid else float("nan"))
        return out

    return measure


def tune_seg_agreement(model, data, preprocess, method: str, *, target: float = 0.99, given: dict[str, Any] | None = None,
                       calibration: int | None = None, split_seed: int = 0, batch_size: int = 8,
                       max_patches: int = 100_000, probe_steps: int = 2000, max_candidates: int = 24, repeats: int = 5,
                       depths: Sequence[float] = DEFAULT_DEPTHS, max_minutes: float | None = None,
                       progress: Callable[[str], None] | None = None, fitted=None) -> dict[str, Any]:
    """:func:`search_agreement` on segmentation prediction agreement (linear read-out, fitted once on the unpatched
    model's train features) over a seeded calibration share of ``data``'s val split; the chosen setting then measured
    on the rest of val (agreement, mIoU and its difference from dense, speed-up).

    Args:
        data: a :class:`~attnpatch.evals.segmentation.SegmentationSet`; calibration: val images searched on (default
            half, in the order ``split_seed`` draws); the others are held out.
        max_patches, probe_steps: the linear probe's sample and steps (``eval segmentation``'s).
        fitted: the linear read-out fitted earlier on ``data``'s train split (:func:`~attnpatch.evals.segmentation.fit_readouts`),
            e.g. shared by the tuning runs of several methods; default: fitted here.

    Returns:
        As :func:`tune_knn_agreement`; ``"held_out_result"``: ``{"agreement", "miou", "dense_miou", "miou_delta",
        "speedup", "speedup_spread"}``.
    """
    import dataclasses

    import torch

    from ...patchers.api import model_geometry
    from ..segmentation import fit_readouts, run_segmentation

    n = len(data.val)
    n_cal = n // 2 if calibration is None else int(calibration)
    if n_cal < 1 or n - n_cal < 1:
        raise OptionError(f"{n} val images: the calibration share ({n_cal}) and the held-out rest ({n - n_cal}) need one "
                          "image each at least")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed)).tolist()
    cal = dataclasses.replace(data, val=data.val.subset(order[:n_cal]))
    hold = dataclasses.replace(data, val=data.val.subset(order[n_cal:]))
    if fitted is None:
        fitted = fit_readouts(model, data, preprocess, readouts=("linear",), max_patches=max_patches,
                              batch_size=batch_size, probe_steps=probe_steps)
    x = preprocess([cal.val.image(i) for i in range(min(batch_size, n_cal))])
    from ..vision.runner import token_count

    tokens = token_count(model, int(x.shape[-1]))
    from ...patchers.adapters import adapter_for

    adapter = adapter_for(model)
    fams = families_of(method, model_geometry(model).num_layers, tokens, given, depths)
    res = search_agreement(model, method, seg_agreement(model, cal, preprocess, fitted, batch_size=batch_size),
                           lambda: adapter.patch_tokens(model, x), target=target, families=fams,
                           max_candidates=max_candidates, repeats=repeats, max_minutes=max_minutes, progress=progress)
    chosen = res["chosen"]
    held = None
    if not chosen.get("exact"):
        out = quietly(lambda: run_segmentation(model, hold, preprocess, settings=[(method, chosen["options"])],
                                               readouts=("linear",), fitted=fitted, batch_size=batch_size, examples=0))
        run = out["runs"][0]
        held = {"agreement": run["linear"]["agreement"], "miou": run["linear"]["miou"],
                "dense_miou": out["dense"]["linear"]["miou"], "miou_delta": run["linear"]["miou_delta"],
                "speedup": run.get("speedup"), "speedup_spread": run.get("speedup_spread")}
    return {"method": method, "tokens": tokens, "resolution": int(x.shape[-1]), "calibration": n_cal,
            "held_out": n - n_cal, "split_seed": split_seed, **res, "held_out_result": held}


def _routed_tokens(model, forward: Callable[[], Any]) -> int:
    """Tokens per call the routed attention layers see, from one recorded forward through the ``dense`` method."""
    from ...patchers.api import record_stats

    with patched(model, "dense"), record_stats(model) as rec:
        import torch

        with torch.no_grad():
            forward()
    layers = rec.forwards[0] if rec.forwards else {}
    return max((lr.queries for lr in layers.values()), default=0)


def zeroshot_agreement(bundle, images, classnames, templates, *, batch_size: int = 32) -> Callable:
    """``measure(settings, deadline=None) -> [zero-shot top-1 agreement with dense, ...]`` of a CLIP image tower over
    ``images``: the share of images whose predicted class equals dense's, as :func:`attnpatch.evals.clip.run_zeroshot_eval` reports it
    (``templates`` x ``classnames`` prompts through the unpatched text tower, averaged per class).  The classifier and
    dense's predictions are made once, at the first call, and kept; each call encodes the images under each setting
    only, checking ``deadline`` (:func:`~.search.check_deadline`) before each batch.

    Raises:
        DataError: fewer class names than labels (at the first call).
    """
    import numpy as np
    import torch

    from ..clip.metrics import zeroshot_accuracy, zeroshot_classifier
    from ..clip.prompts import zeroshot_prompts

    labels = np.asarray(images.labels)
    names = list(classnames)
    batches = _batches(len(images), batch_size)
    kept: dict[str, Any] = {}

    def predictions(deadline: float | None = None) -> np.ndarray:
        emb = []
        with torch.no_grad():
            for b in batches:
                check_deadline(deadline)
                emb.append(bundle.encode_image(bundle.preprocess([images[i][0] for i in b])))
        emb = torch.cat(emb)
        return np.asarray(zeroshot_accuracy(emb, kept["classifier"], labels, (1,))["predictions"])

    def measure(settings: list[tuple[str, dict[str, Any]]], deadline: float | None = None) -> list[float]:
        if not kept:
            _, prompts = zeroshot_prompts(names, templates, labels)
            with torch.no_grad():
                kept["classifier"] = zeroshot_classifier(bundle.encode_text(prompts, batch_size=256), len(names))
            kept["dense"] = predictions()
        out = []
        for m, o in settings:
            with patched(bundle.model, m, **o):
                pred = quietly(lambda: predictions(deadline))
            out.append(float(np.mean(pred == kept["dense"])))
        return out

    return measure


def tune_zeroshot_agreement(bundle, calibration, held_out, classnames, templates, method: str, *, target: float = 0.99,
                            given: dict[str, Any] | None = None, batch_size: int = 32, max_candidates: int = 24,
                            repeats: int = 5, depths: Sequence[float] = DEFAULT_DEPTHS,
                            max_minutes: float | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """:func:`search_agreement` on a CLIP image tower's zero-shot top-1 agreement with dense over the ``calibration``
    images, the chosen setting then measured on ``held_out`` (``"held_out_result"``: ``{"agreement", "top1",
    "dense_top1", "speedup", "speedup_spread"}``; ``None`` when the exact model was chosen).  Otherwise as
    :func:`tune_knn_agreement`."""
    from ...patchers.api import model_geometry
    from ..clip.runner import run_zeroshot_eval

    x = bundle.preprocess([calibration[i][0] for i in range(min(batch_size, len(calibration)))])
    model = bundle.model
    tokens = _routed_tokens(model, lambda: bundle.encode_image(x))
    fams = families_of(method, model_geometry(model).num_layers, tokens, given, depths)
    res = search_agreement(model, method, zeroshot_agreement(bundle, calibration, classnames, templates,
                                                             batch_size=batch_size),
                           lambda: bundle.encode_image(x), target=target, families=fams, max_candidates=max_candidates,
                           repeats=repeats, max_minutes=max_minutes, progress=progress)
    chosen = res["chosen"]
    held = None
    if not chosen.get("exact"):
        out = quietly(lambda: run_zeroshot_eval(bundle, held_out, classnames, templates,
                                                settings=[(method, chosen["options"])], batch_size=batch_size, ks=(1,),
                                                log=lambda *a, **k: None))
        run = out["runs"][0]
        held = {"agreement": run["agreement"], "top1": run.get("top1"), "dense_top1": out["dense"].get("top1"),
                "speedup": run.get("speedup"), "speedup_spread": run.get("speedup_spread")}
    return {"method": method, "tokens": tokens, "resolution": int(x.shape[-1]), "calibration": len(calibration),
            "held_out": len(held_out), **res, "held_out_result": held}


def ruler_agreement(model, tok, *, tasks: Sequence[str], length: int, samples: int, seed: int) -> Callable:
    """``measure(settings, deadline=None) -> [share of RULER samples whose score equals dense's, ...]`` over
    ``tasks`` at ``length`` tokens, ``samples`` each from ``seed`` on: ``eval ruler``'s prompts, greedy generations and
    scores (:func:`attnpatch.evals.ruler.run_ruler_settings`).  The prompts and dense's scores are made once, at the
    first call, and kept; each call generates under each setting only, checking ``deadline``
    (:func:`~.search.check_deadline`) before each sample.

    Raises:
        DataError: a length too short for a task (at the first call, before any generation).
    """
    from ..ruler import tasks as ruler_tasks
    from ..ruler.runner import generate_greedy
    from ..ruler.text import build_input_ids

    model.eval()
    kept: list[tuple[str, Any, list[int], float]] = []  # per sample: task, sample, prompt ids, dense's score

    def score(task: str, s, ids: list[int], deadline: float | None = None) -> float:
        check_deadline(deadline)
        text, _ = generate_greedy(model, tok, ids, s.max_new_tokens)
        return ruler_tasks.score(task, text, s.answers)

    def measure(settings: list[tuple[str, dict[str, Any]]], deadline: float | None = None) -> list[float]:
        if not kept:
            plan = [(t, s) for t in tasks for s in ruler_tasks.make_samples(t, tok, length, samples, seed=seed)]
            for t, s in plan:
                ids = build_input_ids(tok, s)
                kept.append((t, s, ids, score(t, s, ids)))
        out = []
        for m, o in settings:
            with patched(model, m, **o):
                same = quietly(lambda: sum(score(t, s, ids, deadline) == dense for t, s, ids, dense in kept))
            out.append(same / max(1, len(kept)))
        return out

    return measure


def tune_ruler_agreement(model, tok, method: str, *, target: float = 1.0, given: dict[str, Any] | None = None,
                         tasks: Sequence[str] = ("niah_single", "niah_multikey"), length: int = 4096,
                         calibration: int = 2, held_out: int = 2, calibration_seed: int = 1000,
                         max_candidates: int = 12, repeats: int = 5, max_minutes: float | None = None,
                         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """:func:`search_agreement` for a causal LM's prefill method on RULER: the share of calibration samples
    (``calibration`` per task, seeds ``calibration_seed`` on) whose score equals the unpatched model's must reach
    ``target`` (1.0: every score equal); the method's knob is one value for every layer (one family).  The chosen
    setting then runs on ``held_out`` samples per task from seed 0 (``eval ruler``'s prompts, disjoint from the
    calibration seeds): ``"held_out_result"``: ``{"agreement", "dense_acc", "tuned_acc", "prefill_speedup"}``.
    Timing: the prefill of the first calibration prompt, dense beside the setting in pairs."""
    import torch

    from ..ruler import tasks as ruler_tasks
    from ..ruler.runner import run_ruler_settings
    from ..ruler.text import build_input_ids
    from ...patchers.api import model_geometry

    sample = ruler_tasks.make_samples(tasks[0], tok, length, 1, seed=calibration_seed)[0]
    ids = torch.tensor([build_input_ids(tok, sample)])
    fams = families_of(method, model_geometry(model).num_layers, ids.shape[1], given, per_layer=False)
    res = search_agreement(model, method, ruler_agreement(model, tok, tasks=tasks, length=length, samples=calibration,
                                                          seed=calibration_seed),
                           lambda: model(input_ids=ids, use_cache=False), target=target, families=fams,
                           max_candidates=max_candidates, repeats=repeats, max_minutes=max_minutes, progress=progress)
    chosen = res["chosen"]
    held = None
    if not chosen.get("exact") and held_out:
        out = quietly(lambda: run_ruler_settings(model, tok, settings=[(method, chosen["options"])], tasks=list(tasks),
                                                 lengths=[length], num_samples=held_out, seed=0, recall=False))
        cells = out["runs"][0]["cells"]
        rows = [r for c in cells for r in c["samples"]]
        held = {"agreement": sum(r["patched_score"] == r["dense_score"] for r in rows) / max(1, len(rows)),
                "dense_acc": sum(r["dense_score"] for r in rows) / max(1, len(rows)),
                "tuned_acc": sum(r["patched_score"] for r in rows) / max(1, len(rows)),
                "prefill_speedup": [c.get("prefill_speedup") for c in cells]}
    return {"method": method, "tokens": int(ids.shape[1]), "calibration": calibration * len(tasks),
            "held_out": held_out * len(tasks), **res, "held_out_result": held}
