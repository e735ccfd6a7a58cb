"""Vertical-slash (MInference): scores, selection and the column + diagonal attention against float64 references
written from the definitions; exact limits; chunks and causality; padding and a prompt continued on a cache;
half precision; options; a tiny model end to end."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from attnpatch import OptionError, patch, patched, record_stats
from attnpatch.attention.sparse.column_diagonal import column_diagonal_attention
from attnpatch.attention.sparse.vertical_slash import (
    LOCAL_DIAGONALS,
    vertical_slash_attention,
    vertical_slash_pattern,
    vertical_slash_scores,
)
from attnpatch.patchers.methods.vertical_slash import VerticalSlashConfig
from conftest import tiny_causal_lm


def _inputs(b, h, hkv, lq, lk, d, seed=0, pad=None, inner=None, sharp=1.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g) * sharp
    k = torch.randn(b, hkv, lk, d, generator=g) * sharp
    v = torch.randn(b, hkv, lk, d, generator=g)
    key_valid = None
    if pad is not None or inner is not None:
        key_valid = torch.ones(b, lk, dtype=torch.bool)
        for i, p in enumerate(pad or []):
            key_valid[i, :p] = False
        for i, j in inner or []:
            key_valid[i, j] = False
    return q, k, v, key_valid


# --------------------------------------------------------------------------- float64 references, from the definitions


def reference_scores(q_last, k, q_start, scale, key_valid=None):
    """Per (sequence, head): ``A = softmax`` of the estimation queries over their causal valid keys; column sums;
    diagonal sums ``slash[o] = sum_r A[r, i_r - o]`` accumulated one query row at a time."""
    b, h, n, _ = q_last.shape
    lc = k.shape[2]
    g = h // k.shape[1]
    kv = torch.ones(b, lc, dtype=torch.bool) if key_valid is None else key_valid
    kk = k.double().repeat_interleave(g, 1)
    vert = torch.zeros(b, h, lc, dtype=torch.float64)
    slash = torch.zeros(b, h, lc, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for r in range(n):
                i = q_start + r
                if not kv[bi, i]:
                    continue  # a padding query does not vote
                keys = [j for j in range(i + 1) if kv[bi, j]]
                if not keys:
                    continue
                s = (kk[bi, hi, keys] @ q_last[bi, hi, r].double()) * scale
                a = torch.softmax(s, 0)
                for a_j, j in zip(a.tolist(), keys):
                    vert[bi, hi, j] += a_j
                    slash[bi, hi, i - j] += a_j
    return vert, slash


def reference_select(vert, slash, vertical, slash_count, key_valid=None):
    """Top columns among the valid keys; top diagonals with the local ones forced."""
    b, h, lc = vert.shape
    cols = torch.zeros(b, h, lc, dtype=torch.bool)
    diags = torch.zeros(b, h, lc, dtype=torch.bool)
    for bi in range(b):
        valid = [j for j in range(lc) if key_valid is None or key_valid[bi, j]]
        for hi in range(h):
            order = sorted(valid, key=lambda j: -float(vert[bi, hi, j]))
            cols[bi, hi, order[:vertical]] = True
            score = slash[bi, hi].clone()
            score[:LOCAL_DIAGONALS] = math.inf
            order = sorted(range(lc), key=lambda o: -float(score[o]))
            diags[bi, hi, order[:slash_count]] = True
    return cols, diags


def reference_keep(cols, diags, lq, lk, q_offset, key_valid=None):
    """``[B, H, Lq, Lk]``: ``j <= i``, valid, and column ``j`` or diagonal ``i - j`` kept."""
    b, h, lc = cols.shape
    i = q_offset + torch.arange(lq)
    j = torch.arange(lk)
    off = i[:, None] - j[None, :]
    causal = off >= 0
    on_diag = torch.gather(diags[:, :, None, :].expand(b, h, lq, lc), 3, off.clamp(0, lc - 1)[None, None].expand(b, h, lq, lk)) \
        if lk <= lc else None
    col = torch.zeros(b, h, 1, lk, dtype=torch.bool)
    col[..., :lc] = cols[:, :, None, :]
    if on_diag is None:
        dpad = torch.zeros(b, h, lk, dtype=torch.bool)
        dpad[..., :lc] = diags
        on_diag = torch.gather(dpad[:, :, None, :].expand(b, h, lq, lk), 3, off.clamp(0, lk - 1)[None, None].expand(b, h, lq, lk))
    keep = causal[None, None] & (col | on_diag)
    if key_valid is not None:
        keep &= key_valid[:, None, None, :]
    return keep


def reference_attention(q, k, v, keep, scale):
    g = q.shape[1] // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~keep, -math.inf), -1).nan_to_num(0.0) @ v.double().repeat_interleave(g, 1)


def reference_vertical_slash(q, k, v, *, vertical, slash, last_q, scale, q_offset=0, key_valid=None, chunk=None):
    """Each sequence alone (its padding before the first and after the last real token stripped), chunk by chunk."""
    b, h, lq, _ = q.shape
    out = torch.zeros(b, h, lq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        kv = torch.ones(k.shape[2], dtype=torch.bool) if key_valid is None else key_valid[bi]
        idx = kv.nonzero().flatten()
        if idx.numel() == 0:
            continue
        first, end = int(idx[0]), min(int(idx[-1]) + 1, q_offset + lq)
        qi0, qi1 = max(0, first - q_offset), max(0, min(lq, end - q_offset))
        if qi1 <= qi0:
            continue
        qs, ks, vs = q[bi : bi + 1, :, qi0:qi1], k[bi : bi + 1, :, first:end], v[bi : bi + 1, :, first:end]
        kvs = kv[None, first:end]
        off = q_offset + qi0 - first
        n_q = qi1 - qi0
        step = n_q if chunk is None else chunk
        for c0 in range(0, n_q, step):
            c1 = min(n_q, c0 + step)
            lc = off + c1
            m = min(last_q, c1 - c0)
            vert, sl = reference_scores(qs[:, :, c1 - m : c1], ks[:, :, :lc], lc - m, scale, kvs[:, :lc])
            cols, diags = reference_select(vert, sl, vertical, slash, kvs[:, :lc])
            keep = reference_keep(cols, diags, c1 - c0, lc, off + c0, kvs[:, :lc])
            out[bi : bi + 1, :, qi0 + c0 : qi0 + c1] = reference_attention(qs[:, :, c0:c1], ks[:, :, :lc], vs[:, :, :lc], keep, scale)
    return out


# --------------------------------------------------------------------------- scores and selection


@pytest.mark.parametrize("b,h,hkv,n,lc,kv_inner", [(2, 4, 2, 8, 40, None), (1, 6, 3, 16, 16, None), (2, 2, 1, 5, 33, [(0, 3), (1, 30)])])
def test_scores_match_the_reference(b, h, hkv, n, lc, kv_inner):
    q, k, _, kv = _inputs(b, h, hkv, n, lc, 8, seed=1, inner=kv_inner)
    vert, sl = vertical_slash_scores(q, k, scale=0.35, q_start=lc - n, key_valid=kv)
    rv, rs = reference_scores(q, k, lc - n, 0.35, kv)
    assert vert.dtype == torch.float32 and vert.shape == (b, h, lc)
    assert (vert.double() - rv).abs().max() < 1e-5 and (sl.double() - rs).abs().max() < 1e-5
    # every estimation query's probabilities sum to one, over columns and over diagonals alike
    voters = n if kv is None else kv[:, lc - n :].sum(-1)[:, None]
    assert torch.allclose(vert.sum(-1).double(), torch.as_tensor(voters, dtype=torch.float64).expand(b, h), atol=1e-4)
    assert torch.allclose(sl.sum(-1), vert.sum(-1), atol=1e-4)


def test_selection_matches_the_reference_and_clamps():
    q, k, _, kv = _inputs(2, 4, 2, 12, 90, 8, seed=2, inner=[(1, 50), (1, 51)])
    for vertical, slash in [(7, 30), (0, 1), (500, 500), (89, 20)]:
        cols, diags = vertical_slash_pattern(q, k, vertical=vertical, slash=slash, scale=0.35, q_start=78, key_valid=kv)
        rv, rs = reference_scores(q, k, 78, 0.35, kv)
        rc, rd = reference_select(rv, rs, vertical, slash, kv)
        assert torch.equal(cols, rc) and torch.equal(diags, rd), (vertical, slash)
        assert int(cols[0, 0].sum()) == min(vertical, 90) and int(cols[1, 0].sum()) == min(vertical, 88)
        assert int(diags[0, 0].sum()) == min(slash, 90)
        assert bool(diags[..., : min(slash, LOCAL_DIAGONALS)].all())


# --------------------------------------------------------------------------- the column + diagonal attention


@pytest.mark.parametrize("b,h,hkv,p,lq,lk,off,block,inner,density", [
    (2, 4, 2, 4, 100, 100, 0, 16, None, 0.1),  # per query head
    (2, 4, 2, 2, 77, 90, 13, 16, None, 0.2),  # per key/value head, a prompt continued on a cache
    (1, 6, 3, 1, 130, 130, 0, 32, None, 0.05),  # one pattern for all heads
    (2, 4, 4, 4, 45, 61, 16, 8, [(0, 3), (1, 20), (1, 21)], 0.3),  # padding inside the keys
    (1, 2, 1, 2, 33, 33, 0, 128, None, 0.0),  # nothing kept but the diagonal 0 (forced below)
])
def test_column_diagonal_attention_matches_the_reference(b, h, hkv, p, lq, lk, off, block, inner, density):
    q, k, v, kv = _inputs(b, h, hkv, lq, lk, 8, seed=4, inner=inner)
    lc = off + lq
    g = torch.Generator().manual_seed(5)
    cols = torch.rand(b, p, lc, generator=g) < density
    diags = torch.rand(b, p, lc, generator=g) < density
    diags[..., 0] = True
    out, kept = column_diagonal_attention(q, k, v, cols, diags, scale=0.3, q_offset=off, key_valid=kv, block=block,
                                          return_counts=True)
    rep = h // p
    keep = reference_keep(cols.repeat_interleave(rep, 1), diags.repeat_interleave(rep, 1), lq, lk, off, kv)
    ref = reference_attention(q, k, v, keep, 0.3)
    assert (out.double() - ref).abs().max() < 2e-6
    qv = torch.ones(b, lq, dtype=torch.bool) if kv is None else kv[:, off : off + lq]
    assert torch.equal(kept, (keep & qv[:, None, :, None]).sum((-1, -2)).double())


def test_block_size_changes_rounding_only():
    q, k, v, _ = _inputs(1, 4, 2, 300, 300, 16, seed=6)
    cols, diags = vertical_slash_pattern(q[:, :, -32:], k, vertical=40, slash=60, scale=0.25, q_start=268)
    outs = [column_diagonal_attention(q, k, v, cols, diags, scale=0.25, block=blk)[0] for blk in (4, 16, 64, 128, 512)]
    for o in outs[1:]:
        assert (o - outs[0]).abs().max() < 1e-5


# --------------------------------------------------------------------------- the whole method


CASES = [
    # b, h, hkv, lq, lk, vertical, slash, last_q, chunk, pad
    (2, 4, 2, 150, 150, 10, 30, 16, None, None),
    (2, 4, 2, 150, 150, 10, 30, 16, 40, None),  # chunks of 40 queries
    (1, 4, 4, 97, 131, 12, 25, 64, None, None),  # a prompt continued on a cache; last_q beyond the call
    (3, 6, 2, 120, 120, 5, 20, 8, 50, [0, 30, 119]),  # left padding, a one-token sequence
    (2, 4, 2, 80, 80, 0, 17, 16, None, [7, 0]),  # no columns: the diagonals only
    (1, 2, 1, 1, 9, 0, 1, 4, None, None),  # one query on a cache, itself only
    (1, 2, 1, 30, 40, 2, 5, 4, None, None),  # fewer diagonals than the forced local ones: 0 .. 4
]


@pytest.mark.parametrize("b,h,hkv,lq,lk,vertical,slash,last_q,chunk,pad", CASES)
def test_matches_the_float64_reference(b, h, hkv, lq, lk, vertical, slash, last_q, chunk, pad):
    q, k, v, kv = _inputs(b, h, hkv, lq, lk, 8, seed=8, pad=pad, sharp=2.0)
    off = lk - lq
    out, kept = vertical_slash_attention(q, k, v, vertical=vertical, slash=slash, last_q=last_q, scale=0.35, q_offset=off,
                                         key_valid=kv, chunk=chunk, return_counts=True)
    ref = reference_vertical_slash(q, k, v, vertical=vertical, slash=slash, last_q=last_q, scale=0.35, q_offset=off,
                                   key_valid=kv, chunk=chunk)
    assert out.shape == (b, h, lq, 8) and out.dtype == q.dtype
    assert (out.double() - ref).abs().max() < 2e-6
    causal = torch.tensor([sum(min(i + 1, lk) - (p or 0) for i in range(max(off, p or 0), lk)) for p in (pad or [0] * b)])
    assert bool((kept <= causal[:, None]).all()) and bool((kept > 0).all())
    long = causal > 1200
    assert bool((kept[long] < causal[long, None]).all())  # approximate: some causal pairs skipped


@pytest.mark.parametrize("which", ["vertical", "slash"])
@pytest.mark.parametrize("lq,lk,pad", [(96, 96, None), (200, 200, [0, 33]), (70, 110, None)])
def test_exact_limits_are_causal_softmax_attention(which, lq, lk, pad):
    q, k, v, kv = _inputs(2, 4, 2, lq, lk, 16, seed=9, pad=pad)
    off = lk - lq
    counts = {"vertical": 3, "slash": 3, which: lk}
    out = vertical_slash_attention(q, k, v, **counts, last_q=16, scale=0.25, q_offset=off, key_valid=kv)[0]
    i, j = off + torch.arange(lq), torch.arange(lk)
    mask = (j[None, :] <= i[:, None])[None, None] & (torch.ones(2, lk, dtype=torch.bool) if kv is None else kv)[:, None, None]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.25)
    qv = (torch.ones(2, lq, dtype=torch.bool) if kv is None else kv[:, off:])[:, None].expand(2, 4, lq)
    rel = (out - ref)[qv].norm() / ref[qv].norm()
    assert rel < 1e-6, rel


def test_chunks_bound_what_an_output_depends_on():
    """With chunks, changing the last token leaves the earlier chunks' outputs as they were; with one chunk (the
    default, MInference) the estimation queries at the end choose every query's pattern."""
    q, k, v, _ = _inputs(1, 4, 2, 160, 160, 8, seed=10, sharp=2.5)
    q2, k2 = q.clone(), k.clone()
    q2[:, :, -1] = -q2[:, :, -1]
    k2[:, :, -1] = -k2[:, :, -1]
    kw = dict(vertical=6, slash=24, last_q=16, scale=0.35)
    a = vertical_slash_attention(q, k, v, chunk=64, **kw)[0]
    b = vertical_slash_attention(q2, k2, v, chunk=64, **kw)[0]
    assert torch.equal(a[:, :, :128], b[:, :, :128]) and not torch.equal(a[:, :, 128:], b[:, :, 128:])
    a = vertical_slash_attention(q, k, v, **kw)[0]
    b = vertical_slash_attention(q2, k2, v, **kw)[0]
    assert (a[:, :, :128] - b[:, :, :128]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite_and_close(dtype):
    q, k, v, kv = _inputs(2, 4, 2, 200, 200, 16, seed=11, pad=[0, 13])
    kw = dict(vertical=20, slash=40, last_q=32, scale=0.25, key_valid=kv)
    q = q * 30  # logits far beyond what a float16 product of unscaled q and k holds
    ref = vertical_slash_attention(q, k, v, **kw)[0]
    out = vertical_slash_attention(q.to(dtype), k.to(dtype), v.to(dtype), **kw)[0]
    assert out.dtype == dtype and torch.isfinite(out).all()
    qv = kv[:, None].expand(2, 4, 200)
    mask = kv[:, None, None, :] & torch.ones(200, 200, dtype=torch.bool).tril()
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    dense = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=0.25)
    dense_half = F.scaled_dot_product_attention(q.to(dtype), kr.to(dtype), vr.to(dtype), attn_mask=mask, scale=0.25)
    dense_err = (dense_half.float() - dense)[qv].norm() / dense[qv].norm()  # what the dtype costs exact attention

    # the attention on a given pattern costs what the dtype costs exact attention
    cols, diags = vertical_slash_pattern(q[:1, :, -32:], k[:1], vertical=20, slash=40, scale=0.25, q_start=168)
    same = column_diagonal_attention(q[:1], k[:1], v[:1], cols, diags, scale=0.25)[0]
    same_half = column_diagonal_attention(q[:1].to(dtype), k[:1].to(dtype), v[:1].to(dtype), cols, diags, scale=0.25)[0]
    assert (same_half.float() - same).norm() / same.norm() < max(2 * dense_err, 0.01)
    # the whole method: rounding may flip a column or diagonal at a near tie; the half run is then another
    # pattern of the same kind, as close to exact attention as the float32 one
    f32_err = (ref - dense)[qv].norm() / dense[qv].norm()
    half_err = (out.float() - dense)[qv].norm() / dense[qv].norm()
    assert half_err < 1.25 * f32_err + 2 * dense_err, (half_err, f32_err, dense_err)


