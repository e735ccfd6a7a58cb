"""The adapter contract: what :func:`attnpatch.patch` and the evals need from a model library's adapter.

An adapter routes one library's attention modules through :func:`~attnpatch.patchers.runtime.run_layer`
(or :func:`~attnpatch.patchers.runtime.run_module`) and restores them bit for bit.  The adapters
are listed, in the order the patch tries them, in :data:`attnpatch.patchers.adapters.ADAPTERS`:
a new one is one new module in that package plus one line in that list.  Adapters import the
runtime, the method contract and the per-forward state, never the public API (:mod:`.api`).

Everything a model library knows lives in its adapter: besides the patch, the adapter answers the
evals' questions about a model (patch size, token count, preprocessing, feature extraction), so that
no eval branches on the model library (:func:`attnpatch.patchers.adapters.adapter_for` finds the
adapter).  Each answer is the model's or a refusal (:class:`~attnpatch.errors.UnsupportedModelError`
naming the model), never a silent default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

import torch

from ..errors import OptionError

if TYPE_CHECKING:  # annotations only: no import at run time
    from .contract import ModelGeometry
    from .runtime import PatchHandle

__all__ = ["Adapter", "PreprocessConfig", "KIND_NOTE", "tower_kinds", "routed_kind", "choose_towers", "tower_methods"]


@dataclass(frozen=True)
class PreprocessConfig:
    """A model's own image preprocessing, described library-neutrally (what :meth:`Adapter.preprocess_config` returns).

    Attributes:
        library: whose pipeline it is: ``"hf"`` (a Hugging Face image processor), ``"timm"`` (a timm data
            config) or ``"open_clip"`` (open_clip's ``preprocess_cfg``).
        resolution: side in pixels of the square input the pipeline makes, or ``None`` where it does not
            make a square one (an HF processor that only resizes the shortest edge).
        resize: what the resize step targets before the crop, as the eval's ``Preprocess.resize`` records
            it (``{"shortest_edge": 256}``, ``{"height": 224, "width": 224}``, ``{"scale_size": 256}``,
            ``{"shortest_edge": 224, "mode": "shortest"}``).
        crop: side in pixels of the centre crop, or ``None`` without one.
        interpolation: the resize filter (``"bicubic"``, ``"bilinear"``, ...), or ``None`` where not given.
        mean, std: per-channel normalisation, in units of ``[0, 1]`` pixel values (the pipeline computes
            ``(x / 255 - mean) / std``).
        native: what the library's own pipeline takes: the HF image processor, the timm data config dict
            (``input_size``, ``interpolation``, ``mean``, ``std``, ``crop_pct``, ``crop_mode``), or
            open_clip's ``preprocess_cfg`` dict.
    """

    library: str
    resolution: int | None
    resize: dict[str, Any]
    crop: int | None
    interpolation: str | None
    mean: tuple[float, ...]
    std: tuple[float, ...]
    native: Any = field(default=None, repr=False, compare=False)


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

    # ------------------------------------------------------------------ the patch

    def detect(self, model: torch.nn.Module) -> str | None:
        """The model's kind (``"causal_lm"``, ``"vision"``, ``"text"``) if this adapter handles it, else ``None``."""

    def towers(self, model: torch.nn.Module) -> dict[str, str]:
        """Every tower of the model (``"vision"``, ``"text"``) and its kind, in model order."""

    def default_towers(self, model: torch.nn.Module) -> tuple[str, ...]:
        """The towers routed when ``patch(towers=None)``."""

    def check(self, handle: PatchHandle) -> None:
        """Model checks before anything is changed (raises ``UnsupportedModelError``); method options are checked by the method."""

    def features(self, handle: PatchHandle) -> dict[str, str]:
        """Model features of :data:`~attnpatch.patchers.contract.MODEL_FEATURES` the routed attention uses, with where."""

    def geometry(self, model: torch.nn.Module, towers: tuple[str, ...], kind: str) -> ModelGeometry:
        """Layers, heads, key/value heads and head size of the attention of ``towers`` (for the method's check and
        :func:`attnpatch.model_geometry`), read from the model without changing it; ``kind`` is recorded."""

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

    # ------------------------------------------------------------------ what the evals ask

    def patch_size(self, model: torch.nn.Module, tower: str = "vision") -> int:
        """Side in pixels of the square patches of ``tower``; raises ``UnsupportedModelError`` naming the model
        when the model has no such tower or does not say."""

    def grid(self, model: torch.nn.Module, resolution: int, tower: str = "vision") -> tuple[int, int]:
        """``(rows, columns)`` of patches of a square ``resolution``-pixel input (pixels past the last whole patch dropped)."""

    def token_count(self, model: torch.nn.Module, resolution: int, tower: str = "vision") -> int:
        """Tokens the attention of ``tower`` sees on a square ``resolution``-pixel input: patches + prefix tokens."""

    def feature_prefix_tokens(self, model: torch.nn.Module) -> int:
        """Leading tokens :meth:`encode` leaves out of the patch mean: slot 0 (read as the image feature) and registers."""

    def preprocess_config(self, model: torch.nn.Module, processor: Any = None) -> PreprocessConfig:
        """The model's own image preprocessing (``processor``: its image processor / data config where the
        model does not carry it); raises ``UnsupportedModelError`` when it cannot tell."""

    def image_pipeline(self, processor: Any, resolution: int | None) -> tuple[str, Any, dict[str, Any], tuple[float, ...], tuple[float, ...]] | None:
        """The library's own image pipeline of ``processor`` rescaled to a square ``resolution`` (``None``: unchanged):
        ``(kind, fn: list[PIL.Image] -> [B, 3, R, R], resize, mean, std)`` (``kind`` as :attr:`PreprocessConfig.library`), or ``None`` when ``processor`` is not of this
        library's kind; raises ``OptionError`` when its form cannot be rescaled."""

    def encode(
        self, model: torch.nn.Module, pixel_values: torch.Tensor, layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Frozen features of a ViT encoder: ``(cls [B, C], patch_mean [B, C])`` float32 on CPU (and with
        ``layers`` ``{layer: cls_l [B, C]}``); raises ``UnsupportedModelError`` for a model that is not one."""

    def patch_tokens(self, model: torch.nn.Module, pixel_values: torch.Tensor, last: int = 1) -> torch.Tensor:
        """Per-patch features of the vision tower for dense tasks: the last ``last`` blocks' outputs through its final norm,
        ``[B, rows, columns, last * C]`` float32 on CPU, one per input patch also after a token-merging patch;
        raises ``UnsupportedModelError`` for a model that has none."""

    def embed_image(self, model: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected image embeddings ``[B, D]`` of a dual encoder (not normalised); raises ``UnsupportedModelError`` otherwise."""

    def embed_text(self, model: torch.nn.Module, tokens: Any) -> torch.Tensor:
        """Projected text embeddings ``[T, D]`` of a dual encoder (not normalised); raises ``UnsupportedModelError`` otherwise."""


# --------------------------------------------------------------------------- towers (what patch() routes)

KIND_NOTE = {
    "vision": " (bidirectional attention; this method is causal-only)",
    "text": (
        " (a text encoder: BERT-style bidirectional, or CLIP's / SigLIP's text transformer; the approximate methods "
        "are built for ViT image tokens (CLS + patches) and causal LM prefill, so only 'dense' fits it)"
    ),
}


def tower_kinds(adapter: "Adapter", model: torch.nn.Module, kind: str) -> dict[str, str]:
    """Every tower of ``model`` and its kind, in model order (one tower of the detected kind if the adapter lists none)."""
    kinds = dict(adapter.towers(model))
    return kinds or {("vision" if kind == "vision" else "text"): kind}


def routed_kind(kinds: dict[str, str], chosen: tuple[str, ...]) -> str:
    """The kind of the routed towers: the model's one kind, or the chosen towers' kinds joined by ``+`` (``"vision+text"``)."""
    if len(kinds) == 1:
        (only,) = kinds.values()
        return only
    return "+".join(dict.fromkeys(kinds[t] for t in chosen))


def choose_towers(model: torch.nn.Module, adapter: "Adapter", kinds: dict[str, str], towers: Any) -> tuple[str, ...]:
    """Validate ``towers`` (``None``, ``"all"``, a name, or a sequence of names) against ``kinds``.

    Raises:
        OptionError: an empty selection, a value that is not a tower name, or a tower the model lacks.
    """
    default = tuple(adapter.default_towers(model))
    allowed = ", ".join(map(repr, kinds))
    where = f"{type(model).__name__} has the tower(s) {allowed} (default: {', '.join(map(repr, default))}; 'all' = every tower)"
    if towers is None:
        return default
    names = [towers] if isinstance(towers, str) else towers
    try:
        names = list(names)
    except TypeError:
        raise OptionError(f"towers={towers!r}: expected a tower name or a sequence of names; {where}") from None
    if any(not isinstance(t, str) for t in names):
        raise OptionError(f"towers={towers!r}: tower names must be strings; {where}")
    if names == ["all"]:
        return tuple(kinds)
    if not names:
        raise OptionError(f"towers={towers!r}: empty; {where}")
    bad = [t for t in names if t not in kinds]
    if bad:
        raise OptionError(f"towers={towers!r}: {', '.join(map(repr, bad))} is not a tower of this model; {where}")
    return tuple(t for t in kinds if t in names)  # model order, no duplicates


def tower_methods(model: torch.nn.Module, kinds: dict[str, str], methods: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """``[(tower, method, options)]`` of a ``patch(model, {tower: method or (method, options)})`` mapping, checked
    against the model's towers ``kinds`` and the registry before anything is patched.

    Raises:
        OptionError: a key that is not a tower of the model, a value that is not a name or a ``(name, options)`` pair.
        UnknownMethodError: an unknown method name.
    """
    from collections.abc import Mapping

    from .registry import get_method

    plan = []
    for tower, spec in methods.items():
        if not isinstance(tower, str) or tower not in kinds:
            raise OptionError(f"patch(model, {{{tower!r}: ...}}): {tower!r} is not a tower of {type(model).__name__}; its towers: "
                              f"{', '.join(map(repr, kinds))}")
        if isinstance(spec, str):
            name, opts = spec, {}
        elif isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
            name, opts = spec
        else:
            raise OptionError(f"patch(model, {{{tower!r}: {spec!r}}}): give each tower a method name or a (name, options "
                              "dict) pair, e.g. {'vision': ('fna', {'s': 32})}")
        get_method(name)  # an unknown name is refused before anything is patched
        plan.append((tower, name, dict(opts)))
    return plan
