"""Where an open_clip model's towers and attention modules are: the image tower (``VisionTransformer``), the text
tower (``TextTransformer`` or the ``transformer`` of the ``CLIP`` class) and their blocks.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["open_clip_transformer", "is_open_clip", "vision_root", "text_root", "tower_modules"]


def open_clip_transformer() -> Any:
    """The ``open_clip.transformer`` module, or ``None`` where open_clip is not installed (the adapter then handles nothing)."""
    try:
        from open_clip import transformer as oct
    except ImportError:  # open_clip not installed: this adapter handles nothing
        return None
    return oct


def is_open_clip(model: torch.nn.Module) -> bool:
    """Whether ``model``'s class comes from the ``open_clip`` package."""
    return type(model).__module__.split(".")[0] == "open_clip"


def vision_root(model: torch.nn.Module) -> torch.nn.Module | None:
    """The open_clip ``VisionTransformer`` of ``model`` (the model itself, or its ``visual``), else ``None``."""
    oct = open_clip_transformer()
    if oct is None:
        return None
    if isinstance(model, oct.VisionTransformer):
        return model
    visual = getattr(model, "visual", None)
    return visual if isinstance(visual, oct.VisionTransformer) else None


def text_root(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(root called once per text forward, Transformer holding the resblocks)`` of the text tower, or ``None``."""
    oct = open_clip_transformer()
    if oct is None:
        return None
    if isinstance(model, oct.TextTransformer):
        return model, model.transformer
    text = getattr(model, "text", None)
    if isinstance(text, oct.TextTransformer):
        return text, text.transformer
    tr = getattr(model, "transformer", None)  # open_clip.model.CLIP keeps its text transformer at top level
    if isinstance(tr, oct.Transformer) and hasattr(model, "token_embedding") and not isinstance(model, oct.VisionTransformer):
        return tr, tr
    return None


def _blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    return list(getattr(transformer, "resblocks", []))


def tower_modules(model: torch.nn.Module, tower: str) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """``(block, attention module)`` of every block of ``tower`` (``"vision"`` / ``"text"``), in order; ``[]`` if absent."""
    if tower == "vision":
        root = vision_root(model)
        blocks = _blocks(root.transformer) if root is not None else []
    elif tower == "text":
        found = text_root(model)
        blocks = _blocks(found[1]) if found is not None else []
    else:
        return []
    return [(b, b.attn) for b in blocks if isinstance(getattr(b, "attn", None), torch.nn.Module)]
