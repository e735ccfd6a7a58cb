"""``anchor_attention``: AnchorAttention sparse prefill for causal LMs (the math: :mod:`attnpatch.attention.anchor`).

What each option does is declared once below (:data:`ANCHOR_OPTIONS`, defaults in
:class:`~attnpatch.attention.anchor.AnchorConfig`); how the defaults were chosen and what they
cost and keep is measured in BENCHMARKS.md and the README.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...attention.anchor import _GUARDS, _KERNELS, _SELECT_DTYPES, AnchorConfig, anchor_attention, select_stripes
from ...errors import OptionError
from ..bench_hook import BenchCase, BenchInputs
from ..options import opt, options_of
from ..registry import ExactLimit, Method, ModelGeometry, register_method
from ..state import LayerContext, LayerRecord

__all__ = ["ANCHOR", "ANCHOR_OPTIONS", "anchor_forward", "anchor_bench"]

_LAYERS = "name model layers"

#: One declaration per option of :class:`AnchorConfig` (its dataclass fields hold the defaults).
ANCHOR_OPTIONS = {
    "theta": opt("float", "stripe threshold on anchor - score, in logits (inf = dense, -inf = initial block + window only)",
                 rule="must be a real number (inf and -inf allowed)"),
    "block_size": opt("int", "queries per query block (tokens)", low=1, rule="must be an integer >= 1 (tokens)"),
    "init_block": opt("int", "initial keys always kept (tokens)", low=1, rule="must be an integer >= 1 (tokens)"),
    "local_window": opt("int", "keys before each block's end always kept (tokens, >= block_size)", low=1,
                        rule="must be an integer >= 1 (tokens)"),
    "min_len": opt("int", "prompts shorter than this run dense (tokens)", low=0, rule="must be an integer >= 0 (tokens)"),
    "pool_stride": opt("int", "queries averaged per pool for stripe selection (tokens; None = block_size as in the paper, "
                       "1 = per query; must divide block_size)", nullable=True, low=1, rule="must be None or an integer >= 1"),
    "dense_last": opt("int", "the last n prompt queries attend densely (tokens)", low=0, rule="must be an integer >= 0 (tokens)"),
    "dense_layers": opt("int_list", "layer indices that run dense attention", model_scope=_LAYERS),
    "dense_heads": opt("pair_list", "(layer, head) pairs that run dense attention", model_scope=_LAYERS),
    "min_recall": opt("float", "recall guard: heads whose kept keys carry less exact softmax mass than this on the probe "
                      "blocks attend densely (0 = off)", low=0.0, high=1.0, rule="must be a number in [0, 1] (0 = off)"),
    "recall_probes": opt("int", "query blocks the recall guard measures per layer (guard='global')", low=1,
                         rule="must be an integer >= 1 (query blocks)"),
    "guard": opt("str", "recall guard scope, 'causal' or 'global': causal = dense/sparse per query block from probe "
                 "blocks at or before it (no output depends on later tokens); global = once per head from probes over "
                 "the whole prompt", choices=_GUARDS),
    "select_dtype": opt("str", "precision of the stripe-scoring product (bfloat16: faster selection on CPUs with native "
                        "bfloat16)", choices=_SELECT_DTYPES),
    "kernel": opt("str", "attention over kept stripes: auto = the compiled CPU kernel for float32 where it builds, else "
                  "PyTorch operations", choices=_KERNELS),
}


def anchor_forward(
    cfg: AnchorConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext
) -> tuple[torch.Tensor | None, LayerRecord]:
    """AnchorAttention on prefill; exact attention for decoding steps, short prompts and ``dense_layers``."""
    layer, state = ctx.layer, ctx.state
    lq, lk = q.shape[2], k.shape[2]
    if lq == 1:
        return None, LayerRecord(layer, "dense:decode", lq, lk)
    if lq < cfg.min_len:
        return None, LayerRecord(layer, "dense:short", lq, lk)
    if layer in cfg.dense_layers:
        return None, LayerRecord(layer, "dense:layer", lq, lk)
    if cfg.theta == math.inf:  # every causal key kept: the model's own attention, at no extra cost
        return None, LayerRecord(layer, "dense:theta=inf", lq, lk)
    heads = [hd for (li, hd) in cfg.dense_heads if li == layer]
    recall = bool(state is not None and state.recall)
    out, st = anchor_attention(
        q, k, v, cfg, scale=ctx.scale, q_offset=ctx.q_offset, key_valid=ctx.key_valid, dense_heads=heads,
        return_stats=ctx.record, compute_recall=recall,
    )
    rec = LayerRecord(layer, "sparse", lq, lk)
    if st is not None:
        rec.causal_pairs = st.causal_pairs.cpu()
        rec.kept_pairs = st.kept_pairs.cpu()
        rec.kept_columns = None if st.kept_columns is None else st.kept_columns.cpu()
        rec.recall = None if st.recall is None else st.recall.cpu()
    return out, rec


def _check(cfg: AnchorConfig, geo: ModelGeometry) -> None:
    """``dense_layers`` and ``dense_heads`` must name layers and heads the model has.

    Raises:
        OptionError: a layer or head index out of range.
    """
    n_layers, n_heads = geo.num_layers, geo.heads
    for li in cfg.dense_layers:
        if not 0 <= li < n_layers:
            raise OptionError(f"dense_layers contains {li}: layer indices must be in 0..{n_layers - 1}")
    for li, hi in cfg.dense_heads:
        if not 0 <= li < n_layers or (n_heads is not None and not 0 <= hi < n_heads):
            raise OptionError(
                f"dense_heads contains ({li}, {hi}): layers must be in 0..{n_layers - 1}, heads in 0..{(n_heads or 1) - 1}"
            )


def anchor_bench(cfg: AnchorConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: BenchInputs) -> BenchCase:
    """One causal layer: the whole call timed; the stripe selection alone as ``select_seconds`` (``None`` where the
    layer runs dense: ``N < min_len`` or ``theta = inf``); sparsity and recall (exact softmax mass on the kept keys)
    measured outside the timed calls."""
    n, scale = q.shape[2], inputs.scale

    def call():
        return anchor_attention(q, k, v, cfg, scale=scale)[0]

    def select():
        return select_stripes(q, k, cfg, scale=scale)

    def stats() -> dict[str, Any]:
        _, st = anchor_attention(q, k, v, cfg, scale=scale, return_stats=True, compute_recall=True)
        return {
            "sparsity": float(1.0 - st.kept_pairs.sum() / st.causal_pairs.sum().clamp(min=1)),
            "recall": float(st.recall.mean()),
            "recall_min_head": float(st.recall.min()),
        }

    if n < cfg.min_len or cfg.theta == math.inf:
        note = "ran dense: N < min_len" if n < cfg.min_len else "ran dense: theta = inf"
        return BenchCase(call=call, extra=lambda t, ref: {"select_seconds": None}, stats=stats, note=note)
    return BenchCase(call=call, parts={"select": select}, stats=stats)


def _config(options: dict[str, Any]) -> AnchorConfig:
    return AnchorConfig(**options)


def _every_key(tokens: int) -> dict[str, Any]:
    # theta = inf keeps every causal key: every layer hands back to the model's own attention
    return {"theta": math.inf}


ANCHOR = register_method(
    Method(
        name="anchor_attention",
        summary="AnchorAttention sparse prefill: anchor-relative stripe selection, exact attention on kept keys; decoding dense",
        source="AnchorAttention, arXiv 2505.23520, Sec. 3 (Eq. 2-4)",
        options=options_of(AnchorConfig, ANCHOR_OPTIONS),
        model_kinds=frozenset({"causal_lm"}),
        make_config=_config,
        forward=anchor_forward,
        check=_check,
        causal_calls=True,
        noncausal_calls=False,
        key_padding=True,
        exact_limit_decl=ExactLimit(_every_key, at_least=("theta",), text="theta = inf"),
        bench_hook=anchor_bench,
        details=(
            "AnchorAttention: per-query anchor = max logit over the initial block and local window; pooled queries scored against all "
            "causal keys; key stripes within `theta` of the pooled anchor kept for the whole query block; exact softmax "
            "over kept keys. Decoding steps run dense."
        ),
    )
)
