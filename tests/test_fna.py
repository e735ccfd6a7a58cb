"""FNA, landmark selection, sink masking and the vision adapters (HF DINOv2 with/without registers, timm ViT)."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnpatch import OptionError, UnsupportedModelError, patch, patched, record_stats, unpatch
from attnpatch.attention.exact import exact_attention
from attnpatch.attention.landmarks import farthest_point_sampling, farthest_point_sampling_reference, select_landmarks
from attnpatch.attention.nystrom import landmark_pinv, nystrom_attention
from attnpatch.attention.sinks import attention_received, massive_tokens

# --------------------------------------------------------------------------- math


def _qkv(b=2, h=3, n=20, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3)]


def test_nystrom_with_every_token_a_landmark_is_exact():
    q, k, v = _qkv()
    idx = torch.arange(20).expand(2, 20)
    out = nystrom_attention(q, k, v, idx, scale=8**-0.5, pinv="exact")
    ref = torch.softmax(q @ k.transpose(-1, -2) * 8**-0.5, -1) @ v
    torch.testing.assert_close(out, ref, rtol=1e-8, atol=1e-8)
    # landmark order does not matter
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(1)).expand(2, 20)
    torch.testing.assert_close(nystrom_attention(q, k, v, perm, scale=8**-0.5, pinv="exact"), ref, rtol=1e-8, atol=1e-8)


def test_nystrom_sink_masking_with_every_token_a_landmark_equals_masked_exact():
    q, k, v = _qkv()
    idx = torch.arange(20).expand(2, 20)
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[0, 0] = keep[1, 3] = keep[1, 7] = False
    p = torch.softmax(q @ k.transpose(-1, -2) * 8**-0.5, -1) * keep[:, None, None, :]
    ref = p @ v
    ref_renorm = (p / p.sum(-1, keepdim=True)) @ v
    torch.testing.assert_close(nystrom_attention(q, k, v, idx, scale=8**-0.5, pinv="exact", key_keep=keep), ref, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(
        nystrom_attention(q, k, v, idx, scale=8**-0.5, pinv="exact", key_keep=keep, renormalize=True), ref_renorm, rtol=1e-7, atol=1e-7
    )
    torch.testing.assert_close(exact_attention(q, k, v, scale=8**-0.5, key_keep=keep, chunk=7), ref)
    torch.testing.assert_close(exact_attention(q, k, v, scale=8**-0.5, key_keep=keep, renormalize=True), ref_renorm)


def test_nystrom_never_allocates_n_by_n():
    # N = 2048, s = 16: an N x N fp32 score matrix per head would be 16 MiB; the whole call must stay far below.
    q, k, v = _qkv(b=1, h=1, n=2048, d=16, dtype=torch.float32)
    idx = farthest_point_sampling(k[:, 0], 16, prefix=1)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        nystrom_attention(q, k, v, idx, scale=0.25)
    biggest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    assert biggest < 2048 * 2048 * 4 / 8, biggest


def test_pinv_modes():
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(torch.randn(4, 16, 16, generator=g, dtype=torch.float64) * 3, -1)
    exact = torch.linalg.pinv(a)
    torch.testing.assert_close(landmark_pinv(a, "exact"), exact)
    assert (landmark_pinv(a, "newton", iters=30).double() - exact).abs().max() < 1e-4 * exact.abs().max()  # float32
    # rtol truncation: A pinv(A) A == A on the kept subspace, and rtol -> tiny gives the exact pinv back
    torch.testing.assert_close(landmark_pinv(a, "rtol", rtol=1e-12), exact)  # float64 input: float64 work
    # float32 input (what models give): agrees with the float64 truncated SVD pseudo-inverse
    ill = (torch.randn(3, 2, 48, 48, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 4).softmax(-1)
    for rtol, tol in ((1e-1, 1e-4), (1e-2, 2e-3), (1e-3, 1e-8)):  # float32 work from 1e-2 up, float64 below
        ref = torch.linalg.pinv(ill, rtol=rtol)
        got = landmark_pinv(ill.float(), "rtol", rtol=rtol)
        assert got.dtype == torch.float32
        assert ((got.double() - ref).norm(dim=(-1, -2)) / ref.norm(dim=(-1, -2))).max() < max(tol, 1e-6)
    assert landmark_pinv(ill.bfloat16(), "rtol").dtype == torch.bfloat16
    with pytest.raises(OptionError, match="pinv='svd'"):
        landmark_pinv(a, "svd")


@pytest.mark.parametrize("shape,s,prefix", [((2, 30, 5), 7, 1), ((3, 25, 4), 10, 5), ((1, 12, 3), 12, 1)])
def test_fps_matches_reference_distinct_prefix_deterministic(shape, s, prefix):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    idx = farthest_point_sampling(x, s, prefix)
    assert idx.shape == (shape[0], s)
    assert torch.equal(idx, farthest_point_sampling_reference(x, s, prefix))
    assert torch.equal(idx, farthest_point_sampling(x, s, prefix))
    for row in idx:
        assert len(set(row.tolist())) == s
        assert row[:prefix].tolist() == list(range(prefix))


def _fps_kernels() -> list[str]:
    """The FPS paths this machine runs: the PyTorch loop, the compiled CPU kernel where it builds, the Triton kernel
    under the interpreter (conftest.py sets TRITON_INTERPRET=1)."""
    from attnpatch.attention.backends.cpu_kernel import stripe_kernel
    from attnpatch.attention.backends.dispatch import Call, allowed
    from attnpatch.attention.backends.triton_support import interpreted

    here = allowed("fps", Call(torch.device("cpu"), torch.float32))
    assert here == ["auto"] + (["triton"] if interpreted() else []) + (
        ["compiled"] if stripe_kernel() is not None else []) + ["torch"]
    return here[1:]


FPS_KERNELS = _fps_kernels()


@pytest.mark.parametrize("kernel", FPS_KERNELS)
def test_fps_takes_exact_copies_last_and_in_index_order(kernel):
    """20 distinct tokens, each also copied twice: every distinct token is taken before any copy (a copy of a taken
    token is at distance exactly 0), then the copies in index order, as the float64 reference takes them.  The
    |x|^2 + |c|^2 - 2 x.c distances of the earlier loop left a rounding residue on copies and took 10 copies of one
    token."""
    base = torch.randn(20, 64, generator=torch.Generator().manual_seed(0)) * 3 + 1
    x = base[torch.arange(60) % 20][None]  # tokens 20..59 copy tokens 0..19
    idx = farthest_point_sampling(x, 32, 1, kernel=kernel)[0].tolist()
    assert idx == farthest_point_sampling_reference(x, 32, 1)[0].tolist()
    assert sorted(idx[:20]) == list(range(20)) and idx[20:] == list(range(20, 32))
    # FNA on those landmarks: the copies cost nothing (every token is represented once)
    q, v = (torch.randn(1, 2, 60, 32, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    k = x.reshape(1, 60, 2, 32).transpose(1, 2)
    want = nystrom_attention(q.double(), k.double(), v.double(), torch.tensor([idx]), scale=32 ** -0.5)
    got = nystrom_attention(q, k, v, farthest_point_sampling(x, 32, 1, kernel=kernel), scale=32 ** -0.5)
    assert float((got.double() - want).norm() / want.norm()) < 1e-4


@pytest.mark.parametrize("kernel", FPS_KERNELS)
def test_fps_resolves_near_copies_like_the_float64_reference(kernel):
    """Copies perturbed by 1e-3 of the spread: squared distances about 1e-6 of the distinct ones', which the exact
    squared differences still order as float64 does."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 24, 48, generator=g)
    x = torch.cat([base, base + 1e-3 * torch.randn(2, 24, 48, generator=g)], 1)
    for s in (24, 40):
        assert torch.equal(farthest_point_sampling(x, s, 1, kernel=kernel), farthest_point_sampling_reference(x, s, 1))


