"""Hugging Face block forwards split between the attention and the MLP branch, for methods with a block hook (ToMe),
and the read-out rule: which model classes read their output from the class token (or hand out every token).

Each forward is the layer's ``forward`` as ``transformers`` writes it, with ``x = hook(x)`` between
``x = x + attention(...)`` and ``x = x + mlp(...)``; :func:`~attnpatch.patchers.class_swap.wrap_blocks`
swaps a layer's class for a subclass whose forward calls it.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["hf_block_forwards", "HF_TOKEN_READOUT_MODELS"]


def _hf_dinov2_layer(self, hook, hidden_states, attention_mask=None, **kwargs):
    residual = hidden_states
    h, _ = self.attention(self.norm1(hidden_states), attention_mask=attention_mask, **kwargs)
    x = self.drop_path(self.layer_scale1(h)) + residual
    x = hook(x)
    return self.drop_path(self.layer_scale2(self.mlp(self.norm2(x)))) + x


def _hf_vit_layer(self, hook, hidden_states, attention_mask=None, **kwargs):
    residual = hidden_states
    h, _ = self.attention(self.layernorm_before(hidden_states), attention_mask, **kwargs)
    x = self.dropout(h) + residual
    x = hook(x)
    return self.dropout(self.mlp(self.layernorm_after(x))) + x


def _hf_clip_layer(self, hook, hidden_states, attention_mask=None, **kwargs):
    residual = hidden_states
    h, _ = self.self_attn(hidden_states=self.layer_norm1(hidden_states), attention_mask=attention_mask, **kwargs)
    x = residual + h
    x = hook(x)
    return x + self.mlp(self.layer_norm2(x))


def hf_block_forwards() -> dict[type, Callable[..., Any]]:
    """Hugging Face encoder layers a method with a block hook (ToMe) can split, with their forwards: DINOv2
    (with and without registers), ViT, CLIP's vision layers.  Each is the layer's ``forward`` as
    ``transformers`` writes it with ``x = hook(x)`` (``[B, N, C]``) between the attention and the MLP
    branch; ``hook`` returning ``x`` gives the library's own forward."""
    out: dict[type, Callable[..., Any]] = {}
    for module, name, fwd in (
        ("transformers.models.dinov2.modeling_dinov2", "Dinov2Layer", _hf_dinov2_layer),
        ("transformers.models.dinov2_with_registers.modeling_dinov2_with_registers", "Dinov2WithRegistersLayer", _hf_dinov2_layer),
        ("transformers.models.vit.modeling_vit", "ViTLayer", _hf_vit_layer),
        ("transformers.models.clip.modeling_clip", "CLIPEncoderLayer", _hf_clip_layer),
    ):
        try:
            mod = __import__(module, fromlist=[name])
        except ImportError:  # pragma: no cover - a transformers build without that model
            continue
        cls = getattr(mod, name, None)
        if cls is not None:
            out[cls] = fwd
    return out


#: Hugging Face model classes whose outputs read the class token (or hand out every token), so a
#: block-hook method that merges tokens leaves their read-out as it is.
HF_TOKEN_READOUT_MODELS = frozenset({
    "Dinov2Model", "Dinov2WithRegistersModel", "ViTModel", "ViTForImageClassification", "CLIPModel", "CLIPVisionModel",
    "CLIPVisionModelWithProjection",
})
