"""AnchorAttention's attention over kept stripes as a Triton kernel (FlashAttention-2 structure), reading the kept keys
from :mod:`.triton_select`'s bitmask; the recall guard's probe masses and the statistics from the same bitmask.

Attention (:func:`_attend_kernel`): one program per (query block, batch x query head); the key/value head is
``head // (H / Hkv)`` (grouped-query attention, K/V never repeated).  The program keeps a running maximum, a running
sum and a float32 accumulator (online softmax, Dao 2023, Alg. 1) over

1. the kept keys before the block's first query: the bitmask row is read 32 words (1024 keys) at a time, the set
   bits are ranked (a prefix sum of the words' popcounts, then of the bits of each slot's word) and the next
   ``BN`` kept keys are gathered into one tile, so a tile holds ``BN`` kept keys wherever they lie; the loop ends at
   the block's first query (a data-dependent ``while``; nothing goes back to the host);
2. the block's own keys, causal (``key <= query``), in contiguous tiles: always kept (they lie in the local window).

A block the recall guard makes dense (``dense_blocks``) and the last ``Lq - dense_from`` queries (``dense_last``) take
every valid causal key instead, in contiguous tiles (a second launch over the dense rows, in tiles that need not
align with the blocks).  Padding keys (``key_valid``) are masked wherever keys are read; a query without a valid key
gives zeros.  Products run on the tensor cores with float32 accumulation: half-precision tiles as they are, the
probabilities rounded to the value dtype before the product with ``V``, as in FlashAttention; float32 tiles in three
products of split operands (:func:`~.triton_dots.qk_precision`: TF32 up to head dim 64, bfloat16 above), ``P V``
too.  Under the Triton interpreter, whose ``tl.dot`` on bfloat16 is broken (triton issue 11584), tiles are
upcast to float32 after loading (the probabilities still rounded to the value dtype first).

Probe masses (:func:`_mass_kernel`): for the rows of chosen query blocks, one pass over every causal key keeps a
running sum of ``exp`` over all valid causal keys and over the kept ones (a bit test per key), in float32: the
exact softmax mass on the kept keys (the recall guard's probes, :func:`triton_guard`, and ``AnchorStats.recall``),
and the kept causal keys per query (``AnchorStats.kept_pairs``).  The guard's decision (which heads or blocks turn
dense) is then the PyTorch code of :mod:`.guard` on those masses, on the device.

Source: AnchorAttention, arXiv 2505.23520, Sec. 3 (step 3, exact softmax over the kept keys; the kept set of Eq. 2-4).
"""

from __future__ import annotations

import torch

from ..backends.triton_support import TRITON_AVAILABLE, interpreted

if TRITON_AVAILABLE:  # imported here, on first use of a kernel: `import attnpatch` loads no Triton module
    from ..backends.triton_support import tl, triton
from .config import AnchorConfig
from .guard import causal_guard, causal_probe_blocks, probe_blocks, probe_recall
from .select import CallGeometry
from .triton_dots import head_tile, key_tile, qk_precision
from .triton_select import tile_rows, warps

if TRITON_AVAILABLE:
    from .triton_dots import dot3, qk, split_bf16

__all__ = ["attend_bits", "block_masses", "triton_guard", "triton_stats", "bits_popcount"]

_LOG2E = 1.4426950408889634
_POP8 = None  # [256] uint8 popcounts (built on first use)


