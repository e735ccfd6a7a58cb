"""AnchorAttention math: fast implementation vs the slow reference, exactness properties, recall."""

import math

import pytest
import torch

from attnpatch.attention.anchor import (
    AnchorConfig,
    anchor_attention,
    anchor_attention_reference,
    dense_causal_attention,
    select_stripes,
)
from attnpatch.errors import OptionError


def _inputs(b, h, hkv, lq, lk, d, seed=0, pad=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, hkv, lk, d, generator=g)
    v = torch.randn(b, hkv, lk, d, generator=g)
    # a few strong directions make logits spread, so thresholds matter
    q[..., 0] *= 3
    k[..., 0] *= 3
    key_valid = None
    if pad is not None:
        key_valid = torch.ones(b, lk, dtype=torch.bool)
        for i, p in enumerate(pad):
            key_valid[i, :p] = False
    return q, k, v, key_valid


def _valid_rows(key_valid, b, lq, lk):
    if key_valid is None:
        return torch.ones(b, lq, dtype=torch.bool)
    return key_valid[:, lk - lq :]


CASES = [
    # (b, h, hkv, lq, lk, d, cfg kwargs, pad, dense_heads)
    (2, 4, 2, 40, 40, 8, dict(theta=0.5), None, ()),
    (2, 4, 2, 40, 40, 8, dict(theta=2.0), None, ()),
    (1, 6, 2, 45, 45, 8, dict(theta=1.0, pool_stride=4, local_window=16), None, ()),
    (2, 4, 4, 40, 40, 8, dict(theta=1.0, pool_stride=1), None, ()),
    (2, 4, 2, 37, 45, 8, dict(theta=1.0, dense_last=5), None, ()),  # prompt continued on a cache
    (2, 4, 2, 40, 40, 8, dict(theta=1.0), [0, 7], ()),  # left padding
    (2, 4, 2, 40, 40, 8, dict(theta=1.0), [3, 7], (1,)),  # padding + a dense head
    (1, 3, 3, 33, 33, 8, dict(theta=1.5, dense_last=3), [5], ()),
    (2, 4, 2, 40, 40, 8, dict(theta=0.5, min_len=20), [0, 25], ()),  # sequence 1 (15 tokens) is below min_len: dense
    # the cases above run the default causal recall guard (a decision per query block); these the global one
    (2, 4, 2, 37, 45, 8, dict(theta=1.0, dense_last=5, min_recall=0.6, guard="global"), None, ()),
    (2, 4, 2, 40, 40, 8, dict(theta=1.0, min_recall=0.6, guard="global"), [3, 7], (1,)),
]


def _need_compiled():
    """Skip where the platform cannot build the compiled kernel; where it can, a failed build fails the test."""
    from attnpatch.attention.backends.cpu_kernel import kernel_supported

    reason = kernel_supported()
    if reason is not None:
        pytest.skip(reason)


def _kernel_calls(monkeypatch) -> list[tuple[str, tuple]]:
    """Record every call of the compiled kernel as ``(function, its last two arguments)``: the tile sizes the callers
    read from ``tiles`` at call time, so a test that patches ``tiles`` sees that its values reached the kernel."""
    import attnpatch.attention.backends.cpu_kernel as ck

    real, calls = ck.stripe_kernel(), []
    assert real is not None, ck.kernel_status()

    class Recording:
        def __getattr__(self, name):
            fn = getattr(real, name)

            def call(*args):
                calls.append((name, args[-2:]))
                return fn(*args)

            return call

    monkeypatch.setitem(ck._state, "module", Recording())  # what stripe_kernel() hands the callers
    return calls


