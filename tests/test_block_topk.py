"""``block_topk``: XAttention block-sparse prefill (antidiagonal block masses, cumulative-mass selection).

Checked against a float64 reference written here with explicit index arithmetic (strided antidiagonals
gathered by position, the selection as a Python loop, dense masked softmax), on odd sizes, grouped-query
keys, left padding and prompts continued on a cache; the exact limit; hand-computed selections; option
errors; a tiny Llama end to end (exact limit, causality, padding, cache continuation, decoding).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from attnpatch import OptionError, patch, patched, record_stats
from attnpatch.attention.sparse import block_topk as bt
from attnpatch.attention.sparse.block_topk import antidiagonal_block_mass, block_topk_attention, select_blocks
from attnpatch.attention.backends.cpu_kernel import stripe_kernel
from attnpatch.patchers.methods.block_topk import BlockTopkConfig

from conftest import tiny_causal_lm

KERNELS = ["torch"] + (["compiled"] if stripe_kernel() is not None else [])


# --------------------------------------------------------------------------- the float64 reference


def reference_one(q, k, v, *, scale, bs, st, thr, q_offset):
    """One sequence without padding, float64.  Returns ``(out [1, H, Lq, D], blocks [1, H, nbq, nbk])``."""
    q, k, v = q.double(), k.double(), v.double()
    _, h, lq, d = q.shape
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, 1)[:, :, : q_offset + lq], v.repeat_interleave(g, 1)[:, :, : q_offset + lq]
    lk = q_offset + lq
    lp = (-q_offset) % bs  # empty key slots before key 0: the queries start on a block boundary
    c0 = (lp + q_offset) // bs
    nbq = math.ceil(lq / bs)
    nbk = c0 + nbq
    r = bs // st
    # strided antidiagonal logits e[a, j] = scale / S * sum_s q(aS + S-1-s) . k(jS + s), positions in the padded grids
    rows, groups = nbq * r, nbk * r
    e = torch.zeros(h, rows, groups, dtype=torch.float64)
    for a in range(rows):
        for j in range(groups):
            tot = torch.zeros(h, dtype=torch.float64)
            for s in range(st):
                qi = a * st + st - 1 - s  # query row of the call
                kj = j * st + s - lp  # real key index
                if qi < lq and 0 <= kj < lk:
                    tot += (q[0, :, qi] * k[0, :, kj]).sum(-1)
            e[:, a, j] = tot * scale / st
    mass = torch.zeros(h, nbq, nbk, dtype=torch.float64)
    for a in range(rows):
        if a * st >= lq:
            continue  # no query in this strided row
        a_abs = c0 * r + a
        ok = [j for j in range(groups) if j <= a_abs and (j + 1) * st > lp]
        p = torch.softmax(e[:, a, ok], -1)
        for n, j in enumerate(ok):
            mass[:, a // r, j // r] += p[:, n]
    blocks = torch.zeros(h, nbq, nbk, dtype=torch.bool)
    for hh in range(h):
        for i in range(nbq):
            diag = c0 + i
            causal = list(range(diag + 1))
            if thr >= 1:
                blocks[hh, i, causal] = True
                continue
            forced = [c for c in causal if c == diag or c * bs < lp + bs]
            kept = sum(float(mass[hh, i, c]) for c in forced)
            total = sum(float(mass[hh, i, c]) for c in causal)
            blocks[hh, i, forced] = True
            for c in sorted((c for c in causal if c not in forced), key=lambda c: -float(mass[hh, i, c])):
                if kept >= thr * total:
                    break
                blocks[hh, i, c] = True
                kept += float(mass[hh, i, c])
    keymask = torch.zeros(h, lq, lk, dtype=torch.bool)
    for i in range(lq):
        for j in range(q_offset + i + 1):
            keymask[:, i, j] = blocks[:, i // bs, (j + lp) // bs]
    logits = scale * q[0] @ k[0].transpose(-1, -2)
    out = torch.softmax(logits.masked_fill(~keymask, -math.inf), -1) @ v[0]
    return out[None], blocks[None]


def reference(q, k, v, *, scale, bs, st, thr, q_offset=0, key_valid=None):
    """Each sequence with its padding stripped (left padding: keys before the first valid one), zeros for padded queries."""
    b, h, lq, _ = q.shape
    out = torch.zeros(b, h, lq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        p = 0 if key_valid is None else int(key_valid[bi].nonzero()[0])
        qi0 = max(0, p - q_offset)
        o, _ = reference_one(q[bi : bi + 1, :, qi0:], k[bi : bi + 1, :, p:], v[bi : bi + 1, :, p:], scale=scale, bs=bs, st=st,
                             thr=thr, q_offset=q_offset + qi0 - p)
        out[bi, :, qi0:] = o[0]
    return out


def _qkv(b, h, hkv, lq, lk, d, seed, sharp=2.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g) * sharp
    k = torch.randn(b, hkv, lk, d, generator=g) * sharp
    v = torch.randn(b, hkv, lk, d, generator=g)
    return q, k, v


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


# --------------------------------------------------------------------------- the math


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("h,hkv,lq,q_offset,bs,st,thr", [
    (4, 2, 77, 0, 16, 4, 0.6),     # grouped-query keys, partial last block
    (2, 2, 64, 0, 8, 8, 0.8),      # stride = block size (one antidiagonal per block)
    (3, 1, 45, 21, 16, 4, 0.7),    # continued on a cache, q_offset not a multiple of the block
    (2, 1, 50, 32, 16, 2, 0.5),    # continued on a cache at a block boundary
])
def test_fast_path_matches_float64_reference(kernel, h, hkv, lq, q_offset, bs, st, thr):
    q, k, v = _qkv(2, h, hkv, lq, q_offset + lq, 16, seed=lq + q_offset)
    out, stats = block_topk_attention(q, k, v, scale=0.25, block_size=bs, stride=st, threshold=thr, q_offset=q_offset,
                                      kernel=kernel, return_stats=True)
    ref = reference(q, k, v, scale=0.25, bs=bs, st=st, thr=thr, q_offset=q_offset)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    for bi in range(2):  # the kept blocks themselves
        _, blocks = reference_one(q[bi : bi + 1], k[bi : bi + 1], v[bi : bi + 1], scale=0.25, bs=bs, st=st, thr=thr,
                                  q_offset=q_offset)
        assert torch.equal(stats.kept_blocks[bi], blocks[0].sum(-1))
        mass = antidiagonal_block_mass(q[bi : bi + 1], k[bi : bi + 1], block_size=bs, stride=st, scale=0.25, q_offset=q_offset)
        assert torch.equal(select_blocks(mass, threshold=thr, q_offset=q_offset, block_size=bs), blocks)
    sparsity = 1 - stats.kept_pairs / stats.causal_pairs
    assert float(sparsity.mean()) > 0.05  # something was skipped: the comparison is not one of dense attention
    assert _rel(ref, reference(q, k, v, scale=0.25, bs=bs, st=st, thr=1.0, q_offset=q_offset)) > 1e-3


@pytest.mark.parametrize("kernel", KERNELS)
def test_left_padding_matches_reference_and_each_row_alone(kernel):
    q, k, v = _qkv(3, 4, 2, 70, 70, 16, seed=9)
    valid = torch.ones(3, 70, dtype=torch.bool)
    valid[1, :13] = False
    valid[2, :40] = False
    out = block_topk_attention(q, k, v, scale=0.25, block_size=16, stride=4, threshold=0.6, key_valid=valid, kernel=kernel)[0]
    ref = reference(q, k, v, scale=0.25, bs=16, st=4, thr=0.6, key_valid=valid)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    alone = block_topk_attention(q[1:2, :, 13:], k[1:2, :, 13:], v[1:2, :, 13:], scale=0.25, block_size=16, stride=4,
                                 threshold=0.6, kernel=kernel)[0]
    torch.testing.assert_close(out[1:2, :, 13:], alone, rtol=1e-6, atol=1e-6)
    assert float(out[1, :, :13].abs().max()) == 0.0  # padded queries: zeros


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("lq,q_offset,pad", [(96, 0, 0), (61, 0, 0), (40, 27, 0), (70, 0, 11), (33, 19, 5)])
def test_threshold_one_is_exact_causal_attention(kernel, lq, q_offset, pad):
    q, k, v = _qkv(2, 4, 2, lq, q_offset + lq, 16, seed=lq, sharp=3.0)
    valid = torch.ones(2, q_offset + lq, dtype=torch.bool)
    valid[1, :pad] = False
    out, st = block_topk_attention(q, k, v, scale=0.25, block_size=16, stride=4, threshold=1.0, q_offset=q_offset,
                                   key_valid=valid if pad else None, kernel=kernel, return_stats=True)
    i = q_offset + torch.arange(lq)
    mask = (torch.arange(q_offset + lq)[None, :] <= i[:, None])[None, None] & valid[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    rows = valid[:, q_offset:]
    assert _rel(out.transpose(1, 2)[rows], want.transpose(1, 2)[rows]) < 1e-6
    torch.testing.assert_close(st.kept_pairs, st.causal_pairs)


def test_padding_inside_the_keys():
    """A hole in a sequence's keys (not left padding): masked in the scores and in the attention."""
    q, k, v = _qkv(2, 4, 2, 64, 64, 16, seed=5)
    valid = torch.ones(2, 64, dtype=torch.bool)
    valid[1, 20:29] = False
    mask = torch.ones(64, 64, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    out = block_topk_attention(q, k, v, scale=0.25, block_size=16, stride=4, threshold=1.0, key_valid=valid)[0]
    assert _rel(out.transpose(1, 2)[valid], want.transpose(1, 2)[valid]) < 1e-6
    blocks, keep = bt.block_topk_keep(q, k, scale=0.25, block_size=16, stride=4, threshold=0.0, key_valid=valid)
    assert not keep[1, :, :, 20:29].any() and keep[1, :, 1, 16:20].all()  # block 1 is the diagonal of query block 1
    mass = antidiagonal_block_mass(q, k, block_size=16, stride=4, scale=0.25, key_valid=valid)
    assert torch.isfinite(mass).all() and torch.allclose(mass[1].sum(-1), torch.full((4, 4), 4.0))


def test_selection_by_hand():
    # one query block whose diagonal is key block 4; key block 0 is the first block
    mass = torch.tensor([0.10, 0.50, 0.05, 0.30, 0.05])[None, None, None].expand(1, 1, 1, 5)
    sel = lambda thr: select_blocks(mass, threshold=thr, q_offset=64, block_size=16)[0, 0, 0].tolist()
    # forced 0 and 4 carry 0.15; then 0.50 (kept: 0.15 before it), 0.30 (0.65 before it), 0.05 (0.95 before it)
    assert sel(0.9) == [True, True, False, True, True]
    assert sel(0.6) == [True, True, False, False, True]
    assert sel(0.15) == [True, False, False, False, True]
    assert sel(0.0) == [True, False, False, False, True]
    assert sel(0.96) == [True, True, True, True, True]
    # q_offset = 70: 10 empty slots before key 0, so key block 1 holds keys 6..21 and is a first block too
    mass = torch.tensor([0.1, 0.0, 0.2, 0.6, 0.0, 0.1])[None, None, None].expand(1, 1, 1, 6)
    kept = select_blocks(mass, threshold=0.0, q_offset=70, block_size=16)[0, 0, 0].tolist()
    assert kept == [True, True, False, False, False, True]
    kept = select_blocks(mass, threshold=0.5, q_offset=70, block_size=16)[0, 0, 0].tolist()
    assert kept == [True, True, False, True, False, True]
    # threshold 1 keeps every causal block, also those of estimated mass 0
    assert select_blocks(mass, threshold=1.0, q_offset=70, block_size=16)[0, 0, 0].all()


def test_antidiagonal_mass_by_hand():
    """block 2, stride 2, one key/query per position: row a sums q(2a+1).k(2j) + q(2a).k(2j+1)."""
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 3.0]])[None, None]
    k = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 2.0]])[None, None]
    mass = antidiagonal_block_mass(q, k, block_size=2, stride=2, scale=1.0)
    # row 0 (queries 0, 1) sees group 0 only; row 1 (queries 2, 3): e_10 = (q3.k0 + q2.k1) / 2 = (3 + 2) / 2,
    # e_11 = (q3.k2 + q2.k3) / 2 = (3 + 2) / 2: equal, so mass 0.5 / 0.5
    torch.testing.assert_close(mass[0, 0], torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
    k[0, 0, 3] = torch.tensor([5.0, 2.0])  # e_11 = (3 + 10) / 2 = 6.5 vs 2.5
    mass = antidiagonal_block_mass(q, k, block_size=2, stride=2, scale=1.0)
    p = torch.softmax(torch.tensor([2.5, 6.5]), -1)
    torch.testing.assert_close(mass[0, 0, 1], p)


def test_scoring_chunks_give_the_same_masses(monkeypatch):
    q, k, _ = _qkv(1, 4, 2, 200, 200, 16, seed=4)
    one = antidiagonal_block_mass(q, k, block_size=16, stride=4, scale=0.25)
    monkeypatch.setattr(bt, "CHUNK_ELEMENTS", 1)  # one query block per chunk
    torch.testing.assert_close(antidiagonal_block_mass(q, k, block_size=16, stride=4, scale=0.25), one, rtol=1e-6, atol=1e-7)
    assert torch.allclose(one.sum(-1)[..., :-1], torch.full((1, 4, 12), 4.0))  # 4 strided rows per whole block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_finite(dtype):
    q, k, v = _qkv(1, 4, 2, 96, 96, 16, seed=2, sharp=30.0)  # logits beyond float16 unless scaled in float32
    ref = block_topk_attention(q, k, v, scale=0.25, block_size=16, stride=4, threshold=0.9)[0]
    out = block_topk_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=0.25, block_size=16, stride=4, threshold=0.9)[0]
    assert out.dtype == dtype and torch.isfinite(out).all()
    exact = F.scaled_dot_product_attention(q, k, v, scale=0.25, is_causal=True, enable_gqa=True)
    dense_err = _rel(F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=0.25, is_causal=True,
                                                    enable_gqa=True), exact)
    assert _rel(out, ref) < max(4 * dense_err, 0.03) or _rel(out, exact) < 1.25 * _rel(ref, exact) + 2 * dense_err


