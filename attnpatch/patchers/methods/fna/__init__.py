"""``fna``: Fast Nyström Attention for ViTs (the math: :mod:`attnpatch.attention.nystrom`).

Landmark indices are sampled once per forward call (at ``sample_layer``) and kept in the
per-forward :class:`~attnpatch.patchers.state.ForwardState`, so later layers reuse them.  What
each option does is declared once on :class:`~.config.FNAConfig`; how the defaults were chosen, and the
accuracy and speed they give, is measured in docs/benchmarks/vision.md and docs/methods.md.

This module is the method itself: landmark bookkeeping, the forward and the registration.  Its options, checks,
presets and the layer's approximation: :mod:`.config`; its calibration, bench and tune hooks: :mod:`.hooks`.
"""

from __future__ import annotations

from typing import Any

import torch

from ....attention.exact import exact_attention, repeat_kv
from ....attention.landmarks import select_landmarks
from ....attention.nystrom import window_keys
from ....attention.sinks import massive_tokens
from ....errors import OptionError
from ....options import options_of
from ...contract import ExactLimit, Knob, Method
from ...registry import register_method
from ...state import LayerContext, LayerRecord
from .config import BREAK_EVEN, FEATURES, PRESETS, FNAConfig, approximate, check_fna
from .hooks import (CALIBRATION_LENGTHS, TUNE_S, calibration_case, every_token, fna_bench, knob, min_tokens_for,
                    prepare_fna, tune_space)

__all__ = ["FNA", "FNAConfig", "FEATURES", "BREAK_EVEN", "PRESETS", "CALIBRATION_LENGTHS", "TUNE_S", "fna_forward",
           "fna_core", "fna_bench", "check_fna", "exact_reason", "min_tokens_for", "calibration_case", "prepare_fna",
           "approximate"]


