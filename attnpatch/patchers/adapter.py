"""The adapter contract: what :func:`attnpatch.patch` needs from a model library's adapter.

An adapter routes one library's attention modules through :func:`~attnpatch.patchers.runtime.run_layer`
(or :func:`~attnpatch.patchers.runtime.run_module`) and restores them bit for bit.  The adapters
are listed, in the order the patch tries them, in :data:`attnpatch.patchers.adapters.ADAPTERS`:
a new one is one new module in that package plus one line in that list.  Adapters import the
runtime, the registry and the per-forward state, never the public API (:mod:`.api`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # annotations only: no import at run time
    from .registry import ModelGeometry
    from .runtime import PatchHandle

__all__ = ["Adapter"]


@runtime_checkable
class Adapter(Protocol):
    """One model library's adapter (a class of static methods, or any object with these members).

    Attributes:
        library: the library in a few words (``"Hugging Face transformers"``).
        supports: which of its models the adapter handles, as one phrase; the error for an
            unsupported model lists the phrases of every adapter.
    """

    library: str
    supports: str

    def detect(self, model: torch.nn.Module) -> str | None:
        """The model's kind (``"causal_lm"``, ``"vision"``, ``"text"``) if this adapter handles it, else ``None``."""

    def towers(self, model: torch.nn.Module) -> dict[str, str]:
        """Every tower of the model (``"vision"``, ``"text"``) and its kind, in model order."""

    def default_towers(self, model: torch.nn.Module) -> tuple[str, ...]:
        """The towers routed when ``patch(towers=None)``."""

    def check(self, handle: PatchHandle) -> None:
        """Model checks before anything is changed (raises ``UnsupportedModelError``); method options are checked by the method."""

    def features(self, handle: PatchHandle) -> dict[str, str]:
        """Model features of :data:`~attnpatch.patchers.registry.MODEL_FEATURES` the routed attention uses, with where."""

    def geometry(self, handle: PatchHandle) -> ModelGeometry:
        """Layers, heads, key/value heads and head size of the routed attention (for the method's check)."""

    def layer_count(self, handle: PatchHandle) -> int:
        """Number of attention modules the patch routes."""

    def prefix_tokens(self, model: torch.nn.Module, kind: str) -> int:
        """Leading special tokens (CLS + registers) of a tower of kind ``kind`` (0 for causal LMs)."""

    def roots(self, handle: PatchHandle) -> list[torch.nn.Module]:
        """Modules whose call is one whole forward pass (each gets the per-forward state hooks)."""

    def apply(self, handle: PatchHandle) -> Any:
        """Route the chosen towers' attention through the handle; sets ``handle.num_layers`` and
        ``handle.prefix_tokens``; returns what :meth:`restore` needs."""

    def restore(self, handle: PatchHandle, undo: Any) -> None:
        """Undo :meth:`apply`: the model computes bit for bit what it computed before."""
