"""Block-sparse causal prefill with XAttention's antidiagonal block scores and cumulative-mass block selection.

Source: "XAttention: Block Sparse Attention with Antidiagonal Scoring" (Xu et al., arXiv 2503.16428), Sec. 2:

1. *Antidiagonal scoring* (Sec. 2.1): queries and keys are cut into blocks of ``block_size`` tokens; inside
   a block, every ``stride x stride`` tile of the logit matrix is represented by the mean of its antidiagonal,
   ``e_ag = c / S * sum_{s<S} q_{aS+S-1-s} . k_{gS+s}`` (``S`` the stride, ``c`` the attention scale).  This is
   one product of the strided, reordered queries ``[N/S, S D]`` with the strided keys ``[N/S, S D]``: ``1/S``
   of the work of ``Q K^T``.
2. *Block mass*: each strided query row ``a`` is softmax-normalised over its causal strided keys
   (``g <= a``, in float32) and the probabilities are summed over the ``(block_size / S)^2`` tiles of a
   (query block, key block) pair, which estimates the attention mass the key block receives from the query
   block; the masses of a query block's causal key blocks sum to one per strided row.
3. *Threshold block selection* (Sec. 2.2): per query block, the first key block(s) (those holding the first
   ``block_size`` keys) and the diagonal block are always kept; the other causal key blocks are kept in
   descending order of mass while the mass of the blocks kept before them is below ``threshold`` x the
   query block's total: the smallest such set whose share reaches ``threshold`` (the reference code's
   ``cumsum < threshold`` test also counts the block itself, and stops one block earlier).
   ``threshold >= 1`` keeps every causal key block, including blocks whose estimated mass is 0.
4. *Sparse attention*: each query block attends by exact softmax to the keys of its kept blocks, causally
   inside the diagonal block (AnchorAttention's stripe attention over the block mask expanded to keys:
   the compiled CPU kernel for float32 CPU inputs without inner padding, else PyTorch operations; or, with
   ``kernel="flex"``, the kept blocks as a FlexAttention ``BlockMask``: :func:`~attnpatch.attention.flex_patterns.block_flex`).

Block geometry.  Query blocks start at the call's first query; key blocks are aligned to them, so that the
diagonal key block of a query block is the block of its own positions.  A prompt continued on a cache
(``q_offset > 0``) splits its cached keys into blocks ending where the new queries start (the first one then
holds ``q_offset mod block_size`` keys, and the next block is kept as a first block too).  With key padding,
each sequence is computed alone with its padding stripped (blocks counted from its first real token).

Pure tensor functions on ``[batch, heads, tokens, head_dim]`` tensors; keys/values may have fewer heads
(grouped-query attention) and are not repeated.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .anchor.attend import pair_counts, sparse_attend
from .anchor.config import AnchorConfig
from .anchor.guard import kept_mass
from .anchor.select import call_geometry
from .flex import choose_kernel, flex_attend
from .flex_patterns import block_flex
from .prefill import check_inputs, per_sequence, split_padding

__all__ = [
    "BlockTopkStats", "block_geometry", "antidiagonal_block_mass", "select_blocks", "block_topk_keep", "block_topk_attention",
    "KERNELS",
]

#: ``kernel`` values: ``"auto"`` (FlexAttention on CUDA and, on the CPU, from :data:`CPU_FLEX_MIN_KEYS` keys; else
#: ``"gather"``), ``"flex"`` (:func:`~attnpatch.attention.flex_patterns.block_flex`), ``"gather"`` (AnchorAttention's stripe
#: attention: the compiled CPU kernel for float32 CPU inputs where it builds, else PyTorch operations), and
#: ``"compiled"`` / ``"torch"`` (that stripe attention's two kernels, as AnchorAttention's ``kernel`` option).
KERNELS = ("auto", "flex", "gather", "compiled", "torch")
#: ``kernel="auto"`` on the CPU: FlexAttention from this many keys (``q_offset + Lq``) on, else the gather path;
#: ``None``: never.  ``None`` because the gather path measured faster on the CPU at every length tried, with about
#: half the causal pairs kept (``benchmarks/flex_cpu.py``, side by side; the numbers: docs/benchmarks/cpu.md); set it where
#: a CPU's FlexAttention kernel measures faster.  On CUDA ``"auto"`` is always flex.
CPU_FLEX_MIN_KEYS: int | None = None
# Elements of the strided score matrix (all batch items and heads) held at once.
CHUNK_ELEMENTS = 1 << 23


@dataclass
class BlockTopkStats:
    """Per-call statistics of :func:`block_topk_attention`.

    Attributes:
        causal_pairs: ``[B, H]`` float64 causal (query, key) pairs among valid tokens.
        kept_pairs: ``[B, H]`` float64 pairs computed (kept blocks, causal).
        kept_blocks: ``[B, H, nbq]`` kept key blocks per query block (``-1`` for a block of a sequence
            that has fewer).
        recall: ``[B, H]`` float64 mean over valid queries of the exact softmax mass on the kept keys, or ``None``.
    """

    causal_pairs: torch.Tensor
    kept_pairs: torch.Tensor
    kept_blocks: torch.Tensor
    recall: torch.Tensor | None = None


def block_geometry(lq: int, q_offset: int, block_size: int) -> tuple[int, int, int]:
    """``(left_pad, first_diag, n_key_blocks)`` of the block grid (tokens, block indices).

    ``left_pad = (-q_offset) mod block_size`` empty key slots put before key 0 so that the queries start on a
    block boundary; query block ``i``'s diagonal key block is ``first_diag + i``; ``n_key_blocks`` key blocks
    cover the keys ``0 .. q_offset + lq - 1``.
    """
    lp = (-q_offset) % block_size
    c0 = (lp + q_offset) // block_size
    return lp, c0, c0 + -(-lq // block_size)


def _check_options(block_size: int, stride: int, threshold: float) -> None:
    if block_size < 1 or stride < 1 or block_size % stride:
        raise ValueError(f"block_size={block_size} must be a positive multiple of stride={stride}")
    if not (0.0 <= threshold <= 1.0):
        raise ValueError(f"threshold={threshold!r}: must be in [0, 1]")


def antidiagonal_block_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    stride: int,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """XAttention's estimated attention mass of every (query block, key block) pair (steps 1-2 of the module docstring).

    Args:
        q: ``[B, H, Lq, D]`` queries at positions ``q_offset ..``.
        k: ``[B, Hkv, Lk, D]`` keys, ``Lk >= q_offset + Lq`` (later keys are ignored).
        block_size: tokens per block, a multiple of ``stride``.
        stride: antidiagonal stride ``S`` (tokens).
        scale: attention scale.
        q_offset: absolute position of the first query.
        key_valid: ``[B, Lk]`` bool or ``None``; invalid keys count as zero vectors, strided key groups
            without a valid key get no mass.

    Returns:
        ``[B, H, nbq, nbk]`` float32 (float64 for float64 inputs), ``nbq = ceil(Lq / block_size)``, ``nbk`` from
        :func:`block_geometry`; zero for non-causal blocks.  Each query block's row sums to the number of its
        strided rows holding a query (``block_size / stride`` for whole blocks).

    Raises:
        ValueError: ``block_size`` not a positive multiple of ``stride``.
    """
    _check_options(block_size, stride, 0.0)
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    bs, st = block_size, stride
    r = bs // st
    lp, c0, nbk = block_geometry(lq, q_offset, bs)
    nbq = nbk - c0
    lk = q_offset + lq
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kk = k[:, :, :lk].to(acc)
    valid_groups = None
    if key_valid is not None and not bool(key_valid[:, :lk].all()):
        kv = key_valid[:, :lk]
        kk = kk * kv[:, None, :, None].to(acc)
        kvp = F.pad(kv, (lp, nbk * bs - lp - lk))
        valid_groups = kvp.reshape(b, nbk * r, st).any(-1)  # [B, nbk * r]
    # sum_s q_{aS+S-1-s} . k_{jS+s} = sum_t q_{aS+t} . k_{jS+S-1-t}: strided query rows as they are (a view when
    # no padding is needed), each group of S keys in reverse order
    kpad = F.pad(kk, (0, 0, lp, nbk * bs - lp - lk))
    rk = kpad.reshape(b, hkv, nbk * r, st, d).flip(3).reshape(b, hkv, nbk * r, st * d)
    qpad = F.pad(q.to(acc), (0, 0, 0, nbq * bs - lq)) if nbq * bs != lq else q.to(acc)
    rq = qpad.reshape(b, hkv, g, nbq * r, st * d)  # row a: queries aS .. aS+S-1, concatenated
    first_group = lp // st  # groups wholly inside the left padding get no mass
    out = torch.zeros(b, h, nbq, nbk, dtype=acc, device=q.device)
    # chunks of query blocks: within the memory budget, and at least about 8 so that the causal half is skipped
    step = max(1, min(CHUNK_ELEMENTS // max(1, b * h * r * r * nbk), -(-nbq // 8)))
    for i0 in range(0, nbq, step):
        i1 = min(nbq, i0 + step)
        ng = (c0 + i1) * r  # strided key groups causal for some row of the chunk
        s = torch.matmul(rq[:, :, :, i0 * r : i1 * r], rk[:, :, None, :ng].transpose(-1, -2)).mul_(scale / st)
        s = s.reshape(b, h, (i1 - i0) * r, ng)
        a_abs = c0 * r + torch.arange(i0 * r, i1 * r, device=q.device)
        j = torch.arange(ng, device=q.device)
        bad = (j[None, :] > a_abs[:, None]) | (j[None, :] < first_group)
        s.masked_fill_(bad[None, None], -math.inf)
        if valid_groups is not None:
            s.masked_fill_(~valid_groups[:, None, None, :ng], -math.inf)
        p = torch.softmax(s, -1).nan_to_num_(0.0)
        row_ok = (torch.arange(i0 * r, i1 * r, device=q.device) * st) < lq  # strided rows holding a query
        p.mul_(row_ok[None, None, :, None].to(acc))
        out[:, :, i0:i1, : c0 + i1] = p.reshape(b, h, i1 - i0, r, c0 + i1, r).sum((3, 5))
    return out


def select_blocks(mass: torch.Tensor, *, threshold: float, q_offset: int, block_size: int) -> torch.Tensor:
    """Kept key blocks per query block, by cumulative mass (step 3 of the module docstring).

    Args:
        mass: ``[B, H, nbq, nbk]`` block masses (:func:`antidiagonal_block_mass`).
        threshold: share of the query block's estimated mass to cover, in ``[0, 1]``.
        q_offset, block_size: the block grid (:func:`block_geometry`).

    Returns:
        ``[B, H, nbq, nbk]`` bool, only causal blocks (key block ``<=`` the diagonal one).

    Raises:
        ValueError: ``threshold`` outside ``[0, 1]``.
    """
    if not (0.0 <= threshold <= 1.0):
        raise ValueError(f"threshold={threshold!r}: must be in [0, 1]")
    nbq, nbk = mass.shape[-2:]
    lp = (-q_offset) % block_size
    c0 = nbk - nbq
    dev = mass.device
    c = torch.arange(nbk, device=dev)
    diag = c0 + torch.arange(nbq, device=dev)
    causal = c[None, :] <= diag[:, None]  # [nbq, nbk]
    if threshold >= 1.0:
        return causal.expand(mass.shape).clone()
    forced = ((c[None, :] == diag[:, None]) | (c[None, :] * block_size < lp + block_size)[:1]) & causal
    m = mass.double()
    total = (m * causal).sum(-1, keepdim=True)
    forced_sum = (m * forced).sum(-1, keepdim=True)
    other = m.masked_fill(forced | ~causal, -1.0)  # excluded blocks sort last
    vals, idx = torch.sort(other, dim=-1, descending=True, stable=True)
    pos = vals.clamp(min=0.0)
    before = forced_sum + pos.cumsum(-1) - pos  # mass kept before each candidate
    take = (before < threshold * total) & (vals >= 0.0)
    keep = torch.zeros_like(take).scatter_(-1, idx, take)
    return keep | forced


@functools.lru_cache(maxsize=None)
def _attend_config(block_size: int, kernel: str) -> AnchorConfig:
    # the stripe attention reads block_size and kernel only
    return AnchorConfig(block_size=block_size, init_block=block_size, local_window=block_size, pool_stride=None, kernel=kernel)


def block_topk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    block_size: int = 128,
    stride: int = 8,
    threshold: float = 0.9,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    kernel: str = "auto",
    return_stats: bool = False,
    compute_recall: bool = False,
) -> tuple[torch.Tensor, BlockTopkStats | None]:
    """XAttention block-sparse causal prefill: antidiagonal block masses, threshold selection, exact attention
    over the kept blocks (the module docstring; arXiv 2503.16428, Sec. 2).

    Selection costs ``O(Lq Lk D / S)`` (one strided product, in chunks of query blocks of about
    :data:`CHUNK_ELEMENTS` scores) and a ``[B, H, nbq, Lk]`` bool key mask; the attention costs the kept pairs.

    Args:
        q: ``[B, H, Lq, D]`` queries at absolute positions ``q_offset .. q_offset + Lq - 1``.
        k, v: ``[B, Hkv, Lk, D]``, ``H % Hkv == 0``, ``Lk >= q_offset + Lq``.
        scale: attention scale.
        block_size: tokens per query and key block, a multiple of ``stride``.
        stride: antidiagonal stride (tokens).
        threshold: share of each query block's estimated mass its kept blocks must cover, in ``[0, 1]``
            (1 = every causal block: exact causal attention).
        q_offset: absolute position of the first query (a prompt continued on a cache).
        key_valid: ``[B, Lk]`` bool, False at padding keys, or ``None``.
        kernel: one of :data:`KERNELS`: ``"flex"`` runs the kept blocks as a ``BlockMask`` through FlexAttention,
            the others AnchorAttention's stripe attention over the kept keys; ``"auto"``: flex on CUDA, on the CPU
            from :data:`CPU_FLEX_MIN_KEYS` keys (``q_offset + Lq``), else ``"gather"``.
        return_stats: also return :class:`BlockTopkStats`.
        compute_recall: fill ``BlockTopkStats.recall`` (one exact softmax pass in query chunks).

    Returns:
        ``(out, stats)``: ``out`` ``[B, H, Lq, D]`` in ``q.dtype`` (a query without a valid key gives zeros);
        ``stats`` ``None`` unless requested.

    Raises:
        ValueError: inputs that do not fit (ranks, batch, heads, ``q_offset``, ``key_valid``, scale), ``block_size``
            not a positive multiple of ``stride``, ``threshold`` outside ``[0, 1]``, an unknown ``kernel``.
        OptionError: ``kernel="compiled"`` or ``"flex"`` for inputs it does not take.
        RuntimeError: ``kernel="compiled"`` where the kernel cannot be built, ``kernel="flex"`` where ``torch.compile``
            fails.
    """
    check_inputs(q, k, v, scale, q_offset, key_valid)
    _check_options(block_size, stride, threshold)
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: one of {', '.join(KERNELS)}")
    kw = dict(scale=scale, block_size=block_size, stride=stride, threshold=threshold, kernel=kernel,
              return_stats=return_stats, compute_recall=compute_recall)
    lq = q.shape[2]
    split = split_padding(key_valid, q_offset, lq)
    if split is None:
        return _one_call(q, k, v, q_offset=q_offset, key_valid=key_valid, **kw)
    b, h = q.shape[:2]
    out, seqs = per_sequence(  # each sequence alone, its padding stripped
        functools.partial(_one_call, **kw), q, k, v, split, q_offset=q_offset, key_valid=key_valid,
    )
    parts: list[BlockTopkStats | None] = [None if part is None else part[2] for part in seqs]
    if not (return_stats or compute_recall):
        return out, None
    zero = torch.zeros(1, h, dtype=torch.float64, device=q.device)
    nbs = max([st.kept_blocks.shape[-1] for st in parts if st is not None] + [0])
    blocks = torch.full((b, h, nbs), -1, dtype=torch.long, device=q.device)
    for bi, st in enumerate(parts):
        if st is not None:
            blocks[bi, :, : st.kept_blocks.shape[-1]] = st.kept_blocks[0]
    recall = None
    if compute_recall:
        recall = torch.cat([torch.ones_like(zero) if st is None else st.recall for st in parts])
    return out, BlockTopkStats(
        torch.cat([zero if st is None else st.causal_pairs for st in parts]),
        torch.cat([zero if st is None else st.kept_pairs for st in parts]),
        blocks, recall,
    )


def block_topk_keep(
    q: torch.Tensor, k: torch.Tensor, *, scale: float, block_size: int, stride: int, threshold: float, q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [B, H, nbq, nbk] bool, keep [B, H, nbq, q_offset + Lq] bool)``: the kept blocks and the key mask
    they expand to (invalid keys dropped), for one call without padding to strip (see :func:`block_topk_attention`)."""
    lq = q.shape[2]
    lk = q_offset + lq
    mass = antidiagonal_block_mass(q, k, block_size=block_size, stride=stride, scale=scale, q_offset=q_offset,
                                   key_valid=key_valid)
    blocks = select_blocks(mass, threshold=threshold, q_offset=q_offset, block_size=block_size)
    lp = (-q_offset) % block_size
    nbk = blocks.shape[-1]
    keep = blocks[..., None].expand(*blocks.shape, block_size).reshape(*blocks.shape[:-1], nbk * block_size)
    keep = keep[..., lp : lp + lk].contiguous()  # key j lies in block (j + lp) // block_size
    if key_valid is not None:
        keep &= key_valid[:, None, None, :lk]
    return blocks, keep