@pytest.mark.parametrize("kernel", FPS_KERNELS)
def test_fps_nan_tokens_count_as_far_and_the_indices_stay_distinct(kernel):
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(4))
    x[0, 4, 2] = float("nan")
    x[1, 0, 0] = float("nan")  # the first centre itself
    idx = farthest_point_sampling(x, 8, 1, kernel=kernel)
    assert torch.equal(idx, farthest_point_sampling_reference(x, 8, 1))
    assert all(len(set(row.tolist())) == 8 for row in idx) and int(idx[0, 1]) == 4


@pytest.mark.parametrize("kernel", FPS_KERNELS)
def test_fps_at_tiny_scales_follows_the_distances_not_a_tolerance(kernel):
    """Features of size 1e-5 (squared distances about 1e-9): the traversal is the one of the same features at size 1,
    for the kernels and the float64 reference alike."""
    x = torch.randn(1, 30, 16, generator=torch.Generator().manual_seed(5))
    want = farthest_point_sampling_reference(x, 10, 1)
    assert torch.equal(farthest_point_sampling_reference(x * 1e-5, 10, 1), want)
    assert torch.equal(farthest_point_sampling(x * 1e-5, 10, 1, kernel=kernel), want)


def test_fps_checks_its_input_and_ignores_autograd():
    x = torch.randn(1, 20, 8, requires_grad=True)
    for kernel in FPS_KERNELS:
        assert torch.equal(farthest_point_sampling(x, 6, 1, kernel=kernel), farthest_point_sampling_reference(x.detach(), 6, 1))
    with pytest.raises(OptionError, match=r"features of shape \(20, 8\): farthest-point sampling takes \[B, N, D\]"):
        farthest_point_sampling(x[0], 6, 1)
    with pytest.raises(OptionError, match="s=6.0: farthest-point sampling takes an integer"):
        farthest_point_sampling(x, 6.0, 1)


