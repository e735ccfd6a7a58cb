"""``relu_linear``: L2ViT's ReLU-kernel linear attention for ViTs, merged with exact softmax over the CLS/register
tokens and a local window (the math: :mod:`attnpatch.attention.linear`).

Applied in the chosen layers (``layers``; by default the later half of the model); the other layers run the
model's exact attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...attention.linear import exact_pairs, relu_linear_attention
from ...errors import OptionError
from ...options import check_fields, opt, options_of
from ..contract import ExactLimit, Knob, Method, ModelGeometry
from ..registry import register_method
from ..state import LayerContext, LayerRecord

__all__ = ["RELU_LINEAR", "ReluLinearConfig", "relu_linear_forward", "linear_layers"]


@dataclass(frozen=True)
class ReluLinearConfig:
    """Options of ReLU-kernel linear attention (L2ViT, arXiv 2501.16182, Sec. 3, linear global attention).

    Attributes:
        layers: attention-layer indices (0-based) that run linear attention; ``None`` (the default) = the
            later half, layers ``num_layers // 2`` to the last.  The others run exact attention.
        local_window: patch tokens per local window (tokens, 1-D in token order, non-overlapping; 0 = none):
            each patch query attends by exact softmax to its window and to the CLS/register tokens, and through
            the ReLU kernel to the other keys; the two parts are merged through their normalisers
            (:mod:`attnpatch.attention.linear`).  At least ``N - prefix`` (so any ``local_window >= N``):
            exact softmax attention.
        eps: the denominator's ``eps`` (units of kernel scores ``ReLU(c q) . ReLU(k)``); also the weight the
            exact local part keeps in a row whose kernel scores are all 0.
    """

    layers: tuple[int, ...] | None = field(default=None, metadata=opt(
        "int_list", "layer indices that run linear attention (None = the later half, num_layers // 2 on)",
        nullable=True, low=0, rule="must be None or a list of layer indices >= 0", model_scope="act across layers"))
    local_window: int = field(default=64, metadata=opt(
        "int", "patch tokens per exact local window (tokens, 1-D, non-overlapping; 0 = none; >= N = exact)", low=0,
        rule="must be an integer >= 0 (tokens)"))
    eps: float = field(default=1e-6, metadata=opt(
        "float", "eps of the linear attention's denominator", low=0.0, low_open=True, finite=True,
        rule="must be a finite number > 0"))

    def __post_init__(self) -> None:
        check_fields(self)


def linear_layers(cfg: ReluLinearConfig, num_layers: int) -> frozenset[int]:
    """The layer indices that run linear attention in a model of ``num_layers`` attention layers."""
    if cfg.layers is None:
        return frozenset(range(num_layers // 2, num_layers))
    return frozenset(cfg.layers)


def _check(cfg: ReluLinearConfig, geo: ModelGeometry) -> None:
    """``layers`` must name layers the model has.

    Raises:
        OptionError: a layer index out of range.
    """
    for li in cfg.layers or ():
        if not 0 <= li < geo.num_layers:
            raise OptionError(f"layers contains {li}: the model has {geo.num_layers} attention layers (0..{geo.num_layers - 1})")


def relu_linear_forward(
    cfg: ReluLinearConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext
) -> tuple[torch.Tensor | None, LayerRecord]:
    """Linear attention (with the exact prefix and local parts) in the chosen layers; exact attention elsewhere."""
    n = q.shape[2]
    if ctx.layer not in linear_layers(cfg, ctx.num_layers):
        return None, LayerRecord(ctx.layer, "dense:layer", n, n)
    out = relu_linear_attention(q, k, v, scale=ctx.scale, local_window=cfg.local_window, prefix=ctx.prefix_tokens, eps=cfg.eps)
    rec = LayerRecord(ctx.layer, "relu_linear", n, n)
    if ctx.record:  # "kept" = pairs computed by exact softmax
        b, h = q.shape[:2]
        rec.causal_pairs = torch.full((b, h), float(n * n), dtype=torch.float64)
        rec.kept_pairs = torch.full((b, h), float(exact_pairs(n, cfg.local_window, ctx.prefix_tokens)), dtype=torch.float64)
    return out, rec


def _config(options: dict[str, Any]) -> ReluLinearConfig:
    return ReluLinearConfig(**options)


def _every_key_local(tokens: int) -> dict[str, Any]:
    # a window covering every patch token: every key local, exact softmax computed by the method's local path
    return {"local_window": max(1, int(tokens))}


def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"local_window": round(t * n)}


RELU_LINEAR = register_method(
    Method(
        name="relu_linear",
        summary="ReLU-kernel linear attention (L2ViT's LGA), merged with exact softmax over CLS/registers and a local window",
        source="L2ViT, arXiv 2501.16182, Sec. 3 (linear global attention)",
        options=options_of(ReluLinearConfig),
        model_kinds=frozenset({"vision"}),
        make_config=_config,
        forward=relu_linear_forward,
        check=_check,
        causal_calls=False,
        noncausal_calls=True,
        key_padding=False,
        supports=frozenset({"value_head_dim", "packed_sequences"}),  # stateless per call
        token_roles=frozenset({"prefix"}),
        exact_limit_decl=ExactLimit(_every_key_local, at_least=("local_window",), text="local_window >= N"),
        knob=Knob("local_window, 0 to N tokens", _knob),
        small_settings={"vision": dict(local_window=4)},
        details=(
            "L2ViT's linear global attention with φ = ReLU: `φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1) + eps)`, O(N·D²), in `layers` "
            "(default: the later half). Training-free stand-in: CLS/register tokens attend and are attended by exact "
            "softmax; patch tokens in consecutive 1-D windows of `local_window` tokens attend to their window exactly; "
            "local exp-scores and far kernel scores are merged through their normalisers, the kernel calibrated to the "
            "exp-scores' total on the local keys. `local_window ≥ N` is exact softmax attention."
        ),
    )
)
