"""``patch`` / ``unpatch``: binding a registered method to a model through an adapter.

State that crosses layers lives in one :class:`ForwardState`, created by the patch at the
start of every top-level forward call (a forward pre-hook) and dropped at its end; nothing
is global, so two models patched side by side do not interfere and no state leaks from one
batch to the next.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..errors import PatchStateError, UnsupportedModelError
from .registry import Method, get_method, validate_options
from .state import ForwardState, LayerRecord

__all__ = [
    "PatchHandle",
    "ForwardState",
    "LayerRecord",
    "patch",
    "unpatch",
    "patched",
    "is_patched",
    "patch_info",
    "record_stats",
]

_HANDLE_ATTR = "_attnpatch_handle"


@dataclass
class _Recorder:
    recall: bool
    forwards: list[dict[int, LayerRecord]] = field(default_factory=list)


class PatchHandle:
    """The patch applied to one model: method, validated options, config, adapter, hooks.

    Attributes:
        model: the patched model.
        method: the registered :class:`~attnpatch.patchers.registry.Method`.
        options: complete option dict (defaults filled in).
        config: the method's config object built from ``options``.
        kind: model kind detected by the adapter (``"causal_lm"`` or ``"vision"``).
        state: the current :class:`ForwardState` while a forward call runs, else ``None``.
    """

    def __init__(self, model: torch.nn.Module, method: Method, options: dict[str, Any], adapter, kind: str):
        self.model = model
        self.method = method
        self.options = options
        self.config = method.make_config(options)
        self.method_forward = method.forward
        self.adapter = adapter
        self.kind = kind
        self.state: ForwardState | None = None
        self.recorders: list[_Recorder] = []
        self._hooks: list[Any] = []
        self._undo: Any = None

    # forward hooks: one ForwardState per top-level call
    def _pre(self, module, args, kwargs):
        rec = bool(self.recorders)
        self.state = ForwardState(record=rec, recall=any(r.recall for r in self.recorders))
        return None

    def _post(self, module, args, kwargs, output):
        state, self.state = self.state, None
        if state is not None and state.record:
            for r in self.recorders:
                r.forwards.append(state.layers)
        return None

    def install(self) -> None:
        """Apply the adapter and the per-forward hooks."""
        self._undo = self.adapter.apply(self)
        self._hooks.append(self.model.register_forward_pre_hook(self._pre, with_kwargs=True))
        self._hooks.append(self.model.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def remove(self) -> None:
        """Remove the hooks and let the adapter restore the model."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.adapter.restore(self, self._undo)
        self.state = None


def _find_adapter(model: torch.nn.Module):
    from . import hf

    for adapter in (hf.HFAdapter,):
        kind = adapter.detect(model)
        if kind is not None:
            return adapter, kind
    raise UnsupportedModelError(
        f"cannot patch a {type(model).__module__}.{type(model).__name__}: supported are Hugging Face "
        "transformers models whose attention dispatches through transformers.AttentionInterface "
        "(e.g. LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
    )


def patch(model: torch.nn.Module, method: str = "anchor_attention", **options: Any) -> torch.nn.Module:
    """Replace ``model``'s attention with ``method``, in place.

    Args:
        model: a supported model (see :func:`attnpatch.list_methods` for methods and the model kinds each fits).
        method: a registered method name, e.g. ``"anchor_attention"`` or ``"dense"``.
        **options: the method's options; unknown names, wrong types and out-of-range values are refused.

    Returns:
        The same ``model`` object, patched.

    Raises:
        UnknownMethodError: ``method`` is not registered.
        OptionError: an option is unknown, of the wrong type or out of range.
        UnsupportedModelError: no adapter handles this model class, or the method does not fit
            the model (e.g. a causal-only method on a bidirectional vision encoder).
        PatchStateError: ``model`` is already patched (call :func:`unpatch` first).
    """
    m = get_method(method)
    full = validate_options(m, options)
    if getattr(model, _HANDLE_ATTR, None) is not None:
        cur = getattr(model, _HANDLE_ATTR)
        raise PatchStateError(
            f"{type(model).__name__} is already patched with {cur.method.name!r}; call attnpatch.unpatch(model) first"
        )
    adapter, kind = _find_adapter(model)
    if kind not in m.model_kinds:
        raise UnsupportedModelError(
            f"method {m.name!r} fits model kinds {sorted(m.model_kinds)}, but {type(model).__name__} is a {kind!r} model"
            + (" (bidirectional attention; this method is causal-only)" if kind == "vision" else "")
        )
    handle = PatchHandle(model, m, full, adapter, kind)
    adapter.check(handle)
    handle.install()
    object.__setattr__(model, _HANDLE_ATTR, handle)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: the model computes exactly what it computed before (bit for bit).

    Raises:
        PatchStateError: ``model`` is not patched.
    """
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is None:
        raise PatchStateError(f"{type(model).__name__} is not patched; nothing to unpatch")
    handle.remove()
    object.__delattr__(model, _HANDLE_ATTR)
    return model


@contextlib.contextmanager
def patched(model: torch.nn.Module, method: str = "anchor_attention", **options: Any) -> Iterator[torch.nn.Module]:
    """Context-manager form of :func:`patch`: patched inside the ``with`` block, restored on exit (also on error).

    Raises:
        The errors of :func:`patch`.
    """
    patch(model, method, **options)
    try:
        yield model
    finally:
        if is_patched(model):  # the block may have unpatched it already; do not mask its own error
            unpatch(model)


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` is currently patched."""
    return getattr(model, _HANDLE_ATTR, None) is not None


def handle_of(model: torch.nn.Module) -> PatchHandle:
    """The :class:`PatchHandle` of a patched model.

    Raises:
        PatchStateError: ``model`` is not patched.
    """
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is None:
        raise PatchStateError(f"{type(model).__name__} is not patched")
    return handle


def patch_info(model: torch.nn.Module) -> dict[str, Any] | None:
    """``{"method", "options", "kind", "layers"}`` of a patched model, or ``None`` if not patched."""
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is None:
        return None
    return {
        "method": handle.method.name,
        "options": dict(handle.options),
        "kind": handle.kind,
        "layers": handle.adapter.layer_count(handle),
    }


@contextlib.contextmanager
def record_stats(model: torch.nn.Module, recall: bool = False) -> Iterator[_Recorder]:
    """Record per-layer statistics of every forward call made inside the block.

    Args:
        model: a patched model.
        recall: also measure attention recall in sparse layers (one extra dense ``Q K^T`` pass per layer).

    Yields:
        A recorder whose ``forwards`` list gets, per top-level forward call (prefill and each
        decoding step of ``generate``), a dict ``{layer_index: LayerRecord}``.

    Raises:
        PatchStateError: ``model`` is not patched.
    """
    handle = handle_of(model)
    rec = _Recorder(recall=recall)
    handle.recorders.append(rec)
    try:
        yield rec
    finally:
        handle.recorders.remove(rec)
