"""What the evals need from a Hugging Face model besides the patch: its image processor described, the keyword that
lets a ViT take another input size, the projected embedding of a dual encoder's output, and the per-patch features
of a vision tower.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ....errors import OptionError, UnsupportedModelError
from ...adapter import PreprocessConfig
from ...features import check_pixels, float_dtype, input_device, patch_side, vit_patch_tokens
from .modules import block_of, prefix_tokens, routed_in, vision_config

__all__ = ["image_processor_config", "hf_image_pipeline", "interpolate_kwargs", "pooled", "vision_patch_tokens"]


def _field(size: Any, key: str) -> Any:
    if size is None:
        return None
    if isinstance(size, Mapping):
        return size.get(key)
    return getattr(size, key, None)


def _resample_name(resample: Any) -> str | None:
    """A PIL resampling filter (enum or int) as a lower-case name (``"bicubic"``); ``None`` when not given."""
    if resample is None:
        return None
    name = getattr(resample, "name", None)
    if name is None:
        try:
            from PIL import Image

            name = Image.Resampling(int(resample)).name
        except (ImportError, ValueError, TypeError):
            return str(resample)
    return str(name).lower()


def image_processor_config(processor: Any) -> PreprocessConfig:
    """:class:`~attnpatch.patchers.adapter.PreprocessConfig` of a Hugging Face image processor (or of a processor
    holding one as ``image_processor``, e.g. ``CLIPProcessor``), as the eval's preprocessing reads it: resize
    target, centre crop, resample filter, mean / std (0 / 1 with ``do_normalize=False``).

    Raises:
        UnsupportedModelError: ``processor`` is not a Hugging Face image processor.
    """
    proc = getattr(processor, "image_processor", None) or processor
    if isinstance(proc, Mapping) or not callable(proc) or not hasattr(proc, "size"):
        raise UnsupportedModelError(f"expected a Hugging Face image processor, got {type(processor).__name__}")
    size = proc.size
    crop = getattr(proc, "crop_size", None)
    do_crop = bool(getattr(proc, "do_center_crop", False)) and crop is not None
    mean = tuple(float(v) for v in (getattr(proc, "image_mean", None) or (0.0, 0.0, 0.0)))
    std = tuple(float(v) for v in (getattr(proc, "image_std", None) or (1.0, 1.0, 1.0)))
    if not getattr(proc, "do_normalize", True):
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    shortest, height, width = _field(size, "shortest_edge"), _field(size, "height"), _field(size, "width")
    resize = {k: v for k, v in (("shortest_edge", shortest), ("height", height), ("width", width)) if v}
    crop_h, crop_w = (_field(crop, "height"), _field(crop, "width")) if do_crop else (None, None)
    if do_crop:
        side = int(crop_h) if crop_h and crop_h == crop_w else None
    else:
        side = int(height) if height and height == width else None
    return PreprocessConfig(
        library="hf", resolution=side, resize=resize, crop=int(crop_h) if do_crop and crop_h and crop_h == crop_w else None,
        interpolation=_resample_name(getattr(proc, "resample", None)), mean=mean, std=std, native=proc,
    )


def interpolate_kwargs(model: torch.nn.Module, x: torch.Tensor) -> dict[str, bool]:
    """``{"interpolate_pos_encoding": True}`` for a transformers ViT whose forward takes it (ViT, CLIP, SigLIP) on
    images ``x`` ``[B, 3, H, W]`` of another size than its configured ``image_size``, else ``{}`` (DINOv2
    interpolates on its own)."""
    size = getattr(getattr(model, "config", None), "image_size", None)
    if size is None or tuple(x.shape[-2:]) == ((size, size) if isinstance(size, int) else tuple(size)):
        return {}
    try:
        takes = "interpolate_pos_encoding" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return {}
    return {"interpolate_pos_encoding": True} if takes else {}


def pooled(out: Any) -> torch.Tensor:
    """The projected embedding ``[B, D]`` from ``get_*_features`` (a tensor, or an output whose ``pooler_output``,
    ``image_embeds`` or ``text_embeds`` holds it).

    Raises:
        UnsupportedModelError: none of them is a tensor.
    """
    if isinstance(out, torch.Tensor):
        return out
    for key in ("pooler_output", "image_embeds", "text_embeds"):
        val = getattr(out, key, None)
        if isinstance(val, torch.Tensor):
            return val
    raise UnsupportedModelError(f"cannot find the embedding in a {type(out).__name__} (no pooler_output)")


def hf_image_pipeline(proc: Any, resolution: int | None) -> tuple[str, Any, dict[str, Any], tuple[float, ...], tuple[float, ...]] | None:
    """The Hugging Face image processor ``proc``'s own pipeline, rescaled to a square side ``resolution`` (``None``:
    unchanged), with the same crop fraction: a ``shortest_edge`` or ``height``/``width`` resize with a centre crop
    gets the resize target ``round(R * resize / crop)`` and the crop ``R``; a resize straight to ``height``/``width``
    without a crop gets ``R x R``.

    Returns:
        ``(kind, fn, resize, mean, std)``: ``"hf"``, ``fn(list[PIL.Image]) -> [B, 3, R, R]``, what the resize step targets, and the
        normalisation; ``None`` when ``proc`` is not a Hugging Face image processor.

    Raises:
        OptionError: a ``size`` / ``crop_size`` form whose resolution cannot be changed (names both).
    """
    if isinstance(proc, Mapping) or not callable(proc) or not hasattr(proc, "size"):
        return None
    described = image_processor_config(proc)
    mean, std = described.mean, described.std
    size = proc.size
    crop = getattr(proc, "crop_size", None)
    do_crop = bool(getattr(proc, "do_center_crop", False)) and crop is not None
    kwargs: dict = {}
    shortest, height, width = _field(size, "shortest_edge"), _field(size, "height"), _field(size, "width")
    if resolution is None:
        resize = {k: v for k, v in (("shortest_edge", shortest), ("height", height), ("width", width)) if v}
    else:
        r = resolution
        crop_h, crop_w = _field(crop, "height"), _field(crop, "width")
        if do_crop and shortest and crop_h and crop_h == crop_w:
            resize = {"shortest_edge": round(r * shortest / crop_h)}
            kwargs = {"size": dict(resize), "crop_size": {"height": r, "width": r}}
        elif do_crop and height and width and crop_h and crop_w:
            resize = {"height": round(r * height / crop_h), "width": round(r * width / crop_w)}
            kwargs = {"size": dict(resize), "crop_size": {"height": r, "width": r}}
        elif not do_crop and height and width:
            resize = {"height": r, "width": r}
            kwargs = {"size": dict(resize)}
        else:
            raise OptionError(
                f"resolution={resolution}: cannot rescale {type(proc).__name__} with size={size!r}, "
                f"crop_size={crop!r}, do_center_crop={getattr(proc, 'do_center_crop', None)!r}; "
                f"use resolution=None"
            )

    def fn(images):
        return proc(images=images, return_tensors="pt", **kwargs)["pixel_values"]

    return "hf", fn, resize, mean, std


@torch.no_grad()
def vision_patch_tokens(model: torch.nn.Module, pixel_values: torch.Tensor, last: int = 1) -> torch.Tensor:
    """Per-patch features of a model's vision tower: the outputs of its last ``last`` blocks through its final norm
    (``layernorm`` of DINOv2 / ViT, ``post_layernorm`` of CLIP / SigLIP vision), prefix tokens dropped, read back at
    every input patch after a token-merging patch (:func:`~attnpatch.patchers.features.vit_patch_tokens`).

    Runs the vision tower (``model.vision_model`` of a dual encoder such as ``CLIPModel``, else the model) with
    ``interpolate_pos_encoding=True`` on another size than ``config.image_size`` where it takes it.

    Args:
        model: a vision encoder (``Dinov2Model``, ``Dinov2WithRegistersModel``, ``ViTModel``, ``CLIPVisionModel``,
            ``SiglipVisionModel``) or a dual encoder (``CLIPModel``, ``SiglipModel``).
        pixel_values: ``[B, 3, H, W]`` (moved to the model's input device and weight dtype).
        last: how many of the last blocks to read (DINOv2's linear protocol: 1, or 4 concatenated).

    Returns:
        ``[B, H / patch, W / patch, last * C]`` float32 on CPU.

    Raises:
        UnsupportedModelError: no vision tower, or its blocks are not found; OptionError: ``last`` out of range,
        ``pixel_values`` not ``[B, 3, H, W]``.
    """
    towers = {t for _, _, t in routed_in(model, ())}
    if "vision" not in towers:
        raise UnsupportedModelError(f"{type(model).__name__}: per-patch features needs a vision tower; its towers: "
                                    f"{', '.join(sorted(towers)) or 'none'}")
    check_pixels(pixel_values)
    patch = patch_side(getattr(vision_config(model), "patch_size", None) or 0)
    if not patch:
        raise UnsupportedModelError(f"{type(model).__name__}: its vision config has no patch_size")
    tower = getattr(model, "vision_model", None) if "text" in towers else None
    tower = tower if isinstance(tower, torch.nn.Module) else model
    blocks = [b for b in (block_of(model, n) for n, _, _ in routed_in(model, ("vision",))) if b is not None]
    inner = getattr(tower, "vision_model", tower)
    norm = getattr(inner, "layernorm", None) or getattr(inner, "post_layernorm", None)
    x = pixel_values.to(input_device(model), float_dtype(model))
    return vit_patch_tokens(model, lambda: tower(pixel_values=x, **interpolate_kwargs(tower, x)), prefix=prefix_tokens(model, "vision"),
                            blocks=blocks, norm=norm, last=last, grid=(x.shape[-2] // patch, x.shape[-1] // patch))
