"""The runs of :mod:`attnpatch.evals.compare`: :func:`compare_vision`, :func:`compare_clip` and :func:`compare_ruler`
run dense and every setting on the same inputs through the existing runners, the budget matched first
(:func:`~attnpatch.evals.compare.matching.match_settings`), and return one row per setting plus dense."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...errors import OptionError
from ...log import Log
from ...patchers.registry import get_method, validate_options
from ..run.distributed import Ranks
from ..run.report import EvalInterrupted
from .table import front_of
from .matching import EVALS, Match, Settings, as_matches, check_settings, match_settings

__all__ = ["compare_vision", "compare_clip", "compare_ruler", "compare_segmentation"]


def _interrupt_guard(fn, done: str):
    try:
        return fn()
    except KeyboardInterrupt as exc:
        if isinstance(exc, EvalInterrupted):
            raise
        raise EvalInterrupted(None, done) from None


def _image_of(item):
    return item[0] if isinstance(item, tuple) else item


def _calibrated(ranks, store, fn, done: str):
    """``fn()`` (the matched settings and their infos) run once, on rank 0, and sent to every process; with a resumed
    ``store``, what the earlier run matched (a budget matched on measured time would come out otherwise)."""
    r = ranks or Ranks()
    got = store.recall("calibration") if store is not None else None
    if got is None:
        got = r.broadcast(_interrupt_guard(fn, done) if r.main else None)
        if store is not None and r.main:
            store.keep("calibration", got)
    return got


def _first_batch(images, preprocess, batch_size: int) -> torch.Tensor:
    return preprocess([_image_of(images[i]) for i in range(min(len(images), batch_size))])


def _finish(eval: str, match, given: Settings, infos, runner_result: dict[str, Any], rows_of) -> dict[str, Any]:
    """The compare result from a runner's result (``rows_of(runner_result)`` -> dense row, run rows)."""
    _, _, mkey, mlabel, fkey, flabel = EVALS[eval]
    dense, runs = rows_of(runner_result)
    src = runner_result.get("runs") if isinstance(runner_result.get("runs"), list) else []
    rows = [{"method": "dense", "baseline": True, "options": {}, "given_options": {}, **dense}]
    for i, ((m, g), info, run) in enumerate(zip(given, infos, runs)):
        method = get_method(m)
        knob = method.knob
        exact = str(run.get("note") or "").startswith("exact attention")
        # an exact row approximated nothing: it names no landmarks
        tok = info["options"].get(knob.tokens) if knob is not None and knob.tokens and not exact else None
        typed = _typed(method, g)
        shown = {**typed, **info.get("knob_options", {})}
        spread = {k: src[i].get(k) for k in ("speedup_spread", "speedup_within_noise")} if i < len(src) else {}
        rows.append({
            "method": m, "options": info["options"], "given_options": typed, "shown_options": shown,
            "sparsity": info.get("sparsity"), "knob_tokens": f"{knob.tokens}={tok}" if tok is not None else None,
            **run, **spread, "exact": exact, "match": {k: v for k, v in info.items() if k != "options"},
        })
    out = {
        "eval": eval, "metric": mkey, "metric_label": mlabel, "fidelity": fkey, "fidelity_label": flabel,
        "match": [{"key": mt.key, "value": mt.value} for mt in as_matches(match)] or None, "rows": rows, "result": runner_result,
    }
    if runner_result.get("timing") is not None:
        out["timing"] = runner_result["timing"]
    out["pareto_front"] = front_of(rows)
    out["warnings"] = _match_warnings(rows)
    return out