def test_bad_inputs_and_options():
    q, k, v, _ = _inputs(1, 4, 2, 10, 10, 8)
    with pytest.raises(ValueError, match="last_q"):
        vertical_slash_attention(q, k, v, vertical=1, slash=2, last_q=0, scale=0.3)
    with pytest.raises(ValueError, match="q_offset"):
        vertical_slash_attention(q, k, v, vertical=1, slash=2, last_q=4, scale=0.3, q_offset=3)
    with pytest.raises(ValueError, match="P=3"):
        column_diagonal_attention(q, k, v, torch.ones(1, 3, 10, dtype=torch.bool), torch.ones(1, 3, 10, dtype=torch.bool), scale=0.3)
    with pytest.raises(ValueError, match="columns"):
        column_diagonal_attention(q, k, v, torch.ones(1, 1, 9, dtype=torch.bool), torch.ones(1, 1, 10, dtype=torch.bool), scale=0.3)
    for bad in (dict(vertical=-1), dict(slash=0), dict(last_q=0), dict(chunk=0)):
        with pytest.raises(OptionError, match=next(iter(bad))):
            VerticalSlashConfig(**bad)
    assert VerticalSlashConfig(chunk="none").chunk is None
    model = tiny_causal_lm("llama")
    with pytest.raises(OptionError, match="slash"):
        patch(model, "vertical_slash", slash="many")
    with pytest.raises(OptionError, match="top_k"):
        patch(model, "vertical_slash", top_k=3)


