"""Where a model's inputs go, also for a model loaded with a ``device_map`` (accelerate's big-model loading)."""

from __future__ import annotations

from ...patchers.features import input_device

__all__ = ["input_device"]
