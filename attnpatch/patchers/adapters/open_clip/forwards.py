"""The forwards the open_clip adapter swaps in: the block attentions' (``q, k, v`` computed as open_clip does, the
attention routed through :func:`~attnpatch.patchers.runtime.run_layer`) and the blocks' own, split between the
attention and the MLP branch for methods with a block hook (ToMe).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ....errors import UnsupportedModelError
from ...runtime import PatchHandle, needs_attention_tensors, run_layer, run_module
from .towers import open_clip_transformer

__all__ = ["patched_class", "open_clip_block_forwards"]

_PATCHED_CLASSES: dict[type, type] = {}


def _additive_mask(attn_mask: torch.Tensor | None, b: int, h: int, n: int, dtype) -> torch.Tensor | None:
    """open_clip / nn.MultiheadAttention mask (``[L, L]`` or ``[B*H, L, L]``; bool True = masked) as an additive SDPA mask."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 3:
        attn_mask = attn_mask.reshape(b, h, n, n)
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(attn_mask, float("-inf"))
    return attn_mask.to(dtype)


def _refuse_mask(handle: PatchHandle, tower: str, what: str) -> None:
    raise UnsupportedModelError(
        f"method {handle.method.name!r} on an open_clip {tower} attention call with {what}: only unmasked "
        "bidirectional self-attention is supported (the vision tower's); use method 'dense' for other calls"
    )


def _mha_forward(
    self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True, is_causal=False
):
    handle: PatchHandle = self._attnpatch
    original = self._attnpatch_original_class
    plain = (
        key is query and value is query and key_padding_mask is None and not need_weights
        and self._qkv_same_embed_dim and self.bias_k is None and self.bias_v is None and not self.add_zero_attn
    )
    def own():
        return original.forward(
            self, query, key, value, key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            average_attn_weights=average_attn_weights, is_causal=is_causal,
        )

    if not plain:
        if not handle.method.exact:
            _refuse_mask(handle, self._attnpatch_tower, "cross-attention, a key padding mask, attention weights or bias_k/bias_v")
        return own()
    x = query if self.batch_first else query.transpose(0, 1)
    b, n, e = x.shape
    h = self.num_heads
    if handle.method.exact and not needs_attention_tensors(handle):  # the module's own forward, bit for bit
        causal = attn_mask is not None or bool(is_causal)
        return run_module(handle, self._attnpatch_layer, own, batch=b, heads=h, queries=n, keys=n, causal=causal)
    q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).reshape(b, n, 3, h, e // h).permute(2, 0, 3, 1, 4).unbind(0)
    mask = _additive_mask(attn_mask, b, h, n, q.dtype)
    causal = mask is not None or bool(is_causal)
    if causal and not handle.method.exact and self._attnpatch_tower == "vision":
        _refuse_mask(handle, "vision", "an attention mask or is_causal=True")

    def exact() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=bool(is_causal) and mask is None
        )

    dropout = self.dropout if self.training else 0.0
    out = run_layer(handle, self._attnpatch_layer, q, k, v, scale=(e // h) ** -0.5, exact=exact, causal=causal, dropout=dropout,
                    own_forward=True)
    if out is None:  # handed back: the module's own forward, bit for bit (its fused kernel is not exact())
        return own()
    out = self.out_proj(out.transpose(1, 2).reshape(b, n, e))
    if not self.batch_first:
        out = out.transpose(0, 1)
    return out, None


def _attention_forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """open_clip ``Attention.forward`` with the attention itself routed through the patch."""
    handle: PatchHandle = self._attnpatch
    b, n, c = x.shape
    h = self.num_heads
    own = lambda: self._attnpatch_original_class.forward(self, x, attn_mask=attn_mask)  # noqa: E731
    if handle.method.exact and not needs_attention_tensors(handle):  # the module's own forward, bit for bit
        return run_module(handle, self._attnpatch_layer, own, batch=b, heads=h, queries=n, keys=n, causal=attn_mask is not None)
    q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (t.reshape(b, n, h, -1).transpose(1, 2) for t in (q, k, v))
    mask = _additive_mask(attn_mask, b, h, n, q.dtype)
    if mask is not None and not handle.method.exact and self._attnpatch_tower == "vision":
        _refuse_mask(handle, "vision", "an attention mask")
    if self.logit_scale is not None:  # scaled cosine attention: fold the per-head logit scale into q
        q = F.normalize(q, dim=-1) * torch.clamp(self.logit_scale, max=self.logit_scale_max).exp()
        k = F.normalize(k, dim=-1)
        scale = 1.0
    else:
        q, k = self.ln_q(q), self.ln_k(k)
        scale = self.scale

    def exact() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.attn_drop.p if self.training else 0.0, scale=scale
        )

    dropout = self.attn_drop.p if self.training else 0.0
    out = run_layer(handle, self._attnpatch_layer, q, k, v, scale=scale, exact=exact, causal=mask is not None, dropout=dropout,
                    own_forward=True)
    if out is None:  # handed back: the module's own forward, bit for bit
        return own()
    if self.head_scale is not None:
        out = out * self.head_scale
    out = out.transpose(1, 2).reshape(b, n, c)
    out = self.ln_inner(out)
    return self.out_drop(self.out_proj(out))


