"""Budget matching of :mod:`attnpatch.evals.compare`: the evals a compare runs (:data:`EVALS`), the ``--match``
budgets (:class:`Match`, :func:`parse_match`, :func:`parse_matches`), the settings check against the registry
(:func:`check_settings`), and :func:`match_settings`, which puts each method's knob at a budget (a bisection of the
knob position on measured sparsity or speed-up, or its token count set outright)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import OptionError, UnsupportedModelError
from ...log import Log
from ...patchers.api import patched, record_stats
from ...patchers.registry import MODEL_KINDS, get_method, validate_options
from ..recall import summarize_layers
from ...timing import interleaved_speedup, quietly

__all__ = [
    "Settings", "EVALS", "MATCH_KEYS", "Match", "parse_match", "parse_matches", "as_matches", "eval_kind", "check_settings",
    "match_settings",
]

Settings = Sequence[tuple[str, dict[str, Any]]]

#: eval name -> (family, model kind of the routed tower, main metric key, its label, fidelity key, its label)
EVALS: dict[str, tuple[str, str, str, str, str, str]] = {
    "fidelity": ("vision", "vision", "cls_cosine", "CLS cos", "cls_cosine", "CLS cos"),
    "knn": ("vision", "vision", "knn_top1", "k-NN top-1", "cls_cosine", "CLS cos"),
    "linear-probe": ("vision", "vision", "linear_probe", "lin. probe", "cls_cosine", "CLS cos"),
    "retrieval": ("vision", "vision", "map_at_r", "mAP@R", "cls_cosine", "CLS cos"),
    "zeroshot": ("clip", "vision", "top1", "top-1", "embed_cosine", "emb cos"),
    "clip-retrieval": ("clip", "vision", "t2i_recall@1", "T→I R@1", "embed_cosine", "emb cos"),
    "ruler": ("ruler", "causal_lm", "acc", "accuracy", "recall_mean", "recall mean"),
    "segmentation": ("segmentation", "vision", "miou", "mIoU", "agreement", "agree w/ dense"),
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


def as_matches(match) -> list[Match]:
    """``match`` as a list: ``None`` -> ``[]``, one :class:`Match` -> ``[match]``."""
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
    if EVALS[eval][0] == "segmentation":
        from ..segmentation import check_dense_methods

        check_dense_methods([m for m, _ in settings])
    return out


# --------------------------------------------------------------------------- measuring and matching


def _sparsity(model, m: str, o: dict[str, Any], forward: Callable[[], Any], towers=None) -> float | None:
    """Measured sparsity of one recorded forward under ``(m, o)``: ``1 - sum kept / sum causal`` pairs, every routed layer and head."""
    def run():
        with torch.no_grad(), patched(model, m, towers=towers, **o), record_stats(model) as rec:
            forward()
        return summarize_layers(rec.forwards[0])["sparsity"] if rec.forwards else None

    return quietly(run)


def _paired_speedup(model, m, o, forward, towers, repeats) -> float:
    """Speed-up of ``(m, o)`` over dense on the calibration input, each patched forward timed beside a dense one
    (:func:`~attnpatch.timing.interleaved_speedup`: the median of ``repeats`` pairs), so that a machine whose speed
    changes during a long calibration moves both alike."""
    return quietly(lambda: interleaved_speedup(forward, lambda: patched(model, m, towers=towers, **o), repeats=repeats))["speedup"]


def _tokens_of(model, forward, towers) -> int:
    """Tokens per call the routed attention layers see (from one recorded dense-through-the-patch forward)."""
    with torch.no_grad(), patched(model, "dense", towers=towers), record_stats(model) as rec:
        forward()
    layers = rec.forwards[0] if rec.forwards else {}
    return max((lr.queries for lr in layers.values()), default=0)


def _calibrate(model, m, given, knob, tokens, match: Match, measure, steps: int, tol: float, log: Log | None = None) -> dict[str, Any]:
    """Bisection on the knob position ``t``: ``measure(options)`` is a value that falls as ``t`` grows
    (sparsity, speed-up); returns the match info with the closest options found.  ``log``: one line per
    measurement (a calibration at a large resolution takes minutes)."""
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
            if log is not None:
                got = cache[key]
                shown = "refused" if got == "refused" else "-" if got is None else f"{got:.3g}"
                log(f"--match {match.text()}: {m} {', '.join(f'{k}={v}' for k, v in knob_opts.items())} -> "
                    f"{match.key} {shown} (measurement {n_steps}, at most {steps})")
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
        repeats: pairs of timed forwards (dense beside the setting) per measured speed-up (``speedup``), the median
            of their ratios.
        log: one line per matched setting, and one per speed-up measurement.

    Returns:
        ``(settings, infos)``: the settings to run (full options) and per setting
        ``{"status": "matched" | "closest" | "not matched" | "as given", "target", "reached",
        "knob", "knob_options", "steps", "t", "options", "sparsity" (measured at the chosen
        options on this input, or ``None``)}``.

    Raises:
        UnknownMethodError, OptionError, UnsupportedModelError: a bad setting, or a knob option
            the method refuses.
    """
    matches = as_matches(match)
    tokens = _tokens_of(model, forward, towers) if matches else 0
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
            info = _calibrate(model, m, given, knob, tokens, match,
                              lambda o, m=m: _paired_speedup(model, m, o, forward, towers, repeats), steps,
                              0.02 * match.value if tol is None else tol, log)
        else:
            info = _calibrate(model, m, given, knob, tokens, match, lambda o, m=m: _sparsity(model, m, o, forward, towers), steps,
                              0.01 if tol is None else tol)
        if match is not None:
            info["key"] = match.key
            typed = validate_options(method, dict(given))  # "64" given on the command line is 64
            overridden = {k: typed.get(k, v) for k, v in given.items()
                          if k in info.get("knob_options", {}) and info["knob_options"][k] != typed.get(k, v)}
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
