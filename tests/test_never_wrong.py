"""Never silently wrong: model features and call patterns the approximate methods do not implement are
refused at patch() time (or, for a call's own mask, run exactly and said so), autograd is refused, and
``dense`` runs the model's own attention implementation bit for bit."""

import warnings

import pytest
import torch

from attnpatch import InferenceOnlyError, UnsupportedModelError, patch, patch_info, patched, record_stats, unpatch

# every key kept: AnchorAttention's exact limit on a 200-token prompt
ALL_KEYS = dict(theta=1e9, min_len=64, block_size=32, init_block=32, local_window=32, dense_last=32)


def _tiny(model_cls, config_cls, seed=0, **kw):
    base = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    )
    base.update(kw)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**base)).eval()
    with torch.no_grad():  # sharp attention, so that a wrong mask or a missing cap shows in the logits
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in ("q_proj", "k_proj", "qkv_proj"):  # Phi-3 packs q, k, v in one projection
                if hasattr(attn, proj):
                    getattr(attn, proj).weight.mul_(6.0)
    return model


def _ids(n=200, b=1, seed=1):
    return torch.randint(0, 128, (b, n), generator=torch.Generator().manual_seed(seed))


def _mistral(window=48):
    from transformers import MistralConfig, MistralForCausalLM

    return _tiny(MistralForCausalLM, MistralConfig, sliding_window=window, attn_implementation="sdpa")


def _llama(impl="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny(LlamaForCausalLM, LlamaConfig, attn_implementation=impl)


def _gemma2(**kw):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _tiny(Gemma2ForCausalLM, Gemma2Config, attn_implementation="eager", **kw)


# --------------------------------------------------------------------------- 1. sliding windows


@torch.no_grad()
def test_sliding_window_without_layer_types_is_refused_and_dense_is_exact():
    model = _mistral(48)
    assert getattr(model.config, "layer_types", None) is None  # declared only as config.sliding_window
    ids = _ids()
    ref = model(ids).logits
    with pytest.raises(UnsupportedModelError, match=r"MistralForCausalLM uses sliding-window .*window 48 tokens.*'anchor_attention'"):
        patch(model, "anchor_attention", **ALL_KEYS)
    assert patch_info(model) is None  # nothing half-applied
    assert torch.equal(model(ids).logits, ref)
    with patched(model, "dense"):
        assert torch.equal(model(ids).logits, ref)
    without = _mistral(None)  # the same architecture without a window is patched, and exact at its limit
    ref = without(ids).logits
    with patched(without, "anchor_attention", **ALL_KEYS):
        assert torch.allclose(without(ids).logits, ref, atol=1e-5)


def test_sliding_window_layer_types_are_refused_but_disabled_windows_are_not():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sliding = _tiny(Qwen2ForCausalLM, Qwen2Config, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    with pytest.raises(UnsupportedModelError, match=r"Qwen2ForCausalLM uses sliding-window .*window 32 tokens"):
        patch(sliding, "anchor_attention")
    off = _tiny(Qwen2ForCausalLM, Qwen2Config, use_sliding_window=False, sliding_window=32)
    patch(off, "anchor_attention")
    unpatch(off)


# --------------------------------------------------------------------------- 1. arbitrary 4-D masks


@torch.no_grad()
def test_block_diagonal_4d_mask_runs_exactly_and_says_so():
    model = _llama()
    n = 350
    ids = _ids(n)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    packed = (((i < 200) == (j < 200)) & (j <= i))[None, None]  # two documents, 200 + 150 tokens
    ref = model(ids, attention_mask=packed).logits
    with patched(model, "dense"):
        assert torch.equal(model(ids, attention_mask=packed).logits, ref)
    with patched(model, "anchor_attention", **ALL_KEYS), record_stats(model) as rec:
        with pytest.warns(UserWarning, match=r"attention mask that is not causal .*'dense:mask'"):
            out = model(ids, attention_mask=packed).logits
        plain = model(ids).logits  # a plain causal call is still sparse
    assert (out - ref).abs().max() < 1e-5  # the first document's rows were all zero before (0.75)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:mask"}
    assert {r.mode for r in rec.forwards[1].values()} == {"sparse"}
    assert torch.allclose(plain, model(ids).logits, atol=1e-5)


# --------------------------------------------------------------------------- 1. soft-capping


@torch.no_grad()
def test_softcap_is_refused_and_dense_runs_the_eager_cap():
    model = _gemma2(attn_logit_softcapping=5.0, layer_types=["full_attention", "full_attention"])
    ids = _ids()
    ref = model(ids).logits
    with pytest.raises(UnsupportedModelError, match=r"Gemma2ForCausalLM uses attention logit soft-capping.*cap 5.0"):
        patch(model, "anchor_attention", **ALL_KEYS)
    with patched(model, "dense"):  # crashed before: the fallback was SDPA, which has no soft-capping
        assert torch.equal(model(ids).logits, ref)


@torch.no_grad()
def test_default_gemma2_dense_is_bit_exact():
    model = _gemma2(sliding_window=16)  # default layer types: sliding and full layers, soft-capping on
    ids = _ids(100)
    ref = model(ids).logits
    with patched(model, "dense"):
        assert torch.equal(model(ids).logits, ref)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        patch(model, "anchor_attention")


# --------------------------------------------------------------------------- 1. text encoders


@torch.no_grad()
def test_bert_is_a_text_encoder_only_dense_fits():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)).eval()
    ids = _ids(40, b=2)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    ref = bert(ids, attention_mask=mask).last_hidden_state
    for method in ("fna", "sink_mask", "fna+sink_mask", "anchor_attention"):
        with pytest.raises(UnsupportedModelError, match=r"BertModel is a 'text' model \(a text encoder"):
            patch(bert, method)
    with patched(bert, "dense"):
        assert patch_info(bert)["kind"] == "text"
        assert torch.equal(bert(ids, attention_mask=mask).last_hidden_state, ref)


