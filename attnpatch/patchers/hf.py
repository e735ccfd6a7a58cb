"""Hugging Face adapter: binds a method through ``transformers.AttentionInterface``.

One attention function, ``"attnpatch"``, is registered in ``AttentionInterface`` (with
``sdpa_mask`` as its mask builder in ``AttentionMaskInterface``).  Patching a model switches
its attention implementation to it with ``model.set_attn_implementation`` and binds the
model's :class:`~attnpatch.patchers.core.PatchHandle` to each attention module; the
registered function reads the handle from the module it is called with, so the global
registration carries no state.  Unpatching restores the original implementation name.

Any model whose attention modules dispatch through ``ALL_ATTENTION_FUNCTIONS.get_interface``
is covered (Llama, Qwen2, Qwen3, Mistral, ...).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..errors import UnsupportedModelError
from .core import PatchHandle

ATTN_NAME = "attnpatch"
_DISPATCH_CLASSES: dict[type, bool] = {}


def _dispatches_through_interface(cls: type) -> bool:
    if cls not in _DISPATCH_CLASSES:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        _DISPATCH_CLASSES[cls] = "get_interface(" in src and "ALL_ATTENTION_FUNCTIONS" in src
    return _DISPATCH_CLASSES[cls]


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every attention module of ``model`` that dispatches through AttentionInterface."""
    return [(n, m) for n, m in model.named_modules() if _dispatches_through_interface(type(m))]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if ATTN_NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    AttentionInterface.register(ATTN_NAME, _dispatch)


def _key_layout(attention_mask: torch.Tensor | None, lq: int, lk: int) -> tuple[int, torch.Tensor | None]:
    """``(q_offset, key_valid [B, Lk] or None)`` from the 4D mask HF passes (bool, or additive float).

    A ``None`` mask means what it means to ``sdpa_attention_forward``: one query sees every key
    (a decoding step); several queries are causal from key 0 (``is_causal`` is top-left aligned,
    which is also right for a static cache whose key length exceeds the prompt).
    """
    if attention_mask is None:
        return (lk - 1 if lq == 1 else 0), None
    last = attention_mask[:, 0, -1, :]
    if last.dtype != torch.bool:
        last = last > torch.finfo(last.dtype).min / 2
    last = last[:, :lk]
    seen = last.any(0)
    if not bool(seen.any()):
        return lk - lq, last
    last_pos = int(torch.nonzero(seen).max())
    return last_pos + 1 - lq, last


def _count_causal(key_valid: torch.Tensor | None, q_offset: int, lq: int, b: int, h: int) -> torch.Tensor:
    """``[B, H]`` causal pairs among valid tokens for queries at ``q_offset .. q_offset+Lq-1``."""
    if key_valid is None:
        n = lq * q_offset + lq * (lq + 1) // 2
        return torch.full((b, h), float(n), dtype=torch.float64)
    cum = key_valid.to(torch.int64).cumsum(-1)
    pos = q_offset + torch.arange(lq, device=key_valid.device)
    per_q = cum[:, pos] * key_valid[:, pos]
    return per_q.sum(-1).double().cpu()[:, None].expand(b, h).clone()


def _dispatch(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    handle: PatchHandle | None = getattr(module, "_attnpatch", None)
    if handle is None:  # a module of a model that is not patched (cannot happen through patch())
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    b, h, lq, d = query.shape
    lk = key.shape[2]
    scale = scaling if scaling is not None else d**-0.5
    layer = module._attnpatch_layer
    state = handle.state
    record = state is not None and state.record
    q_offset, key_valid = _key_layout(attention_mask, lq, lk)
    out, rec = handle.method_forward(
        handle.config,
        query,
        key,
        value,
        scale=scale,
        q_offset=q_offset,
        key_valid=key_valid,
        layer=layer,
        state=state,
        record=record,
        causal=bool(getattr(module, "is_causal", True)),
    )
    if out is None:  # the method chose exact attention for this call
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)[0]
    else:
        out = out.transpose(1, 2).contiguous()
    if record:
        if rec.causal_pairs is None:
            rec.causal_pairs = _count_causal(key_valid, q_offset, lq, b, h)
            rec.kept_pairs = rec.causal_pairs.clone()
        state.layers[layer] = rec
    return out, None


