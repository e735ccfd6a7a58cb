"""Registry entries of the vision methods: ``fna``, ``sink_mask`` and their composition ``fna+sink_mask``.

The math lives in :mod:`attnpatch.attention.nystrom` and :mod:`attnpatch.attention.sinks`; this
module holds the option sets (with their measured defaults) and the glue that keeps the state
crossing layers in the per-forward :class:`~attnpatch.patchers.state.ForwardState`: landmark
indices sampled once and reused by later layers, and sink tokens detected once and masked in
the last layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..attention.nystrom import PINV_MODES, STRATEGIES, exact_attention, nystrom_attention, select_landmarks
from ..attention.sinks import attention_sinks, massive_tokens
from ..errors import OptionError
from .registry import Method, _options_from_dataclass, register_method
from .state import LayerContext, LayerRecord

__all__ = ["FNAConfig", "SinkMaskConfig", "FNASinkConfig", "fna_forward", "sink_mask_forward", "fna_sink_forward"]

FEATURES = ("keys", "hidden")
DETECT = ("attention", "norm", "both")


@dataclass(frozen=True)
class FNAConfig:
    """Options of Fast Nyström Attention (arXiv 2507.16018).

    Attributes:
        s: landmarks per image (tokens), CLS and register tokens included.  When ``s >= N``
            the layer runs exact attention (Nyström with every token a landmark is exact) and
            the patch says so once.
        sample_layer: layer where landmarks are sampled (an int, 0-based) or ``"auto"``: the
            first layer whose input has a massive token (L2 norm above ``massive_ratio x`` the
            median token norm, per image), and at the latest the layer ``auto_fallback`` when
            no massive token appears.  Layers before it run exact attention; the same indices
            are reused in every later layer.
        resample: run landmark selection again at every patched layer.
        strategy: ``"fps"`` (farthest-point sampling), ``"random"``, ``"strided"``, ``"kmeans"``.
        features: what landmark selection runs on: ``"keys"`` (the layer's keys, heads
            concatenated) or ``"hidden"`` (the attention layer's input hidden states).
        pinv: pseudo-inverse of the landmark kernel: ``"rtol"``, ``"newton"``, ``"exact"``.
        rtol: relative singular-value cut-off of ``pinv="rtol"``.
        newton_iters: iterations of ``pinv="newton"``.
        massive_ratio: norm ratio defining a massive token for ``sample_layer="auto"``.
        auto_fallback: ``sample_layer="auto"`` samples at this layer at the latest (an int, or
            ``"auto"`` = half the depth, ``num_layers // 2``).
        seed: seed of the ``random`` and ``kmeans`` strategies.

    Defaults, chosen by measurement on the offline ``dinov2-small`` (ViT-S/14, 12 layers), with
    ``benchmarks/vision_grid.py features --sweep``: images of ``imagenet-det-200x5`` (2 per class;
    32 at 224 px = 257 tokens, 16 at 448 px = 1025 tokens), ``s=64``.  Columns: mean final-CLS
    cosine to dense (worst image), and mean teacher-forced relative error of the approximated
    layers' attention output, at 224 px | at 448 px::

        setting (s = 64)                 224 px: CLS cos (worst)  err  | 448 px: CLS cos (worst)  err
        sample_layer 0                   0.916 (0.47)  0.64             |  -
        sample_layer 2 / 3               0.948 / 0.949  0.55 / 0.46     |  -
        sample_layer 4                   0.979 (0.92)  0.35             |  0.949 (0.83)  0.32
        sample_layer 5                   0.986 (0.95)  0.20             |  0.975 (0.91)  0.23
        sample_layer 6 = 12 // 2         0.996 (0.987) 0.12             |  0.985 (0.945) 0.16
        sample_layer 7                   0.996 (0.988) 0.10             |  0.991 (0.965) 0.14
        sample_layer 8 / 10              0.998 / 0.999  0.08 / 0.06     |  -
        at layer 6: pinv exact           0.349 (0.15)  70               |  -
        pinv newton (6 / 12 iterations)  0.995 / 0.987  0.12 / 0.23     |  0.977 (6)     0.16
        pinv rtol 1e-1 / 1e-2 / 1e-3     0.976 / 0.996 / 0.985          |  0.943 / 0.985 / 0.967
        features hidden (vs keys)        0.994 (0.955) vs 0.996 (0.987) |  0.989 (0.960) vs 0.985 (0.945)
        strategy random / strided (fps)  0.977 / 0.979 (0.996)          |  -

    So: the landmark kernel needs a *regularised* pseudo-inverse (the exact one, and Newton-
    Schulz run to convergence, amplify the Nyström error; a relative cut-off of 1e-2 is best at
    both sizes); FPS beats strided and random landmarks; keys and hidden states are within
    0.003 of each other (keys better at 224, hidden at 448) and keys are the default because
    every adapter has them; and the layer matters most: early layers attend sharply and
    locally, which 64 landmarks cannot represent.  This model has no massive tokens
    (block-input norms stay below 3.3x the median in every layer; the CLS token is the
    attention sink, receiving 7-76x its uniform share; ``attnpatch sinks``), so ``"auto"``
    needs a rule for that case: sample at half the depth, where the curve flattens (0.996 at
    224 px) and half the layers stay approximated.
    """

    s: int = 64
    sample_layer: int | str = "auto"
    resample: bool = False
    strategy: str = "fps"
    features: str = "keys"
    pinv: str = "rtol"
    rtol: float = 1e-2
    newton_iters: int = 6
    massive_ratio: float = 5.0
    auto_fallback: int | str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.s, bool) or not isinstance(self.s, int) or self.s < 1:
            raise OptionError(f"s={self.s!r}: the number of landmarks must be an integer >= 1 (tokens)")
        for name in ("sample_layer", "auto_fallback"):
            val = getattr(self, name)
            if val != "auto" and (isinstance(val, bool) or not isinstance(val, int) or val < 0):
                raise OptionError(f"{name}={val!r}: must be 'auto' or a layer index >= 0")
        if self.strategy not in STRATEGIES:
            raise OptionError(f"strategy={self.strategy!r}: allowed values are {', '.join(map(repr, STRATEGIES))}")
        if self.features not in FEATURES:
            raise OptionError(f"features={self.features!r}: allowed values are {', '.join(map(repr, FEATURES))}")
        if self.pinv not in PINV_MODES:
            raise OptionError(f"pinv={self.pinv!r}: allowed values are {', '.join(map(repr, PINV_MODES))}")
        if not (isinstance(self.rtol, (int, float)) and 0 < self.rtol < 1):
            raise OptionError(f"rtol={self.rtol!r}: must be in (0, 1)")
        if isinstance(self.newton_iters, bool) or not isinstance(self.newton_iters, int) or self.newton_iters < 1:
            raise OptionError(f"newton_iters={self.newton_iters!r}: must be an integer >= 1")
        if not (isinstance(self.massive_ratio, (int, float)) and self.massive_ratio > 1 and math.isfinite(self.massive_ratio)):
            raise OptionError(f"massive_ratio={self.massive_ratio!r}: must be a finite number > 1")


@dataclass(frozen=True)
class SinkMaskConfig:
    """Options of sink masking (FNA, arXiv 2507.16018, Sec. 4).

    Attributes:
        mask_layers: the last ``mask_layers`` layers set the attention probabilities into sink
            tokens to zero.
        detect: how sink tokens are found: ``"attention"`` (tokens receiving more than
            ``mass_ratio x`` the uniform share ``1/N`` of attention, averaged over heads and
            queries), ``"norm"`` (massive tokens: block-input L2 norm above ``norm_ratio x`` the
            median), or ``"both"`` (either).
        detect_layer: layer where sinks are detected (``"auto"`` = the first masked layer); the
            same tokens are masked in every masked layer.
        norm_ratio: massive-token threshold (multiples of the median token norm).
        mass_ratio: attention-sink threshold (multiples of the uniform share ``1/N``).
        renormalize: renormalise attention rows after masking (the paper does not: it multiplies
            the softmax output by the mask).
        keep_cls: never mask the first (CLS) token.

    Defaults measured on ``dinov2-small`` (32 images of ``imagenet-det-200x5``, 224 px; final-CLS
    cosine to dense): masking the last layer only keeps 0.9999, the last 2 / 4 layers 0.993 /
    0.988; renormalising the rows after masking (last 2 layers) lowers it to 0.981, so the
    paper's plain multiplication by the mask is the default.  On this model the detected sink
    is the CLS token (it receives 7-76x its uniform share of attention; no token has a massive
    norm).
    """

    mask_layers: int = 1
    detect: str = "both"
    detect_layer: int | str = "auto"
    norm_ratio: float = 5.0
    mass_ratio: float = 10.0
    renormalize: bool = False
    keep_cls: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.mask_layers, bool) or not isinstance(self.mask_layers, int) or self.mask_layers < 1:
            raise OptionError(f"mask_layers={self.mask_layers!r}: must be an integer >= 1 (layers)")
        if self.detect not in DETECT:
            raise OptionError(f"detect={self.detect!r}: allowed values are {', '.join(map(repr, DETECT))}")
        if self.detect_layer != "auto" and (
            isinstance(self.detect_layer, bool) or not isinstance(self.detect_layer, int) or self.detect_layer < 0
        ):
            raise OptionError(f"detect_layer={self.detect_layer!r}: must be 'auto' or a layer index >= 0")
        for name in ("norm_ratio", "mass_ratio"):
            val = getattr(self, name)
            if not (isinstance(val, (int, float)) and val > 1 and math.isfinite(val)):
                raise OptionError(f"{name}={val!r}: must be a finite number > 1")


@dataclass(frozen=True)
class FNASinkConfig:
    """``fna+sink_mask``: FNA in every patched layer, with sink tokens masked in the last layers."""

    fna: FNAConfig
    sink: SinkMaskConfig


# --------------------------------------------------------------------------- checks against depth


def _check_fna(cfg: FNAConfig, num_layers: int) -> None:
    for name in ("sample_layer", "auto_fallback"):
        val = getattr(cfg, name)
        if val != "auto" and val >= num_layers:
            raise OptionError(f"{name}={val}: the model has {num_layers} attention layers (0..{num_layers - 1})")


def _check_sink(cfg: SinkMaskConfig, num_layers: int) -> None:
    if cfg.mask_layers > num_layers:
        raise OptionError(f"mask_layers={cfg.mask_layers}: the model has {num_layers} attention layers")
    if cfg.detect_layer != "auto":
        first = num_layers - cfg.mask_layers
        if cfg.detect_layer >= num_layers or cfg.detect_layer > first:
            raise OptionError(
                f"detect_layer={cfg.detect_layer}: must be at or before the first masked layer {first} "
                f"(the model has {num_layers} layers, mask_layers={cfg.mask_layers})"
            )


def _check_fna_sink(cfg: FNASinkConfig, num_layers: int) -> None:
    _check_fna(cfg.fna, num_layers)
    _check_sink(cfg.sink, num_layers)


# --------------------------------------------------------------------------- forwards


def _require_bidirectional(ctx: LayerContext, method: str) -> None:
    if ctx.causal:
        raise OptionError(f"method {method!r} is for bidirectional (vision) attention; layer {ctx.layer} is causal")
    if ctx.key_valid is not None and not bool(ctx.key_valid.all()):
        from ..errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"method {method!r} got an attention mask that hides some keys (padding) in layer {ctx.layer}; "
            "it supports unmasked bidirectional attention only"
        )


def _repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _landmark_features(cfg: FNAConfig, k: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
    if cfg.features == "keys":
        b, h, n, d = k.shape
        return k.transpose(1, 2).reshape(b, n, h * d)
    if ctx.hidden is None:
        raise OptionError("features='hidden': this adapter does not expose the attention layer's input; use features='keys'")
    return ctx.hidden


def _fna_landmarks(cfg: FNAConfig, k: torch.Tensor, ctx: LayerContext) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(landmarks [B, s] or None, active [B] bool)`` for this layer; updates the per-forward state."""
    b = k.shape[0]
    st = ctx.shared("fna")
    active = st.get("active")
    if active is None or active.shape[0] != b:
        active = torch.zeros(b, dtype=torch.bool, device=k.device)
        st["active"] = active
        st["landmarks"] = torch.zeros(b, cfg.s, dtype=torch.long, device=k.device)
        st["sampled_at"] = torch.full((b,), -1, dtype=torch.long)
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
        st["landmarks"][rows] = select_landmarks(feats, cfg.s, prefix=ctx.prefix_tokens, strategy=cfg.strategy, seed=cfg.seed)
        st["sampled_at"][rows.cpu()] = ctx.layer
        active |= trigger
    return (st["landmarks"] if bool(active.any()) else None), active.clone()


def _fna_core(cfg: FNAConfig, q, k, v, ctx: LayerContext, key_keep=None, renormalize=False, mode="fna"):
    """FNA for the images whose landmarks are sampled, exact attention for the others."""
    b, h, n, _ = q.shape
    k, v = _repeat_kv(k, h), _repeat_kv(v, h)
    rec = LayerRecord(ctx.layer, mode, n, n)
    landmarks, active = _fna_landmarks(cfg, k, ctx)
    if landmarks is None:
        if key_keep is None:
            rec.mode = "dense:before_sample"
            return None, rec
        return exact_attention(q, k, v, scale=ctx.scale, key_keep=key_keep, renormalize=renormalize), rec
    kw = dict(scale=ctx.scale, pinv=cfg.pinv, rtol=cfg.rtol, iters=cfg.newton_iters, renormalize=renormalize)
    if bool(active.all()):
        out = nystrom_attention(q, k, v, landmarks, key_keep=key_keep, **kw)
    else:
        out = exact_attention(q, k, v, scale=ctx.scale, key_keep=key_keep, renormalize=renormalize)
        rows = torch.nonzero(active).flatten()
        out[rows] = nystrom_attention(
            q[rows], k[rows], v[rows], landmarks[rows], key_keep=None if key_keep is None else key_keep[rows], **kw
        )
    if ctx.record:
        s = landmarks.shape[1]
        rec.landmarks = torch.where(active[:, None], landmarks, torch.full_like(landmarks, -1)).cpu()
        full = float(n * n)
        kept = torch.where(active.cpu(), torch.full((b,), 2.0 * s * n + s * s), torch.full((b,), full)).double()
        rec.causal_pairs = torch.full((b, h), full, dtype=torch.float64)
        rec.kept_pairs = kept[:, None].expand(b, h).clone()
    return out, rec


def fna_forward(cfg: FNAConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """FNA from ``sample_layer`` on; exact attention before it and wherever ``s >= N``."""
    _require_bidirectional(ctx, "fna")
    n = q.shape[2]
    if cfg.s >= n:
        _say(ctx, f"fna: s={cfg.s} >= N={n} tokens, so Nyström attention is exact attention; running exact attention")
        return None, LayerRecord(ctx.layer, "dense:s>=N", n, n)
    return _fna_core(cfg, q, k, v, ctx)


def _say(ctx: LayerContext, message: str) -> None:
    import warnings

    if ctx.state is not None:
        said = ctx.state.shared.setdefault("_said", set())
        if message in said:
            return
        said.add(message)
    warnings.warn(f"attnpatch: {message}", UserWarning, stacklevel=4)


def _sinks(cfg: SinkMaskConfig, q, k, ctx: LayerContext) -> torch.Tensor | None:
    """``[B, N]`` bool sink tokens to mask in this layer (``None`` outside the masked layers)."""
    first = ctx.num_layers - cfg.mask_layers
    detect_at = first if cfg.detect_layer == "auto" else cfg.detect_layer
    st = ctx.shared("sink")
    if ctx.layer == detect_at or ("sinks" not in st and ctx.layer >= first):
        b, _, n, _ = q.shape
        mask = torch.zeros(b, n, dtype=torch.bool, device=q.device)
        if cfg.detect in ("norm", "both"):
            if ctx.residual is None:
                raise OptionError("detect='norm' needs the block input hidden states, which this adapter does not expose")
            mask |= massive_tokens(ctx.residual, cfg.norm_ratio)
        if cfg.detect in ("attention", "both"):
            mask |= attention_sinks(q, _repeat_kv(k, q.shape[1]), scale=ctx.scale, ratio=cfg.mass_ratio)
        if cfg.keep_cls and ctx.prefix_tokens > 0:
            mask[:, 0] = False
        st["sinks"] = mask
    if ctx.layer < first:
        return None
    return st["sinks"]


def sink_mask_forward(cfg: SinkMaskConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """Exact attention; in the last ``mask_layers`` layers the probabilities into sink tokens are zeroed."""
    _require_bidirectional(ctx, "sink_mask")
    sinks = _sinks(cfg, q, k, ctx)
    n = q.shape[2]
    if sinks is None:
        return None, LayerRecord(ctx.layer, "dense", n, n)
    h = q.shape[1]
    out = exact_attention(q, _repeat_kv(k, h), _repeat_kv(v, h), scale=ctx.scale, key_keep=~sinks, renormalize=cfg.renormalize)
    rec = LayerRecord(ctx.layer, "sink_mask", n, n)
    if ctx.record:
        rec.sinks = sinks.cpu()
    return out, rec


def fna_sink_forward(cfg: FNASinkConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """FNA in every patched layer; sink tokens masked (in Nyström form) in the last ``mask_layers`` layers."""
    _require_bidirectional(ctx, "fna+sink_mask")
    sinks = _sinks(cfg.sink, q, k, ctx)
    n = q.shape[2]
    if cfg.fna.s >= n:
        _say(ctx, f"fna: s={cfg.fna.s} >= N={n} tokens, so Nyström attention is exact attention; running exact attention")
        if sinks is None:
            return None, LayerRecord(ctx.layer, "dense:s>=N", n, n)
        return sink_mask_forward(cfg.sink, q, k, v, ctx)
    keep = None if sinks is None else ~sinks
    out, rec = _fna_core(cfg.fna, q, k, v, ctx, key_keep=keep, renormalize=cfg.sink.renormalize, mode="fna+sink_mask")
    if ctx.record and sinks is not None:
        rec.sinks = sinks.cpu()
    return out, rec


# --------------------------------------------------------------------------- registration

FNA_OPTION_HELP = {
    "s": ("int", "landmarks per image (tokens, CLS and registers included; s >= N runs exact attention)"),
    "sample_layer": ("int_or_auto", "layer where landmarks are sampled once and reused later ('auto' = first layer with a massive token, else auto_fallback)"),
    "resample": ("bool", "sample landmarks again at every patched layer"),
    "strategy": ("str", "landmark selection strategy"),
    "features": ("str", "what landmark selection runs on: the keys (heads concatenated) or the attention input hidden states"),
    "pinv": ("str", "pseudo-inverse of the s x s landmark kernel (rtol: singular values below rtol x the largest dropped, "
                    "float32 eigendecomposition of A^T A; newton: Newton-Schulz; exact: float64 SVD, unregularised)"),
    "rtol": ("float", "relative singular-value cut-off of pinv=rtol"),
    "newton_iters": ("int", "iterations of pinv=newton"),
    "massive_ratio": ("float", "massive token: block-input L2 norm above this many times the median (sample_layer=auto)"),
    "auto_fallback": ("int_or_auto", "sample_layer=auto samples here at the latest ('auto' = num_layers // 2)"),
    "seed": ("int", "seed of the random and kmeans strategies"),
}
SINK_OPTION_HELP = {
    "mask_layers": ("int", "the last m layers zero the attention into sink tokens (layers)"),
    "detect": ("str", "sink detection: by attention mass received, by massive norm, or both"),
    "detect_layer": ("int_or_auto", "layer where sinks are detected ('auto' = first masked layer)"),
    "norm_ratio": ("float", "massive token: block-input L2 norm above this many times the median"),
    "mass_ratio": ("float", "attention sink: receives more than this many times the uniform share 1/N"),
    "renormalize": ("bool", "renormalise attention rows after masking (the paper does not)"),
    "keep_cls": ("bool", "never mask the CLS token"),
}
_FNA_CHOICES = {"strategy": STRATEGIES, "features": FEATURES, "pinv": PINV_MODES}
_SINK_CHOICES = {"detect": DETECT}


def _fna_config(options: dict[str, Any]) -> FNAConfig:
    return FNAConfig(**options)


def _sink_config(options: dict[str, Any]) -> SinkMaskConfig:
    return SinkMaskConfig(**options)


_FNA_NAMES = tuple(f.name for f in fields(FNAConfig))


def _fna_sink_config(options: dict[str, Any]) -> FNASinkConfig:
    return FNASinkConfig(
        FNAConfig(**{k: v for k, v in options.items() if k in _FNA_NAMES}),
        SinkMaskConfig(**{k: v for k, v in options.items() if k not in _FNA_NAMES}),
    )


_fna_options = _options_from_dataclass(FNAConfig, FNA_OPTION_HELP, choices=_FNA_CHOICES)
_sink_options = _options_from_dataclass(SinkMaskConfig, SINK_OPTION_HELP, choices=_SINK_CHOICES)
assert not set(_fna_options) & set(_sink_options)

register_method(
    Method(
        name="fna",
        summary="Fast Nyström Attention: s landmark tokens by farthest-point sampling, sampled once and reused",
        source="FNA, arXiv 2507.16018, Sec. 3 (Eq. 3); Nyströmformer, arXiv 2102.03902, Eq. 13-16",
        options=_fna_options,
        model_kinds=frozenset({"vision"}),
        make_config=_fna_config,
        forward=fna_forward,
        check=_check_fna,
    )
)
register_method(
    Method(
        name="sink_mask",
        summary="exact attention with the attention into detected sink tokens zeroed in the last layers",
        source="FNA, arXiv 2507.16018, Sec. 4 (sink masking); attention sinks: Xiao et al. 2024; massive activations: Sun et al. 2024",
        options=_sink_options,
        model_kinds=frozenset({"vision"}),
        make_config=_sink_config,
        forward=sink_mask_forward,
        check=_check_sink,
    )
)
register_method(
    Method(
        name="fna+sink_mask",
        summary="fna in every patched layer, with sink tokens masked (in Nyström form) in the last layers",
        source="FNA, arXiv 2507.16018, Sec. 3-4",
        options={**_fna_options, **_sink_options},
        model_kinds=frozenset({"vision"}),
        make_config=_fna_sink_config,
        forward=fna_sink_forward,
        check=_check_fna_sink,
    )
)

