"""``tome+fna`` (token merging, then Nyström attention with ToMe's size bias) and per-layer schedules of ``r`` and ``s``."""

from __future__ import annotations

import pytest
import torch

from attnpatch import OptionError, patch, patched, record_stats, token_source, unpatch
from attnpatch.attention.exact import exact_attention
from attnpatch.attention.landmarks import farthest_point_sampling
from attnpatch.attention.merge import proportional_attention
from attnpatch.attention.nystrom import nystrom_attention
from attnpatch.options import parse_schedule

# --------------------------------------------------------------------------- the math: the size bias in Nyström form


def _qkv(b=2, h=3, n=20, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3)]


def _sizes(b=2, n=20, seed=1):
    return torch.randint(1, 6, (b, n), generator=torch.Generator().manual_seed(seed)).double()


def test_biased_nystrom_with_every_token_a_landmark_is_proportional_attention():
    q, k, v = _qkv()
    size = _sizes()
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(2)).expand(2, 20)
    got = nystrom_attention(q, k, v, perm, scale=0.4, pinv="exact", key_bias=size.log())
    # float64 through the pseudo-inverse of a 20 x 20 softmax kernel (condition number ~1e7)
    torch.testing.assert_close(got, proportional_attention(q, k, v, size, scale=0.4), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(exact_attention(q, k, v, scale=0.4, key_bias=size.log()),
                               proportional_attention(q, k, v, size, scale=0.4), rtol=1e-12, atol=1e-12)


def test_biased_nystrom_equals_the_three_factors_written_out():
    q, k, v = _qkv()
    size = _sizes()
    lm = torch.tensor([[0, 3, 7, 11, 19], [0, 1, 2, 15, 16]])
    b = size.log()
    c = 0.4
    idx = lm[:, None, :, None].expand(-1, 3, -1, 8)
    ql, kl = q.gather(2, idx), k.gather(2, idx)
    bl = b.gather(1, lm)[:, None, None, :]
    f = torch.softmax(q @ kl.transpose(-1, -2) * c + bl, -1)
    a = torch.softmax(ql @ kl.transpose(-1, -2) * c + bl, -1)
    bb = torch.softmax(ql @ k.transpose(-1, -2) * c + b[:, None, None, :], -1)
    ref = f @ torch.linalg.pinv(a) @ bb @ v
    got = nystrom_attention(q, k, v, lm, scale=c, pinv="exact", key_bias=b)
    torch.testing.assert_close(got, ref, rtol=1e-8, atol=1e-8)
    # a zero bias is no bias; the bias changes the answer
    torch.testing.assert_close(nystrom_attention(q, k, v, lm, scale=c, key_bias=torch.zeros_like(b)),
                               nystrom_attention(q, k, v, lm, scale=c), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(nystrom_attention(q, k, v, lm, scale=c, key_bias=b), nystrom_attention(q, k, v, lm, scale=c))


def test_biased_nystrom_in_float32_and_bfloat16_follows_float64():
    q, k, v = _qkv()
    b = _sizes().log()
    lm = torch.tensor([[0, 3, 7, 11, 19], [0, 1, 2, 15, 16]])
    # (pinv="rtol" is left out: its cut-off can fall on a singular value that float32 and float64 place on
    # either side of it, with or without the bias)
    for pinv in ("exact", "newton"):
        ref = nystrom_attention(q, k, v, lm, scale=0.4, key_bias=b, pinv=pinv)
        plain = nystrom_attention(q, k, v, lm, scale=0.4, pinv=pinv)
        for dtype in (torch.float32, torch.bfloat16):
            got = nystrom_attention(q.to(dtype), k.to(dtype), v.to(dtype), lm, scale=0.4, key_bias=b.to(dtype), pinv=pinv)
            unbiased = nystrom_attention(q.to(dtype), k.to(dtype), v.to(dtype), lm, scale=0.4, pinv=pinv)
            # the bias costs no precision: its error from float64 is within twice the unbiased layer's
            err, err0 = (got.double() - ref).abs().max(), (unbiased.double() - plain).abs().max()
            assert err <= 2 * err0 + 1e-6, (pinv, dtype, err, err0)


# --------------------------------------------------------------------------- the model: exact limits and landmarks


def _dinov2(layers=4):
    from tiny_models import tiny_dinov2

    return tiny_dinov2(0, seed=0, num_hidden_layers=layers)


def _timm_vit():
    from tiny_models import tiny_timm_vit

    return tiny_timm_vit(seed=0, img_size=70, patch_size=14, depth=4, init_values=1.0)


MODELS = [pytest.param(_dinov2, id="hf-dinov2"), pytest.param(_timm_vit, id="timm-vit")]
X = torch.randn(3, 3, 70, 70, generator=torch.Generator().manual_seed(1))  # 25 patches + CLS = 26 tokens
N = 26


def _run(model, x=X):
    with torch.no_grad():
        if hasattr(model, "forward_features"):
            return model.forward_features(x)
        return model(pixel_values=x).last_hidden_state


@pytest.mark.parametrize("make", MODELS)
def test_at_fnas_exact_limit_the_composition_is_tome(make):
    model = make()
    with patched(model, "tome", r=3):
        ref = _run(model)
    with patched(model, "tome+fna", r=3, s=N, sample_layer=0, min_tokens=0):
        got = _run(model)
    assert got.shape == ref.shape == (3, N - 4 * 3, ref.shape[-1])
    assert torch.equal(got, ref)
    # and it approximates below that limit (the same merges' sizes, Nyström attention on the merged tokens)
    with patched(model, "tome+fna", r=3, s=6, sample_layer=0, min_tokens=0), record_stats(model) as rec:
        approx = _run(model)
    assert [rec.forwards[0][i].mode for i in range(4)] == ["tome+fna"] * 4
    assert not torch.allclose(approx, ref, atol=1e-4)


@pytest.mark.parametrize("make", MODELS)
def test_at_r_zero_the_composition_is_fna(make):
    model = make()
    with patched(model, "fna", s=6, sample_layer=1, min_tokens=0):
        ref = _run(model)
    with patched(model, "tome+fna", r=0, s=6, sample_layer=1, min_tokens=0):
        got = _run(model)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("make", MODELS)
def test_at_both_limits_the_composition_is_the_unpatched_model(make):
    model = make()
    ref = _run(model)
    with patched(model, "tome+fna", r=0, s=N, sample_layer=0, min_tokens=0):
        got = _run(model)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(_run(model), ref)  # restored


def test_landmarks_follow_the_merges_through_the_source_map():
    model = _dinov2()
    # the last block merges nothing, so the source map after the forward is the one the last block's attention saw
    with patched(model, "tome+fna", r="3/3/3/0", s=6, sample_layer=0, min_tokens=0), record_stats(model) as rec:
        _run(model)
        source = token_source(model)
    lay = rec.forwards[0]
    first, last = lay[0].landmarks, lay[3].landmarks
    assert first.shape == last.shape == (3, 6)
    assert first[:, 0].tolist() == [0, 0, 0]  # CLS, never merged
    assert torch.equal(last, source.gather(1, first))
    # merged tokens: some landmark ends inside another one's token in this seed, which the pinv takes
    assert lay[3].queries == N - 9
    # resample=True samples again on each block's merged tokens: distinct landmarks per image
    with patched(model, "tome+fna", r="3/3/3/0", s=6, sample_layer=0, min_tokens=0, resample=True), \
            record_stats(model) as rec:
        _run(model)
    last = rec.forwards[0][3].landmarks
    assert all(len(set(row)) == 6 for row in last.tolist())


def test_blocks_below_min_tokens_run_tomes_exact_attention():
    model = _dinov2()
    # 26 tokens, then 20, 14, 8: FNA only while N >= 15
    with patched(model, "tome+fna", r=6, s=4, sample_layer=0, min_tokens=15), record_stats(model) as rec:
        _run(model)
    assert [rec.forwards[0][i].mode for i in range(4)] == ["tome+fna", "tome+fna", "tome", "tome"]


def test_composition_refuses_the_local_window_and_joins_both_option_sets():
    model = _dinov2()
    with pytest.raises(OptionError, match="local_window=1: tome\\+fna"):
        patch(model, "tome+fna", local_window=1)
    with pytest.raises(OptionError, match="r=-1"):
        patch(model, "tome+fna", r=-1)
    with pytest.raises(OptionError, match="s=0"):
        patch(model, "tome+fna", s=0)


# --------------------------------------------------------------------------- schedules


def test_schedule_strings_lists_and_integers():
    assert parse_schedule("0*4/16*8") == (0,) * 4 + (16,) * 8
    assert parse_schedule("8") == 8
    assert parse_schedule("8/8") == (8, 8)
    assert parse_schedule("[0, 8]") == (0, 8)
    assert parse_schedule([0, 8]) == (0, 8)
    assert parse_schedule(5) == 5
    for bad in ("a", "8*0", "", True, [1.5], "8,", "/8", "0*4/", "8//8"):
        with pytest.raises((TypeError, ValueError)):
            parse_schedule(bad)


@pytest.mark.parametrize("make", MODELS)
def test_a_constant_schedule_is_the_scalar(make):
    model = make()
    for method, opts, sched in (("tome", dict(r=3), dict(r="3*4")), ("fna", dict(s=6), dict(s=[6, 6, 6, 6])),
                                ("tome+fna", dict(r=2, s=6), dict(r="2/2/2/2", s="6*4"))):
        with patched(model, method, sample_layer=0, min_tokens=0, **opts) if method != "tome" else patched(model, method, **opts):
            ref = _run(model)
        with patched(model, method, sample_layer=0, min_tokens=0, **sched) if method != "tome" else patched(model, method, **sched):
            got = _run(model)
        assert torch.equal(got, ref), method


@pytest.mark.parametrize("make", MODELS)
def test_zero_schedules_are_the_unpatched_model(make):
    model = make()
    ref = _run(model)
    for method, opts in (("tome", dict(r="0*4")), ("fna", dict(s="0*4", sample_layer=0, min_tokens=0)),
                         ("tome+fna", dict(r=[0] * 4, s=[0] * 4, min_tokens=0))):
        with patched(model, method, **opts):
            got = _run(model)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=method)


def test_per_layer_r_merges_what_each_block_says():
    model = _dinov2()
    with patched(model, "tome", r="0/5/0/2"), record_stats(model) as rec:
        out = _run(model)
    assert [rec.forwards[0][i].queries for i in range(4)] == [26, 26, 21, 21]
    assert out.shape[1] == 19


def test_per_layer_s_uses_the_first_landmarks_of_one_fps_sample():
    model = _dinov2()
    with patched(model, "fna", s="0/8/4/8", sample_layer=0, min_tokens=0), record_stats(model) as rec:
        _run(model)
    lay = rec.forwards[0]
    assert lay[0].mode == "dense:schedule" and lay[0].landmarks is None
    assert lay[1].landmarks.shape == (3, 8) and torch.equal(lay[2].landmarks, lay[1].landmarks[:, :4])
    assert torch.equal(lay[3].landmarks, lay[1].landmarks)
    # the first 4 of an FPS sample of 8 are the FPS sample of 4 (FPS is greedy)
    feats = torch.randn(3, 26, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(farthest_point_sampling(feats, 8, 1)[:, :4], farthest_point_sampling(feats, 4, 1))


def test_schedules_are_checked_against_the_model_before_any_forward():
    model = _dinov2()
    with pytest.raises(OptionError, match=r"r=\[1, 2\]: a per-block schedule needs one entry per attention layer; the model has 4"):
        patch(model, "tome", r=[1, 2])
    with pytest.raises(OptionError, match=r"s=\[8, 8, 8\]: a per-layer schedule needs one entry per attention layer"):
        patch(model, "fna", s="8/8/8")
    with pytest.raises(OptionError, match="strategy='random'"):
        patch(model, "fna", s="8/8/4/4", strategy="random")
    with pytest.raises(OptionError, match=r"r=\[0, 0, -2, 0\]: must be an integer >= 0"):
        patch(model, "tome", r="0/0/-2/0")
    with pytest.raises(OptionError, match="option s='8/x'"):
        patch(model, "fna", s="8/x")
    # one s for every approximated layer is fine with any strategy; 0 leaves a layer exact
    patch(model, "fna", s="0/0/8/8", strategy="random")
    unpatch(model)


def test_a_schedule_saved_in_a_config_file_loads(tmp_path):
    from attnpatch import model_geometry, write_config

    model = _dinov2()
    opts = dict(r=[0, 3, 3, 2], s="0/8/8/6", sample_layer=0, min_tokens=0)
    with patched(model, "tome+fna", **opts):
        ref = _run(model)
    path = write_config(tmp_path / "sched.json", "tome+fna", opts, model_geometry(model))
    with patched(model, "tome+fna", config=str(path)):
        assert torch.equal(_run(model), ref)
    with patched(model, "tome+fna", config=str(path), r="0*4"):  # an option given beside the file wins
        assert not torch.equal(_run(model), ref)


def test_the_composition_at_its_exact_setting_everywhere_is_the_unpatched_model():
    from attnpatch.patchers.registry import get_method

    model = _dinov2()
    ref = _run(model)
    every = get_method("tome+fna").exact_everywhere()
    assert every["r"] == 0
    with patched(model, "tome+fna", **every):
        torch.testing.assert_close(_run(model), ref, rtol=1e-5, atol=1e-5)


def test_landmarks_sampled_after_merges_fit_the_tokens_left():
    """s=60 on a later layer of 65 tokens: sampling happens after merges shrank the tokens below 60; the landmarks
    kept are the first of the sample (a smaller FPS sample), and layers whose s reaches N run exact."""
    from tiny_models import tiny_dinov2

    model = tiny_dinov2(0, seed=0, num_hidden_layers=4, image_size=112)
    x = torch.randn(2, 3, 112, 112, generator=torch.Generator().manual_seed(3))
    for opts in (dict(r=8, s=[8, 0, 8, 60], sample_layer=2), dict(r=8, s=[8, 8, 8, 60], resample=True),
                 dict(r=[0, 8, 8, 8], s=[60, 8, 8, 8], resample=True)):
        with patched(model, "tome+fna", min_tokens=0, **opts), record_stats(model) as rec:
            out = _run(model, x)
        assert torch.isfinite(out).all()
        lay = rec.forwards[0]
        for i in range(4):
            if lay[i].landmarks is not None:
                assert lay[i].landmarks.shape[1] == opts["s"][i] < lay[i].queries


def test_exact_layers_of_token_merging_are_recorded_as_exact():
    model = _dinov2()
    for method, opts in (("tome", dict(r=0)), ("tome+fna", dict(r=0, s="0*4")),
                         ("tome+fna", dict(r=[0] * 4, s=26, min_tokens=0))):
        with patched(model, method, **opts), record_stats(model) as rec:
            _run(model)
        assert all(rec.forwards[0][i].mode.startswith("dense:") for i in range(4)), (method, opts)
    with patched(model, "tome", r="0/2/0/0"), record_stats(model) as rec:
        _run(model)
    assert [rec.forwards[0][i].mode for i in range(4)] == ["dense:r=0", "tome", "tome", "tome"]


def test_a_schedule_entry_below_the_prefix_tokens_is_refused_in_one_line():
    from tiny_models import tiny_dinov2

    model = tiny_dinov2(4, seed=0, num_hidden_layers=4)  # 4 registers + CLS
    for method in ("fna", "tome+fna"):
        with patched(model, method, s="0/0/3/8", min_tokens=0):
            with pytest.raises(OptionError, match=r"s=3 at layer 2: below this model's 5 prefix tokens"):
                _run(model)


def test_write_config_refuses_what_patch_would_refuse_on_that_model(tmp_path):
    from attnpatch import model_geometry, write_config

    geo = model_geometry(_dinov2())
    with pytest.raises(OptionError, match="one entry per attention layer"):
        write_config(tmp_path / "a.json", "tome+fna", dict(r="2/2", s=8), geo)
    with pytest.raises(OptionError, match="sample_layer=9"):
        write_config(tmp_path / "b.json", "tome+fna", dict(r=2, s=8, sample_layer=9), geo)
    assert not (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()
