"""``relu_linear``: ReLU-kernel linear attention (L2ViT) merged with exact softmax over prefix tokens and local windows.

Checked against a float64 reference written here from the module docstring's formula with dense ``N x N``
masks (an independent formulation: no windows, no kernel-sum subtraction), its exact limit, the paper's
formula, zero-kernel rows, half precision, option errors and a tiny DINOv2 end to end.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from attnpatch import OptionError, patch, patched, record_stats
from attnpatch.attention import linear
from attnpatch.attention.linear import exact_pairs, relu_linear_attention
from attnpatch.patchers.methods.relu_linear import ReluLinearConfig, linear_layers


def reference(q, k, v, *, scale, local_window, prefix, eps=1e-6):
    """float64, dense: ``local[i, j]`` says whether key ``j`` is exact for query ``i``; the merge formula literally."""
    q, k, v = q.double(), k.double(), v.double()
    b, h, n, d = q.shape
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    p = min(prefix, n)
    idx = torch.arange(n)
    win = torch.where(idx >= p, (idx - p) // max(local_window, 1), -1)  # window of each patch token
    local = torch.zeros(n, n, dtype=torch.bool)
    local[:, :p] = True  # every query attends to the prefix exactly
    local[:p, :] = True  # prefix queries attend to everything exactly
    if local_window > 0:
        local |= (win[:, None] == win[None, :]) & (win[:, None] >= 0)
    s = scale * q @ k.transpose(-1, -2)
    a = torch.relu(scale * q) @ torch.relu(k).transpose(-1, -2)  # kernel scores
    out = torch.zeros(b, h, n, v.shape[-1], dtype=torch.float64)
    for i in range(n):
        loc, far = local[i], ~local[i]
        far_num = torch.einsum("bhj,bhje->bhe", a[:, :, i, far], v[:, :, far])
        far_den = a[:, :, i, far].sum(-1)
        if loc.any():
            o_loc = torch.einsum("bhj,bhje->bhe", torch.softmax(s[:, :, i, loc], -1), v[:, :, loc])
            a_loc = a[:, :, i, loc].sum(-1)
            out[:, :, i] = ((a_loc + eps)[..., None] * o_loc + far_num) / (a_loc + eps + far_den)[..., None]
        else:
            out[:, :, i] = far_num / (far_den + eps)[..., None]
    return out


def _qkv(b, h, hkv, n, d, dv=None, seed=0, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g) * sharp
    k = torch.randn(b, hkv, n, d, generator=g) * sharp
    v = torch.randn(b, hkv, n, dv or d, generator=g)
    return q, k, v


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("h,hkv,n,d,dv,w,p", [
    (4, 4, 29, 16, 16, 5, 1),   # partial last window, CLS
    (4, 2, 37, 8, 8, 6, 5),     # grouped-query keys, CLS + 4 registers
    (2, 1, 23, 16, 12, 4, 0),   # no prefix, value head size != query head size
    (3, 3, 20, 8, 8, 1, 1),     # one-token windows
    (2, 2, 26, 8, 8, 0, 1),     # no window: local keys = the CLS token only
    (2, 2, 26, 8, 8, 0, 0),     # no local key at all: the paper's formula
    (2, 2, 26, 8, 8, 24, 1),    # one window short of every patch token
])
def test_fast_path_matches_float64_reference(h, hkv, n, d, dv, w, p):
    q, k, v = _qkv(2, h, hkv, n, d, dv, seed=n + w)
    out = relu_linear_attention(q, k, v, scale=d ** -0.5, local_window=w, prefix=p)
    ref = reference(q, k, v, scale=d ** -0.5, local_window=w, prefix=p)
    assert out.shape == (2, h, n, dv) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # not exact attention (except the trivial cases excluded above)
    exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(h // hkv, 1),
                                           v.double().repeat_interleave(h // hkv, 1), scale=d ** -0.5)
    assert _rel(ref, exact) > 1e-3


def test_window_chunks_give_the_same_result(monkeypatch):
    """Local windows processed a few at a time (tiny chunk budget) give what one chunk gives."""
    q, k, v = _qkv(2, 4, 2, 61, 8, seed=3)
    one = relu_linear_attention(q, k, v, scale=0.3, local_window=7, prefix=1)
    monkeypatch.setattr(linear, "CHUNK_ELEMENTS", 2 * 4 * 7 * 8 * 2)  # two windows per chunk
    many = relu_linear_attention(q, k, v, scale=0.3, local_window=7, prefix=1)
    torch.testing.assert_close(many, one, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(many.double(), reference(q, k, v, scale=0.3, local_window=7, prefix=1), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(linear, "CHUNK_ELEMENTS", 2 * 4 * 8 * 3)  # less than one window: 3 query rows at a time
    rows = relu_linear_attention(q, k, v, scale=0.3, local_window=7, prefix=1)
    torch.testing.assert_close(rows, one, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(relu_linear_attention(q, k, v, scale=0.3, local_window=0, prefix=3).double(),
                               reference(q, k, v, scale=0.3, local_window=0, prefix=3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [0, 1, 5])
def test_exact_limit_is_softmax_attention(p):
    q, k, v = _qkv(2, 4, 2, 30, 16, seed=p, sharp=2.0)
    exact = F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
    for w in (30 - p, 30, 1000):
        out = relu_linear_attention(q, k, v, scale=0.25, local_window=w, prefix=p)
        assert _rel(out, exact) < 1e-6, (p, w)
    assert exact_pairs(30, 30 - p, p) == 30 * 30  # and it is counted as fully exact


def test_no_local_key_is_the_papers_formula():
    q, k, v = _qkv(1, 2, 2, 40, 8, seed=5)
    fq, fk = torch.relu(q * 0.5), torch.relu(k)
    want = (fq @ (fk.transpose(-1, -2) @ v)) / (fq @ fk.sum(2, keepdim=True).transpose(-1, -2) + 1e-3)
    out = relu_linear_attention(q, k, v, scale=0.5, local_window=0, prefix=0, eps=1e-3)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_rows_with_zero_kernel_scores_stay_finite():
    """A query whose projections are all negative has ReLU(q) = 0: its kernel denominator is 0."""
    q, k, v = _qkv(1, 2, 2, 21, 8, seed=7)
    q[:, :, 3] = -q[:, :, 3].abs() - 0.1  # all-negative rows (a patch query)
    q[:, :, 10] = -q[:, :, 10].abs() - 0.1
    # no local key: the paper's output for such a row is 0
    out = relu_linear_attention(q, k, v, scale=0.3, local_window=0, prefix=0)
    assert torch.isfinite(out).all()
    assert float(out[:, :, 3].abs().max()) == 0.0
    # with local keys: exactly the local softmax output (the prefix and the row's own window)
    out = relu_linear_attention(q, k, v, scale=0.3, local_window=4, prefix=1)
    assert torch.isfinite(out).all()
    loc = torch.cat([k[:, :, :1], k[:, :, 1:5]], 2), torch.cat([v[:, :, :1], v[:, :, 1:5]], 2)  # token 3: window 0
    want = F.scaled_dot_product_attention(q[:, :, 3:4], loc[0], loc[1], scale=0.3)
    torch.testing.assert_close(out[:, :, 3:4], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.double(), reference(q, k, v, scale=0.3, local_window=4, prefix=1), rtol=1e-5, atol=1e-5)
    # every key with all-negative projections too: all kernel scores 0
    out = relu_linear_attention(q, -k.abs(), v, scale=0.3, local_window=4, prefix=1)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_finite_and_close(dtype):
    q, k, v = _qkv(1, 4, 4, 50, 16, seed=11, sharp=40.0)  # logits far beyond float16 unless scaled first
    ref = relu_linear_attention(q, k, v, scale=0.25, local_window=8, prefix=1)
    out = relu_linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=0.25, local_window=8, prefix=1)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # within a few times what the dtype costs exact attention on the same (sharp) input
    exact = F.scaled_dot_product_attention(q, k, v, scale=0.25)
    dense_err = _rel(F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=0.25), exact)
    assert _rel(out, ref) < max(4 * dense_err, 0.03 if dtype == torch.bfloat16 else 0.01)


def test_input_errors():
    q, k, v = _qkv(1, 3, 2, 10, 8)
    with pytest.raises(ValueError, match="multiple"):
        relu_linear_attention(q, k, v, scale=0.3)
    q, k, v = _qkv(1, 2, 2, 10, 8)
    with pytest.raises(ValueError, match="scale"):
        relu_linear_attention(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match="local_window"):
        relu_linear_attention(q, k, v, scale=0.3, local_window=-1)
    with pytest.raises(ValueError, match="eps"):
        relu_linear_attention(q, k, v, scale=0.3, eps=0.0)


# --------------------------------------------------------------------------- options and the model


def _dinov2(layers=4):
    from tiny_models import tiny_dinov2

    return tiny_dinov2(num_hidden_layers=layers)


X = torch.randn(2, 3, 70, 70, generator=torch.Generator().manual_seed(1))  # 25 patches + CLS = 26 tokens


def _run(model):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(pixel_values=X).last_hidden_state


def test_option_errors():
    model = _dinov2()
    for bad, words in [({"local_window": -1}, "local_window=-1"), ({"eps": 0.0}, "eps=0.0"), ({"layers": "x"}, "layers"),
                       ({"layers": [4]}, "layers contains 4"), ({"layers": [-1]}, "layers=(-1,)"), ({"window": 3}, "window")]:
        with pytest.raises(OptionError) as err:
            patch(model, "relu_linear", **bad)
        assert words in str(err.value), str(err.value)
    with pytest.raises(OptionError):
        ReluLinearConfig(local_window=-2)
    assert linear_layers(ReluLinearConfig(), 12) == frozenset(range(6, 12))
    assert linear_layers(ReluLinearConfig(layers="0,3"), 12) == frozenset({0, 3})
    assert linear_layers(ReluLinearConfig(layers="none"), 5) == frozenset({2, 3, 4})


def test_tiny_dinov2_end_to_end():
    model = _dinov2()
    ref = _run(model)
    # exact limit through the method's own code (every key local), in the later half of the layers
    with patched(model, "relu_linear", local_window=26), record_stats(model) as rec:
        out = _run(model)
    assert [rec.forwards[0][i].mode for i in range(4)] == ["dense:layer", "dense:layer", "relu_linear", "relu_linear"]
    assert _rel(out, ref) < 1e-5
    # approximate: each linear layer's output is the reference formula on that layer's q, k, v
    seen = {}

    def probe(ctx, q, k, v):
        seen[ctx.layer] = (q.clone(), k.clone(), v.clone(), ctx.scale, ctx.prefix_tokens)

    with patched(model, "relu_linear", local_window=6, layers=[1, 3]), record_stats(model, capture=True, probe=probe) as rec:
        out = _run(model)
    modes = {i: r.mode for i, r in rec.forwards[0].items()}
    assert modes == {0: "dense:layer", 1: "relu_linear", 2: "dense:layer", 3: "relu_linear"}
    r = rec.forwards[0][1]
    assert float(r.sparsity[0, 0]) == pytest.approx(1 - (26 * 26 - 25 * 25 + 4 * 36 + 1) / 676)
    for layer in (1, 3):
        q, k, v, scale, prefix = seen[layer]
        assert prefix == 1
        want = reference(q, k, v, scale=scale, local_window=6, prefix=prefix)
        torch.testing.assert_close(rec.outputs[0][layer].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()
    assert 1e-3 < _rel(out, ref) < 1.0
    assert torch.equal(_run(model), ref)
