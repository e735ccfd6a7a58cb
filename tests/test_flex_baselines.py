"""The block-sparse baselines on FlexAttention (:mod:`attnpatch.attention.backends.flex`, :mod:`.flex_patterns`):
``a_shape``, ``vertical_slash`` and ``block_topk`` with ``kernel="flex"`` against their gather paths (same kept
set: equal to float32 rounding) and against SDPA at their exact limits; grouped-query keys, padding inside the
keys, prompts continued on a cache, queries and keys padded to length buckets; nine lengths that share one
compiled bucket (no new compilation, no fallback); ``block_topk``'s ``min_len`` on a chunked prefill of a tiny
Llama.

``flex_attention`` compiles through Inductor on the CPU (tens of seconds per shape): every flex call here uses
``B=2, H=4, Hkv=2, D=16`` float32 and one of four compiled graphs (the arithmetic A-shape mask and the
column/diagonal lookups shared by all heads at buckets (128, 128); per-head columns and diagonals and blocks of
32 at (128, 256)).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from attnpatch import OptionError, patch, patched, record_stats, unpatch
from attnpatch.attention.backends import flex
from attnpatch.attention.sparse.block_topk import block_topk_attention
from attnpatch.attention.backends import dispatch
from attnpatch.attention.backends.flex import FLEX_STATS, bucket_length, flex_attend
from attnpatch.attention.sparse.column_diagonal import column_diagonal_counts
from attnpatch.attention.sparse.a_shape import a_shape_attention
from attnpatch.attention.sparse.vertical_slash import vertical_slash_attention
from attnpatch.attention.sparse.column_diagonal import column_diagonal_attention

from conftest import tiny_causal_lm

B, H, HKV, D = 2, 4, 2, 16
SCALE = 0.3
TOL = dict(rtol=2e-5, atol=2e-5)


def _qkv(lq, lk, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, lq, D, generator=g) * 1.5
    k = torch.randn(B, HKV, lk, D, generator=g) * 1.5
    v = torch.randn(B, HKV, lk, D, generator=g)
    return q, k, v


def _causal_sdpa(q, k, v, q_offset=0, key_valid=None):
    """Exact causal attention with a query offset (and key padding), float64."""
    lq, lk = q.shape[2], q_offset + q.shape[2]
    i = q_offset + torch.arange(lq)
    mask = (torch.arange(lk)[None, :] <= i[:, None])[None, None]
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :lk]
    return F.scaled_dot_product_attention(q.double(), k[:, :, :lk].double(), v[:, :, :lk].double(), attn_mask=mask,
                                          scale=SCALE, enable_gqa=True)


@pytest.fixture(autouse=True)
def _no_fallback():
    """Every flex call of a test runs the compiled kernel (no fallback to the gather path)."""
    before = FLEX_STATS["fallbacks"]
    yield
    assert FLEX_STATS["fallbacks"] == before


# --------------------------------------------------------------------------- the kept set and the exact limits


def test_bucket_lengths():
    assert [bucket_length(n) for n in (1, 128, 129, 256, 257, 385, 513, 769, 1025, 1537, 2049)] == \
        [128, 128, 256, 256, 384, 512, 768, 1024, 1536, 2048, 3072]


def test_a_shape_flex_equals_gather_and_is_sdpa_at_the_limit():
    lq = 113  # padded to 128 query rows and 128 keys
    q, k, v = _qkv(lq, lq)
    kv = torch.ones(B, lq, dtype=torch.bool)
    kv[1, 30:41] = False  # padding inside the keys: the initial tokens are counted over valid keys
    for key_valid in (None, kv):
        for init, window in ((4, 20), (0, 1), (9, 64)):
            kw = dict(init_tokens=init, window=window, scale=SCALE, key_valid=key_valid, return_counts=True)
            got, kept = a_shape_attention(q, k, v, kernel="flex", **kw)
            want, kept_want = a_shape_attention(q, k, v, kernel="gather", **kw)
            torch.testing.assert_close(got, want, **TOL)
            assert torch.equal(kept, kept_want)
        # a window covering every key: exact causal attention
        got = a_shape_attention(q, k, v, init_tokens=0, window=lq, scale=SCALE, key_valid=key_valid, kernel="flex")[0]
        want = _causal_sdpa(q, k, v, key_valid=key_valid)
        rows = 1.0 if key_valid is None else key_valid[:, None, :, None].double()
        torch.testing.assert_close(got.double() * rows, want * rows, **TOL)
    # the pattern matters: a small window differs from exact attention
    small = a_shape_attention(q, k, v, init_tokens=2, window=8, scale=SCALE, kernel="flex")[0]
    assert (small.double() - _causal_sdpa(q, k, v)).abs().max() > 1e-2


def test_vertical_slash_flex_equals_gather_on_a_cache_and_is_sdpa_at_the_limit():
    q_offset, lq = 60, 100  # 60 cached keys: 68 empty slots before them, queries at shifted 128..227, keys bucket 256
    q, k, v = _qkv(lq, q_offset + lq + 7, seed=1)  # keys after the last query are ignored
    for chunk in (None, 50):
        kw = dict(vertical=12, slash=20, last_q=16, chunk=chunk, scale=SCALE, q_offset=q_offset, return_counts=True)
        got, kept = vertical_slash_attention(q, k, v, kernel="flex", **kw)
        want, kept_want = vertical_slash_attention(q, k, v, kernel="gather", **kw)
        torch.testing.assert_close(got, want, **TOL)
        assert torch.equal(kept, kept_want)
    got = vertical_slash_attention(q, k, v, vertical=q_offset + lq, slash=4, last_q=16, scale=SCALE, q_offset=q_offset,
                                   kernel="flex")[0]
    torch.testing.assert_close(got.double(), _causal_sdpa(q, k, v, q_offset=q_offset), **TOL)


def test_block_topk_flex_equals_gather_with_padding_and_is_sdpa_at_the_limit():
    q_offset, lq, bs = 40, 100, 32  # blocks of 32 inside tiles of 128; 24 empty slots before the keys
    q, k, v = _qkv(lq, q_offset + lq, seed=2)
    kv = torch.ones(B, q_offset + lq, dtype=torch.bool)
    kv[0, 10:25] = False  # padding inside the keys, cached and new
    kv[0, 90:95] = False
    for key_valid in (None, kv):
        kw = dict(scale=SCALE, block_size=bs, stride=8, q_offset=q_offset, key_valid=key_valid)
        got = block_topk_attention(q, k, v, threshold=0.5, kernel="flex", **kw)[0]
        want, st = block_topk_attention(q, k, v, threshold=0.5, kernel="torch", return_stats=True, **kw)
        assert float(st.kept_pairs.sum() / st.causal_pairs.sum()) < 0.9  # some blocks skipped
        torch.testing.assert_close(got, want, **TOL)
        exact = block_topk_attention(q, k, v, threshold=1.0, kernel="flex", **kw)[0]
        want = _causal_sdpa(q, k, v, q_offset=q_offset, key_valid=key_valid)
        rows = 1.0 if key_valid is None else key_valid[:, None, q_offset:, None].double()
        torch.testing.assert_close(exact.double() * rows, want * rows, **TOL)


def test_counts_without_attending():
    g = torch.Generator().manual_seed(3)
    cols, diags = torch.rand(B, H, 90, generator=g) < 0.2, torch.rand(B, H, 90, generator=g) < 0.2
    kv = torch.rand(B, 90, generator=g) > 0.1
    q, k, v = _qkv(50, 90)
    want = column_diagonal_attention(q, k, v, cols, diags, scale=SCALE, q_offset=40, key_valid=kv,
                                     return_counts=True)[1]
    assert torch.equal(column_diagonal_counts(cols, diags, heads=H, lq=50, q_offset=40, key_valid=kv), want)


# --------------------------------------------------------------------------- length buckets


def test_nine_lengths_share_one_compiled_bucket_without_fallback():
    """Nine lengths of one bucket compile nothing after the bucket's first call and never leave the compiled kernel
    (with padding to exact lengths instead of buckets, the first of them compiles a new graph and this fails)."""
    from torch._dynamo.utils import counters

    q, k, v = _qkv(128, 128, seed=4)

    def run(n, kernel):
        return a_shape_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], init_tokens=3, window=17, scale=SCALE,
                                 kernel=kernel)[0]

    run(128, "flex")  # the bucket's graph: compiled here or by an earlier test
    graphs, calls = counters["stats"]["unique_graphs"], FLEX_STATS["calls"]
    lengths = (2, 31, 64, 77, 90, 101, 115, 120, 127)
    for n in lengths:
        out = run(n, "flex")
        assert counters["stats"]["unique_graphs"] == graphs, f"length {n} compiled a new graph"
        torch.testing.assert_close(out, run(n, "gather"), **TOL)
    assert FLEX_STATS["calls"] == calls + len(lengths)


def choose_kernel(kernel, q, keys, cpu_min_keys, monkeypatch):
    """The choice for ``a_shape`` with ``cpu_min_keys`` as the CPU's FlexAttention minimum."""
    monkeypatch.setitem(dispatch.CPU_FLEX_MIN_KEYS, "a_shape", cpu_min_keys)
    return dispatch.choose("a_shape", kernel, dispatch.Call.of(q, keys=keys))


