"""FNA's GPU path: FPS as one Triton kernel, the pseudo-inverse from batched products, and no host sync in the layer.

Without a CUDA device the Triton kernel runs on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py before attnpatch is imported); the tests marked ``cuda`` skip.  Sizes are small: the interpreter runs
each kernel operation in NumPy.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

import attnpatch.attention.nystrom as ny
from attnpatch.attention.backends import dispatch
from attnpatch.attention.landmarks import fps_triton as lt
from attnpatch.attention.nystrom.layer import fna_layer, fna_layer_case
from attnpatch.attention.landmarks import farthest_point_sampling, farthest_point_sampling_reference
from attnpatch.attention.nystrom.local import nystrom_local_attention
from attnpatch.attention.nystrom.pinv_matmul import filter_steps, gram_norm_bound, landmark_pinv_matmul
from attnpatch.attention.nystrom.pinv_triton import landmark_pinv_triton
from attnpatch.errors import OptionError

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_triton_here = pytest.mark.skipif(
    not (lt.TRITON_AVAILABLE and (CUDA or lt.interpreted())), reason="needs Triton (on CUDA, or TRITON_INTERPRET=1)")
DEV = "cuda" if CUDA else "cpu"


def _products_on_cpu(monkeypatch):
    """The pseudo-inverse's dispatch as CUDA has it, for CPU tensors too: ``"auto"`` picks the product form
    (``"products"``) on the CPU (the eigendecomposition stays the CPU's default outside the test)."""
    table = dict(dispatch.TABLE)
    table["pinv"] = [dataclasses.replace(k, auto_on=("cuda", "cpu")) if k.name == "products" else k
                     for k in table["pinv"]]
    monkeypatch.setattr(dispatch, "TABLE", table)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --------------------------------------------------------------------------- FPS kernel


@needs_triton_here
@pytest.mark.parametrize("b,n,d,s,prefix", [(2, 17, 16, 5, 1), (3, 100, 64, 16, 0), (2, 200, 16, 24, 5),
                                            (4, 50, 64, 1, 1), (2, 40, 16, 5, 5)])
def test_fps_kernel_matches_float64_reference(b, n, d, s, prefix):
    x = _randn(b, n, d, seed=n + s)
    ref = farthest_point_sampling_reference(x, s, prefix)
    got = farthest_point_sampling(x.to(DEV), s, prefix, kernel="triton")
    assert got.dtype == torch.long and got.shape == (b, s)
    assert torch.equal(got.cpu(), ref)
    # several programs per item (16- or 64-token tiles dealt round-robin), combined by atomic max; one launch per step
    # (the interpreter runs programs one after another: no grid barrier there)
    assert torch.equal(lt._fps_launch(x.to(DEV), s, prefix, 3, True, block_n=16 if n < 64 else 64)[0].cpu(), ref)


@needs_triton_here
def test_fps_kernel_half_inputs_strides_and_ties():
    x = _randn(2, 90, 32, seed=7)
    for dtype in (torch.bfloat16, torch.float16):
        xh = x.to(dtype)  # the kernel computes in float32: the upcast values, exactly
        assert torch.equal(lt.farthest_point_sampling_triton(xh.to(DEV), 12, 1).cpu(),
                           farthest_point_sampling_reference(xh.float(), 12, 1))
    xt = _randn(2, 32, 90, seed=8).transpose(1, 2)  # [B, N, D] with stride 1 along N
    got = lt.farthest_point_sampling_triton(xt.to(DEV), 10, 1).cpu()
    assert torch.equal(got, farthest_point_sampling_reference(xt, 10, 1))
    # duplicates: all distances 0 after two picks; the untaken tokens are still taken, lowest index first (as the loop)
    dup = torch.zeros(1, 10, 16)
    dup[0, 5] = 1.0
    got = lt.farthest_point_sampling_triton(dup.to(DEV), 6, 1).cpu()
    assert got.tolist() == [[0, 5, 1, 2, 3, 4]]
    assert torch.equal(got, farthest_point_sampling(dup, 6, 1, kernel="torch"))


@needs_triton_here
def test_fps_dispatch_and_errors(monkeypatch):
    x = _randn(2, 30, 8, seed=1)
    with pytest.raises(OptionError, match="s=31"):
        lt.farthest_point_sampling_triton(x.to(DEV), 31, 1)
    with pytest.raises(OptionError, match="kernel='cuda'"):
        farthest_point_sampling(x, 5, 1, kernel="cuda")
    with pytest.raises(OptionError, match="programs=0"):
        lt.farthest_point_sampling_triton(x.to(DEV), 5, 1, programs=0)
    if lt.interpreted():
        with pytest.raises(OptionError, match="stepwise=True"):
            lt.farthest_point_sampling_triton(x, 5, 1, programs=2)
    # "auto" keeps CPU tensors off the Triton kernel (even under the interpreter); kernel="torch" keeps CUDA ones off
    monkeypatch.setattr(lt, "farthest_point_sampling_triton", lambda *a, **k: pytest.fail("Triton path taken"))
    assert torch.equal(farthest_point_sampling(x, 5, 1), farthest_point_sampling_reference(x, 5, 1))
    if CUDA:
        assert torch.equal(farthest_point_sampling(x.cuda(), 5, 1, kernel="torch").cpu(),
                           farthest_point_sampling_reference(x, 5, 1))


# --------------------------------------------------------------------------- pseudo-inverse from products


def _kernels(s, scale, same, seed):
    """Softmax landmark kernels ``[4, s, s]`` (float64) of random queries/keys: ``same`` queries and keys with a large
    scale give a near-identity (well-conditioned) kernel, a small scale a nearly rank-one one (ill-conditioned)."""
    q = _randn(4, s, 64, seed=seed, dtype=torch.float64)
    k = q if same else _randn(4, s, 64, seed=seed + 1, dtype=torch.float64)
    return torch.softmax(scale * q @ k.transpose(-1, -2), dim=-1)


@pytest.mark.parametrize("s", [16, 64])
@pytest.mark.parametrize("case", ["well", "ill"])
def test_matmul_pinv_against_float64_pinv(s, case):
    rtol = 1e-2
    a = _kernels(s, 0.1, True, s) if case == "well" else _kernels(s, 0.03, False, s)
    u, sv, vh = torch.linalg.svd(a)
    tau = rtol * sv[..., :1]
    ratio = sv[..., -1] / sv[..., 0]
    # well: every singular value above 4 tau (measured 0.35-0.8 sigma_max); ill: some below tau (down to 4e-5 sigma_max)
    assert (ratio > 4 * rtol).all() if case == "well" else (ratio < rtol).all(), ratio
    z = landmark_pinv_matmul(a.float(), rtol)
    assert z.dtype == torch.float32 and z.shape == a.shape
    z = z.double()
    trunc = torch.linalg.pinv(a, rtol=rtol)  # float64 reference: the CPU path's truncated pseudo-inverse
    # 1. the filter it is meant to compute, in float64, with the same sigma_max bound
    bound = gram_norm_bound((a @ a.transpose(-1, -2)).float()).double()
    lam = sv[..., :1] ** 2
    assert (bound[..., 0] >= lam * (1 - 1e-5)).all() and (bound[..., 0] <= lam * s ** (2.0**-8) * (1 + 1e-5)).all()
    k = filter_steps(rtol)
    alpha = math.log(2.0) / (rtol * rtol * 2.0**k) / bound[..., 0]
    phi = 1 - (1 - alpha * sv**2) ** (2**k)
    filt = vh.transpose(-1, -2) @ torch.diag_embed(phi / sv) @ u.transpose(-1, -2)
    rel = lambda e, r: ((e.norm(dim=(-2, -1)) / r.norm(dim=(-2, -1))).max().item())  # noqa: E731
    assert rel(z - filt, filt) < 1e-3  # float32 rounding (measured: 1e-7 well, 3e-4 ill)
    # 2. the truncated pseudo-inverse on the singular directions above 3 tau (the smooth cut-off differs near tau)
    big = u * (sv > 3 * tau)[..., None, :]
    assert rel((z - trunc) @ big, trunc @ big) < 3e-3
    if case == "well":
        assert rel(z - trunc, trunc) < 1e-4  # every singular value far above tau: the plain pseudo-inverse
    # 3. bounded like the truncated pseudo-inverse: ||Z||_2 < 1 / tau
    assert (torch.linalg.matrix_norm(z, 2) * tau[..., 0] < 1.0).all()


def test_matmul_pinv_dispatch_cuda_only_and_cpu_default_unchanged():
    a = _kernels(16, 0.03, False, 3).float()
    # the CPU default is the eigendecomposition, bit for bit as before
    x = a.float()
    lam, vec = torch.linalg.eigh(x.transpose(-1, -2) @ x)
    inv = torch.where(lam > (1e-2 * 1e-2) * lam[..., -1:], 1.0 / lam.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    expect = (vec * inv[..., None, :]) @ (vec.transpose(-1, -2) @ x.transpose(-1, -2))
    cpu = dispatch.Call(torch.device("cpu"), torch.float32, side=16, work_dtype=torch.float32)
    assert dispatch.choose("pinv", "auto", cpu) == "eigh"
    assert dispatch.choose("pinv", "auto", dataclasses.replace(cpu, device=torch.device("cuda"))) in ("triton", "products")
    assert torch.equal(ny.landmark_pinv_work(a, "rtol", 1e-2, 6), expect)
    assert torch.equal(ny.landmark_pinv_work(a, "rtol", 1e-2, 6, kernel="eigh"), expect)
    assert torch.equal(ny.landmark_pinv_work(a, "rtol", 1e-2, 6, kernel="products"), landmark_pinv_matmul(a, 1e-2))
    assert ny.landmark_pinv(a.bfloat16(), "rtol").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="rtol=1.5"):
        landmark_pinv_matmul(a, 1.5)
    assert filter_steps(1e-2) == 13 and ny.landmark_pinv_work(a.double(), "rtol", 1e-3, 6).dtype == torch.float64


@needs_triton_here
def test_pinv_kernel_matches_the_batched_products():
    """The one-launch kernel computes the same filter as the PyTorch products (padded sides 16, 64; odd ``s``)."""
    for s, scale, same in ((16, 0.1, True), (40, 0.03, False), (64, 0.03, False), (64, 0.1, True)):
        a = _kernels(s, scale, same, s + 1).float()
        ref = landmark_pinv_matmul(a, 1e-2)
        got = landmark_pinv_triton(a.to(DEV)).cpu()
        assert got.dtype == torch.float32 and got.shape == a.shape
        # rounding only: measured 2e-6 to 4e-5 interpreted (float32); three-pass TF32 at s > 32 on a GPU
        assert ((got - ref).norm() / ref.norm()).item() < 3e-3
    half = ny.landmark_pinv_work(a.bfloat16().to(DEV), "rtol", 1e-2, 6, kernel="triton").cpu()
    ref = landmark_pinv_matmul(a.bfloat16(), 1e-2)
    assert half.dtype == torch.float32 and ((half - ref).norm() / ref.norm()).item() < 3e-3
    with pytest.raises(ValueError, match="s <= 64"):
        landmark_pinv_triton(torch.eye(65).to(DEV))
    with pytest.raises(ValueError, match="rtol=0.001"):
        landmark_pinv_triton(a.to(DEV), 1e-3)
    with pytest.raises(ValueError, match="kernel='cuda': allowed values are 'auto', 'triton', 'products', 'eigh'"):
        ny.landmark_pinv(a, kernel="cuda")
    with pytest.raises(ValueError, match="kernel='triton' takes s <= 64 landmarks .* not s=65; allowed here: 'auto'"):
        ny.landmark_pinv(torch.eye(65)[None].to(DEV), kernel="triton")
    with pytest.raises(ValueError, match="kernel='products': allowed values are 'auto', 'newton'$"):
        ny.landmark_pinv(a, "newton", kernel="products")


def test_nystrom_with_matmul_pinv_keeps_the_exact_limit(monkeypatch):
    """Every token a landmark and all singular values far above tau: Nyström with the product pseudo-inverse is exact
    attention (up to float32 rounding), as with the eigendecomposition."""
    _products_on_cpu(monkeypatch)
    q = _randn(1, 2, 24, 16, seed=4) * 2.0
    k, v = q.clone(), _randn(1, 2, 24, 16, seed=5)  # same queries and keys, sharp: a well-conditioned kernel
    idx = torch.arange(24)[None]
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v
    torch.testing.assert_close(ny.nystrom_attention(q, k, v, idx, scale=0.25), ref, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- no host sync on the CUDA path


class _HostReads(TorchFunctionMode):
    """Records tensor-to-host reads (``item``, ``tolist``, ``bool``/``int``/``float``, ``nonzero``, ``cpu``, ``numpy``)
    issued from attnpatch's own code (the Triton interpreter's reads of its arguments do not count: on a GPU there
    are none); ``.to(device)`` counts when it crosses devices."""

    BAD = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
           torch.Tensor.__index__, torch.nonzero, torch.Tensor.nonzero, torch.Tensor.cpu, torch.Tensor.numpy,
           torch.argwhere, torch.masked_select, torch.Tensor.masked_select, torch.unique}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.BAD or func is torch.Tensor.to:
            frame = sys._getframe(1)
            while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back
            here = frame is not None and f"{os.sep}attnpatch{os.sep}" in frame.f_code.co_filename
            targets = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (torch.device, str))]
            moves = func is torch.Tensor.to and any(torch.device(a) != args[0].device for a in targets)
            if here and (func is not torch.Tensor.to or moves):
                self.reads.append(f"{getattr(func, '__name__', func)} at {frame.f_code.co_filename}:{frame.f_lineno}")
        return func(*args, **kwargs)


