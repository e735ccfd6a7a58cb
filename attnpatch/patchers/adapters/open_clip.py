"""open_clip adapter: binds a method to open_clip's transformer towers by class swap of their attention modules.

open_clip (``open_clip_torch``) builds its ViT image tower (``open_clip.transformer.VisionTransformer``)
and its text tower (``TextTransformer``, or the ``transformer`` of the ``CLIP`` class) from
``ResidualAttentionBlock`` (attention: ``torch.nn.MultiheadAttention``) or
``CustomResidualAttentionBlock`` (attention: open_clip's own ``open_clip.transformer.Attention``,
used when qk-norm, scaled-cosine attention, head scaling or inner norms are configured). The
attention module of every block of a routed tower gets its class swapped for a subclass whose
``forward`` computes ``q, k, v`` exactly as the original does (the packed ``in_proj`` projection,
open_clip's ``ln_q`` / ``ln_k``, scaled-cosine logits folded into ``q``) and routes the attention
itself through :func:`attnpatch.patchers.runtime.run_layer`; exact scaled-dot-product attention on
the same ``q, k, v`` (with the call's mask) is the fallback. Unpatching swaps the original class
back, so the module computes bit for bit what it did before.

Towers: ``"vision"`` (kind ``"vision"``: bidirectional, one class token first, so
``handle.prefix_tokens = 1``) and ``"text"`` (kind ``"text"``: causal, 77 tokens; only ``dense``
fits it). ``patch(model, ...)`` routes the vision tower by default. The model passed may be a
whole open_clip model (``CLIP``, ``CustomTextCLIP``, ``CoCa``) or its ``visual`` tower alone.

Per-forward state: ``model(...)``, ``model.encode_image(x)``, ``model.visual(x)`` and
``model.visual.transformer(x)`` each get exactly one :class:`~attnpatch.patchers.state.ForwardState`
(the model, the tower and its block stack are all roots; nested calls share the outer state).

Not covered: image towers that are not a ``VisionTransformer`` (``ModifiedResNet`` for the RN50
family, ``TimmModel`` trunks such as open_clip's SigLIP / ConvNeXt models -- a timm ViT trunk can
be patched directly with ``patch(model.visual.trunk, ...)`` through the timm adapter), and
Hugging Face text encoders (``HFTextEncoder``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...errors import UnsupportedModelError
from ..registry import ModelGeometry
from ..runtime import (
    PatchHandle, block_refusal, input_hook, needs_attention_tensors, refuse_calls, run_layer, run_module, undo_class_swap, wrap_blocks,
)
from .blocks import open_clip_block_forwards

__all__ = ["OpenClipAdapter", "tower_modules"]

_PATCHED_CLASSES: dict[type, type] = {}
_BLOCK_CLASSES: dict[type, type] = {}
_INPUT_NAMES = ("q_x", "x", "query")  # how open_clip blocks / attentions name their input


def _oc():
    try:
        from open_clip import transformer as oct
    except ImportError:  # open_clip not installed: this adapter handles nothing
        return None
    return oct


def _is_open_clip(model: torch.nn.Module) -> bool:
    return type(model).__module__.split(".")[0] == "open_clip"


def _vision_root(model: torch.nn.Module) -> torch.nn.Module | None:
    oct = _oc()
    if oct is None:
        return None
    if isinstance(model, oct.VisionTransformer):
        return model
    visual = getattr(model, "visual", None)
    return visual if isinstance(visual, oct.VisionTransformer) else None


def _text_root(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(root called once per text forward, Transformer holding the resblocks)`` of the text tower, or ``None``."""
    oct = _oc()
    if oct is None:
        return None
    if isinstance(model, oct.TextTransformer):
        return model, model.transformer
    text = getattr(model, "text", None)
    if isinstance(text, oct.TextTransformer):
        return text, text.transformer
    tr = getattr(model, "transformer", None)  # open_clip.model.CLIP keeps its text transformer at top level
    if isinstance(tr, oct.Transformer) and hasattr(model, "token_embedding") and not isinstance(model, oct.VisionTransformer):
        return tr, tr
    return None


def _blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    return list(getattr(transformer, "resblocks", []))


def tower_modules(model: torch.nn.Module, tower: str) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """``(block, attention module)`` of every block of ``tower`` (``"vision"`` / ``"text"``), in order; ``[]`` if absent."""
    if tower == "vision":
        root = _vision_root(model)
        blocks = _blocks(root.transformer) if root is not None else []
    elif tower == "text":
        found = _text_root(model)
        blocks = _blocks(found[1]) if found is not None else []
    else:
        return []
    return [(b, b.attn) for b in blocks if isinstance(getattr(b, "attn", None), torch.nn.Module)]


