"""Block forwards split between the attention and the MLP branch, for methods with a block hook (ToMe).

Each function is one library's block ``forward`` as that library writes it, with ``x = hook(x)``
between ``x = x + attention(...)`` and ``x = x + mlp(...)``; ``hook`` takes and returns the
residual stream batch first, ``[B, N, C]``.  :func:`attnpatch.patchers.runtime.wrap_blocks` swaps a
block's class for a subclass whose forward calls these.  ``r = 0`` (the hook returns ``x``) gives
what the library's own forward gives; a test holds each one to that.

Read-outs: merging changes the token count, so a model may take a block-hook method only where its
output is read from the class token (or handed out whole); :func:`readout_refusal` says where not.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["timm_block_forwards", "open_clip_block_forwards", "hf_block_forwards", "HF_TOKEN_READOUT_MODELS"]


# --------------------------------------------------------------------------- timm


def _timm_block(self, hook, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
    x = hook(x)
    return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def timm_block_forwards() -> dict[type, Callable[..., Any]]:
    """``{timm.models.vision_transformer.Block: forward}`` (other timm block kinds are not split)."""
    try:
        from timm.models.vision_transformer import Block
    except ImportError:  # pragma: no cover
        return {}
    return {Block: _timm_block}


# --------------------------------------------------------------------------- open_clip


def _batch_first_hook(self, hook, x: torch.Tensor) -> torch.Tensor:
    if getattr(self.attn, "batch_first", True):
        return hook(x)
    return hook(x.transpose(0, 1)).transpose(0, 1)


def _oc_residual_block(self, hook, q_x, k_x=None, v_x=None, attn_mask=None):
    if k_x is not None or v_x is not None:
        from ...errors import UnsupportedModelError

        raise UnsupportedModelError("a block-hook method on an open_clip cross-attention call (k_x / v_x given): only self-attention blocks are supported")
    x = q_x + self.ls_1(self.attention(q_x=self.ln_1(q_x), attn_mask=attn_mask))
    x = _batch_first_hook(self, hook, x)
    return x + self.ls_2(self.mlp(self.ln_2(x)))


def _oc_custom_block(self, hook, x, attn_mask=None):
    x = x + self.ls_1(self.ln_attn(self.attn(self.ln_1(x), attn_mask=attn_mask)))
    x = _batch_first_hook(self, hook, x)
    return x + self.ls_2(self.mlp(self.ln_2(x)))


def open_clip_block_forwards() -> dict[type, Callable[..., Any]]:
    """``{ResidualAttentionBlock: forward, CustomResidualAttentionBlock: forward}`` of ``open_clip.transformer``."""
    try:
        from open_clip import transformer as oct
    except ImportError:  # pragma: no cover
        return {}
    return {oct.ResidualAttentionBlock: _oc_residual_block, oct.CustomResidualAttentionBlock: _oc_custom_block}


# --------------------------------------------------------------------------- Hugging Face


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
    """Hugging Face encoder layers that are split: DINOv2 (with and without registers), ViT, CLIP's vision layers."""
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
