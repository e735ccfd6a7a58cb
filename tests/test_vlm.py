"""Vision-language models (tiny random LLaVA, LLaVA-NeXT, Idefics3, SmolVLM, Qwen2-VL): each tower read right."""

from __future__ import annotations

import pytest

from attnpatch.patchers.adapters.hf.modules import prefix_tokens, towers_of
from tiny_models import VLM_FAMILIES, tiny_vlm, tiny_dinov2, tiny_hf_clip

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
