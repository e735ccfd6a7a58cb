"""A-shape (StreamingLLM sinks + local window): the blocked paths against a float64 reference, the exact limit,
padding and a prompt continued on a cache, half precision, options, and a tiny model end to end."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from attnpatch import OptionError, patch, patched, record_stats, unpatch
from attnpatch.attention.sparse.a_shape import a_shape_attention, a_shape_kept_pairs, a_shape_pattern
from attnpatch.attention.sparse.column_diagonal import column_diagonal_attention
from attnpatch.patchers.methods.a_shape import AShapeConfig
from conftest import tiny_causal_lm


def _inputs(b, h, hkv, lq, lk, d, seed=0, pad=None, inner=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g) * 1.5
    k = torch.randn(b, hkv, lk, d, generator=g) * 1.5
    v = torch.randn(b, hkv, lk, d, generator=g)
    key_valid = None
    if pad is not None or inner is not None:
        key_valid = torch.ones(b, lk, dtype=torch.bool)
        for i, p in enumerate(pad or []):
            key_valid[i, :p] = False
        for i, j in inner or []:
            key_valid[i, j] = False
    return q, k, v, key_valid


def reference_keep(b, lq, lk, q_offset, key_valid, init_tokens, window):
    """``[B, Lq, Lk]`` bool, written from the definition: the first ``init_tokens`` valid keys and the ``window``
    positions ending at the query, causal, valid keys only."""
    kv = torch.ones(b, lk, dtype=torch.bool) if key_valid is None else key_valid
    keep = torch.zeros(b, lq, lk, dtype=torch.bool)
    for bi in range(b):
        valid = [j for j in range(lk) if kv[bi, j]]
        initial = set(valid[:init_tokens])
        for r in range(lq):
            i = q_offset + r
            for j in valid:
                if j <= i and (j in initial or i - j < window):
                    keep[bi, r, j] = True
    return keep


def reference_attention(q, k, v, keep, scale):
    """Exact softmax over ``keep`` ([B, Lq, Lk]) in float64; rows without a kept key give zeros."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep[:, None], -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ vv


def _query_valid(key_valid, b, lq, q_offset):
    return torch.ones(b, lq, dtype=torch.bool) if key_valid is None else key_valid[:, q_offset : q_offset + lq]


CASES = [
    # b, h, hkv, lq, lk, d, q_offset, init, window, block, pad, inner
    (2, 4, 2, 300, 300, 8, 0, 5, 40, 32, None, None),  # prefix, edge and interior blocks, GQA
    (1, 4, 4, 301, 331, 8, 30, 50, 70, 16, None, None),  # a prompt continued on a cache, odd sizes
    (1, 2, 1, 123, 123, 8, 0, 3, 1, 16, None, None),  # window 1: itself and the initial keys
    (1, 2, 2, 100, 100, 8, 0, 200, 3, 16, None, None),  # init beyond the prompt: every causal key
    (2, 6, 3, 200, 230, 16, 30, 0, 500, 64, [0, 17], None),  # no initial keys; window >= N; left padding
    (2, 4, 2, 90, 90, 8, 0, 4, 20, 256, [0, 30], None),  # one block; left padding
    (3, 4, 2, 77, 77, 8, 0, 4, 9, 16, [5, 0, 60], None),  # a sequence of 17 tokens, one unpadded
    (2, 4, 2, 97, 97, 8, 0, 6, 11, 16, [3, 0], [(0, 10), (0, 11), (1, 40)]),  # padding inside the keys
]


@pytest.mark.parametrize("b,h,hkv,lq,lk,d,off,init,window,block,pad,inner", CASES)
def test_matches_the_float64_reference(b, h, hkv, lq, lk, d, off, init, window, block, pad, inner):
    q, k, v, kv = _inputs(b, h, hkv, lq, lk, d, pad=pad, inner=inner)
    scale = d**-0.5
    out, kept = a_shape_attention(q, k, v, init_tokens=init, window=window, scale=scale, q_offset=off, key_valid=kv,
                                  block=block, return_counts=True)
    keep = reference_keep(b, lq, lk, off, kv, init, window)
    ref = reference_attention(q, k, v, keep, scale)
    qv = _query_valid(kv, b, lq, off)
    assert out.shape == (b, h, lq, d) and out.dtype == q.dtype
    err = (out.double() - ref).abs().max()  # every row: queries without a kept key (left padding) give zeros
    assert err < 2e-6, err
    assert int((~keep.any(-1)).sum()) == sum(max(0, p - off) for p in pad or [])  # the zero rows are checked
    want = (keep & qv[:, :, None]).sum((1, 2)).double()
    assert torch.equal(kept, want[:, None].expand(b, h)), (kept[:, 0], want)