@needs_triton_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fna_layer_reads_nothing_back_on_the_cuda_path(monkeypatch, dtype):
    """FPS kernel, product pseudo-inverse, fused attention calls, and the local-window hybrid: no host read (after one
    warm-up call, as CUDA-graph capture does it), and the layer agrees with the PyTorch-loop landmarks."""
    _products_on_cpu(monkeypatch)
    q, k, v = (_randn(1, 2, 65, 16, seed=i, dtype=dtype).to(DEV) for i in range(3))
    lm = farthest_point_sampling(k.transpose(1, 2).reshape(1, 65, 32), 12, 1, kernel="torch")
    for _ in range(2):
        with _HostReads() as mode:
            out = fna_layer(q, k, v, 12, fps_kernel="triton")
            loc = nystrom_local_attention(q, k, v, lm, scale=0.25, prefix=1, radius=1, tile=2)
            ny.landmark_pinv_work(torch.eye(12, device=DEV).expand(2, 12, 12), "rtol", 1e-2, 6, kernel="triton")
    assert mode.reads == []
    assert out.dtype == dtype and loc.dtype == dtype
    torch.testing.assert_close(out, ny.nystrom_attention(q, k, v, lm, scale=0.25), rtol=0, atol=0)


def test_nystrom_attention_traces_as_one_graph_on_the_matmul_pinv(monkeypatch):
    """``torch.compile(fullgraph=True)`` (Dynamo, eager backend) of Nyström attention with the CUDA path's
    pseudo-inverse: no graph break, so no data-dependent Python control flow and no host read."""
    import attnpatch.attention.backends.blas as bt

    _products_on_cpu(monkeypatch)
    monkeypatch.setattr(bt, "_MKL_LOCAL", False)  # the CPU's MKL thread call (a ctypes call) is not on the CUDA path
    torch._dynamo.reset()
    q, k, v = (_randn(1, 2, 40, 16, seed=i) for i in range(3))
    lm = torch.arange(0, 40, 4)[None]
    fn = torch.compile(lambda q, k, v, lm: ny.nystrom_attention(q, k, v, lm, scale=0.25), fullgraph=True,
                       backend="eager")
    torch.testing.assert_close(fn(q, k, v, lm), ny.nystrom_attention(q, k, v, lm, scale=0.25), rtol=0, atol=0)
    torch._dynamo.reset()


