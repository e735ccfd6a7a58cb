"""``sink_mask``: exact attention with the attention into sink tokens zeroed in the last layers (FNA, arXiv 2507.16018, Sec. 4).

Sink tokens are detected once per forward call (at ``detect_layer``) and kept in the
per-forward :class:`~attnpatch.patchers.state.ForwardState`, so every masked layer masks the
same tokens.  The detection itself lives in :mod:`attnpatch.attention.sinks`; measurements of
the defaults are in docs/benchmarks/vision.md and docs/methods.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...attention.exact import exact_attention, repeat_kv
from ...attention.sinks import attention_sinks, massive_tokens
from ...errors import OptionError
from ...options import check_fields, opt, options_of
from ..contract import ExactLimit, Method, ModelGeometry
from ..registry import register_method
from ..state import LayerContext, LayerRecord

__all__ = ["SINK_MASK", "SinkMaskConfig", "DETECT", "sink_mask_forward", "sinks_of", "check_sink", "NO_SINKS"]

DETECT = ("attention", "norm", "both")
_ACROSS = "act across layers"
_RATIO_RULE = "must be a finite number > 1"


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
            the softmax output by the mask, which is the default).
        keep_cls: never mask the first (CLS) token.

    The defaults (mask the last layer only, no renormalisation) were chosen by measurement on
    ``dinov2-small``; the numbers are in docs/benchmarks/vision.md and docs/methods.md.
    """

    mask_layers: int = field(default=1, metadata=opt(
        "int", "the last m layers zero the attention into sink tokens (layers)", low=1,
        rule="must be an integer >= 1 (layers)", model_scope=_ACROSS))
    detect: str = field(default="both", metadata=opt(
        "str", "sink detection: by attention mass received, by massive norm, or both", choices=DETECT))
    detect_layer: int | str = field(default="auto", metadata=opt(
        "int_or_auto", "layer where sinks are detected ('auto' = first masked layer)", low=0,
        rule="must be 'auto' or a layer index >= 0", model_scope=_ACROSS))
    norm_ratio: float = field(default=5.0, metadata=opt(
        "float", "massive token: block-input L2 norm above this many times the median", low=1.0, low_open=True,
        finite=True, rule=_RATIO_RULE))
    mass_ratio: float = field(default=10.0, metadata=opt(
        "float", "attention sink: receives more than this many times the uniform share 1/N", low=1.0, low_open=True,
        finite=True, rule=_RATIO_RULE))
    renormalize: bool = field(default=False, metadata=opt("bool", "renormalise attention rows after masking (the paper does not)"))
    keep_cls: bool = field(default=False, metadata=opt("bool", "never mask the CLS token"))

    def __post_init__(self) -> None:
        check_fields(self)


def check_sink(cfg: SinkMaskConfig, geo: ModelGeometry) -> None:
    """``mask_layers`` at most the depth; ``detect_layer`` a layer at or before the first masked one.

    Raises:
        OptionError: out of range for this model.
    """
    num_layers = geo.num_layers
    if cfg.mask_layers > num_layers:
        raise OptionError(f"mask_layers={cfg.mask_layers}: the model has {num_layers} attention layers")
    if cfg.detect_layer != "auto":
        first = num_layers - cfg.mask_layers
        if cfg.detect_layer >= num_layers or cfg.detect_layer > first:
            raise OptionError(
                f"detect_layer={cfg.detect_layer}: must be at or before the first masked layer {first} "
                f"(the model has {num_layers} layers, mask_layers={cfg.mask_layers})"
            )


def sinks_of(cfg: SinkMaskConfig, q, k, ctx: LayerContext) -> torch.Tensor | None:
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
            mask |= attention_sinks(q, repeat_kv(k, q.shape[1]), scale=ctx.scale, ratio=cfg.mass_ratio)
        if cfg.keep_cls and ctx.prefix_tokens > 0:
            mask[:, 0] = False
        st["sinks"] = mask
    if ctx.layer < first:
        return None
    return st["sinks"]


def sink_mask_forward(cfg: SinkMaskConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """Exact attention; in the last ``mask_layers`` layers the probabilities into sink tokens are zeroed.

    Hands the call back (``None``: the model's own attention) outside the masked layers (mode ``"dense"``) and in a
    masked layer where no image of the batch has a sink (mode ``"dense:no-sinks"``: nothing to mask)."""
    sinks = sinks_of(cfg, q, k, ctx)
    n = q.shape[2]
    if sinks is None:
        return None, LayerRecord(ctx.layer, "dense", n, n)
    if not bool(sinks.any()):
        rec = LayerRecord(ctx.layer, "dense:no-sinks", n, n)
        if ctx.record:
            rec.sinks = sinks.cpu()
        return None, rec
    h = q.shape[1]
    out = exact_attention(q, repeat_kv(k, h), repeat_kv(v, h), scale=ctx.scale, key_keep=~sinks, renormalize=cfg.renormalize)
    rec = LayerRecord(ctx.layer, "sink_mask", n, n)
    if ctx.record:
        rec.sinks = sinks.cpu()
    return out, rec


def _config(options: dict[str, Any]) -> SinkMaskConfig:
    return SinkMaskConfig(**options)


def _no_sinks(tokens: int) -> dict[str, Any]:
    # a key receives at most all of the attention (mean mass 1 = N x the uniform share), so no key
    # receives more than 2N x the uniform share: nothing is detected, nothing masked
    return {"detect": "attention", "mass_ratio": 2.0 * max(1, int(tokens))}


#: The exact limit of sink masking: no sink can be detected (every layer then hands its call back: the model's own
#: attention, bit for bit).
NO_SINKS = ExactLimit(_no_sinks, at_least=("mass_ratio",), text="detect='attention' and mass_ratio >= 2N (no sink can be detected)")

SINK_MASK = register_method(
    Method(
        name="sink_mask",
        summary="exact attention with the attention into detected sink tokens zeroed in the last layers",
        source="FNA, arXiv 2507.16018, Sec. 4 (sink masking); attention sinks: Xiao et al. 2024; massive activations: Sun et al. 2024",
        options=options_of(SinkMaskConfig),
        model_kinds=frozenset({"vision"}),
        make_config=_config,
        forward=sink_mask_forward,
        check=check_sink,
        causal_calls=False,
        noncausal_calls=True,
        key_padding=False,
        token_roles=frozenset({"prefix", "residual"}),
        exact_limit_decl=NO_SINKS,
        # a tiny random ViT has no sink (its attention is near uniform): a norm 1 % above the median marks about half
        # of its tokens, so the masked layers mask something
        small_settings={"vision": dict(mask_layers=2, detect="both", norm_ratio=1.01, mass_ratio=1.5)},
        details=(
            "Exact attention, with the attention probabilities into sink tokens (massive-norm tokens and/or tokens "
            "receiving far more than the uniform share of attention) set to zero in the last `mask_layers` layers."
        ),
    )
)
