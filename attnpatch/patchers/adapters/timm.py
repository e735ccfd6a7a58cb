"""timm adapter: binds a method to timm Vision Transformers by class swap of their attention modules.

Every ``timm.layers.Attention`` module of the model (the attention of ``VisionTransformer``
blocks, fused-attention builds included) gets its class swapped for a subclass whose
``forward`` computes ``q, k, v`` exactly as timm does and routes the attention itself through
the patch (:func:`attnpatch.patchers.runtime.run_layer`); the model's exact attention (fused SDPA
or timm's manual path, whichever the module uses) is the fallback.  Unpatching swaps the
original class back, so the module computes bit for bit what it did before.

Token roles: ``model.num_prefix_tokens`` leading tokens (CLS + register tokens) are the
prefix that FNA always keeps as landmarks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...errors import UnsupportedModelError
from ..registry import ModelGeometry
from ..runtime import PatchHandle, block_refusal, input_hook, refuse_calls, run_layer, undo_class_swap, wrap_blocks
from .blocks import timm_block_forwards

__all__ = ["TimmAdapter", "attention_modules"]

_PATCHED_CLASSES: dict[type, type] = {}
_BLOCK_CLASSES: dict[type, type] = {}
_GRID_CALL = "reshapes the output tokens into the patch grid, which token merging no longer has"


def _timm_attention_class():
    try:
        from timm.layers import Attention
    except ImportError:  # timm not installed: this adapter handles nothing
        return None
    return Attention


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every ``timm.layers.Attention`` in ``model``, in model order."""
    cls = _timm_attention_class()
    if cls is None:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]


def _patched_forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    handle: PatchHandle = self._attnpatch
    b, n, _ = x.shape
    gate_mod = getattr(self, "gate", None)
    gate = gate_mod(x).sigmoid() if gate_mod is not None else None
    qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = self.q_norm(q), self.k_norm(k)

    def exact() -> torch.Tensor:
        if self.fused_attn:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=self.attn_drop.p if self.training else 0.0, is_causal=is_causal
            )
        from timm.layers.attention import maybe_add_mask, resolve_self_attn_mask

        attn = (q * self.scale) @ k.transpose(-2, -1)
        attn = maybe_add_mask(attn, resolve_self_attn_mask(n, attn, attn_mask, is_causal))
        attn = self.attn_drop(attn.softmax(dim=-1))
        return attn @ v

    if (attn_mask is not None or is_causal) and not handle.method.exact:
        raise UnsupportedModelError(
            f"method {handle.method.name!r} on a timm attention call with an attention mask or is_causal=True: "
            "only unmasked bidirectional attention is supported"
        )
    dropout = self.attn_drop.p if self.training else 0.0
    out = run_layer(handle, self._attnpatch_layer, q, k, v, scale=self.scale, exact=exact, causal=False, dropout=dropout)
    out = out.transpose(1, 2).reshape(b, n, -1)
    out = self.norm(out)
    if gate is not None:
        out = out * gate
    return self.proj_drop(self.proj(out))


def _patched_class(cls: type) -> type:
    if cls not in _PATCHED_CLASSES:
        _PATCHED_CLASSES[cls] = type(f"Attnpatch{cls.__name__}", (cls,), {"forward": _patched_forward, "_attnpatch_original_class": cls})
    return _PATCHED_CLASSES[cls]


