"""The tiny random models of the tests, one factory per family, each with the defaults most tests use.

Every factory takes keyword overrides for the config values a test needs otherwise, and ``seed``: the
``torch.manual_seed`` run right before the weights are initialised (``None``: the global generator as it is,
for tests that never seeded).  Nothing here downloads: every model is built from a config with random weights.

Imported as ``from tiny_models import tiny_dinov2`` (pytest puts ``tests/`` on ``sys.path`` through the
rootdir-level ``conftest.py``, as for ``throwaway_method``).  Not named ``models``: ``tests/`` comes first on
``sys.path``, so a generic name would shadow any installed top-level ``models`` package a dependency imports.
"""

from __future__ import annotations

from typing import Any

import torch

# --------------------------------------------------------------------------- Hugging Face DINOv2

#: A 4-layer DINOv2, 4 heads of 16, 70 px at patch 14: 25 patches + CLS = 26 tokens.  (``intermediate_size`` is
#: not a Dinov2Config field, ``mlp_ratio`` sets the MLP width; it is passed as the tests always passed it.)
DINOV2 = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, image_size=70, patch_size=14)

#: The narrow variant several tests use (hidden 32, 2 heads): ``tiny_dinov2(**NARROW_DINOV2, num_hidden_layers=2, image_size=56)``.
NARROW_DINOV2 = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64)


def dinov2_config(registers: int = 0, **overrides: Any):
    """A ``Dinov2Config`` (``Dinov2WithRegistersConfig`` with ``registers`` register tokens) of :data:`DINOV2` updated by
    ``overrides``; an override of ``None`` leaves that field out (``intermediate_size=None``: the config as written
    without it)."""
    from transformers import Dinov2Config, Dinov2WithRegistersConfig

    kw = {k: v for k, v in {**DINOV2, **overrides}.items() if v is not None}
    if registers:
        return Dinov2WithRegistersConfig(num_register_tokens=registers, **kw)
    return Dinov2Config(**kw)


def tiny_dinov2(registers: int = 0, *, seed: int | None = 0, **overrides: Any):
    """A random ``Dinov2Model`` (``Dinov2WithRegistersModel`` with ``registers`` > 0) of :func:`dinov2_config`, in eval mode."""
    from transformers import Dinov2Model, Dinov2WithRegistersModel

    cfg = dinov2_config(registers, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    return (Dinov2WithRegistersModel if registers else Dinov2Model)(cfg).eval()


# --------------------------------------------------------------------------- Hugging Face ViT

#: A 2-layer transformers ViT, hidden 32, 2 heads, 32 px at patch 8 (16 patches + CLS = 17 tokens).
HF_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)


def tiny_hf_vit(*, seed: int | None = 0, add_pooling_layer: bool = False, **overrides: Any):
    """A random ``ViTModel`` of :data:`HF_VIT` updated by ``overrides`` (no pooling layer unless asked), in eval mode."""
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(**{**HF_VIT, **overrides})
    if seed is not None:
        torch.manual_seed(seed)
    return ViTModel(cfg, add_pooling_layer=add_pooling_layer).eval()


# --------------------------------------------------------------------------- Hugging Face causal LMs

#: A 2-layer Llama / Qwen2 / Qwen3: hidden 64, 4 query heads and 2 KV heads of 16, vocabulary 128.
CAUSAL_LM = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, attn_implementation="sdpa",
)


def _causal_lm_classes(kind: str):
    from transformers import (
        LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    return {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]


def causal_lm_config(kind: str = "llama", **overrides: Any):
    """The config of ``kind`` (``"llama"``, ``"qwen2"``, ``"qwen3"``): :data:`CAUSAL_LM` updated by ``overrides``."""
    return _causal_lm_classes(kind)[0](**{**CAUSAL_LM, **overrides})


def tiny_causal_lm(kind: str = "llama", seed: int | None = 0, layers: int = 2, vocab: int = 128, *, sharpen: float = 6.0,
                   **overrides: Any):
    """A randomly initialised Llama / Qwen2 / Qwen3 of a few hundred thousand parameters, in eval mode.

    ``sharpen`` multiplies every layer's q and k projection weights (random init gives near-uniform attention, so
    thresholds would select nothing); 1.0 leaves the weights as initialised.
    """
    cfg = causal_lm_config(kind, num_hidden_layers=layers, vocab_size=vocab, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    model = _causal_lm_classes(kind)[1](cfg).eval()
    if sharpen != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(sharpen)
                layer.self_attn.k_proj.weight.mul_(sharpen)
    return model


# --------------------------------------------------------------------------- Hugging Face CLIP / SigLIP

#: Text tower: 2 layers, hidden 32, 4 heads, vocabulary 100, 16 positions.
HF_CLIP_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
                    max_position_embeddings=16)
#: Vision tower: 3 layers, hidden 32, 4 heads, 32 px at patch 8 (16 patches + CLS for CLIP, 16 for SigLIP).
HF_CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32,
                      patch_size=8)