def test_input_and_option_errors():
    q, k, v = _qkv(1, 2, 2, 20, 20, 8, seed=0)
    with pytest.raises(ValueError, match="multiple of stride"):
        block_topk_attention(q, k, v, scale=0.3, block_size=10, stride=4)
    with pytest.raises(ValueError, match="threshold"):
        block_topk_attention(q, k, v, scale=0.3, threshold=1.5)
    with pytest.raises(ValueError):
        block_topk_attention(q, k[:, :, :10], v[:, :, :10], scale=0.3)  # queries beyond the keys
    with pytest.raises(OptionError, match="does not divide"):
        BlockTopkConfig(block_size=100, stride=8)
    model = tiny_causal_lm("llama")
    for bad, words in [({"threshold": 1.5}, "threshold=1.5"), ({"threshold": -0.1}, "threshold=-0.1"),
                       ({"stride": 0}, "stride=0"), ({"block_size": 12, "stride": 8}, "does not divide"),
                       ({"min_len": "long"}, "min_len"), ({"blocks": 3}, "blocks")]:
        with pytest.raises(OptionError) as err:
            patch(model, "block_topk", **bad)
        assert words in str(err.value), str(err.value)


# --------------------------------------------------------------------------- a tiny Llama end to end


SMALL = dict(block_size=16, stride=4, min_len=32)


