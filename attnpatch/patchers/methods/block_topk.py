"""``block_topk``: XAttention block-sparse prefill for causal LMs (the math: :mod:`attnpatch.attention.sparse.block_topk`).

Each query block keeps the key blocks that carry a ``threshold`` share of its estimated attention mass
(strided antidiagonal scores), always the first and the diagonal block, and attends to them exactly.
Decoding steps and prompts shorter than ``min_len`` run the model's exact attention.

Chunked prefill: a prompt fed in pieces on a KV cache is one call per piece (``q_offset = `` the cache length).
``min_len`` is compared with the prompt's length so far, ``q_offset + Lq`` (the absolute position after the
call's last query), not with the piece's length: a piece runs sparse exactly when a one-call prefill of the
prompt up to the piece's end would.  Each piece's query blocks start at its first query and its cached keys are
split into blocks ending there (:func:`~attnpatch.attention.sparse.block_topk.block_geometry`), so with pieces of a
multiple of ``block_size`` tokens the query blocks are those of the one-call prefill.

``kernel`` (:data:`KERNEL_CHOICES`): the kept blocks run either as AnchorAttention's
stripe attention (the gather path: the compiled CPU kernel for float32 where it builds) or as a FlexAttention
``BlockMask`` (:mod:`attnpatch.attention.sparse.masks`); ``"auto"`` picks flex on CUDA and the gather path on the
CPU unless :data:`attnpatch.attention.backends.dispatch.CPU_FLEX_MIN_KEYS` (``"block_topk"``) says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...attention.sparse.block_topk import block_topk_attention, block_topk_keep
from ...errors import OptionError
from ...options import check_fields, opt, options_of
from ..bench_hook import BenchCase, BenchInputs
from ..contract import ExactLimit, Knob, Method
from ..registry import register_method
from ..state import LayerContext, LayerRecord

#: The ``kernel`` option's values: the FlexAttention pattern or the gather path (operation "block_topk" of
#: :func:`attnpatch.attention.backends.dispatch.choose`; its "compiled" and "torch" stay with the math function).
KERNEL_CHOICES = ("auto", "flex", "gather")

__all__ = ["BLOCK_TOPK", "BlockTopkConfig", "block_topk_forward", "block_topk_bench"]


@dataclass(frozen=True)
class BlockTopkConfig:
    """Options of XAttention block-sparse prefill (arXiv 2503.16428, Sec. 2).

    Attributes:
        block_size: tokens per query block and per key block (the paper's 128 on its GPUs).
        stride: antidiagonal stride ``S``: each ``S x S`` tile of a block's logits is represented by the mean
            of its antidiagonal (the paper's 8 for its long-context LLM benchmarks; 16 costs half the scoring);
            must divide ``block_size``.
        threshold: share of each query block's estimated attention mass its kept key blocks must cover
            (the paper's 0.9; 1 keeps every causal block: exact attention through the sparse code path).
        min_len: calls whose last query sits before absolute position ``min_len - 1`` (``q_offset + Lq < min_len``:
            the prompt so far is shorter) run the model's exact attention.
        kernel: ``"auto"``, ``"flex"`` or ``"gather"`` (the module docstring); the same kept blocks either way.

    Which outputs depend on which tokens: a query block's kept blocks are chosen from all of its queries,
    so the output at position ``i`` depends on the tokens up to the end of ``i``'s block (never later);
    ``min_len`` depends on the prompt's length up to the call's last query.  A left-padded sequence is computed as
    if alone; a prompt continued on a cache is its own call (blocks counted from its first query).
    """

    block_size: int = field(default=128, metadata=opt(
        "int", "tokens per query block and key block (a multiple of stride)", low=1, rule="must be an integer >= 1 (tokens)"))
    stride: int = field(default=8, metadata=opt(
        "int", "antidiagonal stride of the block scores (tokens; divides block_size)", low=1,
        rule="must be an integer >= 1 (tokens)"))
    threshold: float = field(default=0.9, metadata=opt(
        "float", "share of each query block's estimated attention mass the kept key blocks cover (1 = every causal "
        "block, exact)", low=0.0, high=1.0, rule="must be a number in [0, 1]"))
    min_len: int = field(default=1024, metadata=opt(
        "int", "prompts shorter than this run exact attention (tokens; a call on a cache counts the cached tokens too)",
        low=0, rule="must be an integer >= 0 (tokens)"))
    kernel: str = field(default="auto", metadata=opt(
        "str", "how the kept blocks are attended: flex = a FlexAttention BlockMask (compiled per length bucket), gather "
        "= the stripe attention; auto = flex on CUDA, the measured faster one on the CPU", choices=KERNEL_CHOICES))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.block_size % self.stride:
            raise OptionError(f"stride={self.stride} does not divide block_size={self.block_size}")


def block_topk_forward(
    cfg: BlockTopkConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext
) -> tuple[torch.Tensor | None, LayerRecord]:
    """Block-sparse prefill; exact attention for decoding steps and prompts shorter than ``min_len``."""
    layer = ctx.layer
    lq, lk = q.shape[2], k.shape[2]
    if lq == 1:
        return None, LayerRecord(layer, "dense:decode", lq, lk)
    if ctx.q_offset + lq < cfg.min_len:  # the prompt so far, cached tokens included (chunked prefill)
        return None, LayerRecord(layer, "dense:short", lq, lk)
    recall = bool(ctx.state is not None and ctx.state.recall)
    out, st = block_topk_attention(
        q, k, v, scale=ctx.scale, block_size=cfg.block_size, stride=cfg.stride, threshold=cfg.threshold,
        q_offset=ctx.q_offset, key_valid=ctx.key_valid, return_stats=ctx.record, compute_recall=recall,
        kernel=cfg.kernel,
    )
    rec = LayerRecord(layer, "sparse", lq, lk)
    if st is not None:
        rec.causal_pairs = st.causal_pairs.cpu()
        rec.kept_pairs = st.kept_pairs.cpu()
        rec.kept_columns = st.kept_blocks.cpu()
        rec.recall = None if st.recall is None else st.recall.cpu()
    return out, rec


def block_topk_bench(cfg: BlockTopkConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: BenchInputs) -> BenchCase:
    """One causal layer: the whole call timed; the block scoring and selection alone as ``select_seconds``
    (``None`` where the layer runs dense, ``N < min_len``); sparsity and recall measured outside the timed calls."""
    n, scale = q.shape[2], inputs.scale
    kw = dict(scale=scale, block_size=cfg.block_size, stride=cfg.stride, threshold=cfg.threshold)

    def call():
        return block_topk_attention(q, k, v, kernel=cfg.kernel, **kw)[0]

    def select():
        return block_topk_keep(q, k, **kw)

    def stats() -> dict[str, Any]:
        _, st = block_topk_attention(q, k, v, **kw, return_stats=True, compute_recall=True)
        return {
            "sparsity": float(1.0 - st.kept_pairs.sum() / st.causal_pairs.sum().clamp(min=1)),
            "recall": float(st.recall.mean()),
            "recall_min_head": float(st.recall.min()),
        }

    if n < cfg.min_len:
        return BenchCase(call=call, extra=lambda t, ref: {"select_seconds": None}, stats=stats, note="ran dense: N < min_len")
    return BenchCase(call=call, parts={"select": select}, stats=stats)


def _config(options: dict[str, Any]) -> BlockTopkConfig:
    return BlockTopkConfig(**options)


def _every_block(tokens: int) -> dict[str, Any]:
    # threshold = 1 keeps every causal key block: exact attention, computed by the block-sparse kernel
    return {"threshold": 1.0}


def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"threshold": t}


BLOCK_TOPK = register_method(
    Method(
        name="block_topk",
        summary="XAttention block-sparse prefill: antidiagonal block scores, key blocks kept up to a cumulative mass; decoding dense",
        source="XAttention, Xu et al., arXiv 2503.16428, Sec. 2",
        options=options_of(BlockTopkConfig),
        model_kinds=frozenset({"causal_lm"}),
        make_config=_config,
        forward=block_topk_forward,
        causal_calls=True,
        noncausal_calls=False,
        key_padding=True,
        exact_limit_decl=ExactLimit(_every_block, at_least=("threshold",), text="threshold = 1"),
        bench_hook=block_topk_bench,
        knob=Knob("threshold, 0 to 1 (share of the estimated mass)", _knob),
        small_settings={"causal_lm": dict(block_size=16, stride=4, threshold=0.5, min_len=32)},
        details=(
            "XAttention: queries and keys in blocks of `block_size`; each (query block, key block) pair scored by the "
            "softmax-normalised sums of strided antidiagonals (stride `stride`) of its logits, an estimate of its "
            "attention mass; per query block the first and diagonal key blocks plus the highest-scoring others until "
            "their share reaches `threshold`; exact softmax over the kept blocks (causal in the diagonal block). "
            "Decoding steps and prompts shorter than `min_len` run dense."
        ),
    )
)
