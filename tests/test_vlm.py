"""Vision-language models (tiny random LLaVA, LLaVA-NeXT, Idefics3, SmolVLM, Qwen2-VL): each tower read right."""

from __future__ import annotations

import re

import pytest

import torch

from attnpatch import OptionError, PatchStateError, UnsupportedModelError, patch, patch_info, patched, record_stats, unpatch
from attnpatch.patchers.adapters.hf.modules import prefix_tokens, towers_of
from attnpatch.patchers.registry import get_method
from tiny_models import VLM_FAMILIES, tiny_vlm, tiny_dinov2, tiny_hf_clip, vlm_inputs

# CLS + registers of each family's vision tower, from its structure: LLaVA / LLaVA-NeXT use CLIP's tower (a class
# embedding); Idefics3 / SmolVLM (SigLIP-style) and Qwen2-VL hand every patch to the language model: no CLS
PREFIX = {"llava": 1, "llava_next": 1, "idefics3": 0, "smolvlm": 0, "qwen2_vl": 0}


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_each_vlm_has_a_vision_and_a_text_tower_and_its_prefix_tokens_come_from_its_structure(family):
    model = tiny_vlm(family)
    towers = towers_of(model)
    assert list(towers) == ["vision", "text"] and len(towers["vision"]) == 2 and len(towers["text"]) == 2
    assert prefix_tokens(model, "vision") == PREFIX[family]


def test_prefix_tokens_of_single_tower_vits_and_clip():
    assert prefix_tokens(tiny_dinov2(0), "vision") == 1
    assert prefix_tokens(tiny_dinov2(4), "vision") == 5
    assert prefix_tokens(tiny_hf_clip("clip"), "vision") == 1
    assert prefix_tokens(tiny_hf_clip("siglip"), "vision") == 0


# --------------------------------------------------------------------------- one method per tower

# the vision method of each family: fna, but Qwen2-VL packs its images into one sequence and calls the attention once
# per image, which fna's per-forward landmarks cannot follow (refused, tested below); Nyströmformer is stateless per call
VISION = {f: "fna" for f in VLM_FAMILIES} | {"qwen2_vl": "nystromformer"}
SMALL_VISION = {"fna": dict(s=4, sample_layer=0, min_tokens=0), "nystromformer": dict(s=4)}
TEXT = "anchor_attention"


def _small(method: str, kind: str) -> dict:
    return dict(get_method(method).small_settings[kind])


def _exact(method: str, kind: str) -> dict:
    """The method's exact limit over its small settings (so that it runs: min_len / min_tokens below the prompt)."""
    return {**_small(method, kind), **get_method(method).exact_limit(64)}


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _no_patch_left(model) -> bool:
    return not any(k.startswith("_attnpatch") for m in model.modules() for k in m.__dict__)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_each_tower_at_its_exact_limit_equals_the_unpatched_vlm_alone_and_composed(family):
    model = tiny_vlm(family)
    x = vlm_inputs(family, model)
    ref = _logits(model, x)
    vision, text = (VISION[family], _exact(VISION[family], "vision")), (TEXT, _exact(TEXT, "causal_lm"))
    with patched(model, vision[0], towers="vision", **vision[1]):
        torch.testing.assert_close(_logits(model, x), ref, rtol=0, atol=1e-5)
    with patched(model, text[0], towers="text", **text[1]), record_stats(model) as rec:
        torch.testing.assert_close(_logits(model, x), ref, rtol=0, atol=1e-5)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:theta=inf"}  # the method's limit, not "dense:short"
    with patched(model, {"vision": vision, "text": text}):
        torch.testing.assert_close(_logits(model, x), ref, rtol=0, atol=1e-5)
    assert torch.equal(_logits(model, x), ref) and _no_patch_left(model)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_both_towers_approximated_report_their_method_generate_and_restore_bit_exact(family):
    model = tiny_vlm(family)
    x = vlm_inputs(family, model)
    ref = _logits(model, x)
    ref_gen = model.generate(**x, max_new_tokens=4, do_sample=False)
    v = VISION[family]
    patch(model, v, towers="vision", **SMALL_VISION[v])
    patch(model, TEXT, towers="text", **_small(TEXT, "causal_lm"))
    info = patch_info(model)
    assert info["method"] is None and info["towers"] == ["vision", "text"]
    assert {t: d["method"] for t, d in info["per_tower"].items()} == {"vision": v, "text": TEXT}
    assert info["kind"] == "vision+causal_lm" and info["layers"] == 4
    with record_stats(model) as rec:
        got = _logits(model, x)
    assert torch.isfinite(got).all() and not torch.equal(got, ref)
    layers = rec.forwards[0]
    assert sorted(layers) == [0, 1, 2, 3]  # vision layers first (model order), then the language model's
    vision_modes = {layers[i].mode for i in (0, 1)}
    assert vision_modes <= {"fna", "dense:before_sample", "nystromformer", "sparse"} and vision_modes != {"dense:before_sample"}
    assert {layers[i].mode for i in (2, 3)} == {"sparse"}
    gen = model.generate(**x, max_new_tokens=4, do_sample=False)
    assert gen.shape == ref_gen.shape
    unpatch(model)
    assert torch.equal(_logits(model, x), ref) and _no_patch_left(model)
    assert torch.equal(model.generate(**x, max_new_tokens=4, do_sample=False), ref_gen)