def _one_call(q, k, v, *, scale, block_size, stride, threshold, q_offset, key_valid, kernel, return_stats, compute_recall):
    lq = q.shape[2]
    lk = q_offset + lq
    if k.shape[2] != lk:  # keys after the last query are causal for none
        k, v = k[:, :, :lk], v[:, :, :lk]
        key_valid = None if key_valid is None else key_valid[:, :lk]
    if key_valid is not None and bool(key_valid.all()):
        key_valid = None
    use = kernel if kernel in ("compiled", "torch") else choose_kernel(kernel, q, lk, CPU_FLEX_MIN_KEYS)
    stats = return_stats or compute_recall
    if use == "flex" and not stats:  # the kept blocks alone: no [B, H, nbq, Lk] key mask
        mass = antidiagonal_block_mass(q, k, block_size=block_size, stride=stride, scale=scale, q_offset=q_offset,
                                       key_valid=key_valid)
        blocks = select_blocks(mass, threshold=threshold, q_offset=q_offset, block_size=block_size)
        keep = None
    else:
        blocks, keep = block_topk_keep(q, k, scale=scale, block_size=block_size, stride=stride, threshold=threshold,
                                       q_offset=q_offset, key_valid=key_valid)
    cfg = _attend_config(block_size, use if use in ("compiled", "torch") else "auto")
    geo = call_geometry(q, k, cfg, q_offset, key_valid)

    def gather() -> torch.Tensor:
        kp = keep if keep is not None else block_topk_keep(
            q, k, scale=scale, block_size=block_size, stride=stride, threshold=threshold, q_offset=q_offset,
            key_valid=key_valid)[1]
        return sparse_attend(q, k, v, kp, geo, cfg, scale)

    if use == "flex":
        out = flex_attend(
            lambda: block_flex(q, k, v, blocks, block_size=block_size, scale=scale, q_offset=q_offset, key_valid=key_valid),
            gather, strict=kernel == "flex")
    else:
        out = gather()
    if not stats:
        return out, None
    b, h = q.shape[:2]
    causal, kept = pair_counts(keep, geo, cfg)
    stats = BlockTopkStats(causal.expand(b, h).clone(), kept, blocks.sum(-1))
    if compute_recall:
        r = kept_mass(q, k, keep, geo, cfg, scale)  # [B, H, Lq]
        qv = geo.query_valid[:, :lq].double()
        stats.recall = (r * qv[:, None]).sum(-1) / qv.sum(-1).clamp(min=1)[:, None]
    return out, stats
