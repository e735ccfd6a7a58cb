"""Every adapter through the same calls: ``adapter_for``, the geometry without patching, and what the evals ask
(patch size, grid, token count, feature prefix, preprocessing, ``encode``, ``embed_image`` / ``embed_text``).

The evals, the bench and ``ClipBundle`` ask these calls and never branch on the model library.  Each answer is
checked against the model itself: the token count against the query length the patched attention receives, the
features against the model's own outputs, patch size and prefix against its config; where a model cannot answer,
the adapter refuses with an ``UnsupportedModelError`` naming the model (never a silent default).  Tiny random models only.
"""

from __future__ import annotations

import functools

import pytest
import torch

import attnpatch
from attnpatch import OptionError, UnsupportedModelError, model_geometry, patched
from attnpatch.patchers import api
from attnpatch.patchers.adapter import Adapter, PreprocessConfig
from attnpatch.patchers.adapters import ADAPTERS, HFAdapter, OpenClipAdapter, TimmAdapter, adapter_for
from attnpatch.patchers.api import handle_of
from attnpatch.patchers.runtime import PatchHandle

open_clip = pytest.importorskip("open_clip")


# --------------------------------------------------------------------------- models (tiny, random)


def _dinov2(registers: int = 0):
    from tiny_models import NARROW_DINOV2, tiny_dinov2

    return tiny_dinov2(registers, **NARROW_DINOV2, num_hidden_layers=3, image_size=56)


def _hf_vit():
    from tiny_models import tiny_hf_vit

    return tiny_hf_vit()


def _hf_clip():
    from tiny_models import tiny_hf_clip

    return tiny_hf_clip()


def _llama():
    from tiny_models import tiny_causal_lm

    return tiny_causal_lm("llama")


def _timm(**kw):
    from tiny_models import tiny_timm_vit

    return tiny_timm_vit(**kw)


def _open_clip():
    from tiny_models import tiny_open_clip

    return tiny_open_clip()


#: name -> (builder, expected adapter, image side in pixels or None)
MODELS = {
    "dinov2": (lambda: _dinov2(), HFAdapter, 56),
    "dinov2_registers": (lambda: _dinov2(2), HFAdapter, 56),
    "hf_vit": (_hf_vit, HFAdapter, 32),
    "hf_clip": (_hf_clip, HFAdapter, 32),
    "llama": (_llama, HFAdapter, None),
    "timm_vit": (lambda: _timm(), TimmAdapter, 48),
    "timm_vit_registers": (lambda: _timm(reg_tokens=2), TimmAdapter, 48),
    "open_clip": (_open_clip, OpenClipAdapter, 64),
}
VIT_ENCODERS = ["dinov2", "dinov2_registers", "hf_vit", "timm_vit", "timm_vit_registers"]


@functools.lru_cache(maxsize=None)
def built(name: str) -> torch.nn.Module:
    return MODELS[name][0]()


def _images(side: int, b: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 3, side, side, generator=torch.Generator().manual_seed(seed))


def _snapshot(model: torch.nn.Module):
    """What a patch changes: module classes, instance attributes of the modules, attention implementations, weights."""
    classes = [type(m) for m in model.modules()]
    attrs = [sorted(k for k in m.__dict__ if k.startswith("_attnpatch") or k == "extra_repr") for m in model.modules()]
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return classes, attrs, impl, state


# --------------------------------------------------------------------------- adapter_for


@pytest.mark.parametrize("name", list(MODELS))
def test_adapter_for_finds_the_adapter_patch_uses(name):
    model = built(name)
    adapter = adapter_for(model)
    assert adapter is MODELS[name][1]
    assert adapter is api.find_adapter(model)[0]
    assert isinstance(adapter, Adapter)


def test_adapter_for_refuses_an_unknown_model_with_the_supported_list():
    with pytest.raises(UnsupportedModelError, match=r"torch\.nn\.modules\.linear\.Linear.*supported are") as err:
        adapter_for(torch.nn.Linear(2, 2))
    for a in ADAPTERS:
        assert a.supports in str(err.value)


# --------------------------------------------------------------------------- geometry without patching