def test_a_second_patch_on_a_patched_tower_is_refused_naming_the_tower_and_one_tower_unpatches_alone():
    model = tiny_vlm("llava")
    x = vlm_inputs("llava", model)
    ref = _logits(model, x)
    patch(model, "fna", towers="vision", **SMALL_VISION["fna"])
    with pytest.raises(PatchStateError, match=r"its 'vision' tower is already patched with 'fna'; call attnpatch.unpatch\(model, towers='vision'\)"):
        patch(model, "nystromformer", towers="vision")
    with pytest.raises(PatchStateError, match="'vision' tower is already patched"):
        patch(model, "dense")  # the default tower of a VLM is its vision tower
    approx_vision = _logits(model, x)
    with patched(model, TEXT, towers="text", **_small(TEXT, "causal_lm")):
        assert patch_info(model)["per_tower"]["text"]["method"] == TEXT
    assert patch_info(model)["method"] == "fna" and patch_info(model)["towers"] == ["vision"]  # the vision patch stayed
    assert torch.equal(_logits(model, x), approx_vision)
    with pytest.raises(PatchStateError, match="tower 'text' is not patched"):
        unpatch(model, towers="text")
    unpatch(model, towers="vision")
    assert torch.equal(_logits(model, x), ref) and _no_patch_left(model)


def test_a_tower_mapping_is_all_or_none_and_checked_before_anything_is_patched():
    model = tiny_vlm("llava")
    with pytest.raises(UnsupportedModelError, match="does not fit the 'text' tower"):
        patch(model, {"vision": "fna", "text": "fna"})
    assert _no_patch_left(model)
    with pytest.raises(OptionError, match="towers= and options beside it are not taken"):
        patch(model, {"vision": "fna"}, s=4)
    from attnpatch import UnknownMethodError

    with pytest.raises(UnknownMethodError):
        patch(model, {"vision": "fna", "text": "no_such_method"})
    assert _no_patch_left(model)


def test_a_single_method_patch_keeps_its_patch_info():
    model = tiny_vlm("llava")
    with patched(model, "dense", towers="all"):
        info = patch_info(model)
    assert {k: info[k] for k in ("method", "options", "kind", "towers")} == {
        "method": "dense", "options": {}, "kind": "vision+causal_lm", "towers": ["vision", "text"]}
    assert info["per_tower"] == {"vision": {"method": "dense", "options": {}, "kind": "vision"},
                                 "text": {"method": "dense", "options": {}, "kind": "causal_lm"}}


def test_qwen2_vl_packed_images_are_refused_for_a_method_with_per_forward_state_and_run_for_a_stateless_one():
    model = tiny_vlm("qwen2_vl")
    with pytest.raises(UnsupportedModelError, match=r"several images packed into one sequence.*'fna' does not implement"):
        patch(model, "fna", towers="vision")
    # two images of different sizes packed in one sequence: each is an attention call of its own
    x = vlm_inputs("qwen2_vl", model)
    two = {"pixel_values": torch.randn(16 + 8, 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(1)),
           "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 4]])}
    ids = torch.cat([x["input_ids"][:, :7], torch.tensor([[253, 255, 255]]), x["input_ids"][:, 7:]], 1)  # + 2 tokens
    y = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == 255).long(), **two}
    ref = _logits(model, y)
    with patched(model, "nystromformer", towers="vision", s=64):
        torch.testing.assert_close(_logits(model, y), ref, rtol=0, atol=1e-5)
    with patched(model, "nystromformer", towers="vision", s=2):
        assert torch.isfinite(_logits(model, y)).all()


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_a_padded_patch_attention_mask_runs_exact_where_the_method_has_no_key_padding(family):
    model = tiny_vlm(family)
    x = vlm_inputs(family, model, padded=True)
    ref = _logits(model, x)
    with patched(model, "fna", towers="vision", **SMALL_VISION["fna"]), record_stats(model) as rec:
        with pytest.warns(UserWarning, match="dense:padding"):
            got = _logits(model, x)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:padding"}
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- discovery by structure