# --------------------------------------------------------------------------- a tiny model


def _run(model, ids, **kw):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(ids, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiny_model_end_to_end(family):
    """Exact limit through the code; the small setting skips pairs, changes the logits, and a prompt continued
    on the cache at a chunk boundary gives the one-pass logits; generation runs its decoding steps dense."""
    model = tiny_causal_lm(family)
    ids = torch.randint(0, 128, (1, 160), generator=torch.Generator().manual_seed(3))
    ref = _run(model, ids).logits
    with patched(model, "vertical_slash", vertical=160, slash=4, last_q=16):
        with record_stats(model) as rec:
            exact = _run(model, ids[:, :120]).logits  # one block of queries: through the sparse code
            longer = _run(model, ids).logits  # longer: the model's own attention, the same result
    assert {r.mode for fwd in rec.forwards for r in fwd.values()} == {"dense:vertical>=N"}
    assert (exact - ref[:, :120]).norm() / ref[:, :120].norm() < 1e-6
    assert torch.equal(longer, ref)
    small = dict(vertical=8, slash=24, last_q=16, chunk=32)
    with patched(model, "vertical_slash", **small):
        with record_stats(model) as rec:
            one = _run(model, ids).logits
        first = _run(model, ids[:, :96], use_cache=True)
        rest = _run(model, ids[:, 96:], past_key_values=first.past_key_values, use_cache=True).logits
        with record_stats(model) as rec_gen, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gen = model.generate(ids[:, :64], max_new_tokens=3, do_sample=False)
    layers = [r for fwd in rec.forwards for r in fwd.values()]
    assert {r.mode for r in layers} == {"sparse"}
    assert all(bool((r.kept_pairs < r.causal_pairs).all()) for r in layers)
    assert (one - ref).abs().max() > 1e-2  # the pattern changes the logits: the next check can fail
    assert (rest - one[:, 96:]).abs().max() < 1e-4
    assert (first.logits - one[:, :96]).abs().max() < 1e-4
    assert gen.shape == (1, 67)
    assert [r.mode for r in rec_gen.forwards[-1].values()] == ["dense:decode"] * 2


def reference_recall(q, k, *, vertical, slash, last_q, scale, q_offset=0, key_valid=None, chunk=None):
    """``[B, H]``: per sequence alone, chunk by chunk as :func:`reference_vertical_slash`, the mean over its real
    queries of the float64 softmax mass on the kept keys."""
    b, h, lq, _ = q.shape
    g = h // k.shape[1]
    out = torch.ones(b, h, dtype=torch.float64)
    for bi in range(b):
        kv = torch.ones(k.shape[2], dtype=torch.bool) if key_valid is None else key_valid[bi]
        idx = kv.nonzero().flatten()
        first, end = int(idx[0]), min(int(idx[-1]) + 1, q_offset + lq)
        qi0, qi1 = max(0, first - q_offset), max(0, min(lq, end - q_offset))
        qs, ks, kvs = q[bi : bi + 1, :, qi0:qi1], k[bi : bi + 1, :, first:end], kv[None, first:end]
        off, n_q = q_offset + qi0 - first, qi1 - qi0
        step = n_q if chunk is None else chunk
        tot, cnt = torch.zeros(h, dtype=torch.float64), 0
        for c0 in range(0, n_q, step):
            c1 = min(n_q, c0 + step)
            lc = off + c1
            m = min(last_q, c1 - c0)
            vert, sl = reference_scores(qs[:, :, c1 - m : c1], ks[:, :, :lc], lc - m, scale, kvs[:, :lc])
            cols, diags = reference_select(vert, sl, vertical, slash, kvs[:, :lc])
            keep = reference_keep(cols, diags, c1 - c0, lc, off + c0, kvs[:, :lc])
            full = reference_keep(torch.ones_like(cols), diags, c1 - c0, lc, off + c0, kvs[:, :lc])
            s = (qs[:, :, c0:c1].double() @ ks[:, :, :lc].double().repeat_interleave(g, 1).transpose(-1, -2)) * scale
            p = torch.softmax(s.masked_fill(~full, -math.inf), -1).nan_to_num(0.0)
            tot += (p * keep).sum(-1)[0].sum(-1)
            cnt += c1 - c0
        out[bi] = tot / cnt
    return out


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[3]])
def test_recall_is_the_exact_softmax_mass_on_the_kept_keys(case):
    from attnpatch.attention.sparse.vertical_slash import vertical_slash_recall

    b, h, hkv, lq, lk, vertical, slash, last_q, chunk, pad = case
    q, k, _, kv = _inputs(b, h, hkv, lq, lk, 8, seed=8, pad=pad, sharp=2.0)
    off = lk - lq
    kw = dict(vertical=vertical, slash=slash, last_q=last_q, scale=0.35, q_offset=off, key_valid=kv, chunk=chunk)
    got = vertical_slash_recall(q, k, **kw)
    want = reference_recall(q, k, **kw)
    assert got.shape == (b, h) and (got - want).abs().max() < 1e-5, (got, want)
    assert bool((got < 1).any())


def test_recall_is_recorded_by_the_method():
    model, ids = tiny_causal_lm("qwen2"), torch.randint(3, 100, (1, 90))
    with patched(model, "vertical_slash", vertical=4, slash=8, last_q=16), record_stats(model, recall=True) as rec, torch.no_grad():
        model(input_ids=ids)
    recs = list(rec.forwards[0].values())
    assert all(r.recall is not None and 0 < float(r.recall.min()) <= float(r.recall.max()) <= 1 + 1e-6 for r in recs)
    assert any(float(r.recall.min()) < 0.999 for r in recs)
