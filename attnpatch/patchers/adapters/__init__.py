"""The model-library adapters, in the order :func:`attnpatch.patch` tries them.

A new adapter is one new module here implementing :class:`~attnpatch.patchers.adapter.Adapter`
and one line in :data:`ADAPTERS`; the patch, its error messages and the tests walk this list.
"""

from __future__ import annotations

from ..adapter import Adapter
from .hf import HFAdapter
from .open_clip import OpenClipAdapter
from .timm import TimmAdapter

__all__ = ["ADAPTERS", "Adapter", "HFAdapter", "TimmAdapter", "OpenClipAdapter"]

#: Every adapter, tried in this order; the first whose ``detect`` returns a kind handles the model.
ADAPTERS: tuple[Adapter, ...] = (
    HFAdapter,
    TimmAdapter,
    OpenClipAdapter,
)
