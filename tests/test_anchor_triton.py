"""AnchorAttention's Triton path (``kernel="triton"``; ``"auto"`` on CUDA): the bitmask selection equals the PyTorch
path's kept set, the attention over it equals the float64 reference and the PyTorch path, the guard and statistics
agree, and the dispatch rule.

Without a CUDA device the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py before attnpatch is imported); the tests marked ``cuda`` skip.  Sizes are small (the interpreter runs
each kernel operation in NumPy, one program after another): about 16-32 programs per launch.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnpatch.attention.anchor import AnchorConfig, anchor_attention, anchor_attention_reference, select_stripes
from attnpatch.attention.anchor import triton_select as ts
from attnpatch.attention.backends import dispatch, triton_support
from attnpatch.attention.anchor.guard import causal_guard
from attnpatch.attention.anchor.select import call_geometry, select_kept
from attnpatch.attention.anchor.triton_attend import attend_bits, bits_popcount, block_masses
from attnpatch.errors import OptionError

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
pytestmark = pytest.mark.skipif(not (ts.TRITON_AVAILABLE and (CUDA or ts.interpreted())),
                                reason="needs Triton (on CUDA, or TRITON_INTERPRET=1)")

SMALL = dict(block_size=16, init_block=16, local_window=16, min_len=0, dense_last=0, min_recall=0.0, pool_stride=4)


def _qkv(b, h, hkv, n, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, x, n, d, generator=g) for x in (h, hkv, hkv))
    q[..., 0] *= 3  # a few strong directions: logits spread, thresholds matter
    k[..., 0] *= 3
    return q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype)


def _pad(b, lk, holes):
    """``[B, Lk]`` bool, False on the keys of ``holes`` (one ``(start, stop)`` per sequence, or ``None``)."""
    kv = torch.ones(b, lk, dtype=torch.bool)
    for i, hole in enumerate(holes):
        if hole is not None:
            kv[i, hole[0] : hole[1]] = False
    return kv.to(DEV)


def _masked_float64(q, k, v, allowed, scale):
    """``softmax(q k^T * scale)`` over ``allowed`` ``[B, H, Lq, Lk]`` in float64 on the CPU (zeros for empty rows)."""
    h, hkv = q.shape[1], k.shape[1]
    qd, kd, vd = (x.double().cpu() for x in (q, k, v))
    kd, vd = kd.repeat_interleave(h // hkv, 1), vd.repeat_interleave(h // hkv, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", qd, kd) * scale
    p = torch.softmax(s.masked_fill(~allowed.cpu(), -math.inf), -1).nan_to_num(0.0)
    return p @ vd


def _rows_allowed(keep, geo, lq, bq):
    """``[B, H, Lq, Lk]``: each query's kept keys (its block's row of ``keep``) at or before its position, valid."""
    rows = keep.cpu().repeat_interleave(bq, 2)[:, :, :lq]
    i = geo.q_offset + torch.arange(lq)
    causal = torch.arange(geo.lk)[None, :] <= i[:, None]
    return rows & causal[None, None] & geo.key_valid.cpu()[:, None, None, :]


# ------------------------------------------------------------------------------------------------ selection


SELECT_CASES = [
    # (b, h, hkv, lq, lk, d, options, holes)
    (1, 2, 1, 128, 128, 16, dict(theta=1.0), None),
    (1, 2, 2, 128, 128, 32, dict(theta=1.5, pool_stride=1, block_size=32, local_window=32), None),
    (1, 2, 1, 128, 128, 16, dict(theta=2.0, pool_stride=None, init_block=8), None),  # the paper's pooling
    (1, 2, 1, 72, 150, 16, dict(theta=1.0, local_window=24), None),  # continued on a cache, a ragged last block
    (2, 2, 1, 64, 64, 16, dict(theta=1.0), [(20, 30), None]),  # a hole inside the keys
    (1, 2, 1, 64, 64, 16, dict(theta=-math.inf), None),
    (1, 2, 1, 64, 64, 16, dict(theta=math.inf), None),
]


@pytest.mark.parametrize("b,h,hkv,lq,lk,d,kw,holes", SELECT_CASES)
def test_bitmask_equals_the_torch_kept_set(b, h, hkv, lq, lk, d, kw, holes):
    q, k, _ = _qkv(b, h, hkv, lk, d, seed=lq + d)
    q = q[:, :, lk - lq :]
    cfg = AnchorConfig(**{**SMALL, **kw})
    kv = None if holes is None else _pad(b, lk, holes)
    geo = call_geometry(q, k, cfg.block_size, lk - lq, kv)
    bits = ts.select_bits(q, k, cfg, d**-0.5, geo)
    assert bits.dtype == torch.int32 and bits.shape == (b, h, geo.nb, -(-lk // 32))
    keep = select_kept(q, k, AnchorConfig(**{**SMALL, **kw, "kernel": "torch"}), d**-0.5, geo)
    assert torch.equal(ts.unpack_bits(bits, lk), keep)
    if math.isfinite(cfg.theta) and cfg.theta > 0:
        assert 0.05 < float(keep.float().mean()) < 0.9  # a real mix of kept and skipped stripes
    assert torch.equal(bits_popcount(bits), keep.sum(-1))
    # the public entry point takes the same path
    triton_cfg = AnchorConfig(**{**SMALL, **kw, "kernel": "triton"})
    assert torch.equal(select_stripes(q, k, triton_cfg, scale=d**-0.5, q_offset=lk - lq, key_valid=kv), keep)


def test_bfloat16_selection_matches_the_torch_bfloat16_selection():
    q, k, _ = _qkv(1, 4, 2, 128, 16, seed=3)
    kw = {**SMALL, "theta": 1.0, "select_dtype": "bfloat16"}
    geo = call_geometry(q, k, AnchorConfig(**kw).block_size, 0, None)
    got = ts.unpack_bits(ts.select_bits(q, k, AnchorConfig(**kw, kernel="triton"), 0.25, geo), 128)
    want = select_kept(q, k, AnchorConfig(**kw, kernel="torch"), 0.25, geo)
    # the score is rounded to bfloat16 before the comparison, as on the PyTorch path: a stripe flips only where
    # a float32 summation order moves a score across a bfloat16 rounding boundary at the threshold
    assert float((got != want).float().mean()) < 2e-3


# ------------------------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("q_offset,hkv,holes", [(0, 2, None), (37, 1, None), (0, 2, [(20, 27)])])
def test_theta_inf_kernel_is_causal_attention(q_offset, hkv, holes):
    """theta = inf keeps every causal key: the selection kernel's bitmask and the attention kernel over it give
    float64 causal attention (SDPA's semantics: GQA, an offset, padding keys)."""
    n, d = 64, 16
    q, k, v = _qkv(1, 4, hkv, n + q_offset, d, seed=5)
    q = q[:, :, q_offset:]
    kv = None if holes is None else _pad(1, n + q_offset, holes)
    cfg = AnchorConfig(**{**SMALL, "theta": math.inf, "kernel": "triton"})
    geo = call_geometry(q, k, cfg.block_size, q_offset, kv)
    bits = ts.select_bits(q, k, cfg, 0.25, geo)
    out = attend_bits(q, k, v, bits, geo, cfg, 0.25)
    i = q_offset + torch.arange(n)
    allowed = (torch.arange(n + q_offset)[None, :] <= i[:, None])[None, None] & geo.key_valid.cpu()[:, None, None, :]
    want = _masked_float64(q, k, v, allowed.expand(1, 4, n, n + q_offset), 0.25)
    assert float((out.double().cpu() - want).abs().max()) < 1e-5
    if holes is None:  # and SDPA itself, through the public call (which runs dense for theta = inf)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=allowed[0, 0].to(DEV), scale=0.25, enable_gqa=True)
        assert float((out.double() - sdpa).abs().max()) < 1e-5
        full, _ = anchor_attention(q, k, v, cfg, scale=0.25, q_offset=q_offset)
        assert float((full.double() - sdpa).abs().max()) < 1e-5


CASES = [
    # (b, h, hkv, lq, lk, options, holes, dense_heads): every case against the float64 reference
    (1, 4, 2, 80, 80, dict(theta=1.0), None, ()),
    (1, 2, 1, 60, 100, dict(theta=1.0, dense_last=21), None, ()),  # chunked prefill on a cache, dense tail
    (2, 2, 1, 64, 64, dict(theta=1.0, dense_last=5), [(0, 9), None], (1,)),  # left padding (per sequence), a dense head
    (2, 2, 1, 64, 64, dict(theta=1.5), [(20, 31), (50, 55)], ()),  # holes inside the keys
    (1, 4, 2, 80, 80, dict(theta=1.0, min_recall=0.6), None, ()),  # the causal guard
    (1, 4, 2, 64, 80, dict(theta=1.0, min_recall=0.73, guard="global", recall_probes=3), None, ()),
]


@pytest.mark.parametrize("b,h,hkv,lq,lk,kw,holes,dense_heads", CASES)
def test_matches_the_float64_reference_and_the_torch_path(b, h, hkv, lq, lk, kw, holes, dense_heads):
    d = 16
    q, k, v = _qkv(b, h, hkv, lk, d, seed=lq + lk + h)
    q = q[:, :, lk - lq :]
    kv = None if holes is None else _pad(b, lk, holes)
    scale = d**-0.5
    call = dict(scale=scale, q_offset=lk - lq, key_valid=kv, dense_heads=dense_heads)
    out, st = anchor_attention(q, k, v, AnchorConfig(**{**SMALL, **kw, "kernel": "triton"}), **call,
                               return_stats=True, compute_recall=True)
    ref, kept = anchor_attention_reference(q.cpu(), k.cpu(), v.cpu(), AnchorConfig(**{**SMALL, **kw}), **{
        **call, "key_valid": None if kv is None else kv.cpu()})
    rows = torch.ones(b, lq, dtype=torch.bool) if kv is None else kv.cpu()[:, lk - lq :]
    rows = rows[:, None, :, None]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert float(((out.cpu() - ref) * rows).abs().max()) < 1e-5
    assert torch.equal((kept.sum(-1) * rows[..., 0]).sum(-1).double(), st.kept_pairs.cpu())
    torch_out, torch_st = anchor_attention(q, k, v, AnchorConfig(**{**SMALL, **kw, "kernel": "torch"}), **call,
                                           return_stats=True, compute_recall=True)
    assert float(((out - torch_out).cpu() * rows).abs().max()) < 1e-5
    assert torch.equal(st.causal_pairs, torch_st.causal_pairs) and torch.equal(st.kept_pairs, torch_st.kept_pairs)
    assert torch.equal(st.kept_columns, torch_st.kept_columns)
    assert float((st.recall - torch_st.recall).abs().max()) < 1e-5
    if kw.get("min_recall"):  # the guard turned some blocks (or heads) dense, not all
        off = AnchorConfig(**{**SMALL, **kw, "min_recall": 0.0, "kernel": "torch"})
        _, unguarded = anchor_attention(q, k, v, off, **call, return_stats=True)
        assert bool((st.kept_pairs > unguarded.kept_pairs).any()) and float(st.sparsity.max()) > 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_within_a_rounding_of_float64(dtype):
    """fp16/bf16 inputs, float32 accumulation: against float64 attention of the same (rounded) inputs over the same
    kept set, within about one ulp of the output's dtype (2^-10 fp16, 2^-7 bf16, relative to the values' scale)."""
    n, d = 128, 32
    q, k, v = _qkv(1, 4, 2, n, d, seed=9, dtype=dtype)
    cfg = AnchorConfig(**{**SMALL, "theta": 1.0, "block_size": 32, "local_window": 32, "dense_last": 20,
                          "kernel": "triton"})
    geo = call_geometry(q, k, cfg.block_size, 0, None)
    bits = ts.select_bits(q, k, cfg, d**-0.5, geo)
    keep = ts.unpack_bits(bits, n)
    assert torch.equal(keep, select_kept(q.float(), k.float(), AnchorConfig(**{**SMALL, "theta": 1.0, "block_size": 32,
                                                                               "local_window": 32}), d**-0.5, geo))
    out, _ = anchor_attention(q, k, v, cfg, scale=d**-0.5)
    assert out.dtype == dtype
    allowed = _rows_allowed(keep, geo, n, 32)
    allowed[:, :, n - 20 :] = (torch.arange(n)[None, :] <= torch.arange(n - 20, n)[:, None])  # dense_last rows
    want = _masked_float64(q, k, v, allowed, d**-0.5)
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    err = (out.double().cpu() - want).abs()
    assert float(err.max()) <= ulp * max(1.0, float(want.abs().max())), float(err.max())
    assert float(err.mean()) <= ulp / 4


def test_probe_masses_are_the_exact_kept_mass():
    q, k, _ = _qkv(1, 2, 1, 96, 16, seed=4)
    cfg = AnchorConfig(**{**SMALL, "theta": 1.0})
    geo = call_geometry(q, k, cfg.block_size, 0, None)
    bits = ts.select_bits(q, k, cfg, 0.25, geo)
    mass, count = block_masses(q, k, bits, geo, cfg, 0.25, [1, 4])
    keep = ts.unpack_bits(bits, 96).cpu()
    allowed = _rows_allowed(torch.ones_like(keep), geo, 96, 16)
    s = torch.einsum("bhqd,bhkd->bhqk", q.double().cpu(), k.double().cpu().expand(1, 2, 96, 16)) * 0.25
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1)
    kept = _rows_allowed(keep, geo, 96, 16)
    want = (p * kept).sum(-1).view(1, 2, 6, 16)[:, :, [1, 4]]
    assert float((mass.double().cpu() - want).abs().max()) < 1e-5
    assert torch.equal(count.cpu().long(), kept.sum(-1).view(1, 2, 6, 16)[:, :, [1, 4]])