def patched_class(cls: type) -> type:
    """The routed subclass of an open_clip block attention class (``torch.nn.MultiheadAttention`` or
    ``open_clip.transformer.Attention``), made once per class.

    Raises:
        UnsupportedModelError: any other attention class.
    """
    if cls not in _PATCHED_CLASSES:
        oct = open_clip_transformer()
        if issubclass(cls, torch.nn.MultiheadAttention):
            fwd = _mha_forward
        elif oct is not None and issubclass(cls, oct.Attention):
            fwd = _attention_forward
        else:
            raise UnsupportedModelError(
                f"open_clip block attention of class {cls.__module__}.{cls.__name__}: expected torch.nn.MultiheadAttention "
                "or open_clip.transformer.Attention"
            )
        _PATCHED_CLASSES[cls] = type(f"Attnpatch{cls.__name__}", (cls,), {"forward": fwd, "_attnpatch_original_class": cls})
    return _PATCHED_CLASSES[cls]


# --------------------------------------------------------------------------- block forwards (token merging)


def _batch_first_hook(self, hook, x: torch.Tensor) -> torch.Tensor:
    if getattr(self.attn, "batch_first", True):
        return hook(x)
    return hook(x.transpose(0, 1)).transpose(0, 1)


def _oc_residual_block(self, hook, q_x, k_x=None, v_x=None, attn_mask=None):
    """open_clip ``ResidualAttentionBlock.forward`` with ``x = hook(x)`` between the attention and the MLP branch."""
    if k_x is not None or v_x is not None:
        raise UnsupportedModelError("a block-hook method on an open_clip cross-attention call (k_x / v_x given): only self-attention blocks are supported")
    x = q_x + self.ls_1(self.attention(q_x=self.ln_1(q_x), attn_mask=attn_mask))
    x = _batch_first_hook(self, hook, x)
    return x + self.ls_2(self.mlp(self.ln_2(x)))


def _oc_custom_block(self, hook, x, attn_mask=None):
    """open_clip ``CustomResidualAttentionBlock.forward`` with ``x = hook(x)`` between the two branches."""
    x = x + self.ls_1(self.ln_attn(self.attn(self.ln_1(x), attn_mask=attn_mask)))
    x = _batch_first_hook(self, hook, x)
    return x + self.ls_2(self.mlp(self.ln_2(x)))


def open_clip_block_forwards() -> dict[type, Callable[..., Any]]:
    """``{ResidualAttentionBlock: forward, CustomResidualAttentionBlock: forward}`` of ``open_clip.transformer``:
    the block forwards a method with a block hook (ToMe) runs; ``hook`` takes and returns ``[B, N, C]``
    (batch first, whatever the block's layout) and returning ``x`` gives open_clip's own forward."""
    oct = open_clip_transformer()
    if oct is None:  # pragma: no cover
        return {}
    return {oct.ResidualAttentionBlock: _oc_residual_block, oct.CustomResidualAttentionBlock: _oc_custom_block}
