"""Compare dense and several patched settings on one model and one eval, at matched budgets.

:func:`compare_vision` (frozen ViT features: ``fidelity``, ``knn``, ``linear-probe``, ``retrieval``),
:func:`compare_clip` (``zeroshot``, ``clip-retrieval``) and :func:`compare_ruler` (causal LMs) run
dense and every setting on the same inputs in one process, interleaved, through the existing
runners (:func:`attnpatch.evals.vision.run_feature_eval`, the CLIP runners,
:func:`attnpatch.evals.ruler.run_ruler_settings`), and return one row per setting plus dense:
the eval's main metric, a fidelity to dense, the sparsity, the time and the speed-up.

Budget matching (:class:`Match`, ``attnpatch compare --match``) turns each method's main knob
(:attr:`attnpatch.patchers.registry.Method.knob`) before the run, on the first batch of images
(vision, CLIP) or the first sample of the first cell (RULER):

* ``sparsity=X``: bisection on the knob position ``t`` in ``[0, 1]`` until the measured sparsity
  ``1 - sum(kept_pairs) / sum(causal_pairs)`` over every routed layer and head (one recorded
  forward, :func:`attnpatch.record_stats`) is within ``tol`` of ``X``;
* ``flops=X``: the same on the kept fraction ``1 - sparsity``;
* ``tokens=S``: the knob's token-count option (``Knob.tokens``: landmarks ``s``, anchors ``m``) set to ``S``;
* ``speedup=X``: bisection on the measured speed-up over dense (median of timed forwards).

A method without a knob (or, for ``tokens``, whose knob counts no tokens) runs as given and its
row says ``not matched``.  Nothing here names a method: everything goes through the registry.
:func:`plot_pareto` draws metric vs speed-up with the Pareto front.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import OptionError, UnsupportedModelError
from ..patchers.api import patched, record_stats
from ..patchers.registry import MODEL_KINDS, get_method, validate_options
from .distributed import Ranks
from .recall import summarize_layers
from .report import Column, EvalInterrupted

__all__ = [
    "EVALS", "MATCH_KEYS", "Match", "parse_match", "parse_matches", "eval_kind", "check_settings", "match_settings", "compare_vision",
    "compare_clip", "compare_ruler", "compare_rows", "compare_columns", "pareto_front", "plot_pareto",
]

Settings = Sequence[tuple[str, dict[str, Any]]]
Log = Callable[[str], None]

#: eval name -> (family, model kind of the routed tower, main metric key, its label, fidelity key, its label)
EVALS: dict[str, tuple[str, str, str, str, str, str]] = {
    "fidelity": ("vision", "vision", "cls_cosine", "CLS cos", "cls_cosine", "CLS cos"),
    "knn": ("vision", "vision", "knn_top1", "k-NN top-1", "cls_cosine", "CLS cos"),
    "linear-probe": ("vision", "vision", "linear_probe", "lin. probe", "cls_cosine", "CLS cos"),
    "retrieval": ("vision", "vision", "map_at_r", "mAP@R", "cls_cosine", "CLS cos"),
    "zeroshot": ("clip", "vision", "top1", "top-1", "embed_cosine", "emb cos"),
    "clip-retrieval": ("clip", "vision", "t2i_recall@1", "T→I R@1", "embed_cosine", "emb cos"),
    "ruler": ("ruler", "causal_lm", "acc", "accuracy", "recall_mean", "recall mean"),
}

#: ``--match`` keys and what their value is.
MATCH_KEYS: dict[str, str] = {
    "sparsity": "skipped fraction of query-key pairs, in [0, 1)",
    "flops": "kept fraction of query-key pairs (1 - sparsity), in (0, 1]",
    "tokens": "token count (landmarks / anchors) for methods whose knob counts tokens; vision and CLIP evals only",
    "speedup": "speed-up over dense (> 0), measured on the first batch / sample",
}


@dataclass(frozen=True)
class Match:
    """A budget to match: ``key`` one of :data:`MATCH_KEYS`, ``value`` its target."""

    key: str
    value: float

    def text(self) -> str:
        return f"{self.key}={int(self.value) if self.key == 'tokens' else self.value:g}"


def parse_matches(texts: Sequence[str] | str | None, eval: str | None = None) -> list[Match]:
    """Several ``--match`` budgets, in order (see :func:`match_settings`: each method takes the first one
    its knob can follow); ``None`` -> ``[]``.

    Raises:
        OptionError: as :func:`parse_match`, or one key given twice.
    """
    if texts is None:
        return []
    out = [parse_match(t, eval) for t in ([texts] if isinstance(texts, str) else texts)]
    keys = [m.key for m in out]
    if len(set(keys)) != len(keys):
        raise OptionError(f"--match {' '.join(texts)}: each key at most once (a method takes the first budget its knob can follow)")
    return out


def _as_list(match) -> list[Match]:
    if match is None:
        return []
    return [match] if isinstance(match, Match) else list(match)


def _applies(match: Match, knob) -> bool:
    """Whether a method with ``knob`` can follow ``match`` (``tokens`` needs a knob that counts tokens)."""
    return knob is not None and (match.key != "tokens" or knob.tokens is not None)


def parse_match(text: str | None, eval: str | None = None) -> Match | None:
    """``"sparsity=0.5"`` -> ``Match("sparsity", 0.5)``; ``None`` -> ``None``.

    Raises:
        OptionError: not ``KEY=VALUE``, an unknown key, a value that is not a number or out of its
            range (see :data:`MATCH_KEYS`), or ``tokens`` with ``eval == "ruler"``.
    """
    if text is None:
        return None
    key, sep, raw = text.partition("=")
    key = key.strip()
    allowed = ", ".join(f"{k}=X" for k in MATCH_KEYS)
    if not sep or key not in MATCH_KEYS:
        raise OptionError(f"--match {text!r}: expected one of {allowed} (e.g. --match sparsity=0.5)")
    try:
        value = float(raw)
    except ValueError:
        raise OptionError(f"--match {text!r}: {raw.strip()!r} is not a number") from None
    if not math.isfinite(value):
        raise OptionError(f"--match {text!r}: {raw.strip()!r} is not a finite number")
    ok = {
        "sparsity": 0.0 <= value < 1.0, "flops": 0.0 < value <= 1.0, "speedup": 0.0 < value < float("inf"),
        "tokens": value >= 1 and value == int(value),
    }[key]
    if not ok:
        what = {"sparsity": "in [0, 1)", "flops": "in (0, 1]", "speedup": "a number > 0", "tokens": "a positive integer"}[key]
        raise OptionError(f"--match {text!r}: {key} must be {what}")
    if key == "tokens" and eval is not None and EVALS.get(eval, ("",))[0] == "ruler":
        raise OptionError(f"--match {text!r}: tokens applies to the vision and CLIP evals only; for ruler use sparsity, flops or speedup")
    return Match(key, int(value) if key == "tokens" else value)


def eval_kind(eval: str) -> str:
    """Model kind of the tower an eval patches (``"vision"`` or ``"causal_lm"``).

    Raises:
        OptionError: unknown eval (the message lists them).
    """
    if eval not in EVALS:
        raise OptionError(f"unknown eval {eval!r}; allowed: {', '.join(EVALS)}")
    return EVALS[eval][1]


def check_settings(settings: Settings, eval: str) -> list[tuple[str, dict[str, Any]]]:
    """Validate every setting against the registry and the model kind ``eval`` patches, before any model loads.

    Returns:
        ``[(method, full options)]`` (defaults filled).

    Raises:
        UnknownMethodError, OptionError: a bad method or option; OptionError: unknown eval.
        UnsupportedModelError: a method that does not fit the eval's model kind (the message
            names the method and the kinds it fits).
    """
    kind = eval_kind(eval)
    out = []
    for m, o in settings:
        method = get_method(m)
        full = validate_options(method, dict(o))
        if not method.fits(kind):
            fits = ", ".join(f"{k!r} ({MODEL_KINDS.get(k, k)})" for k in sorted(method.model_kinds))
            raise UnsupportedModelError(
                f"method {m!r} does not fit the {eval} eval: {m!r} fits model kinds {fits}, and {eval} patches a {kind!r} model"
            )
        out.append((m, full))
    return out


# --------------------------------------------------------------------------- measuring and matching


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "s >= N: exact attention" while the knob sweeps
        return fn()


def _sparsity(model, m: str, o: dict[str, Any], forward: Callable[[], Any], towers=None) -> float | None:
    """Measured sparsity of one recorded forward under ``(m, o)``: ``1 - sum kept / sum causal`` pairs, every routed layer and head."""
    def run():
        with torch.no_grad(), patched(model, m, towers=towers, **o), record_stats(model) as rec:
            forward()
        return summarize_layers(rec.forwards[0])["sparsity"] if rec.forwards else None

    return _quiet(run)


def _seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time (seconds) of ``repeats`` calls of ``fn`` after one untimed call."""
    with torch.no_grad():
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _patched_seconds(model, m, o, forward, towers, repeats) -> float:
    def run():
        with patched(model, m, towers=towers, **o):
            return _seconds(forward, repeats)

    return _quiet(run)