def test_block_size_changes_rounding_only():
    q, k, v, _ = _inputs(1, 3, 3, 517, 517, 16, seed=3)
    outs = [a_shape_attention(q, k, v, init_tokens=7, window=45, scale=0.25, block=blk)[0] for blk in (1, 8, 64, 256, 1024)]
    for o in outs[1:]:
        assert (o - outs[0]).abs().max() < 1e-5


def test_the_column_diagonal_engine_gives_the_same_pattern():
    """The inner-padding route (column + diagonal attention) and the blocked route agree on the same inputs."""
    q, k, v, _ = _inputs(2, 4, 2, 150, 170, 8, seed=5)
    cols, diags = a_shape_pattern(None, batch=2, keys=170, init_tokens=9, window=33)
    a = column_diagonal_attention(q, k, v, cols, diags, scale=0.3, q_offset=20, block=32)[0]
    b = a_shape_attention(q, k, v, init_tokens=9, window=33, scale=0.3, q_offset=20, block=64)[0]
    assert (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("lq,lk,pad", [(96, 96, None), (257, 257, None), (60, 100, None), (80, 80, [0, 9])])
def test_exact_limit_is_causal_softmax_attention(lq, lk, pad):
    q, k, v, kv = _inputs(2, 4, 2, lq, lk, 16, seed=7, pad=pad)
    off = lk - lq
    out = a_shape_attention(q, k, v, init_tokens=0, window=lk, scale=0.25, q_offset=off, key_valid=kv)[0]
    i, j = off + torch.arange(lq), torch.arange(lk)
    mask = (j[None, :] <= i[:, None])[None, None] & (torch.ones(2, lk, dtype=torch.bool) if kv is None else kv)[:, None, None]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.25)
    qv = _query_valid(kv, 2, lq, off)[:, None].expand(2, 4, lq)
    rel = (out - ref)[qv].norm() / ref[qv].norm()
    assert rel < 1e-6, rel


def test_kept_pairs_formula():
    for lq, off, init, w in [(50, 0, 4, 10), (33, 17, 0, 1), (10, 0, 100, 3), (64, 5, 8, 1000)]:
        keep = reference_keep(1, lq, off + lq, off, None, init, w)
        assert a_shape_kept_pairs(lq, q_offset=off, init_tokens=init, window=w) == int(keep.sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite_and_close(dtype):
    q, k, v, kv = _inputs(2, 4, 2, 200, 200, 16, seed=11, pad=[0, 13])
    q = q * 30  # logits far beyond what a float16 product of unscaled q and k holds
    ref = a_shape_attention(q, k, v, init_tokens=6, window=25, scale=0.25, key_valid=kv)[0]
    out = a_shape_attention(q.to(dtype), k.to(dtype), v.to(dtype), init_tokens=6, window=25, scale=0.25, key_valid=kv)[0]
    assert out.dtype == dtype and torch.isfinite(out).all()
    qv = kv[:, None].expand(2, 4, 200)
    rel = (out.float() - ref)[qv].norm() / ref[qv].norm()
    assert rel < (0.03 if dtype == torch.bfloat16 else 0.005), rel


def test_bad_inputs_and_options():
    q, k, v, _ = _inputs(1, 4, 2, 10, 10, 8)
    with pytest.raises(ValueError, match="window"):
        a_shape_attention(q, k, v, init_tokens=1, window=0, scale=0.3)
    with pytest.raises(ValueError, match="multiple"):
        a_shape_attention(q, k[:, :1].expand(1, 3, 10, 8), v[:, :1].expand(1, 3, 10, 8), init_tokens=1, window=2, scale=0.3)
    with pytest.raises(ValueError, match="q_offset"):
        a_shape_attention(q, k, v, init_tokens=1, window=2, scale=0.3, q_offset=1)
    with pytest.raises(ValueError, match="key_valid"):
        a_shape_attention(q, k, v, init_tokens=1, window=2, scale=0.3, key_valid=torch.ones(1, 10))
    with pytest.raises(OptionError, match="window=0"):
        AShapeConfig(window=0)
    with pytest.raises(OptionError, match="init_tokens=-1"):
        AShapeConfig(init_tokens=-1)
    model = tiny_causal_lm("llama")
    with pytest.raises(OptionError, match="window"):
        patch(model, "a_shape", window="wide")
    with pytest.raises(OptionError, match="sink"):
        patch(model, "a_shape", sink=4)


def _a_shape_mask(n, init_tokens, window):
    """The A-shape pattern as the 4-D boolean mask Hugging Face models take ([1, 1, N, N])."""
    i = torch.arange(n)
    keep = (i[None, :] <= i[:, None]) & ((i[None, :] < init_tokens) | (i[:, None] - i[None, :] < window))
    return keep[None, None]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_model_equals_its_own_attention_under_the_a_shape_mask(family):
    """The patched model gives what the unpatched model gives with the A-shape pattern as its attention mask,
    for a plain and a left-padded prompt, and a prompt continued on the cache gives the one-pass logits."""
    model = tiny_causal_lm(family)
    g = torch.Generator().manual_seed(1)
    n, pad = 150, 11
    ids = torch.randint(0, 128, (1, n), generator=g)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(ids, attention_mask=_a_shape_mask(n, 5, 23)).logits
        with patched(model, "a_shape", init_tokens=5, window=23):
            with record_stats(model) as rec:
                got = model(ids).logits
            padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), ids], 1)
            mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, n, dtype=torch.long)], 1)
            got_padded = model(padded, attention_mask=mask).logits[:, pad:]
            first = model(ids[:, :97], use_cache=True)
            rest = model(ids[:, 97:], past_key_values=first.past_key_values, use_cache=True).logits
            gen = model.generate(ids[:, :40], max_new_tokens=3, do_sample=False)
        dense = model(ids).logits
    assert (got - want).abs().max() < 1e-4
    assert (got_padded - want).abs().max() < 1e-3
    assert (rest - want[:, 97:]).abs().max() < 1e-4
    assert (dense - want).abs().max() > 1e-2  # the pattern changes the logits: the check can fail
    modes = {r.mode for fwd in rec.forwards for r in fwd.values()}
    assert modes == {"sparse"}
    layer0 = rec.forwards[0][0]
    keep = reference_keep(1, n, n, 0, None, 5, 23)
    assert float(layer0.kept_pairs[0, 0]) == float(keep.sum())
    assert gen.shape == (1, 43)


