"""AnchorAttention's attention over kept stripes (exact softmax over the kept keys; Sec. 3, step 3) and the
dense causal attention that short prompts, ``dense_last`` queries and guarded heads run.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..backends.cpu_kernel import stripe_kernel
from ..backends.dispatch import Call, choose
from . import tiles
from .select import CallGeometry, pad_rows

__all__ = ["dense_causal_attention", "pair_counts", "attend_call", "sparse_attend", "dense_heads_attention",
           "dense_rows_attention"]


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


def pair_counts(keep: torch.Tensor | None, geo: CallGeometry, block_size: int, dense_from: int | None = None):
    """Causal pairs ``[B, H or 1]`` and kept causal pairs ``[B, Hs]`` from the stripe mask ``keep`` [B, Hs, nb, Lk]
    of query blocks of ``block_size`` queries.

    Queries with index ``>= dense_from`` count as keeping every causal key.
    """
    b = geo.key_valid.shape[0]
    bq, nb = block_size, geo.nb
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


def attend_call(q: torch.Tensor, geo: CallGeometry) -> Call:
    """The :class:`~attnpatch.attention.backends.dispatch.Call` of an attention over kept keys: ``q``'s device, dtype and
    head size, the keys, and whether some key inside a sequence is padding."""
    return Call.of(q, keys=geo.lk, inner_padding=geo.inner_padding)


def _lse_path_ok(q: torch.Tensor, geo: CallGeometry) -> bool:
    """Whether the two-part (diagonal + off-diagonal, log-sum-exp merged) path applies: the ``"flash_lse"`` kernel of
    the operation ``"anchor_merge"`` (PyTorch's CPU flash-attention kernel, which also returns each row's
    log-sum-exp, without padding inside the keys); otherwise the one-call masked path."""
    return choose("anchor_merge", "auto", attend_call(q, geo)) == "flash_lse"


def sparse_attend(q, k, v, keep, geo: CallGeometry, block_size: int, scale: float, *, use: str = "torch",
                  merge: bool | None = None) -> torch.Tensor:
    """Exact attention of each query block (``block_size`` queries) over its kept keys ``keep`` ``[B, H, nb, Lk]``
    bool; ``q`` ``[B, H, Lq, D]``, ``k, v`` ``[B, Hkv, Lk, D]``; returns ``[B, H, Lq, D]``.

    ``use`` is the kernel :func:`~attnpatch.attention.backends.dispatch.choose` picked for the call (operation
    ``"anchor_attend"``; never ``"triton"`` here: that path reads a bitmask, :mod:`.triton_attend`).
    With the compiled CPU kernel (``use="compiled"``), each (batch, head, query
    block) gathers its kept keys ``tiles.KV_TILE`` at a time into a per-thread buffer inside a
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
    bq, nb = block_size, geo.nb
    dev = q.device
    if use == "compiled" and merge is None:
        return stripe_kernel().stripe_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), keep.contiguous(), geo.q_offset, bq, scale, tiles.KV_TILE, tiles.Q_TILE
        )
    if merge is None:
        merge = _lse_path_ok(q, geo)
    n_groups = b * h * nb
    p0 = geo.q_offset + torch.arange(nb, device=dev) * bq  # first query position of each block
    j = torch.arange(lk, device=dev)
    off = (keep & (j < p0[:, None])).reshape(n_groups, lk)  # kept keys strictly before the block
    counts = off.sum(-1)
    qg = pad_rows(q, nb * bq).reshape(n_groups, bq, d)
    grp = torch.arange(n_groups, device=dev)
    g_b, g_h, g_blk = grp // (h * nb), (grp // nb) % h, grp % nb
    kv_base = (g_b * hkv + g_h // g) * lk  # flat row of key 0 of the group's key/value head
    kflat, vflat = k.reshape(-1, d), v.reshape(-1, d)
    sorted_counts, perm = counts.sort()
    budget = tiles.CHUNK_ELEMENTS // 2

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
        kd = pad_rows(k[:, :, geo.q_offset : geo.q_offset + lq], nb * bq).reshape(b, hkv, 1, nb, bq, d)
        vd = pad_rows(v[:, :, geo.q_offset : geo.q_offset + lq], nb * bq).reshape(b, hkv, 1, nb, bq, d)
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



def dense_heads_attention(q, k, v, heads: torch.Tensor, scale: float, q_offset: int, key_valid) -> torch.Tensor:
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


def dense_rows_attention(q, k, v, heads: torch.Tensor, scale: float, geo: CallGeometry, r0: int, r1: int) -> torch.Tensor:
    """``[B, H, r1 - r0, D]`` exact causal attention of the query rows ``r0 .. r1 - 1`` (absolute positions
    ``q_offset + r0 ..``) for the query heads where ``heads`` ([H] bool) is True, zeros elsewhere.

    On the CPU without inner padding (:func:`_lse_path_ok`): per key/value head, one flash-attention call
    over the keys before the rows and one causal call over the rows' own keys, merged by their
    log-sum-exps (Dao et al. 2022, Sec. 3.1); K/V are not repeated.  Otherwise :func:`dense_heads_attention` in
    chunks of about ``tiles.CHUNK_ELEMENTS / Lk`` rows, each against the keys up to its own last query (a
    chunk's mask is ``rows x keys`` booleans, never ``Lq x Lk``).
    """
    b, h, _, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    p0, p1 = geo.q_offset + r0, geo.q_offset + r1
    if not _lse_path_ok(q, geo):
        key_valid = geo.key_valid
        out = q.new_zeros(b, h, r1 - r0, d)
        step = max(1, tiles.CHUNK_ELEMENTS // max(k.shape[2], 1))
        for c0 in range(r0, r1, step):
            c1 = min(r1, c0 + step)
            e = geo.q_offset + c1  # keys after the chunk's last query are causal for none of its rows
            out[:, :, c0 - r0 : c1 - r0] = dense_heads_attention(
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
