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

from ...errors import OptionError
from ...patchers.api import model_geometry, patched, record_stats
from ...patchers.registry import Method, get_method, load_config, validate_options
from ...timing import median_seconds, quietly  # quietly: warnings off (e.g. "s >= N: exact attention" on a small input)
from ..recall import attention_recall

__all__ = ["tune_causal", "tune_vision", "recall_scores"]

Progress = Callable[[str], None]

#: The unpatched model's times at the start and end of a run further apart than this ratio get a warning.
TIMING_SPREAD = 1.25


def recall_scores(recall: torch.Tensor, worst_fraction: float = 0.05) -> tuple[float, float]:
    """``(mean, worst)`` of a recall tensor (any shape, e.g. ``[prompts, layers, heads]``): the mean of all
    entries and the mean of the lowest ``worst_fraction`` of them (at least one).  Recall is the exact softmax
    mass the kept keys carry (:mod:`.recall`), a fraction in ``[0, 1]``.

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
                              f"{', '.join(tunable_methods())}")
        candidates = meth.tune_space(geometry)
    if not candidates:
        raise OptionError("no candidates to tune: give at least one option dict (or None for the method's tuning space)")
    out = []
    for c in candidates:
        full = validate_options(meth, dict(c))  # a bad candidate fails before any measurement
        keep = set(c) | {"dense_heads"}
        if c.get("preset") is not None:  # what a preset or a saved config sets is part of the candidate
            keep |= set(meth.presets[c["preset"]].options)
        if c.get("config") is not None:
            keep |= set(load_config(c["config"], meth)["options"])
        out.append({k: v for k, v in full.items() if k in keep and k not in ("preset", "config")})
    return out


def _check_patches(model: torch.nn.Module, method: str, space: list[dict[str, Any]]) -> None:
    """Patch and unpatch once per candidate, so that a model feature a candidate cannot run, or an option that
    does not fit the model (``dense_heads`` naming a head it lacks), fails before anything is timed."""
    for opts in space:
        with patched(model, method, **opts):
            pass


def _all_dense(per_layer_modes: list[list[str]]) -> bool:
    """Whether every routed layer of every calibration input ran exact attention (record modes ``dense:*``)."""
    modes = [m for layer_modes in per_layer_modes for m in layer_modes]
    return bool(modes) and all(str(m).startswith("dense:") for m in modes)


def _timing_warning(dense_times: list[float]) -> str | None:
    lo, hi = min(dense_times), max(dense_times)
    if lo > 0 and hi / lo > TIMING_SPREAD:
        return (f"the unpatched model took {dense_times[0]:.3g} s at the start and {dense_times[-1]:.3g} s at the end "
                f"({hi / lo:.2f}x apart): this machine's speed changed during the run, so the speed-ups are uncertain; "
                "run again on an idle machine or with more --repeats")
    return None


def tunable_methods() -> list[str]:
    from ...patchers.registry import METHODS

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

    Per-head dense decisions measured offline on calibration prompts follow MInference's offline per-head
    search (arXiv 2407.02490), here with attention recall as the criterion and wall time as the cost.

    Args:
        model: an unpatched causal LM (patched and unpatched per candidate; left unpatched).
        prompts: calibration prompts, each ``[1, tokens]`` integer token ids; a timed pass runs every one.
        method: a registered method with a tuning space and a recall measurement (``anchor_attention``).
        target_mean: required mean recall over every (prompt, layer, query head), in ``[0, 1]``.
        target_worst: required mean of the worst ``worst_fraction`` of them, in ``[0, 1]``.
        worst_fraction: share of entries averaged into the worst recall (0.05 = worst 5 %).
        candidates: option dicts to try instead of the method's tuning space.
        repeats: timed passes over the prompts per candidate (median; one untimed pass before them).
        max_rounds: recall measurements per candidate (per-head decisions added after each).
        progress: called with one line per measurement.

    Returns:
        ``{"method", "target": {...}, "geometry", "tokens"`` (the longest prompt), ``"prompt_tokens", "dense_seconds",
        "rows": [...], "chosen": row, "warnings": [...]}`` (warnings: the machine's speed changed during the run,
        or every candidate ran exact attention on the calibration input);
        each row has ``options`` (``dense_heads`` included), ``dense_heads`` (count), ``recall_mean``,
        ``recall_worst``, ``meets``, ``seconds`` (``None`` when it misses the target, or when every head
        ended dense, or every layer ran exact attention on the calibration input, e.g. below ``min_len``: not
        timed, ``note`` says which) and ``speedup`` (unpatched seconds / seconds).  The exact setting is the last
        row (``exact``; ``exact_at_tokens`` where its options are exact at that length only).

    Raises:
        OptionError: a target outside ``[0, 1]``, no prompts or prompts not ``[1, tokens]`` integer ids, a method
            the tuner cannot search, a bad candidate.
        UnsupportedModelError: the method does not fit the model.
    """
    for name, v in (("target_mean", target_mean), ("target_worst", target_worst)):
        if not isinstance(v, (int, float)) or not 0.0 <= float(v) <= 1.0:
            raise OptionError(f"{name}={v!r}: must be a recall in [0, 1]")
    if not prompts:
        raise OptionError("tune_causal needs at least one calibration prompt")
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 2 or p.shape[0] != 1 or p.shape[1] < 1 or p.is_floating_point():
            what = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise OptionError(f"prompts[{i}] of shape {what}: expected integer token ids of shape [1, tokens]")
    if repeats < 1 or max_rounds < 1:
        raise OptionError(f"repeats={repeats}, max_rounds={max_rounds}: each must be >= 1")
    meth = get_method(method)
    if not meth.fits("causal_lm"):
        raise OptionError(f"method {method!r} does not fit a causal LM (it fits: {', '.join(sorted(meth.model_kinds))})")
    geometry = model_geometry(model)
    space = _candidates(meth, geometry, candidates)
    say = progress or (lambda s: None)
    per_head = "dense_heads" in meth.options
    lengths = [int(p.shape[-1]) for p in prompts]
    tokens = max(lengths)
    _check_patches(model, method, space)

    def forward():  # one pass over every calibration prompt
        for p in prompts:
            model(input_ids=p, use_cache=False)

    def unpatched_time() -> float:
        return median_seconds(forward, repeats)

    dense_times = [unpatched_time()]
    say(f"unpatched: {dense_times[0]:.2f} s per pass ({len(prompts)} prompt(s), {sum(lengths)} tokens)")
    rows: list[dict[str, Any]] = []
    for i, cand in enumerate(space):
        opts = dict(cand)
        dense: set[tuple[int, int]] = {tuple(p) for p in opts.get("dense_heads", ())}
        for rnd in range(max_rounds):
            opts["dense_heads"] = tuple(sorted(dense)) if per_head else opts.get("dense_heads", ())
            if not per_head:
                opts.pop("dense_heads", None)
            with torch.no_grad(), patched(model, method, **opts):
                mats = [quietly(lambda p=p: attention_recall(model, p)) for p in prompts]
            if any(m["recall_matrix"] is None for m in mats):
                raise OptionError(f"method {method!r} does not measure its recall; the causal tuner needs it")
            layers = [r["layer"] for r in mats[0]["per_layer"]]
            rec = torch.tensor([m["recall_matrix"] for m in mats], dtype=torch.float64)  # [P, L, H]
            mean, worst = recall_scores(rec, worst_fraction)
            meets = mean >= target_mean and worst >= target_worst
            say(f"[{i + 1}/{len(space)}] {short_options(opts)} round {rnd + 1}: recall mean {mean:.3f}, worst {worst:.3f}, "
                f"{len(dense)} dense heads")
            if meets or not per_head or rnd == max_rounds - 1:
                break
            add = _heads_to_add(rec, dense, layers, target_mean, target_worst, worst_fraction)
            if not add:
                break
            dense.update(add)
        row = {"options": dict(opts), "dense_heads": len(dense), "recall_mean": mean, "recall_worst": worst, "meets": meets,
               "seconds": None, "speedup": None}
        if _all_dense([[r["mode"] for r in m["per_layer"]] for m in mats]):
            row["note"] = (f"every layer ran exact attention on the calibration input "
                           f"({', '.join(sorted({r['mode'] for m in mats for r in m['per_layer']}))}): not timed")
            say(f"[{i + 1}/{len(space)}] {short_options(opts)}: {row['note']}")
        elif per_head and len(dense) >= rec.shape[1] * rec.shape[2]:
            row["note"] = "every head dense: the exact model with the patch's overhead; not timed"
            say(f"[{i + 1}/{len(space)}] {short_options(opts)}: {row['note']}")
        elif meets:
            with patched(model, method, **opts):
                row["seconds"] = quietly(lambda: median_seconds(forward, repeats))
            say(f"[{i + 1}/{len(space)}] {short_options(opts)}: {row['seconds']:.2f} s")
        rows.append(row)
    dense_times.append(unpatched_time())
    ref, chosen = _finish(rows, dense_times, meth, tokens, dense_heads=0, recall_mean=1.0, recall_worst=1.0)
    warnings = _warnings(rows, dense_times, f"{tokens} tokens")
    return {
        "method": method, "kind": "causal_lm", "tokens": tokens, "prompt_tokens": lengths, "prompts": len(prompts),
        "warnings": warnings,
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

    The criterion, the final CLS token's cosine to the exact model, is ``attnpatch eval fidelity``'s; the methods
    searched are the method's own (``fna``: arXiv 2507.16018).  Times are seconds of wall clock per pass over ``pixels``.

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
        ``{"method", "target", "geometry", "tokens", "images", "dense_seconds", "rows", "chosen", "warnings"}``; each
        row has ``options``, ``cls_cos`` (mean), ``cls_cos_min``, ``meets``, ``seconds`` (one pass over the calibration
        images; ``None`` when it misses the target or every layer ran exact attention, ``note`` then says so) and
        ``speedup``.  The exact setting is the last row (``exact``;
        ``exact_at_tokens`` where its options are exact at that length only).

    Raises:
        OptionError: a target outside ``[-1, 1]``, no images or non-square ones, a model that is not a vision
            encoder, a method the tuner cannot search, a bad candidate.
        UnsupportedModelError: the method does not fit the model.
    """
    from ..vision.runner import encode, token_count

    if not isinstance(target_cos, (int, float)) or not -1.0 <= float(target_cos) <= 1.0:
        raise OptionError(f"target_cos={target_cos!r}: must be a cosine in [-1, 1]")
    if pixels.dim() != 4 or pixels.shape[0] < 1 or pixels.shape[-1] != pixels.shape[-2] or not pixels.is_floating_point():
        raise OptionError(f"calibration images of shape {tuple(pixels.shape)}: expected square float images [B >= 1, 3, R, R]")
    if repeats < 1 or batch_size < 1:
        raise OptionError(f"repeats={repeats}, batch_size={batch_size}: each must be >= 1")
    meth = get_method(method)
    if not meth.fits("vision"):
        raise OptionError(f"method {method!r} does not fit a vision encoder (it fits: {', '.join(sorted(meth.model_kinds))})")
    geometry = model_geometry(model)
    if "vision" not in geometry.kind:
        raise OptionError(f"tune_vision needs a vision encoder; this model's routed attention is {geometry.kind or 'unknown'!r}")
    space = _candidates(meth, geometry, candidates)
    _check_patches(model, method, space)
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
    dense_times = [median_seconds(one_pass, repeats)]
    say(f"unpatched: {dense_times[0]:.2f} s per pass ({pixels.shape[0]} images, {tokens} tokens)")
    rows: list[dict[str, Any]] = []
    for i, opts in enumerate(space):
        with patched(model, method, **opts):
            with record_stats(model) as recorder:
                c = _cos(quietly(cls), ref_cls)
            row = {"options": dict(opts), "cls_cos": float(c.mean()), "cls_cos_min": float(c.min()),
                   "meets": float(c.mean()) >= target_cos, "seconds": None, "speedup": None}
            modes = [[r.mode for r in f.values()] for f in recorder.forwards]
            if _all_dense(modes):
                row["note"] = (f"every layer ran exact attention on the calibration input "
                               f"({', '.join(sorted({m for f in modes for m in f}))}): not timed")
            elif row["meets"]:
                row["seconds"] = quietly(lambda: median_seconds(one_pass, repeats))
        rows.append(row)
        t = (f"{row['seconds']:.2f} s" if row["seconds"] is not None else
             row.get("note", "not timed (misses the target)"))
        say(f"[{i + 1}/{len(space)}] {short_options(opts)}: CLS cos {row['cls_cos']:.4f}, {t}")
    dense_times.append(median_seconds(one_pass, repeats))
    ref, chosen = _finish(rows, dense_times, meth, tokens, cls_cos=1.0, cls_cos_min=1.0)
    warnings = _warnings(rows, dense_times, f"{tokens} tokens")
    return {
        "method": method, "kind": "vision", "tokens": tokens, "images": int(pixels.shape[0]),
        "resolution": int(pixels.shape[-1]), "target": {"cls_cos": target_cos}, "warnings": warnings, "geometry": _geometry_dict(geometry),
        "dense_seconds": ref, "dense_seconds_each": dense_times, "rows": rows, "chosen": chosen,
    }


def _warnings(rows: list[dict[str, Any]], dense_times: list[float], size: str) -> list[str]:
    out = []
    spread = _timing_warning(dense_times)
    if spread:
        out.append(spread)
    approx = rows[:-1]
    if approx and all(r.get("note", "").startswith("every layer ran exact") for r in approx):
        out.append(f"every candidate ran exact attention at {size} (e.g. below its min_len / min_tokens): calibrate on "
                   "inputs long enough for the method to run, or give candidates that approximate there")
    return out


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


def short_options(opts: dict[str, Any]) -> str:
    """Options in one short line (``dense_heads`` as a count)."""
    parts = []
    for k, v in opts.items():
        if k == "dense_heads":
            if v:
                parts.append(f"dense_heads={len(v)}")
            continue
        parts.append(f"{k}={v}")
    return ", ".join(parts) or "defaults"