# --------------------------------------------------------------------------- 2. autograd


@pytest.mark.parametrize("method,opts", [("anchor_attention", dict(theta=8.0, min_len=64, block_size=32, init_block=32, local_window=32)),
                                         ("anchor_attention", dict(theta=8.0, min_len=64, block_size=32, init_block=32, local_window=32, kernel="torch"))])
def test_autograd_through_an_approximate_causal_method_is_refused(method, opts):
    model = _llama()
    ids = _ids()
    with patched(model, method, **opts):
        with pytest.raises(InferenceOnlyError, match=r"inference-only .*torch.no_grad\(\)"):
            model(ids, labels=ids)
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all()


def test_autograd_through_vision_methods_is_refused_and_dense_keeps_gradients():
    from tiny_models import tiny_dinov2

    vit = tiny_dinov2(image_size=112)
    x = torch.randn(2, 3, 112, 112)
    for method, opts in (("fna", dict(s=16, sample_layer=0)), ("sink_mask", {})):
        with patched(vit, method, **opts):
            with pytest.raises(InferenceOnlyError, match=method):
                vit(pixel_values=x).pooler_output.sum().backward()
    vit.zero_grad()
    vit(pixel_values=x).pooler_output.sum().backward()
    ref = {n: p.grad.clone() for n, p in vit.named_parameters() if p.grad is not None}
    vit.zero_grad()
    with patched(vit, "dense"):
        vit(pixel_values=x).pooler_output.sum().backward()
    got = {n: p.grad for n, p in vit.named_parameters() if p.grad is not None}
    assert got.keys() == ref.keys() and len(ref) > 20
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_attention_dropout_in_training_mode_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = _tiny(LlamaForCausalLM, LlamaConfig, attention_dropout=0.1, attn_implementation="sdpa").train()
    with patched(model, "anchor_attention", **ALL_KEYS), torch.no_grad():
        with pytest.raises(InferenceOnlyError, match=r"attention dropout p=0.1 .*model.eval\(\)"):
            model(_ids())


# --------------------------------------------------------------------------- 6. dense is the model's own attention


@torch.no_grad()
def test_dense_on_eager_llama_is_bit_exact_and_returns_attention_weights():
    model = _llama("eager")
    ids = _ids()
    ref = model(ids, output_attentions=True)
    with patched(model, "dense"):
        out = model(ids, output_attentions=True)
    assert torch.equal(out.logits, ref.logits)
    assert len(out.attentions) == 2 and all(torch.equal(a, b) for a, b in zip(out.attentions, ref.attentions, strict=True))