def _logits(model, ids, **kw):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(ids, **kw)


def test_tiny_llama_end_to_end():
    model = tiny_causal_lm("llama", layers=2)
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, ids).logits
    # threshold = 1: exact attention through the block-sparse kernel
    with patched(model, "block_topk", threshold=1.0, **SMALL), record_stats(model) as rec:
        out = _logits(model, ids).logits
    assert {r.mode for r in rec.forwards[0].values()} == {"sparse"}
    assert _rel(out, ref) < 1e-5
    # approximate: skips pairs; each layer's output is the reference's on that layer's q, k, v
    seen = {}

    def probe(ctx, q, k, v):
        seen[ctx.layer] = (q.clone(), k.clone(), v.clone(), ctx.scale)

    with patched(model, "block_topk", threshold=0.5, **SMALL), record_stats(model, recall=True, capture=True, probe=probe) as rec:
        out = _logits(model, ids).logits
    for layer, r in rec.forwards[0].items():
        assert r.mode == "sparse" and float(r.sparsity.min()) > 0.1 and 0.3 < float(r.recall.min()) < 1.0
        q, k, v, scale = seen[layer]
        want = reference(q, k, v, scale=scale, bs=16, st=4, thr=0.5)
        torch.testing.assert_close(rec.outputs[0][layer].double(), want, rtol=2e-5, atol=2e-5)
    assert 1e-4 < _rel(out, ref) < 1.0


