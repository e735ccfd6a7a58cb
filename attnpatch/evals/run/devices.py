"""Where a model's inputs go, also for a model loaded with a ``device_map`` (accelerate's big-model loading)."""

from __future__ import annotations

import torch

__all__ = ["input_device"]


def input_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's input embeddings (a causal LM's token embeddings; else its first parameter, e.g. a
    ViT's class token); the CPU when those weights are offloaded (on ``meta``: accelerate's hooks bring them in
    from CPU memory or disk and run the module on the CPU)."""
    try:
        dev = model.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        dev = next(model.parameters()).device
    return torch.device("cpu") if dev.type == "meta" else dev