def _tokens_of(model, forward, towers) -> int:
    """Tokens per call the routed attention layers see (from one recorded dense-through-the-patch forward)."""
    with torch.no_grad(), patched(model, "dense", towers=towers), record_stats(model) as rec:
        forward()
    layers = rec.forwards[0] if rec.forwards else {}
    return max((lr.queries for lr in layers.values()), default=0)


def _calibrate(model, m, given, knob, tokens, match: Match, measure, steps: int, tol: float) -> dict[str, Any]:
    """Bisection on the knob position ``t``: ``measure(options)`` is a value that falls as ``t`` grows
    (sparsity, speed-up); returns the match info with the closest options found."""
    target = 1.0 - match.value if match.key == "flops" else match.value
    cache: dict[tuple, float | None] = {}
    best = None
    lo, hi = 0.0, 1.0
    n_steps = 0
    for _ in range(steps):
        t = (lo + hi) / 2
        knob_opts = knob.at(t, tokens)
        opts = validate_options(get_method(m), {**given, **knob_opts})
        key = tuple(sorted(knob_opts.items()))
        if key not in cache:
            try:
                cache[key] = measure(opts)
            except OptionError:  # the knob's sparse end refused on this model (e.g. s not above the prefix tokens)
                cache[key] = "refused"
            n_steps += 1
        value = cache[key]
        if value == "refused":
            lo = t  # denser
            continue
        if value is None:
            break
        err = abs(value - target)
        if best is None or err < best[0]:
            best = (err, t, knob_opts, opts, value)
        if err <= tol:
            break
        if value > target:  # too sparse / too fast: denser
            lo = t
        else:
            hi = t
    if best is None:
        return {"status": "not matched", "reason": "the method records no sparsity", "options": validate_options(get_method(m), given)}
    err, t, knob_opts, opts, value = best
    reached = 1.0 - value if match.key == "flops" else value
    return {
        "status": "matched" if err <= tol else "closest", "target": match.value, "reached": reached, "t": t,
        "knob": knob.text, "knob_options": knob_opts, "steps": n_steps, "options": opts,
    }


