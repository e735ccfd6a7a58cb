"""The downstream-agreement search of ``attnpatch tune``: the fastest setting of a method, per layer, whose predictions
agree with the unpatched model's on a calibration split, reported on the disjoint held-out split.

The search space is the method's main knob (:class:`~attnpatch.patchers.contract.Knob`: ``r`` for ``tome`` and
``tome+fna``, ``s`` for ``fna``) in *families*: the knob applied from a start layer ``d`` on, the layers before it
exact (a per-layer schedule, ``"0*d/v*(L-d)"``; FNA also samples its landmarks at ``d``).  Accuracy picks the knob
and time picks the family:

1. Within each family, agreement falls as the knob gets cheaper, so a bisection on the knob position finds the
   cheapest value that meets the target.  All families are measured together, one pass over the calibration split
   per bisection round (``measure(settings)`` returns each setting's agreement), so the number of measured settings
   is at most ``families x rounds`` (``max_candidates``).  This choice depends on predictions only, not on time.
2. Each family's winner is timed beside the unpatched model in pairs (:func:`~attnpatch.timing.interleaved_speedup`:
   the median of ``repeats`` pair ratios and their middle half), and the fastest is chosen; the exact model (1.00x)
   is chosen when no winner is faster.  A winner whose speed-up range overlaps the fastest's is not told apart from
   it by this machine: among those, the one with the highest agreement is chosen, so that a busier machine picks
   the same setting, or one knob step away.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import OptionError
from ...patchers.api import patched
from ...patchers.registry import get_method, validate_options
from ...timing import interleaved_speedup, quietly

__all__ = ["Family", "families_of", "search_agreement", "choose", "searchable_methods", "knn_agreement", "tune_knn_agreement",
           "seg_agreement", "tune_seg_agreement", "DEFAULT_DEPTHS", "TARGETS", "parse_target", "agreement_tables",
           "short_setting"]

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
    if start <= 0:
        return out
    for k, v in knob_opts.items():
        if meth.options[k].kind == "int_schedule":
            out[k] = (0,) * start + (int(v),) * (layers - start)
    if "sample_layer" in meth.options and "s" in knob_opts:
        out["sample_layer"] = start  # FNA samples its landmarks on the first approximated layer
    return out


def families_of(method: str, layers: int, tokens: int, given: dict[str, Any] | None = None,
                depths: Sequence[float] = DEFAULT_DEPTHS) -> list[Family]:
    """The families of ``method`` on a model of ``layers`` attention layers and ``tokens`` tokens per image.

    Raises:
        OptionError: a method without a knob, or whose knob turns no per-layer option.
    """
    meth = get_method(method)
    if meth.knob is None:
        raise OptionError(f"method {method!r} has no knob for the agreement search; it searches: "
                          f"{', '.join(searchable_methods())}")
    keys = set(meth.knob.at(0.0, tokens))
    if not any(meth.options[k].kind == "int_schedule" for k in keys):
        raise OptionError(f"method {method!r}: its knob ({', '.join(sorted(keys))}) has no per-layer schedule; the agreement "
                          f"search runs on: {', '.join(searchable_methods())}")
    base = dict(given or {})
    if "min_tokens" in meth.options:
        base.setdefault("min_tokens", 0)  # approximate at the calibration size; the exact model is measured beside
    starts = sorted({min(layers - 1, int(round(f * layers))) for f in depths})
    out = []
    for d in starts:
        def shown(t: float, d=d) -> dict[str, Any]:
            return {**base, **_from_layer(method, meth.knob.at(t, tokens), d, layers)}

        def options(t: float, shown=shown) -> dict[str, Any]:
            return validate_options(meth, shown(t))

        out.append(Family(f"{meth.knob.text.split(',')[0]} from layer {d}", d, options, shown))
    return out


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


def _key(opts: dict[str, Any]) -> tuple:
    return tuple(sorted((k, v) for k, v in opts.items()))


def search_agreement(
    model,
    method: str,
    measure: Callable[[list[tuple[str, dict[str, Any]]]], list[float]],
    forward: Callable[[], Any],
    *,
    target: float,
    families: Sequence[Family],
    max_candidates: int = 24,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The fastest setting of ``method`` whose agreement on the calibration split meets ``target``.

    Args:
        model: the unpatched model (left unpatched).
        method: the method searched.
        measure: ``measure([(method, options), ...]) -> [agreement, ...]`` on the calibration split, one pass for all
            (e.g. k-NN top-1 agreement with dense over the split's images), each a fraction in ``[0, 1]``.
        forward: one forward on a fixed calibration batch, for the paired timing.
        target: required agreement, in ``[0, 1]``.
        families: :func:`families_of`.
        max_candidates: settings measured for agreement at most (the bisection rounds are
            ``max_candidates // len(families)``, at least 1).
        repeats: timed pairs (dense beside the setting) per family winner.
        progress: one line per round and per timing.

    Returns:
        ``{"target", "rounds", "measured": [{"family", "start", "t", "options" (full), "shown" (what the family
        sets), "agreement", "meets"}], "winners": [{... as measured, "speedup", "spread"}],
        "chosen": a winner, or ``{"exact": True, "speedup": 1.0, "agreement": 1.0}`` when none is faster}``.

    Raises:
        OptionError: a target outside ``[0, 1]``, ``max_candidates < 1`` or no families.
    """
    if not 0.0 <= float(target) <= 1.0:
        raise OptionError(f"target={target!r}: an agreement in [0, 1]")
    if max_candidates < 1 or not families:
        raise OptionError(f"max_candidates={max_candidates}, {len(families)} families: need at least one of each")
    say = progress or (lambda s: None)
    rounds = max(1, max_candidates // len(families))
    lo = [0.0] * len(families)
    hi = [1.0] * len(families)  # t = 1: the exact end, which meets any target
    best: list[dict[str, Any] | None] = [None] * len(families)
    cache: dict[tuple, float] = {}
    measured: list[dict[str, Any]] = []
    for rnd in range(rounds):
        todo: list[tuple[int, float, dict[str, Any]]] = []
        for i, fam in enumerate(families):
            t = (lo[i] + hi[i]) / 2
            try:
                todo.append((i, t, fam.options(t)))
            except OptionError:  # the knob's cheap end refused on this model: move up
                lo[i] = t
        shown = {i: families[i].shown(t) for i, t, _ in todo}
        new = {(_key(o)): o for _, _, o in todo if _key(o) not in cache}
        if new:
            got = measure([(method, o) for o in new.values()])
            cache.update(zip(new, got))
        for i, t, o in todo:
            agree = cache[_key(o)]
            meets = agree >= target
            row = {"family": families[i].name, "start": families[i].start, "t": t, "options": o, "shown": shown[i],
                   "agreement": agree, "meets": meets}
            measured.append(row)
            if meets:
                hi[i] = t
                if best[i] is None or t <= best[i]["t"]:
                    best[i] = {k: v for k, v in row.items() if k != "meets"}
            else:
                lo[i] = t
        say(f"round {rnd + 1}/{rounds}: " + "; ".join(
            f"{families[i].name}: {_short(shown[i])} agreement {cache[_key(o)]:.4f}" for i, _, o in todo))
    winners = []
    for w in best:
        if w is None:
            continue
        timing = quietly(lambda: interleaved_speedup(forward, lambda: patched(model, method, **w["options"]), repeats=repeats))
        w = {**w, "speedup": timing["speedup"], "spread": timing["spread"]}
        say(f"{w['family']}: {_short(w['shown'])} {w['speedup']:.2f}x [{w['spread'][0]:.2f}-{w['spread'][1]:.2f}]")
        winners.append(w)
    return {"target": target, "rounds": rounds, "measured": measured, "winners": winners, "chosen": choose(winners)}


def choose(winners: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest winner by median speed-up; among the winners whose speed-up range overlaps its range, the one with
    the highest agreement (this machine does not tell them apart); the exact model when no winner's range lies
    above 1.00x."""
    exact = {"exact": True, "speedup": 1.0, "spread": [1.0, 1.0], "agreement": 1.0}
    fast = [w for w in winners if w["spread"][0] > 1.0]
    if not fast:
        return exact
    top = max(fast, key=lambda w: w["speedup"])
    tied = [w for w in fast if w["spread"][1] >= top["spread"][0]]
    return max(tied, key=lambda w: (w["agreement"], w["speedup"]))


def short_setting(opts: dict[str, Any]) -> str:
    """Options in one line, a schedule as ``0/0/8/8``."""
    return ", ".join(f"{k}={'/'.join(map(str, v)) if isinstance(v, (tuple, list)) else v}" for k, v in opts.items())


_short = short_setting

#: ``attnpatch tune --target`` keys: what the agreement search measures (vision encoders).
TARGETS = {"knn-agreement": "k-NN top-1 agreement with the unpatched model, in [0, 1]",
           "seg-agreement": "segmentation prediction agreement with the unpatched model (linear read-out), in [0, 1]"}


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
             "chosen": "<-" if w is result["chosen"] else ""} for w in result["winners"]]
    return rows, wins


def knn_agreement(model, images, preprocess, *, batch_size: int = 8, knn_k: int = 20) -> Callable:
    """``measure(settings) -> [k-NN top-1 agreement with dense, ...]`` over the labelled image set ``images``: one
    interleaved pass (:func:`attnpatch.evals.vision.run_feature_eval`, dense and every setting), each image's k-NN
    prediction among the others (``knn_k`` neighbours) compared with dense's."""
    from ..vision.runner import run_feature_eval

    def measure(settings: list[tuple[str, dict[str, Any]]]) -> list[float]:
        res = quietly(lambda: run_feature_eval(model, images, preprocess, settings=settings, tasks=("fidelity", "knn"),
                                               batch_size=batch_size, layer_error_images=0, knn_k=knn_k))
        return [float(r["knn_agreement"]) for r in res["runs"]]

    return measure


def tune_knn_agreement(model, calibration, held_out, preprocess, method: str, *, target: float = 0.99,
                       given: dict[str, Any] | None = None, batch_size: int = 8, knn_k: int = 20,
                       max_candidates: int = 24, repeats: int = 5, depths: Sequence[float] = DEFAULT_DEPTHS,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """:func:`search_agreement` on k-NN top-1 agreement with dense over the ``calibration`` images, then the chosen
    setting measured on the disjoint ``held_out`` images (its agreement and speed-up there).

    Args:
        model: an unpatched ViT encoder; calibration, held_out: labelled image sets (``len``, ``[i]``, ``labels``).
        preprocess: list of PIL images -> ``[B, 3, R, R]`` at the resolution tuned for.
        method: a method of :func:`searchable_methods`; given: options every candidate keeps (e.g. ``s`` of ``tome+fna``).
        target: k-NN top-1 agreement with dense to reach on the calibration split, in ``[0, 1]``.
        batch_size, knn_k: as ``attnpatch eval knn``; max_candidates, repeats, depths: the search's bounds.

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
                           repeats=repeats, progress=progress)
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
    """``measure(settings) -> [segmentation prediction agreement with dense, ...]`` over ``data``'s val split: one
    interleaved pass (:func:`attnpatch.evals.segmentation.run_segmentation` with the read-outs ``fitted`` once on the
    unpatched model's train features), the share of non-void pixels where a setting predicts what dense predicts."""
    from ..segmentation import run_segmentation

    def measure(settings: list[tuple[str, dict[str, Any]]]) -> list[float]:
        res = quietly(lambda: run_segmentation(model, data, preprocess, settings=settings, readouts=(readout,),
                                               fitted=fitted, batch_size=batch_size, resamples=0, examples=0))
        return [float(r[readout]["agreement"]) for r in res["runs"]]

    return measure


def tune_seg_agreement(model, data, preprocess, method: str, *, target: float = 0.99, given: dict[str, Any] | None = None,
                       calibration: int | None = None, split_seed: int = 0, batch_size: int = 8,
                       max_patches: int = 100_000, probe_steps: int = 2000, max_candidates: int = 24, repeats: int = 5,
                       depths: Sequence[float] = DEFAULT_DEPTHS, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """:func:`search_agreement` on segmentation prediction agreement (linear read-out, fitted once on the unpatched
    model's train features) over a seeded calibration share of ``data``'s val split; the chosen setting then measured
    on the rest of val (agreement, mIoU and its difference from dense, speed-up).

    Args:
        data: a :class:`~attnpatch.evals.segmentation.SegmentationSet`; calibration: val images searched on (default
            half, in the order ``split_seed`` draws); the others are held out.
        max_patches, probe_steps: the linear probe's sample and steps (``eval segmentation``'s).

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
    fitted = fit_readouts(model, data, preprocess, readouts=("linear",), max_patches=max_patches, batch_size=batch_size,
                          probe_steps=probe_steps)
    x = preprocess([cal.val.image(i) for i in range(min(batch_size, n_cal))])
    from ..vision.runner import token_count

    tokens = token_count(model, int(x.shape[-1]))
    from ...patchers.adapters import adapter_for

    adapter = adapter_for(model)
    fams = families_of(method, model_geometry(model).num_layers, tokens, given, depths)
    res = search_agreement(model, method, seg_agreement(model, cal, preprocess, fitted, batch_size=batch_size),
                           lambda: adapter.patch_tokens(model, x), target=target, families=fams,
                           max_candidates=max_candidates, repeats=repeats, progress=progress)
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
