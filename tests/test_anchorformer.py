"""AnchorFormer (arXiv 2505.16463), training-free: bipartite token-anchor attention, anchors, exact limit, the method."""

from __future__ import annotations

import warnings

import pytest
import torch

from attnpatch import OptionError, patch, patched, record_stats, unpatch
from attnpatch.attention.anchorformer import anchor_bipartite_attention
from attnpatch.attention.landmarks import select_landmarks
from attnpatch.patchers.methods.anchorformer import AnchorFormerConfig, anchorformer_forward
from attnpatch.patchers.state import ForwardState, LayerContext

# --------------------------------------------------------------------------- float64 reference


def anchorformer_reference(q, k, v, anchors, *, scale):
    """A_q diag(1 / Delta) A_k^T V in float64, explicit matrices, loops over items and heads."""
    b, h, n, _ = q.shape
    k = k.repeat_interleave(h // k.shape[1], dim=1).double()
    v = v.repeat_interleave(h // v.shape[1], dim=1).double()
    q = q.double()
    out = torch.empty(b, h, n, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        a = anchors[bi]
        for hi in range(h):
            qq, kk, vv = q[bi, hi], k[bi, hi], v[bi, hi]
            a_q = torch.softmax(qq @ kk[a].T * scale, dim=1)  # [N, m] token -> anchor
            a_k = torch.softmax(kk @ qq[a].T * scale, dim=1)  # [N, m] p(anchor | key)
            delta = a_k.sum(0)  # [m] the anchors' degrees
            p = a_q @ torch.diag(1.0 / delta) @ a_k.T  # [N, N], row-stochastic
            assert torch.allclose(p.sum(1), torch.ones(n, dtype=torch.float64))
            out[bi, hi] = p @ vv
    return out


def official_code_form(x, anchor_vectors, v, scale):
    """The expression of AnchorFormer's released ``AnchorAttention.forward`` (tied query/key ``x``, learned
    anchors ``U``): ``A = softmax(x U^T c)``, ``out = A (Delta^{-1} (A^T V))``, ``Delta`` = column sums of ``A``."""
    a = torch.softmax(x @ anchor_vectors.transpose(-1, -2) * scale, dim=-1)
    deg = a.sum(dim=-2).pow(-1)[..., None]
    return a @ (deg * (a.transpose(-1, -2) @ v))


def _qkv(b=2, h=4, hkv=4, n=37, d=8, dtype=torch.float32, seed=0, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * sharp
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64) * sharp
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _anchors(b, n, m, seed=1, prefix=1):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.cat([torch.arange(prefix), prefix + torch.randperm(n - prefix, generator=g)[: m - prefix]]) for _ in range(b)]
    return torch.stack(rows)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _exact(q, k, v, scale):
    h = q.shape[1]
    k = k.repeat_interleave(h // k.shape[1], dim=1).double()
    v = v.repeat_interleave(h // v.shape[1], dim=1).double()
    return torch.softmax(q.double() @ k.transpose(-1, -2) * scale, -1) @ v


# --------------------------------------------------------------------------- the math


@pytest.mark.parametrize("b,h,hkv,n,m", [(2, 4, 4, 37, 7), (2, 4, 2, 50, 9), (1, 3, 1, 33, 1), (2, 2, 2, 20, 19)])
def test_fast_path_matches_float64_reference(b, h, hkv, n, m):
    q, k, v = _qkv(b, h, hkv, n)
    anchors = _anchors(b, n, m)
    ref = anchorformer_reference(q, k, v, anchors, scale=8**-0.5)
    out = anchor_bipartite_attention(q, k, v, anchors, scale=8**-0.5)
    assert out.dtype == torch.float32 and out.shape == (b, h, n, 8)
    assert _rel(out, ref) < 2e-6, _rel(out, ref)
    out64 = anchor_bipartite_attention(q.double(), k.double(), v.double(), anchors, scale=8**-0.5)
    assert _rel(out64, ref) < 1e-12
    # key chunks (an online softmax over the keys) give the same result
    for chunk in (1, 5, 16):
        assert _rel(anchor_bipartite_attention(q, k, v, anchors, scale=8**-0.5, key_chunk=chunk), ref) < 2e-6
    assert _rel(out, _exact(q, k, v, 8**-0.5)) > 1e-3  # an approximation


def test_with_tied_queries_and_keys_it_is_the_papers_formula():
    """The released AnchorFormer ties queries and keys; with Q = K and the anchor vectors U = K[anchors]
    both factors are one matrix A and the method is the paper's A Delta^-1 A^T V."""
    _, k, v = _qkv(2, 3, 3, 40, dtype=torch.float64)
    anchors = _anchors(2, 40, 6)
    out = anchor_bipartite_attention(k, k, v, anchors, scale=0.4)
    u = k.gather(2, anchors[:, None, :, None].expand(2, 3, 6, 8))
    torch.testing.assert_close(out, official_code_form(k, u, v, 0.4), rtol=1e-10, atol=1e-12)


def test_rows_are_convex_combinations_of_values():
    q, k, v = _qkv(1, 2, 2, 30, sharp=8.0)  # sharp: some anchors' columns of A_k are tiny
    anchors = _anchors(1, 30, 6)
    ones = torch.ones_like(v)
    torch.testing.assert_close(anchor_bipartite_attention(q, k, ones, anchors, scale=1.0), torch.ones(1, 2, 30, 8))
    out = anchor_bipartite_attention(q, k, v, anchors, scale=1.0)
    assert bool((out <= v.amax(2, keepdim=True) + 1e-5).all() and (out >= v.amin(2, keepdim=True) - 1e-5).all())


def test_an_anchor_column_that_underflows_stays_finite():
    """An anchor whose query loses to another anchor's by ~120 logits on every key: its column of A_k is
    below float32's range (exp(-120)) and its degree Delta is 0 in float32; the column-wise softmax of
    log A_k still gives the float64 answer (the paper's code would divide 0 by 0, then zero the anchor)."""
    q, k, v = _qkv(1, 1, 1, 12, 4)
    k[..., 0] = 1.0 + torch.rand(12, generator=torch.Generator().manual_seed(5))  # every key: k_0 in [1, 2)
    q[0, 0, 0] = torch.tensor([120.0, 0.0, 0.0, 0.0])  # anchor 0 wins every key by >= 120
    q[0, 0, 3] = 0.0  # anchor 3: logit 0 everywhere
    anchors = torch.tensor([[0, 3, 7]])
    a_k = torch.softmax(k[0, 0] @ q[0, 0, anchors[0]].T, dim=1)  # float32
    assert float(a_k[:, 1].sum()) == 0.0  # the case: anchor 3's degree underflows
    ref = anchorformer_reference(q, k, v, anchors, scale=1.0)
    assert bool(torch.isfinite(ref).all())
    out = anchor_bipartite_attention(q, k, v, anchors, scale=1.0)
    assert bool(torch.isfinite(out).all()) and _rel(out, ref) < 1e-5, _rel(out, ref)
    naive = official_code_form_untied(q, k, v, anchors)
    assert not bool(torch.isfinite(naive).all())  # what dividing by the float32 degree gives


def official_code_form_untied(q, k, v, anchors):
    """A_q Delta^-1 A_k^T V with Delta = A_k^T 1 taken literally, in the inputs' dtype."""
    qa, ka = q[:, :, anchors[0]], k[:, :, anchors[0]]
    a_q = torch.softmax(q @ ka.transpose(-1, -2), -1)
    a_k = torch.softmax(k @ qa.transpose(-1, -2), -1)
    return a_q @ ((a_k.transpose(-1, -2) @ v) / a_k.sum(-2)[..., None])


def test_never_allocates_n_by_n():
    q, k, v = _qkv(1, 1, 1, 2048, 16)
    anchors = torch.arange(0, 2048, 64)[None]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        anchor_bipartite_attention(q, k, v, anchors, scale=0.25)
    biggest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    assert biggest < 2048 * 2048 * 4 / 8, biggest


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_finite_and_close_to_float32(dtype):
    q, k, v = _qkv(2, 4, 2, 41, 16, sharp=6.0)
    anchors = _anchors(2, 41, 9)
    ref = anchor_bipartite_attention(q, k, v, anchors, scale=0.25)
    qh, kh, vh = q.to(dtype), k.to(dtype), v.to(dtype)
    ref_rounded = anchor_bipartite_attention(qh.float(), kh.float(), vh.float(), anchors, scale=0.25)
    out = anchor_bipartite_attention(qh, kh, vh, anchors, scale=0.25)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    assert _rel(out, ref_rounded) < (1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert _rel(out, ref) < 0.1


# --------------------------------------------------------------------------- the method's forward


def _ctx(prefix=1):
    return LayerContext(layer=0, num_layers=2, scale=8**-0.5, causal=False, prefix_tokens=prefix,
                        state=ForwardState(), record=True)


@pytest.mark.parametrize("strategy", ["fps", "strided", "random"])
def test_forward_picks_anchors_on_the_keys_with_the_prefix_tokens(strategy):
    q, k, v = _qkv(2, 4, 2, 30)
    cfg = AnchorFormerConfig(m=8, strategy=strategy, seed=3)
    out, rec = anchorformer_forward(cfg, q, k, v, _ctx(prefix=5))
    assert rec.mode == "anchorformer"
    feats = k.transpose(1, 2).reshape(2, 30, -1)
    anchors = select_landmarks(feats, 8, prefix=5, strategy=strategy, seed=3)
    assert torch.equal(rec.landmarks, anchors) and rec.landmarks[:, :5].tolist() == [list(range(5))] * 2
    assert len(set(anchors[0].tolist())) == 8
    assert _rel(out, anchorformer_reference(q, k, v, anchors, scale=8**-0.5)) < 2e-6
    assert float(rec.kept_pairs[0, 0]) == 2 * 8 * 30 and float(rec.causal_pairs[0, 0]) == 900
    with pytest.raises(OptionError, match="m=5: this model has 5 prefix tokens"):
        anchorformer_forward(AnchorFormerConfig(m=5, strategy=strategy), q, k, v, _ctx(prefix=5))


@pytest.mark.parametrize("m", [30, 31, 1000])
def test_exact_limit_is_exact_attention_computed_here(m):
    q, k, v = _qkv(2, 4, 2, 30)
    with pytest.warns(UserWarning, match=">= N=30"):
        out, rec = anchorformer_forward(AnchorFormerConfig(m=m), q, k, v, _ctx())
    assert out is not None and out.dtype == q.dtype and rec.mode == "dense:m>=N"
    assert _rel(out, _exact(q, k, v, 8**-0.5)) < 1e-6


def test_every_token_an_anchor_is_still_not_exact():
    """Why the exact limit runs exact attention: with all N tokens as anchors the bipartite product is two
    softmax steps, A_q Delta^-1 A_k^T, not softmax(Q K^T)."""
    q, k, v = _qkv(1, 2, 2, 20)
    out = anchor_bipartite_attention(q, k, v, torch.arange(20)[None], scale=8**-0.5)
    assert _rel(out, _exact(q, k, v, 8**-0.5)) > 0.05


def test_options_are_checked():
    with pytest.raises(OptionError, match="m=0"):
        AnchorFormerConfig(m=0)
    with pytest.raises(OptionError, match="strategy"):
        AnchorFormerConfig(strategy="segments")
    with pytest.raises(OptionError, match="seed=-1"):
        AnchorFormerConfig(seed=-1)


# --------------------------------------------------------------------------- tiny models end to end


def _dinov2_registers():
    from tiny_models import tiny_dinov2

    return tiny_dinov2(4, num_hidden_layers=3)  # 25 patches + CLS + 4 registers = 30 tokens


def _timm_cls():
    from tiny_models import tiny_timm_vit

    return tiny_timm_vit()  # 37 tokens


@pytest.mark.parametrize("arch", ["dinov2_registers", "timm_cls"])
def test_tiny_model_end_to_end(arch):
    if arch == "dinov2_registers":
        model, x, n, prefix = _dinov2_registers(), torch.randn(2, 3, 70, 70, generator=torch.Generator().manual_seed(1)), 30, 5

        def run():
            return model(pixel_values=x).last_hidden_state
    else:
        model, x, n, prefix = _timm_cls(), torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(1)), 37, 1

        def run():
            return model.forward_features(x)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = run()
        with patched(model, "anchorformer", m=n), record_stats(model) as rec:  # the exact limit, computed by the method
            exact = run()
        assert {r.mode for r in rec.forwards[0].values()} == {"dense:m>=N"}
        assert _rel(exact, dense) < 1e-5
        with patched(model, "anchorformer", m=10), record_stats(model) as rec:
            approx = run()
        layers = rec.forwards[0]
        assert {r.mode for r in layers.values()} == {"anchorformer"}
        # anchors chosen anew in every layer, prefix tokens always among them
        lms = [r.landmarks for r in layers.values()]
        assert all(lm.shape == (2, 10) and lm[:, :prefix].tolist() == [list(range(prefix))] * 2 for lm in lms)
        assert any(not torch.equal(lms[0], lm) for lm in lms[1:])
        assert bool(torch.isfinite(approx).all())
        err = _rel(approx, dense)
        assert 1e-4 < err < 0.5, err
        if arch == "dinov2_registers":
            patch(model, "anchorformer", m=5)
            try:
                with pytest.raises(OptionError, match="m=5: this model has 5 prefix tokens"):
                    run()
            finally:
                unpatch(model)
            torch.testing.assert_close(run(), dense, rtol=0, atol=0)


def test_patch_refuses_wrong_options_by_name():
    model = _timm_cls()
    with pytest.raises(OptionError, match="m='many'"):
        patch(model, "anchorformer", m="many")
    with pytest.raises(OptionError, match="unknown option"):
        patch(model, "anchorformer", anchors=8)