class HFAdapter:
    """Adapter for Hugging Face ``PreTrainedModel`` subclasses that dispatch attention through AttentionInterface."""

    @staticmethod
    def detect(model: torch.nn.Module) -> str | None:
        """``"causal_lm"`` or ``"vision"`` if this adapter handles ``model``, else ``None``."""
        try:
            from transformers import PreTrainedModel
        except ImportError:  # pragma: no cover
            return None
        if not isinstance(model, PreTrainedModel):
            return None
        mods = attention_modules(model)
        if not mods:
            return None
        causal = {bool(getattr(m, "is_causal", False)) for _, m in mods}
        return "causal_lm" if causal == {True} else "vision"

    @staticmethod
    def layer_count(handle: PatchHandle) -> int:
        """Number of attention modules the patch routes."""
        return len(attention_modules(handle.model))

    @staticmethod
    def check(handle: PatchHandle) -> None:
        """Method-specific checks against the model geometry.

        Raises:
            UnsupportedModelError: sliding-window layers under a method that assumes full causal attention.
            OptionError: layer or head indices out of range.
        """
        from ..errors import OptionError

        model = handle.model
        cfg = model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        n_layers = len(attention_modules(model))
        n_heads = getattr(text_cfg, "num_attention_heads", None)
        types = getattr(text_cfg, "layer_types", None) or []
        if handle.method.name != "dense" and any(t != "full_attention" for t in types):
            raise UnsupportedModelError(
                f"{type(model).__name__} has layer types {sorted(set(types))}; method {handle.method.name!r} "
                "supports full causal attention layers only (no sliding-window layers)"
            )
        opts = handle.options
        for li in opts.get("dense_layers", ()):
            if not 0 <= li < n_layers:
                raise OptionError(f"dense_layers contains {li}: layer indices must be in 0..{n_layers - 1}")
        for li, hi in opts.get("dense_heads", ()):
            if not 0 <= li < n_layers or (n_heads is not None and not 0 <= hi < n_heads):
                raise OptionError(
                    f"dense_heads contains ({li}, {hi}): layers must be in 0..{n_layers - 1}, heads in 0..{(n_heads or 1) - 1}"
                )

    @staticmethod
    def apply(handle: PatchHandle) -> Any:
        """Bind ``handle`` to every attention module and switch the model to the ``"attnpatch"`` implementation.

        Returns:
            What :meth:`restore` needs: the original implementation name and the modules.

        Raises:
            UnsupportedModelError: the model refuses ``set_attn_implementation``.
        """
        _register()
        model = handle.model
        original = model.config._attn_implementation
        mods = attention_modules(model)
        for i, (_, m) in enumerate(mods):
            m._attnpatch = handle
            li = getattr(m, "layer_idx", None)
            m._attnpatch_layer = int(li) if isinstance(li, int) else i  # encoders often carry no layer_idx
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:
            for _, m in mods:
                del m._attnpatch, m._attnpatch_layer
            raise UnsupportedModelError(
                f"{type(model).__name__} refused set_attn_implementation({ATTN_NAME!r}); it does not dispatch "
                "attention through transformers.AttentionInterface"
            )
        return original, mods

    @staticmethod
    def restore(handle: PatchHandle, undo: Any) -> None:
        """Switch back to the original attention implementation and unbind the modules."""
        original, mods = undo
        handle.model.set_attn_implementation(original)
        for _, m in mods:
            for attr in ("_attnpatch", "_attnpatch_layer"):
                m.__dict__.pop(attr, None)