def test_fps_with_duplicate_points_still_distinct():
    x = torch.zeros(1, 10, 4)
    x[0, 5] = 1.0
    idx = farthest_point_sampling(x, 6, 1)
    assert len(set(idx[0].tolist())) == 6


@pytest.mark.parametrize("strategy", ["fps", "random", "strided", "kmeans"])
def test_strategies_distinct_with_prefix(strategy):
    x = torch.randn(3, 40, 6, generator=torch.Generator().manual_seed(0))
    idx = select_landmarks(x, 12, prefix=2, strategy=strategy, seed=0)
    assert idx.shape == (3, 12)
    for row in idx:
        assert len(set(row.tolist())) == 12
        assert row[:2].tolist() == [0, 1]
        assert all(2 <= t < 40 for t in row[2:].tolist())
    assert torch.equal(idx, select_landmarks(x, 12, prefix=2, strategy=strategy, seed=0))


def test_strided_is_evenly_spaced():
    idx = select_landmarks(torch.zeros(1, 101, 2), 11, prefix=1, strategy="strided")
    assert idx[0].tolist() == [0, 1, 11, 21, 31, 41, 51, 61, 71, 81, 91]


def test_select_landmarks_errors():
    x = torch.zeros(1, 10, 2)
    with pytest.raises(OptionError, match="strategy='grid'"):
        select_landmarks(x, 4, strategy="grid")
    with pytest.raises(OptionError, match="s=11"):
        select_landmarks(x, 11)
    with pytest.raises(OptionError, match="s=0"):
        select_landmarks(x, 0, prefix=0)


def test_sink_detection():
    h = torch.ones(2, 10, 4)
    h[0, 3] *= 20
    assert massive_tokens(h, 5.0).tolist() == [[i == 3 for i in range(10)], [False] * 10]
    q, k, _ = _qkv(b=1, h=2, n=10, d=4)
    recv = attention_received(q, k, scale=0.5)
    assert torch.allclose(recv.sum(-1), torch.ones(1, dtype=recv.dtype))
    p = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1)
    torch.testing.assert_close(recv, p.mean(dim=(1, 2)).float())


# --------------------------------------------------------------------------- adapters


def _hf_dinov2(registers: int = 0, layers: int = 4, seed: int = 0):
    from tiny_models import tiny_dinov2

    return tiny_dinov2(registers, seed=seed, num_hidden_layers=layers)


