"""AnchorAttention's stripe selection (arXiv 2505.23520, Sec. 3, Eq. 2-4): the call's geometry, anchors, pooled
scores and thresholds, in the compiled kernel or in PyTorch operations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..backends.cpu_kernel import stripe_kernel
from ..backends.dispatch import Call, choose
from ..prefill import check_inputs
from . import tiles
from .config import AnchorConfig

__all__ = ["CallGeometry", "call_geometry", "causal_keys", "pad_rows", "grouped_heads", "select_stripes", "select_kernel",
           "select_kept"]


@dataclass
class CallGeometry:
    """Positions of one attention call, shared by the selection, the sparse attention, the guard and the statistics.

    Attributes:
        lq, lk: query and key counts (tokens).
        q_offset: absolute position of the first query.
        nb: query blocks, ``ceil(lq / block_size)``.
        key_valid: ``[B, Lk]`` bool, False for padding keys.
        start: ``[B]`` int64, the first valid key of each sequence.
        query_valid: ``[B, nb * block_size]`` bool; padded query rows are False.
        block_end: ``[nb]`` int64, the absolute position one past each block's last query.
        padded: whether a ``key_valid`` mask was given (``False``: every key is valid, known without reading
            the mask back from the device).
    """

    lq: int
    lk: int
    q_offset: int
    nb: int
    key_valid: torch.Tensor  # [B, Lk] bool
    start: torch.Tensor  # [B] first valid key index
    query_valid: torch.Tensor  # [B, nb*bq] bool (padded query rows are False)
    block_end: torch.Tensor  # [nb] absolute position one past the block's last query
    padded: bool = True

    @property
    def inner_padding(self) -> bool:
        """Whether some key is padding (read back from the mask only when one was given)."""
        return self.padded and not bool(self.key_valid.all())


def call_geometry(q: torch.Tensor, k: torch.Tensor, block_size: int, q_offset: int,
                  key_valid: torch.Tensor | None) -> CallGeometry:
    """The :class:`CallGeometry` of queries ``q`` ``[B, H, Lq, D]`` at positions ``q_offset ..`` over keys
    ``k`` ``[B, Hkv, Lk, D]`` (``key_valid`` ``[B, Lk]`` bool or ``None`` = all valid), in blocks of
    ``block_size`` queries.  Inputs are not checked here (:func:`select_stripes` checks them)."""
    b, _, lq, _ = q.shape
    lk = k.shape[2]
    bq = block_size
    nb = -(-lq // bq)
    dev = q.device
    padded = key_valid is not None
    if key_valid is None:
        key_valid = torch.ones(b, lk, dtype=torch.bool, device=dev)
    start = torch.argmax(key_valid.to(torch.int8), dim=1)
    pos = q_offset + torch.arange(nb * bq, device=dev)
    in_range = pos < q_offset + lq
    query_valid = in_range[None, :] & key_valid[:, pos.clamp(max=lk - 1)]
    block_end = q_offset + torch.clamp(torch.arange(1, nb + 1, device=dev) * bq, max=lq)
    return CallGeometry(lq, lk, q_offset, nb, key_valid, start, query_valid, block_end, padded)


def _always_kept(geo: CallGeometry, cfg: AnchorConfig) -> torch.Tensor:
    """``[B, nb, Lk]`` bool: initial block (from each sequence's first valid token) and local window."""
    j = torch.arange(geo.lk, device=geo.key_valid.device)
    initial = (j[None, :] >= geo.start[:, None]) & (j[None, :] < geo.start[:, None] + cfg.init_block)  # [B, Lk]
    window = (j[None, :] >= geo.block_end[:, None] - cfg.local_window) & (j[None, :] < geo.block_end[:, None])
    return initial[:, None, :] | window[None, :, :]


def causal_keys(geo: CallGeometry) -> torch.Tensor:
    """``[B, nb, Lk]`` bool: valid keys at or before each block's last query."""
    j = torch.arange(geo.lk, device=geo.key_valid.device)
    return (j[None, :] < geo.block_end[:, None])[None] & geo.key_valid[:, None, :]


def pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` ``[..., L, D]`` zero-padded to ``n`` rows (``x`` itself, not a copy, when ``L == n``)."""
    return x if x.shape[-2] == n else F.pad(x, (0, 0, 0, n - x.shape[-2]))


def grouped_heads(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, H, ...]`` -> ``[B, Hkv, G, ...]`` (query heads grouped by their key/value head)."""
    b, h = q.shape[:2]
    return q.reshape(b, hkv, h // hkv, *q.shape[2:])


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
        ValueError: inputs that do not fit (see :func:`attnpatch.attention.prefill.check_inputs`: shapes, ``H`` not a multiple of
            ``Hkv``, ``q_offset``, ``key_valid``, a scale that is not positive).
    """
    check_inputs(q, k, None, scale, q_offset, key_valid)
    geo = call_geometry(q, k, cfg.block_size, q_offset, key_valid)
    return select_kept(q, k, cfg, scale, geo)


def select_kernel(q: torch.Tensor, cfg: AnchorConfig, geo: CallGeometry) -> str:
    """The kernel that selects ``q``'s stripes under ``cfg.kernel``: ``"triton"``, ``"compiled"`` (float32 selection
    on the CPU, from inputs of any floating dtype, with padding; a ``kernel="compiled"`` it does not take selects with
    ``"torch"``, and the attention that follows says why) or ``"torch"``
    (:func:`attnpatch.attention.backends.dispatch.choose`, operation ``"anchor_select"``).

    Raises:
        KernelError: ``kernel="triton"`` where Triton cannot run.
    """
    return choose("anchor_select", cfg.kernel, Call.of(q, keys=geo.lk, select_dtype=cfg.select_dtype_on(q.device)))


def select_kept(q: torch.Tensor, k: torch.Tensor, cfg: AnchorConfig, scale: float, geo: CallGeometry) -> torch.Tensor:
    """:func:`select_stripes` on inputs already checked, with their :class:`CallGeometry` ``geo``: ``[B, H, nb, Lk]``
    bool, the kept keys of each query block (AnchorAttention Eq. 2-4, arXiv 2505.23520).

    The kernel is :func:`select_kernel`'s; the Triton kernel's bitmask is unpacked.

    Raises:
        KernelError: ``kernel="triton"`` where Triton cannot run.
    """
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    bq, nb = cfg.block_size, geo.nb
    dev = q.device
    use = select_kernel(q, cfg, geo)
    if use == "triton":
        from .triton_select import select_bits, unpack_bits  # imports Triton: only where its kernels run

        return unpack_bits(select_bits(q, k, cfg, scale, geo), geo.lk)
    if math.isinf(cfg.theta):
        keep = (_always_kept(geo, cfg) | (cfg.theta > 0)) & causal_keys(geo)
        return keep[:, None].expand(b, h, nb, geo.lk)

    if use == "compiled":  # the same steps in one parallel region (stripe_select in csrc/anchor_cpu.cpp)
        return stripe_kernel().stripe_select(
            q.float().contiguous(), k.float().contiguous(), geo.key_valid.contiguous(), geo.start.to(torch.int64),
            geo.q_offset, bq, cfg.stride, cfg.init_block, cfg.local_window, float(cfg.theta), float(scale),
            tiles.SELECT_KERNEL_ROWS, tiles.SELECT_KERNEL_TILE,
        )

    always = _always_kept(geo, cfg)  # [B, nb, Lk]
    causal = causal_keys(geo)  # [B, nb, Lk]
    qs = q.float() * scale  # the logit scale folded into the queries once
    kf = k.float()
    qpad = pad_rows(qs, nb * bq)  # [B, H, nb*bq, D]
    qv = geo.query_valid  # [B, nb*bq]
    pos = geo.q_offset + torch.arange(nb * bq, device=dev)  # absolute query positions

    # (1) anchors: max logit over initial block and local window, per query (masked in place).
    n_init = min(cfg.init_block, geo.lk)
    init_idx = (geo.start[:, None] + torch.arange(n_init, device=dev)[None, :])  # [B, I]
    init_ok = init_idx < geo.lk
    init_idx = init_idx.clamp(max=geo.lk - 1)
    k_init = torch.gather(kf, 2, init_idx[:, None, :, None].expand(b, hkv, n_init, d))  # [B,Hkv,I,D]
    qg = grouped_heads(qpad, hkv)  # [B, Hkv, G, nb*bq, D]
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
    # chunks of query blocks (about tiles.SELECT_ROWS pooled queries per key/value head: an efficient GEMM shape)
    # times tiles of keys, so that the [.., npool, tile] score buffer stays in cache
    sel_dtype = getattr(torch, cfg.select_dtype_on(dev))
    ks = kf if sel_dtype == torch.float32 else k.to(sel_dtype)
    step = max(1, min(nb, tiles.SELECT_ROWS // (g * npool)))
    tile = max(tiles.SELECT_MIN_TILE, tiles.SELECT_CHUNK_ELEMENTS // max(b * hkv * g * step * npool, 1))
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