# ------------------------------------------------------------------------------------------------ the guard's causality


@pytest.mark.parametrize("what,pos", [("k", 70), ("q", 44)])
def test_causal_guard_outputs_before_the_changed_block_do_not_move(what, pos):
    """guard='causal' on the Triton path: changing a query, key or value at ``pos`` leaves the outputs of every query
    before ``pos``'s block bit for bit unchanged (each block is computed on its own), while some blocks are dense."""
    n, d = 80, 8
    q, k, v = _qkv(1, 2, 1, n, d, seed=21)
    cfg = AnchorConfig(theta=0.8, block_size=16, init_block=8, local_window=16, min_len=0, pool_stride=None,
                       dense_last=0, min_recall=0.4, guard="causal", kernel="triton")
    geo = call_geometry(q, k, cfg.block_size, 0, None)
    torch_cfg = AnchorConfig(**{**cfg.__dict__, "kernel": "torch"})
    low = causal_guard(q, k, select_kept(q, k, torch_cfg, d**-0.5, geo), geo, torch_cfg, d**-0.5)
    assert low is not None and 0.2 < float(low.float().mean()) < 0.8
    x = {"q": q, "k": k, "v": v}
    changed = dict(x)
    changed[what] = x[what].clone()
    changed[what][:, :, pos] += 3 * torch.randn(x[what].shape[1], d, generator=torch.Generator().manual_seed(1)).to(DEV)
    out = anchor_attention(q, k, v, cfg, scale=d**-0.5)[0]
    out2 = anchor_attention(changed["q"], changed["k"], changed["v"], cfg, scale=d**-0.5)[0]
    start = pos // 16 * 16
    assert torch.equal(out[:, :, :start], out2[:, :, :start])
    assert float((out - out2).abs().max()) > 1e-3