def _block_of(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    return model.get_submodule(parent) if parent else None


class TimmAdapter:
    """Adapter for timm models built of ``timm.layers.Attention`` modules (``VisionTransformer`` and relatives)."""

    library = "timm"
    supports = "timm VisionTransformer models (timm.layers.Attention)"

    @staticmethod
    def detect(model: torch.nn.Module) -> str | None:
        """``"vision"`` for a timm model with ``timm.layers.Attention`` modules, else ``None``."""
        if not type(model).__module__.startswith("timm."):
            return None
        return "vision" if attention_modules(model) else None

    @staticmethod
    def roots(handle: PatchHandle) -> list[torch.nn.Module]:
        """Modules whose call is one whole forward pass: the model, its ``blocks`` (so that
        ``forward_features`` alone also gets one per-forward state) and each block."""
        blocks = getattr(handle.model, "blocks", None)
        out = [handle.model] + ([blocks] if isinstance(blocks, torch.nn.Module) else [])
        for name, _ in attention_modules(handle.model):  # a block called on its own is a forward pass too
            block = _block_of(handle.model, name)
            if block is not None and all(block is not o for o in out):
                out.append(block)
        return out

    @staticmethod
    def layer_count(handle: PatchHandle) -> int:
        """Number of attention modules the patch routes."""
        return len(attention_modules(handle.model))

    @staticmethod
    def towers(model: torch.nn.Module) -> dict[str, str]:
        """One tower: ``{"vision": "vision"}``."""
        return {"vision": "vision"}

    @staticmethod
    def default_towers(model: torch.nn.Module) -> tuple[str, ...]:
        """``("vision",)``."""
        return ("vision",)

    @staticmethod
    def features(handle: PatchHandle) -> dict[str, str]:
        """None of :data:`~attnpatch.patchers.registry.MODEL_FEATURES` (a timm ``Attention`` is plain softmax attention)."""
        return {}

    @staticmethod
    def geometry(handle: PatchHandle) -> ModelGeometry:
        """Routed layers, heads and head size of the attention modules."""
        mods = attention_modules(handle.model)
        heads = int(mods[0][1].num_heads) if mods else None
        head_dim = int(mods[0][1].head_dim) if mods else None
        return ModelGeometry(num_layers=len(mods), heads=heads, kv_heads=heads, head_dim=head_dim, kind=handle.kind)

    @staticmethod
    def prefix_tokens(model: torch.nn.Module, kind: str) -> int:
        """``model.num_prefix_tokens`` (CLS + registers; 1 when the model does not say)."""
        return int(getattr(model, "num_prefix_tokens", 1))

    @staticmethod
    def check(handle: PatchHandle) -> None:
        """For a method with a block hook (ToMe): every block must be a timm ``Block`` and the model's
        read-out the class token (``global_pool='token'``) or every token (``global_pool=''``).

        Raises:
            UnsupportedModelError: another block class, or a pooled read-out (``avg``, ``max``, ``map``)
                that would average merged tokens without their sizes.
        """
        if handle.method.block_hook is None:
            return
        model = handle.model
        blocks = [_block_of(model, name) for name, _ in attention_modules(model)]
        forwards = timm_block_forwards()
        if any(b is None or type(b) not in forwards for b in blocks):
            raise UnsupportedModelError(block_refusal(handle, [b for b in blocks if b is not None], forwards))
        pool = getattr(model, "global_pool", "token")
        if pool not in ("token", "") or getattr(model, "attn_pool", None) is not None:
            raise UnsupportedModelError(
                f"method {handle.method.name!r} merges tokens, but {type(model).__name__} reads its output out with "
                f"global_pool={pool!r}, which would weigh every merged token as one; supported read-outs: the class "
                "token (global_pool='token') or every token (global_pool='', then weight them by attnpatch.token_sizes(model))"
            )

    @staticmethod
    def apply(handle: PatchHandle) -> Any:
        """Swap every attention module's class for its routed subclass and install the input hooks.

        Returns:
            What :meth:`restore` needs: the modules with their original classes, and the hooks.
        """
        model = handle.model
        mods = attention_modules(model)
        handle.num_layers = len(mods)
        handle.prefix_tokens = TimmAdapter.prefix_tokens(model, "vision")
        swapped, hooks = [], []
        for i, (name, m) in enumerate(mods):
            original = type(m)
            m._attnpatch = handle
            m._attnpatch_layer = i
            m.__class__ = _patched_class(original)
            swapped.append((m, original))
            hooks.append(m.register_forward_pre_hook(input_hook(handle, "hidden", ("x",)), with_kwargs=True))
            block = _block_of(model, name)
            if block is not None:
                hooks.append(block.register_forward_pre_hook(input_hook(handle, "residual", ("x",)), with_kwargs=True))
            if handle.method.block_hook is not None:  # checked by check(): a timm Block
                swapped += wrap_blocks(handle, [(i, block)], timm_block_forwards(), _BLOCK_CLASSES)
        if handle.method.block_hook is not None:
            hooks += refuse_calls(handle, model, ("forward_intermediates", "get_intermediate_layers"), _GRID_CALL)
        return swapped, hooks

    @staticmethod
    def restore(handle: PatchHandle, undo: Any) -> None:
        """Swap the original classes back, remove the hooks and the bindings."""
        undo_class_swap(undo)
