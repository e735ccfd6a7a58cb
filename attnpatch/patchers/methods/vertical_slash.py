"""``vertical_slash``: MInference's dynamic vertical-slash sparse prefill for causal LMs (the math:
:mod:`attnpatch.attention.sparse.vertical_slash`).

Decoding steps (one query) run the model's own attention.

Chunked prefill: a prompt fed in pieces on a KV cache is one call per piece (``q_offset = `` the cache length):
each piece estimates its own pattern from its own last ``last_q`` queries against every key so far, so a piece
keeps what a ``chunk`` of its length would keep in one call, not what the whole prompt in one call keeps (with
``chunk=None`` that call's pattern comes from the prompt's last queries).  The exact-limit shortcut
(``vertical >= q_offset + Lq``) uses the absolute length.

``kernel`` (:data:`KERNEL_CHOICES`): the kept columns and diagonals run either as the
gather path or as a FlexAttention ``BlockMask`` (:mod:`attnpatch.attention.sparse.masks`); ``"auto"`` picks flex
on CUDA and the gather path on the CPU unless :data:`attnpatch.attention.backends.dispatch.CPU_FLEX_MIN_KEYS` (``"vertical_slash"``) says
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...attention.sparse.column_diagonal import BLOCK
from ...attention.backends.dispatch import kernels_of
from ...attention.sparse.vertical_slash import vertical_slash_attention, vertical_slash_pattern, vertical_slash_recall
from ...options import check_fields, opt, options_of
from ..bench_hook import BenchCase, BenchInputs, sdpa
from ..contract import ExactLimit, Knob, Method
from ..registry import register_method
from ..state import LayerContext, LayerRecord

#: The ``kernel`` option's values (operation "vertical_slash" of :func:`attnpatch.attention.backends.dispatch.choose`).
KERNEL_CHOICES = ("auto", *kernels_of("vertical_slash"))

__all__ = ["VerticalSlashConfig", "vertical_slash_forward", "vertical_slash_bench", "VERTICAL_SLASH"]


@dataclass(frozen=True)
class VerticalSlashConfig:
    """Options of the vertical-slash pattern (MInference, arXiv 2407.02490, Sec. 3.2, Alg. 2).

    Attributes:
        vertical: key columns kept per head (the top columns by the estimation queries' summed attention);
            clamped to the keys that exist, so ``vertical >= N`` keeps every causal key: exact attention, computed
            through the sparse code for calls of at most ``BLOCK`` (128) queries and handed to the model's own
            attention (the same result, faster) for longer ones; ``slash >= N`` likewise.
        slash: diagonals kept per head (the top ones by summed attention along each diagonal; the local
            diagonals ``0 .. LOCAL_DIAGONALS - 1`` always among them); clamped likewise.
        last_q: the last ``last_q`` queries of a chunk estimate its pattern with exact attention.
        chunk: queries per selection chunk, or ``None``: the whole call is one chunk (MInference).  A query's
            output depends on the tokens up to the end of its chunk, so with ``None`` every output of a
            prefill depends on its last ``last_q`` tokens (fine for generation, not for scoring each position
            of a text in one pass); a prompt continued on a cache is its own call, chunks counted from its first query.
        kernel: ``"auto"``, ``"flex"`` or ``"gather"`` (the module docstring); the same kept keys either way.
    """

    vertical: int = field(default=1000, metadata=opt(
        "int", "key columns kept per head (tokens); >= N is exact", low=0))
    slash: int = field(default=6000, metadata=opt(
        "int", "diagonals kept per head, the local ones always among them (tokens)", low=1))
    last_q: int = field(default=64, metadata=opt(
        "int", "estimation queries: the last last_q queries of a chunk (tokens)", low=1))
    chunk: int | None = field(default=None, metadata=opt(
        "int", "queries per selection chunk (tokens); none: the whole call (outputs then depend on its last tokens)",
        nullable=True, low=1))
    kernel: str = field(default="auto", metadata=opt(
        "str", "how the kept keys are attended: flex = a FlexAttention BlockMask (compiled per length bucket), gather "
        "= the blocked PyTorch path; auto = flex on CUDA, the measured faster one on the CPU", choices=KERNEL_CHOICES))

    def __post_init__(self) -> None:
        check_fields(self)


def vertical_slash_forward(
    cfg: VerticalSlashConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext
) -> tuple[torch.Tensor | None, LayerRecord]:
    """Vertical-slash attention on prefill (padding and a prompt continued on a cache included); decoding steps dense."""
    lq, lk = q.shape[2], k.shape[2]
    if lq == 1:
        return None, LayerRecord(ctx.layer, "dense:decode", lq, lk)
    # counts are clamped to the keys that exist: every column (or every diagonal) kept is exact attention
    n = ctx.q_offset + lq
    mode = "dense:vertical>=N" if cfg.vertical >= n else "dense:slash>=N" if cfg.slash >= n else "sparse"
    if mode != "sparse" and lq > BLOCK:
        # the same result as the model's own (fused) attention, which is faster; calls of at most one block still run
        # through the sparse code, so that the contract battery's exact-limit check tests its masking
        return None, LayerRecord(ctx.layer, mode, lq, lk)
    out, kept = vertical_slash_attention(
        q, k, v, vertical=cfg.vertical, slash=cfg.slash, last_q=cfg.last_q, chunk=cfg.chunk, scale=ctx.scale,
        q_offset=ctx.q_offset, key_valid=ctx.key_valid, return_counts=ctx.record, kernel=cfg.kernel,
    )
    rec = LayerRecord(ctx.layer, mode, lq, lk)
    if kept is not None:
        rec.kept_pairs = kept.cpu()
    if ctx.state is not None and ctx.state.recall and mode == "sparse":  # diagnostic: one dense Q K^T pass more
        rec.recall = vertical_slash_recall(
            q, k, vertical=cfg.vertical, slash=cfg.slash, last_q=cfg.last_q, chunk=cfg.chunk, scale=ctx.scale,
            q_offset=ctx.q_offset, key_valid=ctx.key_valid,
        ).cpu()
    return out, rec


def vertical_slash_bench(cfg: VerticalSlashConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         inputs: BenchInputs) -> BenchCase:
    """One causal layer, the whole call timed; the pattern estimation of the (first) chunk alone as ``select_seconds``;
    the sparsity (skipped causal pairs) from one more untimed call."""
    n, scale = q.shape[2], inputs.scale
    kw = dict(vertical=cfg.vertical, slash=cfg.slash, last_q=cfg.last_q, chunk=cfg.chunk, scale=scale,
              kernel=cfg.kernel)

    exact = cfg.vertical >= n or cfg.slash >= n

    def call():
        if exact and n > BLOCK:  # as the forward: the model's own attention
            return sdpa(q, k, v, scale=scale, causal=True)
        return vertical_slash_attention(q, k, v, **kw)[0]

    def select():
        c1 = n if cfg.chunk is None else min(n, cfg.chunk)
        m = min(cfg.last_q, c1)
        return vertical_slash_pattern(q[:, :, c1 - m : c1], k[:, :, :c1], vertical=cfg.vertical, slash=cfg.slash,
                                      scale=scale, q_start=c1 - m)

    def stats() -> dict[str, Any]:
        if exact:
            return {"sparsity": 0.0}
        kept = vertical_slash_attention(q, k, v, return_counts=True, **kw)[1]
        return {"sparsity": float(1.0 - kept.mean() / (n * (n + 1) / 2))}

    if exact:
        why = "vertical>=N" if cfg.vertical >= n else "slash>=N"
        return BenchCase(call=call, stats=stats, note=f"ran dense: {why}" if n > BLOCK else f"every causal key kept: {why}")
    return BenchCase(call=call, parts={"select": select}, stats=stats)


def _config(options: dict[str, Any]) -> VerticalSlashConfig:
    return VerticalSlashConfig(**options)


def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"vertical": max(1, round(t * n)), "slash": max(1, round(t * n))}


VERTICAL_SLASH = register_method(
    Method(
        name="vertical_slash",
        summary="MInference vertical-slash sparse prefill: per-head top key columns and diagonals from the last queries, "
                "exact softmax over their union; decoding dense",
        source="MInference, arXiv 2407.02490, Sec. 3.2 and Alg. 2 (vertical-slash)",
        options=options_of(VerticalSlashConfig),
        model_kinds=frozenset({"causal_lm"}),
        make_config=_config,
        forward=vertical_slash_forward,
        causal_calls=True,
        noncausal_calls=False,
        key_padding=True,
        exact_limit_decl=ExactLimit(lambda tokens: {"vertical": tokens}, at_least=("vertical",), text="vertical >= N"),
        bench_hook=vertical_slash_bench,
        knob=Knob("vertical = slash, 1 to N (key columns and diagonals)", _knob),
        small_settings={"causal_lm": dict(vertical=8, slash=24, last_q=16, chunk=32)},
        details=(
            "Vertical-slash (MInference): per head, the last `last_q` queries of a chunk (`chunk` queries; the whole "
            "prompt by default) attend exactly; the `vertical` key columns and `slash` diagonals (the local ones always "
            "among them) with the most summed attention are kept, and every query of the chunk attends with an exact "
            "softmax to the kept columns and diagonals at or before it. With the default (one chunk) every output may "
            "depend on the prompt's last tokens, as in MInference; set `chunk` for outputs that depend only on tokens up "
            "to the end of their chunk (scoring a text in one pass). Decoding steps run dense."
        ),
    )
)