def match_settings(
    model: torch.nn.Module,
    settings: Settings,
    forward: Callable[[], Any],
    match: Match | Sequence[Match] | None,
    *,
    towers: Any = None,
    steps: int = 10,
    tol: float | None = None,
    repeats: int = 3,
    log: Log | None = None,
) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """Put each setting's knob at the budget ``match`` on one input, and measure every setting's sparsity there.

    Args:
        model: the unpatched model (left unpatched).
        settings: ``[(method, options)]``; options as given by the user (kept; only the knob's options change).
        forward: runs the model once on the calibration input (the first batch, or the first
            sample's prefill), e.g. ``lambda: encode(model, x)``.
        match: the budget, or several: each setting follows the first one its knob can follow
            (``tokens`` only a knob that counts tokens, e.g. ``[tokens=64, speedup=1.4]`` puts landmark
            methods at 64 landmarks and the others at a 1.4x speed-up); ``None`` or ``[]``: settings run as
            given (sparsity still measured).
        towers: the towers each setting routes (``None``: the model's default).
        steps: at most this many bisection steps (measurements) per setting.
        tol: stop when within this of the target: default 0.01 (sparsity, flops), or 2 % of the
            target speed-up.
        repeats: timed forwards per median (``speedup``).
        log: one line per matched setting.

    Returns:
        ``(settings, infos)``: the settings to run (full options) and per setting
        ``{"status": "matched" | "closest" | "not matched" | "as given", "target", "reached",
        "knob", "knob_options", "steps", "t", "options", "sparsity" (measured at the chosen
        options on this input, or ``None``)}``.

    Raises:
        UnknownMethodError, OptionError, UnsupportedModelError: a bad setting, or a knob option
            the method refuses.
    """
    matches = _as_list(match)
    tokens = _tokens_of(model, forward, towers) if matches else 0
    dense_s: list[float] = []  # measured once, when a setting first needs it
    out, infos = [], []
    for m, given in settings:
        method = get_method(m)
        knob = method.knob
        match = next((mt for mt in matches if _applies(mt, knob)), None)
        info: dict[str, Any]
        if not matches:
            info = {"status": "as given", "options": validate_options(method, dict(given))}
        elif match is None:
            reason = "the method has no knob" if knob is None else "its knob counts no tokens"
            info = {"status": "not matched", "reason": reason, "options": validate_options(method, dict(given))}
        elif match.key == "tokens":
            kopts = {knob.tokens: int(match.value)}
            info = {"status": "matched", "target": match.value, "reached": match.value, "knob": knob.text,
                    "knob_options": kopts, "steps": 0, "options": validate_options(method, {**given, **kopts})}
        elif match.key == "speedup":
            if not dense_s:
                dense_s.append(_seconds(forward, repeats))
            info = _calibrate(model, m, given, knob, tokens, match,
                              lambda o, m=m: dense_s[0] / _patched_seconds(model, m, o, forward, towers, repeats), steps,
                              0.02 * match.value if tol is None else tol)
        else:
            info = _calibrate(model, m, given, knob, tokens, match, lambda o, m=m: _sparsity(model, m, o, forward, towers), steps,
                              0.01 if tol is None else tol)
        if match is not None:
            info["key"] = match.key
            overridden = {k: v for k, v in given.items() if k in info.get("knob_options", {}) and info["knob_options"][k] != v}
            if overridden and log is not None:
                log(f"--match {match.text()}: {m}: the given {', '.join(f'{k}={v}' for k, v in overridden.items())} "
                    "is the knob --match turns; it is replaced")
        info["sparsity"] = _sparsity(model, m, info["options"], forward, towers)
        if match is not None and log is not None:
            what = f"{match.key} {info['reached']:.3g}" if "reached" in info else info.get("reason", "")
            chosen = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.get("knob_options", {}).items())
            log(f"--match {match.text()}: {m}{' ' + chosen if chosen else ''} -> {info['status']}: {what}"
                + (f" ({info['steps']} measurements)" if info.get("steps") else ""))
        out.append((m, info["options"]))
        infos.append(info)
    return out, infos


