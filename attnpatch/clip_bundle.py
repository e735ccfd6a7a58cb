"""The dual encoder :func:`attnpatch.clip_models.load_clip` returns: a CLIP-style model with its preprocessing and
tokenizer, whose embeddings come from the model's adapter (:meth:`~attnpatch.patchers.adapter.Adapter.embed_image`,
:meth:`~attnpatch.patchers.adapter.Adapter.embed_text`), so no branch here knows the model library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .errors import OptionError
from .patchers.adapters import adapter_for

__all__ = ["ClipBundle"]


@dataclass
class ClipBundle:
    """A dual encoder with its preprocessing, ready for zero-shot classification and retrieval.

    Attributes:
        model: the ``torch.nn.Module`` (open_clip ``CLIP`` / ``CustomTextCLIP`` or a Hugging Face
            ``CLIPModel`` / ``SiglipModel``), in eval mode; patch it with ``attnpatch.patch``.
        preprocess: ``list[PIL.Image] -> [B, 3, R, R]`` float32 (the model's own evaluation
            transform: resize, center crop, normalise), an :class:`attnpatch.evals.vision.preprocess.Preprocess`.
        tokenizer: ``list[str] -> token ids``: an ``[T, L]`` int64 tensor (open_clip, ``L`` = 77)
            or a dict with ``input_ids`` / ``attention_mask`` ``[T, L]`` (Hugging Face, padded to
            the model's maximum length).
        kind: ``"open_clip"`` or ``"hf"``.
        name: the name it was loaded by.
        resolution: input side ``R`` in pixels.
        embed_dim: dimension ``D`` of the joint embedding.
        random_init: whether the weights are random (``ARCH:random``).
    """

    model: torch.nn.Module
    preprocess: Callable
    tokenizer: Callable
    kind: str
    name: str
    resolution: int
    embed_dim: int
    random_init: bool = False

    @property
    def device(self) -> torch.device:
        """Device of the model's weights."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the model's floating-point weights."""
        return next(p for p in self.model.parameters() if p.is_floating_point()).dtype

    @torch.no_grad()
    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """L2-normalised image embeddings.

        Args:
            pixel_values: ``[B, 3, R, R]`` float, as :attr:`preprocess` returns.

        Returns:
            ``[B, D]`` float32 on CPU, unit L2 norm per row.

        Raises:
            OptionError: ``pixel_values`` is not a ``[B, 3, H, W]`` tensor.
        """
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4 or pixel_values.shape[1] != 3:
            shape = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
            raise OptionError(f"pixel_values: expected a [B, 3, H, W] tensor, got {shape}")
        feats = adapter_for(self.model).embed_image(self.model, pixel_values)
        return torch.nn.functional.normalize(feats.float(), dim=-1).cpu()

    @torch.no_grad()
    def encode_text(self, texts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
        """L2-normalised text embeddings, ``batch_size`` texts per forward call.

        Args:
            texts: the strings (tokenised with :attr:`tokenizer`; CLIP truncates at 77 tokens).
            batch_size: texts per forward call (positive int).

        Returns:
            ``[T, D]`` float32 on CPU, unit L2 norm per row.

        Raises:
            OptionError: ``texts`` is empty or holds a non-string; ``batch_size`` not a positive int.
        """
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        if not texts:
            raise OptionError("texts: empty list; pass at least one string")
        bad = [type(t).__name__ for t in texts if not isinstance(t, str)]
        if bad:
            raise OptionError(f"texts: expected strings, got {bad[0]}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise OptionError(f"batch_size={batch_size!r}: must be a positive int (texts per forward call)")
        out = []
        for s in range(0, len(texts), batch_size):
            feats = adapter_for(self.model).embed_text(self.model, self.tokenizer(texts[s : s + batch_size]))
            out.append(torch.nn.functional.normalize(feats.float(), dim=-1).cpu())
        return torch.cat(out)

    def vision_tokens(self) -> int:
        """Tokens ``N`` the image tower's attention sees at :attr:`resolution` (patches + class token, if any).

        Raises:
            UnsupportedModelError: the adapter cannot tell the tower's patch size (e.g. an open_clip timm trunk).
        """
        return adapter_for(self.model).token_count(self.model, self.resolution)
