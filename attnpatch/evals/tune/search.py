"""The downstream-agreement search of ``attnpatch tune``: the fastest setting of a method, per layer, whose predictions
agree with the unpatched model's on a calibration split, reported on the disjoint held-out split.

The search space is the method's main knob (:class:`~attnpatch.patchers.contract.Knob`: ``r`` for ``tome`` and
``tome+fna``, ``s`` for ``fna``) in *families*: the knob applied from a start layer ``d`` on, the layers before it
exact (a per-layer schedule, ``"0*d/v*(L-d)"``; FNA also samples its landmarks at ``d``).  Accuracy picks the knob
and time picks the family:

1. Within each family, agreement falls as the knob gets cheaper, so a bisection on the knob position finds the
   cheapest value that meets the target.  Each round measures every family's next setting (``measure(settings)``
   returns each setting's agreement; dense's predictions are made once, by ``measure([])``), so the number of
   measured settings is at most ``families x rounds`` (``max_candidates``).  This choice depends on predictions only,
   not on time.
2. Each family's winner is timed beside the unpatched model in pairs (:func:`~attnpatch.timing.interleaved_speedup`:
   the median of ``repeats`` pair ratios and their middle half, and the ratio of the best times), and the fastest by
   best times is chosen (:func:`choose`); the exact model (1.00x) is chosen when no winner is faster.  A winner whose
   speed-up range overlaps the fastest's is not told apart from it by this machine: among those, the one with the
   fewest FLOPs per forward (:func:`forward_flops`, a count no other job changes) is chosen.  The knob of every
   family is the same on a busy machine, and the family is chosen on timings only where they are clear
   (docs/cli.md, ``tune --target``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import OptionError
from ...patchers.api import patched
from ...patchers.registry import get_method, validate_options
from ...timing import interleaved_speedup, quietly

__all__ = ["Family", "families_of", "check_given", "search_agreement", "choose", "forward_flops", "searchable_methods",
           "PastDeadline", "check_deadline", "DEFAULT_DEPTHS", "TARGETS",
           "parse_target", "agreement_tables", "agreement_line", "short_setting"]

#: Start layers of the families, as fractions of the depth: the knob on every layer, from a quarter, from half.
DEFAULT_DEPTHS = (0.0, 0.25, 0.5)


@dataclass(frozen=True)
class Family:
    """One shape of setting: the knob's options from layer ``start`` on, the earlier layers exact.

    Attributes:
        name: e.g. ``"r from layer 3"``.
        start: first approximated layer.
        options: ``options(t) -> full option dict`` at knob position ``t`` (0 cheapest, 1 exact).
        shown: ``shown(t) -> the options this family sets`` (the knob's, the schedule's, the ones given).
    """

    name: str
    start: int
    options: Callable[[float], dict[str, Any]]
    shown: Callable[[float], dict[str, Any]]


def _from_layer(method: str, knob_opts: dict[str, Any], start: int, layers: int) -> dict[str, Any]:
    """``knob_opts`` with each per-layer option (kind ``int_schedule``) zero before ``start``."""
    meth = get_method(method)
    out = dict(knob_opts)
    if "sample_layer" in meth.options and "s" in knob_opts:
        out["sample_layer"] = max(0, start)  # FNA samples its landmarks on the first approximated layer (0 included)
    if start <= 0:
        return out
    for k, v in knob_opts.items():
        if meth.options[k].kind == "int_schedule":
            out[k] = (0,) * start + (int(v),) * (layers - start)
    return out


def families_of(method: str, layers: int, tokens: int, given: dict[str, Any] | None = None,
                depths: Sequence[float] = DEFAULT_DEPTHS, per_layer: bool = True) -> list[Family]:
    """The families of ``method`` on a model of ``layers`` attention layers and ``tokens`` tokens per input.

    ``per_layer=False`` (the causal methods, whose knobs are one value for every layer): one family, the knob on
    every layer.

    Raises:
        OptionError: a method without a knob, or (``per_layer``) whose knob turns no per-layer option; ``given``
            naming an option the search sets (the knob's; ``sample_layer`` with per-layer families).
    """
    meth = get_method(method)
    if meth.knob is None:
        raise OptionError(f"method {method!r} has no knob for the agreement search; it searches: "
                          f"{', '.join(searchable_methods())}")
    keys = set(meth.knob.at(0.0, tokens))
    if not per_layer:
        depths = (0.0,)
    elif not any(meth.options[k].kind == "int_schedule" for k in keys):
        raise OptionError(f"method {method!r}: its knob ({', '.join(sorted(keys))}) has no per-layer schedule; the agreement "
                          f"search runs on: {', '.join(searchable_methods())}")
    given = dict(given or {})
    typed = check_given(method, given, tokens, per_layer)
    base = {k: typed.get(k, v) for k, v in given.items()}
    for floor in ("min_tokens", "min_len"):
        if floor in meth.options:
            base.setdefault(floor, 0)  # approximate at the calibration size; the exact model is measured beside
    starts = sorted({min(layers - 1, int(round(f * layers))) for f in depths})
    out = []
    for d in starts:
        def shown(t: float, d=d) -> dict[str, Any]:
            return {**base, **_from_layer(method, meth.knob.at(t, tokens), d, layers)}

        def options(t: float, shown=shown) -> dict[str, Any]:
            return validate_options(meth, shown(t))

        out.append(Family(f"{meth.knob.text.split(',')[0]} from layer {d}", d, options, shown))
    return out


def check_given(method: str, given: dict[str, Any], tokens: int = 1025, per_layer: bool = True) -> dict[str, Any]:
    """The options every candidate keeps, validated (a command line checks them before anything loads); returns them
    with the method's defaults filled.

    Raises:
        OptionError: a bad option, or one the search sets itself (the knob's; ``sample_layer`` with per-layer families).
    """
    meth = get_method(method)
    typed = validate_options(meth, dict(given))
    keys = set(meth.knob.at(0.0, tokens)) if meth.knob is not None else set()
    searched = keys | ({"sample_layer"} if per_layer and "sample_layer" in meth.options else set())
    clash = sorted(set(given) & searched)
    if clash:
        raise OptionError(f"{', '.join(f'{k}={given[k]}' for k in clash)}: the search sets {', '.join(sorted(searched))} "
                          "itself (per family); give only the options every candidate keeps")
    return typed


def searchable_methods() -> list[str]:
    """Methods whose knob turns a per-layer option (the agreement search's families)."""
    from ...patchers.registry import METHODS

    out = []
    for name, m in METHODS.items():
        if m.knob is None or not m.fits("vision"):
            continue
        keys = set(m.knob.at(0.0, 64))
        if any(m.options[k].kind == "int_schedule" for k in keys if k in m.options):
            out.append(name)
    return sorted(out)


def _took(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


class PastDeadline(Exception):
    """Raised by a search's ``measure`` when the search's time bound passed while it ran (:func:`check_deadline`)."""


def check_deadline(deadline: float | None) -> None:
    """For a ``measure`` between its batches: raise :class:`PastDeadline` once ``time.perf_counter()`` is past
    ``deadline`` (``None``: no bound)."""
    if deadline is not None and time.perf_counter() > deadline:
        raise PastDeadline


def _key(opts: dict[str, Any]) -> tuple:
    return tuple(sorted((k, v) for k, v in opts.items()))


def search_agreement(
    model,
    method: str,
    measure: Callable[..., list[float]],
    forward: Callable[[], Any],
    *,
    target: float,
    families: Sequence[Family],
    max_candidates: int = 24,
    repeats: int = 5,
    max_minutes: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The fastest setting of ``method`` whose agreement on the calibration split meets ``target``.

    Args:
        model: the unpatched model (left unpatched).
        method: the method searched.
        measure: ``measure([(method, options), ...], deadline=None) -> [agreement, ...]`` on the calibration split
            (e.g. k-NN top-1 agreement with dense over the split's images), each a fraction in ``[0, 1]``; dense's
            predictions made at the first call (``measure([])``, timed apart) and kept; between its batches it calls
            :func:`check_deadline` with ``deadline`` (a ``time.perf_counter()`` value, or ``None``).
        forward: one forward on a fixed calibration batch, for the paired timing.
        target: required agreement, in ``[0, 1]``.
        families: :func:`families_of`.
        max_candidates: settings measured for agreement at most (the bisection rounds are
            ``max_candidates // len(families)``, at least 1).
        repeats: timed pairs (dense beside the setting) per family winner.
        max_minutes: wall-clock bound of the bisection rounds, from the start of the search: the dense pass and the
            first round always run; after them no setting starts whose measurement would end past the bound (judged
            by the longest measurement so far), and one still running when the bound passes is dropped (``measure``
            stops at its next batch).  Each family keeps its best so far.  The timing of the winners follows
            (``repeats`` pairs each).  ``None``: no bound.
        progress: one line per round and per timing.

    Returns:
        ``{"target", "rounds", "measured": [{"family", "start", "t", "options" (full), "shown" (what the family
        sets), "agreement", "meets"}], "winners": [{... as measured, "speedup", "spread", "best" (the best-time
        ratio), "flops" (:func:`forward_flops` on the timed batch, ``None`` uncounted), "flop_ratio" (dense's over the
        setting's)}],
        "chosen": a winner, or ``{"exact": True, "speedup": 1.0, "agreement": 1.0}`` when none is faster,
        "stopped": ``None``, or where and why the rounds stopped before ``rounds`` (``max_minutes``)}``.

    Raises:
        OptionError: a target outside ``[0, 1]``, ``max_candidates < 1``, no families or ``max_minutes <= 0``.
    """
    if not 0.0 <= float(target) <= 1.0:
        raise OptionError(f"target={target!r}: an agreement in [0, 1]")
    if max_candidates < 1 or not families:
        raise OptionError(f"max_candidates={max_candidates}, {len(families)} families: need at least one of each")
    if max_minutes is not None and not max_minutes > 0:
        raise OptionError(f"max_minutes={max_minutes!r}: a positive number of minutes")
    say = progress or (lambda s: None)
    rounds = max(1, max_candidates // len(families))
    lo = [0.0] * len(families)
    hi = [1.0] * len(families)  # t = 1: the exact end, which meets any target
    best: list[dict[str, Any] | None] = [None] * len(families)
    cache: dict[tuple, float] = {}
    measured: list[dict[str, Any]] = []
    t0, stopped = time.perf_counter(), None
    deadline = None if max_minutes is None else t0 + 60 * max_minutes
    measure([])  # dense's predictions, kept by the measure
    say(f"dense pass over the calibration split: {_took(time.perf_counter() - t0)}")
    longest = 0.0  # the longest measurement of one setting so far
    for rnd in range(rounds):
        todo: list[tuple[int, float, dict[str, Any]]] = []
        for i, fam in enumerate(families):
            t = (lo[i] + hi[i]) / 2
            try:
                todo.append((i, t, fam.options(t)))
            except OptionError:  # the knob's cheap end refused on this model: move up
                lo[i] = t
        done = []
        for i, t, o in todo:
            shown = families[i].shown(t)
            if _key(o) not in cache:
                now = time.perf_counter()
                where = f"in round {rnd + 1} of {rounds}, {families[i].name} {short_setting(shown)}"
                if rnd and deadline is not None and now + longest > deadline:
                    stopped = (f"{where} not started: {_took(now - t0)} used, a setting takes up to {_took(longest)}, "
                               f"the bound is {_took(60 * max_minutes)}")
                    break
                try:
                    cache[_key(o)] = measure([(method, o)], deadline=deadline if rnd else None)[0]
                except PastDeadline:
                    stopped = f"{where} dropped: the bound of {_took(60 * max_minutes)} passed while it was measured"
                    break
                longest = max(longest, time.perf_counter() - now)
            agree = cache[_key(o)]
            meets = agree >= target
            row = {"family": families[i].name, "start": families[i].start, "t": t, "options": o, "shown": shown,
                   "agreement": agree, "meets": meets}
            measured.append(row)
            done.append(row)
            if meets:
                hi[i] = t
                if best[i] is None or t <= best[i]["t"]:
                    best[i] = {k: v for k, v in row.items() if k != "meets"}
            else:
                lo[i] = t
        if done:
            say(f"round {rnd + 1}/{rounds}: " + "; ".join(
                f"{r['family']}: {short_setting(r['shown'])} agreement {r['agreement']:.4f}" for r in done))
        if stopped:
            say(f"search stopped {stopped}")
            break
    winners = []
    dense_flops = forward_flops(forward)
    uncounted = []
    for w in best:
        if w is None:
            continue
        timing = quietly(lambda: interleaved_speedup(forward, lambda: patched(model, method, **w["options"]), repeats=repeats))
        with patched(model, method, **w["options"]):
            flops = quietly(lambda: forward_flops(forward))
        w = {**w, "speedup": timing["speedup"], "spread": timing["spread"], "best": timing["best"], "flops": flops,
             "flop_ratio": dense_flops / flops if flops and dense_flops else None}
        if flops is None:
            uncounted.append(w["family"])
        fl = f", dense / setting FLOPs {w['flop_ratio']:.2f}" if w["flop_ratio"] else ""
        say(f"{w['family']}: {short_setting(w['shown'])} {w['speedup']:.2f}x [{w['spread'][0]:.2f}-{w['spread'][1]:.2f}]{fl}")
        winners.append(w)
    if uncounted:
        say(f"FLOPs not counted for {', '.join(uncounted)} (FlopCounterMode could not run the forward): winners the "
            "timings do not tell apart go by agreement")
    return {"target": target, "rounds": rounds, "measured": measured, "winners": winners, "chosen": choose(winners),
            "stopped": stopped}


def choose(winners: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest winner; the exact model when none is faster than it.

    Faster is judged on the best times (the fastest dense call over the fastest patched call, ``"best"``): another
    job on the machine slows some calls, rarely the fastest, so this ratio moves least under load (the median of the
    pairs and its middle half are reported).  A winner is faster than the exact model when its best ratio exceeds 1.
    Among the winners whose speed-up range overlaps the fastest's, the machine does not tell them apart; of those the
    one with the fewest FLOPs per forward (``"flops"``, :func:`forward_flops`, a count no other job changes) is chosen,
    then the highest agreement; where a tied winner has no count, the highest agreement.  So a busy machine, whose
    ranges widen, falls back on a count an idle run also sees rather than on its noisy times."""
    exact = {"exact": True, "speedup": 1.0, "spread": [1.0, 1.0], "best": 1.0, "agreement": 1.0}
    fast = [w for w in winners if w.get("best", w["speedup"]) > 1.0]
    if not fast:
        return exact
    top = max(fast, key=lambda w: w.get("best", w["speedup"]))
    tied = [w for w in fast if w["spread"][1] >= top["spread"][0]]
    if all(w.get("flops") is not None for w in tied):
        return min(tied, key=lambda w: (w["flops"], -w["agreement"], -w.get("best", w["speedup"])))
    return max(tied, key=lambda w: (w["agreement"], w.get("best", w["speedup"])))


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def forward_flops(forward: Callable[[], Any]) -> int | None:
    """FLOPs of one ``forward()`` (no gradients), as :class:`torch.utils.flop_counter.FlopCounterMode` counts them:
    matrix products and convolutions, and PyTorch's fused attention (its CPU kernel counted here as its CUDA ones
    are: two products of the query, key and value shapes).  Element-wise work, softmax, sorting, gathers and the
    work of the project's compiled kernels (C++, Triton) are not counted.  ``None`` where the counter cannot run the
    forward (e.g. a compiled kernel it cannot trace)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    extra = {}
    cpu_sdpa = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_sdpa is not None:
        extra[cpu_sdpa] = _cpu_sdpa_flops
    try:
        with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=extra) as counter:
            forward()
    except Exception:  # noqa: BLE001 - the count only breaks ties; the search says it went without it
        return None
    return int(counter.get_total_flops())


def short_setting(opts: dict[str, Any]) -> str:
    """Options in one line, a schedule as ``0/0/8/8``."""
    return ", ".join(f"{k}={'/'.join(map(str, v)) if isinstance(v, (tuple, list)) else v}" for k, v in opts.items())



#: ``attnpatch tune --target`` keys: what the agreement search measures (:mod:`.targets`).
TARGETS = {"knn-agreement": "k-NN top-1 agreement with the unpatched model, in [0, 1] (ViT)",
           "seg-agreement": "segmentation prediction agreement with the unpatched model (linear read-out), in [0, 1] (ViT)",
           "ruler-agreement": "share of RULER calibration samples scored as the unpatched model scores them (causal LM)"}


def parse_target(text: str) -> tuple[str, float]:
    """``"knn-agreement=0.99"`` -> ``("knn-agreement", 0.99)``.

    Raises:
        OptionError: an unknown key, a value that is not a number in ``[0, 1]``.
    """
    key, sep, raw = text.partition("=")
    allowed = ", ".join(f"{k}=X" for k in TARGETS)
    if not sep or key.strip() not in TARGETS:
        raise OptionError(f"--target {text!r}: expected one of {allowed} (e.g. --target knn-agreement=0.99)")
    try:
        value = float(raw)
    except ValueError:
        raise OptionError(f"--target {text!r}: {raw.strip()!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise OptionError(f"--target {text!r}: an agreement in [0, 1]")
    return key.strip(), value


def agreement_tables(result: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The table rows of an agreement search: every measured setting, and each family's winner with its speed-up."""
    rows = [{"family": r["family"], "setting": short_setting(r["shown"]), "agreement": f"{r['agreement']:.4f}",
             "meets": "yes" if r["meets"] else "no"} for r in result["measured"]]
    wins = [{"family": w["family"], "setting": short_setting(w["shown"]), "agreement": f"{w['agreement']:.4f}",
             "speed-up [middle half]": f"{w['speedup']:.2f}x [{w['spread'][0]:.2f}-{w['spread'][1]:.2f}]",
             "dense / setting FLOPs": f"{w['flop_ratio']:.2f}" if w.get("flop_ratio") else "-",
             "chosen": "<-" if w is result["chosen"] else ""} for w in result["winners"]]
    return rows, wins


def agreement_line(result: dict[str, Any], key: str) -> str:
    """One line on the chosen setting: its speed-up and agreement on the calibration split, and what the held-out
    split measured (``key``: the ``--target`` key, which says what was measured there)."""
    chosen, h = result["chosen"], result["held_out_result"]
    if chosen.get("exact"):
        if not result["winners"]:
            return "chosen: exact (unpatched): no setting met the target"
        return "chosen: exact (unpatched): no setting met the target faster than the unpatched model on this machine"
    unit = "samples" if key == "ruler-agreement" else "images"
    line = (f"chosen: {short_setting(chosen['shown'])} ({chosen['speedup']:.2f}x, agreement {chosen['agreement']:.4f} on "
            f"the calibration split); held-out ({result['held_out']} {unit}): ")
    if h is None:
        return line + "not run (--holdout 0)"
    pct = (lambda v: "-" if v is None else f"{100 * v:.1f}%")  # noqa: E731
    if key == "ruler-agreement":
        return line + (f"scores as dense's {pct(h['agreement'])}, accuracy dense {pct(h['dense_acc'])} tuned "
                       f"{pct(h['tuned_acc'])}, prefill "
                       + ", ".join("-" if x is None else f"{x:.2f}x" for x in h["prefill_speedup"]))
    if key == "seg-agreement":
        d = h["miou_delta"]["delta"]
        line += (f"agreement {pct(h['agreement'])}, mIoU dense {pct(h['dense_miou'])} tuned {pct(h['miou'])} "
                 f"({'-' if d is None else f'{100 * d:+.2f}'} points)")
    else:
        line += (f"k-NN agreement {pct(h['knn_agreement'])}, top-1 dense {pct(h['dense_knn_top1'])} tuned "
                 f"{pct(h['knn_top1'])}")
    return line + ("" if h.get("speedup") is None else f", speed {h['speedup']:.2f}x")