@pytest.mark.parametrize("kernel", ["torch", "compiled"])
@pytest.mark.parametrize("b,h,hkv,lq,lk,d,kw,pad,dense_heads", CASES)
def test_fast_matches_reference(b, h, hkv, lq, lk, d, kw, pad, dense_heads, kernel):
    if kernel == "compiled":
        _need_compiled()
    kw = {"dense_last": 0, "pool_stride": None, **kw}
    kw = {"min_len": 0, "kernel": kernel, **kw}
    cfg = AnchorConfig(block_size=8, init_block=4, local_window=kw.pop("local_window", 8), **kw)
    q, k, v, kv = _inputs(b, h, hkv, lq, lk, d, pad=pad)
    off = lk - lq
    out, st = anchor_attention(
        q, k, v, cfg, scale=d**-0.5, q_offset=off, key_valid=kv, dense_heads=dense_heads,
        return_stats=True, compute_recall=True,
    )
    ref, kept = anchor_attention_reference(q, k, v, cfg, scale=d**-0.5, q_offset=off, key_valid=kv, dense_heads=dense_heads)
    rows = _valid_rows(kv, b, lq, lk)[:, None, :, None]
    assert torch.allclose(out * rows, ref * rows, atol=1e-5, rtol=1e-5)
    # sparsity counts agree with the reference's kept set
    kept_pairs = (kept.sum(-1) * rows[..., 0]).sum(-1).double()
    assert torch.equal(kept_pairs, st.kept_pairs)
    # recall agrees with the exact softmax mass of the reference's kept keys
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(h // hkv, 1)) * d**-0.5
    i = off + torch.arange(lq)
    causal = torch.arange(lk)[None, :] <= i[:, None]
    allowed = causal[None, None] & (kv[:, None, None, :] if kv is not None else True)
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    mass = (p * kept).sum(-1)  # [b, h, lq]
    rec = (mass * rows[..., 0]).sum(-1) / rows[..., 0].sum(-1)
    assert torch.allclose(rec, st.recall, atol=1e-5)
    # causal pairs among valid tokens, and the sparsity they give with the reference's kept count
    causal_pairs = (allowed & rows).sum((-2, -1)).double().expand(b, h)  # [b, h]
    assert torch.equal(st.causal_pairs.double(), causal_pairs)
    assert torch.allclose(st.sparsity.double(), 1 - kept_pairs / causal_pairs, atol=1e-6)


def test_theta_inf_equals_dense():
    q, k, v, kv = _inputs(2, 4, 2, 300, 300, 16, pad=[0, 20])
    cfg = AnchorConfig(theta=math.inf, block_size=32, init_block=16, local_window=32, min_len=0)
    out, st = anchor_attention(q, k, v, cfg, scale=0.25, key_valid=kv, return_stats=True)
    dense = dense_causal_attention(q, k, v, scale=0.25, key_valid=kv)
    assert torch.allclose(out, dense, atol=1e-6)
    assert float(st.sparsity.max()) == 0.0


def test_theta_minus_inf_keeps_initial_block_and_window_only():
    b, h, hkv, n, d = 1, 2, 1, 96, 8
    q, k, v, _ = _inputs(b, h, hkv, n, n, d, seed=3)
    cfg = AnchorConfig(theta=-math.inf, block_size=16, init_block=8, local_window=32, min_len=0, dense_last=0, min_recall=0)
    keep = select_stripes(q, k, cfg, scale=d**-0.5)
    for blk in range(n // 16):
        end = (blk + 1) * 16
        expected = torch.zeros(n, dtype=torch.bool)
        expected[:8] = True
        expected[max(0, end - 32) : end] = True
        assert torch.equal(keep[0, 0, blk], expected)
    # explicit masked reference: per query, initial block + window, causal
    out, _ = anchor_attention(q, k, v, cfg, scale=d**-0.5)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    end = (i // 16 + 1) * 16
    mask = ((j < 8) | (j >= end - 32)) & (j <= i)
    s = (q @ k.transpose(-1, -2)) * d**-0.5
    ref = torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ v
    assert torch.allclose(out, ref, atol=1e-5)


def test_dense_last_and_dense_heads_are_exact():
    q, k, v, _ = _inputs(1, 4, 2, 128, 128, 8, seed=5)
    cfg = AnchorConfig(theta=-math.inf, block_size=16, init_block=4, local_window=16, min_len=0, dense_last=20, min_recall=0)
    out, _ = anchor_attention(q, k, v, cfg, scale=0.3, dense_heads=(2,))
    dense = dense_causal_attention(q, k, v, scale=0.3)
    assert torch.allclose(out[:, :, -20:], dense[:, :, -20:], atol=1e-6)
    assert torch.allclose(out[:, 2], dense[:, 2], atol=1e-6)
    assert not torch.allclose(out[:, 0, :-20], dense[:, 0, :-20], atol=1e-3)


def test_bf16_and_shapes():
    q, k, v, _ = _inputs(1, 4, 2, 100, 100, 16)
    cfg = AnchorConfig(theta=3.0, block_size=16, init_block=8, local_window=16, min_len=0, dense_last=0)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out, _ = anchor_attention(q, k, v, cfg, scale=0.25)
    # same (bf16-rounded) values in fp32: selection is computed in fp32 either way
    ref, _ = anchor_attention(q.float(), k.float(), v.float(), cfg, scale=0.25)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 4, 100, 16)
    assert (out.float() - ref).abs().max() < 0.05


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(theta="big"), "theta='big'"),
        (dict(theta=float("nan")), "theta=nan"),
        (dict(block_size=0), "block_size=0"),
        (dict(block_size=64, local_window=32), "local_window=32 < block_size=64"),
        (dict(pool_stride=0), "pool_stride=0"),
        (dict(pool_stride=48), "pool_stride=48 does not divide block_size=128"),
        (dict(dense_last=-1), "dense_last=-1"),
        (dict(kernel="cuda"), "kernel='cuda': allowed values are 'auto', 'compiled', 'torch'"),
        (dict(select_dtype="float16"), "select_dtype='float16': allowed values are 'float32', 'bfloat16'"),
        (dict(guard="local"), "guard='local': allowed values are 'global', 'causal'"),
    ],
)
def test_config_errors_name_the_value(kw, match):
    with pytest.raises(OptionError, match=match):
        AnchorConfig(**kw)