@torch.no_grad()
def test_output_attentions_under_an_approximate_method_warns():
    model = _llama("eager")
    ids = _ids()
    with patched(model, "anchor_attention", theta=8.0, min_len=64, block_size=32, init_block=32, local_window=32):
        with pytest.warns(UserWarning, match=r"output_attentions=True: method 'anchor_attention' forms no attention matrix"):
            out = model(ids, output_attentions=True)
    assert all(a is None for a in out.attentions)


def _eager_vit(name):
    """``(model, images, layers, attentions of a forward)`` of a tiny random eager Hugging Face ViT."""
    from tiny_models import tiny_dinov2, tiny_hf_clip, tiny_hf_vit

    g = torch.Generator().manual_seed(0)
    if name == "dinov2":
        return tiny_dinov2(attn_implementation="eager"), torch.randn(2, 3, 70, 70, generator=g), 4, lambda m, x: m(x, output_attentions=True).attentions
    if name == "vit":
        return tiny_hf_vit(attn_implementation="eager"), torch.randn(2, 3, 32, 32, generator=g), 2, lambda m, x: m(x, output_attentions=True).attentions
    model = tiny_hf_clip(attn_implementation="eager")
    return model, torch.randn(2, 3, 32, 32, generator=g), 3, lambda m, x: m.vision_model(pixel_values=x, output_attentions=True).attentions


@pytest.mark.parametrize("name", ["dinov2", "vit", "clip"])
@torch.no_grad()
def test_output_attentions_keeps_one_entry_per_layer_under_fna(name):
    """``attentions[i]`` is layer i's: ``None`` exactly where FNA approximated (no matrix exists), the unpatched
    weights where the layer ran exact attention (transformers' hook skips a ``None``, which shortened the tuple)."""
    model, x, layers, attentions = _eager_vit(name)
    ref = attentions(model, x)
    assert len(ref) == layers and all(a is not None for a in ref)
    with patched(model, "fna", s=8, sample_layer=1, min_tokens=0), record_stats(model) as rec:
        with pytest.warns(UserWarning, match=r"output_attentions=True: method 'fna' forms no attention matrix"):
            got = attentions(model, x)
    approximated = [i for i, r in sorted(rec.forwards[0].items()) if not r.mode.startswith("dense")]
    assert approximated == list(range(1, layers))  # layer 0 exact (before the sample layer), the others FNA
    assert len(got) == layers
    assert [i for i, a in enumerate(got) if a is None] == approximated
    assert all(torch.equal(got[i], ref[i]) for i in range(layers) if i not in approximated)


@torch.no_grad()
def test_dense_on_open_clip_vit_b32_is_bit_exact():
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = open_clip.create_model("ViT-B-32").eval()
    x = torch.randn(2, 3, 224, 224)
    ref = model.encode_image(x)
    with patched(model, "dense"):
        assert torch.equal(model.encode_image(x), ref)
        with record_stats(model) as rec:  # the per-layer records still come
            model.encode_image(x)
    assert len(rec.forwards[0]) == 12 and {r.mode for r in rec.forwards[0].values()} == {"dense"}


def _vit_features(name):
    """``(model, image features of x)`` of a tiny random ViT of each library the vision methods patch."""
    from tiny_models import tiny_dinov2, tiny_open_clip, tiny_timm_vit

    if name.startswith("open_clip"):
        model = tiny_open_clip(vision=dict(qk_norm=True) if name == "open_clip_attention" else None)
        return model, torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)), model.encode_image
    if name == "timm":
        model = tiny_timm_vit()
        return model, torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(0)), model.forward_features
    model = tiny_dinov2()
    return model, torch.randn(2, 3, 70, 70, generator=torch.Generator().manual_seed(0)), lambda x: model(x).last_hidden_state


#: Settings whose every call is handed back to the model's own attention, and the record modes that say so.
HANDED_BACK = [
    ("fna", {"min_tokens": 10**6}, {"dense:short"}),  # below min_tokens
    ("fna", {"s": 10000, "min_tokens": 0}, {"dense:s>=N"}),  # every token a landmark
    ("sink_mask", {}, {"dense", "dense:no-sinks"}),  # random weights: no sink found in the masked last layer
]


