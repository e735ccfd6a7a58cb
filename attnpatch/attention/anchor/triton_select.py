"""AnchorAttention's stripe selection as one Triton kernel: anchors, pooled scores and the threshold on the device,
the kept keys written as a bitmask (arXiv 2505.23520, Sec. 3, Eq. 2-4).

Kernel (:func:`_select_kernel`): one program per (query block, batch x query head).  It loads the block's queries in
their dtype, takes each query's *anchor* (their Eq. 2: the largest
logit over the keys of the initial block, from the sequence's first valid key, and of the local window ending at the
block's end; causal, valid keys only), averages queries and anchors over each pool of ``pool_stride`` valid queries
(a product with a ``[pools, block]`` 0/1 matrix, then a division by the pool's count), and streams the causal keys
``0 .. block_end - 1`` in tiles: key ``j`` is kept when some pool has ``q_bar . k_j >= a_bar - theta`` (their Eq. 3-4,
the PyTorch path's rule), when it lies in the initial block or the window, and only when it is valid and before the
block's end.  Pools without a valid query keep nothing.  ``theta = inf`` keeps every causal key, ``-inf`` the initial
block and the window only (no scoring).  ``select_dtype="bfloat16"`` scores in bfloat16 with float32 accumulation and
compares the score and the threshold rounded to bfloat16, as the PyTorch path does.

Precision (:mod:`.triton_dots`): every product on the tensor cores with float32 accumulation, the logit scale applied
to the float32 sums.  Half-precision tiles multiply as they are (exact products); float32 tiles in three
TF32 products up to head dim 64, three bfloat16 products above (docs/methods.md, "The Triton kernels' precision", has
the kept set's tolerance against float64).  Tiles are sized so that no variant spills registers on sm_90 at the GPU
check's shapes (``benchmarks/triton_compile.py``; the budgets: ``tests/test_triton_compile.py``).

The kept keys leave the kernel as a bitmask, ``[B, H, nb, ceil(Lk / 32)]`` int32 words, bit ``j % 32`` of word
``j // 32`` for key ``j``: ``N^2 / (8 * block_size)`` bytes per head for ``N`` tokens, written with no host
synchronisation; :mod:`.triton_attend` reads it directly.  :func:`unpack_bits` turns it into the PyTorch path's
``[B, H, nb, Lk]`` bool mask (for tests and :func:`~.select.select_stripes`).

Which calls run here is decided by :func:`attnpatch.attention.backends.dispatch.choose` (operations ``"anchor_select"``
and ``"anchor_attend"``): ``kernel="triton"`` for CUDA tensors, and for CPU tensors only under the Triton interpreter
(``TRITON_INTERPRET=1``; tests) or inside :func:`~attnpatch.attention.backends.aot.compile_only` (compiled for a
target, never launched); ``kernel="auto"`` for CUDA tensors where Triton is installed.

Source: AnchorAttention, arXiv 2505.23520, Sec. 3, Eq. 2-4.
"""

from __future__ import annotations

import math

import torch

from ..backends.triton_support import TRITON_AVAILABLE, interpreted

if TRITON_AVAILABLE:  # imported here, on first use of a kernel: `import attnpatch` loads no Triton module
    from ..backends.triton_support import tl, triton
from .config import AnchorConfig
from .triton_dots import head_tile, key_tile, qk_precision

__all__ = ["select_bits", "unpack_bits", "n_words", "tile_rows", "head_tile", "warps"]


