"""Whole-model benches: images per second of a ViT and prefill latency of a causal LM, unpatched vs patched, side by side."""

from __future__ import annotations

import statistics
import sys
from typing import Any, Callable, Sequence

import torch

from ...errors import OptionError
from ...patchers.adapters import adapter_for
from ...patchers.api import patch, record_stats, time_attention, unpatch
from ...patchers.registry import Method, get_method, validate_options
from .layer import setting_label
from ...timing import time_call

__all__ = ["bench_vision_model", "bench_causal_lm", "prefill_ids"]


def bench_vision_model(
    model,
    processor,
    settings: Sequence[tuple[str, dict[str, Any]]],
    *,
    resolutions: Sequence[int] = (224, 448, 896),
    batch: int = 1,
    repeats: int = 3,
    warmup: int = 1,
    device: str = "cpu",
    images=None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Images per second of a ViT, unpatched vs each setting, at several resolutions, in one run.

    For every resolution the unpatched model, ``dense`` routed through the patch (the cost of
    the patch machinery itself, and the share of time in attention) and each setting are timed
    back to back on the same batch.

    Args:
        model: a ViT the patch supports (``Dinov2Model``, timm ViT, ...), in eval mode.
        processor: its preprocessing (see :func:`attnpatch.evals.vision.preprocess.make_preprocess`).
        settings: ``(method, options)`` pairs, e.g. ``[("fna", {"s": 64})]``.
        resolutions: square input sizes in pixels.
        batch: images per forward call.
        repeats, warmup: timed and untimed forward calls per cell.
        device: where the model runs.
        images: a list of PIL images (default: the embedded image set).
        progress: called with a line of text per finished cell.

    Returns:
        ``{"rows": [...]}``; each row: ``resolution``, ``tokens``, ``setting``, ``seconds``
        (median per forward), ``images_per_s``, ``speedup`` (vs unpatched), ``attention_share``
        (fraction of the forward spent in the patched attention calls; ``None`` unpatched), and
        ``note`` where a setting approximated nothing (``s >= N``).

    Raises:
        OptionError: a resolution below the patch size, or a bad setting (also
        UnknownMethodError / UnsupportedModelError from :func:`attnpatch.patch`).
        UnsupportedModelError: the model's adapter cannot tell its patch size.
    """
    from ..vision.images import load_image_set
    from ..vision.preprocess import make_preprocess

    for name, opts in settings:
        validate_options(get_method(name), opts)
    if images is None:
        data = load_image_set(None)
        images = [data[i][0] for i in range(len(data))]
    pics = [images[i % len(images)] for i in range(batch)]
    dev = torch.device(device)
    model = model.to(dev).eval()
    rows = []
    adapter = adapter_for(model)
    patch_size = adapter.patch_size(model)  # raises where the adapter cannot tell it (no guessed fallback)
    small = [r for r in resolutions if r < patch_size]
    if small:
        raise OptionError(f"resolutions {small}: must be at least the patch size, {patch_size} pixels")
    for res in resolutions:
        x = make_preprocess(processor, res)(pics).to(dev)
        tokens = adapter.token_count(model, int(x.shape[-1]))

        def fwd():
            with torch.inference_mode():
                return model(x)

        t_ref = statistics.median(time_call(fwd, repeats=repeats, warmup=warmup, device=dev))
        rows.append({"resolution": res, "tokens": tokens, "setting": "unpatched", "seconds": t_ref,
                     "images_per_s": batch / t_ref, "speedup": 1.0, "attention_share": None})
        for name, opts in [("dense", {})] + list(settings):
            patch(model, name, **opts)
            try:
                with time_attention(model) as rec:
                    ts = time_call(fwd, repeats=repeats, warmup=warmup, device=dev)
                att = rec.attention_seconds[warmup:]
            finally:
                unpatch(model)
            t = statistics.median(ts)
            share = statistics.median(a / b for a, b in zip(att, ts)) if att else None
            rows.append({"resolution": res, "tokens": tokens, "setting": setting_label(name, opts), "seconds": t,
                         "images_per_s": batch / t, "speedup": t_ref / t, "attention_share": share})
            note = _exact_note(get_method(name), opts, tokens)
            if note:
                rows[-1]["note"] = note
            if progress is not None:
                progress(f"{res} px (N={tokens}) {rows[-1]['setting']}: {batch / t:.2f} img/s, {t_ref / t:.2f}x")
    return {"rows": rows, "config": {"resolutions": list(resolutions), "batch": batch, "repeats": repeats,
                                     "warmup": warmup, "device": str(dev)}}


def _exact_note(method: Method, options: dict[str, Any], tokens: int) -> str | None:
    """``"exact: <condition>"`` where an approximate method's options make it exact at ``tokens`` tokens (its exact limit)."""
    if method.exact or not method.is_exact(validate_options(method, options), tokens):
        return None
    return f"exact: {method.exact_limit_decl.text}"


def prefill_ids(tokenizer, length: int) -> torch.Tensor:
    """``[1, length]`` token ids of natural prose (the public-domain essay text the RULER tasks use), cycled if short."""
    from ..ruler.haystack import essay_sentences

    text = " ".join(essay_sentences())
    ids = tokenizer(text[: length * 8])["input_ids"]
    while len(ids) < length:
        ids = ids + ids
    return torch.tensor([ids[:length]])


def _prefill(tokenizer, length: int) -> torch.Tensor:
    """:func:`prefill_ids`, looked up on the package at call time (``attnpatch.evals.bench.prefill_ids`` may be replaced, as tests do)."""
    return getattr(sys.modules[__package__], "prefill_ids", prefill_ids)(tokenizer, length)


def bench_causal_lm(
    model,
    tokenizer,
    settings: Sequence[tuple[str, dict[str, Any]]],
    *,
    lengths: Sequence[int] = (1024, 2048, 4096, 8192),
    repeats: int = 1,
    warmup: int = 0,
    device: str = "cpu",
    include_dense: bool = True,
    stats: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Prefill latency of a causal LM, unpatched vs each setting, at several prompt lengths, in one run.

    One prefill = one forward over the whole prompt computing only the last position's
    logits (``logits_to_keep=1``, no cache kept), on natural prose (:func:`prefill_ids`).

    Args:
        model, tokenizer: a Hugging Face causal LM the patch supports.
        settings: ``(method, options)`` pairs.
        lengths: prompt lengths in tokens.
        repeats, warmup: timed and untimed prefills per cell.
        device: where the model runs.
        include_dense: also time ``dense`` routed through the patch (the machinery's own cost and
            the share of time in attention); off saves one prefill per length at long lengths.
        stats: run one more (untimed) prefill per patched setting to measure its sparsity.
        progress: called with a line of text per finished cell.

    Returns:
        ``{"rows": [...]}``; each row: ``length``, ``setting``, ``seconds`` (median prefill),
        ``tokens_per_s``, ``speedup`` (vs unpatched), ``attention_share``, and for
        ``anchor_attention`` the ``sparsity`` of that prefill.

    Raises:
        OptionError / UnknownMethodError: a bad setting (checked before any prefill);
        UnsupportedModelError from :func:`attnpatch.patch` for a method that does not fit the model.
    """
    for name, opts in settings:
        validate_options(get_method(name), opts)
    dev = torch.device(device)
    model = model.to(dev).eval()
    rows = []
    for n in lengths:
        ids = _prefill(tokenizer, n).to(dev)

        def fwd():
            with torch.inference_mode():
                return model(ids, use_cache=False, logits_to_keep=1)

        t_ref = statistics.median(time_call(fwd, repeats=repeats, warmup=warmup, device=dev))
        rows.append({"length": n, "setting": "unpatched", "seconds": t_ref, "tokens_per_s": n / t_ref, "speedup": 1.0})
        for name, opts in ([("dense", {})] if include_dense else []) + list(settings):
            patch(model, name, **opts)
            try:
                with time_attention(model) as rec:
                    ts = time_call(fwd, repeats=repeats, warmup=warmup, device=dev)
                att = rec.attention_seconds[warmup:]
                sparsity = None
                if not get_method(name).exact and stats:
                    with record_stats(model) as st:
                        fwd()
                    recs = [r for r in st.forwards[0].values() if r.causal_pairs is not None]
                    causal = sum(float(r.causal_pairs.sum()) for r in recs)
                    kept = sum(float(r.kept_pairs.sum()) for r in recs)
                    sparsity = 1.0 - kept / causal if causal else None
            finally:
                unpatch(model)
            t = statistics.median(ts)
            rows.append({"length": n, "setting": setting_label(name, opts), "seconds": t, "tokens_per_s": n / t,
                         "speedup": t_ref / t, "attention_share": statistics.median(a / b for a, b in zip(att, ts)),
                         "sparsity": sparsity})
            if progress is not None:
                progress(f"{n} tokens {rows[-1]['setting']}: {t:.2f} s, {t_ref / t:.2f}x")
    return {"rows": rows, "config": {"lengths": list(lengths), "repeats": repeats, "warmup": warmup, "device": str(dev)}}