def tiny_hf_clip(family: str = "clip", *, seed: int | None = 0, text: dict | None = None, vision: dict | None = None,
                 **overrides: Any):
    """A random ``CLIPModel`` (``family="clip"``, ``projection_dim=16`` unless overridden) or ``SiglipModel``
    (``"siglip"``) with the towers :data:`HF_CLIP_TEXT` / :data:`HF_CLIP_VISION` updated by ``text`` / ``vision``,
    in eval mode; ``overrides`` go to the top-level config."""
    from transformers import CLIPConfig, CLIPModel, SiglipConfig, SiglipModel

    tc, vc = {**HF_CLIP_TEXT, **(text or {})}, {**HF_CLIP_VISION, **(vision or {})}
    if family == "clip":
        cfg, cls = CLIPConfig(text_config=tc, vision_config=vc, **{"projection_dim": 16, **overrides}), CLIPModel
    elif family == "siglip":
        cfg, cls = SiglipConfig(text_config=tc, vision_config=vc, **overrides), SiglipModel
    else:
        raise ValueError(f"family={family!r}: 'clip' or 'siglip'")
    if seed is not None:
        torch.manual_seed(seed)
    return cls(cfg).eval()


# --------------------------------------------------------------------------- open_clip CLIP

#: Image tower: 64 px at patch 8 (64 patches + CLS = 65 tokens), width 64, 4 heads of 16, 4 layers.
OPEN_CLIP_VISION = dict(image_size=64, patch_size=8, width=64, head_width=16, layers=4)
#: Text tower: open_clip's 77-token context and BPE vocabulary, width 32, 4 heads, 2 layers.
OPEN_CLIP_TEXT = dict(context_length=77, vocab_size=49408, width=32, heads=4, layers=2)


def open_clip_cfg(vision: dict | None = None, text: dict | None = None) -> dict[str, Any]:
    """The keyword arguments of ``open_clip.model.CLIP`` (also what an ``open_clip_config.json``'s ``model_cfg``
    holds): embed_dim 32, quick GELU, the towers :data:`OPEN_CLIP_VISION` / :data:`OPEN_CLIP_TEXT` updated by
    ``vision`` / ``text``."""
    return dict(embed_dim=32, vision_cfg={**OPEN_CLIP_VISION, **(vision or {})}, text_cfg={**OPEN_CLIP_TEXT, **(text or {})},
                quick_gelu=True)


def tiny_open_clip(*, seed: int | None = 0, vision: dict | None = None, text: dict | None = None):
    """A random ``open_clip.model.CLIP`` of :func:`open_clip_cfg`, in eval mode."""
    import open_clip

    if seed is not None:
        torch.manual_seed(seed)
    return open_clip.model.CLIP(**open_clip_cfg(vision, text)).eval()


# --------------------------------------------------------------------------- timm ViTs

#: A 2-layer timm ViT, width 64, 4 heads, 48 px at patch 8 (36 patches + CLS = 37 tokens), no head.
TIMM_VIT = dict(img_size=48, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=0)


def tiny_timm_vit(*, seed: int | None = 0, **overrides: Any):
    """A random ``timm.models.vision_transformer.VisionTransformer`` of :data:`TIMM_VIT` updated by ``overrides``, in eval mode."""
    from timm.models.vision_transformer import VisionTransformer

    if seed is not None:
        torch.manual_seed(seed)
    return VisionTransformer(**{**TIMM_VIT, **overrides}).eval()


def timm_vit_tiny(*, seed: int | None = 0, **overrides: Any):
    """timm's ``vit_tiny_patch16_224`` (width 192, 3 heads) with random weights (``pretrained=False``: nothing is
    downloaded) at 64 px (16 patches + CLS), no head, in eval mode; ``overrides`` go to ``timm.create_model``."""
    import timm

    if seed is not None:
        torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", **{"pretrained": False, "img_size": 64, "num_classes": 0, **overrides}).eval()


# --------------------------------------------------------------------------- vision-language models

#: The language model of every tiny VLM: a 2-layer Llama-shaped decoder, hidden 64, 4 heads (2 KV heads), vocab 256.
VLM_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
#: The vision tower of the CLIP-tower VLMs (LLaVA, LLaVA-NeXT) and of Idefics3 / SmolVLM: 2 layers, hidden 32, 2 heads,
#: 32 px at patch 8 (16 patches).
VLM_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
VLM_FAMILIES = ("llava", "llava_next", "idefics3", "smolvlm", "qwen2_vl")


