"""patch()/unpatch() on Hugging Face causal LMs: exactness, restore, padding, GQA, errors."""

import math

import pytest
import torch

import attnpatch
from attnpatch import (
    OptionError, PatchStateError, UnknownMethodError, UnsupportedModelError, is_patched, list_methods, patch,
    patch_info, patched, record_stats, unpatch,
)
from attnpatch.evals.recall import attention_recall

from conftest import tiny_causal_lm

SMALL = dict(block_size=16, init_block=8, local_window=16, min_len=0, dense_last=0, min_recall=0)


def _ids(b=2, n=150, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    if b > 1:
        mask[1, :23] = 0  # left padding
    return ids, mask


@torch.no_grad()
def test_theta_inf_matches_dense_prefill_and_generate(causal_lm):
    ids, mask = _ids()
    ref = causal_lm(ids, attention_mask=mask).logits
    gen_ref = causal_lm.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with patched(causal_lm, "anchor_attention", theta=math.inf, **SMALL):
        out = causal_lm(ids, attention_mask=mask).logits
        gen = causal_lm.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    valid = mask.bool()
    assert torch.allclose(out[valid], ref[valid], atol=1e-5, rtol=1e-5)
    assert torch.equal(gen.sequences, gen_ref.sequences)
    assert len(gen.scores) == len(gen_ref.scores) == 6
    for a, b in zip(gen.scores, gen_ref.scores, strict=True):
        assert torch.allclose(a, b, atol=1e-4)


@torch.no_grad()
def test_unpatch_restores_bit_for_bit(causal_lm):
    ids, mask = _ids()
    ref = causal_lm(ids, attention_mask=mask).logits
    impl = causal_lm.config._attn_implementation
    patch(causal_lm, "anchor_attention", theta=1.0, **SMALL)
    assert is_patched(causal_lm)
    sparse = causal_lm(ids, attention_mask=mask).logits
    assert not torch.allclose(sparse[mask.bool()], ref[mask.bool()], atol=1e-3)  # the patch did something
    unpatch(causal_lm)
    assert not is_patched(causal_lm)
    assert causal_lm.config._attn_implementation == impl
    assert torch.equal(causal_lm(ids, attention_mask=mask).logits, ref)


@torch.no_grad()
def test_theta_minus_inf_attends_initial_block_and_window_only():
    model = tiny_causal_lm("llama")
    n = 96
    ids, _ = _ids(1, n)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    end = (i // 16 + 1) * 16
    explicit = ((j < 8) | (j >= end - 16)) & (j <= i)  # initial block 8, window 16 ending at the block end
    ref = model(ids, attention_mask=explicit[None, None]).logits  # a prepared 4D mask is used as is
    with patched(model, "anchor_attention", theta=-math.inf, **SMALL):
        out = model(ids).logits
    assert torch.allclose(out, ref, atol=1e-5)


@torch.no_grad()
def test_left_padded_batch_equals_sequences_alone(causal_lm):
    ids, mask = _ids()
    with patched(causal_lm, "anchor_attention", theta=1.0, **SMALL):
        both = causal_lm(ids, attention_mask=mask).logits
        alone0 = causal_lm(ids[:1]).logits
        alone1 = causal_lm(ids[1:, 23:]).logits
    assert torch.allclose(both[0], alone0[0], atol=1e-4)
    assert torch.allclose(both[1, 23:], alone1[0], atol=1e-4)


@torch.no_grad()
def test_decode_steps_run_dense_and_stats_recorded():
    model = tiny_causal_lm("qwen2")
    ids, _ = _ids(1, 120)
    with patched(model, "anchor_attention", theta=0.5, **SMALL):
        with record_stats(model) as rec:
            model.generate(ids, max_new_tokens=3, do_sample=False)
    prefill, *decode = rec.forwards
    assert len(decode) == 2
    assert {r.mode for r in prefill.values()} == {"sparse"}
    assert all(r.mode == "dense:decode" and r.queries == 1 for f in decode for r in f.values())
    sp = torch.stack([r.sparsity for r in prefill.values()])
    assert float(sp.min()) > 0.05 and float(sp.max()) < 1.0
    for r in prefill.values():
        assert r.kept_columns.shape == (1, 4, 8)  # 120 queries / block 16 -> 8 blocks


@torch.no_grad()
def test_min_len_dense_layers_and_recall():
    model = tiny_causal_lm("llama", layers=3)
    ids, _ = _ids(1, 100)
    with patched(model, "anchor_attention", theta=0.5, **{**SMALL, "min_len": 101}):
        with record_stats(model) as rec:
            model(ids)
        assert {r.mode for r in rec.forwards[0].values()} == {"dense:short"}
    with patched(model, "anchor_attention", theta=0.5, dense_layers=[1], dense_heads=[(2, 3)], **SMALL):
        rep = attention_recall(model, ids)
    modes = [p["mode"] for p in rep["per_layer"]]
    assert modes == ["sparse", "dense:layer", "sparse"]
    assert rep["per_layer"][1]["recall"] == [1.0] * 4
    assert rep["per_layer"][2]["recall"][3] == pytest.approx(1.0)
    assert 0.0 < rep["recall_worst"] <= rep["recall_mean"] < 1.0
    assert 0.0 < rep["sparsity"] < 1.0
    assert len(rep["worst_heads"]) == 1  # 5 % of 12 layer-heads, at least one


def test_two_models_patched_side_by_side_do_not_interfere():
    a, b = tiny_causal_lm("llama", seed=0), tiny_causal_lm("llama", seed=1)
    ids, _ = _ids(1, 80)
    with torch.no_grad():
        ref_b = b(ids).logits
        patch(a, "anchor_attention", theta=-math.inf, **SMALL)
        patch(b, "anchor_attention", theta=math.inf, **SMALL)
        a(ids)
        out_b = b(ids).logits
        unpatch(a)
        unpatch(b)
    assert torch.allclose(out_b, ref_b, atol=1e-5)


def test_errors_are_clear():
    model = tiny_causal_lm("llama")
    with pytest.raises(UnknownMethodError, match="'nope'.*anchor_attention"):
        patch(model, "nope")
    with pytest.raises(OptionError, match="unknown option.*thetta.*allowed: theta"):
        patch(model, "anchor_attention", thetta=3)
    with pytest.raises(OptionError, match="theta='x'"):
        patch(model, "anchor_attention", theta="x")
    with pytest.raises(OptionError, match="block_size=None.*expected an integer"):
        patch(model, "anchor_attention", block_size=None)  # not nullable
    with pytest.raises(OptionError, match="block_size=0"):
        patch(model, "anchor_attention", block_size=0)
    with pytest.raises(OptionError, match="dense_layers contains 7"):
        patch(model, "anchor_attention", dense_layers=[7])
    with pytest.raises(PatchStateError, match="not patched"):
        unpatch(model)
    patch(model, "anchor_attention")
    with pytest.raises(PatchStateError, match="already patched with 'anchor_attention'"):
        patch(model, "dense")
    unpatch(model)
    assert not is_patched(model)
    with pytest.raises(UnsupportedModelError, match="cannot patch a torch.nn.modules.linear.Linear"):
        patch(torch.nn.Linear(2, 2), "anchor_attention")


def test_causal_only_method_refuses_vision_encoder():
    from tiny_models import NARROW_DINOV2, tiny_dinov2

    vit = tiny_dinov2(seed=None, **NARROW_DINOV2, num_hidden_layers=1, image_size=28)
    with pytest.raises(UnsupportedModelError, match="'anchor_attention' fits model kinds \\['causal_lm'\\].*'vision'.*causal-only"):
        patch(vit, "anchor_attention")


def test_list_methods_and_info():
    methods = {m["name"]: m for m in list_methods()}
    assert methods["anchor_attention"]["model_kinds"] == ["causal_lm"]
    opts = methods["anchor_attention"]["options"]
    assert {"theta", "block_size", "init_block", "local_window", "min_len", "pool_stride", "dense_last"} <= set(opts)
    model = tiny_causal_lm("qwen3")
    with patched(model, "anchor_attention", theta=5) as m:
        info = patch_info(m)
    assert info["method"] == "anchor_attention" and info["options"]["theta"] == 5.0 and info["layers"] == 2
    assert patch_info(model) is None
    assert attnpatch.__version__


@torch.no_grad()
def test_dense_method_on_vision_encoder_is_exact_and_restores():
    from tiny_models import NARROW_DINOV2, tiny_dinov2

    vit = tiny_dinov2(**NARROW_DINOV2, num_hidden_layers=2, image_size=56)
    x = torch.randn(2, 3, 56, 56)
    ref = vit(pixel_values=x).last_hidden_state
    with patched(vit, "dense"):
        with record_stats(vit) as rec:
            out = vit(pixel_values=x).last_hidden_state
    assert torch.allclose(out, ref, atol=1e-6)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense"} and len(rec.forwards[0]) == 2
    assert torch.equal(vit(pixel_values=x).last_hidden_state, ref)


@torch.no_grad()
def test_static_cache_prefill_and_generate_match_dense():
    from transformers import StaticCache

    model = tiny_causal_lm("llama")
    ids, _ = _ids(1, 200)
    ref = model(ids).logits
    gen_ref = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static", output_scores=True, return_dict_in_generate=True)
    with patched(model, "anchor_attention", theta=math.inf, **SMALL):
        out = model(ids, cache=StaticCache(config=model.config, max_cache_len=512)).logits
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static", output_scores=True, return_dict_in_generate=True)
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.equal(gen.sequences, gen_ref.sequences)
    assert len(gen.scores) == len(gen_ref.scores) == 4
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(gen.scores, gen_ref.scores, strict=True))


@torch.no_grad()
def test_right_padding_and_short_sequences_computed_as_alone():
    model = tiny_causal_lm("qwen2")
    g = torch.Generator().manual_seed(4)
    lens = [200, 137, 40]
    ids = torch.randint(0, 128, (3, 200), generator=g)
    opts = {**SMALL, "theta": 0.5, "min_len": 48, "dense_last": 8}
    with patched(model, "anchor_attention", **opts):
        right = torch.zeros(3, 200, dtype=torch.long)
        left = torch.zeros(3, 200, dtype=torch.long)
        for i, n in enumerate(lens):
            right[i, :n] = 1
            left[i, 200 - n :] = 1
        out_r = model(ids, attention_mask=right).logits
        ids_l = torch.stack([torch.cat([ids[i, n:], ids[i, :n]]) for i, n in enumerate(lens)])  # sequence i at the end
        pos_l = (left.cumsum(-1) - 1).clamp(min=0)
        out_l = model(ids_l, attention_mask=left, position_ids=pos_l).logits
        for i, n in enumerate(lens):
            alone = model(ids[i : i + 1, :n]).logits[0]
            assert torch.allclose(out_r[i, :n], alone, atol=1e-4), n
            assert torch.allclose(out_l[i, 200 - n :], alone, atol=1e-4), n


def test_patched_model_pickles_and_options_accept_numpy_scalars():
    import pickle

    import numpy as np

    model = tiny_causal_lm("llama")
    with patched(model, "anchor_attention", theta=np.float32(3.0), block_size=np.int64(16), init_block=torch.tensor(8), local_window=16) as m:
        assert patch_info(m)["options"]["block_size"] == 16 and isinstance(patch_info(m)["options"]["init_block"], int)
        clone = pickle.loads(pickle.dumps(m))
        assert is_patched(clone)
    with pytest.raises(OptionError, match="theta=.*expected a number"):
        patch(model, "anchor_attention", theta=10**400)
    with pytest.raises(OptionError, match="takes no options"):
        patch(model, "dense", theta=1)


@torch.no_grad()
def test_recall_of_an_all_dense_forward_is_one():
    model = tiny_causal_lm("llama")
    ids, _ = _ids(1, 60)
    with patched(model, "anchor_attention"):  # min_len 512 > 60 tokens: every layer dense
        rep = attention_recall(model, ids)
        with pytest.raises(ValueError, match="worst_fraction=2.0"):
            attention_recall(model, ids, worst_fraction=2.0)
        with pytest.raises(ValueError, match=r"\(60,\): expected \[batch, tokens\]"):
            attention_recall(model, ids[0])
    assert rep["recall_mean"] == 1.0 and rep["recall_worst"] == 1.0 and rep["sparsity"] == 0.0


def test_patched_context_does_not_mask_the_body_error():
    model = tiny_causal_lm("llama")
    with pytest.raises(KeyError):
        with patched(model, "dense"):
            unpatch(model)
            raise KeyError("body")