# ------------------------------------------------------------------------------------------------ dispatch


def test_dispatch_and_errors(monkeypatch):
    q, k, v = _qkv(1, 2, 1, 64, 16)
    with pytest.raises(OptionError, match="kernel='cuda': allowed values are 'auto', 'compiled', 'torch', 'triton'"):
        AnchorConfig(kernel="cuda")
    cfg = AnchorConfig(**{**SMALL, "theta": 1.0, "kernel": "triton"})
    with pytest.raises(OptionError, match="kernel='triton' takes float32, float16 or bfloat16"):
        anchor_attention(q.double(), k.double(), v.double(), cfg, scale=0.25)
    if not CUDA:
        # "auto" keeps CPU tensors on the compiled kernel or PyTorch operations, as before the Triton path
        monkeypatch.setattr(ts, "select_bits", lambda *a, **kw: pytest.fail("Triton path taken"))
        anchor_attention(q, k, v, AnchorConfig(**{**SMALL, "theta": 1.0}), scale=0.25)
        assert dispatch.choose("anchor_attend", "auto", dispatch.Call.of(q)) != "triton"
        monkeypatch.setattr(triton_support, "_INTERPRETED", False)  # a CPU tensor outside the interpreter
        with pytest.raises(OptionError, match="kernel='triton' runs on CUDA tensors.*allowed here: 'auto'"):
            anchor_attention(q, k, v, cfg, scale=0.25)
    monkeypatch.setattr(triton_support, "TRITON_AVAILABLE", False)
    with pytest.raises(OptionError, match="kernel='triton' needs Triton"):
        anchor_attention(q, k, v, cfg, scale=0.25)
    # "auto" without Triton: the other paths
    assert dispatch.choose("anchor_attend", "auto", dispatch.Call.of(q.to(DEV))) != "triton"


