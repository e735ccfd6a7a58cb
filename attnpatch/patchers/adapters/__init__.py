"""The model-library adapters, in the order :func:`attnpatch.patch` tries them.

A new adapter is one new module here implementing :class:`~attnpatch.patchers.adapter.Adapter`
and one line in :data:`ADAPTERS`; the patch, its error messages and the tests walk this list.
:func:`adapter_for` finds a model's adapter (for the evals: patch size, token count, preprocessing,
feature extraction, without a model-library branch of their own).
"""

from __future__ import annotations

import torch

from ...errors import OptionError, UnsupportedModelError
from ..adapter import Adapter, PreprocessConfig
from .hf import HFAdapter
from .open_clip import OpenClipAdapter
from .timm import TimmAdapter

__all__ = ["ADAPTERS", "Adapter", "PreprocessConfig", "HFAdapter", "TimmAdapter", "OpenClipAdapter", "adapter_for", "detect", "image_pipeline", "supported_text"]

#: Every adapter, tried in this order; the first whose ``detect`` returns a kind handles the model.
ADAPTERS: tuple[Adapter, ...] = (
    HFAdapter,
    TimmAdapter,
    OpenClipAdapter,
)


def detect(model: torch.nn.Module) -> tuple[Adapter, str] | None:
    """``(adapter, kind)`` of the first adapter of :data:`ADAPTERS` that handles ``model``, else ``None``."""
    for adapter in ADAPTERS:
        kind = adapter.detect(model)
        if kind is not None:
            return adapter, kind
    return None


def supported_text() -> str:
    """What the adapters support, as one phrase (each adapter's ``supports``, joined with commas and "and")."""
    phrases = [a.supports for a in ADAPTERS]
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]


def adapter_for(model: torch.nn.Module) -> Adapter:
    """The adapter of :data:`ADAPTERS` that handles ``model`` (the one :func:`attnpatch.patch` would use).

    Raises:
        UnsupportedModelError: no adapter handles it; the message names the model's class and lists what
            each adapter supports.
    """
    found = detect(model)
    if found is None:
        raise UnsupportedModelError(
            f"no attnpatch adapter handles a {type(model).__module__}.{type(model).__name__}: supported are {supported_text()}"
        )
    return found[0]


def image_pipeline(processor, resolution: int | None):
    """``(library, fn, resize, mean, std)``: the pipeline of the first adapter of :data:`ADAPTERS` that knows
    ``processor`` (:meth:`~attnpatch.patchers.adapter.Adapter.image_pipeline`).

    Raises:
        OptionError: no adapter knows it (the message names its type), or its form cannot be rescaled.
    """
    for adapter in ADAPTERS:
        got = adapter.image_pipeline(processor, resolution)
        if got is not None:
            return got
    raise OptionError(
        f"image_processor: expected a Hugging Face image processor or a timm data config dict, got {type(processor).__name__}"
    )
