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
from .core import PatchHandle, run_layer, set_layer_inputs

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


def _dispatch(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    handle: PatchHandle | None = getattr(module, "_attnpatch", None)
    if handle is None:  # a module of a model that is not patched (cannot happen through patch())
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    lq, lk, d = query.shape[2], key.shape[2], query.shape[3]
    scale = scaling if scaling is not None else d**-0.5
    q_offset, key_valid = _key_layout(attention_mask, lq, lk)

    def exact() -> torch.Tensor:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)[0]
        return out.transpose(1, 2)

    out = run_layer(
        handle, module._attnpatch_layer, query, key, value, scale=scale, exact=exact, q_offset=q_offset,
        key_valid=key_valid, causal=bool(getattr(module, "is_causal", True)),
    )
    return out.transpose(1, 2).contiguous(), None


def _block_of(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The transformer block holding the attention module called ``name``: the ancestor that is an item of a ModuleList."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = model.get_submodule(".".join(parts[: i - 1])) if i > 1 else model
        child = getattr(parent, parts[i - 1], None)
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) and parts[i].isdigit():
            return child[int(parts[i])]
    return None


def _prefix_tokens(model: torch.nn.Module, kind: str) -> int:
    """CLS + register tokens for ViT encoders (token roles FNA and sink masking need); 0 for causal LMs."""
    if kind != "vision":
        return 0
    cfg = model.config
    vcfg = getattr(cfg, "vision_config", None) or cfg
    return 1 + int(getattr(vcfg, "num_register_tokens", 0) or 0)


def _first_tensor(args, kwargs, name: str) -> torch.Tensor | None:
    x = args[0] if args else kwargs.get(name)
    return x if isinstance(x, torch.Tensor) else None


def _attn_input_hook(handle: PatchHandle):
    def hook(module, args, kwargs):
        set_layer_inputs(handle, hidden=_first_tensor(args, kwargs, "hidden_states"))

    return hook


def _block_input_hook(handle: PatchHandle):
    def hook(module, args, kwargs):
        set_layer_inputs(handle, residual=_first_tensor(args, kwargs, "hidden_states"))

    return hook


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
        handle.num_layers = len(mods)
        handle.prefix_tokens = _prefix_tokens(model, handle.kind)
        hooks = []
        for i, (name, m) in enumerate(mods):
            m._attnpatch = handle
            li = getattr(m, "layer_idx", None)
            m._attnpatch_layer = int(li) if isinstance(li, int) else i  # encoders often carry no layer_idx
            if handle.kind == "vision":  # token features for landmark selection and sink detection
                hooks.append(m.register_forward_pre_hook(_attn_input_hook(handle), with_kwargs=True))
                block = _block_of(model, name)
                if block is not None:
                    hooks.append(block.register_forward_pre_hook(_block_input_hook(handle), with_kwargs=True))
        model.set_attn_implementation(ATTN_NAME)
        if model.config._attn_implementation != ATTN_NAME:
            for _, m in mods:
                del m._attnpatch, m._attnpatch_layer
            for h in hooks:
                h.remove()
            raise UnsupportedModelError(
                f"{type(model).__name__} refused set_attn_implementation({ATTN_NAME!r}); it does not dispatch "
                "attention through transformers.AttentionInterface"
            )
        return original, mods, hooks

    @staticmethod
    def restore(handle: PatchHandle, undo: Any) -> None:
        """Switch back to the original attention implementation and unbind the modules."""
        original, mods, hooks = undo
        for h in hooks:
            h.remove()
        handle.model.set_attn_implementation(original)
        for _, m in mods:
            for attr in ("_attnpatch", "_attnpatch_layer"):
                m.__dict__.pop(attr, None)

