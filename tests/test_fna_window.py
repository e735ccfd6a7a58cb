"""FNA with an exact local 2-D window (Nyström far field + exact near field), and ``min_tokens``."""

from __future__ import annotations

import pytest
import torch

from attnpatch import OptionError, patch, patched, record_stats
from attnpatch.attention.landmarks import select_landmarks
from attnpatch.attention.nystrom import nystrom_attention
from attnpatch.attention.nystrom.local import grid_of, nystrom_local_attention, nystrom_local_reference, window_keys
from attnpatch.patchers.methods.fna import BREAK_EVEN, FNAConfig

from test_fna import MODELS, X, _hf_dinov2, _run

SCALE = 8**-0.5


def _qkv(b, h, n, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype) for _ in range(3)]


# rows, cols, prefix, landmarks, radius, tile: square and non-square grids, tiles that overhang the image, no prefix
CASES = [(6, 6, 1, 8, 1, 2), (5, 7, 2, 9, 1, 3), (4, 4, 1, 5, 0, 4), (7, 5, 0, 6, 2, 4), (3, 9, 1, 7, 1, 1)]


@pytest.mark.parametrize("rows,cols,p,s,radius,tile", CASES)
def test_window_hybrid_matches_the_float64_reference(rows, cols, p, s, radius, tile):
    n = p + rows * cols
    q, k, v = _qkv(2, 3, n)
    lm = select_landmarks(k.transpose(1, 2).reshape(2, n, -1), s, prefix=p)
    out = nystrom_local_attention(q, k, v, lm, scale=SCALE, prefix=p, radius=radius, tile=tile, grid=(rows, cols))
    ref = nystrom_local_reference(q, k, v, lm, scale=SCALE, prefix=p, radius=radius, tile=tile, grid=(rows, cols))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    # float32 and bfloat16 inputs agree with the float64 result to their precision
    out32 = nystrom_local_attention(q.float(), k.float(), v.float(), lm, scale=SCALE, prefix=p, radius=radius, tile=tile,
                                    grid=(rows, cols))
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), ref, rtol=1e-3, atol=1e-3)
    out16 = nystrom_local_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), lm, scale=SCALE, prefix=p, radius=radius,
                                    tile=tile, grid=(rows, cols))
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()


@pytest.mark.parametrize("rows,cols,p,s,radius,tile", CASES)
def test_window_covering_every_patch_or_every_token_a_landmark_is_exact(rows, cols, p, s, radius, tile):
    n = p + rows * cols
    q, k, v = _qkv(2, 3, n, seed=1)
    exact = torch.softmax(q @ k.transpose(-1, -2) * SCALE, -1) @ v
    lm = select_landmarks(k.transpose(1, 2).reshape(2, n, -1), s, prefix=p)
    whole = nystrom_local_attention(q, k, v, lm, scale=SCALE, prefix=p, radius=max(rows, cols), tile=tile, grid=(rows, cols))
    torch.testing.assert_close(whole, exact, rtol=1e-10, atol=1e-10)
    # just below the shortcut (radius = max(rows, cols) - 2) with one tile per image the box still holds every key
    if max(rows, cols) - 2 >= 0 and tile >= max(rows, cols):
        near = nystrom_local_attention(q, k, v, lm, scale=SCALE, prefix=p, radius=max(rows, cols) - 2, tile=tile,
                                       grid=(rows, cols))
        torch.testing.assert_close(near, exact, rtol=1e-10, atol=1e-10)
    every = torch.arange(n).expand(2, n)
    est = nystrom_local_attention(q, k, v, every, scale=SCALE, prefix=p, radius=radius, tile=tile, grid=(rows, cols),
                                  pinv="exact")
    torch.testing.assert_close(est, exact, rtol=1e-8, atol=1e-8)


def test_window_rows_whose_far_estimate_is_inconsistent_keep_exact_window_attention():
    # a far-field estimate with no positive mass, or whose mean value leaves the box of the value rows, is dropped:
    # every output row then lies inside the box of V (a convex combination), which plain Nyström does not guarantee
    q, k, v = _qkv(1, 4, 1 + 64, seed=3)
    q = q * 3.0
    lm = select_landmarks(k.transpose(1, 2).reshape(1, 65, -1), 6, prefix=1)
    out = nystrom_local_attention(q, k, v, lm, scale=SCALE, prefix=1, radius=1, tile=2)
    lo, hi = v.amin(-2, keepdim=True), v.amax(-2, keepdim=True)
    assert ((out >= lo - 1e-9) & (out <= hi + 1e-9)).all()
    plain = nystrom_attention(q, k, v, lm, scale=SCALE)
    assert not ((plain >= lo - 1e-9) & (plain <= hi + 1e-9)).all()


