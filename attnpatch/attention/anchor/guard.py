"""AnchorAttention's recall guard (beyond the paper): the exact softmax mass the kept keys carry on probe query
blocks, and which heads (``guard="global"``) or query blocks (``guard="causal"``) attend densely.
"""

from __future__ import annotations

import math

import torch

from ..backends.cpu_kernel import stripe_kernel
from . import tiles
from .config import AnchorConfig
from .select import CallGeometry, grouped_heads, pad_rows

__all__ = ["kept_mass", "probe_blocks", "causal_probe_blocks", "probe_recall", "causal_guard"]


def _block_mass(qpad, kf, keep, geo: CallGeometry, block_size: int, scale: float, c0: int, c1: int) -> torch.Tensor:
    """``[B, H, (c1 - c0) * block_size]`` exact softmax mass (over valid causal keys) on the kept keys of
    the queries of blocks ``c0 .. c1 - 1``; ``qpad`` ``[B, H, nb * block_size, D]`` and ``kf`` in float32.

    The logit scale is folded into the block's queries and the causal mask touches only the keys at or
    after the block's first query.
    """
    b, h = qpad.shape[:2]
    hkv = kf.shape[1]
    bq = block_size
    dev = qpad.device
    r0, r1 = c0 * bq, c1 * bq
    lc = min(geo.lk, geo.q_offset + r1)  # keys after the last query are never causal
    qc = grouped_heads(qpad[:, :, r0:r1], hkv) * scale
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


def kept_mass(q, k, keep, geo: CallGeometry, block_size: int, scale: float) -> torch.Tensor:
    """``[B, H, Lq]`` exact softmax mass (over valid causal keys) carried by each query's kept keys ``keep``
    ``[B, H, nb, Lk]`` (blocks of ``block_size`` queries).

    One dense softmax pass in chunks of query blocks (never an ``Lq x Lk`` buffer for all
    queries at once); the kept mass of a block's queries is a product with the block's stripe mask.
    """
    b, h, lq, d = q.shape
    bq, nb = block_size, geo.nb
    qpad = pad_rows(q.float(), nb * bq)
    kf = k.float()
    out = torch.empty(b, h, nb * bq, dtype=torch.float64, device=q.device)
    step = max(1, tiles.CHUNK_ELEMENTS // max(b * h * bq * geo.lk, 1))
    for c0 in range(0, nb, step):
        c1 = min(nb, c0 + step)
        out[:, :, c0 * bq : c1 * bq] = _block_mass(qpad, kf, keep, geo, bq, scale, c0, c1)
    return out[:, :, :lq]


def probe_blocks(cfg: AnchorConfig, n_sparse: int) -> list[int]:
    """Evenly spaced query blocks (holding sparse queries) the recall guard measures."""
    nsb = -(-n_sparse // cfg.block_size)
    if nsb <= 0:
        return []
    m = min(cfg.recall_probes, nsb)
    return sorted({(nsb - 1) * i // max(m - 1, 1) for i in range(m)})


def causal_probe_blocks(cfg: AnchorConfig, q_offset: int, nb: int) -> list[int]:
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


def _probe_masses(q, k, keep, geo: CallGeometry, cfg: AnchorConfig, scale: float, blocks: list[int], use: str):
    """``[B, H, block_size]`` exact softmax mass on the kept keys of the rows of each of ``blocks`` (an iterable).

    With the compiled CPU kernel (``use="compiled"``: the call's stripe-attention kernel) one pass over the probe
    blocks' causal keys keeps running sums of exp over all and over the kept keys; otherwise a softmax per probe block.
    """
    b, h = q.shape[:2]
    bq = cfg.block_size
    if use == "compiled" and blocks:
        return stripe_kernel().kept_mass(
            q.contiguous(), k.contiguous(), keep.contiguous(), torch.tensor(blocks), geo.q_offset, bq, scale,
            tiles.KV_TILE, tiles.Q_TILE,
        ).view(b, h, len(blocks), bq).unbind(2)
    qpad = pad_rows(q.float(), geo.nb * bq)
    kf = k.float()
    return (_block_mass(qpad, kf, keep, geo, bq, scale, blk, blk + 1) for blk in blocks)


def probe_recall(q, k, keep, geo: CallGeometry, cfg: AnchorConfig, scale: float, n_sparse: int, *,
                 masses=None, use: str = "torch") -> torch.Tensor:
    """``[B, H]`` exact softmax mass on the kept keys, averaged over the valid sparse queries of the probe blocks
    (the global recall guard, ``guard="global"``).  ``masses``: the probe blocks' masses computed elsewhere (one
    ``[B, H, block_size]`` tensor per block of :func:`probe_blocks`, the Triton path), ``keep`` then unused;
    ``use``: the call's stripe-attention kernel (``"compiled"`` or ``"torch"``), which measures them otherwise."""
    b, h = q.shape[:2]
    bq = cfg.block_size
    blocks = probe_blocks(cfg, n_sparse)
    tot = torch.zeros(b, h, dtype=torch.float64, device=q.device)
    cnt = torch.zeros(b, dtype=torch.float64, device=q.device)
    if masses is None:
        masses = _probe_masses(q, k, keep, geo, cfg, scale, blocks, use)
    for blk, mass in zip(blocks, masses):
        r0 = blk * bq
        rows = torch.arange(r0, r0 + bq, device=q.device) < n_sparse  # queries after n_sparse attend densely
        qv = (geo.query_valid[:, r0 : r0 + bq] & rows).double()
        tot += (mass * qv[:, None]).sum(-1)
        cnt += qv.sum(-1)
    return tot / cnt.clamp(min=1)[:, None]


def causal_guard(q, k, keep, geo: CallGeometry, cfg: AnchorConfig, scale: float, *,
                 masses=None, use: str = "torch") -> torch.Tensor | None:
    """``[B, H, nb]`` bool: the query blocks that the causal recall guard (``guard="causal"``) makes dense, or
    ``None`` when it makes none dense.

    The recall of a probe block (:func:`causal_probe_blocks`) is the exact softmax mass on its kept keys,
    averaged over its valid queries (all of them: ``dense_last`` plays no part, so the decision does not
    depend on the prompt's length).  Block ``j >= f`` (the first probe) is dense in a head when the mean
    recall of the probes ``p_1 < ... < p_m <= j`` is below ``min_recall``, probe ``p_i`` weighted by the
    blocks it stands for up to ``j`` (``p_{i+1} - p_i``, and ``j + 1 - p_m`` for the last): an estimate of
    the mean recall of blocks ``f .. j``.  Block ``j``'s decision therefore reads keys and queries at or
    before block ``j``'s last query only.  ``masses``: the probe blocks' masses computed elsewhere (one
    ``[B, H, block_size]`` tensor per block of :func:`causal_probe_blocks`, the Triton path), ``keep`` then unused;
    ``use``: the call's stripe-attention kernel (``"compiled"`` or ``"torch"``), which measures them otherwise.
    """
    b, h = q.shape[:2]
    bq, nb = cfg.block_size, geo.nb
    blocks = causal_probe_blocks(cfg, geo.q_offset, nb)
    if not blocks:
        return None
    dev = q.device
    rec = torch.empty(b, h, len(blocks), dtype=torch.float64, device=dev)
    if masses is None:
        masses = _probe_masses(q, k, keep, geo, cfg, scale, blocks, use)
    for i, (blk, mass) in enumerate(zip(blocks, masses)):
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