# --------------------------------------------------------------------------- patched forwards


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
    out = run_layer(handle, self._attnpatch_layer, q, k, v, scale=(e // h) ** -0.5, exact=exact, causal=causal, dropout=dropout)
    out = self.out_proj(out.transpose(1, 2).reshape(b, n, e))
    if not self.batch_first:
        out = out.transpose(0, 1)
    return out, None


def _attention_forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """open_clip ``Attention.forward`` with the attention itself routed through the patch."""
    handle: PatchHandle = self._attnpatch
    b, n, c = x.shape
    h = self.num_heads
    if handle.method.exact and not needs_attention_tensors(handle):  # the module's own forward, bit for bit
        own = lambda: self._attnpatch_original_class.forward(self, x, attn_mask=attn_mask)  # noqa: E731
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
    out = run_layer(handle, self._attnpatch_layer, q, k, v, scale=scale, exact=exact, causal=mask is not None, dropout=dropout)
    if self.head_scale is not None:
        out = out * self.head_scale
    out = out.transpose(1, 2).reshape(b, n, c)
    out = self.ln_inner(out)
    return self.out_drop(self.out_proj(out))


def _patched_class(cls: type) -> type:
    if cls not in _PATCHED_CLASSES:
        oct = _oc()
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


# --------------------------------------------------------------------------- adapter


class OpenClipAdapter:
    """Adapter for open_clip models (``CLIP``, ``CustomTextCLIP``, ``CoCa``) and their ``VisionTransformer`` tower."""

    library = "open_clip"
    supports = "open_clip models with a VisionTransformer image tower"

    @staticmethod
    def detect(model: torch.nn.Module) -> str | None:
        """``"vision"`` for an open_clip model (or tower) this adapter handles, else ``None``."""
        if _oc() is None or not _is_open_clip(model):
            return None
        if _vision_root(model) is not None or hasattr(model, "visual"):
            return "vision"
        return "text" if _text_root(model) is not None else None

    @staticmethod
    def towers(model: torch.nn.Module) -> dict[str, str]:
        """``{"vision": "vision", "text": "text"}`` for a whole CLIP; ``{"vision": "vision"}`` for a
        ``VisionTransformer`` alone (or a model whose text tower is a Hugging Face encoder)."""
        out = {}
        if _vision_root(model) is not None or hasattr(model, "visual"):
            out["vision"] = "vision"
        if _text_root(model) is not None:
            out["text"] = "text"
        return out

    @staticmethod
    def default_towers(model: torch.nn.Module) -> tuple[str, ...]:
        """``("vision",)`` whenever the model has an image tower, else every tower."""
        names = tuple(OpenClipAdapter.towers(model))
        return ("vision",) if "vision" in names else names

    @staticmethod
    def roots(handle: PatchHandle) -> list[torch.nn.Module]:
        """The model, the routed towers and their block stacks (so ``encode_image``, ``visual(x)``
        and ``visual.transformer(x)`` each get one per-forward state)."""
        out: list[torch.nn.Module] = [handle.model]
        if "vision" in handle.towers:
            root = _vision_root(handle.model)
            out += [root, root.transformer]
        if "text" in handle.towers:
            found = _text_root(handle.model)
            out += [found[0], found[1]]
        for t in handle.towers:  # a block called on its own is a forward pass too
            out += [block for block, _ in tower_modules(handle.model, t)]
        uniq: list[torch.nn.Module] = []
        for m in out:
            if all(m is not u for u in uniq):
                uniq.append(m)
        return uniq

    @staticmethod
    def layer_count(handle: PatchHandle) -> int:
        """Number of attention modules the patch routes (blocks of the chosen towers)."""
        return sum(len(tower_modules(handle.model, t)) for t in handle.towers)

    @staticmethod
    def features(handle: PatchHandle) -> dict[str, str]:
        """None of :data:`~attnpatch.patchers.registry.MODEL_FEATURES` (scaled-cosine logits and head scaling are folded into ``q`` / applied outside the attention)."""
        return {}

    @staticmethod
    def geometry(handle: PatchHandle) -> ModelGeometry:
        """Routed layers; heads and head size of the first routed attention module."""
        mods = [a for t in handle.towers for _, a in tower_modules(handle.model, t)]
        heads = int(mods[0].num_heads) if mods else None
        head_dim = int(mods[0].head_dim) if mods and getattr(mods[0], "head_dim", None) else None
        return ModelGeometry(num_layers=len(mods), heads=heads, kv_heads=heads, head_dim=head_dim, kind=handle.kind)

    @staticmethod
    def prefix_tokens(model: torch.nn.Module, kind: str) -> int:
        """1 for the ``"vision"`` tower (open_clip's ViT puts one class token first), else 0."""
        return 1 if kind == "vision" else 0

    @staticmethod
    def check(handle: PatchHandle) -> None:
        """The image tower must be an open_clip ``VisionTransformer``.

        Raises:
            UnsupportedModelError: the vision tower is routed but is a ``ModifiedResNet`` or a timm trunk.
        """
        if "vision" in handle.towers and _vision_root(handle.model) is None:
            from .timm import TimmAdapter

            visual = getattr(handle.model, "visual", None)
            trunk = getattr(visual, "trunk", None)
            hint = (
                f"; its timm trunk ({type(trunk).__name__}) is a ViT and can be patched directly: attnpatch.patch(model.visual.trunk, ...)"
                if trunk is not None and TimmAdapter.detect(trunk) is not None
                else f"; its trunk ({type(trunk).__name__}) has no softmax attention layers to patch" if trunk is not None else ""
            )
            raise UnsupportedModelError(
                f"open_clip {type(handle.model).__name__}: the image tower is a {type(visual).__module__}.{type(visual).__name__}, "
                f"not an open_clip VisionTransformer, so the open_clip adapter cannot route it{hint}"
            )
        if handle.method.block_hook is not None and "vision" in handle.towers:
            visual = _vision_root(handle.model)
            forwards = open_clip_block_forwards()
            blocks = [b for b, _ in tower_modules(handle.model, "vision")]
            if any(type(b) not in forwards for b in blocks):
                raise UnsupportedModelError(block_refusal(handle, blocks, forwards))
            pool = getattr(visual, "pool_type", "tok")
            if pool not in ("tok", "none") or getattr(visual, "attn_pool", None) is not None:
                what = "an attention-pooling head" if getattr(visual, "attn_pool", None) is not None else f"pool_type={pool!r}"
                raise UnsupportedModelError(
                    f"method {handle.method.name!r} merges tokens, but this open_clip image tower reads its output out with "
                    f"{what}, which would weigh every merged token as one; supported: the class token (pool_type='tok') or every "
                    "token (pool_type='none', then weight them by attnpatch.token_sizes(model))"
                )

    @staticmethod
    def apply(handle: PatchHandle) -> Any:
        """Swap the chosen towers' attention classes for their routed subclasses and install the input hooks.

        Layers are numbered vision blocks first, then text blocks.

        Returns:
            What :meth:`restore` needs: the modules with their original classes, and the hooks.
        """
        model = handle.model
        swapped, hooks = [], []
        i = 0
        handle.prefix_tokens = OpenClipAdapter.prefix_tokens(model, "vision" if "vision" in handle.towers else "text")
        try:
            for tower in ("vision", "text"):
                if tower not in handle.towers:
                    continue
                for block, attn in tower_modules(model, tower):
                    original = type(attn)
                    cls = _patched_class(original)
                    attn._attnpatch = handle
                    attn._attnpatch_layer = i
                    attn._attnpatch_tower = tower
                    attn.__class__ = cls
                    swapped.append((attn, original))
                    if tower == "vision":  # token features for landmark selection and sink detection
                        bf = bool(getattr(attn, "batch_first", True))
                        hooks.append(attn.register_forward_pre_hook(input_hook(handle, "hidden", _INPUT_NAMES, bf), with_kwargs=True))
                        hooks.append(block.register_forward_pre_hook(input_hook(handle, "residual", _INPUT_NAMES, bf), with_kwargs=True))
                        if handle.method.block_hook is not None:  # checked by check()
                            swapped += wrap_blocks(handle, [(i, block)], open_clip_block_forwards(), _BLOCK_CLASSES)
                    i += 1
            if handle.method.block_hook is not None and "vision" in handle.towers:
                hooks += refuse_calls(
                    handle, _vision_root(model), ("forward_intermediates",),
                    "reshapes the output tokens into the patch grid, which token merging no longer has",
                )
        except Exception:
            OpenClipAdapter.restore(handle, (swapped, hooks))
            raise
        handle.num_layers = i
        return swapped, hooks

    @staticmethod
    def restore(handle: PatchHandle, undo: Any) -> None:
        """Swap the original classes back, remove the hooks and the bindings."""
        undo_class_swap(undo)