# --------------------------------------------------------------------------- the runs


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
    rows = [{"method": "dense", "baseline": True, "options": {}, "given_options": {}, **dense}]
    for (m, g), info, run in zip(given, infos, runs):
        knob = get_method(m).knob
        tok = info["options"].get(knob.tokens) if knob is not None and knob.tokens else None
        shown = {**g, **info.get("knob_options", {})}
        rows.append({
            "method": m, "options": info["options"], "given_options": dict(g), "shown_options": shown,
            "sparsity": info.get("sparsity"), "knob_tokens": f"{knob.tokens}={tok}" if tok is not None else None,
            **run, "match": {k: v for k, v in info.items() if k != "options"},
        })
    return {
        "eval": eval, "metric": mkey, "metric_label": mlabel, "fidelity": fkey, "fidelity_label": flabel,
        "match": [{"key": mt.key, "value": mt.value} for mt in _as_list(match)] or None, "rows": rows, "result": runner_result,
    }


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
        images: a labelled image set (e.g. :func:`attnpatch.evals.images.load_image_set`).
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
    from .vision import encode, run_feature_eval

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
    from .clip import run_retrieval_eval, run_zeroshot_eval

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
    from .devices import input_device
    from .ruler import run_ruler_settings

    if any(mt.key == "tokens" for mt in _as_list(match)):
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