def _old_geometry(model, towers=None):
    """The geometry as ``model_geometry`` computed it before: patch with ``dense``, ask the adapter, unpatch."""
    with patched(model, "dense", towers=towers):
        h = handle_of(model)
        return h.adapter.geometry(h.model, h.towers, h.kind)


@pytest.mark.parametrize("name,towers", [(n, None) for n in MODELS] + [("hf_clip", "all"), ("hf_clip", "text"),
                                                                        ("open_clip", "all"), ("open_clip", "text")])
def test_model_geometry_equals_the_patch_based_path_and_leaves_the_model_untouched(name, towers, monkeypatch):
    model = built(name)
    old = _old_geometry(model, towers)
    before = _snapshot(model)

    def boom(*a, **k):
        raise AssertionError("model_geometry patched the model")

    adapter = adapter_for(model)
    monkeypatch.setattr(api, "patch", boom)
    monkeypatch.setattr(api, "unpatch", boom)
    monkeypatch.setattr(PatchHandle, "install", boom)
    monkeypatch.setattr(adapter, "apply", staticmethod(boom))
    monkeypatch.setattr(adapter, "restore", staticmethod(boom))
    geo = model_geometry(model, towers=towers)
    after = _snapshot(model)
    assert geo == old
    assert geo.num_layers > 0 and geo.heads and geo.head_dim
    assert before[:3] == after[:3] and before[3].keys() == after[3].keys()
    assert all(torch.equal(before[3][k], after[3][k]) for k in before[3])


def test_model_geometry_values():
    assert model_geometry(built("llama")) == attnpatch.patchers.contract.ModelGeometry(2, 4, 2, 16, None, "causal_lm")
    assert model_geometry(built("dinov2")).num_layers == 3 and model_geometry(built("dinov2")).kind == "vision"
    g = model_geometry(built("hf_clip"), towers="all")
    assert (g.num_layers, g.kind) == (5, "vision+text")
    assert model_geometry(built("open_clip")) == attnpatch.patchers.contract.ModelGeometry(4, 4, 4, 16, None, "vision")


def test_model_geometry_of_a_patched_model_is_its_patch():
    model = built("hf_clip")
    text = model_geometry(model, towers="text")
    assert text != model_geometry(model)  # the default routes the vision tower
    with patched(model, "dense", towers="text"):
        assert model_geometry(model) == model_geometry(model, towers="all") == text


def test_model_geometry_refuses_what_patch_refuses():
    from tiny_models import open_clip_cfg

    model = open_clip.model.CLIP(**{**open_clip_cfg(), "vision_cfg": dict(layers=(1, 1, 1, 1), width=16, image_size=64)}).eval()
    with pytest.raises(UnsupportedModelError, match="not an open_clip VisionTransformer"):
        attnpatch.patch(model, "dense")
    with pytest.raises(UnsupportedModelError, match="not an open_clip VisionTransformer"):
        model_geometry(model)
    assert model_geometry(model, towers="text").num_layers == 2


# --------------------------------------------------------------------------- what the evals ask: every adapter, same calls


def _eval_calls(adapter, model, side):
    return {
        "patch_size": lambda: adapter.patch_size(model),
        "grid": lambda: adapter.grid(model, side or 32),
        "token_count": lambda: adapter.token_count(model, side or 32),
        "feature_prefix_tokens": lambda: adapter.feature_prefix_tokens(model),
        "preprocess_config": lambda: adapter.preprocess_config(model),
        "encode": lambda: adapter.encode(model, _images(side or 32)),
        "embed_image": lambda: adapter.embed_image(model, _images(side or 32)),
        "embed_text": lambda: adapter.embed_text(model, torch.randint(1, 100, (2, 77)) if adapter is OpenClipAdapter
                                                 else {"input_ids": torch.randint(1, 100, (2, 16))}),
    }


#: (model, call) pairs answered with a value; every other pair is refused with UnsupportedModelError.
ANSWERED = {
    **{(m, c): True for m in VIT_ENCODERS for c in ("patch_size", "grid", "token_count", "feature_prefix_tokens", "encode")},
    **{(m, "preprocess_config"): True for m in ("timm_vit", "timm_vit_registers")},  # timm: from the model's pretrained_cfg
    **{("hf_clip", c): True for c in ("patch_size", "grid", "token_count", "feature_prefix_tokens", "embed_image", "embed_text")},
    **{("open_clip", c): True for c in ("patch_size", "grid", "token_count", "feature_prefix_tokens", "embed_image", "embed_text")},
}


