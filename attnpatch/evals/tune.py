"""Budget tuner (``attnpatch tune``): the cheapest setting of a method that meets an accuracy target on
calibration data, by measured time.

The candidates are the method's own (:attr:`~attnpatch.patchers.registry.Method.tune_space`, e.g.
AnchorAttention's thresholds, FNA's landmark counts, sampling depths and local windows) plus the exact
model itself, which always meets the target: when no approximate setting is faster, the tuner says so and
chooses the exact setting.  Each candidate is measured on the same calibration inputs in one run:

* causal LMs: attention recall (the exact softmax mass the kept keys carry, :mod:`.recall`) of every
  (prompt, layer, query head); the target is ``recall_mean >= x`` and ``recall_worst >= y``, the mean of
  the worst ``worst_fraction`` of those entries.  A method with a ``dense_heads`` option gets per-head
  decisions on top: the heads with the lowest recall attend densely, fewest first, until the target is met,
  and the recall is measured again with them (the heads change what later layers see);
* vision encoders: the final CLS token's cosine similarity to the unpatched model's, per image; the target
  is its mean.

Time: the median of ``repeats`` forwards over the calibration inputs after one untimed one; the unpatched
model is timed at the start and at the end of the run (its mean is the reference).  The chosen setting is
written by :func:`~attnpatch.patchers.registry.write_config` (the model's geometry recorded, so loading it
on another model is refused) for ``patch(model, method, config=PATH)`` / ``-o config=PATH``.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch

from ..errors import OptionError
from ..patchers.api import model_geometry, patched
from ..patchers.registry import Method, get_method, validate_options
from .compare import _quiet  # warnings off (e.g. "s >= N: exact attention" on a small calibration input)
from .compare import _seconds as _median_seconds  # median of repeats after one untimed call
from .recall import attention_recall

__all__ = ["tune_causal", "tune_vision", "recall_scores"]

Progress = Callable[[str], None]


def recall_scores(recall: torch.Tensor, worst_fraction: float = 0.05) -> tuple[float, float]:
    """``(mean, worst)`` of a recall tensor (any shape, e.g. ``[prompts, layers, heads]``): the mean of all
    entries and the mean of the lowest ``worst_fraction`` of them (at least one).

    Raises:
        ValueError: ``worst_fraction`` outside ``(0, 1]``, or an empty tensor.
    """
    if not 0.0 < worst_fraction <= 1.0:
        raise ValueError(f"worst_fraction={worst_fraction!r}: must be in (0, 1]")
    flat = recall.flatten().double()
    if flat.numel() == 0:
        raise ValueError("recall_scores of an empty tensor")
    n = max(1, int(round(worst_fraction * flat.numel())))
    return float(flat.mean()), float(torch.topk(flat, n, largest=False).values.mean())


def _heads_to_add(rec: torch.Tensor, dense: set[tuple[int, int]], layers: list[int], target_mean: float,
                  target_worst: float, worst_fraction: float) -> list[tuple[int, int]]:
    """Fewest heads, lowest mean recall first, whose recall set to 1 meets the target on ``rec`` ``[P, L, H]``."""
    r = rec.clone().double()
    heads = r.shape[2]
    for li, layer in enumerate(layers):  # heads already dense carry all their mass (as measured)
        for h in range(heads):
            if (layer, h) in dense:
                r[:, li, h] = 1.0
    order = torch.argsort(r.mean(0).flatten()).tolist()  # lowest mean recall over the prompts first
    added: list[tuple[int, int]] = []
    for flat in order:
        li, h = divmod(flat, heads)
        pair = (layers[li], h)
        if pair in dense:
            continue
        m, w = recall_scores(r, worst_fraction)
        if m >= target_mean and w >= target_worst:
            break
        r[:, li, h] = 1.0
        added.append(pair)
    return added


def _candidates(meth: Method, geometry, candidates: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if candidates is None:
        if meth.tune_space is None:
            raise OptionError(f"method {meth.name!r} has no tuning space; attnpatch tune searches: "
                              f"{', '.join(_tunable())}")
        candidates = meth.tune_space(geometry)
    out = []
    for c in candidates:
        full = validate_options(meth, dict(c))  # a bad candidate fails before any measurement
        out.append({k: v for k, v in full.items() if k in c or k == "dense_heads"})
    return out


def _tunable() -> list[str]:
    from ..patchers.registry import METHODS

    return sorted(n for n, m in METHODS.items() if m.tune_space is not None)


def _exact_row(meth: Method, tokens: int) -> dict[str, Any]:
    """The exact setting's row: options exact on inputs of every length where the method has such a setting,
    else the ones exact at ``tokens`` (``exact_at_tokens`` records the length they hold for)."""
    every = meth.exact_everywhere()
    if every is not None:
        return {"options": every, "exact": True}
    lim = meth.exact_limit(tokens)
    if lim is None:
        raise OptionError(f"method {meth.name!r} has no exact setting, which the tuner measures as its baseline")
    return {"options": lim, "exact": True, "exact_at_tokens": tokens}


def tune_causal(
    model: torch.nn.Module,
    prompts: Sequence[torch.Tensor],
    method: str = "anchor_attention",
    *,
    target_mean: float = 0.95,
    target_worst: float = 0.8,
    worst_fraction: float = 0.05,
    candidates: Sequence[dict[str, Any]] | None = None,
    repeats: int = 2,
    max_rounds: int = 3,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The cheapest setting of ``method`` on a causal LM whose attention recall meets the target.

    Args:
        model: an unpatched causal LM (patched and unpatched per candidate; left unpatched).
        prompts: calibration prompts, each ``[1, tokens]`` token ids; the first is the one timed.
        method: a registered method with a tuning space and a recall measurement (``anchor_attention``).
        target_mean: required mean recall over every (prompt, layer, query head), in ``[0, 1]``.
        target_worst: required mean of the worst ``worst_fraction`` of them, in ``[0, 1]``.
        worst_fraction: share of entries averaged into the worst recall (0.05 = worst 5 %).
        candidates: option dicts to try instead of the method's tuning space.
        repeats: timed forwards per candidate (median; one untimed forward before them).
        max_rounds: recall measurements per candidate (per-head decisions added after each).
        progress: called with one line per measurement.

    Returns:
        ``{"method", "target": {...}, "geometry", "tokens", "dense_seconds", "rows": [...], "chosen": row}``;
        each row has ``options`` (``dense_heads`` included), ``dense_heads`` (count), ``recall_mean``,
        ``recall_worst``, ``meets``, ``seconds`` (``None`` when it misses the target, or when every head
        ended dense: not timed) and ``speedup`` (unpatched seconds / seconds).  The exact setting is the last
        row (``exact``; ``exact_at_tokens`` where its options are exact at that length only).

    Raises:
        OptionError: a target outside ``[0, 1]``, no prompts, a method the tuner cannot search, a bad
            candidate.
        UnsupportedModelError: the method does not fit the model.
    """
    for name, v in (("target_mean", target_mean), ("target_worst", target_worst)):
        if not 0.0 <= float(v) <= 1.0:
            raise OptionError(f"{name}={v!r}: must be a recall in [0, 1]")
    if not prompts:
        raise OptionError("tune_causal needs at least one calibration prompt")
    if repeats < 1 or max_rounds < 1:
        raise OptionError(f"repeats={repeats}, max_rounds={max_rounds}: each must be >= 1")
    meth = get_method(method)
    if not meth.fits("causal_lm"):
        raise OptionError(f"method {method!r} does not fit a causal LM (it fits: {', '.join(sorted(meth.model_kinds))})")
    geometry = model_geometry(model)
    space = _candidates(meth, geometry, candidates)
    say = progress or (lambda s: None)
    per_head = "dense_heads" in meth.options
    tokens = int(prompts[0].shape[-1])
    first = prompts[0]

    def forward():
        model(input_ids=first, use_cache=False)

    def unpatched_time() -> float:
        return _median_seconds(forward, repeats)

    dense_times = [unpatched_time()]
    say(f"unpatched: {dense_times[0]:.2f} s ({tokens} tokens)")
    rows: list[dict[str, Any]] = []
    for i, cand in enumerate(space):
        opts = dict(cand)
        dense: set[tuple[int, int]] = {tuple(p) for p in opts.get("dense_heads", ())}
        for rnd in range(max_rounds):
            opts["dense_heads"] = tuple(sorted(dense)) if per_head else opts.get("dense_heads", ())
            if not per_head:
                opts.pop("dense_heads", None)
            with torch.no_grad(), patched(model, method, **opts):
                mats = [_quiet(lambda p=p: attention_recall(model, p)) for p in prompts]
            if any(m["recall_matrix"] is None for m in mats):
                raise OptionError(f"method {method!r} does not measure its recall; the causal tuner needs it")
            layers = [r["layer"] for r in mats[0]["per_layer"]]
            rec = torch.tensor([m["recall_matrix"] for m in mats], dtype=torch.float64)  # [P, L, H]
            mean, worst = recall_scores(rec, worst_fraction)
            meets = mean >= target_mean and worst >= target_worst
            say(f"[{i + 1}/{len(space)}] {_short(opts)} round {rnd + 1}: recall mean {mean:.3f}, worst {worst:.3f}, "
                f"{len(dense)} dense heads")
            if meets or not per_head or rnd == max_rounds - 1:
                break
            add = _heads_to_add(rec, dense, layers, target_mean, target_worst, worst_fraction)
            if not add:
                break
            dense.update(add)
        row = {"options": dict(opts), "dense_heads": len(dense), "recall_mean": mean, "recall_worst": worst, "meets": meets,
               "seconds": None, "speedup": None}
        if per_head and len(dense) >= rec.shape[1] * rec.shape[2]:
            row["note"] = "every head dense: the exact model with the patch's overhead; not timed"
            say(f"[{i + 1}/{len(space)}] {_short(opts)}: {row['note']}")
        elif meets:
            with patched(model, method, **opts):
                row["seconds"] = _quiet(lambda: _median_seconds(forward, repeats))
            say(f"[{i + 1}/{len(space)}] {_short(opts)}: {row['seconds']:.2f} s")
        rows.append(row)
    dense_times.append(unpatched_time())
    ref, chosen = _finish(rows, dense_times, meth, tokens, dense_heads=0, recall_mean=1.0, recall_worst=1.0)
    return {
        "method": method, "kind": "causal_lm", "tokens": tokens, "prompts": len(prompts),
        "target": {"recall_mean": target_mean, "recall_worst": target_worst, "worst_fraction": worst_fraction},
        "geometry": _geometry_dict(geometry), "dense_seconds": ref, "dense_seconds_each": dense_times,
        "rows": rows, "chosen": chosen,
    }


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def tune_vision(
    model: torch.nn.Module,
    pixels: torch.Tensor,
    method: str = "fna",
    *,
    target_cos: float = 0.98,
    candidates: Sequence[dict[str, Any]] | None = None,
    repeats: int = 2,
    batch_size: int = 8,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The cheapest setting of ``method`` on a ViT encoder whose final CLS token stays within the target.

    Args:
        model: an unpatched ViT encoder (:func:`attnpatch.evals.vision.encode`); left unpatched.
        pixels: calibration images ``[B, 3, R, R]``, preprocessed at the resolution to tune for.
        method: a registered method with a tuning space that fits vision encoders (``fna``).
        target_cos: required mean cosine similarity of the final CLS token to the unpatched model's, in ``[-1, 1]``.
        candidates: option dicts to try instead of the method's tuning space.
        repeats: timed passes over the calibration images per candidate (median; one untimed pass before).
        batch_size: images per forward call.
        progress: called with one line per candidate.

    Returns:
        ``{"method", "target", "geometry", "tokens", "images", "dense_seconds", "rows", "chosen"}``; each row has
        ``options``, ``cls_cos`` (mean), ``cls_cos_min``, ``meets``, ``seconds`` (one pass over the calibration
        images; ``None`` when it misses the target) and ``speedup``.  The exact setting is the last row (``exact``;
        ``exact_at_tokens`` where its options are exact at that length only).

    Raises:
        OptionError: a target outside ``[-1, 1]``, no images, a method the tuner cannot search, a bad candidate.
        UnsupportedModelError: the method does not fit the model.
    """
    from .vision import encode, token_count

    if not -1.0 <= float(target_cos) <= 1.0:
        raise OptionError(f"target_cos={target_cos!r}: must be a cosine in [-1, 1]")
    if pixels.dim() != 4 or pixels.shape[0] < 1:
        raise OptionError(f"calibration images of shape {tuple(pixels.shape)}: expected [B >= 1, 3, R, R]")
    if repeats < 1 or batch_size < 1:
        raise OptionError(f"repeats={repeats}, batch_size={batch_size}: each must be >= 1")
    meth = get_method(method)
    if not meth.fits("vision"):
        raise OptionError(f"method {method!r} does not fit a vision encoder (it fits: {', '.join(sorted(meth.model_kinds))})")
    geometry = model_geometry(model)
    space = _candidates(meth, geometry, candidates)
    say = progress or (lambda s: None)
    batches = list(pixels.split(batch_size))
    tokens = token_count(model, int(pixels.shape[-1]))

    def cls() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([encode(model, b)[0] for b in batches])

    def one_pass() -> None:
        for b in batches:
            encode(model, b)

    ref_cls = cls()
    dense_times = [_median_seconds(one_pass, repeats)]
    say(f"unpatched: {dense_times[0]:.2f} s per pass ({pixels.shape[0]} images, {tokens} tokens)")
    rows: list[dict[str, Any]] = []
    for i, opts in enumerate(space):
        with patched(model, method, **opts):
            c = _cos(_quiet(cls), ref_cls)
            row = {"options": dict(opts), "cls_cos": float(c.mean()), "cls_cos_min": float(c.min()),
                   "meets": float(c.mean()) >= target_cos, "seconds": None, "speedup": None}
            if row["meets"]:
                row["seconds"] = _quiet(lambda: _median_seconds(one_pass, repeats))
        rows.append(row)
        t = f"{row['seconds']:.2f} s" if row["seconds"] is not None else "not timed (misses the target)"
        say(f"[{i + 1}/{len(space)}] {_short(opts)}: CLS cos {row['cls_cos']:.4f}, {t}")
    dense_times.append(_median_seconds(one_pass, repeats))
    ref, chosen = _finish(rows, dense_times, meth, tokens, cls_cos=1.0, cls_cos_min=1.0)
    return {
        "method": method, "kind": "vision", "tokens": tokens, "images": int(pixels.shape[0]),
        "resolution": int(pixels.shape[-1]), "target": {"cls_cos": target_cos}, "geometry": _geometry_dict(geometry),
        "dense_seconds": ref, "dense_seconds_each": dense_times, "rows": rows, "chosen": chosen,
    }


def _finish(rows: list[dict[str, Any]], dense_times: list[float], meth: Method, tokens: int,
            **exact_scores: float) -> tuple[float, dict[str, Any]]:
    """Append the exact row (the unpatched model's mean time, ``exact_scores``), set every timed row's speed-up
    against it; return ``(reference seconds, the fastest row that meets the target)``."""
    ref = statistics.mean(dense_times)
    rows.append({**_exact_row(meth, tokens), **exact_scores, "meets": True, "seconds": ref, "speedup": 1.0})
    for r in rows:
        if r["seconds"] is not None:
            r["speedup"] = ref / r["seconds"]
    return ref, min((r for r in rows if r["meets"] and r["seconds"] is not None), key=lambda r: r["seconds"])


def _geometry_dict(geometry) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: v for k, v in asdict(geometry).items() if v is not None and v != ""}


def _short(opts: dict[str, Any]) -> str:
    """Options in one short line (``dense_heads`` as a count)."""
    parts = []
    for k, v in opts.items():
        if k == "dense_heads":
            if v:
                parts.append(f"dense_heads={len(v)}")
            continue
        parts.append(f"{k}={v}")
    return ", ".join(parts) or "defaults"