def test_the_compile_limit_or_a_compile_failure_falls_back_to_the_gather_path_not_eager(monkeypatch):
    from torch._dynamo.exc import FailOnRecompileLimitHit

    def limit():
        raise FailOnRecompileLimitHit("limit")

    def broken():
        raise flex.FlexCompileError("no compiler") from OSError("no compiler")

    def bug():
        raise IndexError("a bug in the tables")

    before = FLEX_STATS["fallbacks"]
    q = torch.zeros(1, 1, 4, 8)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert flex_attend(limit, lambda: torch.ones(1), kernel="auto").item() == 1.0
            # the limit leaves "auto" on flex for known shapes
            assert choose_kernel("auto", q, 10, 1, monkeypatch) == "flex"
            assert flex_attend(broken, lambda: torch.ones(1), kernel="auto").item() == 1.0
            # a compile failure: the gather path from now on
            assert choose_kernel("auto", q, 10, 1, monkeypatch) == "gather"
            assert flex.flex_broken() is not None
        assert FLEX_STATS["fallbacks"] == before + 2
        with pytest.raises(RuntimeError, match="limit"):
            flex_attend(limit, lambda: torch.ones(1), kernel="flex")
        with pytest.raises(RuntimeError, match="no compiler"):
            flex_attend(broken, lambda: torch.ones(1), kernel="flex")
        with pytest.raises(IndexError):  # not a compile failure: not hidden behind the gather path
            flex_attend(bug, lambda: torch.ones(1), kernel="auto")
    finally:
        FLEX_STATS["fallbacks"] = before  # counted on purpose here
        flex.forget_failures()
    assert flex.flex_broken() is None