@pytest.mark.parametrize("name", list(MODELS))
def test_every_adapter_answers_or_refuses_naming_the_model(name):
    model = built(name)
    adapter = adapter_for(model)
    for call, run in _eval_calls(adapter, model, MODELS[name][2]).items():
        if ANSWERED.get((name, call)):
            assert run() is not None, call
        else:
            with pytest.raises(UnsupportedModelError) as err:
                run()
            assert type(model).__name__ in str(err.value), (call, str(err.value))


def test_patch_size_refuses_instead_of_a_default():
    """The bench's old ``_patch_size`` fell back to 1 on a model that does not say; the adapters refuse."""
    model = _timm()
    del model.patch_embed.patch_size
    with pytest.raises(UnsupportedModelError, match="VisionTransformer.*patch size"):
        TimmAdapter.patch_size(model)
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        HFAdapter.patch_size(built("llama"))
    with pytest.raises(UnsupportedModelError, match="text"):
        OpenClipAdapter.patch_size(built("open_clip"), "text")
    with pytest.raises(OptionError, match="smaller than the model's patch size"):
        HFAdapter.grid(built("dinov2"), 10)


# --------------------------------------------------------------------------- equal to the model's own numbers


def _reference_patch_and_prefix(model) -> tuple[int, int]:
    """Patch side and feature prefix read straight from the model's own config / attributes (not through an adapter)."""
    if hasattr(model, "patch_embed"):  # timm
        return int(model.patch_embed.patch_size[0]), int(model.num_prefix_tokens)
    vcfg = getattr(model.config, "vision_config", None) or model.config
    return int(vcfg.patch_size), 1 + int(getattr(vcfg, "num_register_tokens", 0) or 0)


