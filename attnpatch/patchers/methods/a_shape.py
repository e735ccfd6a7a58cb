"""``a_shape``: StreamingLLM's attention-sink + local-window pattern as a sparse prefill for causal LMs
(MInference's "A-shape"; the math: :mod:`attnpatch.attention.sparse.a_shape`).

Decoding steps (one query) run the model's own attention.

Chunked prefill: a prompt fed in pieces on a KV cache (each call's queries at ``q_offset = `` the cache length)
keeps, for every query, the same keys as the prompt in one call: the initial tokens and the window are counted
in absolute positions, so the outputs agree with the one-call prefill to float rounding; the exact-limit
shortcut (``window >= q_offset + Lq``) also uses the absolute length.

``kernel`` (:data:`KERNEL_CHOICES`): the same kept set runs either as the blocked gather
path or as a FlexAttention ``BlockMask`` (:mod:`attnpatch.attention.sparse.masks`); ``"auto"`` picks flex on CUDA
and the gather path on the CPU unless :data:`attnpatch.attention.backends.dispatch.CPU_FLEX_MIN_KEYS` (``"a_shape"``) says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...attention.backends.dispatch import kernels_of
from ...attention.sparse.a_shape import A_BLOCK, a_shape_attention, a_shape_kept_pairs, a_shape_recall
from ...options import check_fields, opt, options_of
from ..bench_hook import BenchCase, BenchInputs, sdpa
from ..contract import ExactLimit, Knob, Method
from ..registry import register_method
from ..state import LayerContext, LayerRecord

#: The ``kernel`` option's values (operation "a_shape" of :func:`attnpatch.attention.backends.dispatch.choose`).
KERNEL_CHOICES = ("auto", *kernels_of("a_shape"))

__all__ = ["AShapeConfig", "a_shape_forward", "a_shape_bench", "A_SHAPE"]


@dataclass(frozen=True)
class AShapeConfig:
    """Options of the A-shape pattern (StreamingLLM, arXiv 2309.17453; MInference, arXiv 2407.02490, Sec. 3.2).

    Attributes:
        init_tokens: initial keys (attention sinks) every query attends to, counted from the sequence's first
            non-padding token.
        window: keys ending at each query, itself included (the local window).  ``window >= N`` keeps every
            causal key: exact attention, computed through the blocked code for calls of at most ``A_BLOCK`` (256)
            queries and handed to the model's own attention (the same result, faster) for longer ones.
        kernel: ``"auto"``, ``"flex"`` or ``"gather"`` (the module docstring); the same kept keys either way.
    """

    init_tokens: int = field(default=128, metadata=opt(
        "int", "initial keys every query attends to, from the sequence's first real token (tokens)", low=0))
    window: int = field(default=1024, metadata=opt(
        "int", "local window: keys ending at each query, itself included (tokens); >= N is exact", low=1))
    kernel: str = field(default="auto", metadata=opt(
        "str", "how the kept keys are attended: flex = a FlexAttention BlockMask (compiled per length bucket), gather "
        "= the blocked PyTorch path; auto = flex on CUDA, the measured faster one on the CPU", choices=KERNEL_CHOICES))

    def __post_init__(self) -> None:
        check_fields(self)


def a_shape_forward(
    cfg: AShapeConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext
) -> tuple[torch.Tensor | None, LayerRecord]:
    """A-shape attention on prefill (padding and a prompt continued on a cache included); decoding steps dense."""
    lq, lk = q.shape[2], k.shape[2]
    if lq == 1:
        return None, LayerRecord(ctx.layer, "dense:decode", lq, lk)
    exact = cfg.window >= ctx.q_offset + lq  # every causal key inside the window
    if exact and lq > A_BLOCK:
        # the same result as the model's own (fused) attention, which is faster; calls of at most one block still run
        # through the blocked code, so that the contract battery's exact-limit check tests its masking
        return None, LayerRecord(ctx.layer, "dense:window>=N", lq, lk)
    out, kept = a_shape_attention(
        q, k, v, init_tokens=cfg.init_tokens, window=cfg.window, scale=ctx.scale, q_offset=ctx.q_offset,
        key_valid=ctx.key_valid, return_counts=ctx.record, kernel=cfg.kernel,
    )
    rec = LayerRecord(ctx.layer, "dense:window>=N" if exact else "sparse", lq, lk)
    if kept is not None:
        rec.kept_pairs = kept.cpu()
    if ctx.state is not None and ctx.state.recall and not exact:  # diagnostic: one dense Q K^T pass more
        rec.recall = a_shape_recall(
            q, k, init_tokens=cfg.init_tokens, window=cfg.window, scale=ctx.scale, q_offset=ctx.q_offset, key_valid=ctx.key_valid,
        ).cpu()
    return out, rec


def a_shape_bench(cfg: AShapeConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: BenchInputs) -> BenchCase:
    """One causal layer, the whole call timed; the sparsity (skipped causal pairs) is computed, not measured."""
    n = q.shape[2]

    def call():
        if cfg.window >= n and n > A_BLOCK:  # as the forward: the model's own attention
            return sdpa(q, k, v, scale=inputs.scale, causal=True)
        return a_shape_attention(q, k, v, init_tokens=cfg.init_tokens, window=cfg.window, scale=inputs.scale,
                                 kernel=cfg.kernel)[0]

    def stats() -> dict[str, Any]:
        kept = a_shape_kept_pairs(n, q_offset=0, init_tokens=cfg.init_tokens, window=cfg.window)
        return {"sparsity": 1.0 - kept / (n * (n + 1) / 2)}

    note = ("ran dense: window>=N" if n > A_BLOCK else "every causal key kept: window >= N") if cfg.window >= n else None
    return BenchCase(call=call, stats=stats, note=note)


def _config(options: dict[str, Any]) -> AShapeConfig:
    return AShapeConfig(**options)


def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"window": max(1, round(t * n))}


A_SHAPE = register_method(
    Method(
        name="a_shape",
        summary="A-shape sparse prefill: the initial tokens and a local window per query, exact softmax; decoding dense",
        source="StreamingLLM, arXiv 2309.17453, Sec. 3.2; MInference, arXiv 2407.02490, Sec. 3.2 (A-shape)",
        options=options_of(AShapeConfig),
        model_kinds=frozenset({"causal_lm"}),
        make_config=_config,
        forward=a_shape_forward,
        causal_calls=True,
        noncausal_calls=False,
        key_padding=True,
        exact_limit_decl=ExactLimit(lambda tokens: {"window": tokens}, at_least=("window",), text="window >= N"),
        bench_hook=a_shape_bench,
        knob=Knob("window, 1 to N tokens", _knob),
        small_settings={"causal_lm": dict(init_tokens=4, window=20)},
        details=(
            "A-shape (attention sinks + local window): each query attends with an exact softmax to the first "
            "`init_tokens` keys of its sequence and the `window` keys ending at itself; blocked, never an N×N matrix. "
            "Decoding steps run dense."
        ),
    )
)