def test_kernel_choice(monkeypatch):
    q = torch.zeros(1, 1, 4, 8)
    assert choose_kernel("auto", q, 10**6, None, monkeypatch) == "gather"  # CPU, no threshold
    assert choose_kernel("auto", q, 4096, 4096, monkeypatch) == "flex"
    assert choose_kernel("auto", q, 4095, 4096, monkeypatch) == "gather"
    assert choose_kernel("auto", q.double(), 10**6, 1, monkeypatch) == "gather"  # float64: not a flex dtype
    with pytest.raises(OptionError, match="kernel='flex' flex_attention's compiled kernel takes .* not torch.float64; "
                                          "allowed here: 'auto', 'gather'"):
        choose_kernel("flex", q.double(), 4, None, monkeypatch)
    with pytest.raises(ValueError, match="kernel='nope'"):
        a_shape_attention(q, q, q, init_tokens=1, window=2, scale=1.0, kernel="nope")
    model = tiny_causal_lm("llama")
    for method in ("a_shape", "vertical_slash", "block_topk"):
        with pytest.raises(OptionError, match="kernel"):
            patch(model, method, kernel="triton")
        patch(model, method, kernel="gather")
        unpatch(model)


# --------------------------------------------------------------------------- chunked prefill


def test_block_topk_chunked_prefill_decides_by_the_absolute_length():
    """A 384-token prompt in 128-token pieces on a cache runs sparse from the piece that reaches ``min_len``, as the
    same prompt in one call does (before, each piece compared its own 128 tokens with ``min_len`` and ran dense)."""
    model = tiny_causal_lm("llama", layers=2)
    ids = torch.randint(0, 128, (1, 384), generator=torch.Generator().manual_seed(5))
    opts = dict(block_size=16, stride=4, threshold=0.5, min_len=256)
    with torch.no_grad(), warnings.catch_warnings(), patched(model, "block_topk", **opts), record_stats(model) as rec:
        warnings.simplefilter("ignore")
        model(ids[:, :256], use_cache=False)  # one call of 256 tokens: sparse
        model(ids[:, :255], use_cache=False)  # one call of 255 tokens: dense
        past = None
        for c0 in range(0, 384, 128):
            past = model(ids[:, c0 : c0 + 128], past_key_values=past, use_cache=True).past_key_values
    modes = [{r.mode for r in fwd.values()} for fwd in rec.forwards]
    assert modes[:2] == [{"sparse"}, {"dense:short"}]
    assert modes[2:] == [{"dense:short"}, {"sparse"}, {"sparse"}]  # prompt so far: 128, 256, 384 tokens