@pytest.mark.parametrize("name", VIT_ENCODERS + ["hf_clip"])
def test_patch_size_grid_and_token_count_are_what_the_attention_sees(name):
    """The token count equals the query length the patched attention receives in a real forward, at the native
    side and at twice it; patch size and prefix equal the model's own config."""
    from attnpatch.evals.vision.runner import patch_size, token_count

    model = built(name)
    adapter = adapter_for(model)
    patch, prefix = _reference_patch_and_prefix(model)
    assert adapter.patch_size(model) == patch_size(model) == patch
    native = MODELS[name][2]
    for side in (native,) if name.startswith("timm") else (native, 2 * native):  # the tiny timm ViTs take their size only
        assert adapter.grid(model, side) == (side // patch,) * 2
        seen: list[int] = []
        with patched(model, "dense"), attnpatch.record_stats(model, probe=lambda ctx, q, k, v: seen.append(q.shape[2])):
            if name == "hf_clip":
                adapter.embed_image(model, _images(side, b=1))
            else:
                adapter.encode(model, _images(side, b=1))
        assert seen and set(seen) == {adapter.token_count(model, side)}, (seen, side)
        if name != "hf_clip":  # the vision eval reads ViT encoders: its count is patches + the feature prefix
            assert adapter.feature_prefix_tokens(model) == prefix
            assert token_count(model, side) == (side // patch) ** 2 + prefix


def _reference_features(name, model, x, layers=()):
    """CLS, patch mean and intermediate CLS tokens computed from the model's own outputs (no adapter)."""
    _, prefix = _reference_patch_and_prefix(model)
    with torch.no_grad():
        if hasattr(model, "forward_features"):  # timm
            got = {}
            hooks = [model.blocks[i].register_forward_hook(lambda m, a, o, i=i: got.__setitem__(i, model.norm(o)[:, 0]))
                     for i in layers]
            h = model.forward_features(x)
            for hk in hooks:
                hk.remove()
        else:
            out = model(pixel_values=x, output_hidden_states=bool(layers))
            h = out.last_hidden_state
            got = {i: model.layernorm(out.hidden_states[i + 1])[:, 0] for i in layers}
    return h[:, 0].float(), h[:, prefix:].float().mean(1), {i: v.float() for i, v in got.items()}


@pytest.mark.parametrize("name", VIT_ENCODERS)
@pytest.mark.parametrize("method", [None, "tome"])
def test_encode_equals_the_models_own_outputs(name, method):
    from attnpatch.evals.vision.runner import encode

    model = built(name)
    adapter = adapter_for(model)
    x = _images(MODELS[name][2])
    if method is None:
        # intermediate CLS tokens: transformers' ViTModel keeps its blocks in model.layers, DINOv2 in model.encoder.layer
        cls, pm, inter = encode(model, x, (0, 1))
        ref = _reference_features(name, model, x, (0, 1))
        torch.testing.assert_close(cls, ref[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(pm, ref[1], rtol=0, atol=1e-6)
        assert inter.keys() == {0, 1}
        for i in (0, 1):
            torch.testing.assert_close(inter[i], ref[2][i], rtol=0, atol=1e-6)
        cls, pm = encode(model, x)
        ref = _reference_features(name, model, x)
        torch.testing.assert_close(cls, ref[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(pm, ref[1], rtol=0, atol=1e-6)
    else:
        with patched(model, method, r=2):
            cls, pm = encode(model, x)
            sizes = attnpatch.token_sizes(model)
            assert sizes is not None  # merged: the patch mean weighs each token by the patches it stands for
            h = adapter_for(model)  # same adapter while patched
            assert h is adapter
        _, prefix = _reference_patch_and_prefix(model)
        assert sizes[:, prefix:].sum(1).tolist() == [(MODELS[name][2] // _reference_patch_and_prefix(model)[0]) ** 2] * 2


@pytest.mark.parametrize("name,kind", [("hf_clip", "hf"), ("open_clip", "open_clip")])
def test_clip_bundle_embeddings_equal_the_models_own(name, kind):
    from attnpatch.clip_models import ClipBundle

    model = built(name)
    ids = torch.randint(1, 100, (3, 77 if kind == "open_clip" else 16), generator=torch.Generator().manual_seed(3))
    tokens = ids if kind == "open_clip" else {"input_ids": ids}
    for side in (MODELS[name][2], MODELS[name][2] + 16):  # native, and another size (HF: interpolated positions)
        bundle = ClipBundle(model=model, preprocess=None, tokenizer=lambda texts: tokens, kind=kind, name=name,
                            resolution=side, embed_dim=32)
        patch, _ = (int(model.visual.patch_size[0]), 1) if kind == "open_clip" else _reference_patch_and_prefix(model)
        assert bundle.vision_tokens() == (side // patch) ** 2 + 1
        if kind == "open_clip" and side != MODELS[name][2]:
            continue  # an open_clip tower is built for its size
        x = _images(side)
        with torch.no_grad():
            if kind == "open_clip":
                want = model.encode_image(x)
            else:
                kw = {"interpolate_pos_encoding": True} if side != MODELS[name][2] else {}
                out = model.get_image_features(pixel_values=x, **kw)
                want = out if isinstance(out, torch.Tensor) else out.pooler_output
        assert torch.equal(torch.nn.functional.normalize(want.float(), dim=-1), bundle.encode_image(x))
    with torch.no_grad():
        out = model.encode_text(ids) if kind == "open_clip" else model.get_text_features(input_ids=ids)
        want = out if isinstance(out, torch.Tensor) else out.pooler_output
    assert torch.equal(torch.nn.functional.normalize(want.float(), dim=-1), bundle.encode_text(["a", "b", "c"]))


def test_preprocess_config_equals_the_eval_preprocessing_hf():
    from attnpatch.checkpoints import dinov2_image_processor
    from attnpatch.evals.vision.preprocess import make_preprocess

    proc = dinov2_image_processor()
    cfg = HFAdapter.preprocess_config(built("dinov2"), proc)
    pre = make_preprocess(proc)
    assert isinstance(cfg, PreprocessConfig) and cfg.library == "hf"
    assert (cfg.mean, cfg.std, cfg.resize) == (pre.mean, pre.std, pre.resize)
    assert (cfg.resolution, cfg.crop, cfg.interpolation) == (224, 224, "bicubic")
    assert cfg.native is proc
    with pytest.raises(UnsupportedModelError, match="Dinov2Model.*image processor"):
        HFAdapter.preprocess_config(built("dinov2"))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        HFAdapter.preprocess_config(built("llama"), proc)


def test_preprocess_config_equals_the_eval_preprocessing_timm():
    from PIL import Image
    from timm.data import resolve_data_config

    from attnpatch.checkpoints import dinov2_image_processor
    from attnpatch.evals.vision.preprocess import make_preprocess

    model = built("timm_vit")
    given = {"input_size": (3, 48, 48), "interpolation": "bicubic", "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25),
             "crop_pct": 0.875, "crop_mode": "center"}
    for data_cfg, cfg in ((given, TimmAdapter.preprocess_config(model, given)),
                          (resolve_data_config({}, model=model), TimmAdapter.preprocess_config(model))):
        pre = make_preprocess(data_cfg)
        assert cfg.library == "timm"
        assert (cfg.mean, cfg.std, cfg.resize) == (pre.mean, pre.std, pre.resize)
        assert cfg.resolution == cfg.crop == data_cfg["input_size"][-1]
        img = Image.new("RGB", (70, 60), (120, 30, 200))
        assert torch.equal(make_preprocess(cfg.native)([img]), pre([img]))
    proc = dinov2_image_processor()  # the catalogue's timm DINOv2 comes with the HF processor
    assert TimmAdapter.preprocess_config(model, proc) == HFAdapter.preprocess_config(built("dinov2"), proc)


def test_preprocess_config_equals_the_clip_bundle_open_clip():
    from dataclasses import asdict

    from open_clip.transform import PreprocessCfg

    from attnpatch.clip_models import _wrap_open_clip_transform

    model = _open_clip()
    with pytest.raises(UnsupportedModelError, match="CLIP.*preprocess_cfg"):
        OpenClipAdapter.preprocess_config(model)
    open_clip.model.set_model_preprocess_cfg(model, asdict(PreprocessCfg(size=64)))  # as open_clip's factory does
    cfg = OpenClipAdapter.preprocess_config(model)
    pre = _wrap_open_clip_transform(None, 64, model.visual.preprocess_cfg)
    assert cfg.library == "open_clip"
    assert (cfg.mean, cfg.std, cfg.resize, cfg.resolution) == (pre.mean, pre.std, pre.resize, pre.resolution)
    assert (cfg.crop, cfg.interpolation) == (64, "bicubic")


def test_siglip_token_count_has_no_class_token():
    """A SigLIP vision tower has no class token: the vision eval's token count is the patches alone (it used to add
    one), equal to the query length the patched attention receives."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from attnpatch.evals.vision.runner import token_count

    torch.manual_seed(0)
    model = SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, image_size=32, patch_size=8)).eval()
    seen: list[int] = []
    with patched(model, "dense"), attnpatch.record_stats(model, probe=lambda ctx, q, k, v: seen.append(q.shape[2])):
        model(pixel_values=_images(32, b=1))
    assert set(seen) == {16} and token_count(model, 32) == 16
    assert adapter_for(model).feature_prefix_tokens(model) == 1  # slot 0 (a patch) is read as the feature


def test_encode_refuses_a_classifier_output_naming_the_model():
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, image_size=32, patch_size=8)).eval()
    with pytest.raises(UnsupportedModelError, match="ViTForImageClassification.*no last_hidden_state"):
        adapter_for(model).encode(model, _images(32))


def test_timm_pipeline_at_the_native_side_is_timms_default():
    """``make_preprocess(cfg, R)`` at the config's own side equals timm's default pipeline (crop_pct 0.9: timm resizes
    to floor(224 / 0.9) = 248, not round(...) = 249)."""
    from PIL import Image
    from timm.data import create_transform

    from attnpatch.evals.vision.preprocess import make_preprocess

    cfg = {"input_size": (3, 224, 224), "interpolation": "bicubic", "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5),
           "crop_pct": 0.9, "crop_mode": "center"}
    img = Image.fromarray((torch.rand(300, 260, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy())
    want = create_transform(**cfg, is_training=False)(img)[None]
    assert make_preprocess(cfg, 224).resize == {"scale_size": 248}
    assert torch.equal(make_preprocess(cfg, 224)([img]), want) and torch.equal(make_preprocess(cfg)([img]), want)
