"""``nystromformer``: Nyströmformer attention for ViTs (the math: :mod:`attnpatch.attention.nystrom.nystromformer`).

Landmarks are segment means of each layer's own queries and keys, recomputed in every layer (no
state across layers); the CLS and register tokens are landmarks of their own.  ``s >= N`` runs exact
attention here, in this file, and records ``"dense:s>=N"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...attention.exact import exact_attention, repeat_kv
from ...attention.nystrom.nystromformer import nystromformer_attention
from ...errors import OptionError
from ...options import check_fields, opt, options_of
from ..contract import ExactLimit, Knob, Method
from ..registry import register_method
from ..state import LayerContext, LayerRecord

__all__ = ["NystromformerConfig", "nystromformer_forward", "NYSTROMFORMER"]


@dataclass(frozen=True)
class NystromformerConfig:
    """Options of Nyströmformer attention (arXiv 2102.03902, Sec. 3).

    Attributes:
        s: landmarks per image, CLS and register tokens included (each is a landmark of its own;
            the other tokens are split into ``s - prefix`` contiguous segments whose means are the
            remaining landmarks).  ``s`` must exceed the number of prefix tokens.  When ``s >= N``
            the layer runs exact attention (segment means of one token each would make Nyström
            exact only with an exact pseudo-inverse, which the iteration is not) and says so once
            per forward.
        pinv_iters: iterations of the paper's iterative pseudo-inverse of the ``s x s`` landmark
            kernel (Eq. 16; the paper uses 6).
    """

    s: int = field(default=64, metadata=opt(
        "int", "landmarks per image (segment means; CLS and registers are landmarks of their own; s >= N runs exact "
        "attention)", low=1, rule="the number of landmarks must be an integer >= 1 (tokens)"))
    pinv_iters: int = field(default=6, metadata=opt(
        "int", "iterations of the iterative pseudo-inverse of the s x s landmark kernel (Nyströmformer Eq. 16)", low=1,
        rule="must be an integer >= 1"))

    def __post_init__(self) -> None:
        check_fields(self)


def nystromformer_forward(cfg: NystromformerConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """Nyströmformer attention for one bidirectional layer; exact attention (computed here) where ``s >= N``.

    Raises:
        OptionError: ``s`` not above the prefix tokens (CLS + registers) while below ``N``.
    """
    b, h, n, _ = q.shape
    if cfg.s >= n:
        ctx.say(f"nystromformer: s={cfg.s} >= N={n} tokens; running exact attention")
        out = exact_attention(q, repeat_kv(k, h), repeat_kv(v, h), scale=ctx.scale)
        return out, LayerRecord(ctx.layer, "dense:s>=N", n, n)
    p = ctx.prefix_tokens
    if cfg.s <= p:
        raise OptionError(
            f"s={cfg.s}: this model has {p} prefix tokens (CLS and registers), each a landmark of its own; "
            f"s must exceed {p} so that at least one landmark averages the patch tokens"
        )
    out = nystromformer_attention(q, k, v, cfg.s, scale=ctx.scale, prefix=p, pinv_iters=cfg.pinv_iters)
    rec = LayerRecord(ctx.layer, "nystromformer", n, n)
    if ctx.record:
        rec.causal_pairs = torch.full((b, h), float(n * n), dtype=torch.float64)
        rec.kept_pairs = torch.full((b, h), 2.0 * cfg.s * n + cfg.s * cfg.s, dtype=torch.float64)
    return out, rec


def _config(options: dict[str, Any]) -> NystromformerConfig:
    return NystromformerConfig(**options)


def _every_token(tokens: int) -> dict[str, Any]:
    return {"s": max(1, int(tokens))}


def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"s": max(1, round(n ** t))}


NYSTROMFORMER = register_method(
    Method(
        name="nystromformer",
        summary="Nyströmformer: s segment-mean landmarks per layer, iterative pseudo-inverse of the landmark kernel",
        source="Nyströmformer, arXiv 2102.03902, Sec. 3 (Eq. 13-16)",
        options=options_of(NystromformerConfig),
        model_kinds=frozenset({"vision"}),
        make_config=_config,
        forward=nystromformer_forward,
        causal_calls=False,
        noncausal_calls=True,
        key_padding=False,
        supports=frozenset({"packed_sequences"}),  # stateless per call: each packed image is a call of its own
        token_roles=frozenset({"prefix"}),
        exact_limit_decl=ExactLimit(_every_token, at_least=("s",), text="s >= N"),
        knob=Knob("s, 1 to N landmarks (log scale)", _knob, tokens="s"),
        small_settings={"vision": dict(s=8)},
        details=(
            "Nyströmformer: landmarks are the means of `s` contiguous segments of each layer's queries and keys (CLS and "
            "registers landmarks of their own), recomputed in every layer; `softmax(QK̃ᵀ)·Z·softmax(Q̃Kᵀ)·V` with `Z` "
            "`pinv_iters` steps of the paper's iterative pseudo-inverse of `softmax(Q̃K̃ᵀ)`, evaluated right to left, "
            "never forming an N×N matrix. `s ≥ N` runs exact attention and says so."
        ),
    )
)