def test_right_padding_matches_reference_and_sequence_alone():
    q, k, v, _ = _inputs(2, 4, 2, 48, 48, 8, seed=7)
    kv = torch.ones(2, 48, dtype=torch.bool)
    kv[1, 30:] = False  # right padding
    cfg = AnchorConfig(theta=0.5, block_size=8, init_block=4, local_window=8, min_len=0, dense_last=3, pool_stride=4)
    out, st = anchor_attention(q, k, v, cfg, scale=0.3, key_valid=kv, return_stats=True)
    ref, _ = anchor_attention_reference(q, k, v, cfg, scale=0.3, key_valid=kv)
    alone, _ = anchor_attention(q[1:, :, :30], k[1:, :, :30], v[1:, :, :30], cfg, scale=0.3)
    assert torch.allclose(out[:, :, :30], ref[:, :, :30], atol=1e-5)
    assert torch.allclose(out[1, :, :30], alone[0], atol=1e-6)
    assert float(st.causal_pairs[1, 0]) == 30 * 31 / 2


@pytest.mark.parametrize("lq,lk,hkv,dtype", [(40, 40, 2, torch.float32), (37, 45, 2, torch.float32), (64, 64, 4, torch.float64), (50, 50, 1, torch.bfloat16)])
def test_both_attend_paths_agree(lq, lk, hkv, dtype):
    """The CPU two-part path (diagonal + gathered keys merged by log-sum-exp) and the one-call masked path
    (used on other devices and with inner padding) give the same output."""
    from attnpatch.attention.anchor.attend import sparse_attend
    from attnpatch.attention.anchor.select import call_geometry, select_kept

    q, k, v, _ = _inputs(2, 4, hkv, lq, lk, 8, seed=11)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cfg = AnchorConfig(theta=1.0, block_size=8, init_block=4, local_window=8, min_len=0, dense_last=0, pool_stride=None)
    geo = call_geometry(q, k, cfg.block_size, lk - lq, None)
    keep = select_kept(q, k, cfg, 8**-0.5, geo)
    assert 0.1 < keep.float().mean() < 0.9  # a real mix of kept and skipped stripes
    merged = sparse_attend(q, k, v, keep, geo, cfg.block_size, 8**-0.5, merge=True)
    masked = sparse_attend(q, k, v, keep, geo, cfg.block_size, 8**-0.5, merge=False)
    tol = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2}[dtype]
    assert merged.dtype == dtype and merged.shape == (2, 4, lq, 8)
    assert (merged.double() - masked.double()).abs().max() < tol