@needs_cuda
def test_auto_on_cuda_takes_the_triton_path(monkeypatch):
    q, k, v = _qkv(1, 4, 2, 256, 64, dtype=torch.bfloat16)
    assert dispatch.choose("anchor_attend", "auto", dispatch.Call.of(q)) == "triton"
    calls = []
    real = ts.select_bits
    monkeypatch.setattr(ts, "select_bits", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg = dict(theta=4.0, block_size=64, init_block=64, local_window=64, min_len=0, dense_last=32)
    out, _ = anchor_attention(q, k, v, AnchorConfig(**cfg), scale=0.125)
    ref, _ = anchor_attention(q.float(), k.float(), v.float(), AnchorConfig(**cfg, kernel="torch"), scale=0.125)
    assert calls and float((out.float() - ref).abs().max()) < 3e-2


# ------------------------------------------------------------------------------------------------ against float64


def _margins_float64(q, k, cfg, scale):
    """``(margin, size)`` ``[B, H, nb, Lk]`` float64 (no padding, queries from position 0): each key's largest
    ``q_bar . k_j * scale - (a_bar - theta)`` over the block's pools (AnchorAttention Eq. 2-4), and the size of the
    terms it is made of, ``1 + |a_bar| + |q_bar| |k_j| scale`` (the scale of its rounding error)."""
    b, h, n, d = q.shape
    g = h // k.shape[1]
    qd, kd = q.double().cpu(), k.double().cpu().repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    bq, st = cfg.block_size, cfg.stride
    nb = -(-n // bq)
    i = torch.arange(n)
    margin = torch.full((b, h, nb, n), -math.inf, dtype=torch.float64)
    size = torch.zeros(b, h, nb, n, dtype=torch.float64)
    for blk in range(nb):
        r0, r1 = blk * bq, min(n, (blk + 1) * bq)
        cand = (i < cfg.init_block) | ((i >= r1 - cfg.local_window) & (i < r1))
        anchor = s[:, :, r0:r1].masked_fill(~(cand[None, :] & (i[None, :] <= i[r0:r1, None])), -math.inf).amax(-1)
        for p0 in range(r0, r1, st):
            p1 = min(r1, p0 + st)
            qbar, abar = qd[:, :, p0:p1].mean(2), anchor[..., p0 - r0 : p1 - r0].mean(-1)
            m = torch.einsum("bhd,bhjd->bhj", qbar, kd) * scale - (abar[..., None] - cfg.theta)
            sz = 1 + abar.abs()[..., None] + qbar.norm(dim=-1)[..., None] * kd.norm(dim=-1) * scale
            better = m > margin[:, :, blk]
            margin[:, :, blk] = torch.where(better, m, margin[:, :, blk])
            size[:, :, blk] = torch.where(better, sz, size[:, :, blk])
    return margin, size


#: The documented tolerance of the Triton selection (docs/methods.md, "The Triton kernels' precision"): a stripe whose
#: float64 margin is farther than this times the size of its terms from the threshold is kept as float64 keeps it.
SELECT_TOL = {"float32": 1e-3, "bfloat16": 1e-2}


@pytest.mark.parametrize("dtype,d,select_dtype", [(torch.float32, 16, "float32"), (torch.float32, 128, "float32"),
                                                  (torch.bfloat16, 64, "float32"), (torch.float32, 64, "bfloat16")])
def test_kept_stripes_equal_float64_beyond_the_documented_tolerance(dtype, d, select_dtype):
    """The bitmask against the float64 rule: every stripe whose margin lies beyond the documented tolerance is kept
    exactly when float64 keeps it (float32 inputs multiply in three products of split parts: ``tf32x3`` up to head dim
    64, ``bf16x3`` above, which the interpreter computes as on the GPU; half inputs in exact products)."""
    q, k, _ = _qkv(1, 4, 2, 256, d, seed=d, dtype=dtype)
    cfg = AnchorConfig(**{**SMALL, "theta": 2.0, "select_dtype": select_dtype, "kernel": "triton"})
    geo = call_geometry(q, k, cfg.block_size, 0, None)
    got = ts.unpack_bits(ts.select_bits(q, k, cfg, d**-0.5, geo), 256).cpu()
    margin, size = _margins_float64(q, k, cfg, d**-0.5)
    j = torch.arange(256)
    end = torch.tensor([min(256, (n + 1) * cfg.block_size) for n in range(geo.nb)])
    always = (j[None, :] < cfg.init_block) | ((j[None, :] >= end[:, None] - cfg.local_window) & (j[None, :] < end[:, None]))
    want = ((margin >= 0) | always[None, None]) & (j[None, :] < end[:, None])[None, None]
    clear = (margin - 0).abs() > SELECT_TOL[select_dtype] * size
    assert float(clear.float().mean()) > 0.9 and 0.1 < float(want[clear].float().mean()) < 0.9
    assert torch.equal(got[clear], want[clear])


def test_float32_at_head_dim_128_attends_within_its_precision():
    """Float32 tiles of 128 columns multiply in three bfloat16 products (``bf16x3``, about 2^-16 per product): the
    attention over every causal key (theta = 1e30 through the public call) against float64 causal SDPA."""
    from attnpatch.attention.anchor.triton_dots import qk_precision

    assert qk_precision(torch.float32, 128) == "bf16x3" and qk_precision(torch.float32, 64) == "tf32x3"
    assert qk_precision(torch.bfloat16, 128) == "native"
    q, k, v = _qkv(1, 2, 1, 128, 128, seed=7)
    cfg = AnchorConfig(**{**SMALL, "theta": 1e30, "kernel": "triton", "dense_last": 16})
    out, st = anchor_attention(q, k, v, cfg, scale=128**-0.5, return_stats=True)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                            scale=128**-0.5, enable_gqa=True)
    assert float(st.kept_pairs.sum()) == float(st.causal_pairs.sum())  # every key kept: the kernels ran exact attention
    err = float((out.double() - want).norm() / want.norm())
    print(f"bf16x3 relative error {err:.2e}")
    assert err < 1e-4


# ------------------------------------------------------------------------------------------------ at patch time


def test_a_kernel_the_models_device_cannot_run_is_refused_at_patch_time(monkeypatch):
    """kernel='triton' on a CPU model outside the Triton interpreter, and kernel='compiled' on a model that is not
    float32, are refused by patch() (naming the model, its dtype and device, and the kernels allowed), not by the
    first forward."""
    from attnpatch import is_patched, patch
    from tiny_models import tiny_causal_lm

    model = tiny_causal_lm()
    monkeypatch.setattr(triton_support, "_INTERPRETED", False)  # a CPU tensor outside the interpreter
    with pytest.raises(OptionError, match=r"LlamaForCausalLM \(torch.float32 on cpu\): kernel='triton' runs on CUDA "
                                          r"tensors.*allowed here: 'auto', 'compiled', 'torch'"):
        patch(model, "anchor_attention", kernel="triton")
    assert not is_patched(model)
    with pytest.raises(OptionError, match=r"LlamaForCausalLM \(torch.bfloat16 on cpu\): kernel='compiled' takes float32 "
                                          r"tensors, not torch.bfloat16; allowed here: 'auto', 'torch'$"):
        patch(model.to(torch.bfloat16), "anchor_attention", kernel="compiled")
    with pytest.raises(OptionError, match=r"\(torch.bfloat16 on cpu\): kernel='triton' runs on CUDA tensors.*allowed here: "
                                          r"'auto', 'torch'$"):  # not 'compiled', which takes float32 only
        patch(model, "anchor_attention", kernel="triton")
    assert not is_patched(model)
    monkeypatch.setattr(triton_support, "_INTERPRETED", True)
    patch(model.float(), "anchor_attention", kernel="triton")  # under the interpreter the CPU runs the kernels
    assert is_patched(model)


def test_patch_builds_the_compiled_kernel_before_any_forward(monkeypatch):
    """The compiled CPU kernel (AnchorAttention's stripes, FNA's farthest-point sampling) is built, or loaded from the
    build cache, by patch(): no timed forward pays its build."""
    import attnpatch.attention.backends.cpu_kernel as ck
    from attnpatch import patch, unpatch
    from tiny_models import tiny_causal_lm, tiny_dinov2

    if ck.kernel_supported() is not None:
        pytest.skip(ck.kernel_supported())
    for model, method in ((tiny_causal_lm(), "anchor_attention"), (tiny_dinov2(), "fna")):
        monkeypatch.setattr(ck, "_state", {})
        patch(model, method)
        assert ck._state.get("module") is not None, method
        unpatch(model)