def test_grid_inference_and_window_size():
    assert grid_of(1024) == (32, 32)
    assert grid_of(24) == (1, 24)  # not a square: one row, the window runs along the token order
    assert grid_of(24, (4, 6)) == (4, 6)
    with pytest.raises(ValueError, match=r"grid=\(4, 5\) does not hold the 24 patch tokens"):
        grid_of(24, (4, 5))
    assert window_keys(1024, None, 1, 4) == 36 and window_keys(16, None, 3, 4) == 16
    with pytest.raises(ValueError, match="radius=-1"):
        nystrom_local_attention(*_qkv(1, 1, 17), torch.arange(4)[None], scale=SCALE, prefix=1, radius=-1)


# --------------------------------------------------------------------------- through the patch


@pytest.mark.parametrize("make", MODELS)
def test_fna_with_a_window_over_the_whole_image_equals_the_unpatched_model(make):
    model = make()
    ref = _run(model, X)  # 25 patches (5 x 5)
    with patched(model, "fna", s=6, sample_layer=0, local_window=5, min_tokens=0), record_stats(model) as rec:
        out = _run(model, X)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert {r.mode for r in rec.forwards[0].values()} == {"fna+window"}
    with patched(model, "fna", s=6, sample_layer=0, local_window=1, window_tile=2, min_tokens=0):
        approx = _run(model, X)
    assert not torch.allclose(approx, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(_run(model, X), ref)


def test_window_until_switches_to_plain_fna_and_window_improves_early_layers():
    model = _hf_dinov2(layers=4)
    with patched(model, "fna", s=6, sample_layer=0, local_window=1, window_tile=2, window_until=2, min_tokens=0), \
            record_stats(model) as rec:
        _run(model, X)
    modes = [rec.forwards[0][i].mode for i in range(4)]
    assert modes == ["fna+window", "fna+window", "fna", "fna"]
    with pytest.raises(OptionError, match="window_until=4: the model has 4 attention layers"):
        patch(model, "fna", local_window=1, window_until=4)


def test_min_tokens_runs_the_models_own_attention_below_it_and_says_so(monkeypatch):
    model = _hf_dinov2(layers=2)
    ref = _run(model, X)  # 26 tokens
    with patched(model, "fna", s=8, sample_layer=0, min_tokens=27), record_stats(model) as rec:
        out = _run(model, X)
    assert torch.equal(out, ref)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:short"}
    with patched(model, "fna", s=8, sample_layer=0, min_tokens=26), record_stats(model) as rec:
        _run(model, X)
    assert {r.mode for r in rec.forwards[0].values()} == {"fna"}
    assert FNAConfig().min_tokens == "auto" and FNAConfig().min_tokens_on("cpu") == 0  # the suite's override
    monkeypatch.delenv("ATTNPATCH_FNA_BREAK_EVEN")
    assert FNAConfig().min_tokens_on("cpu") == BREAK_EVEN["cpu"] == 600 and FNAConfig().min_tokens_on("meta") is None
    assert FNAConfig(min_tokens=5).min_tokens_on("cpu") == 5
    with pytest.raises(OptionError, match="min_tokens"):
        FNAConfig(min_tokens=-1)


def test_sink_masking_with_the_window_is_refused():
    model = _hf_dinov2(layers=2)
    with pytest.raises(OptionError, match="fna\\+sink_mask does not implement sink masking with the local window"):
        patch(model, "fna+sink_mask", local_window=2)


def test_fna_presets_expand_and_fast_windows_the_first_half(monkeypatch):
    model = _hf_dinov2(layers=4)
    from attnpatch.patchers.registry import get_method, validate_options

    assert validate_options(get_method("fna"), {"preset": "fast"})["min_tokens"] == 2048
    with patched(model, "fna", preset="fast", s=6, min_tokens=0), record_stats(model) as rec:
        _run(model, X)
    assert [rec.forwards[0][i].mode for i in range(4)] == ["fna+window", "fna+window", "fna", "fna"]
    with patched(model, "fna", preset="every-layer", s=6, min_tokens=0), record_stats(model) as rec:
        _run(model, X)
    assert {r.mode for r in rec.forwards[0].values()} == {"fna+window"}
    ref = _run(model, X)
    monkeypatch.setenv("ATTNPATCH_FNA_BREAK_EVEN", "27")
    with patched(model, "fna", preset="accurate"), record_stats(model) as rec:  # 26 tokens: below the break-even
        assert torch.equal(_run(model, X), ref)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:short"}
    with pytest.raises(OptionError, match="window_until"):
        patch(model, "fna", window_until="half")
