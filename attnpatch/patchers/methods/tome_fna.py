"""``tome+fna``: ToMe token merging, then Fast Nyström Attention on the merged tokens of the blocks still long enough.

Each routed block runs ToMe's proportional attention (``softmax(Q K^T c + log(size))``, arXiv 2210.09461 Eq. 1) and
merges ``r`` tokens between its attention and MLP branches (:mod:`.tome`).  Where the block's *current* token count is
at least FNA's ``min_tokens`` (the device's break-even by default) and above its ``s``, the proportional attention is
approximated in Nyström form with the size bias in every factor
(:func:`~attnpatch.attention.nystrom.fna.nystrom_attention`'s ``key_bias``: exact with every token a landmark).

Landmarks: FNA samples them once (at ``sample_layer``) and reuses them, but ToMe renumbers the tokens in every block.
By default the landmark indices are **mapped through each merge's source map**: a landmark that is merged away is
replaced by the token it joined, so the landmarks stay the tokens FPS chose (or what they became).  Two landmarks can
join one token; the landmark kernel then repeats a row and a column, which the regularised pseudo-inverse absorbs (its
rank drops; the Nyström estimate is that of the distinct landmarks up to the factors' row normalisation).
``resample=True`` samples them again in every approximated block on its own merged tokens instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from ...attention.exact import repeat_kv
from ...attention.merge import proportional_attention
from ...errors import OptionError
from ..contract import ExactLimit, Knob, Method, ModelGeometry
from ..registry import register_method
from ..state import LayerContext, LayerRecord
from .fna import FNA, FNAConfig, check_fna, exact_reason, fna_core, prepare_fna
from .tome import TOME, ToMeConfig, check_tome, current_sizes, tome_block, tome_mode

__all__ = ["TOME_FNA", "ToMeFNAConfig", "tome_fna_forward", "tome_fna_block"]

_TOME_NAMES = tuple(f.name for f in fields(ToMeConfig))


@dataclass(frozen=True)
class ToMeFNAConfig:
    """``tome+fna``: ToMe's options (``r``, ``proportional``) and FNA's (``s``, ``sample_layer``, ``min_tokens``, ...)."""

    tome: ToMeConfig
    fna: FNAConfig


def _config(options: dict[str, Any]) -> ToMeFNAConfig:
    if options.get("local_window", 0):
        raise OptionError(
            f"local_window={options['local_window']}: tome+fna does not implement FNA's local window (merged tokens "
            "have no patch grid); use local_window=0")
    return ToMeFNAConfig(
        ToMeConfig(**{k: v for k, v in options.items() if k in _TOME_NAMES}),
        FNAConfig(**{k: v for k, v in options.items() if k not in _TOME_NAMES}),
    )


def _check(cfg: ToMeFNAConfig, geo: ModelGeometry) -> None:
    check_tome(cfg.tome, geo)
    check_fna(cfg.fna, geo)


def tome_fna_forward(cfg: ToMeFNAConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """One block's attention: FNA with the ``log(size)`` key bias where the block's tokens still exceed FNA's limits
    (recorded ``"tome+fna"``), ToMe's exact proportional attention elsewhere (recorded as ``tome`` records it);
    keeps the block's merge metric for :func:`tome_fna_block`."""
    b, h, n, _ = q.shape
    size = current_sizes(cfg.tome, k, ctx)
    out = None
    # once tokens are merged, blocks falling below s is what merging does: said only before any merge
    if exact_reason(cfg.fna, q, k, ctx, say=size is None, name="tome+fna") is None:
        bias = None if size is None or not cfg.tome.proportional else size.float().log().to(q.dtype)
        out, rec = fna_core(cfg.fna, q, k, v, ctx, mode="tome+fna", key_bias=bias)
    if out is None:
        out = proportional_attention(q, repeat_kv(k, h), repeat_kv(v, h), size if cfg.tome.proportional else None,
                                     scale=ctx.scale)
        rec = LayerRecord(ctx.layer, tome_mode(cfg.tome, size, ctx), n, n)
        if ctx.record:
            rec.kept_pairs = torch.full((b, h), float(n * n), dtype=torch.float64)
    if ctx.record:
        n0 = int(ctx.shared("tome")["n0"])
        rec.causal_pairs = torch.full((b, h), float(n0 * n0), dtype=torch.float64)
    return out, rec


def tome_fna_block(cfg: ToMeFNAConfig, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
    """ToMe's block hook (:func:`~.tome.tome_block`), then FNA's landmark indices mapped through this block's merge:
    each landmark becomes the index of the token it is now part of."""
    x = tome_block(cfg.tome, x, ctx)
    dest = ctx.shared("tome").get("dest")
    st = ctx.shared("fna")
    landmarks = st.get("landmarks")
    if dest is not None and landmarks is not None and landmarks.shape[0] == dest.shape[0]:
        st["landmarks"] = dest.gather(1, landmarks)
    return x


def _exact(tokens: int) -> dict[str, Any]:
    return {**TOME.exact_limit(tokens), **FNA.exact_limit(tokens)}


def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens: ToMe's ``r`` (see
    :class:`~attnpatch.patchers.contract.Knob`); FNA's options stay as given."""
    return TOME.knob.options(t, n)


assert not set(TOME.options) & set(FNA.options)

TOME_FNA = register_method(
    Method(
        name="tome+fna",
        summary="ToMe token merging, then FNA's Nyström attention (with the log-size bias) on blocks still long enough",
        source="ToMe, arXiv 2210.09461, Sec. 3 (Eq. 1); FNA, arXiv 2507.16018, Sec. 3 (Eq. 3)",
        options={**TOME.options, **FNA.options},
        model_kinds=frozenset({"vision"}),
        make_config=_config,
        forward=tome_fna_forward,
        block_hook=tome_fna_block,
        check=_check,
        prepare=lambda cfg, geo, device, dtype: prepare_fna(cfg.fna, geo, device, dtype),
        causal_calls=False,
        noncausal_calls=True,
        key_padding=False,
        token_roles=TOME.token_roles | FNA.token_roles,
        exact_limit_decl=ExactLimit(_exact, at_least=("s",), text="r = 0 and s >= N",
                                    everywhere={"r": 0, "min_tokens": 2**31 - 1}),
        token_map=True,
        knob=Knob("r, N/8 down to 0 tokens per block (FNA's options as given)", _knob),
        small_settings={"vision": dict(r=2, s=6, sample_layer=0, min_tokens=0)},
        details=(
            "ToMe merges `r` tokens per block (per-block schedules allowed) with proportional attention; in the blocks "
            "whose current token count is at least `min_tokens` and above `s`, that attention runs as FNA with "
            "`log(size)` added to each key's logit in all three Nyström factors (exact with every token a landmark). "
            "FNA's landmarks, sampled once, follow the merges through ToMe's source map (`resample=True`: sampled "
            "again on each block's merged tokens). `attnpatch.token_source(model)` maps every input patch to its "
            "output token, as for `tome`."
        ),
    )
)