# --------------------------------------------------------------------------- CUDA only


@needs_cuda
@pytest.mark.parametrize("n,d", [(1025, 384), (4097, 64)])
def test_fps_kernel_on_cuda_one_launch_equals_stepwise_and_reference(n, d):
    x = _randn(2, n, d, seed=n, dtype=torch.bfloat16).cuda()
    idx, status = lt._fps_launch(x, 64, 1, None, False)
    assert status.item() == 0  # no grid-barrier give-up
    for programs, stepwise in ((1, False), (3, True), (lt.fps_programs(x), True)):
        assert torch.equal(lt._fps_launch(x, 64, 1, programs, stepwise)[0], idx)
    small = x[:, :300, :64].float()
    got = lt.farthest_point_sampling_triton(small, 32, 1).cpu()
    assert torch.equal(got, farthest_point_sampling_reference(small.cpu(), 32, 1))
    assert len(set(idx[0].tolist())) == 64


@needs_cuda
@pytest.mark.parametrize("s", [16, 64])
def test_pinv_kernel_on_cuda_against_float64(s):
    a = _kernels(s, 0.03, False, s)
    trunc = torch.linalg.pinv(a, rtol=1e-2)
    u, sv, _ = torch.linalg.svd(a)
    big = u * (sv > 3e-2 * sv[..., :1])[..., None, :]
    cpu = landmark_pinv_matmul(a.float(), 1e-2).double()
    for kernel, tol in (("triton", 3e-3), ("products", 1e-3)):  # s = 64 runs three-pass TF32 products (pinv_triton)
        z = ny.landmark_pinv_work(a.float().cuda(), "rtol", 1e-2, 6, kernel=kernel).double().cpu()
        assert ((z - cpu).norm() / cpu.norm()).item() < tol
        assert ((((z - trunc) @ big).norm() / (trunc @ big).norm())).item() < 3e-3