def n_words(lk: int) -> int:
    """Int32 words per bitmask row of ``lk`` keys."""
    return -(-lk // 32)


def tile_rows(block_size: int) -> int:
    """Query rows per program: ``block_size`` rounded up to a power of two, at least 16 (``tl.dot``'s least size);
    rows past ``block_size`` are masked."""
    return max(16, 1 << (block_size - 1).bit_length())


def warps(rows: int) -> int:
    """Warps per program of ``rows`` query rows (a ``rows x head_dim`` float32 accumulator in registers)."""
    return 4 if rows <= 64 else 8


if TRITON_AVAILABLE:
    from .triton_dots import dot2, qk, split_bf16

    @triton.jit
    def _anchor_part(qt, anchor, k_base, valid_base, pos, lo, hi, stride_kn, offs_d, d, scale,
                     BN: tl.constexpr, HAS_PAD: tl.constexpr, UPCAST: tl.constexpr, QK: tl.constexpr):
        """``anchor`` updated with the largest logit of the query tile ``qt`` (``[BQ, BD]`` in the input dtype, the
        logit ``scale`` applied to the products) over the keys ``lo .. hi - 1`` that are valid and at or before each
        query's position ``pos``."""
        for j0 in range(lo, hi, BN):
            keys = j0 + tl.arange(0, BN)
            kin = keys < hi
            kt = tl.load(k_base + keys[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                         mask=kin[:, None] & (offs_d[None, :] < d), other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
            if HAS_PAD:
                kin = kin & (tl.load(valid_base + keys, mask=kin, other=0) != 0)
            s = qk(qt, kt, QK, UPCAST) * scale
            s = tl.where(kin[None, :] & (keys[None, :] <= pos[:, None]), s, float("-inf"))
            anchor = tl.maximum(anchor, tl.max(s, axis=1))
        return anchor

    @triton.jit
    def _select_kernel(q_ptr, k_ptr, valid_ptr, start_ptr, bits_ptr,
                       sq_b, sq_h, sq_n, sk_b, sk_h, sk_n,
                       H, G, lq, lk, q_offset, bq, pool, init_block, local_window, nwords, theta, scale,
                       d, BQ: tl.constexpr, NP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                       SCORE: tl.constexpr, KEEP_ALL: tl.constexpr, SEL_BF16: tl.constexpr, HAS_PAD: tl.constexpr,
                       UPCAST: tl.constexpr, QK: tl.constexpr, QK_F32: tl.constexpr):
        """The bitmask row of query block ``program_id(0)`` of (batch, head) ``program_id(1)`` (module docstring).
        Strides along the head dim are 1 (the launcher makes the inputs contiguous)."""
        blk = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        kvh = h // G
        r0 = blk * bq
        n_rows = tl.minimum(bq, lq - r0)
        block_end = q_offset + r0 + n_rows  # one past the block's last query position
        start = tl.load(start_ptr + b)  # first valid key of the sequence
        init_end = tl.minimum(start + init_block, lk)
        win_lo = tl.maximum(block_end - local_window, 0)
        k_base = k_ptr + b.to(tl.int64) * sk_b + kvh.to(tl.int64) * sk_h
        valid_base = valid_ptr + b.to(tl.int64) * lk
        bits_row = bits_ptr + (bh.to(tl.int64) * tl.cdiv(lq, bq) + blk) * nwords
        rows = tl.arange(0, BQ)
        offs_d = tl.arange(0, BD)
        if SCORE:
            row_in = rows < n_rows
            pos = q_offset + r0 + rows
            q_base = q_ptr + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
            qt = tl.load(q_base + (r0 + rows)[:, None].to(tl.int64) * sq_n + offs_d[None, :],
                         mask=row_in[:, None] & (offs_d[None, :] < d), other=0.0)
            if UPCAST:
                qt = qt.to(tl.float32)
            qvalid = row_in
            if HAS_PAD:
                qvalid = qvalid & (tl.load(valid_base + pos, mask=row_in, other=0) != 0)
            # (1) anchors over the initial block and the local window (their Eq. 2)
            anchor = tl.full([BQ], float("-inf"), tl.float32)
            anchor = _anchor_part(qt, anchor, k_base, valid_base, pos, start, init_end, sk_n, offs_d, d, scale,
                                  BN, HAS_PAD, UPCAST, QK)
            anchor = _anchor_part(qt, anchor, k_base, valid_base, pos, win_lo, block_end, sk_n, offs_d, d, scale,
                                  BN, HAS_PAD, UPCAST, QK)
            anchor = tl.where(qvalid, anchor, 0.0)
            # (2) pooling: a [NP, BQ] 0/1 matrix of the valid queries of each pool times the query tile (exact
            # products, float32 sums), then the mean and the logit scale
            pools = tl.arange(0, NP)
            member = ((rows[None, :] // pool) == pools[:, None]) & qvalid[None, :]
            mf = member.to(tl.float32)
            cnt = tl.sum(mf, axis=1)
            pm = member.to(qt.dtype)
            if QK == "bf16x3":  # the 0/1 matrix is exact in bfloat16: two products, the tile's high and low parts
                q_hi, q_lo = split_bf16(qt)
                qsum = dot2(pm.to(tl.bfloat16), q_hi, q_lo, UPCAST)
            elif QK == "tf32x3":
                qsum = tl.dot(pm, qt, input_precision="tf32x3")
            else:
                qsum = tl.dot(pm, qt)
            qbar = qsum * (scale / tl.maximum(cnt, 1.0))[:, None]
            abar = tl.sum(mf * anchor[None, :], axis=1) / tl.maximum(cnt, 1.0)
            thr = tl.where(cnt > 0, abar - theta, float("inf"))  # pools without a valid query keep nothing
            if SEL_BF16:
                qbar = qbar.to(tl.bfloat16)
                thr = thr.to(tl.bfloat16).to(tl.float32)
                if UPCAST:
                    qbar = qbar.to(tl.float32)
        # (3) every causal key: scored stripes, the initial block and the window; packed 32 keys a word
        for j0 in range(0, block_end, BN):
            keys = j0 + tl.arange(0, BN)
            kin = keys < block_end
            if HAS_PAD:
                kin = kin & (tl.load(valid_base + keys, mask=kin, other=0) != 0)
            keep = ((keys >= start) & (keys < init_end)) | (keys >= win_lo)
            if KEEP_ALL:
                keep = keep | kin
            if SCORE:
                kt = tl.load(k_base + keys[:, None].to(tl.int64) * sk_n + offs_d[None, :],
                             mask=(keys[:, None] < block_end) & (offs_d[None, :] < d), other=0.0)
                if SEL_BF16:
                    kt = kt.to(tl.bfloat16)
                    if UPCAST:
                        kt = kt.to(tl.float32)
                    sc = tl.dot(qbar, tl.trans(kt)).to(tl.bfloat16).to(tl.float32)
                else:
                    sc = qk(qbar, kt.to(tl.float32), QK_F32, UPCAST)
                best = tl.max(sc - thr[:, None], axis=0)
                keep = keep | (best >= 0)
            keep = keep & kin
            words = tl.sum(tl.reshape(keep.to(tl.int32), [BN // 32, 32]) << tl.arange(0, 32)[None, :], axis=1)
            widx = j0 // 32 + tl.arange(0, BN // 32)
            tl.store(bits_row + widx, words, mask=widx < nwords)


def select_bits(q: torch.Tensor, k: torch.Tensor, cfg: AnchorConfig, scale: float, geo) -> torch.Tensor:
    """The kept keys of every query block as a bitmask, in one Triton launch (module docstring).

    Args:
        q: ``[B, H, Lq, D]`` queries (float32, float16 or bfloat16) at positions ``geo.q_offset ..``.
        k: ``[B, Hkv, Lk, D]``, ``H % Hkv == 0`` (grouped-query attention; keys not repeated).
        cfg: the options (``theta``, ``block_size``, ``init_block``, ``local_window``, ``pool_stride``,
            ``select_dtype``).
        scale: the logit scale.
        geo: the call's :class:`~.select.CallGeometry` (inputs already checked).

    Returns:
        ``[B, H, nb, ceil(Lk / 32)]`` int32 on ``q``'s device: bit ``j % 32`` of word ``j // 32`` of row ``(b, h,
        block)`` is set when that block keeps key ``j`` (exactly the keys of
        :func:`~.select.select_kept`: never a padding key or a key after the block's last query).
    """
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    interp = interpreted()
    nw = n_words(lk)
    bits = torch.zeros(b, h, geo.nb, nw, dtype=torch.int32, device=q.device)
    if b == 0 or h == 0 or lq == 0:
        return bits
    q, k = q.contiguous(), k.contiguous()
    has_pad = geo.padded  # no read-back of the mask
    valid = geo.key_valid.to(torch.int8).contiguous()
    score = math.isfinite(cfg.theta)
    sel_bf16 = score and cfg.select_dtype_on(q.device) == "bfloat16"
    npool = cfg.block_size // cfg.stride
    _select_kernel[(geo.nb, b * h)](
        q, k, valid, geo.start.to(torch.int64).contiguous(), bits,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        h, h // hkv, lq, lk, geo.q_offset, cfg.block_size, cfg.stride, cfg.init_block, cfg.local_window, nw,
        float(cfg.theta) if score else 0.0, float(scale), d,
        BQ=tile_rows(cfg.block_size), NP=max(16, 1 << (npool - 1).bit_length()), BN=key_tile(interp, q.dtype),
        BD=head_tile(d), SCORE=score, KEEP_ALL=cfg.theta == math.inf, SEL_BF16=sel_bf16, HAS_PAD=has_pad,
        UPCAST=interp, QK=qk_precision(q.dtype, d), QK_F32=qk_precision(torch.float32, d),
        num_warps=warps(tile_rows(cfg.block_size)),
    )
    return bits


def unpack_bits(bits: torch.Tensor, lk: int) -> torch.Tensor:
    """``[..., ceil(Lk / 32)]`` int32 words -> ``[..., Lk]`` bool (bit ``j % 32`` of word ``j // 32``), on the device,
    one byte per key (no int32 intermediate of that size)."""
    by = bits.contiguous().view(torch.uint8)  # little-endian: byte i of a word holds its bits 8i .. 8i + 7
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    out = ((by.unsqueeze(-1) >> shifts) & 1).to(torch.bool)
    return out.reshape(*bits.shape[:-1], -1)[..., :lk]