@pytest.mark.parametrize("pad", [None, [0, 9]])
def test_recall_guard_makes_low_recall_heads_dense_like_the_reference(pad):
    """min_recall: heads whose kept keys carry too little exact mass on the probe blocks attend densely;
    the fast path and the explicit reference agree on which heads and on the outputs."""
    from attnpatch.attention.anchor.guard import probe_recall
    from attnpatch.attention.anchor.select import call_geometry, select_kept

    b, h, hkv, n, d = 2, 6, 2, 64, 8
    q, k, v, kv = _inputs(b, h, hkv, n, n, d, pad=pad, seed=21)
    base = dict(theta=0.7, block_size=8, init_block=4, local_window=8, min_len=0, dense_last=4, pool_stride=None, recall_probes=3,
                guard="global")
    geo = call_geometry(q[:1], k[:1], AnchorConfig(**base).block_size, 0, None)
    rec = probe_recall(q[:1], k[:1], select_kept(q[:1], k[:1], AnchorConfig(**base), d**-0.5, geo), geo, AnchorConfig(**base), d**-0.5, n - 4)[0]
    vals = sorted(float(x) for x in rec)
    gaps = [(vals[i + 1] - vals[i], (vals[i + 1] + vals[i]) / 2) for i in range(len(vals) - 1) if 0 < i < len(vals) - 2 or len(vals) <= 3]
    gap, thr = max(gaps)
    assert gap > 1e-3  # a threshold well away from every head's value
    cfg = AnchorConfig(**base, min_recall=thr)
    out, st = anchor_attention(q, k, v, cfg, scale=d**-0.5, key_valid=kv, return_stats=True, compute_recall=True)
    ref, kept = anchor_attention_reference(q, k, v, cfg, scale=d**-0.5, key_valid=kv)
    rows = _valid_rows(kv, b, n, n)[:, None, :, None]
    assert torch.allclose(out * rows, ref * rows, atol=1e-5)
    assert torch.equal((kept.sum(-1) * rows[..., 0]).sum(-1).double(), st.kept_pairs)
    if pad is None:
        low = rec < thr
        assert 0 < int(low.sum()) < h
        assert torch.equal(st.sparsity[0] == 0, low)  # exactly the low-recall heads became dense
        assert (st.recall[0][low] > 1 - 1e-6).all()
        # the guarded heads run the fused dense kernel: the exact causal result
        dense = dense_causal_attention(q, k, v, scale=d**-0.5)
        assert torch.allclose(out[0, low], dense[0, low], atol=1e-6)