def _landmark_features(cfg: FNAConfig, k: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
    if cfg.features == "keys":
        b, h, n, d = k.shape
        return k.transpose(1, 2).reshape(b, n, h * d)
    if ctx.hidden is None:
        raise OptionError("features='hidden': this adapter does not expose the attention layer's input; use features='keys'")
    return ctx.hidden


def _sampled(cfg: FNAConfig, n: int) -> int:
    """Landmarks sampled once on ``n`` tokens: the largest per-layer ``s`` (at most ``n``); a layer taking fewer uses
    the first of them, which for farthest-point sampling is the sample of that size (FPS is greedy)."""
    return min(cfg.s_max, n)


def _fna_landmarks(cfg: FNAConfig, k: torch.Tensor, ctx: LayerContext) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
    """``(landmarks [B, s] or None, active [B] bool, every row active)`` for this layer; updates the per-forward state.

    With a numeric ``sample_layer`` (and no ``resample``) which rows are active is known on the host: nothing is
    read back from the device, so on CUDA the layers run without a host sync.  ``sample_layer="auto"`` reads the
    massive-token test back in each layer until every image has sampled.
    """
    b = k.shape[0]
    st = ctx.shared("fna")
    active = st.get("active")
    if active is None or active.shape[0] != b:
        active = torch.zeros(b, dtype=torch.bool, device=k.device)
        st["active"] = active
        st["landmarks"] = torch.zeros(b, _sampled(cfg, k.shape[2]), dtype=torch.long, device=k.device)
        st["sampled_at"] = torch.full((b,), -1, dtype=torch.long)
        st["all_active"] = False
    width = _sampled(cfg, k.shape[2])
    if st["landmarks"].shape[1] > width:
        # fewer tokens than when the buffer was made (a merge ran since): the first landmarks, an FPS sample of that size
        st["landmarks"] = st["landmarks"][:, :width].contiguous()
    if st["all_active"] and not cfg.resample:
        return st["landmarks"], active.clone(), True
    if cfg.sample_layer != "auto" and not cfg.resample:  # every row samples at sample_layer, at once
        if ctx.layer < cfg.sample_layer:
            return None, active.clone(), False
        st["landmarks"].copy_(select_landmarks(_landmark_features(cfg, k, ctx), st["landmarks"].shape[1], prefix=ctx.prefix_tokens,
                                               strategy=cfg.strategy, seed=cfg.seed))
        st["sampled_at"].fill_(ctx.layer)
        active.fill_(True)
        st["all_active"] = True
        return st["landmarks"], active.clone(), True
    if cfg.sample_layer == "auto":
        fallback = ctx.num_layers // 2 if cfg.auto_fallback == "auto" else cfg.auto_fallback
        trigger = ~active
        if ctx.layer < fallback:
            if ctx.residual is None:
                raise OptionError("sample_layer='auto' needs the block input hidden states, which this adapter does not expose")
            trigger = trigger & massive_tokens(ctx.residual, cfg.massive_ratio).any(-1)
    else:
        trigger = ~active if ctx.layer >= cfg.sample_layer else torch.zeros_like(active)
    if cfg.resample:
        trigger = trigger | active
    if bool(trigger.any()):
        rows = torch.nonzero(trigger).flatten()
        feats = _landmark_features(cfg, k, ctx)[rows]
        st["landmarks"][rows] = select_landmarks(feats, st["landmarks"].shape[1], prefix=ctx.prefix_tokens, strategy=cfg.strategy, seed=cfg.seed)
        st["sampled_at"][rows.cpu()] = ctx.layer
        active |= trigger
    st["all_active"] = every = bool(active.all())
    return (st["landmarks"] if every or bool(active.any()) else None), active.clone(), every


def exact_reason(cfg: FNAConfig, q: torch.Tensor, k: torch.Tensor, ctx: LayerContext, say: bool = True,
                 name: str = "fna") -> str | None:
    """Why a call on ``q`` ``[B, H, N, D]`` runs exact attention whatever the layer (``"dense:short"``: below
    ``min_tokens``, :func:`min_tokens_for`; ``"dense:s>=N"``: every token would be a landmark, said once;
    ``"dense:schedule"``: a per-layer ``s`` of 0), or ``None``; shared with ``fna+sink_mask`` and ``tome+fna``."""
    n = q.shape[2]
    s = cfg.s_at(ctx.layer)
    if s == 0:
        return "dense:schedule"
    if s < ctx.prefix_tokens:
        raise OptionError(f"{name}: s={s} at layer {ctx.layer}: below this model's {ctx.prefix_tokens} prefix tokens (CLS "
                          "and registers), which are always landmarks; give s >= the prefix tokens, or 0 to leave the "
                          "layer exact")
    if n < min_tokens_for(cfg, q, k):
        return "dense:short"
    if s >= n:
        if say:
            ctx.say(f"{name}: s={s} >= N={n} tokens, so Nyström attention is exact attention; running exact attention")
        return "dense:s>=N"
    return None


def fna_core(cfg: FNAConfig, q, k, v, ctx: LayerContext, key_keep=None, renormalize=False, mode="fna", key_bias=None):
    """FNA for the images whose landmarks are sampled, exact attention for the others (shared with ``fna+sink_mask``
    and ``tome+fna``, whose ``key_bias`` ``[B, N]`` is ToMe's ``log(size)``)."""
    b, h, n, _ = q.shape
    k, v = repeat_kv(k, h), repeat_kv(v, h)
    rec = LayerRecord(ctx.layer, mode, n, n)
    landmarks, active, every = _fna_landmarks(cfg, k, ctx)
    if landmarks is None:
        if key_keep is None and key_bias is None:
            rec.mode = "dense:before_sample"
            return None, rec
        return exact_attention(q, k, v, scale=ctx.scale, key_keep=key_keep, renormalize=renormalize,
                               key_bias=key_bias), rec
    s = cfg.s_at(ctx.layer)
    if s < landmarks.shape[1]:
        landmarks = landmarks[:, :s]
    until = ctx.num_layers // 2 if cfg.window_until == "auto" else cfg.window_until
    window = cfg.local_window > 0 and (until is None or ctx.layer < until)
    if window:
        rec.mode = mode + "+window"
    kw = dict(scale=ctx.scale, prefix=ctx.prefix_tokens, window=window, renormalize=renormalize)
    if key_bias is not None:
        kw["key_bias"] = key_bias
    if every:  # known on the host: no read-back
        out = approximate(cfg, q, k, v, landmarks, key_keep=key_keep, **kw)
    else:
        out = exact_attention(q, k, v, scale=ctx.scale, key_keep=key_keep, renormalize=renormalize, key_bias=key_bias)
        rows = torch.nonzero(active).flatten()
        if key_bias is not None:
            kw["key_bias"] = key_bias[rows]
        out[rows] = approximate(
            cfg, q[rows], k[rows], v[rows], landmarks[rows], key_keep=None if key_keep is None else key_keep[rows], **kw
        )
    if ctx.record:
        s = landmarks.shape[1]
        rec.landmarks = torch.where(active[:, None], landmarks, torch.full_like(landmarks, -1)).cpu()
        full = float(n * n)
        pairs = 2.0 * s * n + s * s
        if window:
            p = ctx.prefix_tokens
            pairs += (n - p) * (window_keys(n - p, None, cfg.local_window, cfg.window_tile) + p) + p * n
        kept = torch.where(active.cpu(), torch.full((b,), min(pairs, full)), torch.full((b,), full)).double()
        rec.causal_pairs = torch.full((b, h), full, dtype=torch.float64)
        rec.kept_pairs = kept[:, None].expand(b, h).clone()
    return out, rec


def fna_forward(cfg: FNAConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """FNA from ``sample_layer`` on; exact attention before it and wherever ``s >= N``."""
    n = q.shape[2]
    reason = exact_reason(cfg, q, k, ctx)
    if reason is not None:
        return None, LayerRecord(ctx.layer, reason, n, n)
    return fna_core(cfg, q, k, v, ctx)


def _config(options: dict[str, Any]) -> FNAConfig:
    return FNAConfig(**options)


FNA = register_method(
    Method(
        name="fna",
        summary="Fast Nyström Attention: s landmark tokens by farthest-point sampling, sampled once and reused",
        source="FNA, arXiv 2507.16018, Sec. 3 (Eq. 3); Nyströmformer, arXiv 2102.03902, Eq. 13-16",
        options=options_of(FNAConfig),
        model_kinds=frozenset({"vision"}),
        make_config=_config,
        forward=fna_forward,
        check=check_fna,
        prepare=prepare_fna,
        causal_calls=False,
        noncausal_calls=True,
        key_padding=False,
        token_roles=frozenset({"prefix", "hidden", "residual"}),
        exact_limit_decl=ExactLimit(every_token, at_least=("s",), text="s >= N", everywhere={"min_tokens": 2**31 - 1}),
        bench_hook=fna_bench,
        knob=Knob("s, 1 to N landmarks (log scale)", knob, tokens="s"),
        presets=PRESETS,
        tune_space=tune_space,
        small_settings={"vision": dict(s=8, sample_layer=0, min_tokens=0)},
        details=(
            "Fast Nyström Attention: `s` landmark tokens (CLS and registers always among them) chosen by farthest-point sampling once, at "
            "`sample_layer`, and reused by every later layer; `softmax(QK̃ᵀ)·pinv(softmax(Q̃K̃ᵀ))·softmax(Q̃Kᵀ)·V` "
            "evaluated right to left, never forming an N×N matrix. `s ≥ N` runs exact attention and says so."
        ),
    )
)