@pytest.mark.parametrize("name", ["open_clip", "open_clip_attention", "dinov2", "timm"])
@pytest.mark.parametrize("method,options,modes", HANDED_BACK)
@torch.no_grad()
def test_a_call_handed_back_is_the_models_own_attention_bit_for_bit(name, method, options, modes):
    """What ``dense`` gives, for every method's hand-back: on open_clip the hand-back ran exact SDPA on the adapter's
    ``q, k, v``, while ``nn.MultiheadAttention`` runs its fused inference kernel (1.7e-6 apart on ViT-B-32), and
    ``sink_mask`` masked nothing in its own code where no sink was found."""
    model, x, features = _vit_features(name)
    ref = features(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fna says s >= N runs exact attention
        with patched(model, method, **options), record_stats(model) as rec:
            out = features(x)
    assert torch.equal(out, ref), (out - ref).abs().max().item()
    assert {r.mode for r in rec.forwards[0].values()} == modes


def test_repr_shows_the_patch_and_unpatch_removes_it():
    model = _llama()
    before = repr(model)
    patch(model, "anchor_attention", theta=8.0)
    text = repr(model)
    assert "attnpatch=anchor_attention(theta=8.0)" in text.splitlines()[1]
    assert "attnpatch=anchor_attention(theta=8.0), layer=1" in text
    unpatch(model)
    assert repr(model) == before


def test_readme_names_is_patched_and_patch_info_and_they_answer():
    """The README's "Seeing the patch" names both functions; they answer as it says (method, options, kind, layers)."""
    from pathlib import Path

    import attnpatch

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "`attnpatch.is_patched(model)`" in readme and "`attnpatch.patch_info(model)`" in readme
    model = _llama()
    assert not attnpatch.is_patched(model) and attnpatch.patch_info(model) is None
    with patched(model, "anchor_attention", theta=8.0):
        info = attnpatch.patch_info(model)
        assert attnpatch.is_patched(model)
        assert info["method"] == "anchor_attention" and info["options"]["theta"] == 8.0
        assert info["kind"] == "causal_lm" and info["layers"] == len(model.model.layers)
    assert not attnpatch.is_patched(model)


def test_open_clip_convnext_refusal_does_not_suggest_patching_the_trunk():
    open_clip = pytest.importorskip("open_clip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = open_clip.create_model("convnext_tiny").eval()
    with pytest.raises(UnsupportedModelError) as err:
        patch(model, "fna")
    assert "has no softmax attention layers to patch" in str(err.value)
    assert "patch(model.visual.trunk" not in str(err.value)


# --------------------------------------------------------------------------- families


def _family(name):
    import transformers as T

    families = {
        "phi3": (T.Phi3ForCausalLM, T.Phi3Config, {"pad_token_id": 0}),
        "gemma": (T.GemmaForCausalLM, T.GemmaConfig, {}),
        "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config, {"attn_implementation": "eager"}),
        "gemma3": (T.Gemma3ForCausalLM, T.Gemma3TextConfig, {"attn_implementation": "eager"}),
        "mixtral": (T.MixtralForCausalLM, T.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
        "qwen2_moe": (T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig, {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
        "olmo2": (T.Olmo2ForCausalLM, T.Olmo2Config, {}),
    }
    model_cls, config_cls, kw = families[name]
    return _tiny(model_cls, config_cls, **{"attn_implementation": "sdpa", **kw})


@pytest.mark.parametrize("family,refused", [
    ("phi3", None), ("gemma", None), ("gemma2", "sliding-window"), ("gemma3", "sliding-window"), ("mixtral", None),
    ("qwen2_moe", None), ("olmo2", None),
])
@torch.no_grad()
def test_families_dense_bit_exact_and_anchor_exact_limit_or_refused(family, refused):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _family(family)
    ids = _ids(200, b=2)
    mask = torch.ones_like(ids)
    mask[1, :23] = 0  # left padding
    ref = model(ids, attention_mask=mask).logits
    with patched(model, "dense"):
        assert torch.equal(model(ids, attention_mask=mask).logits, ref)
    if refused:
        with pytest.raises(UnsupportedModelError, match=refused):
            patch(model, "anchor_attention", **ALL_KEYS)
        return
    with patched(model, "anchor_attention", **ALL_KEYS), record_stats(model) as rec:
        out = model(ids, attention_mask=mask).logits
    assert {r.mode for r in rec.forwards[0].values()} == {"sparse"}
    valid = mask.bool()
    assert (out[valid] - ref[valid]).abs().max() < 1e-5


# --------------------------------------------------------------------------- found by trying it as a new user


def test_relative_position_bias_sinks_and_mla_are_refused():
    import transformers as T

    torch.manual_seed(0)
    beit = T.BeitModel(T.BeitConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                    image_size=64, patch_size=16, use_relative_position_bias=True)).eval()
    for method in ("fna", "sink_mask"):
        with pytest.raises(UnsupportedModelError, match=r"BeitModel uses an additive bias on the attention logits \(relative position bias\)"):
            patch(beit, method)
    oss = T.GptOssForCausalLM._from_config(T.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"] * 2, sliding_window=128,
    ), attn_implementation="eager").eval()
    with pytest.raises(UnsupportedModelError, match=r"GptOssForCausalLM uses learned attention-sink logits"):
        patch(oss, "anchor_attention")
    mla = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=2,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
    )).eval()
    with pytest.raises(UnsupportedModelError, match=r"value head size 8, query/key head size 24"):
        patch(mla, "anchor_attention")


@torch.no_grad()
def test_additive_float_mask_with_a_bias_runs_exactly():
    model = _llama()
    n = 80
    ids = _ids(n)
    causal = torch.full((1, 1, n, n), torch.finfo(torch.float32).min).triu(1)
    biased = causal + torch.where(causal == 0, -0.5 * torch.rand(1, 1, n, n, generator=torch.Generator().manual_seed(3)), torch.zeros(()))
    ref = model(ids, attention_mask=biased).logits
    small = dict(theta=1e9, min_len=16, block_size=16, init_block=16, local_window=16, dense_last=0, min_recall=0.0)
    with patched(model, "anchor_attention", **small), record_stats(model) as rec:
        with pytest.warns(UserWarning, match="dense:mask"):
            out = model(ids, attention_mask=biased).logits
        plain = model(ids, attention_mask=causal).logits  # a 0 / min additive causal mask is represented
    assert torch.equal(out, ref)  # the bias was dropped before (0.05)
    assert [sorted({r.mode for r in f.values()}) for f in rec.forwards] == [["dense:mask"], ["sparse"]]
    assert (plain - model(ids, attention_mask=causal).logits).abs().max() < 1e-5


@torch.no_grad()
def test_right_padding_of_every_row_runs_the_method():
    model = _llama()
    ids = _ids(100, b=2)
    mask = torch.ones_like(ids)
    mask[:, 90:] = 0
    mask[1, 70:] = 0
    ref = model(ids, attention_mask=mask).logits
    small = dict(theta=1e9, min_len=16, block_size=16, init_block=16, local_window=16, dense_last=0, min_recall=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 'dense:mask' warning
        with patched(model, "anchor_attention", **small), record_stats(model) as rec:
            out = model(ids, attention_mask=mask).logits
    assert {r.mode for r in rec.forwards[0].values()} == {"sparse"}
    valid = mask.bool()
    assert (out[valid] - ref[valid]).abs().max() < 1e-5


@torch.no_grad()
def test_dense_on_eager_passes_a_users_bool_4d_mask_as_the_model_does():
    model = _llama("eager")
    n = 120
    ids = _ids(n)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    packed = (((i < 60) == (j < 60)) & (j <= i))[None, None]
    ref = model(ids, attention_mask=packed).logits
    with patched(model, "dense"):
        assert torch.equal(model(ids, attention_mask=packed).logits, ref)


@torch.no_grad()
def test_a_sub_module_called_alone_gets_one_forward_state():
    from tiny_models import tiny_dinov2

    vit = tiny_dinov2(image_size=112)
    x = torch.randn(2, 3, 112, 112)
    with patched(vit, "fna", s=8, sample_layer=0):
        full = vit(pixel_values=x).last_hidden_state
        with record_stats(vit) as rec:
            enc = vit.layernorm(vit.encoder(vit.embeddings(x)).last_hidden_state)
    assert torch.equal(enc, full)  # landmarks sampled once and reused, as in a whole-model call (resampled per layer before)
    assert len(rec.forwards) == 1 and sorted(rec.forwards[0]) == [0, 1, 2, 3]
    with patched(vit, "sink_mask", mask_layers=2, detect_layer=1):  # needed the block inputs, which were lost before
        ref = vit(pixel_values=x).last_hidden_state
        enc = vit.layernorm(vit.encoder(vit.embeddings(x)).last_hidden_state)
    assert torch.equal(enc, ref)