def _match_warnings(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row whose ``--match speedup`` was reached on the calibration input but not in the run: the run's
    speed-up is off the target by more than the match's tolerance (2 %) and its spread does not hold the target."""
    out = []
    for r in rows:
        mi = r.get("match") or {}
        run = r.get("speedup")
        if mi.get("key") != "speedup" or mi.get("status") not in ("matched", "closest") or run is None:
            continue
        mi["run_speedup"] = run
        target = float(mi["target"])
        # a "closest" match could not reach the target: the run is held to what the calibration reached
        expect = target if mi["status"] == "matched" else float(mi["reached"])
        spread = r.get("speedup_spread") or [run, run]
        if abs(run - expect) > 0.02 * expect and not spread[0] <= expect <= spread[1]:
            knob = ", ".join(f"{k}={v}" for k, v in (mi.get("knob_options") or {}).items())
            out.append(f"warning: {r['method']} {knob}: --match speedup={target:g} was {mi['status']} on the calibration "
                       f"input ({mi['reached']:.2f}x), but the whole run measured {run:.2f}x: the first batch's speed is "
                       "not the run's (other image sizes, a warmer cache, or a busier machine while calibrating)")
    return out


def _typed(method, given: dict[str, Any]) -> dict[str, Any]:
    """The options a user gave, each parsed to its option's type (``{"s": "64"}`` -> ``{"s": 64}``)."""
    full = validate_options(method, dict(given))
    return {k: full.get(k, v) for k, v in given.items()}


def _runner(fn, eval, match, given, infos, rows_of):
    """Run ``fn()`` (a runner); on Ctrl-C, re-raise :class:`EvalInterrupted` carrying the compare result over the finished part."""
    try:
        res = fn()
    except EvalInterrupted as exc:
        if exc.partial is None:
            raise
        partial = _finish(eval, match, given, infos, exc.partial, rows_of)
        partial["interrupted"] = True
        raise EvalInterrupted(partial, exc.done) from None
    return _finish(eval, match, given, infos, res, rows_of)


def _image_rows(mkey: str, fkey: str):
    def rows_of(res):
        d = res["dense"]
        dense = {"metric": 1.0 if mkey == fkey else d.get(mkey), "fidelity": 1.0, "speedup": 1.0, "seconds": d.get("seconds"),
                 "images_per_s": d.get("images_per_s"), "sparsity": 0.0}
        runs = [{"metric": r.get(mkey), "fidelity": r.get(fkey), "speedup": r.get("speedup"), "seconds": r.get("seconds"),
                 "images_per_s": r.get("images_per_s"), **({"note": r["note"]} if r.get("note") else {})} for r in res["runs"]]
        return dense, runs

    return rows_of


def compare_vision(
    model: torch.nn.Module,
    images,
    preprocess: Callable[[list], torch.Tensor],
    *,
    eval: str,
    settings: Settings,
    match: Match | None = None,
    batch_size: int = 16,
    layer_error_images: int = 0,
    knn_k: int = 20,
    steps: int = 10,
    progress: Callable[[int, int], None] | None = None,
    log: Log | None = None,
    ranks: Ranks | None = None,
    store=None,
) -> dict[str, Any]:
    """Dense vs several settings on frozen ViT features, at a matched budget, in one run.

    Args:
        model: an unpatched ViT encoder (see :func:`attnpatch.evals.vision.encode`).
        images: a labelled image set (e.g. :func:`attnpatch.evals.vision.images.load_image_set`).
        preprocess: list of PIL images -> ``[B, 3, R, R]``.
        eval: ``"fidelity"``, ``"knn"``, ``"linear-probe"`` or ``"retrieval"``; the CLS cosine to
            dense (fidelity) is measured for every eval.
        settings: ``[(method, options)]`` as given.
        match: the budget (see :func:`match_settings`), matched on the first batch; ``None``: as given.
        batch_size: images per forward call.
        layer_error_images: per-layer errors on the first this many images (costly; 0 = none).
        knn_k: k-NN neighbours.
        steps: bisection steps per setting at most.
        progress: ``progress(images_done, images_total)``.
        log: one line per matched setting.
        ranks, store: a data-parallel run and the kept batches of ``--resume``
            (:func:`attnpatch.evals.vision.run_feature_eval`); the budget is matched on rank 0 and kept in ``store``.

    Returns:
        ``{"eval", "metric" (key of the main metric), "metric_label", "fidelity", "fidelity_label",
        "match" ({"key", "value"} or ``None``), "rows": [{"method", "options" (full), "given_options",
        "shown_options", "metric", "fidelity", "sparsity" (measured on the first batch),
        "knob_tokens" ("s=32"), "seconds" (forward time, all images), "images_per_s", "speedup",
        "match": {"status", "target", "reached", "knob", "knob_options", "steps", "t", "sparsity"}}, ...]
        (dense first, marked ``"baseline": True``), "result": run_feature_eval's result}``.

    Raises:
        OptionError / UnknownMethodError / UnsupportedModelError: a bad eval or setting.
        EvalInterrupted: Ctrl-C; ``partial`` is the compare result over the finished batches, or ``None``.
    """
    from ..vision.runner import encode, run_feature_eval

    if EVALS.get(eval, ("",))[0] != "vision":
        raise OptionError(f"compare_vision: eval {eval!r} is not one of fidelity, knn, linear-probe, retrieval")
    given = [(m, dict(o)) for m, o in settings]
    check_settings(given, eval)
    x = _first_batch(images, preprocess, batch_size)
    final, infos = _calibrated(
        ranks, store, lambda: match_settings(model, given, lambda: encode(model, x), match, steps=steps, log=log), "matching (first batch)"
    )
    task = eval.replace("-", "_")
    tasks = ["fidelity", "knn"] if task == "fidelity" else ["fidelity", task]
    _, _, mkey, _, fkey, _ = EVALS[eval]
    return _runner(
        lambda: run_feature_eval(model, images, preprocess, settings=final, tasks=tasks, batch_size=batch_size,
                                 layer_error_images=layer_error_images, knn_k=knn_k, progress=progress, ranks=ranks, store=store),
        eval, match, given, infos, _image_rows(mkey, fkey),
    )


def compare_clip(
    bundle,
    data,
    *,
    eval: str,
    settings: Settings,
    match: Match | None = None,
    classnames: Sequence[str] | None = None,
    templates: Sequence[str] | None = None,
    ks: Sequence[int] | None = None,
    batch_size: int = 32,
    text_batch_size: int = 256,
    steps: int = 10,
    progress: Callable[[int, int], None] | None = None,
    log: Log | None = None,
    ranks: Ranks | None = None,
    store=None,
) -> dict[str, Any]:
    """Dense vs several settings of a CLIP image tower (zero-shot or image-text retrieval), at a matched budget.

    Args:
        bundle: a :class:`attnpatch.clip_models.ClipBundle` (left unpatched).
        data: a labelled image set (``zeroshot``) or a :class:`~attnpatch.evals.clip.CaptionSet` (``clip-retrieval``).
        eval: ``"zeroshot"`` or ``"clip-retrieval"``.
        settings, match, steps, progress, log, ranks, store: as for :func:`compare_vision` (matched on the first batch).
        classnames, templates: zero-shot class names and prompt templates (required for ``zeroshot``).
        ks: cut-offs (default: (1, 5) zero-shot, (1, 5, 10) retrieval).
        batch_size, text_batch_size: images / texts per forward call.

    Returns:
        As :func:`compare_vision`; the metric is top-1 (``zeroshot``) or text->image recall@1, the
        fidelity the image-embedding cosine to dense; ``"result"`` is the CLIP runner's result.

    Raises:
        OptionError: bad eval, or ``zeroshot`` without class names / templates; the errors of the runners.
        EvalInterrupted: Ctrl-C; ``partial`` is the compare result over the finished batches, or ``None``.
    """
    from ..clip import run_retrieval_eval, run_zeroshot_eval

    if EVALS.get(eval, ("",))[0] != "clip":
        raise OptionError(f"compare_clip: eval {eval!r} is not zeroshot or clip-retrieval")
    if eval == "zeroshot" and (classnames is None or templates is None):
        raise OptionError("compare_clip: zeroshot needs classnames and templates")
    given = [(m, dict(o)) for m, o in settings]
    check_settings(given, eval)
    x = _first_batch(data, bundle.preprocess, batch_size)
    final, infos = _calibrated(
        ranks, store, lambda: match_settings(bundle.model, given, lambda: bundle.encode_image(x), match, steps=steps, log=log),
        "matching (first batch)",
    )
    common = dict(settings=final, batch_size=batch_size, text_batch_size=text_batch_size, progress=progress, ranks=ranks, store=store)
    if eval == "zeroshot":
        fn = lambda: run_zeroshot_eval(bundle, data, classnames, templates, ks=tuple(ks or (1, 5)), **common)  # noqa: E731
    else:
        fn = lambda: run_retrieval_eval(bundle, data, ks=tuple(ks or (1, 5, 10)), **common)  # noqa: E731
    _, _, mkey, _, fkey, _ = EVALS[eval]
    return _runner(fn, eval, match, given, infos, _image_rows(mkey, fkey))


def _ruler_rows(res):
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    def weighted(cells, key):
        num = sum(c[key] * c["n"] for c in cells if c.get(key) is not None)
        den = sum(c["n"] for c in cells if c.get(key) is not None)
        return num / den if den else None

    dcells = res["dense"]["cells"]
    dense_s = sum(c["prefill_dense_s"] for c in dcells)
    dense = {"metric": weighted(dcells, "dense_acc"), "fidelity": 1.0, "speedup": 1.0, "seconds": dense_s, "sparsity": 0.0}
    runs = []
    for r in res["runs"]:
        cells = r["cells"]
        secs = sum(c["prefill_patched_s"] for c in cells)
        runs.append({
            "metric": weighted(cells, "patched_acc"), "fidelity": mean(c.get("recall_mean") for c in cells),
            "recall_worst5": mean(c.get("recall_worst5") for c in cells), "seconds": secs,
            "speedup": dense_s / secs if secs else None, "sparsity": mean(c.get("sparsity") for c in cells),
        })
    return dense, runs


def compare_ruler(
    model: torch.nn.Module,
    tokenizer,
    *,
    settings: Settings,
    match: Match | None = None,
    tasks: Sequence[str] = ("niah_single",),
    lengths: Sequence[int] = (1024,),
    num_samples: int = 10,
    seed: int = 0,
    depths: Sequence[float] | None = None,
    haystack: str = "repeat",
    recall: bool = True,
    recall_samples: int | None = None,
    steps: int = 10,
    progress: Callable[[str], None] | None = None,
    on_cell: Callable[[dict[str, Any]], None] | None = None,
    log: Log | None = None,
    ranks: Ranks | None = None,
    resume: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Dense vs several settings on the RULER-style tasks of a causal LM, at a matched budget, in one run.

    Dense answers each sample once, then every setting answers the same sample
    (:func:`attnpatch.evals.ruler.run_ruler_settings`).  ``match`` is calibrated on the prefill of
    the first sample of the first cell (``tokens`` is refused: use sparsity, flops or speedup).

    Args:
        model, tokenizer: an unpatched causal LM and its tokenizer.
        settings: ``[(method, options)]`` as given.
        match: the budget (see :func:`match_settings`), or ``None``.
        tasks, lengths, num_samples, seed, depths, haystack, recall, recall_samples: as for
            :func:`attnpatch.evals.ruler.run_ruler`.
        steps: bisection steps per setting at most.
        progress: called with a line after each sample.
        on_cell: called after each finished cell with the compare result so far.
        log: one line per matched setting.
        ranks: a data-parallel run (:func:`attnpatch.evals.ruler.run_ruler_settings`; the budget is matched on rank 0).
        resume: the compare result (JSON) of an earlier run of this configuration that stopped: its finished
            cells and its matched settings are kept.

    Returns:
        As :func:`compare_vision`; the metric is the accuracy over every cell (samples pooled),
        the fidelity the mean attention recall, ``sparsity`` the mean over the run's prefills
        (``match["sparsity"]``: the one measured on the first sample), ``seconds`` the sum over
        cells of the median prefill time, ``speedup`` dense seconds / setting seconds;
        ``"result"`` is ``run_ruler_settings``'s result.

    Raises:
        OptionError: ``match`` of key ``tokens``; the errors of :func:`run_ruler_settings`.
        EvalInterrupted: Ctrl-C; ``partial`` is the compare result over the finished cells, or ``None``.
    """
    from ..run.devices import input_device
    from ..ruler.runner import run_ruler_settings

    if any(mt.key == "tokens" for mt in as_matches(match)):
        raise OptionError("--match tokens applies to the vision and CLIP evals only; for ruler use sparsity, flops or speedup")
    given = [(m, dict(o)) for m, o in settings]
    check_settings(given, "ruler")
    # a resumed run keeps what the earlier one matched (its rows), and runs its settings
    infos: list[dict[str, Any]] = [{**row.get("match", {}), "options": row["options"]} for row in (resume or {}).get("rows", [])[1:]]

    def calibrate(ids: list[int]):
        x = torch.tensor([ids], device=input_device(model))
        final, got = match_settings(model, given, lambda: model(input_ids=x, use_cache=False), match, steps=steps, log=log)
        infos.extend(got)
        return final

    cell_cb = (lambda res: on_cell({**_finish("ruler", match, given, infos, res, _ruler_rows), "complete": False})) if on_cell else None
    return _runner(
        lambda: run_ruler_settings(
            model, tokenizer, settings=given, tasks=tasks, lengths=lengths, num_samples=num_samples, seed=seed, depths=depths,
            haystack=haystack, recall=recall, recall_samples=recall_samples, calibrate=calibrate, progress=progress, on_cell=cell_cb,
            ranks=ranks, resume=(resume or {}).get("result"),
        ),
        "ruler", match, given, infos, _ruler_rows,
    )


def compare_segmentation(
    model: torch.nn.Module,
    data,
    preprocess: Callable[[list], torch.Tensor],
    *,
    settings: Settings,
    match: Match | None = None,
    readout: str = "linear",
    steps: int = 10,
    log: Log | None = None,
    **run_options: Any,
) -> dict[str, Any]:
    """Dense vs several settings on semantic segmentation (:func:`attnpatch.evals.segmentation.run_segmentation`),
    at a matched budget (on the first val batch), in one run.

    Args:
        model, data, preprocess: as for :func:`~attnpatch.evals.segmentation.run_segmentation`.
        settings, match, steps, log: as for :func:`compare_vision`.
        readout: the read-out whose mIoU is the compare's metric and whose agreement with dense its fidelity
            (``"linear"`` or ``"knn"``); both are in ``"result"`` when ``run_options`` asks for both.
        run_options: the runner's other keywords (``readouts``, ``fit``, ``last``, ``max_patches``, ``batch_size``, ...).

    Returns:
        As :func:`compare_vision`, with ``"readout"``; ``"result"`` is the segmentation runner's result.

    Raises:
        OptionError: ``readout`` not among the run's read-outs; the errors of the runner.
        EvalInterrupted: Ctrl-C; ``partial`` is the compare result over the finished batches, or ``None``.
    """
    from ...patchers.adapters import adapter_for
    from ..segmentation import run_segmentation

    readouts = list(run_options.pop("readouts", [readout]))
    if readout not in readouts:
        raise OptionError(f"readout={readout!r}: not among the run's read-outs {readouts}")
    given = [(m, dict(o)) for m, o in settings]
    check_settings(given, "segmentation")
    adapter = adapter_for(model)
    last = run_options.get("last", 1)
    x = preprocess([data.val.image(i) for i in range(min(len(data.val), run_options.get("batch_size", 8)))])
    final, infos = _calibrated(
        run_options.get("ranks"), run_options.get("store"),
        lambda: match_settings(model, given, lambda: adapter.patch_tokens(model, x, last), match, steps=steps, log=log),
        "matching (first batch)",
    )

    def rows_of(res):
        d = res["dense"]
        dense = {"metric": d[readout]["miou"], "fidelity": 1.0, "speedup": 1.0, "seconds": d.get("seconds"),
                 "images_per_s": d.get("images_per_s"), "sparsity": 0.0}
        runs = [{"metric": r[readout]["miou"], "fidelity": r[readout]["agreement"], "miou_delta": r[readout]["miou_delta"],
                 "speedup": r.get("speedup"), "seconds": r.get("seconds"), "images_per_s": r.get("images_per_s"),
                 **({"note": r["note"]} if r.get("note") else {})} for r in res["runs"]]
        return dense, runs

    out = _runner(lambda: run_segmentation(model, data, preprocess, settings=final, readouts=readouts, **run_options),
                  "segmentation", match, given, infos, rows_of)
    out["readout"] = readout
    return out