def _timm_vit(registers: int = 0, seed: int = 0, fused: bool = True):
    from tiny_models import tiny_timm_vit

    m = tiny_timm_vit(seed=seed, img_size=70, patch_size=14, depth=4, reg_tokens=registers, init_values=1.0)
    for blk in m.blocks:
        blk.attn.fused_attn = fused
    return m


def _run(model, x):

    with torch.no_grad():
        if hasattr(model, "forward_features"):
            return model.forward_features(x)
        return model(pixel_values=x).last_hidden_state


MODELS = [
    pytest.param(lambda: _hf_dinov2(0), id="hf-dinov2"),
    pytest.param(lambda: _hf_dinov2(4), id="hf-dinov2-registers"),
    pytest.param(lambda: _timm_vit(0), id="timm-vit"),
    pytest.param(lambda: _timm_vit(4, fused=False), id="timm-vit-registers-manual"),
]
X = torch.randn(3, 3, 70, 70, generator=torch.Generator().manual_seed(1))  # 25 patches


@pytest.mark.parametrize("make", MODELS)
def test_s_at_least_n_is_exact_with_message_and_unpatch_is_bit_exact(make):
    model = make()
    ref = _run(model, X)
    n = ref.shape[1]
    patch(model, "fna", s=n, min_tokens=0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = _run(model, X)
    assert any(f"s={n} >= N={n}" in str(m.message) for m in w)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    unpatch(model)
    assert torch.equal(_run(model, X), ref)
    with patched(model, "fna", s=8, sample_layer=0, min_tokens=0):
        approx = _run(model, X)
    assert not torch.equal(approx, ref)
    assert torch.equal(_run(model, X), ref)


@pytest.mark.parametrize("make", MODELS)
def test_sample_once_reused_per_image_and_prefix_kept(make):
    model = make()
    prefix = 1 + (4 if "Registers" in type(model).__name__ or getattr(model, "num_reg_tokens", 0) else 0)
    with patched(model, "fna", s=9, sample_layer=1, min_tokens=0), record_stats(model) as rec:
        _run(model, X)
    lay = rec.forwards[0]
    assert lay[0].landmarks is None and lay[0].mode.startswith("dense")
    first = lay[1].landmarks
    assert first.shape == (3, 9)
    for li in (2, 3):
        assert torch.equal(lay[li].landmarks, first)
    assert first[:, :prefix].tolist() == [list(range(prefix))] * 3
    assert len({tuple(r) for r in first.tolist()}) > 1  # per image
    with patched(model, "fna", s=9, sample_layer=1, resample=True, min_tokens=0), record_stats(model) as rec:
        _run(model, X)
    assert not all(torch.equal(rec.forwards[0][li].landmarks, rec.forwards[0][1].landmarks) for li in (2, 3))


@pytest.mark.parametrize("make", MODELS)
@pytest.mark.parametrize("method,opts", [("fna", {"s": 9, "min_tokens": 0}), ("fna", {"s": 9, "sample_layer": 0, "strategy": "kmeans", "min_tokens": 0}),
                                         ("sink_mask", {"mask_layers": 2}), ("fna+sink_mask", {"s": 9, "sample_layer": 1})])
def test_batch_independence(make, method, opts):
    model = make()
    with patched(model, method, **opts):
        full = _run(model, X)
        alone = _run(model, X[1:2])
        other = _run(model, torch.cat([X[1:2], torch.randn(2, 3, 70, 70)]))
    torch.testing.assert_close(alone[0], full[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(other[0], full[1], rtol=1e-5, atol=1e-5)


def test_auto_sample_layer_without_massive_tokens_uses_the_fallback():
    model = _hf_dinov2(layers=6)
    with patched(model, "fna", s=9, min_tokens=0), record_stats(model) as rec:
        _run(model, X)
    modes = {li: r.mode for li, r in rec.forwards[0].items()}
    assert [modes[i] for i in range(6)] == ["dense:before_sample"] * 3 + ["fna"] * 3
    with patched(model, "fna", s=9, auto_fallback=1, min_tokens=0), record_stats(model) as rec:
        _run(model, X)
    assert rec.forwards[0][0].mode == "dense:before_sample" and rec.forwards[0][1].mode == "fna"


def test_auto_sample_layer_samples_where_massive_tokens_appear():
    model = _hf_dinov2(layers=6)
    # plant a massive token in image 0 only, from the block input of layer 2 on
    def plant(module, args, kwargs):
        h = args[0].clone()
        h[0, 5] *= 100.0
        return (h, *args[1:]), kwargs

    hook = model.encoder.layer[2].register_forward_pre_hook(plant, with_kwargs=True)
    try:
        with patched(model, "fna", s=9, min_tokens=0), record_stats(model) as rec:
            _run(model, X)
    finally:
        hook.remove()
    lay = rec.forwards[0]
    assert lay[1].landmarks is None
    assert lay[2].landmarks[0, 0] == 0 and (lay[2].landmarks[1:] == -1).all()  # only image 0 sampled at layer 2
    assert (lay[3].landmarks >= 0).all()  # the others at the fallback (6 // 2 = 3)


def test_sink_mask_detects_once_and_masks_the_last_layers():
    model = _hf_dinov2(layers=4)

    def plant(module, args, kwargs):  # a massive token (index 5) in image 0 from layer 2's input on
        h = args[0].clone()
        h[0, 5] *= 100.0
        return (h, *args[1:]), kwargs

    hook = model.encoder.layer[2].register_forward_pre_hook(plant, with_kwargs=True)
    try:
        with patched(model, "sink_mask", mask_layers=2, detect="norm"), record_stats(model) as rec:
            _run(model, X)
    finally:
        hook.remove()
    lay = rec.forwards[0]
    assert lay[1].sinks is None and lay[1].mode == "dense"
    assert torch.equal(lay[2].sinks, lay[3].sinks)  # detected once (layer 2), reused in layer 3
    assert torch.nonzero(lay[2].sinks).tolist() == [[0, 5]]


def test_hf_and_timm_agree_on_the_same_weights():
    from attnpatch.checkpoints import dinov2_hf_to_timm_state_dict

    hf = _hf_dinov2(layers=4)
    tm = _timm_vit()
    tm.load_state_dict(dinov2_hf_to_timm_state_dict(hf.state_dict(), hf.config), strict=True)
    torch.testing.assert_close(_run(tm, X), _run(hf, X), rtol=1e-4, atol=1e-4)
    for method, opts in [("fna", {"s": 9, "min_tokens": 0}), ("fna", {"s": 9, "sample_layer": 0, "min_tokens": 0}), ("sink_mask", {}), ("fna+sink_mask", {"s": 12})]:
        with patched(hf, method, **opts), patched(tm, method, **opts):
            torch.testing.assert_close(_run(tm, X), _run(hf, X), rtol=1e-4, atol=1e-4)


def test_two_models_patched_side_by_side_do_not_interfere():
    a, b = _hf_dinov2(seed=0), _hf_dinov2(seed=1)
    with patched(a, "fna", s=9, sample_layer=0, min_tokens=0):
        ref_a = _run(a, X)
    with patched(b, "fna", s=12, sample_layer=1, min_tokens=0):
        ref_b = _run(b, X)
    with patched(a, "fna", s=9, sample_layer=0, min_tokens=0), patched(b, "fna", s=12, sample_layer=1, min_tokens=0):
        assert torch.equal(_run(a, X), ref_a)
        assert torch.equal(_run(b, X), ref_b)


def test_bad_options_and_misfits():
    model = _hf_dinov2(layers=4)
    for opts, match in [({"s": 0}, "s=0"), ({"strategy": "grid"}, "strategy='grid'"), ({"sample_layer": 4}, "sample_layer=4"),
                        ({"pinv": "svd"}, "pinv='svd'"), ({"features": "values"}, "features='values'"), ({"landmarks": 3}, "unknown option")]:
        with pytest.raises(OptionError, match=match):
            patch(model, "fna", **opts)
    with pytest.raises(OptionError, match="mask_layers=5"):
        patch(model, "sink_mask", mask_layers=5)
    with pytest.raises(UnsupportedModelError, match="causal-only"):
        patch(model, "anchor_attention")
    from conftest import tiny_causal_lm

    lm = tiny_causal_lm("llama")
    with pytest.raises(UnsupportedModelError, match="'vision'"):
        patch(lm, "fna")


def test_padding_mask_is_refused_not_ignored():
    """fna declares no key padding; the runtime refuses such a call before the method sees it."""
    from attnpatch.patchers.methods.fna import FNA
    from attnpatch.patchers.runtime import check_call
    from attnpatch.patchers.state import LayerContext

    valid = torch.ones(1, 12, dtype=torch.bool)
    valid[0, -2:] = False
    ctx = LayerContext(layer=0, num_layers=2, scale=0.5, key_valid=valid, causal=False, prefix_tokens=1)
    assert not FNA.key_padding
    with pytest.raises(UnsupportedModelError, match="attention mask that hides some keys"):
        check_call(FNA, ctx)
    check_call(FNA, LayerContext(layer=0, num_layers=2, scale=0.5, key_valid=torch.ones(1, 12, dtype=torch.bool),
                                 causal=False, prefix_tokens=1))  # every key valid: accepted


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_nystrom_same_code_path(dtype):
    """bf16 / fp16 inputs (what GPU users run) go through the same code: output in the input dtype,
    pseudo-inverse in float32, close to the float32 result."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 300, 32, generator=g) for _ in range(3))
    feats = k.transpose(1, 2).reshape(2, 300, 96)
    lm = farthest_point_sampling(feats.to(dtype), 40, 1)
    assert torch.equal(lm, farthest_point_sampling(feats.to(dtype).float(), 40, 1))
    ref = nystrom_attention(q, k, v, lm, scale=32**-0.5)
    out = nystrom_attention(q.to(dtype), k.to(dtype), v.to(dtype), lm, scale=32**-0.5)
    assert out.dtype == dtype and out.shape == ref.shape
    assert ((out.float() - ref).norm() / ref.norm()) < 0.05


def test_fps_runs_once_per_forward_not_per_layer(monkeypatch):
    """The sample-once path pays for landmark selection once per forward call."""
    from attnpatch.patchers.methods import fna as vision_methods

    calls = []
    real = vision_methods.select_landmarks
    monkeypatch.setattr(vision_methods, "select_landmarks", lambda *a, **k: calls.append(1) or real(*a, **k))
    for model in (_hf_dinov2(0), _timm_vit(0)):
        calls.clear()
        with patched(model, "fna", s=9, sample_layer=1, min_tokens=0):
            _run(model, X)
            _run(model, X)
        assert len(calls) == 2  # one per forward, not one per FNA layer (3 per forward here)


def test_patch_warms_the_kernels_on_small_inputs_whatever_s(monkeypatch):
    """patch() runs FPS and the pseudo-inverse once where their kernels have a one-time cost (the compiled CPU
    kernel's build, a Triton JIT compile), on at most ``WARM_UP_LANDMARKS`` landmarks: ``s >= N`` (s=10000, every
    layer exact) must not make it factorise 10000 x 10000 matrices."""
    from attnpatch.patchers.methods.fna import hooks

    seen = []
    real_fps, real_pinv = hooks.farthest_point_sampling, hooks.landmark_pinv
    monkeypatch.setattr(hooks, "needs_warm_up", lambda *a: True)  # as where a kernel has a one-time cost
    monkeypatch.setattr(hooks, "farthest_point_sampling", lambda x, s, p: seen.append(("fps", x.shape[1], s)) or real_fps(x, s, p))
    monkeypatch.setattr(hooks, "landmark_pinv", lambda a, *r, **k: seen.append(("pinv", a.shape[-1])) or real_pinv(a, *r, **k))
    model = _hf_dinov2(0)
    with patched(model, "fna", s=10000, min_tokens=0):
        pass
    with patched(model, "fna", s=8, min_tokens=0):
        pass
    assert seen == [("fps", 2 * hooks.WARM_UP_LANDMARKS + 1, hooks.WARM_UP_LANDMARKS), ("pinv", hooks.WARM_UP_LANDMARKS),
                    ("fps", 17, 8), ("pinv", 8)]