# --------------------------------------------------------------------------- table and plot


def _fmt_value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def compare_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows of a compare result (dense first): the result's rows with text columns for options and match."""
    out = []
    for r in result["rows"]:
        row = dict(r)
        row["options_text"] = ", ".join(f"{k}={_fmt_value(v)}" for k, v in r.get("shown_options", {}).items())
        if r.get("note"):
            row["options_text"] += f" [{r['note']}]"
        mi = r.get("match")
        if mi is None:
            row["match_text"] = ""
        elif mi["status"] in ("matched", "closest"):
            key = mi.get("key", "")
            row["match_text"] = f"{key} {mi['reached']:.3g}" + (" (closest)" if mi["status"] == "closest" else "")
        elif mi["status"] == "not matched":
            row["match_text"] = "not matched"
        else:
            row["match_text"] = ""
        out.append(row)
    return out


def compare_columns(result: dict[str, Any]) -> list[Column]:
    """The table columns of a compare result (metric and fidelity titled after the eval)."""
    cols = [
        Column("method", "method"), Column("options_text", "options"),
        Column("metric", result.get("metric_label", "metric"), "f3" if result.get("metric") == "cls_cosine" else "pct"),
    ]
    if result.get("fidelity") != result.get("metric"):
        cols.append(Column("fidelity", result.get("fidelity_label", "fidelity"), "f3"))
    cols += [Column("sparsity", "sparsity", "pct"), Column("knob_tokens", "landmarks")]
    if result.get("match"):
        cols.append(Column("match_text", "matched"))
    cols += [Column("seconds", "time", "s"), Column("speedup", "speed-up", "x")]
    return cols


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated in (x, y), both maximised, sorted by x ascending.

    A point is dominated when another is at least as good in both and better in one.
    """
    idx = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i
        )
        if not dominated:
            idx.append(i)
    return sorted(idx, key=lambda i: (points[i][0], -points[i][1]))


def plot_pareto(result: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Draw the eval's metric (y) against the speed-up over dense (x) as a PNG: one labelled point per
    setting, dense marked, and the Pareto front (settings not dominated in (speed-up, metric)) as a step line.

    Rows without a metric or a speed-up are left out.  Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in compare_rows(result) if r.get("metric") is not None and r.get("speedup") is not None]
    pts = [(float(r["speedup"]), float(r["metric"])) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    try:
        front = pareto_front(pts)
        if front:
            fx, fy = [pts[i][0] for i in front], [pts[i][1] for i in front]
            ax.step(fx, fy, where="pre", color="tab:orange", lw=1.5, label="Pareto front", zorder=1)
            ax.plot(fx, fy, "o", ms=13, mfc="none", mec="tab:orange", mew=1.5, zorder=1)  # visible with a single front point too
        for (x, y), r in zip(pts, rows):
            dense = bool(r.get("baseline"))
            ax.scatter([x], [y], marker="*" if dense else "o", s=140 if dense else 40, color="black" if dense else "tab:blue", zorder=2)
            label = r["method"] + (f" ({r['options_text']})" if r.get("options_text") else "")
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=7)
        ax.axvline(1.0, color="grey", lw=0.6, ls="--")
        ax.set_xlabel("speed-up over dense (x)")
        ax.set_ylabel(result.get("metric_label", "metric"))
        m = result.get("match") or []
        matched = ", ".join(f"{x['key']}={x['value']:g}" for x in m)
        ax.set_title(title or f"{result.get('eval', '')}" + (f" — matched {matched}" if matched else ""), fontsize=9)
        ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p)
    finally:
        plt.close(fig)
    return p
