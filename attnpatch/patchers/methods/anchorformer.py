"""``anchorformer``: AnchorFormer's bipartite token-anchor attention, training-free, for ViTs
(the math: :mod:`attnpatch.attention.anchorformer`).

Anchors are ``m`` tokens chosen in every layer from that layer's keys (heads concatenated) by a
landmark strategy (FNA's :func:`~attnpatch.attention.landmarks.select_landmarks`; CLS and registers
always anchors); no state across layers.  ``m >= N`` runs exact attention here, in this file, and
records ``"dense:m>=N"``: the bipartite product itself is not exact for any ``m``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...attention.anchorformer import anchor_bipartite_attention
from ...attention.exact import exact_attention, repeat_kv
from ...attention.landmarks import STRATEGIES, select_landmarks
from ...errors import OptionError
from ...options import check_fields, opt, options_of
from ..contract import ExactLimit, Knob, Method
from ..registry import register_method
from ..state import LayerContext, LayerRecord

__all__ = ["AnchorFormerConfig", "anchorformer_forward", "ANCHORFORMER"]


@dataclass(frozen=True)
class AnchorFormerConfig:
    """Options of training-free AnchorFormer attention (arXiv 2505.16463, Sec. 3).

    Attributes:
        m: anchors per image (tokens), CLS and register tokens included; ``m`` must exceed the
            number of prefix tokens.  When ``m >= N`` the layer runs exact attention (the
            bipartite product is not exact for any ``m``) and says so once per forward.
        strategy: how the anchors are chosen from the layer's keys (heads concatenated):
            ``"fps"`` farthest-point sampling, ``"random"`` (seeded, the same for every image),
            ``"strided"`` (evenly spaced), ``"kmeans"`` (faiss; nearest token to each centroid).
        seed: seed of the ``random`` and ``kmeans`` strategies.
    """

    m: int = field(default=64, metadata=opt(
        "int", "anchors per image (tokens, CLS and registers included; m >= N runs exact attention)", low=1,
        rule="the number of anchors must be an integer >= 1 (tokens)"))
    strategy: str = field(default="fps", metadata=opt(
        "str", "anchor selection on the layer's keys (heads concatenated)", choices=STRATEGIES))
    seed: int = field(default=0, metadata=opt("int", "seed of the random and kmeans strategies", low=0, high=2**63 - 1))

    def __post_init__(self) -> None:
        check_fields(self)


def anchorformer_forward(cfg: AnchorFormerConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """Bipartite token-anchor attention for one bidirectional layer; exact attention (computed here) where ``m >= N``.

    Raises:
        OptionError: ``m`` not above the prefix tokens (CLS + registers) while below ``N``.
    """
    b, h, n, d = q.shape
    if cfg.m >= n:
        ctx.say(f"anchorformer: m={cfg.m} >= N={n} tokens; running exact attention")
        out = exact_attention(q, repeat_kv(k, h), repeat_kv(v, h), scale=ctx.scale)
        return out, LayerRecord(ctx.layer, "dense:m>=N", n, n)
    p = ctx.prefix_tokens
    if cfg.m <= p:
        raise OptionError(
            f"m={cfg.m}: this model has {p} prefix tokens (CLS and registers), which are always anchors; "
            f"m must exceed {p}"
        )
    feats = k.transpose(1, 2).reshape(b, n, -1)  # [B, N, Hkv * D]
    anchors = select_landmarks(feats, cfg.m, prefix=p, strategy=cfg.strategy, seed=cfg.seed)
    out = anchor_bipartite_attention(q, k, v, anchors, scale=ctx.scale)
    rec = LayerRecord(ctx.layer, "anchorformer", n, n)
    if ctx.record:
        rec.landmarks = anchors.cpu()
        rec.causal_pairs = torch.full((b, h), float(n * n), dtype=torch.float64)
        rec.kept_pairs = torch.full((b, h), 2.0 * cfg.m * n, dtype=torch.float64)
    return out, rec


def _config(options: dict[str, Any]) -> AnchorFormerConfig:
    return AnchorFormerConfig(**options)


def _every_token(tokens: int) -> dict[str, Any]:
    return {"m": max(1, int(tokens))}


def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"m": max(1, round(n ** t))}


ANCHORFORMER = register_method(
    Method(
        name="anchorformer",
        summary=("AnchorFormer: bipartite token-anchor attention through m anchor tokens, a diagonal normaliser "
                 "instead of a pseudo-inverse"),
        source="AnchorFormer, arXiv 2505.16463, Sec. 3 (bipartite attention, Markov process)",
        options=options_of(AnchorFormerConfig),
        model_kinds=frozenset({"vision"}),
        make_config=_config,
        forward=anchorformer_forward,
        causal_calls=False,
        noncausal_calls=True,
        key_padding=False,
        supports=frozenset({"packed_sequences"}),  # stateless per call: each packed image is a call of its own
        token_roles=frozenset({"prefix"}),
        exact_limit_decl=ExactLimit(
            _every_token, at_least=("m",),
            text="m >= N, where it runs exact attention instead: the bipartite product is exact for no m, and its "
                 "error does not shrink towards 0 as m grows",
        ),
        knob=Knob("m, 1 to N anchors (log scale)", _knob, tokens="m"),
        small_settings={"vision": dict(m=8)},
        details=(
            "AnchorFormer, training-free: `m` anchor tokens (CLS and registers always among them) chosen in every layer "
            "by farthest-point sampling on the keys; attention as a two-step Markov chain token → anchor → token, "
            "`A_q·Δ⁻¹·A_kᵀ·V` with `A_q = softmax(Q K_aᵀ)`, `A_k = softmax(K Q_aᵀ)` (both over the anchors) and "
            "`Δ = diag(A_kᵀ1)`: row-stochastic, no pseudo-inverse, never an N×N matrix. Not exact for any `m`; "
            "`m ≥ N` runs exact attention and says so."
        ),
    )
)