def _llama_with(attention_forward):
    """A tiny Llama whose attention class's forward is ``attention_forward`` (a subclass per call)."""
    import torch

    from tiny_models import tiny_causal_lm
    from transformers.models.llama import modeling_llama as ml

    model = tiny_causal_lm("llama")
    cls = type("CustomAttention", (ml.LlamaAttention,), {"forward": attention_forward})
    for layer in model.model.layers:
        layer.self_attn.__class__ = cls
    return model, torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))


def _subscript_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """LlamaAttention's forward, dispatching through ``ALL_ATTENTION_FUNCTIONS[...]`` instead of ``get_interface``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    fn = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, w = fn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), w


def _own_sdpa_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """Attention computed in the module itself (scaled_dot_product_attention), never dispatched."""
    import torch

    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(shape).transpose(1, 2).repeat_interleave(self.num_key_value_groups, 1)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2).repeat_interleave(self.num_key_value_groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


def test_a_module_dispatching_through_the_mapping_by_subscript_is_found_and_routed():
    import torch

    from attnpatch import patched, record_stats

    model, ids = _llama_with(_subscript_forward)
    with torch.no_grad():
        ref = model(ids).logits
        with patched(model, "dense"), record_stats(model) as rec:
            got = model(ids).logits
    assert len(rec.forwards[0]) == 2  # both layers routed
    assert torch.equal(got, ref)


def test_a_module_computing_attention_itself_is_refused_naming_its_class():
    from attnpatch import patch
    from attnpatch.errors import UnsupportedModelError

    model, _ = _llama_with(_own_sdpa_forward)
    with pytest.raises(UnsupportedModelError, match=r"CustomAttention .* does not call transformers' attention dispatch"):
        patch(model, "anchor_attention")


def test_bad_tower_arguments_get_one_line_each():
    model = tiny_vlm("llava")
    for bad, words in [({"vision": ("fna",)}, "give each tower a method name or a (name, options dict) pair"),
                       ({"audio": "fna"}, "'audio' is not a tower of LlavaForConditionalGeneration; its towers: 'vision', 'text'"),
                       ([("vision", "fna")], "give a method name")]:
        with pytest.raises(OptionError, match=re.escape(words)):
            patch(model, bad)
    assert _no_patch_left(model)
    patch(model, "fna", towers="vision")
    with pytest.raises(OptionError, match=r"unpatch\(towers=3\): give a tower name or a non-empty sequence"):
        unpatch(model, towers=3)
    with pytest.raises(OptionError, match=r"unpatch\(towers=\(\)\)"):
        unpatch(model, towers=())
    with pytest.raises(PatchStateError, match="tower 'audio' is not a tower of this model"):
        unpatch(model, towers="audio")
    unpatch(model, towers="all")
    assert _no_patch_left(model)


def test_a_packed_layer_records_every_image_of_the_forward():
    model = tiny_vlm("qwen2_vl")
    two = {"pixel_values": torch.randn(16 + 32, 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(1)),
           "image_grid_thw": torch.tensor([[1, 4, 4], [1, 8, 4]])}
    with patched(model, "nystromformer", towers="vision", s=2), record_stats(model, capture=True) as rec, torch.no_grad():
        model.model.get_image_features(**two)
    first = rec.forwards[0][0]
    assert first.queries == 16 + 32 and first.causal_pairs.tolist() == [[16 * 16 + 32 * 32] * 2]  # per head
    assert rec.outputs[0][0].shape[2] == 48  # both images' tokens


def test_the_packed_sequences_refusal_names_the_methods_that_run():
    with pytest.raises(UnsupportedModelError, match=r"methods that implement it: .*nystromformer"):
        patch(tiny_vlm("qwen2_vl"), "fna", towers="vision")