@pytest.mark.parametrize("pad", [None, [0, 6]])
def test_chunking_and_bucketing_do_not_change_the_result(monkeypatch, pad):
    """The stripe selection runs in chunks of query blocks times tiles of keys and the attention in buckets
    of groups; with tiny budgets (one block, 5 keys, one group at a time) the stripes are identical
    and the outputs agree with the reference."""
    from attnpatch.attention.anchor import tiles

    q, k, v, kv = _inputs(2, 6, 2, 72, 72, 8, pad=pad, seed=31)
    cfg = AnchorConfig(
        theta=1.0, block_size=8, init_block=4, local_window=8, min_len=0, dense_last=5, pool_stride=2, kernel="torch"
    )
    products, matmul = [], torch.matmul

    def counting(*a, **kw):  # the selection's score products, one per (chunk of blocks, key tile)
        products.append(1)
        return matmul(*a, **kw)

    monkeypatch.setattr(torch, "matmul", counting)
    keep = select_stripes(q, k, cfg, scale=8**-0.5, key_valid=kv)
    whole = len(products)
    out = anchor_attention(q, k, v, cfg, scale=8**-0.5, key_valid=kv)[0]
    monkeypatch.setattr(tiles, "SELECT_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(tiles, "SELECT_ROWS", 1)
    monkeypatch.setattr(tiles, "SELECT_MIN_TILE", 5)  # key tiles of 5 keys: tiles end inside blocks
    monkeypatch.setattr(tiles, "CHUNK_ELEMENTS", 2)
    products.clear()
    keep_small = select_stripes(q, k, cfg, scale=8**-0.5, key_valid=kv)
    # 9 blocks of 8 queries, one per chunk, each against its causal keys in tiles of 5: sum of ceil(8 j / 5), j = 1..9
    assert (whole, len(products)) == (1, sum(-(-8 * j // 5) for j in range(1, 10)))
    out_small = anchor_attention(q, k, v, cfg, scale=8**-0.5, key_valid=kv)[0]
    ref, _ = anchor_attention_reference(q, k, v, cfg, scale=8**-0.5, key_valid=kv)
    rows = _valid_rows(kv, 2, 72, 72)[:, None, :, None]
    assert torch.equal(keep, keep_small)
    assert 0.1 < keep.float().mean() < 0.9
    assert torch.allclose(out * rows, out_small * rows, atol=1e-6)
    assert torch.allclose(out_small * rows, ref * rows, atol=1e-5)


@pytest.mark.parametrize(
    "b,h,hkv,lq,lk,d,bq,kv_tile,q_tile,theta",
    [
        (2, 4, 2, 40, 40, 8, 8, 3, 256, 1.0),  # tiles of 3 keys: many tiles, the last one partial, diagonal too
        (1, 6, 2, 45, 53, 8, 8, 512, 256, 0.5),  # a prompt continued on a cache; last block partial
        (1, 14, 2, 700, 700, 64, 128, 100, 256, 2.0),  # Qwen2.5-0.5B head geometry, vector-width rows
        (2, 3, 3, 33, 33, 16, 16, 7, 256, -math.inf),  # only the initial block and the window
        (1, 4, 2, 70, 90, 40, 32, 6, 5, 1.0),  # blocks of 32 queries taken 5 rows at a time, head dim 40
        (1, 2, 1, 300, 300, 24, 4096, 64, 48, 1.0),  # one block longer than the prompt, rows and keys tiled
    ],
)
def test_compiled_kernel_matches_torch_path(monkeypatch, b, h, hkv, lq, lk, d, bq, kv_tile, q_tile, theta):
    """The compiled kernel (gather fused into an online-softmax loop, diagonal block last, long blocks taken a
    few query rows at a time) gives the PyTorch path's output for the same stripes, whatever the tiles."""
    from attnpatch.attention.anchor import attend, select, tiles

    _need_compiled()
    monkeypatch.setattr(tiles, "KV_TILE", kv_tile)
    monkeypatch.setattr(tiles, "Q_TILE", q_tile)
    calls = _kernel_calls(monkeypatch)
    q, k, v, _ = _inputs(b, h, hkv, lq, lk, d, seed=5)
    k = k.transpose(2, 3).contiguous().transpose(2, 3)  # non-contiguous keys, as models hand them over
    kw = dict(theta=theta, block_size=bq, init_block=4, local_window=bq, min_len=0, dense_last=0, pool_stride=None)
    geo = select.call_geometry(q, k, bq, lk - lq, None)
    keep = select.select_kept(q, k, AnchorConfig(**kw), d**-0.5, geo)
    compiled = attend.sparse_attend(q, k, v, keep, geo, bq, d**-0.5, use="compiled")
    torch_path = attend.sparse_attend(q, k, v, keep, geo, bq, d**-0.5, use="torch")
    assert compiled.shape == (b, h, lq, d) and compiled.dtype == torch.float32
    assert (compiled - torch_path).abs().max() < 1e-5
    assert [t for name, t in calls if name == "stripe_attention"] == [(kv_tile, q_tile)]  # the patched tiles ran


@pytest.mark.parametrize(
    "b,h,hkv,lq,lk,d,bq,stride,rows,tile,pad",
    [
        (2, 4, 2, 40, 40, 8, 8, 2, 8, 3, None),  # tiles of 3 keys, one pooled query row group per item
        (1, 6, 2, 45, 53, 8, 8, None, 5, 7, None),  # a prompt continued on a cache; last block partial
        (2, 4, 2, 40, 40, 8, 8, 4, 256, 256, [3, 17]),  # left padding: pools of padding keep nothing
        (1, 14, 2, 700, 700, 64, 128, 2, 256, 256, None),  # Qwen2.5-0.5B head geometry at the defaults
    ],
)
def test_compiled_selection_matches_torch_selection(monkeypatch, b, h, hkv, lq, lk, d, bq, stride, rows, tile, pad):
    """The compiled stripe selection (one parallel region over chunks of blocks x key tiles) keeps exactly
    the stripes the PyTorch path keeps, whatever the chunk and tile sizes."""
    from attnpatch.attention.anchor import tiles

    _need_compiled()
    monkeypatch.setattr(tiles, "SELECT_KERNEL_ROWS", rows)
    monkeypatch.setattr(tiles, "SELECT_KERNEL_TILE", tile)
    calls = _kernel_calls(monkeypatch)
    q, k, _, kv = _inputs(b, h, hkv, lq, lk, d, pad=pad, seed=9)
    k = k.transpose(2, 3).contiguous().transpose(2, 3)  # non-contiguous keys, as models hand them over
    kw = dict(theta=1.0, block_size=bq, init_block=4, local_window=bq, min_len=0, dense_last=0, pool_stride=stride)
    compiled = select_stripes(q, k, AnchorConfig(**kw, kernel="compiled"), scale=d**-0.5, q_offset=lk - lq, key_valid=kv)
    torch_path = select_stripes(q, k, AnchorConfig(**kw, kernel="torch"), scale=d**-0.5, q_offset=lk - lq, key_valid=kv)
    assert 0.05 < torch_path.float().mean() < 0.95  # the threshold matters
    assert torch.equal(compiled, torch_path)
    assert calls == [("stripe_select", (rows, tile))]  # the patched chunk and tile sizes ran


def test_compiled_kernel_refuses_what_it_does_not_take():
    """kernel='compiled' names the dtype it cannot take; 'auto' runs such inputs through PyTorch operations."""
    _need_compiled()
    q, k, v, _ = _inputs(1, 4, 2, 40, 40, 8)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    kw = dict(theta=1.0, block_size=8, init_block=4, local_window=8, min_len=0, dense_last=0)
    with pytest.raises(OptionError, match=r"kernel='compiled' takes float32 tensors, not torch.bfloat16; "
                                          r"allowed here: 'auto', ('triton', )?'torch'$"):
        anchor_attention(q, k, v, AnchorConfig(**kw, kernel="compiled"), scale=8**-0.5)
    auto = anchor_attention(q, k, v, AnchorConfig(**kw), scale=8**-0.5)[0]
    torch_path = anchor_attention(q, k, v, AnchorConfig(**kw, kernel="torch"), scale=8**-0.5)[0]
    assert torch.equal(auto, torch_path)


def test_bfloat16_selection_flips_only_stripes_near_the_threshold():
    """select_dtype='bfloat16' rounds the pooled queries and keys of the stripe-scoring product: the kept
    stripes change only where the float32 score is within rounding of the threshold."""
    q, k, v, _ = _inputs(1, 8, 2, 1024, 1024, 64, seed=3)
    kw = dict(theta=2.0, block_size=32, init_block=8, local_window=32, min_len=0, pool_stride=8)
    keep32 = select_stripes(q, k, AnchorConfig(**kw), scale=64**-0.5)
    keep16 = select_stripes(q, k, AnchorConfig(**kw, select_dtype="bfloat16"), scale=64**-0.5)
    flips = keep32 ^ keep16
    assert 0.2 < keep32.float().mean() < 0.8
    assert flips.float().mean() < 0.01
    # the flipped stripes sit within 0.05 logit of the threshold: kept at theta 2.05, skipped at theta 1.95
    wide = select_stripes(q, k, AnchorConfig(**{**kw, "theta": 2.05}), scale=64**-0.5)
    narrow = select_stripes(q, k, AnchorConfig(**{**kw, "theta": 1.95}), scale=64**-0.5)
    assert int(flips.sum()) > 0 and not bool((flips & ~(wide & ~narrow)).any())


def test_kernel_auto_falls_back_when_the_build_fails(monkeypatch, tmp_path):
    """A failed build warns once with the reason; kernel='auto' then runs the PyTorch path and
    kernel='compiled' raises with the same reason."""
    import attnpatch.attention.backends.cpu_kernel as ck

    monkeypatch.setattr(ck, "_state", {})
    monkeypatch.setattr(ck, "kernel_supported", lambda: None)
    monkeypatch.setattr(ck, "_SOURCE", tmp_path / "missing.cpp")
    q, k, v, _ = _inputs(1, 4, 2, 40, 40, 8)
    kw = dict(theta=1.0, block_size=8, init_block=4, local_window=8, min_len=0, dense_last=0)
    with pytest.warns(RuntimeWarning, match="run their PyTorch paths: building missing.cpp failed"):
        auto = anchor_attention(q, k, v, AnchorConfig(**kw), scale=8**-0.5)[0]
    assert torch.equal(auto, anchor_attention(q, k, v, AnchorConfig(**kw, kernel="torch"), scale=8**-0.5)[0])
    with pytest.raises(RuntimeError, match="kernel='compiled' cannot run here: compiled CPU kernel: unavailable "
                                           "\\(building missing.cpp failed"):
        anchor_attention(q, k, v, AnchorConfig(**kw, kernel="compiled"), scale=8**-0.5)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q_offset=-5), r"q_offset=-5: the 40 queries sit at positions"),
        (dict(q_offset=3), r"q_offset=3: .* within the 40 keys \(0 <= q_offset <= 0\)"),
        (dict(v_keys=50), r"v \(1, 2, 50, 8\) must have the shape of k \(1, 2, 40, 8\)"),
        (dict(key_valid=torch.ones(1, 30, dtype=torch.bool)), r"key_valid torch.bool \(1, 30\): must be bool \[batch, keys\] = \[1, 40\]"),
        (dict(scale=0.0), r"scale=0.0: the logit scale must be a positive finite number"),
        (dict(scale=-0.3), r"scale=-0.3"),
    ],
)
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_bad_inputs_name_the_value_on_every_path(change, match, kernel):
    """The same ValueError whichever kernel would run, for the fast function, the selection and the reference."""
    q, k, v, _ = _inputs(1, 4, 2, 40, 40, 8)
    if "v_keys" in change:
        v = torch.randn(1, 2, change["v_keys"], 8)
    cfg = AnchorConfig(theta=1.0, block_size=8, init_block=4, local_window=8, min_len=0, dense_last=0, kernel=kernel)
    kw = dict(scale=change.get("scale", 8**-0.5), q_offset=change.get("q_offset", 0), key_valid=change.get("key_valid"))
    with pytest.raises(ValueError, match=match):
        anchor_attention(q, k, v, cfg, **kw)
    with pytest.raises(ValueError, match=match):
        anchor_attention_reference(q, k, v, cfg, **kw)
    if "v_keys" not in change:
        with pytest.raises(ValueError, match=match):
            select_stripes(q, k, cfg, **kw)


