"""``tome``: ToMe token merging against a transcription of ToMe's own code, and its block hooks in every adapter."""

from __future__ import annotations

import math

import pytest
import torch

import attnpatch
from attnpatch import OptionError, UnsupportedModelError, patch, patched, token_sizes, unpatch
from attnpatch.attention.merge import bipartite_merge, proportional_attention
from attnpatch.patchers.bench_hook import BenchInputs
from attnpatch.patchers.registry import get_method

timm = pytest.importorskip("timm")


# --------------------------------------------------------------------------- ToMe's code, transcribed (float64 here)


def _tome_matching(metric, r, class_token):
    """ToMe's ``bipartite_soft_matching`` (facebookresearch/ToMe, tome/merge.py), in float64."""
    protected = 1 if class_token else 0
    t = metric.shape[1]
    r = min(r, (t - protected) // 2)
    if r <= 0:
        return None
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a, b = metric[..., ::2, :], metric[..., 1::2, :]
    scores = a @ b.transpose(-1, -2)
    if class_token:
        scores[..., 0, :] = -math.inf
    node_max, node_idx = scores.max(dim=-1)
    edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
    unm_idx = edge_idx[..., r:, :]
    src_idx = edge_idx[..., :r, :]
    dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
    unm_idx = unm_idx.sort(dim=1)[0]  # ToMe sorts with a class token; this project keeps position order always

    def merge(x, mode):
        src, dst = x[..., ::2, :], x[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)
        return torch.cat([unm, dst], dim=1)

    return merge


def _tome_wavg(merge, x, size):
    """ToMe's ``merge_wavg``."""
    if merge is None:
        return x, size
    x = merge(x * size, "sum")
    size = merge(size, "sum")
    return x / size, size


def _slow_merge(x, size, metric, r, prefix):
    """The merge by explicit loops over tokens (float64), for any number of protected prefix tokens."""
    out_x, out_s = [], []
    for bi in range(x.shape[0]):
        n = x.shape[1]
        a = [i for i in range(prefix, n) if i % 2 == 0]
        b = [i for i in range(prefix, n) if i % 2 == 1]
        rr = min(r, (n - prefix) // 2)
        m = metric[bi] / metric[bi].norm(dim=-1, keepdim=True)
        best = {i: max(b, key=lambda j: float(m[i] @ m[j])) for i in a}
        score = {i: float(m[i] @ m[best[i]]) for i in a}
        merged = sorted(a, key=lambda i: -score[i])[:rr]
        xs = {i: x[bi, i] * size[bi, i] for i in range(n)}
        ss = {i: size[bi, i].clone() for i in range(n)}
        for i in merged:
            xs[best[i]] = xs[best[i]] + xs[i]
            ss[best[i]] = ss[best[i]] + ss[i]
        order = list(range(prefix)) + [i for i in a if i not in merged] + b
        out_x.append(torch.stack([xs[i] / ss[i] for i in order]))
        out_s.append(torch.stack([ss[i] for i in order]))
    return torch.stack(out_x), torch.stack(out_s)


@pytest.mark.parametrize("n,r", [(17, 3), (50, 8), (51, 25), (51, 100), (9, 0)])
def test_merge_matches_tomes_own_code_with_a_class_token(n, r):
    g = torch.Generator().manual_seed(n * 7 + r)
    x = torch.randn(3, n, 12, generator=g, dtype=torch.float64)
    metric = torch.randn(3, n, 8, generator=g, dtype=torch.float64)
    size = torch.randint(1, 5, (3, n), generator=g).double()
    got_x, got_s = bipartite_merge(x, size, metric, r, prefix=1)
    ref_x, ref_s = _tome_wavg(_tome_matching(metric, r, class_token=True), x, size[..., None])
    assert got_x.shape == ref_x.shape == (3, n - min(r, (n - 1) // 2), 12)
    torch.testing.assert_close(got_x, ref_x, rtol=1e-6, atol=1e-6)  # float32 sums inside: 1e-6
    torch.testing.assert_close(got_s.double(), ref_s[..., 0])
    assert torch.equal(got_x[:, 0], x[:, 0])  # the class token stays first, untouched


@pytest.mark.parametrize("prefix", [0, 2, 5])
def test_merge_matches_the_slow_loop_for_any_prefix(prefix):
    g = torch.Generator().manual_seed(prefix)
    n, r = 31, 6
    x = torch.randn(2, n, 5, generator=g, dtype=torch.float64)
    metric = torch.randn(2, n, 4, generator=g, dtype=torch.float64)
    size = torch.randint(1, 4, (2, n), generator=g).double()
    got_x, got_s = bipartite_merge(x, size, metric, r, prefix=prefix)
    ref_x, ref_s = _slow_merge(x, size, metric, r, prefix)
    torch.testing.assert_close(got_x, ref_x, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_s.double(), ref_s)
    assert torch.equal(got_x[:, :prefix], x[:, :prefix])  # CLS and registers: never merged, never merged into
    torch.testing.assert_close(got_s.sum(1).double(), size.sum(1))  # sizes are conserved


def test_proportional_attention_is_softmax_with_log_size_bias():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=g) for _ in range(3))
    size = torch.randint(1, 6, (2, 10), generator=g).float()
    got = proportional_attention(q, k, v, size, scale=0.3)
    logits = q.double() @ k.double().transpose(-1, -2) * 0.3 + size.double().log()[:, None, None, :]
    ref = logits.softmax(-1) @ v.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # a token of size s weighs as s identical tokens: duplicate key 0 three times and give it size 1 each
    k3, v3 = torch.cat([k[:, :, :1]] * 2 + [k], 2), torch.cat([v[:, :, :1]] * 2 + [v], 2)
    ones = torch.ones(2, 12)
    s3 = torch.ones(2, 10)
    s3[:, 0] = 3
    torch.testing.assert_close(proportional_attention(q, k, v, s3, scale=0.3), proportional_attention(q, k3, v3, ones, scale=0.3), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- end to end against ToMe's forward


def _timm_vit(**kw):
    from tiny_models import timm_vit_tiny

    return timm_vit_tiny(depth=3, **kw)


def _tome_timm_reference(model, x, r):
    """ToMe's timm forward (tome/patch/timm.py: ToMeBlock + ToMeAttention), written out in float64."""
    model = model.double()
    x = model.patch_embed(x.double())
    x = model.norm_pre(model.patch_drop(model._pos_embed(x)))
    size = torch.ones(x.shape[0], x.shape[1], 1, dtype=torch.float64)
    for blk in model.blocks:
        a = blk.attn
        h = blk.norm1(x)
        b, n, c = h.shape
        qkv = a.qkv(h).reshape(b, n, 3, a.num_heads, c // a.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = a.q_norm(q), a.k_norm(k)
        logits = (q * a.scale) @ k.transpose(-2, -1) + size.log()[:, None, None, :, 0]
        out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)
        x = x + blk.ls1(a.proj(a.norm(out)))
        x, size = _tome_wavg(_tome_matching(k.mean(1), r, class_token=True), x, size)
        x = x + blk.ls2(blk.mlp(blk.norm2(x)))
    out = model.norm(x)
    model.float()
    return out, size[..., 0]


@pytest.mark.parametrize("r", [1, 3])
def test_timm_vit_equals_tomes_own_forward(r):
    model = _timm_vit()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(r))
    with torch.no_grad():
        with patched(model, "tome", r=r):
            got = model.forward_features(x)
            sizes = token_sizes(model)
        ref, ref_sizes = _tome_timm_reference(model, x, r)
    assert got.shape == ref.shape and got.shape[1] < 17
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sizes.double(), ref_sizes)
    assert sizes.sum(1).tolist() == [17.0, 17.0]


def _hf_dinov2(registers=0):
    from tiny_models import NARROW_DINOV2, tiny_dinov2

    return tiny_dinov2(registers, **NARROW_DINOV2, num_hidden_layers=3, image_size=56)


def _open_clip_vit():
    open_clip = pytest.importorskip("open_clip")
    from open_clip.transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(image_size=64, patch_size=16, width=32, layers=3, heads=2, mlp_ratio=2.0, output_dim=16).eval()


MODELS = {
    "timm": (lambda: _timm_vit(), lambda m, x: m.forward_features(x), 64, 1),
    "dinov2": (lambda: _hf_dinov2(), lambda m, x: m(pixel_values=x).last_hidden_state, 56, 1),
    "dinov2_registers": (lambda: _hf_dinov2(2), lambda m, x: m(pixel_values=x).last_hidden_state, 56, 3),
    "open_clip": (_open_clip_vit, lambda m, x: m(x), 64, 1),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_adapter_merges_keeps_the_prefix_and_restores(name):
    make, run, res, prefix = MODELS[name]
    model = make()
    x = torch.randn(2, 3, res, res, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = run(model, x)
        with patched(model, "tome", r=0):
            exact = run(model, x)
            assert token_sizes(model) is None
        torch.testing.assert_close(exact, ref, rtol=1e-5, atol=1e-5)
        patch(model, "tome", r=2)
        merged = run(model, x)
        sizes = token_sizes(model)
        unpatch(model)
        assert torch.equal(run(model, x), ref)  # bit for bit after unpatch
    if name != "open_clip":  # open_clip's tower returns the pooled class token
        n = ref.shape[1]
        assert merged.shape == (2, n - 2 * 3, ref.shape[2])  # three blocks, r = 2 each
        assert sizes.shape == merged.shape[:2]
        assert sizes[:, :prefix].eq(1).all() and sizes.sum(1).tolist() == [float(n)] * 2
    rel = float((merged[:, 0] - ref[:, 0]).norm() / ref[:, 0].norm()) if merged.dim() == 3 else float((merged - ref).norm() / ref.norm())
    assert 0 < rel < 1.0  # approximated, not garbage


def test_hf_clip_vision_tower_merges_and_text_tower_is_untouched():
    from tiny_models import tiny_hf_clip

    model = tiny_hf_clip(vision=dict(num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=16),
                         text=dict(num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1))
    x = torch.randn(2, 3, 64, 64)
    ids = torch.randint(2, 100, (2, 7))
    with torch.no_grad():
        ref_v = model.vision_model(pixel_values=x).last_hidden_state
        ref_t = model.text_model(input_ids=ids).last_hidden_state
        with patched(model, "tome", r=3):
            v = model.vision_model(pixel_values=x).last_hidden_state
            t = model.text_model(input_ids=ids).last_hidden_state
    assert v.shape[1] == ref_v.shape[1] - 6
    assert torch.equal(t, ref_t)


def test_weighted_patch_mean_uses_the_sizes():
    from attnpatch.evals.vision.runner import encode

    model = _hf_dinov2()
    x = torch.randn(2, 3, 56, 56)
    with patched(model, "tome", r=4):
        cls, pm = encode(model, x)
        with torch.no_grad():
            h = model(pixel_values=x).last_hidden_state
        s = token_sizes(model)
    w = s[:, 1:, None]
    torch.testing.assert_close(pm, (h[:, 1:] * w).sum(1) / w.sum(1))
    assert not torch.allclose(pm, h[:, 1:].mean(1))  # the unweighted mean differs: the weights matter


# --------------------------------------------------------------------------- refusals and options


def test_refuses_pooled_readouts_and_unknown_blocks():
    with pytest.raises(UnsupportedModelError, match=r"global_pool='avg'.*class token"):
        patch(_timm_vit(global_pool="avg"), "tome")
    from tiny_models import NARROW_DINOV2, dinov2_config
    from transformers import Dinov2ForImageClassification

    clf = Dinov2ForImageClassification(dinov2_config(**NARROW_DINOV2, num_hidden_layers=2, image_size=56))
    with pytest.raises(UnsupportedModelError, match="Dinov2ForImageClassification is not one known"):
        patch(clf, "tome")
    assert not attnpatch.is_patched(clf)
    model = _timm_vit()
    from timm.models.vision_transformer import ResPostBlock

    model.blocks[1] = ResPostBlock(192, 3)
    with pytest.raises(UnsupportedModelError, match=r"ResPostBlock.*supported blocks: Block"):
        patch(model, "tome")
    assert not attnpatch.is_patched(model)


def test_options_and_kinds():
    with pytest.raises(OptionError, match="r"):
        patch(_timm_vit(), "tome", r=-1)
    from tiny_models import tiny_causal_lm

    lm = tiny_causal_lm("llama", seed=None, layers=1, vocab=50, sharpen=1.0, hidden_size=32, intermediate_size=64,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048, attn_implementation=None)
    with pytest.raises(UnsupportedModelError, match="fits model kinds"):
        patch(lm, "tome")


def test_bench_hook_times_attention_and_merge():
    m = get_method("tome")
    q, k, v = (torch.randn(1, 3, 65, 16) for _ in range(3))
    case = m.bench(m.make_config({"r": 8, "proportional": True}), q, k, v, BenchInputs(scale=0.25, causal=False))
    out, merged = case.call()
    assert out.shape == q.shape and merged.shape == (1, 57, 48)
    assert set(case.parts) == {"attention", "merge"}


def test_record_stats_counts_pairs_against_the_input_tokens():
    model = _hf_dinov2()
    x = torch.randn(1, 3, 56, 56)
    with patched(model, "tome", r=4), attnpatch.record_stats(model) as rec, torch.no_grad():
        model(pixel_values=x)
    recs = rec.forwards[0]
    assert [recs[i].queries for i in sorted(recs)] == [17, 13, 9]
    assert float(recs[2].kept_pairs[0, 0]) == 81 and float(recs[2].causal_pairs[0, 0]) == 17 * 17


def test_grid_readouts_are_refused_while_merged_and_restored_after():
    model = _timm_vit()
    x = torch.randn(1, 3, 64, 64)
    ref = model.forward_intermediates(x, indices=[2], intermediates_only=True)[0]
    with patched(model, "tome", r=2):
        with pytest.raises(UnsupportedModelError, match="forward_intermediates reshapes the output tokens into the patch grid"):
            model.forward_intermediates(x, indices=[2], intermediates_only=True)
    assert "forward_intermediates" not in model.__dict__
    assert torch.equal(model.forward_intermediates(x, indices=[2], intermediates_only=True)[0], ref)
    oc = _open_clip_vit()
    with patched(oc, "tome", r=2), pytest.raises(UnsupportedModelError, match="forward_intermediates"):
        oc.forward_intermediates(x)


def test_open_clip_every_token_readout_is_accepted():
    oc = _open_clip_vit()
    oc.pool_type = "none"
    x = torch.randn(2, 3, 64, 64)
    with patched(oc, "tome", r=2), torch.no_grad():
        out = oc(x)
        sizes = token_sizes(oc)
    assert sizes is not None and sizes.sum(1).tolist() == [17.0, 17.0]
    assert out.shape[1] == sizes.shape[1]


def test_fidelity_reports_no_layer_errors_for_merged_tokens():
    """Layer errors compare a layer's output with dense's on the same tokens; merged tokens have no such
    counterpart, so a tome row has none (not the log(size) term alone, not 0)."""
    from attnpatch.evals.vision.runner import run_feature_eval
    from PIL import Image

    class Images:
        labels = [0, 0, 1, 1]

        def __len__(self):
            return 4

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return Image.fromarray((torch.rand(56, 56, 3, generator=g) * 255).byte().numpy()), self.labels[i]

    def pre(imgs):
        import numpy as np

        return torch.stack([torch.from_numpy(np.asarray(im, dtype=np.float32) / 255).permute(2, 0, 1) for im in imgs])

    res = run_feature_eval(_hf_dinov2(), Images(), pre, settings=[("tome", {"r": 2})], tasks=["fidelity"], batch_size=2,
                           compute_metrics=False, warmup=False)
    row = res["runs"][0]
    assert row["layer_error_teacher"] == [] and row["mean_layer_error_teacher"] is None and row["mean_layer_error_free"] is None
    assert 0.5 < row["cls_cosine"] < 1.0