def test_tiny_llama_cache_padding_and_decoding():
    model = tiny_causal_lm("qwen2", layers=2)
    ids = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids).logits
    with patched(model, "block_topk", threshold=1.0, **SMALL), record_stats(model) as rec:
        # a prompt continued on a cache (q_offset = 37: not a block boundary), then one decoding step
        first = _logits(model, ids[:, :37], use_cache=True)
        second = _logits(model, ids[:, 37:], past_key_values=first.past_key_values, use_cache=True)
        step = _logits(model, ids[:, :1], past_key_values=second.past_key_values, use_cache=True)
    assert _rel(second.logits, ref[:, 37:]) < 1e-5
    assert [r.mode for r in rec.forwards[1].values()] == ["sparse", "sparse"]
    assert [r.mode for r in rec.forwards[2].values()] == ["dense:decode", "dense:decode"]
    assert torch.isfinite(step.logits).all()
    # left padding: a padded row gives at its real tokens what those tokens give alone
    mask = torch.ones(2, 80, dtype=torch.long)
    mask[1, :21] = 0
    with patched(model, "block_topk", threshold=0.5, **SMALL):
        padded = _logits(model, ids, attention_mask=mask).logits
        alone = _logits(model, ids[1:, 21:]).logits
        short = _logits(model, ids[:, :31]).logits  # shorter than min_len: exact
    assert _rel(padded[1:, 21:], alone) < 1e-4
    assert _rel(short, ref[:, :31]) < 1e-6