def test_tiny_model_exact_limit_through_the_code():
    model = tiny_causal_lm("qwen2")
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
        patch(model, "a_shape", init_tokens=0, window=70)
        try:
            with record_stats(model) as rec:
                out = model(ids).logits
        finally:
            unpatch(model)
    assert {r.mode for fwd in rec.forwards for r in fwd.values()} == {"dense:window>=N"}
    assert (out - ref).norm() / ref.norm() < 1e-6


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4], CASES[7]])
def test_recall_is_the_exact_softmax_mass_on_the_kept_keys(case):
    """``a_shape_recall``: mean over valid queries of the float64 softmax mass on the initial keys and the window."""
    from attnpatch.attention.sparse.a_shape import a_shape_recall

    b, h, hkv, lq, lk, d, off, init, window, _, pad, inner = case
    q, k, v, kv = _inputs(b, h, hkv, lq, lk, d, pad=pad, inner=inner)
    scale = d**-0.5
    got = a_shape_recall(q, k, init_tokens=init, window=window, scale=scale, q_offset=off, key_valid=kv)
    keep = reference_keep(b, lq, lk, off, kv, init, window)
    full = reference_keep(b, lq, lk, off, kv, lk, lk)  # every causal valid key
    g = h // hkv
    s = (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~full[:, None], -math.inf), -1).nan_to_num(0.0)
    per_q = (p * keep[:, None]).sum(-1)  # [B, H, Lq]
    qv = _query_valid(kv, b, lq, off) & full.any(-1)
    want = (per_q * qv[:, None]).sum(-1) / qv.sum(-1)[:, None]
    assert got.shape == (b, h) and (got - want).abs().max() < 1e-5
    if window < lk:
        assert bool((got < 1).any())  # a real cut: the figure is not the 1.0 of a dense layer


def test_recall_is_recorded_by_the_method():
    model, ids = tiny_causal_lm("llama"), torch.randint(3, 100, (1, 80))
    with patched(model, "a_shape", init_tokens=4, window=16), record_stats(model, recall=True) as rec, torch.no_grad():
        model(input_ids=ids)
    recs = rec.forwards[0].values()
    assert all(r.recall is not None and r.recall.shape == (1, r.kept_pairs.shape[1]) for r in recs)
    assert all(0 < float(r.recall.min()) and float(r.recall.max()) <= 1 + 1e-6 for r in recs)