@needs_cuda
@pytest.mark.parametrize("window", [False, True])
def test_fna_layer_cuda_graph_and_no_sync(window, monkeypatch):
    """The layer on CUDA (bf16): no host sync (``set_sync_debug_mode("error")``), captured and replayed in a CUDA
    graph with the eager result, and the same numbers as the CPU float32 path on the same landmarks."""
    case = fna_layer_case(1025, 64, torch.bfloat16, "cuda")
    q, k, v = case["q"], case["k"], case["v"]
    b, h, n, d = k.shape

    def landmarks():
        return farthest_point_sampling(k.transpose(1, 2).reshape(b, n, h * d), 64, 1)

    def layer(q, k, v, lm):
        if window:
            return nystrom_local_attention(q, k, v, lm, scale=d**-0.5, prefix=1, radius=2)
        return ny.nystrom_attention(q, k, v, lm, scale=d**-0.5)

    fn = (lambda: layer(q, k, v, landmarks())) if window else case["fna"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: Triton compiles, the window layout is copied once
            ref = fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    # the same math on the CPU in float32 (product pseudo-inverse there too): bf16 rounding apart (measured on the CPU,
    # bf16 against float32: 5e-3 plain, 2e-3 window)
    _products_on_cpu(monkeypatch)
    cpu = layer(q.cpu().float(), k.cpu().float(), v.cpu().float(), landmarks().cpu())
    assert ((out.cpu().float() - cpu).norm() / cpu.norm()).item() < 2e-2


@needs_triton_here
def test_the_fna_method_reads_nothing_back_with_a_numeric_sample_layer(monkeypatch):
    """In a patched model, the fna method's own code (landmark bookkeeping, the layer) issues no host read once
    ``sample_layer`` is a number: which images are approximated is known on the host.  ``"auto"`` reads back the
    massive-token test, which the test sees (so it can fail)."""
    import attnpatch
    from tiny_models import tiny_dinov2

    _products_on_cpu(monkeypatch)  # the CUDA path's pseudo-inverse
    model = tiny_dinov2().to(DEV)
    x = _randn(2, 3, 70, 70, seed=1).to(DEV)

    def reads(**opts):
        with torch.no_grad(), attnpatch.patched(model, "fna", s=8, min_tokens=0, **opts):
            model(pixel_values=x)  # warm (Triton compile on CUDA)
            with _HostReads() as mode:
                model(pixel_values=x)
        return [r for r in mode.reads if f"methods{os.sep}fna{os.sep}" in r or f"attention{os.sep}" in r]

    assert reads(sample_layer=0) == []
    assert reads(sample_layer=2) == []
    assert any(f"methods{os.sep}fna{os.sep}" in r for r in reads(sample_layer="auto"))
