"""The model CLIP_benchmark's ``evaluate`` functions call: ``encode_image`` / ``encode_text`` on any CLIP
the project loads (open_clip or Hugging Face), through the model's adapter, with the image tower timed."""

from __future__ import annotations

from typing import Any

import torch

from ...patchers.adapters import adapter_for
from ...timing import Stopwatch

__all__ = ["HarnessModel", "OneImage"]


class HarnessModel:
    """``encode_image`` / ``encode_text`` as CLIP_benchmark calls them (``model.encode_image(images)``,
    ``model.encode_text(tokenizer(texts).to(device))``), answered by
    :meth:`~attnpatch.patchers.adapter.Adapter.embed_image` / ``embed_text`` of ``model``'s adapter, so a
    Hugging Face ``CLIPModel`` (which has no ``encode_image``) runs too. The embeddings are returned as
    the model projects them, unnormalised: CLIP_benchmark normalises them itself.

    Args:
        model: the dual encoder (a :class:`attnpatch.clip_models.ClipBundle`'s ``model``), patched or not.

    Attributes:
        image_seconds: wall seconds spent in ``encode_image`` since :meth:`reset` (device synchronised
            at both ends of each call).
        images: images encoded since :meth:`reset`.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.image_seconds = 0.0
        self.images = 0

    def reset(self) -> None:
        """Zero :attr:`image_seconds` and :attr:`images`."""
        self.image_seconds, self.images = 0.0, 0

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, R, R]`` pixels -> ``[B, D]`` projected image embeddings (timed)."""
        adapter = adapter_for(self.model)
        with Stopwatch(images.device) as sw:
            out = adapter.embed_image(self.model, images)
        self.image_seconds += sw.seconds
        self.images += int(images.shape[0])
        return out

    def encode_text(self, tokens: Any) -> torch.Tensor:
        """Token ids (the bundle tokenizer's output: ``[T, L]`` ids or a ``BatchEncoding``) -> ``[T, D]`` text embeddings."""
        return adapter_for(self.model).embed_text(self.model, tokens)


class OneImage:
    """A per-image transform for a ``torch`` dataset from a batch preprocess: ``PIL image -> [3, R, R]``.

    Args:
        preprocess: ``list[PIL.Image] -> [B, 3, R, R]`` (a bundle's ``preprocess``).
    """

    def __init__(self, preprocess):
        self.preprocess = preprocess

    def __call__(self, image) -> torch.Tensor:
        return self.preprocess([image])[0]