def tiny_vlm(family: str, *, seed: int | None = 0):
    """A random tiny VLM of ``family`` (:data:`VLM_FAMILIES`), in eval mode: its language model :data:`VLM_TEXT`
    (Qwen2-VL: the same sizes with M-RoPE), its vision tower :data:`VLM_VISION` (Qwen2-VL: depth 2, width 32, patch 8,
    2x2 merge); image token id 255."""
    import transformers as tf

    if seed is not None:
        torch.manual_seed(seed)
    text = tf.LlamaConfig(**VLM_TEXT).to_dict()
    if family == "llava":
        cfg = tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(**VLM_VISION).to_dict(), text_config=text,
                             image_token_index=255, vision_feature_layer=-1)
        return tf.LlavaForConditionalGeneration(cfg).eval()
    if family == "llava_next":
        cfg = tf.LlavaNextConfig(vision_config=tf.CLIPVisionConfig(**VLM_VISION).to_dict(), text_config=text,
                                 image_token_index=255, vision_feature_layer=-1, image_grid_pinpoints=[[32, 32], [32, 64]])
        return tf.LlavaNextForConditionalGeneration(cfg).eval()
    if family in ("idefics3", "smolvlm"):
        cls_cfg, cls = ((tf.Idefics3Config, tf.Idefics3ForConditionalGeneration) if family == "idefics3"
                        else (tf.SmolVLMConfig, tf.SmolVLMForConditionalGeneration))
        return cls(cls_cfg(vision_config=dict(VLM_VISION), text_config=text, image_token_id=255, scale_factor=2)).eval()
    if family == "qwen2_vl":
        cfg = tf.Qwen2VLConfig(
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                               in_chans=3, temporal_patch_size=2),
            text_config={**{k: v for k, v in VLM_TEXT.items() if k != "max_position_embeddings"},
                         "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]}, "bos_token_id": 0, "eos_token_id": 1},
            image_token_id=255, video_token_id=254, vision_start_token_id=253)
        return tf.Qwen2VLForConditionalGeneration(cfg).eval()
    raise ValueError(f"family={family!r}: one of {', '.join(VLM_FAMILIES)}")


def vlm_inputs(family: str, model, *, text: int = 40, seed: int = 0, padded: bool = False) -> dict:
    """One prompt for :func:`tiny_vlm` ``family``: ``text`` random text tokens around one 32 px image's tokens (as many
    as the model's own ``get_image_features`` gives), with the family's pixel inputs (LLaVA-NeXT: 2 tiles and
    ``image_sizes``; Idefics3 / SmolVLM: ``[1, 1, 3, 32, 32]``, and with ``padded`` a ``pixel_attention_mask`` whose
    right half is padding; Qwen2-VL: 16 flattened patches, ``image_grid_thw`` and ``mm_token_type_ids``)."""
    g = torch.Generator().manual_seed(seed)
    inner = model.model
    extra: dict = {}
    if family == "llava":
        extra["pixel_values"] = torch.randn(1, 3, 32, 32, generator=g)
    elif family == "llava_next":
        extra.update(pixel_values=torch.randn(1, 2, 3, 32, 32, generator=g), image_sizes=torch.tensor([[32, 32]]))
    elif family in ("idefics3", "smolvlm"):
        extra["pixel_values"] = torch.randn(1, 1, 3, 32, 32, generator=g)
        if padded:
            mask = torch.ones(1, 1, 32, 32, dtype=torch.bool)
            mask[..., 16:] = False
            extra["pixel_attention_mask"] = mask
    elif family == "qwen2_vl":
        extra.update(pixel_values=torch.randn(16, 3 * 2 * 8 * 8, generator=g), image_grid_thw=torch.tensor([[1, 4, 4]]))
    else:
        raise ValueError(f"family={family!r}: one of {', '.join(VLM_FAMILIES)}")
    with torch.no_grad():
        out = inner.get_image_features(**extra)
    feats = out.pooler_output if getattr(out, "pooler_output", None) is not None else out
    feats = list(feats) if isinstance(feats, (list, tuple)) else [feats]
    count = sum(f.shape[:-1].numel() for f in feats)
    ids = torch.randint(3, 250, (1, text), generator=g)
    image = torch.full((1, count), 255)
    start = torch.tensor([[253]]) if family == "qwen2_vl" else torch.empty(1, 0, dtype=torch.long)
    ids = torch.cat([ids[:, :2], start, image, ids[:, 2:]], 1)
    if family == "qwen2_vl":
        extra["mm_token_type_ids"] = (ids == 255).long()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **extra}
