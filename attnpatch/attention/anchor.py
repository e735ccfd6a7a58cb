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
failure on retrieval (the measurements that chose the defaults are in the README and BENCHMARKS.md):
finer pooling (``pool_stride``; 1 = every query selects for itself), dense attention for the last
``dense_last`` prompt queries, dense fallback for chosen layers or (layer, head) pairs, and the recall
guard (``min_recall``): heads whose kept keys lose softmax mass on probe blocks attend densely, decided
per query block from earlier probes only (``guard="causal"``) or once per prompt (``guard="global"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import OptionError
from .cpu_kernel import kernel_status, stripe_kernel

__all__ = [
    "AnchorConfig",
    "AnchorStats",
    "anchor_attention",
    "anchor_attention_reference",
    "select_stripes",
    "dense_causal_attention",
]

# Scores buffer budget (elements) for one chunk of query blocks in the fast path.
_CHUNK_ELEMENTS = 1 << 24
# Pooled-score buffer (elements) per chunk of query blocks in the stripe selection: small enough for cache.
_SELECT_CHUNK_ELEMENTS = 1 << 21
# Pooled queries per key/value head in one stripe-selection GEMM (fewer give a less efficient matrix product).
_SELECT_ROWS = 512
# Fewest keys per stripe-selection tile.
_SELECT_MIN_TILE = 128
# Compiled selection: pooled queries per work item and keys per tile (a [rows, tile] float32 score
# buffer of 256 KiB per thread).
_SELECT_KERNEL_ROWS = 256
_SELECT_KERNEL_TILE = 256
# Keys and query rows per step of the compiled kernel (its per-thread buffers: _Q_TILE x _KV_TILE scores,
# _KV_TILE keys and values, whatever the block size).
_KV_TILE = 512
_Q_TILE = 256
_KERNELS = ("auto", "compiled", "torch")
_GUARDS = ("global", "causal")
_SELECT_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class AnchorConfig:
    """Options of AnchorAttention (all sizes in tokens).

    Attributes:
        theta: threshold on ``a_bar - q_bar.k_j*scale`` (in logit units, natural-log scale);
            ``inf`` keeps every causal key (exactly dense), ``-inf`` keeps only the initial
            block and the local window.
        block_size: number of queries per query block (the pooling unit of the paper).
        init_block: number of initial keys always kept (the attention-sink region).
        local_window: number of keys ending at each query block's last position that are
            always kept; must be ``>= block_size`` so the diagonal block is exact.
        min_len: prompts (query length) shorter than this run dense attention.
        pool_stride: queries per pool: the queries of a pool are averaged into ``q_bar``
            and their anchors into ``a_bar`` (the paper's mean pooling); a stripe is kept for
            the whole block when any of its pools keeps it.  ``None`` means ``block_size``
            (the paper: one pool per block); ``1`` means every query selects for itself (a
            max over the block's queries of ``s_ij - a_i``; costs a full ``Q K^T``).  Must
            divide ``block_size``.
        dense_last: the last ``dense_last`` queries of the prompt attend densely (the
            question at the end of a long-context prompt).
        dense_layers: layer indices that run dense attention.
        dense_heads: ``(layer, head)`` pairs (query-head index) that run dense attention.
        min_recall: recall guard (0 = off): a head whose kept keys carry less than this exact
            softmax mass on average over the queries of some probe blocks attends densely in this
            layer (``guard`` says which probes and for which queries).  The automatic form of
            ``dense_heads``: the retrieval heads that thresholding hurts are found by measurement.
        recall_probes: ``guard="global"`` only: query blocks the recall guard measures (cost: one
            exact ``Q K^T`` over that many blocks per layer).
        guard: scope of the recall guard's decision (no effect when ``min_recall=0``).
            ``"global"`` (the only guard before this option existed): one decision per (sequence,
            head) and call, from ``recall_probes`` evenly spaced blocks of sparse queries over the
            whole prompt (the last one holds the last sparse queries); a head judged low attends
            densely for every query, so any output may depend on any token of the prompt.
            ``"causal"`` (the default: no output depends on later tokens, at a probe cost of the
            same order): one decision per (sequence, head, query block): block ``j`` attends
            densely when the mean recall of the probe blocks at or before ``j`` is below
            ``min_recall``, each probe weighted by the blocks it stands for up to ``j`` (an
            estimate of the mean recall of the blocks so far).  The probe blocks are ``f - 1 + d``,
            ``d`` = 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (two per doubling), where ``f = max(0,
            (init_block + local_window - q_offset) // block_size)`` is the first block that does
            not keep every causal key; they are fixed by the options whatever the prompt's length,
            and every query of a probe block counts (``dense_last`` plays no part).  Cost per head:
            the exact logits of the probe blocks' queries against their causal keys, about
            ``3.4 * (last probe + 1) * block_size ** 2`` for the causal guard, about
            ``recall_probes / 2 * Lq * block_size`` for the global one.  Guarded blocks run the
            compiled kernel over every causal key where it runs, else fused dense attention.  See
            "Which outputs depend on which tokens" below.
        select_dtype: ``"float32"`` or ``"bfloat16"``: the precision of the pooled queries and keys in
            the stripe-scoring product (accumulated in float32).  ``"bfloat16"`` makes the selection faster
            on CPUs with native bfloat16 dot products (AVX512-BF16, AMX) and flips stripes only within
            rounding of the threshold (speed and flipped stripes measured: BENCHMARKS.md).
            The anchors, the recall guard and the attention itself stay in the input precision.
        kernel: how the attention over kept stripes runs.  ``"auto"``: the compiled CPU kernel
            (:mod:`attnpatch.attention.cpu_kernel`, built on first use) for float32 CPU tensors without
            padding inside the keys when it can be built here, else PyTorch operations;
            ``"compiled"``: the compiled kernel, an error where it cannot run; ``"torch"``: PyTorch
            operations only.  All three give the same result up to float rounding (through a whole
            model with ``select_dtype="bfloat16"``, such a rounding difference in one layer can flip
            a stripe that sits at the threshold in a later one).

    Which outputs depend on which tokens.  Positions count from the call's first query (a
    padded sequence from its first real token, exactly as if it were alone); query ``i`` lies in
    query block ``i // block_size``, which ends before ``e(i) = (i // block_size + 1) *
    block_size`` (the prompt's last block may end sooner, at the prompt's end):

    * stripe selection (the paper's design): a block's stripes come from the pooled queries and
      anchors of all its queries and from the keys before ``e(i)`` (with ``pool_stride=1`` too: a
      stripe one query keeps is kept for the whole block), so query ``i``'s output depends on the
      tokens before ``e(i)``, the later queries of its own block included; it attends only keys
      at or before ``i``.
    * ``min_recall > 0, guard="global"``: the decision for a head changes the output of all its
      sparse queries, and the probes are spread over the whole prompt: any output may depend on
      any token (changing a token in the last block changes the outputs of the first blocks),
      and on the prompt's length (which blocks are probed).
    * ``min_recall > 0, guard="causal"``: block ``j``'s decision reads the probe blocks at or
      before ``j`` only: nothing at or after ``e(i)``.
    * ``dense_last``: the last ``dense_last`` queries of the call attend densely; which ones is
      set by the prompt's length: changing a later token's value changes nothing earlier, but
      appending tokens makes queries that were dense sparse.
    * ``min_len``: a call with fewer queries runs dense: appending tokens past ``min_len`` makes
      the blocks that do not keep every causal key sparse.
    * ``kernel``: the compiled kernel computes each query block on its own; the PyTorch path
      processes blocks in buckets sorted by kept count, so a later block can change an earlier
      block's float rounding (about 1e-7), never its kept keys.

    Hence two guarantees.  Causal: with ``guard="causal"`` or ``min_recall=0``, whatever the other
    options, changing tokens at positions ``>= e(i)`` of a prompt (its length kept) leaves query
    ``i``'s output unchanged (bit for bit with the compiled kernel, to float rounding on the
    PyTorch path); every layer of a model keeps this, so the logits at ``i`` depend on the tokens
    before ``e(i)`` only: fit for scoring a text in one pass (perplexity), where the logits at
    ``i`` still see the rest of ``i``'s block through the selection.  Prefix-consistent: with in
    addition ``dense_last=0`` and ``min_len`` at most the end of the first block that does not
    keep every causal key, ``block_size * (1 + (init_block + local_window) // block_size)``,
    query ``i`` gives the same output, to float rounding, in every prompt of at least ``e(i)``
    tokens that agrees on the tokens before ``e(i)``.  The defaults are causal but not
    prefix-consistent (``dense_last=256``, ``min_len=512``); ``guard="global"`` is neither.  A
    prompt continued on a cache (chunked prefill) is computed as its own call: blocks from its
    first query, ``dense_last`` and ``min_len`` on its own length, the causal guard's probes from
    its first block; it equals a one-pass prefill only for chunks that are multiples of
    ``block_size`` and at least ``min_len`` long, with ``min_recall=0`` and ``dense_last=0``.

    Defaults: ``theta=12, block_size=128, init_block=128, local_window=128`` as in the paper, plus
    three remedies for the paper setting's loss of multi-key retrieval: ``pool_stride=2`` (queries
    pooled 2 at a time instead of a whole block, since the queries of one block want different keys;
    a stripe is kept for the block when any pool keeps it), ``dense_last=256`` (the question at the
    end of the prompt attends densely) and the recall guard ``min_recall=0.9`` (the retrieval heads
    that thresholding hurts attend densely).  They were chosen by measurement on SmolLM2-135M-Instruct
    so that needle-in-a-haystack accuracy is not below dense; they buy accuracy with sparsity.  The
    measurements (accuracy, sparsity and recall per setting, and the speed of the defaults and of
    settings chosen for speed) are in the README ("Methods") and BENCHMARKS.md.
    """

    theta: float = 12.0
    block_size: int = 128
    init_block: int = 128
    local_window: int = 128
    min_len: int = 512
    pool_stride: int | None = 2
    dense_last: int = 256
    dense_layers: tuple[int, ...] = ()
    dense_heads: tuple[tuple[int, int], ...] = ()
    min_recall: float = 0.9
    recall_probes: int = 4
    guard: str = "causal"
    select_dtype: str = "float32"
    kernel: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.theta, bool) or not isinstance(self.theta, (int, float)) or math.isnan(self.theta):
            raise OptionError(f"theta={self.theta!r}: must be a real number (inf and -inf allowed)")
        for name in ("block_size", "init_block", "local_window"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise OptionError(f"{name}={val!r}: must be an integer >= 1 (tokens)")
        for name in ("min_len", "dense_last"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise OptionError(f"{name}={val!r}: must be an integer >= 0 (tokens)")
        if isinstance(self.min_recall, bool) or not isinstance(self.min_recall, (int, float)) or not 0.0 <= self.min_recall <= 1.0:
            raise OptionError(f"min_recall={self.min_recall!r}: must be a number in [0, 1] (0 = off)")
        if isinstance(self.recall_probes, bool) or not isinstance(self.recall_probes, int) or self.recall_probes < 1:
            raise OptionError(f"recall_probes={self.recall_probes!r}: must be an integer >= 1 (query blocks)")
        if self.guard not in _GUARDS:
            raise OptionError(f"guard={self.guard!r}: must be one of {', '.join(map(repr, _GUARDS))}")
        if self.select_dtype not in _SELECT_DTYPES:
            raise OptionError(f"select_dtype={self.select_dtype!r}: must be one of {', '.join(map(repr, _SELECT_DTYPES))}")
        if self.kernel not in _KERNELS:
            raise OptionError(f"kernel={self.kernel!r}: must be one of {', '.join(map(repr, _KERNELS))}")
        if self.local_window < self.block_size:
            raise OptionError(
                f"local_window={self.local_window} < block_size={self.block_size}: the local window must "
                "cover the query block's own (diagonal) keys"
            )
        if self.pool_stride is not None:
            if isinstance(self.pool_stride, bool) or not isinstance(self.pool_stride, int) or self.pool_stride < 1:
                raise OptionError(f"pool_stride={self.pool_stride!r}: must be None or an integer >= 1")
            if self.block_size % self.pool_stride:
                raise OptionError(
                    f"pool_stride={self.pool_stride} does not divide block_size={self.block_size}"
                )

    @property
    def stride(self) -> int:
        """Queries per pool (``block_size`` when ``pool_stride`` is ``None``)."""
        return self.pool_stride or self.block_size


@dataclass
class AnchorStats:
    """Per-call statistics of one attention layer.

    Attributes:
        causal_pairs: ``[batch, heads]`` number of causal (query, key) pairs among valid tokens.
        kept_pairs: ``[batch, heads]`` how many of those pairs were computed.
        kept_columns: ``[batch, heads, n_blocks]`` kept key columns (stripes) per query block.
        recall: ``[batch, heads]`` mean over valid queries of the exact softmax mass carried by
            the kept keys (1.0 = nothing lost), or ``None`` when not requested.
    """

    causal_pairs: torch.Tensor
    kept_pairs: torch.Tensor
    kept_columns: torch.Tensor | None = None
    recall: torch.Tensor | None = None

    @property
    def sparsity(self) -> torch.Tensor:
        """``[batch, heads]`` skipped fraction of causal query-key pairs."""
        return 1.0 - self.kept_pairs / self.causal_pairs.clamp(min=1)


@dataclass
class _Geometry:
    """Positions shared by the fast path and the statistics."""

    lq: int
    lk: int
    q_offset: int
    nb: int
    key_valid: torch.Tensor  # [B, Lk] bool
    start: torch.Tensor  # [B] first valid key index
    query_valid: torch.Tensor  # [B, nb*bq] bool (padded query rows are False)
    block_end: torch.Tensor  # [nb] absolute position one past the block's last query


def _geometry(q: torch.Tensor, k: torch.Tensor, cfg: AnchorConfig, q_offset: int, key_valid: torch.Tensor | None):
    b, _, lq, _ = q.shape
    lk = k.shape[2]
    bq = cfg.block_size
    nb = -(-lq // bq)
    dev = q.device
    if key_valid is None:
        key_valid = torch.ones(b, lk, dtype=torch.bool, device=dev)
    start = torch.argmax(key_valid.to(torch.int8), dim=1)
    pos = q_offset + torch.arange(nb * bq, device=dev)
    in_range = pos < q_offset + lq
    query_valid = in_range[None, :] & key_valid[:, pos.clamp(max=lk - 1)]
    block_end = q_offset + torch.clamp(torch.arange(1, nb + 1, device=dev) * bq, max=lq)
    return _Geometry(lq, lk, q_offset, nb, key_valid, start, query_valid, block_end)


def _always_kept(geo: _Geometry, cfg: AnchorConfig) -> torch.Tensor:
    """``[B, nb, Lk]`` bool: initial block (from each sequence's first valid token) and local window."""
    j = torch.arange(geo.lk, device=geo.key_valid.device)
    initial = (j[None, :] >= geo.start[:, None]) & (j[None, :] < geo.start[:, None] + cfg.init_block)  # [B, Lk]
    window = (j[None, :] >= geo.block_end[:, None] - cfg.local_window) & (j[None, :] < geo.block_end[:, None])
    return initial[:, None, :] | window[None, :, :]


def _causal_keys(geo: _Geometry) -> torch.Tensor:
    """``[B, nb, Lk]`` bool: valid keys at or before each block's last query."""
    j = torch.arange(geo.lk, device=geo.key_valid.device)
    return (j[None, :] < geo.block_end[:, None])[None] & geo.key_valid[:, None, :]


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` ``[..., L, D]`` zero-padded to ``n`` rows (``x`` itself, not a copy, when ``L == n``)."""
    return x if x.shape[-2] == n else F.pad(x, (0, 0, 0, n - x.shape[-2]))


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, H, ...]`` -> ``[B, Hkv, G, ...]`` (query heads grouped by their key/value head)."""
    b, h = q.shape[:2]
    return q.reshape(b, hkv, h // hkv, *q.shape[2:])


def _check_inputs(q, k, v, scale: float, q_offset: int, key_valid) -> None:
    """ValueError naming the first thing that does not fit: ranks, batch, head dim, ``H % Hkv``, ``v`` shaped
    unlike ``k``, queries beyond the keys, a negative ``q_offset``, ``key_valid`` not ``[B, Lk]`` bool, a
    logit scale that is not a positive finite number."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [batch, heads, tokens, head_dim]")
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} (batch and head_dim must match)")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have the shape of k {tuple(k.shape)}")
    if hkv < 1 or h % hkv:
        raise ValueError(f"query heads {h} not a multiple of key/value heads {hkv}")
    if q_offset < 0 or q_offset + lq > lk:
        raise ValueError(
            f"q_offset={q_offset}: the {lq} queries sit at positions q_offset..q_offset+{lq - 1}, which must lie "
            f"within the {lk} keys (0 <= q_offset <= {lk - lq})"
        )
    if key_valid is not None and (key_valid.dtype != torch.bool or tuple(key_valid.shape) != (b, lk)):
        raise ValueError(f"key_valid {key_valid.dtype} {tuple(key_valid.shape)}: must be bool [batch, keys] = [{b}, {lk}]")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r}: the logit scale must be a positive finite number (usually head_dim ** -0.5)")


def select_stripes(
    q: torch.Tensor,
    k: torch.Tensor,
    cfg: AnchorConfig,
    *,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kept key columns (stripes) per query block, AnchorAttention Eq. 2-4 (arXiv 2505.23520).

    Args:
        q: ``[B, H, Lq, D]`` queries at absolute positions ``q_offset .. q_offset+Lq-1``.
        k: ``[B, Hkv, Lk, D]`` keys, ``H % Hkv == 0`` (grouped-query attention, not repeated).
        cfg: the options.
        scale: logit scale (usually ``D ** -0.5``).
        q_offset: absolute position of the first query (``Lk - Lq`` for a prefill chunk).
        key_valid: ``[B, Lk]`` bool, False for padding keys (left padding); ``None`` = all valid.

    Returns:
        ``[B, H, n_blocks, Lk]`` bool, ``n_blocks = ceil(Lq / block_size)``: key ``j`` is attended by
        block ``b`` (before the per-query causal mask).  Always contains the initial block
        and the local window, never a padding key or a key after the block's last query.

    Raises:
        ValueError: inputs that do not fit (see ``_check_inputs``: shapes, ``H`` not a multiple of
            ``Hkv``, ``q_offset``, ``key_valid``, a scale that is not positive).
    """
    _check_inputs(q, k, None, scale, q_offset, key_valid)
    geo = _geometry(q, k, cfg, q_offset, key_valid)
    return _select(q, k, cfg, scale, geo)


def _select_kernel(q: torch.Tensor, cfg: AnchorConfig):
    """The compiled selection kernel when ``cfg.kernel`` allows it and it takes these inputs, else ``None``.

    It selects in float32 on the CPU, from inputs of any floating dtype, with padding (pools without a
    valid query keep nothing, padding keys are never kept).  ``kernel="compiled"`` where it does not
    apply (``select_dtype="bfloat16"``, another device) selects with PyTorch operations; :func:`_compiled`
    raises for the attention that follows where that one does not apply.
    """
    if cfg.kernel == "torch" or q.device.type != "cpu" or cfg.select_dtype != "float32":
        return None
    return stripe_kernel()


def _select(q: torch.Tensor, k: torch.Tensor, cfg: AnchorConfig, scale: float, geo: _Geometry) -> torch.Tensor:
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    bq, nb = cfg.block_size, geo.nb
    dev = q.device
    if math.isinf(cfg.theta):
        keep = (_always_kept(geo, cfg) | (cfg.theta > 0)) & _causal_keys(geo)
        return keep[:, None].expand(b, h, nb, geo.lk)

    mod = _select_kernel(q, cfg)
    if mod is not None:  # the same steps in one parallel region (stripe_select in csrc/anchor_cpu.cpp)
        return mod.stripe_select(
            q.float().contiguous(), k.float().contiguous(), geo.key_valid.contiguous(), geo.start.to(torch.int64),
            geo.q_offset, bq, cfg.stride, cfg.init_block, cfg.local_window, float(cfg.theta), float(scale),
            _SELECT_KERNEL_ROWS, _SELECT_KERNEL_TILE,
        )

    always = _always_kept(geo, cfg)  # [B, nb, Lk]
    causal = _causal_keys(geo)  # [B, nb, Lk]
    qs = q.float() * scale  # the logit scale folded into the queries once
    kf = k.float()
    qpad = _pad_rows(qs, nb * bq)  # [B, H, nb*bq, D]
    qv = geo.query_valid  # [B, nb*bq]
    pos = geo.q_offset + torch.arange(nb * bq, device=dev)  # absolute query positions

    # (1) anchors: max logit over initial block and local window, per query (masked in place).
    n_init = min(cfg.init_block, geo.lk)
    init_idx = (geo.start[:, None] + torch.arange(n_init, device=dev)[None, :])  # [B, I]
    init_ok = init_idx < geo.lk
    init_idx = init_idx.clamp(max=geo.lk - 1)
    k_init = torch.gather(kf, 2, init_idx[:, None, :, None].expand(b, hkv, n_init, d))  # [B,Hkv,I,D]
    qg = _grouped(qpad, hkv)  # [B, Hkv, G, nb*bq, D]
    s_init = torch.einsum("bkgqd,bkid->bkgqi", qg, k_init)
    init_ok_q = init_ok[:, None, :] & (init_idx[:, None, :] <= pos[None, :, None]) & geo.key_valid.gather(1, init_idx)[:, None, :]
    anchor = s_init.masked_fill_(~init_ok_q[:, None, None], -math.inf).amax(-1)  # [B, Hkv, G, nb*bq]
    del s_init

    w = min(cfg.local_window, geo.lk)
    win_idx = geo.block_end[:, None] - w + torch.arange(w, device=dev)[None, :]  # [nb, W]
    win_ok = win_idx >= 0
    win_idx = win_idx.clamp(min=0)
    k_win = kf[:, :, win_idx.reshape(-1)].reshape(b, hkv, nb, w, d)
    s_win = torch.einsum("bkgnqd,bknwd->bkgnqw", qg.reshape(b, hkv, g, nb, bq, d), k_win)
    pos_b = pos.reshape(nb, bq)
    win_ok_q = win_ok[:, None, :] & (win_idx[:, None, :] <= pos_b[:, :, None])  # [nb, bq, W]
    win_ok_q = win_ok_q[None] & geo.key_valid[:, win_idx][:, :, None, :]  # [B, nb, bq, W]
    s_win.masked_fill_(~win_ok_q[:, None, None], -math.inf)
    anchor = torch.maximum(anchor, s_win.amax(-1).reshape(b, hkv, g, nb * bq))
    del s_win, k_win

    # (2) pooling, (3) scores of pooled queries against all keys, stripe threshold.
    st = cfg.stride
    npool = bq // st
    qv_f = qv.to(qs.dtype).reshape(b, 1, 1, nb, npool, st, 1)
    cnt = qv_f.sum(5)  # [B,1,1,nb,npool,1]
    has = cnt.squeeze(-1) > 0  # [B,1,1,nb,npool]
    keep = torch.zeros(b, h, nb, geo.lk, dtype=torch.bool, device=dev)
    qp = (qg.reshape(b, hkv, g, nb, npool, st, d) * qv_f).sum(5) / cnt.clamp(min=1)  # [B,Hkv,G,nb,npool,D]
    an = anchor.masked_fill(~qv[:, None, None], 0.0).reshape(b, hkv, g, nb, npool, st)
    ap = an.sum(-1) / cnt.squeeze(-1).clamp(min=1)  # [B,Hkv,G,nb,npool]
    # stripe kept by a pool when  a_bar - q_bar.k * scale <= theta,  i.e.  q_bar.k * scale - (a_bar - theta) >= 0,
    # and for the block when the largest of these over its pools is >= 0;
    # pools without a valid query (padding) keep nothing (threshold +inf)
    thr = (ap - cfg.theta).masked_fill(~has, math.inf)[..., None]  # [B,Hkv,G,nb,npool,1]
    # chunks of query blocks (about _SELECT_ROWS pooled queries per key/value head: an efficient GEMM shape)
    # times tiles of keys, so that the [.., npool, tile] score buffer stays in cache
    sel_dtype = getattr(torch, cfg.select_dtype)
    ks = kf if sel_dtype == torch.float32 else k.to(sel_dtype)
    step = max(1, min(nb, _SELECT_ROWS // (g * npool)))
    tile = max(_SELECT_MIN_TILE, _SELECT_CHUNK_ELEMENTS // max(b * hkv * g * step * npool, 1))
    for c0 in range(0, nb, step):
        c1 = min(nb, c0 + step)
        lc = int(geo.block_end[c1 - 1])  # later keys are not causal for these blocks
        n = c1 - c0
        qc = qp[:, :, :, c0:c1].reshape(b * hkv, g * n * npool, d).to(sel_dtype)  # one contiguous copy per chunk
        tc = thr[:, :, :, c0:c1].to(sel_dtype)
        for j0 in range(0, lc, tile):
            j1 = min(lc, j0 + tile)
            sc = torch.matmul(qc, ks[:, :, j0:j1].reshape(b * hkv, j1 - j0, d).transpose(1, 2))
            sc = sc.view(b, hkv, g, n, npool, j1 - j0).sub_(tc)
            best = sc.amax(4) if npool > 1 else sc[:, :, :, :, 0]
            keep[:, :, c0:c1, j0:j1] = (best >= 0).reshape(b, h, c1 - c0, j1 - j0)
    keep |= always[:, None]
    keep &= causal[:, None]
    return keep


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact causal softmax attention with a position offset and key padding.

    Args:
        q: ``[B, H, Lq, D]`` at positions ``q_offset ..``; k, v: ``[B, Hkv, Lk, D]``.
        key_valid: ``[B, Lk]`` bool or ``None``.

    Returns:
        ``[B, H, Lq, D]``; a query with no valid key returns zeros.
    """
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    hkv = k.shape[1]
    if q_offset == 0 and lq == lk and (key_valid is None or bool(key_valid.all())):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=h != hkv)
    i = q_offset + torch.arange(lq, device=q.device)
    j = torch.arange(lk, device=q.device)
    mask = (j[None, :] <= i[:, None])[None, None]
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :]
    any_key = mask.any(-1, keepdim=True)
    mask = mask | ~any_key  # avoid NaN rows; zeroed below
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != hkv)
    if key_valid is not None:
        out = out * any_key.to(out.dtype)
    return out


def _pair_counts(keep: torch.Tensor | None, geo: _Geometry, cfg: AnchorConfig, dense_from: int | None = None):
    """Causal pairs ``[B, H or 1]`` and kept causal pairs ``[B, Hs]`` from the stripe mask ``keep`` [B, Hs, nb, Lk].

    Queries with index ``>= dense_from`` count as keeping every causal key.
    """
    b = geo.key_valid.shape[0]
    bq, nb = cfg.block_size, geo.nb
    dev = geo.key_valid.device
    pos = (geo.q_offset + torch.arange(nb * bq, device=dev)).clamp(max=geo.lk - 1)
    qv = geo.query_valid  # [B, nb*bq]
    causal_at = geo.key_valid.to(torch.int64).cumsum(-1)[:, pos]  # [B, nb*bq] valid keys <= position
    causal = (causal_at * qv).sum(-1).double()[:, None]
    if keep is None:
        return causal, None
    hs = keep.shape[1]
    kept_cum = keep.to(torch.int32).cumsum(-1)
    kept_at = torch.gather(kept_cum, 3, pos.reshape(nb, bq)[None, None].expand(b, hs, nb, bq)).reshape(b, hs, nb * bq)
    if dense_from is not None:
        kept_at[:, :, dense_from:] = causal_at[:, None, dense_from:].to(kept_at.dtype)
    kept = (kept_at * qv[:, None]).sum(-1).double()
    return causal, kept


_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _lse_path_ok(q: torch.Tensor, geo: _Geometry) -> bool:
    """Whether the two-part (diagonal + off-diagonal, log-sum-exp merged) path applies.

    It needs PyTorch's CPU flash-attention kernel, which also returns each row's log-sum-exp;
    other devices and sequences with padding inside the keys take the one-call masked path.
    """
    return (
        _FLASH_LSE is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and bool(geo.key_valid.all())
    )


def _compiled(q: torch.Tensor, geo: _Geometry, cfg: AnchorConfig):
    """The compiled stripe-attention kernel when ``cfg.kernel`` asks for it and it runs here, else ``None``.

    Raises:
        OptionError: ``kernel="compiled"`` for inputs it does not take (not float32 on the CPU,
            or padding inside the keys).
        RuntimeError: ``kernel="compiled"`` where the kernel cannot be built (the message says why).
    """
    if cfg.kernel == "torch":
        return None
    fits = q.device.type == "cpu" and q.dtype == torch.float32 and bool(geo.key_valid.all())
    if cfg.kernel == "auto":
        return stripe_kernel() if fits else None
    if not fits:
        raise OptionError(
            f"kernel='compiled' takes float32 CPU tensors without padding inside the keys, not {q.dtype} on "
            f"{q.device.type}{'' if bool(geo.key_valid.all()) else ' with inner padding'}; use kernel='auto' or 'torch'"
        )
    mod = stripe_kernel()
    if mod is None:
        raise RuntimeError(f"kernel='compiled': {kernel_status()}")
    return mod


def _sparse_attend(q, k, v, keep, geo: _Geometry, cfg: AnchorConfig, scale: float, *, merge: bool | None = None) -> torch.Tensor:
    """Exact attention of each query block over its kept keys.

    With the compiled CPU kernel (``cfg.kernel``, see :func:`_compiled`), each (batch, head, query
    block) gathers its kept keys ``_KV_TILE`` at a time into a per-thread buffer inside a
    flash-attention loop (online softmax, Dao et al. 2022, Alg. 1) that ends with the causal
    diagonal block; nothing of size ``queries x kept keys`` and no gathered copy of K/V is
    materialised, and blocks are handed to the threads one at a time.  Otherwise PyTorch operations:

    Every (batch, head, query block) is one group.  A group's keys are its kept keys before
    the block (gathered, no causal constraint) followed by the block's own ``block_size``
    diagonal keys (always kept, causal).  Groups are sorted by kept count and processed in
    buckets padded only to the bucket's largest count; no Python loop over queries, heads
    or blocks.

    Two ways to run a bucket, with the same result up to float rounding:

    * ``merge=True`` (default on CPU without inner padding): the diagonal blocks of all groups
      are one causal flash-attention call, each bucket's gathered keys one more call with a
      per-group padding mask broadcast over the queries, and the two parts are combined with
      their log-sum-exps (the flash-attention merge, Dao et al. 2022, Sec. 3.1).  Nothing of
      size ``queries x kept keys`` is materialised besides the kernel's own tiles.
    * ``merge=False`` (other devices, padding inside the keys): one fused
      ``scaled_dot_product_attention`` call per bucket with an additive ``[n, bq, mk + bq]`` mask.
    """
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], geo.lk
    g = h // hkv
    bq, nb = cfg.block_size, geo.nb
    dev = q.device
    kern = _compiled(q, geo, cfg) if merge is None else None
    if kern is not None:
        return kern.stripe_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), keep.contiguous(), geo.q_offset, bq, scale, _KV_TILE, _Q_TILE
        )
    if merge is None:
        merge = _lse_path_ok(q, geo)
    n_groups = b * h * nb
    p0 = geo.q_offset + torch.arange(nb, device=dev) * bq  # first query position of each block
    j = torch.arange(lk, device=dev)
    off = (keep & (j < p0[:, None])).reshape(n_groups, lk)  # kept keys strictly before the block
    counts = off.sum(-1)
    qg = _pad_rows(q, nb * bq).reshape(n_groups, bq, d)
    grp = torch.arange(n_groups, device=dev)
    g_b, g_h, g_blk = grp // (h * nb), (grp // nb) % h, grp % nb
    kv_base = (g_b * hkv + g_h // g) * lk  # flat row of key 0 of the group's key/value head
    kflat, vflat = k.reshape(-1, d), v.reshape(-1, d)
    sorted_counts, perm = counts.sort()
    budget = _CHUNK_ELEMENTS // 2

    def buckets():
        i = int((sorted_counts == 0).sum()) if merge else 0
        while i < n_groups:
            width = int(sorted_counts[i]) + (0 if merge else bq)
            i2 = min(n_groups, i + max(1, budget // (bq * max(width, 1))))
            while i2 > i + 1 and (i2 - i) * bq * (int(sorted_counts[i2 - 1]) + bq) > 2 * budget:
                i2 = i + (i2 - i) // 2
            idx = perm[i:i2]
            mk = int(sorted_counts[i2 - 1])
            # [n, mk]: each group's kept keys in ascending order, padded with key 0 (masked out)
            order = torch.zeros(idx.numel(), mk, dtype=torch.long, device=dev)
            if mk:
                r, c = off.index_select(0, idx).nonzero(as_tuple=True)  # row-major: ascending keys per group
                cnt = counts.index_select(0, idx)
                order[r, torch.arange(r.numel(), device=dev) - (cnt.cumsum(0) - cnt)[r]] = c
            yield i2, idx, mk, order
            i = i2

    if merge:
        # diagonal blocks: keys at the block's own positions, causal; padded rows/keys only meet each other
        kd = _pad_rows(k[:, :, geo.q_offset : geo.q_offset + lq], nb * bq).reshape(b, hkv, 1, nb, bq, d)
        vd = _pad_rows(v[:, :, geo.q_offset : geo.q_offset + lq], nb * bq).reshape(b, hkv, 1, nb, bq, d)
        kd = kd.expand(b, hkv, g, nb, bq, d).reshape(n_groups, 1, bq, d)
        vd = vd.expand(b, hkv, g, nb, bq, d).reshape(n_groups, 1, bq, d)
        out, lse = _FLASH_LSE(qg[:, None], kd, vd, 0.0, True, scale=scale)
        out, lse = out[:, 0], lse[:, 0]
        del kd, vd
        for _, idx, mk, order in buckets():
            n = idx.numel()
            rows = (kv_base[idx, None] + order).reshape(-1)
            kk = kflat.index_select(0, rows).reshape(n, 1, mk, d)
            vv = vflat.index_select(0, rows).reshape(n, 1, mk, d)
            c = counts[idx]
            mask = None
            if bool((c < mk).any()):
                pad = torch.zeros(n, 1, 1, mk, dtype=q.dtype, device=dev)
                pad.masked_fill_((torch.arange(mk, device=dev) >= c[:, None])[:, None, None, :], -math.inf)
                mask = pad.expand(n, 1, bq, mk)
            o2, l2 = _FLASH_LSE(qg.index_select(0, idx)[:, None], kk, vv, 0.0, False, attn_mask=mask, scale=scale)
            # out = (o1 e^l1 + o2 e^l2) / (e^l1 + e^l2) = o2 + (o1 - o2) * sigmoid(l1 - l2), in place
            acc = torch.promote_types(out.dtype, torch.float32)
            a = torch.sigmoid(lse.index_select(0, idx) - l2[:, 0]).to(acc)[..., None]  # [n, bq, 1]
            o2 = o2[:, 0].to(acc)
            o1 = out.index_select(0, idx).to(acc)
            out.index_copy_(0, idx, o1.sub_(o2).mul_(a).add_(o2).to(out.dtype))
        return out.reshape(b, h, nb * bq, d)[:, :, :lq]

    diag = p0[:, None] + torch.arange(bq, device=dev)  # [nb, bq]; slot-causal masking handles overrun
    diag_ok = diag < lk
    diag = diag.clamp(max=lk - 1)
    causal_bias = torch.zeros(bq, bq, device=dev).masked_fill(
        torch.ones(bq, bq, dtype=torch.bool, device=dev).triu(1), -math.inf
    )
    out = torch.empty(n_groups, bq, d, dtype=q.dtype, device=dev)
    inner_padding = not bool(geo.key_valid.all())
    for _, idx, mk, order in buckets():
        n = idx.numel()
        slots = torch.cat([order, diag[g_blk[idx]]], 1)  # [n, mk + bq]
        rows = (kv_base[idx, None] + slots).reshape(-1)
        kk = kflat.index_select(0, rows).reshape(n, mk + bq, d)
        vv = vflat.index_select(0, rows).reshape(n, mk + bq, d)
        pad_ok = torch.arange(mk, device=dev) < counts[idx, None]  # [n, mk]
        d_ok = diag_ok[g_blk[idx]]
        if inner_padding:
            d_ok = d_ok & geo.key_valid[g_b[idx, None], diag[g_blk[idx]]]
        bias = torch.empty(n, bq, mk + bq, dtype=q.dtype, device=dev)
        bias[:, :, :mk] = torch.where(pad_ok, 0.0, -math.inf)[:, None, :]
        bias[:, :, mk:] = causal_bias
        bias[:, :, mk:].masked_fill_(~d_ok[:, None, :], -math.inf)
        qq = qg.index_select(0, idx)
        o = F.scaled_dot_product_attention(qq[:, None], kk[:, None], vv[:, None], attn_mask=bias[:, None], scale=scale)[:, 0]
        out[idx] = o.nan_to_num(0.0) if inner_padding else o
    return out.reshape(b, h, nb * bq, d)[:, :, :lq]


def _block_mass(qpad, kf, keep, geo: _Geometry, cfg: AnchorConfig, scale: float, c0: int, c1: int) -> torch.Tensor:
    """``[B, H, (c1 - c0) * block_size]`` exact softmax mass (over valid causal keys) on the kept keys of
    the queries of blocks ``c0 .. c1 - 1``; ``qpad`` ``[B, H, nb * block_size, D]`` and ``kf`` in float32.

    The logit scale is folded into the block's queries and the causal mask touches only the keys at or
    after the block's first query.
    """
    b, h = qpad.shape[:2]
    hkv = kf.shape[1]
    bq = cfg.block_size
    dev = qpad.device
    r0, r1 = c0 * bq, c1 * bq
    lc = min(geo.lk, geo.q_offset + r1)  # keys after the last query are never causal
    qc = _grouped(qpad[:, :, r0:r1], hkv) * scale
    s = torch.einsum("bkgqd,bkjd->bkgqj", qc, kf[:, :, :lc]).reshape(b, h, r1 - r0, lc)
    c = max(0, min(lc, geo.q_offset + r0))  # causality only masks keys at or after the first query
    i = geo.q_offset + torch.arange(r0, r1, device=dev)
    j = torch.arange(c, lc, device=dev)
    s[..., c:].masked_fill_((j[None, :] > i[:, None])[None, None], -math.inf)
    if not bool(geo.key_valid[:, :lc].all()):
        s.masked_fill_(~geo.key_valid[:, None, None, :lc], -math.inf)
    p = torch.softmax(s, -1).view(b, h, c1 - c0, bq, lc)
    mass = torch.einsum("bhnqj,bhnj->bhnq", p, keep[:, :, c0:c1, :lc].to(p.dtype))
    return mass.reshape(b, h, r1 - r0).nan_to_num_(0.0).double()  # a row without any valid key has mass 0


def _kept_mass(q, k, keep, geo: _Geometry, cfg: AnchorConfig, scale: float) -> torch.Tensor:
    """``[B, H, Lq]`` exact softmax mass (over valid causal keys) carried by each query's kept keys.

    One dense softmax pass in chunks of query blocks (never an ``Lq x Lk`` buffer for all
    queries at once); the kept mass of a block's queries is a product with the block's stripe mask.
    """
    b, h, lq, d = q.shape
    bq, nb = cfg.block_size, geo.nb
    qpad = _pad_rows(q.float(), nb * bq)
    kf = k.float()
    out = torch.empty(b, h, nb * bq, dtype=torch.float64, device=q.device)
    step = max(1, _CHUNK_ELEMENTS // max(b * h * bq * geo.lk, 1))
    for c0 in range(0, nb, step):
        c1 = min(nb, c0 + step)
        out[:, :, c0 * bq : c1 * bq] = _block_mass(qpad, kf, keep, geo, cfg, scale, c0, c1)
    return out[:, :, :lq]


def _probe_blocks(cfg: AnchorConfig, n_sparse: int) -> list[int]:
    """Evenly spaced query blocks (holding sparse queries) the recall guard measures."""
    nsb = -(-n_sparse // cfg.block_size)
    if nsb <= 0:
        return []
    m = min(cfg.recall_probes, nsb)
    return sorted({(nsb - 1) * i // max(m - 1, 1) for i in range(m)})


def _causal_probe_blocks(cfg: AnchorConfig, q_offset: int, nb: int) -> list[int]:
    """Query blocks the causal recall guard (``guard="causal"``) measures, among ``0 .. nb - 1``.

    ``f - 1 + d`` for ``d`` in 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (the powers of two and 1.5 times
    them: two probes per doubling of the distance), where ``f`` is the first block whose causal
    keys are not all inside the initial block and the local window (``f = max(0, (init_block +
    local_window - q_offset) // block_size)``; earlier blocks keep every causal key).  The set
    depends on the options and ``q_offset`` only, never on the prompt's length or tokens.
    """
    bq = cfg.block_size
    f = max(0, (cfg.init_block + cfg.local_window - q_offset) // bq)
    out, d = [], 1
    while f - 1 + d < nb:
        out.append(f - 1 + d)
        d = d + 1 if d < 2 else (d * 3 // 2 if d & (d - 1) == 0 else d * 4 // 3)
    return out


def _probe_masses(q, k, keep, geo: _Geometry, cfg: AnchorConfig, scale: float, blocks: list[int]):
    """``[B, H, block_size]`` exact softmax mass on the kept keys of the rows of each of ``blocks`` (an iterable).

    With the compiled CPU kernel (``cfg.kernel``) one pass over the probe blocks' causal keys keeps
    running sums of exp over all and over the kept keys; otherwise a softmax per probe block.
    """
    b, h = q.shape[:2]
    bq = cfg.block_size
    kern = _compiled(q, geo, cfg)
    if kern is not None and blocks:
        return kern.kept_mass(
            q.contiguous(), k.contiguous(), keep.contiguous(), torch.tensor(blocks), geo.q_offset, bq, scale,
            _KV_TILE, _Q_TILE,
        ).view(b, h, len(blocks), bq).unbind(2)
    qpad = _pad_rows(q.float(), geo.nb * bq)
    kf = k.float()
    return (_block_mass(qpad, kf, keep, geo, cfg, scale, blk, blk + 1) for blk in blocks)


def _probe_recall(q, k, keep, geo: _Geometry, cfg: AnchorConfig, scale: float, n_sparse: int) -> torch.Tensor:
    """``[B, H]`` exact softmax mass on the kept keys, averaged over the valid sparse queries of the probe blocks
    (the global recall guard, ``guard="global"``)."""
    b, h = q.shape[:2]
    bq = cfg.block_size
    blocks = _probe_blocks(cfg, n_sparse)
    tot = torch.zeros(b, h, dtype=torch.float64, device=q.device)
    cnt = torch.zeros(b, dtype=torch.float64, device=q.device)
    for blk, mass in zip(blocks, _probe_masses(q, k, keep, geo, cfg, scale, blocks)):
        r0 = blk * bq
        rows = torch.arange(r0, r0 + bq, device=q.device) < n_sparse  # queries after n_sparse attend densely
        qv = (geo.query_valid[:, r0 : r0 + bq] & rows).double()
        tot += (mass * qv[:, None]).sum(-1)
        cnt += qv.sum(-1)
    return tot / cnt.clamp(min=1)[:, None]


def _causal_guard(q, k, keep, geo: _Geometry, cfg: AnchorConfig, scale: float) -> torch.Tensor | None:
    """``[B, H, nb]`` bool: the query blocks that the causal recall guard (``guard="causal"``) makes dense, or
    ``None`` when it makes none dense.

    The recall of a probe block (:func:`_causal_probe_blocks`) is the exact softmax mass on its kept keys,
    averaged over its valid queries (all of them: ``dense_last`` plays no part, so the decision does not
    depend on the prompt's length).  Block ``j >= f`` (the first probe) is dense in a head when the mean
    recall of the probes ``p_1 < ... < p_m <= j`` is below ``min_recall``, probe ``p_i`` weighted by the
    blocks it stands for up to ``j`` (``p_{i+1} - p_i``, and ``j + 1 - p_m`` for the last): an estimate of
    the mean recall of blocks ``f .. j``.  Block ``j``'s decision therefore reads keys and queries at or
    before block ``j``'s last query only.
    """
    b, h = q.shape[:2]
    bq, nb = cfg.block_size, geo.nb
    blocks = _causal_probe_blocks(cfg, geo.q_offset, nb)
    if not blocks:
        return None
    dev = q.device
    rec = torch.empty(b, h, len(blocks), dtype=torch.float64, device=dev)
    for i, (blk, mass) in enumerate(zip(blocks, _probe_masses(q, k, keep, geo, cfg, scale, blocks))):
        qv = geo.query_valid[:, blk * bq : (blk + 1) * bq].double()
        n = qv.sum(-1)[:, None]
        # a probe block without a valid query has lost nothing
        rec[:, :, i] = torch.where(n > 0, (mass * qv[:, None]).sum(-1) / n.clamp(min=1), 1.0)
    p = torch.tensor(blocks, device=dev)
    nxt = torch.cat([p[1:], p.new_tensor([nb])])
    before = torch.cumsum(rec * (nxt - p).double(), -1) - rec * (nxt - p).double()  # sum over the earlier probes
    j = torch.arange(nb, device=dev)
    last = torch.searchsorted(p, j, right=True) - 1  # [nb] latest probe at or before each block, -1 if none
    li = last.clamp(min=0)
    total = before[:, :, li] + rec[:, :, li] * (j + 1 - p[li]).double()
    low = (total / (j + 1 - p[0]).clamp(min=1).double() < cfg.min_recall) & (last >= 0)
    return low if bool(low.any()) else None


def anchor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AnchorConfig,
    *,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    dense_heads: list[int] | tuple[int, ...] = (),
    return_stats: bool = False,
    compute_recall: bool = False,
) -> tuple[torch.Tensor, AnchorStats | None]:
    """AnchorAttention sparse prefill (arXiv 2505.23520, Sec. 3, Eq. 2-4), fast batched implementation.

    Selection (anchors, pooled scores) is computed in fp32 (the stripe-scoring product in
    bfloat16 with ``select_dtype="bfloat16"``) on grouped query heads, without repeating keys.
    Attention over kept stripes: float32 CPU tensors run the compiled kernel (``cfg.kernel``; each
    (batch, head, query block) gathers its kept keys tile by tile inside an online-softmax loop,
    K/V never repeated or copied whole); other inputs gather, per (batch, head, query block), the
    kept keys padded to the largest kept set of a bucket of blocks sorted by kept count, and run
    batched fused attention.  There is no Python loop over queries or heads (see ``_sparse_attend``).

    Speed and recall of the defaults and of faster settings, against causal SDPA on captured inputs:
    BENCHMARKS.md.  Heads the global recall
    guard makes dense run PyTorch's fused causal attention (one call per key/value head, K/V not repeated);
    blocks the causal guard makes dense run the compiled kernel over every causal key, or on the PyTorch path
    fused attention over the rows from the first guarded block (:func:`_dense_rows`).

    Args:
        q: ``[B, H, Lq, D]`` queries at absolute positions ``q_offset .. q_offset+Lq-1``.
        k, v: ``[B, Hkv, Lk, D]``, ``H % Hkv == 0``; ``Lk >= q_offset + Lq``.
        cfg: :class:`AnchorConfig`.
        scale: logit scale.
        q_offset: absolute position of the first query (``Lk - Lq`` for a prompt continued on a cache).
        key_valid: ``[B, Lk]`` bool, False at padding keys (left padding), or ``None``.
        dense_heads: query-head indices that attend densely (all causal keys).
        return_stats: also return :class:`AnchorStats` (sparsity, kept columns per block).
        compute_recall: also fill ``AnchorStats.recall`` (exact softmax mass on kept keys; costs
            one dense ``Q K^T`` pass in query chunks, never an ``Lq x Lk`` buffer).

    Returns:
        ``(out, stats)``: ``out`` is ``[B, H, Lq, D]`` in ``q.dtype``; queries with no valid key
        (padding) give zeros.  ``stats`` is ``None`` unless requested.

    Raises:
        ValueError: inputs that do not fit: ranks, batch or head dim of ``q`` and ``k``, ``v`` shaped
            unlike ``k``, ``H`` not a multiple of ``Hkv``, ``q_offset < 0`` or ``Lk < q_offset + Lq``,
            ``key_valid`` not bool ``[B, Lk]``, a scale that is not a positive finite number.
        OptionError: a ``dense_heads`` index outside ``0..H-1``; ``kernel="compiled"`` for inputs
            it does not take.
        RuntimeError: ``kernel="compiled"`` where the compiled kernel cannot be built.
    """
    _check_inputs(q, k, v, scale, q_offset, key_valid)
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    want_stats = return_stats or compute_recall
    split = _split_padding(key_valid, q_offset, lq)
    if split is not None:
        return _per_sequence(
            anchor_attention, q, k, v, cfg, split, scale=scale, q_offset=q_offset, key_valid=key_valid,
            dense_heads=dense_heads, return_stats=return_stats, compute_recall=compute_recall,
        )
    n_dense = min(cfg.dense_last, lq)
    ls = lq - n_dense  # queries that follow the sparse rule; the last n_dense attend densely
    dense_set = sorted({int(x) for x in dense_heads})
    if any(x < 0 or x >= h for x in dense_set):
        raise OptionError(f"dense_heads={dense_set}: head indices must be in 0..{h - 1}")
    geo = _geometry(q, k, cfg, q_offset, key_valid)
    sparse_heads = [x for x in range(h) if x not in dense_set]
    if cfg.theta == math.inf or not sparse_heads or ls == 0 or lq < cfg.min_len:
        # every causal key is kept (or the prompt is shorter than min_len): exactly dense
        out = dense_causal_attention(q, k, v, scale=scale, q_offset=q_offset, key_valid=key_valid)
        stats = None
        if want_stats:
            causal = _pair_counts(None, geo, cfg)[0].expand(b, h).clone()
            stats = AnchorStats(causal, causal.clone(), None, torch.ones_like(causal) if compute_recall else None)
        return out, stats
    g = h // hkv
    if dense_set:
        sidx = torch.tensor(sparse_heads, device=q.device)
        qh, kh, vh = q.index_select(1, sidx), k.index_select(1, sidx // g), v.index_select(1, sidx // g)
    else:
        qh, kh, vh = q, k, v
    keep = _select(qh, kh, cfg, scale, geo)
    low = None  # [B, Hs, nb] bool: the (sequence, head, query block) triples the recall guard makes dense
    if cfg.min_recall > 0 and cfg.guard == "global":  # heads that lose too much mass on the probe blocks
        heads_low = _probe_recall(qh, kh, keep, geo, cfg, scale, ls) < cfg.min_recall  # [B, Hs]
        low = heads_low[:, :, None].expand(-1, -1, geo.nb) if bool(heads_low.any()) else None
    elif cfg.min_recall > 0:  # causal: blocks whose probes so far lost too much mass
        low = _causal_guard(qh, kh, keep, geo, cfg, scale)
    if low is None:
        o = _sparse_attend(qh, kh, vh, keep, geo, cfg, scale)
    elif cfg.guard == "causal" and _compiled(qh, geo, cfg) is not None:
        # the compiled kernel takes a guarded block's every causal key at about the fused kernel's cost per pair
        o = _sparse_attend(qh, kh, vh, torch.where(low[..., None], _causal_keys(geo)[:, None], keep), geo, cfg, scale)
    else:
        # guarded blocks gather nothing (diagonal block only) and take the fused dense result
        o = _sparse_attend(qh, kh, vh, keep.masked_fill(low[..., None], False), geo, cfg, scale)
        if cfg.guard == "global":
            dense = _dense_heads(qh, kh, vh, low[:, :, 0].any(0), scale, q_offset, key_valid)
            o = torch.where(low[:, :, :1, None], dense, o)
        else:
            r0 = int(low.any(1).any(0).nonzero()[0]) * cfg.block_size  # first guarded query row
            if r0 < ls:  # rows from ls on attend densely anyway (dense_last)
                rows = low.repeat_interleave(cfg.block_size, -1)[:, :, r0:ls, None]
                dense = _dense_rows(qh, kh, vh, low.any(-1).any(0), scale, geo, r0, ls)
                o[:, :, r0:ls] = torch.where(rows, dense, o[:, :, r0:ls])
    if dense_set:
        configured = torch.zeros(h, dtype=torch.bool, device=q.device)
        configured[dense_set] = True
        out = _dense_heads(q, k, v, configured, scale, q_offset, key_valid)
        out[:, sidx] = o
    else:
        out = o
    if n_dense:
        out[:, :, ls:] = dense_causal_attention(
            q[:, :, ls:], k, v, scale=scale, q_offset=q_offset + ls, key_valid=key_valid
        )
    if not want_stats:
        return out, None
    if low is not None:  # guarded blocks kept every causal key
        keep = torch.where(low[..., None], _causal_keys(geo)[:, None], keep)
    causal, kept_s = _pair_counts(keep, geo, cfg, dense_from=ls)
    causal = causal.expand(b, h).clone()
    kept = causal.clone()
    kept[:, sparse_heads] = kept_s
    kept_cols = torch.full((b, h, geo.nb), -1, dtype=torch.long, device=q.device)
    kept_cols[:, sparse_heads] = keep.sum(-1)
    stats = AnchorStats(causal, kept, kept_cols)
    if compute_recall:
        r = _kept_mass(qh, kh, keep, geo, cfg, scale)  # [B, Hs, Lq]
        r[:, :, ls:] = 1.0
        qv = geo.query_valid[:, :lq].double()
        recall = torch.ones(b, h, dtype=torch.float64, device=q.device)
        recall[:, sparse_heads] = (r * qv[:, None]).sum(-1) / qv.sum(-1).clamp(min=1)[:, None]
        stats.recall = recall
    return out, stats


def _dense_heads(q, k, v, heads: torch.Tensor, scale: float, q_offset: int, key_valid) -> torch.Tensor:
    """``[B, H, Lq, D]`` exact causal attention for the query heads where ``heads`` ([H] bool) is True
    (zeros elsewhere): one fused call per key/value head over its selected query heads, K/V not repeated."""
    h, hkv = q.shape[1], k.shape[1]
    g = h // hkv
    out = torch.zeros_like(q)
    for kvh in range(hkv):
        sel = heads[kvh * g : (kvh + 1) * g].nonzero().flatten() + kvh * g
        if sel.numel():
            out[:, sel] = dense_causal_attention(
                q.index_select(1, sel), k[:, kvh : kvh + 1], v[:, kvh : kvh + 1],
                scale=scale, q_offset=q_offset, key_valid=key_valid,
            )
    return out


def _dense_rows(q, k, v, heads: torch.Tensor, scale: float, geo: _Geometry, r0: int, r1: int) -> torch.Tensor:
    """``[B, H, r1 - r0, D]`` exact causal attention of the query rows ``r0 .. r1 - 1`` (absolute positions
    ``q_offset + r0 ..``) for the query heads where ``heads`` ([H] bool) is True, zeros elsewhere.

    On the CPU without inner padding (:func:`_lse_path_ok`): per key/value head, one flash-attention call
    over the keys before the rows and one causal call over the rows' own keys, merged by their
    log-sum-exps (Dao et al. 2022, Sec. 3.1); K/V are not repeated.  Otherwise :func:`_dense_heads` in
    chunks of about ``_CHUNK_ELEMENTS / Lk`` rows, each against the keys up to its own last query (a
    chunk's mask is ``rows x keys`` booleans, never ``Lq x Lk``).
    """
    b, h, _, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    p0, p1 = geo.q_offset + r0, geo.q_offset + r1
    if not _lse_path_ok(q, geo):
        key_valid = geo.key_valid
        out = q.new_zeros(b, h, r1 - r0, d)
        step = max(1, _CHUNK_ELEMENTS // max(k.shape[2], 1))
        for c0 in range(r0, r1, step):
            c1 = min(r1, c0 + step)
            e = geo.q_offset + c1  # keys after the chunk's last query are causal for none of its rows
            out[:, :, c0 - r0 : c1 - r0] = _dense_heads(
                q[:, :, c0:c1], k[:, :, :e], v[:, :, :e], heads, scale, geo.q_offset + c0, key_valid[:, :e]
            )
        return out
    out = q.new_zeros(b, h, r1 - r0, d)
    for kvh in range(hkv):
        sel = heads[kvh * g : (kvh + 1) * g].nonzero().flatten() + kvh * g
        if not sel.numel():
            continue
        n = sel.numel()
        qq = q[:, sel, r0:r1]
        kk = k[:, kvh : kvh + 1].expand(b, n, *k.shape[2:])
        vv = v[:, kvh : kvh + 1].expand(b, n, *v.shape[2:])
        o1, l1 = _FLASH_LSE(qq, kk[:, :, p0:p1], vv[:, :, p0:p1], 0.0, True, scale=scale)[:2]  # the rows' own keys
        if p0 > 0:  # every key before the rows: no mask
            o2, l2 = _FLASH_LSE(qq, kk[:, :, :p0], vv[:, :, :p0], 0.0, False, scale=scale)[:2]
            acc = torch.promote_types(q.dtype, torch.float32)
            a = torch.sigmoid(l1 - l2).to(acc)[..., None]
            o2 = o2.to(acc)
            o1 = (o1.to(acc) - o2).mul_(a).add_(o2).to(q.dtype)
        out[:, sel] = o1
    return out


def _split_padding(key_valid: torch.Tensor | None, q_offset: int, lq: int) -> list[tuple[int, int]] | None:
    """``(first, end)`` valid key range of each sequence when any sequence is padded, else ``None``.

    Query blocks, the initial block, the local window and ``dense_last`` are defined relative
    to each sequence's own first and last real tokens, so a padded sequence (left padding,
    or right padding in a prompt) is computed exactly as it would be alone.
    """
    if key_valid is None:
        return None
    lk = key_valid.shape[1]
    any_valid = key_valid.any(1)
    first = torch.argmax(key_valid.to(torch.int8), dim=1)
    end = lk - torch.argmax(key_valid.flip(1).to(torch.int8), dim=1)
    first = torch.where(any_valid, first, 0)
    end = torch.where(any_valid, end, 0)
    # keys after the last query are empty cache slots or future tokens, not padding to strip
    end = end.clamp(max=q_offset + lq)
    if bool((first == 0).all()) and bool((end == q_offset + lq).all()):
        return None
    return [(int(a), int(e)) for a, e in zip(first, end)]


def _per_sequence(fn, q, k, v, cfg, ranges, *, scale, q_offset, key_valid, dense_heads, return_stats, compute_recall):
    """Run ``fn`` on each sequence with its padding stripped; padded query rows get zeros."""
    b, h, lq, d = q.shape
    out = torch.zeros_like(q)
    parts = []
    for bi, (p, e) in enumerate(ranges):
        qi0 = min(lq, max(0, p - q_offset))
        qi1 = max(qi0, min(lq, e - q_offset))
        if qi1 <= qi0:
            parts.append(None)
            continue
        kv = key_valid[bi : bi + 1, p:e]
        o, st = fn(
            q[bi : bi + 1, :, qi0:qi1], k[bi : bi + 1, :, p:e], v[bi : bi + 1, :, p:e], cfg, scale=scale,
            q_offset=q_offset + qi0 - p, key_valid=None if bool(kv.all()) else kv, dense_heads=dense_heads,
            **({"return_stats": return_stats, "compute_recall": compute_recall} if fn is anchor_attention else {}),
        )
        out[bi : bi + 1, :, qi0:qi1] = o
        parts.append(st if fn is anchor_attention else (qi0, p, st))
    if fn is not anchor_attention:  # the reference returns the kept mask [1, H, Lq', Lk']
        kept = torch.zeros(b, h, lq, k.shape[2], dtype=torch.bool)
        for bi, part in enumerate(parts):
            if part is not None:
                qi0, p, km = part
                kept[bi, :, qi0 : qi0 + km.shape[2], p : p + km.shape[3]] = km[0]
        return out, kept
    if not (return_stats or compute_recall):
        return out, None
    zero = torch.zeros(1, h, dtype=torch.float64, device=q.device)
    causal = torch.cat([zero if st is None else st.causal_pairs for st in parts])
    kept = torch.cat([zero if st is None else st.kept_pairs for st in parts])
    recall = None
    if compute_recall:
        recall = torch.cat([torch.ones_like(zero) if st is None else st.recall for st in parts])
    nbs = [st.kept_columns.shape[-1] for st in parts if st is not None and st.kept_columns is not None]
    cols = None
    if nbs:
        cols = torch.full((b, h, max(nbs)), -1, dtype=torch.long, device=q.device)
        for bi, st in enumerate(parts):
            if st is not None and st.kept_columns is not None:
                cols[bi, :, : st.kept_columns.shape[-1]] = st.kept_columns[0]
    return out, AnchorStats(causal, kept, cols, recall)


def anchor_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AnchorConfig,
    *,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    dense_heads: list[int] | tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow, explicit AnchorAttention (arXiv 2505.23520 Eq. 2-4) with Python loops, for tests.

    Same arguments and semantics as :func:`anchor_attention` (fp64 arithmetic).

    Returns:
        ``(out, kept)``: ``out`` ``[B, H, Lq, D]`` in ``q.dtype``; ``kept`` ``[B, H, Lq, Lk]`` bool,
        the keys each query attended.  Left-padded sequences are computed with their padding
        stripped (blocks relative to the first real token), exactly as :func:`anchor_attention`.
    """
    _check_inputs(q, k, v, scale, q_offset, key_valid)
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    split = _split_padding(key_valid, q_offset, lq)
    if split is not None:
        return _per_sequence(
            anchor_attention_reference, q, k, v, cfg, split, scale=scale, q_offset=q_offset, key_valid=key_valid,
            dense_heads=dense_heads, return_stats=False, compute_recall=False,
        )
    g = h // hkv
    bq = cfg.block_size
    out = torch.zeros(b, h, lq, d, dtype=torch.float64)
    kept = torch.zeros(b, h, lq, lk, dtype=torch.bool)
    qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
    valid = torch.ones(b, lk, dtype=torch.bool) if key_valid is None else key_valid.cpu()
    # prompts shorter than min_len run dense; otherwise the last dense_last queries do
    n_sparse = 0 if lq < cfg.min_len else lq - min(cfg.dense_last, lq)
    nb = -(-lq // bq)
    causal_guard = cfg.guard == "causal"
    probes = set()
    if cfg.min_recall > 0:
        probes = set(_causal_probe_blocks(cfg, q_offset, nb) if causal_guard else _probe_blocks(cfg, n_sparse))
    for bi in range(b):
        start = next((j for j in range(lk) if valid[bi, j]), lk)
        initial = set(range(start, min(start + cfg.init_block, lk)))
        for hi in range(h):
            kv = hi // g
            sels = {}
            for b0 in range(0, lq, bq):
                rows = list(range(b0, min(b0 + bq, lq)))
                end = q_offset + rows[-1] + 1  # one past the block's last query position
                window = set(range(max(0, end - cfg.local_window), end))
                always = {j for j in initial | window if j < end and valid[bi, j]}
                # anchors of the block's valid queries
                anchors = {}
                for i in rows:
                    p = q_offset + i
                    if not valid[bi, p]:
                        continue
                    cand = [j for j in (initial | window) if j <= p and valid[bi, j]]
                    anchors[i] = max(float(qd[bi, hi, i] @ kd[bi, kv, j]) * scale for j in cand)
                dense_rows = hi in dense_heads or n_sparse == 0
                sel = set(always)
                if not dense_rows and anchors:
                    vis = [i for i in rows if i in anchors]
                    pools = [[i for i in vis if (i - b0) // cfg.stride == p] for p in range(bq // cfg.stride)]
                    for pool in pools:
                        if not pool:
                            continue
                        qbar = sum(qd[bi, hi, i] for i in pool) / len(pool)
                        abar = sum(anchors[i] for i in pool) / len(pool)
                        for j in range(end):
                            if valid[bi, j] and abar - float(qbar @ kd[bi, kv, j]) * scale <= cfg.theta:
                                sel.add(j)
                sels[b0] = (rows, sel, dense_rows)
            # recall guard: exact kept mass over the probe blocks' queries (global: the sparse ones only)
            block_dense = set()  # query block indices that attend densely
            if probes and hi not in dense_heads and n_sparse > 0:
                masses = {}
                for b0, (rows, sel, _) in sels.items():
                    if b0 // bq not in probes:
                        continue
                    for i in rows:
                        p = q_offset + i
                        if (i >= n_sparse and not causal_guard) or not valid[bi, p]:
                            continue
                        cols = [j for j in range(p + 1) if valid[bi, j]]
                        pr = torch.softmax(torch.stack([qd[bi, hi, i] @ kd[bi, kv, j] for j in cols]) * scale, 0)
                        masses.setdefault(b0 // bq, []).append(sum(float(pr[n]) for n, j in enumerate(cols) if j in sel))
                if not causal_guard:
                    allm = [x for m in masses.values() for x in m]
                    if allm and sum(allm) / len(allm) < cfg.min_recall:
                        block_dense = set(range(nb))
                else:
                    # block J: mean recall of the probes <= J, each weighted by the blocks up to the next probe (or J)
                    plist = sorted(probes)
                    rec = {pb: sum(masses[pb]) / len(masses[pb]) if masses.get(pb) else 1.0 for pb in plist}
                    for jb in range(nb):
                        seen = [pb for pb in plist if pb <= jb]
                        if not seen:
                            continue
                        wts = [(seen[n + 1] if n + 1 < len(seen) else jb + 1) - pb for n, pb in enumerate(seen)]
                        if sum(w * rec[pb] for w, pb in zip(wts, seen)) / sum(wts) < cfg.min_recall:
                            block_dense.add(jb)
            for b0, (rows, sel, dense_rows) in sels.items():
                dense_rows = dense_rows or b0 // bq in block_dense
                for i in rows:
                    p = q_offset + i
                    if dense_rows or i >= n_sparse:
                        cols = [j for j in range(p + 1) if valid[bi, j]]
                    else:
                        cols = sorted(j for j in sel if j <= p)
                    if not cols:
                        continue
                    kept[bi, hi, i, cols] = True
                    s = torch.stack([qd[bi, hi, i] @ kd[bi, kv, j] for j in cols]) * scale
                    pr = torch.softmax(s, 0)
                    out[bi, hi, i] = sum(pr[n] * vd[bi, kv, j] for n, j in enumerate(cols))
    return out.to(q.dtype), kept
