"""AnchorAttention: difference-aware sparse prefill attention with stripe granularity.

Source: "AnchorAttention: Difference-Aware Sparse Attention with Stripe Granularity"
(arXiv 2505.23520), Sec. 3:

1. *Anchor* (their Eq. 2): for every query ``i`` at absolute position ``p_i``, the anchor
   ``a_i = max_j s_ij`` over the keys of the initial block and of the local window,
   where ``s_ij = q_i . k_j * scale`` is the scaled logit.
2. *Difference-aware stripe selection* (their Eq. 3-4): the queries of a query block are
   average-pooled into ``q_bar``, the anchors likewise into ``a_bar``; ``q_bar`` is scored
   against every causal key, and the key column ("stripe") ``j`` is kept for the whole
   block when ``a_bar - q_bar . k_j * scale <= theta``.  The initial block and the local
   window are always kept.
3. *Sparse computation*: exact softmax attention of the block's queries over the kept keys
   (causal inside the window).

The functions here are pure tensor functions (no model knowledge).  Tensors follow
``[batch, heads, tokens, head_dim]``; keys/values may have fewer heads than queries
(grouped-query attention) and are never repeated in memory for the selection step.

Beyond the paper, :class:`AnchorConfig` offers remedies for the paper-faithful setting's
failure on retrieval (the measurements that chose the defaults are in docs/methods.md and docs/benchmarks/anchor.md):
finer pooling (``pool_stride``; 1 = every query selects for itself), dense attention for the last
``dense_last`` prompt queries, dense fallback for chosen layers or (layer, head) pairs, and the recall
guard (``min_recall``): heads whose kept keys lose softmax mass on probe blocks attend densely, decided
per query block from earlier probes only (``guard="causal"``) or once per prompt (``guard="global"``).

Modules (their main functions re-exported here): :mod:`.config` (:class:`AnchorConfig`, :class:`AnchorStats`),
:mod:`.select` (geometry and stripe selection), :mod:`.attend` (attention over kept stripes, dense
causal attention), :mod:`.guard` (the recall guard), :mod:`.core` (:func:`anchor_attention`),
:mod:`.reference` (the float64 reference), :mod:`.tiles` (tile sizes of the fast paths), :mod:`.triton_select`,
:mod:`.triton_attend` and :mod:`.triton_dots` (the Triton path on CUDA: selection into a bitmask on the device,
attention over it, the guard's probes and the statistics; ``kernel="triton"``, or ``"auto"`` on CUDA; imported only by
a call that runs them).  Which kernel runs: :func:`attnpatch.attention.backends.dispatch.choose` (operations
``"anchor_select"``, ``"anchor_attend"``, ``"anchor_merge"``).
"""

from __future__ import annotations

from .attend import dense_causal_attention
from .config import AnchorConfig, AnchorStats
from .core import anchor_attention
from .reference import anchor_attention_reference
from .select import select_stripes

__all__ = [
    "AnchorConfig",
    "AnchorStats",
    "anchor_attention",
    "anchor_attention_reference",
    "select_stripes",
    "dense_causal_attention",
]