@pytest.mark.parametrize(
    "b,h,hkv,lq,lk,d,bq,kv_tile,q_tile,probes",
    [
        (2, 4, 2, 64, 64, 8, 8, 5, 3, 3),  # key and row tiles that end inside blocks
        (1, 6, 2, 45, 53, 40, 8, 512, 256, 4),  # a prompt continued on a cache; last block partial
        (1, 14, 2, 700, 700, 64, 128, 512, 256, 4),  # Qwen2.5-0.5B head geometry
    ],
)
def test_compiled_probe_matches_torch_probe(monkeypatch, b, h, hkv, lq, lk, d, bq, kv_tile, q_tile, probes):
    """The recall guard's probe (exact softmax mass on the kept keys of a few query blocks) in the compiled
    kernel, one pass of running sums over the causal keys, equals the PyTorch softmax per block."""
    from attnpatch.attention.anchor import guard, select, tiles

    _need_compiled()
    monkeypatch.setattr(tiles, "KV_TILE", kv_tile)
    monkeypatch.setattr(tiles, "Q_TILE", q_tile)
    calls = _kernel_calls(monkeypatch)
    q, k, _, _ = _inputs(b, h, hkv, lq, lk, d, seed=9)
    kw = dict(theta=1.0, block_size=bq, init_block=4, local_window=bq, min_len=0, dense_last=3, pool_stride=None,
              recall_probes=probes)
    geo = select.call_geometry(q, k, bq, lk - lq, None)
    keep = select.select_kept(q, k, AnchorConfig(**kw), d**-0.5, geo)
    rec_c = guard.probe_recall(q, k, keep, geo, AnchorConfig(**kw), d**-0.5, lq - 3, use="compiled")
    rec_t = guard.probe_recall(q, k, keep, geo, AnchorConfig(**kw), d**-0.5, lq - 3, use="torch")
    assert 0.3 < float(rec_t.mean()) < 0.99  # kept stripes carry part of the mass, not all
    assert (rec_c - rec_t).abs().max() < 1e-5
    assert [t for name, t in calls if name == "kept_mass"] == [(kv_tile, q_tile)]  # the patched tiles ran
