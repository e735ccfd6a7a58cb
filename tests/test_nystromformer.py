"""Nyströmformer (arXiv 2102.03902): segment-mean landmarks, the iterative pseudo-inverse, the exact limit, the method."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnpatch import OptionError, patch, patched, record_stats, unpatch
from attnpatch.attention.nystrom.nystromformer import nystromformer_attention, segment_means, segment_plan
from attnpatch.patchers.methods.nystromformer import NystromformerConfig, nystromformer_forward
from attnpatch.patchers.state import ForwardState, LayerContext

# --------------------------------------------------------------------------- float64 reference


def _segments_reference(n: int, s: int, prefix: int) -> list[tuple[int, int]]:
    """Prefix tokens one by one, then s - prefix contiguous segments of nearly equal length (Python ints)."""
    out = [(i, i + 1) for i in range(prefix)]
    m, g = n - prefix, s - prefix
    out += [(prefix + (j * m) // g, prefix + ((j + 1) * m) // g) for j in range(g)]
    return out


def _newton_reference(a: torch.Tensor, iters: int) -> torch.Tensor:
    """The paper's Eq. 16 in float64, one matrix at a time, written out as printed."""
    a = a.double()
    eye = torch.eye(a.shape[-1], dtype=torch.float64)
    norm1 = float(a.abs().sum(0).max())  # max column sum
    norm_inf = float(a.abs().sum(1).max())  # max row sum
    z = a.T / (norm1 * norm_inf)
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystromformer_reference(q, k, v, s, *, scale, prefix=0, iters=6):
    """softmax(Q K~^T c) Z softmax(Q~ K^T c) V in float64 with explicit matrices and loops over items, heads, segments."""
    b, h, n, _ = q.shape
    k = k.repeat_interleave(h // k.shape[1], dim=1).double()
    v = v.repeat_interleave(h // v.shape[1], dim=1).double()
    q = q.double()
    segs = _segments_reference(n, s, prefix)
    out = torch.empty(b, h, n, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            qq, kk, vv = q[bi, hi], k[bi, hi], v[bi, hi]
            ql = torch.stack([qq[a:e].mean(0) for a, e in segs])
            kl = torch.stack([kk[a:e].mean(0) for a, e in segs])
            f = torch.softmax(qq @ kl.T * scale, -1)
            a_ = torch.softmax(ql @ kl.T * scale, -1)
            bb = torch.softmax(ql @ kk.T * scale, -1)
            out[bi, hi] = f @ _newton_reference(a_, iters) @ (bb @ vv)
    return out


def _qkv(b=2, h=4, hkv=4, n=37, d=8, dtype=torch.float32, seed=0, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * sharp
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64) * sharp
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _exact(q, k, v, scale):
    h = q.shape[1]
    k = k.repeat_interleave(h // k.shape[1], dim=1).double()
    v = v.repeat_interleave(h // v.shape[1], dim=1).double()
    return torch.softmax(q.double() @ k.transpose(-1, -2) * scale, -1) @ v


# --------------------------------------------------------------------------- segments


@pytest.mark.parametrize("n,s,prefix", [(12, 4, 0), (37, 7, 1), (30, 8, 5), (17, 17, 1), (10, 2, 1), (50, 9, 0)])
def test_segment_plan_matches_explicit_segments(n, s, prefix):
    index, weight = segment_plan(n, s, prefix)
    segs = _segments_reference(n, s, prefix)
    assert index.shape[0] == s == len(segs)
    covered = []
    for j, (a, e) in enumerate(segs):
        ln = e - a
        assert ln >= 1
        assert index[j, :ln].tolist() == list(range(a, e))
        assert torch.allclose(weight[j, :ln], torch.full((ln,), 1.0 / ln))
        assert bool((weight[j, ln:] == 0).all())
        covered += list(range(a, e))
    assert covered == list(range(n))  # contiguous, disjoint, in order, every token once
    lengths = [e - a for a, e in segs[prefix:]]
    assert max(lengths) - min(lengths) <= 1
    x = torch.randn(2, 3, n, 5, dtype=torch.float64)
    ref = torch.stack([x[:, :, a:e].mean(2) for a, e in segs], dim=2)
    torch.testing.assert_close(segment_means(x, index, weight), ref)


def test_segment_plan_refuses_bad_landmark_counts():
    for n, s, p in [(10, 11, 0), (10, 0, 0), (10, 5, 5), (10, 3, 5)]:
        with pytest.raises(OptionError, match=f"s={s}"):
            segment_plan(n, s, p)


# --------------------------------------------------------------------------- the fast path against the reference


@pytest.mark.parametrize("b,h,hkv,n,s,prefix", [
    (2, 4, 4, 37, 7, 1),  # N not divisible by s - prefix
    (2, 4, 2, 50, 9, 5),  # grouped-query keys, five prefix tokens
    (1, 3, 1, 33, 8, 0),  # no prefix, GQA 3:1
    (2, 2, 2, 65, 17, 1),  # divisible: 64 patch tokens into 16 segments of 4
])
def test_fast_path_matches_float64_reference(b, h, hkv, n, s, prefix):
    q, k, v = _qkv(b, h, hkv, n)
    for iters in (6, 2):
        ref = nystromformer_reference(q, k, v, s, scale=8**-0.5, prefix=prefix, iters=iters)
        out = nystromformer_attention(q, k, v, s, scale=8**-0.5, prefix=prefix, pinv_iters=iters)
        assert out.dtype == torch.float32 and out.shape == (b, h, n, 8)
        assert _rel(out, ref) < 1e-5, (iters, _rel(out, ref))
        out64 = nystromformer_attention(q.double(), k.double(), v.double(), s, scale=8**-0.5, prefix=prefix, pinv_iters=iters)
        assert out64.dtype == torch.float64 and _rel(out64, ref) < 1e-5  # the pseudo-inverse iterates in float32
    # the approximation is an approximation: it is not exact attention here
    assert _rel(out, _exact(q, k, v, 8**-0.5)) > 1e-3


def test_value_head_size_may_differ():
    q, k, _ = _qkv(1, 2, 2, 29)
    v = torch.randn(1, 2, 29, 5)
    out = nystromformer_attention(q, k, v, 6, scale=0.3, prefix=1)
    assert out.shape == (1, 2, 29, 5)
    assert _rel(out, nystromformer_reference(q, k, v, 6, scale=0.3, prefix=1)) < 1e-5


def test_segment_means_of_one_token_segments_approach_exact_with_more_iterations():
    """s = N: every segment is one token, so the landmark kernel is the attention matrix itself and only
    the iterative pseudo-inverse separates the result from exact attention (sharp, well conditioned case)."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(1, 2, 24, 8, generator=g, dtype=torch.float64) * 2.0
    q, v = k.clone(), torch.randn(1, 2, 24, 8, generator=g, dtype=torch.float64)
    exact = _exact(q, k, v, 8**-0.5)
    errs = [_rel(nystromformer_attention(q, k, v, 24, scale=8**-0.5, prefix=1, pinv_iters=i), exact) for i in (1, 6, 20)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-4, errs


def test_never_allocates_n_by_n():
    q, k, v = _qkv(1, 1, 1, 2048, 16)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        nystromformer_attention(q, k, v, 32, scale=0.25, prefix=1)
    biggest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    assert biggest < 2048 * 2048 * 4 / 8, biggest


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite_and_close_to_float32(dtype):
    q, k, v = _qkv(2, 4, 2, 41, 16, sharp=6.0)  # sharp logits: raw q.k far beyond what a half dtype rounds well
    ref = nystromformer_attention(q, k, v, 9, scale=0.25, prefix=1)
    # the float32 method on the half-rounded inputs: what the dtype's rounding of q, k, v alone costs
    qh, kh, vh = q.to(dtype), k.to(dtype), v.to(dtype)
    ref_rounded = nystromformer_attention(qh.float(), kh.float(), vh.float(), 9, scale=0.25, prefix=1)
    out = nystromformer_attention(qh, kh, vh, 9, scale=0.25, prefix=1)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    assert _rel(out, ref_rounded) < (2e-2 if dtype == torch.bfloat16 else 3e-3)
    assert _rel(out, ref) < 0.1


# --------------------------------------------------------------------------- the method's forward


def _ctx(prefix=1, layer=0):
    return LayerContext(layer=layer, num_layers=2, scale=8**-0.5, causal=False, prefix_tokens=prefix,
                        state=ForwardState(), record=True)


def test_forward_runs_the_math_with_the_models_prefix_tokens():
    q, k, v = _qkv(2, 4, 2, 30)
    cfg = NystromformerConfig(s=8, pinv_iters=4)
    out, rec = nystromformer_forward(cfg, q, k, v, _ctx(prefix=5))
    assert rec.mode == "nystromformer" and rec.queries == rec.keys == 30
    torch.testing.assert_close(out, nystromformer_attention(q, k, v, 8, scale=8**-0.5, prefix=5, pinv_iters=4))
    assert _rel(out, nystromformer_reference(q, k, v, 8, scale=8**-0.5, prefix=5, iters=4)) < 1e-5
    assert float(rec.kept_pairs[0, 0]) == 2 * 8 * 30 + 64 and float(rec.causal_pairs[0, 0]) == 900
    with pytest.raises(OptionError, match="s=5: this model has 5 prefix tokens"):
        nystromformer_forward(NystromformerConfig(s=5), q, k, v, _ctx(prefix=5))


@pytest.mark.parametrize("s", [30, 31, 1000])
def test_exact_limit_is_exact_attention_computed_here(s):
    q, k, v = _qkv(2, 4, 2, 30)
    with pytest.warns(UserWarning, match="s>=N|>= N=30"):
        out, rec = nystromformer_forward(NystromformerConfig(s=s), q, k, v, _ctx())
    assert out is not None and out.dtype == q.dtype and rec.mode == "dense:s>=N"
    assert _rel(out, _exact(q, k, v, 8**-0.5)) < 1e-6


def test_options_are_checked():
    with pytest.raises(OptionError, match="s=0"):
        NystromformerConfig(s=0)
    with pytest.raises(OptionError, match="pinv_iters=0"):
        NystromformerConfig(pinv_iters=0)
    with pytest.raises(OptionError, match="pinv_iters"):
        NystromformerConfig(pinv_iters="six")
    with pytest.raises(OptionError, match="pinv_iters=0"):
        nystromformer_attention(*_qkv(1, 1, 1, 10), 4, scale=1.0, pinv_iters=0)


# --------------------------------------------------------------------------- tiny models end to end


def _dinov2_registers():
    from tiny_models import tiny_dinov2

    return tiny_dinov2(4, num_hidden_layers=3)  # 25 patches + CLS + 4 registers = 30 tokens


def _timm_nocls():
    from tiny_models import tiny_timm_vit

    return tiny_timm_vit(class_token=False, global_pool="avg")  # 36 tokens, no prefix


@pytest.mark.parametrize("arch", ["dinov2_registers", "timm_nocls"])
def test_tiny_model_end_to_end(arch):
    if arch == "dinov2_registers":
        model, x, n = _dinov2_registers(), torch.randn(2, 3, 70, 70, generator=torch.Generator().manual_seed(1)), 30

        def run():
            return model(pixel_values=x).last_hidden_state
    else:
        model, x, n = _timm_nocls(), torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(1)), 36

        def run():
            return model.forward_features(x)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = run()
        with patched(model, "nystromformer", s=n):  # the exact limit, through the method's own code
            with record_stats(model) as rec:
                exact = run()
        assert {r.mode for r in rec.forwards[0].values()} == {"dense:s>=N"}
        assert _rel(exact, dense) < 1e-5
        with patched(model, "nystromformer", s=9):
            with record_stats(model) as rec:
                approx = run()
        layers = rec.forwards[0]
        assert len(layers) == len(model.encoder.layer if arch == "dinov2_registers" else model.blocks)
        assert {r.mode for r in layers.values()} == {"nystromformer"}
        assert bool(torch.isfinite(approx).all())
        err = _rel(approx, dense)
        assert 1e-4 < err < 0.5, err  # approximate, and not wild on a random model
        if arch == "dinov2_registers":
            patch(model, "nystromformer", s=5)  # 5 prefix tokens: no landmark left for the patches
            try:
                with pytest.raises(OptionError, match="s=5: this model has 5 prefix tokens"):
                    run()
            finally:
                unpatch(model)
            torch.testing.assert_close(run(), dense, rtol=0, atol=0)


def test_patch_refuses_wrong_options_by_name():
    model = _timm_nocls()
    with pytest.raises(OptionError, match="s='many'"):
        patch(model, "nystromformer", s="many")
    with pytest.raises(OptionError, match="unknown option"):
        patch(model, "nystromformer", landmarks=8)