if TRITON_AVAILABLE:

    @triton.jit
    def _update(qt, q_lo, kt, vt, ok, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr, QK: tl.constexpr):
        """One online-softmax step of the query tile ``qt`` over the key/value tile ``kt``/``vt`` where ``ok``: the
        logits by :func:`~.triton_dots.qk` (``"bf16x3"``: ``qt``, ``q_lo`` are the query tile's split parts, made
        once per program); ``P V`` in the same precision for float32 inputs, for half-precision ones with ``P``
        rounded to the value dtype (as FlashAttention does)."""
        if UPCAST:
            kt = kt.to(tl.float32)
        if QK == "bf16x3":
            k_hi, k_lo = split_bf16(kt)
            s = dot3(qt, q_lo, tl.trans(k_hi), tl.trans(k_lo), 0.0, UPCAST)
        else:
            s = qk(qt, kt, QK, UPCAST)
        s = tl.where(ok, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if QK == "bf16x3":
            p_hi, p_lo = split_bf16(p)
            v_hi, v_lo = split_bf16(vt)
            acc = dot3(p_hi, p_lo, v_hi, v_lo, acc, UPCAST)
        elif QK == "tf32x3":
            acc = tl.dot(p, vt, acc, input_precision="tf32x3")
        elif UPCAST:
            acc += tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32))
        else:
            acc += tl.dot(p.to(vt.dtype), vt)
        return m_new, l_i, acc

    @triton.jit
    def _dense_part(qt, q_lo, m_i, l_i, acc, k_base, v_base, valid_base, pos, lo, hi, stride_kn, stride_vn, offs_d, d,
                    qk_scale, BN: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, UPCAST: tl.constexpr,
                    QK: tl.constexpr):
        """Every valid key ``lo .. hi - 1`` (``CAUSAL``: at or before each query's position ``pos``)."""
        for j0 in range(lo, hi, BN):
            keys = j0 + tl.arange(0, BN)
            kin = keys < hi
            ld = kin[:, None] & (offs_d[None, :] < d)
            kt = tl.load(k_base + keys[:, None].to(tl.int64) * stride_kn + offs_d[None, :], mask=ld, other=0.0)
            vt = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vn + offs_d[None, :], mask=ld, other=0.0)
            if HAS_PAD:
                kin = kin & (tl.load(valid_base + keys, mask=kin, other=0) != 0)
            ok = kin[None, :]
            if CAUSAL:
                ok = ok & (keys[None, :] <= pos[:, None])
            m_i, l_i, acc = _update(qt, q_lo, kt, vt, ok, m_i, l_i, acc, qk_scale, UPCAST, QK)
        return m_i, l_i, acc

    @triton.jit
    def _attend_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bits_ptr, flags_ptr, valid_ptr,
                       sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n,
                       H, G, lk, q_offset, rows_per, row_start, row_stop, nb, nwords, qk_scale, d,
                       BQ: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, NW: tl.constexpr,
                       DENSE: tl.constexpr, HAS_FLAGS: tl.constexpr, HAS_PAD: tl.constexpr, UPCAST: tl.constexpr,
                       QK: tl.constexpr):
        """Rows ``row_start + program_id(0) * rows_per ..`` (below ``row_stop``) of (batch, head) ``program_id(1)``
        (module docstring); ``DENSE``: every causal key, else the kept keys of block ``program_id(0)``'s bitmask row."""
        blk = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        kvh = h // G
        r0 = row_start + blk * rows_per
        rows = r0 + tl.arange(0, BQ)
        row_in = (tl.arange(0, BQ) < rows_per) & (rows < row_stop)
        pos = q_offset + rows
        p0 = q_offset + r0  # the tile's first query position: keys before it need no causal mask
        hi = q_offset + tl.minimum(r0 + rows_per, row_stop)
        offs_d = tl.arange(0, BD)
        q_base = q_ptr + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
        k_base = k_ptr + b.to(tl.int64) * sk_b + kvh.to(tl.int64) * sk_h
        v_base = v_ptr + b.to(tl.int64) * sv_b + kvh.to(tl.int64) * sv_h
        valid_base = valid_ptr + b.to(tl.int64) * lk
        qt = tl.load(q_base + rows[:, None].to(tl.int64) * sq_n + offs_d[None, :],
                     mask=row_in[:, None] & (offs_d[None, :] < d), other=0.0)
        if UPCAST:
            qt = qt.to(tl.float32)
        if QK == "bf16x3":
            qt, q_lo = split_bf16(qt)
        else:
            q_lo = qt
        m_i = tl.full([BQ], -1.0e30, tl.float32)  # finite: a row without keys so far stays at p = 0, alpha = 1
        l_i = tl.zeros([BQ], tl.float32)
        acc = tl.zeros([BQ, BD], tl.float32)
        dense = DENSE
        if HAS_FLAGS:
            dense = tl.load(flags_ptr + bh.to(tl.int64) * nb + blk) != 0
        if dense:
            m_i, l_i, acc = _dense_part(qt, q_lo, m_i, l_i, acc, k_base, v_base, valid_base, pos, 0, p0, sk_n, sv_n,
                                        offs_d, d, qk_scale, BN, False, HAS_PAD, UPCAST, QK)
        else:
            # (1) the kept keys before the block, BN at a time from the bitmask row
            bits_row = bits_ptr + (bh.to(tl.int64) * nb + blk) * nwords
            ar32 = tl.arange(0, 32)
            slot = tl.arange(0, BN)
            cur = p0 * 0  # key cursor: every kept key before it is done
            while cur < p0:
                w0 = cur // 32
                widx = w0 + tl.arange(0, NW)
                words = tl.load(bits_row + widx, mask=widx * 32 < p0, other=0)
                kidx = widx[:, None] * 32 + ar32[None, :]
                bset = (((words[:, None] >> ar32[None, :]) & 1) != 0) & (kidx >= cur) & (kidx < p0)
                pc = tl.sum(bset.to(tl.int32), axis=1)
                cum = tl.cumsum(pc, axis=0)
                total = tl.sum(pc, axis=0)
                nxt = (w0 + NW) * 32
                if total > 0:
                    wi = tl.sum((cum[None, :] <= slot[:, None]).to(tl.int32), axis=1)  # each slot's word
                    onehot = tl.arange(0, NW)[None, :] == wi[:, None]
                    excl = tl.sum(tl.where(onehot, (cum - pc)[None, :], 0), axis=1)
                    wv = tl.sum(tl.where(onehot, words[None, :], 0), axis=1)
                    kb = (w0 + wi)[:, None] * 32 + ar32[None, :]
                    sb = (((wv[:, None] >> ar32[None, :]) & 1) != 0) & (kb >= cur) & (kb < p0)
                    bc = tl.cumsum(sb.to(tl.int32), axis=1)
                    bit = tl.sum((bc <= (slot - excl)[:, None]).to(tl.int32), axis=1)  # the slot's set bit
                    ok = slot < total
                    key = tl.where(ok, (w0 + wi) * 32 + bit, 0)
                    ld = ok[:, None] & (offs_d[None, :] < d)
                    kt = tl.load(k_base + key[:, None].to(tl.int64) * sk_n + offs_d[None, :], mask=ld, other=0.0)
                    vt = tl.load(v_base + key[:, None].to(tl.int64) * sv_n + offs_d[None, :], mask=ld, other=0.0)
                    m_i, l_i, acc = _update(qt, q_lo, kt, vt, ok[None, :], m_i, l_i, acc, qk_scale, UPCAST, QK)
                    nxt = tl.where(total > BN, tl.max(tl.where(ok, key, -1), axis=0) + 1, nxt)
                cur = nxt
        # (2) the tile's own keys, causal
        m_i, l_i, acc = _dense_part(qt, q_lo, m_i, l_i, acc, k_base, v_base, valid_base, pos, p0, hi, sk_n, sv_n,
                                    offs_d, d, qk_scale, BN, True, HAS_PAD, UPCAST, QK)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out = tl.where((l_i > 0)[:, None], out, 0.0)
        o_base = o_ptr + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h
        tl.store(o_base + rows[:, None].to(tl.int64) * so_n + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_in[:, None] & (offs_d[None, :] < d))

    @triton.jit
    def _mass_kernel(q_ptr, k_ptr, bits_ptr, flags_ptr, valid_ptr, blocks_ptr, mass_ptr, count_ptr,
                     sq_b, sq_h, sq_n, sk_b, sk_h, sk_n,
                     H, G, lq, lk, q_offset, bq, nb, nwords, n_blocks, scale, d,
                     BQ: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, HAS_FLAGS: tl.constexpr,
                     HAS_PAD: tl.constexpr, UPCAST: tl.constexpr, QK: tl.constexpr):
        """Mass on the kept keys and kept causal keys of each row of block ``blocks[program_id(0)]``, (batch, head)
        ``program_id(1)`` (module docstring), in float32."""
        i = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        kvh = h // G
        blk = tl.load(blocks_ptr + i)
        r0 = blk * bq
        rows = r0 + tl.arange(0, BQ)
        row_in = (tl.arange(0, BQ) < bq) & (rows < lq)
        pos = q_offset + rows
        block_end = q_offset + tl.minimum(r0 + bq, lq)
        offs_d = tl.arange(0, BD)
        q_base = q_ptr + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
        k_base = k_ptr + b.to(tl.int64) * sk_b + kvh.to(tl.int64) * sk_h
        valid_base = valid_ptr + b.to(tl.int64) * lk
        bits_row = bits_ptr + (bh.to(tl.int64) * nb + blk) * nwords
        qt = tl.load(q_base + rows[:, None].to(tl.int64) * sq_n + offs_d[None, :],
                     mask=row_in[:, None] & (offs_d[None, :] < d), other=0.0)
        if UPCAST:
            qt = qt.to(tl.float32)
        every = False
        if HAS_FLAGS:
            every = tl.load(flags_ptr + bh.to(tl.int64) * nb + blk) != 0
        m_i = tl.full([BQ], -1.0e30, tl.float32)
        l_all = tl.zeros([BQ], tl.float32)
        l_kept = tl.zeros([BQ], tl.float32)
        cnt = tl.zeros([BQ], tl.int32)
        for j0 in range(0, block_end, BN):
            keys = j0 + tl.arange(0, BN)
            kin = keys < block_end
            kt = tl.load(k_base + keys[:, None].to(tl.int64) * sk_n + offs_d[None, :],
                         mask=kin[:, None] & (offs_d[None, :] < d), other=0.0)
            if UPCAST:
                kt = kt.to(tl.float32)
            if HAS_PAD:
                kin = kin & (tl.load(valid_base + keys, mask=kin, other=0) != 0)
            word = tl.load(bits_row + keys // 32, mask=kin, other=0)
            kept = (((word >> (keys % 32)) & 1) != 0) | every
            ok = kin[None, :] & (keys[None, :] <= pos[:, None])
            s = tl.where(ok, qk(qt, kt, QK, UPCAST) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_all = l_all * alpha + tl.sum(p, axis=1)
            l_kept = l_kept * alpha + tl.sum(tl.where(kept[None, :], p, 0.0), axis=1)
            cnt += tl.sum((ok & kept[None, :]).to(tl.int32), axis=1)
            m_i = m_new
        mass = tl.where(l_all > 0, l_kept / tl.where(l_all > 0, l_all, 1.0), 0.0)
        out = (bh.to(tl.int64) * n_blocks + i) * BQ + tl.arange(0, BQ)
        tl.store(mass_ptr + out, mass, mask=row_in)
        tl.store(count_ptr + out, cnt, mask=row_in)


def _tiles(interp: bool, dtype: torch.dtype, d: int) -> tuple[int, int]:
    """``(BN, NW)``: keys per tile and bitmask words per gather window of the attention.  On a GPU 64 keys a tile for
    half-precision inputs; float32 inputs hold their products' split parts (:func:`~.triton_dots.qk_precision`) in
    twice the registers: 16 keys a tile in three TF32 products, 32 in three bfloat16 products (the tiles that do not
    spill on sm_90: ``benchmarks/triton_compile.py``).  Under the interpreter (cost per operation, not per element)
    larger key tiles."""
    if interp:
        return 128, 16
    return {"native": 64, "tf32x3": 16, "bf16x3": 32}[qk_precision(dtype, d)], 32


def _flags(dense_blocks: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like if dense_blocks is None else dense_blocks.to(torch.int8).contiguous()


def attend_bits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bits: torch.Tensor, geo: CallGeometry,
                cfg: AnchorConfig, scale: float, *, dense_from: int | None = None,
                dense_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of each query block over its kept keys (module docstring), one or two Triton launches.

    Args:
        q: ``[B, H, Lq, D]`` (float32, float16 or bfloat16) at positions ``geo.q_offset ..``.
        k, v: ``[B, Hkv, Lk, D]`` of ``q``'s dtype, ``H % Hkv == 0`` (not repeated).
        bits: ``[B, H, nb, ceil(Lk / 32)]`` int32 kept keys (:func:`~.triton_select.select_bits`).
        geo: the call's :class:`~.select.CallGeometry`; cfg: the options (``block_size``); scale: logit scale.
        dense_from: queries with index ``>= dense_from`` attend every valid causal key (``dense_last``); ``None``:
            none.
        dense_blocks: ``[B, H, nb]`` bool, blocks that attend every valid causal key (the recall guard), or ``None``.

    Returns:
        ``[B, H, Lq, D]`` in ``q``'s dtype; a query without a valid causal key gives zeros.
    """
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    interp = interpreted()
    bn, nw = _tiles(interp, q.dtype, d)
    has_pad = geo.padded  # no read-back of the mask
    valid = geo.key_valid.to(torch.int8).contiguous()
    flags = _flags(dense_blocks, valid)
    ls = lq if dense_from is None else max(0, min(lq, dense_from))
    common = dict(BN=bn, BD=head_tile(d), NW=nw, HAS_PAD=has_pad, UPCAST=interp, QK=qk_precision(q.dtype, d))
    args = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), h, h // hkv, lk,
            geo.q_offset)
    bq = cfg.block_size
    nb = bits.shape[2]
    if ls > 0:
        _attend_kernel[(-(-ls // bq), b * h)](
            q, k, v, out, bits, flags, valid, *args, bq, 0, ls, nb, bits.shape[3], scale * _LOG2E, d,
            BQ=tile_rows(bq), DENSE=False, HAS_FLAGS=dense_blocks is not None, num_warps=warps(tile_rows(bq)), **common)
    if ls < lq:
        rows = 64
        _attend_kernel[(-(-(lq - ls) // rows), b * h)](
            q, k, v, out, bits, flags, valid, *args, rows, ls, lq, nb, bits.shape[3], scale * _LOG2E, d,
            BQ=rows, DENSE=True, HAS_FLAGS=False, num_warps=warps(rows), **common)
    return out


def block_masses(q: torch.Tensor, k: torch.Tensor, bits: torch.Tensor, geo: CallGeometry, cfg: AnchorConfig,
                 scale: float, blocks, dense_blocks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax mass on the kept keys and the count of kept causal keys, per query of the query blocks ``blocks``
    (a list of block indices), in one Triton launch (module docstring).

    Args:
        q: ``[B, H, Lq, D]``; k: ``[B, Hkv, Lk, D]``; bits: ``[B, H, nb, ceil(Lk / 32)]`` int32;
        dense_blocks: ``[B, H, nb]`` bool blocks that keep every causal key, or ``None``.

    Returns:
        ``(mass, count)``: ``[B, H, len(blocks), block_size]`` float32 (0 for a row without a valid causal key and
        for rows past ``Lq``) and int32.
    """
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    bq = cfg.block_size
    n = len(blocks)
    mass = torch.zeros(b, h, n, tile_rows(bq), dtype=torch.float32, device=q.device)
    count = torch.zeros(b, h, n, tile_rows(bq), dtype=torch.int32, device=q.device)
    if n and b * h and lq:
        q, k = q.contiguous(), k.contiguous()
        valid = geo.key_valid.to(torch.int8).contiguous()
        bn = key_tile(interpreted(), q.dtype)
        _mass_kernel[(n, b * h)](
            q, k, bits, _flags(dense_blocks, valid), valid, torch.tensor(list(blocks), dtype=torch.int32, device=q.device),
            mass, count, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            h, h // hkv, lq, lk, geo.q_offset, bq, bits.shape[2], bits.shape[3], n, float(scale), d,
            BQ=tile_rows(bq), BN=bn, BD=head_tile(d), HAS_FLAGS=dense_blocks is not None,
            HAS_PAD=geo.padded, UPCAST=interpreted(), QK=qk_precision(q.dtype, d), num_warps=warps(tile_rows(bq)))
    return mass[..., :bq], count[..., :bq]


def triton_guard(q, k, bits: torch.Tensor, geo: CallGeometry, cfg: AnchorConfig, scale: float,
                 n_sparse: int) -> torch.Tensor | None:
    """``[B, H, nb]`` bool: the blocks the recall guard (``cfg.min_recall``, ``cfg.guard``) makes dense, or ``None``
    (guard off, or, ``guard="causal"``, no block dense): the probe masses from :func:`block_masses`, the decision
    of :func:`~.guard.probe_recall` / :func:`~.guard.causal_guard` on them."""
    if cfg.min_recall <= 0:
        return None
    if cfg.guard == "global":
        blocks = probe_blocks(cfg, n_sparse)
        mass = block_masses(q, k, bits, geo, cfg, scale, blocks)[0]
        low = probe_recall(q, k, None, geo, cfg, scale, n_sparse, masses=mass.unbind(2)) < cfg.min_recall
        return low[:, :, None].expand(-1, -1, geo.nb)
    blocks = causal_probe_blocks(cfg, geo.q_offset, geo.nb)
    if not blocks:
        return None
    mass = block_masses(q, k, bits, geo, cfg, scale, blocks)[0]
    return causal_guard(q, k, None, geo, cfg, scale, masses=mass.unbind(2))


def triton_stats(q, k, bits: torch.Tensor, low: torch.Tensor | None, geo: CallGeometry, cfg: AnchorConfig,
                 scale: float, dense_from: int, compute_recall: bool):
    """The statistics of a Triton-path call from its bitmask (``low``: the blocks the guard made dense, or ``None``):
    ``(kept, kept_columns, mass)``, ``kept`` ``[B, H]`` float64 kept causal pairs over the valid queries (rows
    ``>= dense_from`` count every valid causal key), ``kept_columns`` ``[B, H, nb]`` int64, ``mass`` ``[B, H, Lq]``
    float64 exact softmax mass on each query's kept keys (``None`` unless ``compute_recall``).  One pass of
    :func:`block_masses` over every block (the cost of a dense ``Q K^T`` in float32)."""
    b, h, lq, _ = q.shape
    bq, nb = cfg.block_size, geo.nb
    dev = q.device
    mass, count = block_masses(q, k, bits, geo, cfg, scale, list(range(nb)), dense_blocks=low)
    count = count.reshape(b, h, nb * bq).to(torch.int64)
    valid_cum = geo.key_valid.to(torch.int64).cumsum(-1)  # [B, Lk] valid keys at or before each position
    pos = (geo.q_offset + torch.arange(nb * bq, device=dev)).clamp(max=geo.lk - 1)
    count[:, :, dense_from:] = valid_cum[:, None, pos[dense_from:]]
    kept = (count * geo.query_valid[:, None]).sum(-1).double()
    cols = bits_popcount(bits)
    if low is not None:  # guarded blocks kept every valid causal key
        cols = torch.where(low, valid_cum[:, geo.block_end - 1][:, None], cols)
    rows = mass.reshape(b, h, nb * bq)[:, :, :lq].double() if compute_recall else None
    return kept, cols, rows


def bits_popcount(bits: torch.Tensor) -> torch.Tensor:
    """``[..., W]`` int32 words -> ``[...]`` int64 number of set bits (kept keys per bitmask row), on the device,
    in chunks of rows (a byte lookup table; no ``[..., 32 W]`` intermediate)."""
    global _POP8
    if _POP8 is None:
        _POP8 = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)
    table = _POP8.to(bits.device)
    by = bits.contiguous().view(torch.uint8).reshape(-1, bits.shape[-1] * 4)
    out = torch.empty(by.shape[0], dtype=torch.int64, device=bits.device)
    step = max(1, (1 << 24) // max(by.shape[1], 1))
    for r in range(0, by.shape[0], step):
        out[r : r + step] = table[by[r : r + step].long()].sum(-1)
    return out.reshape(bits.shape[:-1])
