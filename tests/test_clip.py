"""CLIP path: open_clip and Hugging Face CLIP adapters (towers), load_clip, zero-shot and retrieval metrics and evals.

Every model here has random weights (no hub): open_clip's ViT-B-32 built at 128 px (17 image
tokens), and a tiny open_clip CLIP copied into a Hugging Face CLIPModel with open_clip_to_hf.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from attnpatch.patchers import handle_of
from attnpatch import ModelNotFoundError, OptionError, UnsupportedModelError, is_patched, patch, patch_info, patched, record_stats, unpatch
from attnpatch.cli import main
from attnpatch.clip_models import ClipBundle, hf_clip_tokenizer_from_open_clip, load_clip, open_clip_to_hf
from attnpatch.errors import DataError
from attnpatch.evals import clip as ce

open_clip = pytest.importorskip("open_clip")

SHARED = Path(os.environ.get("ATTNPATCH_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
TUXPAINT = SHARED / "tuxpaint-captions"
IMAGENET = SHARED / "imagenet-1k-samples"
QUIET = dict(log=lambda m: None)

def _tiny_open_clip(seed: int = 0, **vision_extra):
    """:func:`tiny_models.tiny_open_clip`: 65 image tokens, 4 heads."""
    from tiny_models import tiny_open_clip

    return tiny_open_clip(seed=seed, vision=vision_extra)


@pytest.fixture(scope="module")
def vitb32():
    """open_clip ViT-B-32, random weights, built at 128 px (4 x 4 patches + CLS = 17 tokens)."""
    return load_clip("ViT-B-32:random", resolution=128, **QUIET)


@pytest.fixture(scope="module")
def tiny_pair():
    oc = _tiny_open_clip()
    hf, proc = open_clip_to_hf(oc)
    return oc, hf, proc


X128 = torch.randn(3, 3, 128, 128, generator=torch.Generator().manual_seed(1))
X64 = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(2))
TEXTS = ["a photo of a cat.", "A frog.", "An albino peahen (a female peafowl, or peacock)."]


def _oc_img(model, x):
    with torch.no_grad():
        return model.encode_image(x)


def _oc_txt(model, ids):
    with torch.no_grad():
        return model.encode_text(ids)


def _hf_img(model, x):
    with torch.no_grad():
        return model.get_image_features(pixel_values=x).pooler_output


def _hf_txt(model, enc):
    with torch.no_grad():
        return model.get_text_features(**enc).pooler_output


def _hf_tok(proc, texts=TEXTS):
    return proc.tokenizer(texts, padding="max_length", max_length=77, return_tensors="pt")


# --------------------------------------------------------------------------- adapters: exactness and restore


def test_open_clip_s_at_least_n_exact_unpatch_bit_exact_text_untouched(vitb32):
    model = vitb32.model
    ids = vitb32.tokenizer(TEXTS)
    ref, ref_t = _oc_img(model, X128), _oc_txt(model, ids)
    patch(model, "fna", s=17)
    assert patch_info(model)["towers"] == ["vision"] and patch_info(model)["layers"] == 12
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = _oc_img(model, X128)
    assert any("s=17 >= N=17" in str(m.message) for m in w)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(_oc_txt(model, ids), ref_t)  # the text tower is not routed by default
    unpatch(model)
    assert torch.equal(_oc_img(model, X128), ref)
    with patched(model, "fna", s=6, sample_layer=2):
        approx = _oc_img(model, X128)
        assert torch.equal(_oc_txt(model, ids), ref_t)
    assert not torch.equal(approx, ref)
    assert torch.equal(_oc_img(model, X128), ref)


def test_hf_clip_s_at_least_n_exact_unpatch_bit_exact_text_untouched(tiny_pair):
    _, hf, proc = tiny_pair
    enc = _hf_tok(proc)
    ref, ref_t = _hf_img(hf, X64), _hf_txt(hf, enc)
    impl = (hf.config._attn_implementation, hf.config.vision_config._attn_implementation, hf.config.text_config._attn_implementation)
    with pytest.warns(UserWarning, match="s=65 >= N=65"), patched(hf, "fna", s=65):
        assert hf.config.vision_config._attn_implementation == "attnpatch"
        assert hf.config.text_config._attn_implementation == impl[2]  # only the vision tower is switched
        torch.testing.assert_close(_hf_img(hf, X64), ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(_hf_txt(hf, enc), ref_t)
    assert (hf.config._attn_implementation, hf.config.vision_config._attn_implementation, hf.config.text_config._attn_implementation) == impl
    assert torch.equal(_hf_img(hf, X64), ref)
    with patched(hf, "fna", s=9, sample_layer=1):
        assert not torch.equal(_hf_img(hf, X64), ref)
        assert torch.equal(_hf_txt(hf, enc), ref_t)
    assert torch.equal(_hf_img(hf, X64), ref)


def test_open_clip_custom_attention_block_routes_and_restores():
    model = _tiny_open_clip(qk_norm=True, scale_heads=True)
    assert type(model.visual.transformer.resblocks[0].attn).__name__ == "Attention"
    ref = _oc_img(model, X64)
    with pytest.warns(UserWarning, match="s=65 >= N=65"), patched(model, "fna", s=65):
        torch.testing.assert_close(_oc_img(model, X64), ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(_oc_img(model, X64), ref)
    with patched(model, "fna", s=9, sample_layer=0), record_stats(model) as rec:
        out = _oc_img(model, X64)
    assert not torch.equal(out, ref) and rec.forwards[0][0].mode == "fna"
    assert torch.equal(_oc_img(model, X64), ref)


# --------------------------------------------------------------------------- towers


@pytest.mark.parametrize("which", ["open_clip", "hf"])
def test_text_tower_refuses_vision_methods_and_bad_towers(which, vitb32, tiny_pair):
    model = vitb32.model if which == "open_clip" else tiny_pair[1]
    for towers in (("text",), ("vision", "text"), "all"):
        with pytest.raises(UnsupportedModelError, match=r"'fna' does not fit the 'text' tower.*towers=\('vision',\)"):
            patch(model, "fna", towers=towers, s=8)
        assert not is_patched(model)
    with pytest.raises(OptionError, match=r"towers='audio': 'audio' is not a tower.*'vision', 'text'"):
        patch(model, "fna", towers="audio")
    with pytest.raises(OptionError, match=r"towers=\(\): empty"):
        patch(model, "fna", towers=())
    with pytest.raises(UnsupportedModelError, match="'vision' tower"):
        patch(model, "anchor_attention")
    assert not is_patched(model)


def test_dense_on_both_towers(vitb32, tiny_pair):
    model = vitb32.model
    ids = vitb32.tokenizer(TEXTS)
    ref_t = _oc_txt(model, ids)
    with patched(model, "dense", towers=("vision", "text")), record_stats(model) as rec:
        assert patch_info(model)["kind"] == "vision+text"
        out_t = _oc_txt(model, ids)
    torch.testing.assert_close(out_t, ref_t, rtol=1e-5, atol=1e-5)
    lay = rec.forwards[0]
    assert sorted(lay) == list(range(12, 24))  # text layers numbered after the 12 vision layers
    assert float(lay[12].causal_pairs[0, 0]) == 77 * 78 / 2  # causal
    _, hf, proc = tiny_pair
    enc = _hf_tok(proc)
    ref = _hf_txt(hf, enc)
    with patched(hf, "dense", towers="all"), record_stats(hf) as rec:
        torch.testing.assert_close(_hf_txt(hf, enc), ref, rtol=1e-5, atol=1e-5)
    n0 = int(enc["attention_mask"][0].sum())  # causal pairs among the first text's non-padding tokens
    assert len(rec.forwards) == 1 and sorted(rec.forwards[0]) == [4, 5]
    assert float(rec.forwards[0][4].causal_pairs[0, 0]) == n0 * (n0 + 1) / 2


def test_one_forward_state_per_call(tiny_pair):
    model = tiny_pair[0]
    ids = open_clip.get_tokenizer("ViT-B-32")(TEXTS[:1])
    with patched(model, "fna", s=6, sample_layer=1), record_stats(model) as rec:
        with torch.no_grad():
            model.encode_image(X64)
            model.visual(X64)
            model.visual.transformer(model.visual._embeds(X64))
            model(X64, ids)
    assert len(rec.forwards) == 4
    for f in rec.forwards:
        assert sorted(f) == [0, 1, 2, 3]
        lm = f[1].landmarks
        assert f[0].mode == "dense:before_sample" and lm.shape == (3, 6) and (lm[:, 0] == 0).all()  # CLS always a landmark
        assert all(torch.equal(f[li].landmarks, lm) for li in (2, 3))  # sampled once, reused
    _, hf, proc = tiny_pair
    with patched(hf, "fna", s=9, sample_layer=1), record_stats(hf) as rec:
        assert handle_of(hf).prefix_tokens == 1
        with torch.no_grad():
            hf.get_image_features(pixel_values=X64)
            hf.vision_model(pixel_values=X64)
            hf(pixel_values=X64, **_hf_tok(proc, TEXTS[:3]))
    assert len(rec.forwards) == 3
    for f in rec.forwards:
        assert sorted(f) == [0, 1, 2, 3] and all(torch.equal(f[li].landmarks, f[1].landmarks) for li in (2, 3))


def test_open_clip_visual_tower_alone():
    model = _tiny_open_clip()
    ref = _oc_img(model, X64)
    with patched(model.visual, "fna", s=9, sample_layer=0), record_stats(model.visual) as rec:
        assert patch_info(model.visual)["towers"] == ["vision"]
        with torch.no_grad():
            out = model.encode_image(X64)  # the tower is the root: one state per call
    assert len(rec.forwards) == 1 and not torch.equal(out, ref)
    assert torch.equal(_oc_img(model, X64), ref)


# --------------------------------------------------------------------------- open_clip vs Hugging Face


def test_open_clip_and_hf_agree_on_the_same_weights(tiny_pair):
    oc, hf, proc = tiny_pair
    ids = open_clip.get_tokenizer("ViT-B-32")(TEXTS)
    enc = _hf_tok(proc)
    assert torch.equal(enc["input_ids"][ids != 0], ids[ids != 0])  # same BPE ids (padding differs: 0 vs <|endoftext|>)
    torch.testing.assert_close(_hf_txt(hf, enc), _oc_txt(oc, ids), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_hf_img(hf, X64), _oc_img(oc, X64), rtol=1e-4, atol=1e-5)
    ref = _oc_img(oc, X64)
    no_sink = torch.zeros(3, 65, dtype=torch.bool)
    one_sink = no_sink.clone()
    one_sink[2, 48] = True  # the only key of the three images above 1.15 x the uniform share in layer 2 (1.176; next 1.139)
    # (method, options, the images whose embedding changes, the sinks masked in layers 2 and 3 or None)
    cases = [
        ("fna", {"s": 9}, {0, 1, 2}, None),
        ("fna", {"s": 9, "sample_layer": 0}, {0, 1, 2}, None),
        # random weights: no key gets 10 x the uniform share nor a 5 x median norm, so nothing is masked: the model's own attention
        ("sink_mask", {"mask_layers": 2}, set(), no_sink),
        ("sink_mask", {"mask_layers": 2, "detect": "attention", "mass_ratio": 1.15}, {2}, one_sink),
        ("fna+sink_mask", {"s": 12, "sample_layer": 1}, {0, 1, 2}, None),
    ]
    for method, opts, changed, sinks in cases:
        with patched(hf, method, **opts), patched(oc, method, **opts), record_stats(hf) as rec_hf, record_stats(oc) as rec_oc:
            a, b = _hf_img(hf, X64), _oc_img(oc, X64)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        for i in range(3):
            moved = float((a[i] - ref[i]).abs().max())
            assert (moved > 1e-3) if i in changed else (moved < 1e-5), (method, opts, i, moved)
        if sinks is not None:
            for rec in (rec_hf, rec_oc):
                masked = "sink_mask" if sinks.any() else "dense:no-sinks"  # nothing to mask: the model's own attention
                assert [r.mode for r in rec.forwards[0].values()] == ["dense", "dense", masked, masked]
                assert all(torch.equal(rec.forwards[0][li].sinks, sinks) for li in (2, 3)), (method, opts)


BATCH_CASES = [("fna", {"s": 6}), ("fna", {"s": 6, "sample_layer": 0, "strategy": "kmeans"}),
               ("sink_mask", {"mask_layers": 2}), ("fna+sink_mask", {"s": 6, "sample_layer": 1})]


@pytest.mark.parametrize(
    "which,method,opts",
    [("vitb32", *BATCH_CASES[0])] + [(w, m, o) for w in ("open_clip", "hf") for m, o in BATCH_CASES],
)
def test_batch_independence(which, method, opts, vitb32, tiny_pair):
    if which == "vitb32":
        model, x, run = vitb32.model, X128, _oc_img
    elif which == "open_clip":
        model, x, run = tiny_pair[0], X64, _oc_img
    else:
        model, x, run = tiny_pair[1], X64, _hf_img
    other = torch.randn(2, *x.shape[1:], generator=torch.Generator().manual_seed(5))
    with patched(model, method, **opts):
        full = run(model, x)
        alone = run(model, x[1:2])
        mixed = run(model, torch.cat([x[1:2], other]))
    torch.testing.assert_close(alone[0], full[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mixed[0], full[1], rtol=1e-4, atol=1e-5)


def test_siglip_vision_tower_has_no_cls_prefix():
    from tiny_models import tiny_hf_clip

    model = tiny_hf_clip("siglip", vision=dict(num_hidden_layers=4, image_size=64))
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        ref, ref_t = model.get_image_features(pixel_values=X64).pooler_output, model.get_text_features(input_ids=ids).pooler_output
    with pytest.warns(UserWarning, match="s=64 >= N=64"), patched(model, "fna", s=64):
        h = handle_of(model)
        assert h.prefix_tokens == 0 and h.tower_kinds == {"text": "text", "vision": "vision"} and h.towers == ("vision",)
        with torch.no_grad():
            torch.testing.assert_close(model.get_image_features(pixel_values=X64).pooler_output, ref, rtol=1e-4, atol=1e-4)
            assert torch.equal(model.get_text_features(input_ids=ids).pooler_output, ref_t)
    with pytest.raises(UnsupportedModelError, match="'text' tower"):
        patch(model, "sink_mask", towers="text")


def test_single_tower_models_keep_their_towers():
    from conftest import tiny_causal_lm
    from tiny_models import tiny_dinov2

    lm = tiny_causal_lm("llama")
    with patched(lm, "anchor_attention", towers="text"):
        assert patch_info(lm)["towers"] == ["text"] and patch_info(lm)["kind"] == "causal_lm"
    with pytest.raises(OptionError, match="towers='vision'.*LlamaForCausalLM has the tower\\(s\\) 'text'"):
        patch(lm, "anchor_attention", towers="vision")
    vit = tiny_dinov2(seed=None, hidden_size=32, num_hidden_layers=2, intermediate_size=64, image_size=28)
    with patched(vit, "fna", s=3):
        assert patch_info(vit)["towers"] == ["vision"] and handle_of(vit).prefix_tokens == 1


# --------------------------------------------------------------------------- load_clip


def test_load_clip_random_is_deterministic_and_normalised(vitb32):
    assert vitb32.kind == "open_clip" and vitb32.random_init and vitb32.resolution == 128 and vitb32.vision_tokens() == 17
    again = load_clip("ViT-B-32:random", resolution=128, **QUIET)
    e1, e2 = vitb32.encode_image(X128), again.encode_image(X128)
    assert torch.equal(e1, e2) and e1.shape == (3, 512)
    torch.testing.assert_close(e1.norm(dim=-1), torch.ones(3))
    t = vitb32.encode_text(TEXTS, batch_size=2)
    assert t.shape == (3, 512) and torch.allclose(t.norm(dim=-1), torch.ones(3))
    from PIL import Image

    img = Image.fromarray((np.random.default_rng(0).random((90, 140, 3)) * 255).astype(np.uint8))
    assert vitb32.preprocess([img, img]).shape == (2, 3, 128, 128)


def test_load_clip_errors_are_fast_and_clear(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="'nosuchtag' is not a pretrained tag.*openai.*'random'"):
        load_clip("ViT-B-32:nosuchtag", **QUIET)
    with pytest.raises(ModelNotFoundError, match="ViT-B-32:openai"):
        load_clip("ViT-B-32", **QUIET)
    with pytest.raises(ModelNotFoundError, match="neither config.json"):
        load_clip(tmp_path, **QUIET)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_clip(str(tmp_path / "missing"), **QUIET)
    with pytest.raises(OptionError, match="resolution=0"):
        load_clip("ViT-B-32:random", resolution=0, **QUIET)
    from huggingface_hub import constants, try_to_load_from_cache
    from open_clip import pretrained as ocp

    # an empty hub cache (read at call time), so that weights cached on this machine cannot turn the errors into loads
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    hub = ocp.get_pretrained_cfg("ViT-B-32", "openai")["hf_hub"].rstrip("/")
    assert all(try_to_load_from_cache(hub, f) is None for f in ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"))
    t0 = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="not in the local cache and offline mode is on.*ViT-B-32:random"):
        load_clip("ViT-B-32:openai", **QUIET)
    with pytest.raises(ModelNotFoundError, match="offline mode is on.*ViT-B-32:random"):
        load_clip("openai/clip-vit-base-patch32-not-cached", **QUIET)
    with pytest.raises(ModelNotFoundError, match="offline mode is on"):
        load_clip("hf-hub:timm/not-cached-clip", **QUIET)
    assert time.perf_counter() - t0 < 10


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tiny_pair):
    """The tiny CLIP saved twice: as a transformers directory and as an open_clip directory."""
    oc, hf, proc = tiny_pair
    hf_dir = tmp_path_factory.mktemp("tiny-clip-hf")
    hf.save_pretrained(hf_dir)
    proc.save_pretrained(hf_dir)
    from tiny_models import open_clip_cfg

    oc_dir = tmp_path_factory.mktemp("tiny-clip-open_clip")
    cfg = {"model_cfg": open_clip_cfg(), "preprocess_cfg": {}}
    (oc_dir / "open_clip_config.json").write_text(json.dumps(cfg))
    torch.save(oc.state_dict(), oc_dir / "open_clip_pytorch_model.bin")
    return hf_dir, oc_dir


def test_load_clip_local_directories_agree(tiny_dirs, tiny_pair):
    hf_dir, oc_dir = tiny_dirs
    a, b = load_clip(hf_dir, **QUIET), load_clip(oc_dir, **QUIET)
    assert (a.kind, b.kind, a.resolution, b.resolution, a.embed_dim, b.embed_dim) == ("hf", "open_clip", 64, 64, 32, 32)
    assert isinstance(a, ClipBundle) and a.vision_tokens() == b.vision_tokens() == 65
    torch.testing.assert_close(a.encode_image(X64), b.encode_image(X64), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.encode_text(TEXTS), b.encode_text(TEXTS), rtol=1e-4, atol=1e-5)
    tok = hf_clip_tokenizer_from_open_clip()
    assert tok("a photo of a dog.")["input_ids"] == [49406, 320, 1125, 539, 320, 1929, 269, 49407]


# --------------------------------------------------------------------------- metrics on constructed embeddings


def _unit(*rows):
    return torch.nn.functional.normalize(torch.tensor(rows, dtype=torch.float32), dim=-1)


def test_retrieval_recall_by_hand():
    # 3 images on the axes; 5 texts: image 0 has captions 0 and 1, image 1 caption 2, image 2 captions 3 and 4
    images = _unit([1, 0, 0], [0, 1, 0], [0, 0, 1])
    texts = _unit(
        [0.9, 0.1, 0.0],   # t0 -> image 0 first (correct)
        [0.0, 0.6, 0.5],   # t1 -> images 1, 2, 0 (its image 0 last)
        [0.5, 0.4, 0.0],   # t2 -> images 0, 1 (correct at rank 2)
        [0.0, 0.2, 0.9],   # t3 -> image 2 first (correct)
        [0.7, 0.0, 0.1],   # t4 -> images 0, 2 (correct at rank 2)
    )
    t2i = [0, 0, 1, 2, 2]
    r = ce.retrieval_recall(images, texts, t2i, ks=(1, 2, 3))
    # text->image ranks of the true image: t0 0, t1 2, t2 1, t3 0, t4 1
    assert r["t2i_recall@1"] == pytest.approx(2 / 5)
    assert r["t2i_recall@2"] == pytest.approx(4 / 5)
    assert r["t2i_recall@3"] == pytest.approx(1.0)
    # image->text (cosines): image 0: t0 .994, t4 .990, t2 .781, ... -> its captions t0/t4 first: found @1
    # image 1: t1 .768, t2 .625, t3 .217, t0 .110 -> its caption t2 second: found @2
    # image 2: t3 .976, t1 .640, t4 .141 -> its caption t3 first: found @1
    assert r["i2t_recall@1"] == pytest.approx(2 / 3)
    assert r["i2t_recall@2"] == pytest.approx(1.0)
    assert r["n_images"] == 3 and r["n_texts"] == 5
    # unnormalised inputs give the same result (cosine similarity); numpy works too
    r2 = ce.retrieval_recall(images.numpy() * 3.0, texts.numpy() * 0.5, np.array(t2i), ks=(1, 2, 3))
    assert {k: v for k, v in r2.items() if "@" in k} == {k: v for k, v in r.items() if "@" in k}


def test_retrieval_ties_and_errors():
    images = _unit([1, 0], [1, 0])  # identical images: ties broken by the lower index
    texts = _unit([1, 0], [1, 0])
    r = ce.retrieval_recall(images, texts, [0, 1], ks=(1,))
    assert r["t2i_recall@1"] == 0.5 and r["i2t_recall@1"] == 0.5
    with pytest.raises(DataError, match=r"images \[2\] have no text"):
        ce.retrieval_recall(_unit([1, 0], [0, 1], [1, 1]), texts, [0, 1])
    with pytest.raises(DataError, match="indices must be in 0..1"):
        ce.retrieval_recall(images, texts, [0, 2])
    with pytest.raises(DataError, match="3-d"):
        ce.retrieval_recall(images, torch.ones(2, 3), [0, 1])
    with pytest.raises(OptionError, match="ks="):
        ce.retrieval_recall(images, texts, [0, 1], ks=(0,))


def test_retrieval_chance():
    c = ce.retrieval_chance([0, 0, 1, 2, 2], 3, ks=(1, 2))
    assert c["t2i_recall@1"] == pytest.approx(1 / 3) and c["t2i_recall@2"] == pytest.approx(2 / 3)
    # image with m captions among 5 texts: 1 - C(5-m, k)/C(5, k)
    p = lambda m, k: 1 - math.comb(5 - m, k) / math.comb(5, k)  # noqa: E731
    assert c["i2t_recall@1"] == pytest.approx((p(2, 1) + p(1, 1) + p(2, 1)) / 3)
    assert c["i2t_recall@2"] == pytest.approx((p(2, 2) + p(1, 2) + p(2, 2)) / 3)


def test_zeroshot_classifier_and_accuracy_by_hand():
    # 3 classes x 2 templates; class c's prompts are around axis c
    prompts = torch.tensor([[2, 0.2, 0], [1, -0.1, 0], [0, 1, 0], [0, 3, 0], [0, 0, 1], [0, 0, 0.5]])
    clf = ce.zeroshot_classifier(prompts, num_classes=3)
    torch.testing.assert_close(clf, torch.eye(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(ce.zeroshot_classifier(prompts.reshape(3, 2, 3)), clf)
    images = torch.tensor([[1.0, 0.5, 0.1], [0.2, 0.1, 1.0], [0.6, 0.5, 0.0], [0.0, 0.3, 0.2]])
    labels = [0, 2, 1, 0]
    r = ce.zeroshot_accuracy(images, clf, labels, ks=(1, 2, 3))
    # predictions: 0, 2, 0, 1; true-class ranks: 0, 0, 1, 2
    assert r["predictions"].tolist() == [0, 2, 0, 1]
    assert r["top1"] == pytest.approx(0.5) and r["top2"] == pytest.approx(0.75) and r["top3"] == pytest.approx(1.0)
    with pytest.raises(DataError, match="indices must be in 0..2"):
        ce.zeroshot_accuracy(images, clf, [0, 1, 2, 3])
    with pytest.raises(DataError, match="do not split"):
        ce.zeroshot_classifier(prompts, num_classes=4)


def test_templates_and_classnames(tmp_path):
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

    t = ce.resolve_templates("openai")
    assert len(t) == 80 and t[0] == OPENAI_IMAGENET_TEMPLATES[0]("{}") and all("{}" in s for s in t)
    assert len(ce.resolve_templates("openai-7")) == 7 and ce.resolve_templates("photo") == ["a photo of a {}."]
    f = tmp_path / "t.txt"
    f.write_text("# mine\nan image of a {c}\n\n")
    assert ce.resolve_templates(str(f)) == ["an image of a {}"]
    with pytest.raises(OptionError, match="templates='nope'"):
        ce.resolve_templates("nope")
    with pytest.raises(OptionError, match="placeholder"):
        ce.resolve_templates(["a photo"])
    assert ce.imagenet_classnames() == list(IMAGENET_CLASSNAMES) and len(IMAGENET_CLASSNAMES) == 1000

    class Fake:
        class_names = ["cat", "dog"]
        labels = np.array([0, 1])
        source = str(tmp_path)

    assert ce.resolve_classnames("auto", Fake()) == (["cat", "dog"], "dataset")
    with pytest.raises(OptionError, match="classnames='x'"):
        ce.resolve_classnames("x", Fake())


# --------------------------------------------------------------------------- end to end on shared/data


def _band(p: float, n: int, z: float = 5.0) -> tuple[float, float]:
    sd = math.sqrt(max(p * (1 - p), 1e-12) / n)
    return max(0.0, p - z * sd - 1e-9), min(1.0, p + z * sd + 1.0 / n)


@pytest.mark.slow
@pytest.mark.skipif(not TUXPAINT.is_dir(), reason="shared/data/tuxpaint-captions is absent")
def test_retrieval_eval_tuxpaint_end_to_end_near_chance(tiny_dirs, tmp_path, capsys):
    _, oc_dir = tiny_dirs
    out = tmp_path / "r.json"
    rc = main([
        "eval", "clip-retrieval", "--model", str(oc_dir), "--data", str(TUXPAINT), "--method", "fna", "-o", "s=16",
        "--batch-size", "64", "--device", "cpu", "--json", str(out),
    ])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["n_images"] == 538 and res["n_texts"] == 538 and res["tokens"] == 65 and res["resolution"] == 64
    run = res["runs"][0]
    assert run["method"] == "fna" and run["towers"] == ["vision"] and run["images_per_s"] > 0 and res["dense"]["images_per_s"] > 0
    assert run["sampled_at"] == {"2": 538}  # auto: no massive token in a random net -> half depth
    for row in (res["dense"], run):
        for key, p in res["chance"].items():
            lo, hi = _band(p, 538)
            assert lo <= row[key] <= hi, (key, row[key], p)
    # measured (FNA s=16 of 65 tokens, this random net): embed cosine 1 - 5.8e-6 (min 1 - 6.2e-5), T->I top-1 agreement 0.974
    assert 1.0 - 2e-5 < run["embed_cosine"] < 1.0 - 1e-6 and run["embed_cosine_min"] > 1.0 - 2e-4  # approximate, yet close
    assert run["t2i_top1_agreement"] > 0.92
    printed = capsys.readouterr().out
    assert "T→I R@1" in printed and "chance" in printed and "fna (s=16)" in printed


@pytest.mark.slow
@pytest.mark.skipif(not IMAGENET.is_dir(), reason="shared/data/imagenet-1k-samples is absent")
def test_zeroshot_eval_imagenet_samples_end_to_end(tiny_dirs, tmp_path):
    hf_dir, _ = tiny_dirs
    out = tmp_path / "z.json"
    rc = main([
        "eval", "zeroshot", "--model", str(hf_dir), "--data", str(IMAGENET), "--limit", "12", "--method", "fna", "fna+sink_mask",
        "-o", "s=16", "--templates", "photo", "--batch-size", "6", "--device", "cpu", "--json", str(out),
    ])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["classnames"] == "imagenet1k" and res["n_classes"] == 1000 and res["n_templates"] == 1 and res["n_images"] == 12
    assert res["chance"] == {"top1": 0.001, "top5": 0.005}
    assert [r["method"] for r in res["runs"]] == ["fna", "fna+sink_mask"]
    for row in (res["dense"], *res["runs"]):
        for k, p in res["chance"].items():
            lo, hi = _band(p, 12)
            assert lo <= row[k] <= hi
    # measured (FNA s=16 of 65 tokens, this random net; no sinks to mask): embed cosine 1 - 1.0e-5 (min 1 - 4.1e-5),
    # top-1 agreement with dense 12/12 for both rows
    for r in res["runs"]:
        assert r["images_per_s"] > 0 and r["agreement"] >= 11 / 12
        assert 1.0 - 3e-5 < r["embed_cosine"] < 1.0 - 1e-6 and r["embed_cosine_min"] > 1.0 - 1.5e-4  # approximate, yet close


@pytest.mark.skipif(not IMAGENET.is_dir(), reason="shared/data/imagenet-1k-samples is absent")
def test_imagenet_samples_are_recognised_as_imagenet1k():
    from attnpatch.evals.vision.images import load_image_set

    s = load_image_set(IMAGENET, limit=5, **QUIET)
    names, source = ce.resolve_classnames("auto", s)
    assert source == "imagenet1k" and names[0] == "tench" and len(names) == 1000
    assert ce.resolve_classnames("dataset", s)[1] == "dataset"


@pytest.mark.skipif(not TUXPAINT.is_dir(), reason="shared/data/tuxpaint-captions is absent")
def test_caption_set_loading(tmp_path):
    cs = ce.load_caption_set(TUXPAINT, limit=7, **QUIET)
    assert len(cs) == 7 and cs.caption_column == "caption" and cs.captions[0] == ["A frog."]
    assert cs.text_to_image.tolist() == list(range(7)) and cs[0].mode == "RGB"
    with pytest.raises(DataError, match="caption_column='nope'"):
        ce.load_caption_set(TUXPAINT, caption_column="nope", **QUIET)


def _caption_folder(root: Path, captions: list) -> Path:
    from PIL import Image

    (root / "train").mkdir(parents=True)
    rows = []
    for i, cap in enumerate(captions):
        Image.fromarray(np.full((20, 20, 3), 40 * i, np.uint8)).save(root / "train" / f"im{i}.jpg")
        rows.append({"file_name": f"im{i}.jpg", "captions": cap})
    (root / "train" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_caption_set_several_captions_per_image(tmp_path):
    lists = ce.load_caption_set(_caption_folder(tmp_path / "a", [["image 0", "picture 0"], ["image 1"], ["a", " b ", ""]]), **QUIET)
    assert lists.caption_column == "captions" and lists.captions == [["image 0", "picture 0"], ["image 1"], ["a", "b"]]
    assert lists.texts == ["image 0", "picture 0", "image 1", "a", "b"] and lists.text_to_image.tolist() == [0, 0, 1, 2, 2]
    lines = ce.load_caption_set(_caption_folder(tmp_path / "b", ["one\ntwo", "three", "four\n\nfive\n"]), **QUIET)
    assert lines.captions == [["one", "two"], ["three"], ["four", "five"]]  # CLIP_benchmark: one caption per line
    # CLIP_benchmark's webdataset layout: <split>/<n>.tar with .jpg + .txt (captions one per line)
    import io
    import tarfile

    from PIL import Image

    (tmp_path / "w" / "test").mkdir(parents=True)
    with tarfile.open(tmp_path / "w" / "test" / "0.tar", "w") as tf:
        for i in range(3):
            buf = io.BytesIO()
            Image.fromarray(np.full((10, 10, 3), 60 * i, np.uint8)).save(buf, "JPEG")
            for member, payload in ((f"{i:05d}.jpg", buf.getvalue()), (f"{i:05d}.txt", f"cap {i} a\ncap {i} b".encode())):
                info = tarfile.TarInfo(member)
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    w = ce.load_caption_set(tmp_path / "w", **QUIET)
    assert (w.split, w.image_column, w.caption_column) == ("test", "jpg", "txt")
    assert w.captions == [[f"cap {i} a", f"cap {i} b"] for i in range(3)] and w[2].size == (10, 10)
    with pytest.raises(DataError, match="row 1 has no caption"):
        ce.load_caption_set(_caption_folder(tmp_path / "c", ["x", "  "]), **QUIET)
    with pytest.raises(DataError, match="does not exist"):
        ce.load_caption_set(tmp_path / "missing", **QUIET)


def test_cli_clip_bad_input(tiny_dirs, capsys, tmp_path):
    hf_dir, _ = tiny_dirs
    data = str(_caption_folder(tmp_path / "caps", ["a red square.", "a blue square."]))
    assert main(["eval", "clip-retrieval", "--model", str(hf_dir), "--data", data, "--method", "fna", "--towers", "text"]) == 2
    assert "'text' tower" in capsys.readouterr().err
    assert main(["eval", "clip-retrieval", "--model", str(hf_dir), "--data", data, "--towers", "audio"]) == 2
    assert "'audio' is not a tower" in capsys.readouterr().err
    assert main(["eval", "zeroshot", "--model", str(hf_dir), "--method", "fna", "-o", "s=0"]) == 2
    assert "s=0" in capsys.readouterr().err
    assert main(["eval", "zeroshot", "--model", str(hf_dir), "--templates", "nope"]) == 2
    assert "templates='nope'" in capsys.readouterr().err
