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

import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ...errors import OptionError, UnsupportedModelError
from ..adapter import PreprocessConfig
from ..contract import ModelGeometry
from ..features import check_pixels, input_device, patch_side, square_grid, vit_features, vit_patch_tokens
from ..class_swap import block_refusal, refuse_calls, undo_class_swap, wrap_blocks
from ..runtime import PatchHandle, input_hook, run_layer
from .hf.images import image_processor_config

__all__ = ["TimmAdapter", "attention_modules", "timm_block_forwards", "data_config_preprocess", "timm_image_pipeline"]

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


# --------------------------------------------------------------------------- block forward (token merging)


def _timm_block(self, hook, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """timm ``Block.forward`` with ``x = hook(x)`` between the attention and the MLP branch (``x`` ``[B, N, C]``)."""
    x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))
    x = hook(x)
    return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def timm_block_forwards() -> dict[type, Callable[..., Any]]:
    """``{timm.models.vision_transformer.Block: forward}``: the block forwards a method with a block hook (ToMe)
    runs (:func:`~attnpatch.patchers.class_swap.wrap_blocks`); other timm block kinds are not split.
    ``hook`` returning ``x`` gives what timm's own forward gives."""
    try:
        from timm.models.vision_transformer import Block
    except ImportError:  # pragma: no cover
        return {}
    return {Block: _timm_block}


# --------------------------------------------------------------------------- what the evals ask

_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def data_config_preprocess(cfg: Mapping[str, Any]) -> PreprocessConfig:
    """:class:`~attnpatch.patchers.adapter.PreprocessConfig` of a timm data config (``timm.data.resolve_data_config``:
    ``input_size``, ``interpolation``, ``mean``, ``std``, ``crop_pct``, ``crop_mode``) as the eval's preprocessing
    reads it: resize to ``input_size / crop_pct`` (``crop_pct`` 0.875 when not given), centre crop ``input_size``,
    ImageNet mean / std where not given.

    Raises:
        UnsupportedModelError: no ``input_size`` in ``cfg``.
    """
    if "input_size" not in cfg:
        raise UnsupportedModelError(f"timm data config without 'input_size' (keys: {sorted(cfg)}); pass timm.data.resolve_data_config(...)")
    keep = {k: cfg[k] for k in ("input_size", "interpolation", "mean", "std", "crop_pct", "crop_mode") if k in cfg}
    crop_pct = float(keep.get("crop_pct") or 0.875)
    side = int(keep["input_size"][-1])
    return PreprocessConfig(
        library="timm", resolution=side, resize={"scale_size": int(side / crop_pct)}, crop=side,
        interpolation=keep.get("interpolation"), mean=tuple(float(v) for v in keep.get("mean", _IMAGENET_MEAN)),
        std=tuple(float(v) for v in keep.get("std", _IMAGENET_STD)), native=keep,
    )


def _need_vision(model: torch.nn.Module, tower: str, what: str) -> None:
    if tower != "vision":
        raise UnsupportedModelError(f"{type(model).__name__}: a timm ViT has one tower, 'vision', not {tower!r}, so no {what} there")


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
        """None of :data:`~attnpatch.patchers.contract.MODEL_FEATURES` (a timm ``Attention`` is plain softmax attention)."""
        return {}

    @staticmethod
    def geometry(model: torch.nn.Module, towers: tuple[str, ...], kind: str) -> ModelGeometry:
        """Layers, heads and head size of the attention modules (the one tower), read from the model."""
        mods = attention_modules(model)
        heads = int(mods[0][1].num_heads) if mods else None
        head_dim = int(mods[0][1].head_dim) if mods else None
        return ModelGeometry(num_layers=len(mods), heads=heads, kv_heads=heads, head_dim=head_dim, kind=kind)

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


    # ------------------------------------------------------------------ what the evals ask

    @staticmethod
    def patch_size(model: torch.nn.Module, tower: str = "vision") -> int:
        """Side in pixels of the square patches: ``model.patch_embed.patch_size``.

        Raises:
            UnsupportedModelError: ``tower`` is not ``"vision"``, or the model has no ``patch_embed.patch_size``
                (the message names the model).
        """
        _need_vision(model, tower, "patch size")
        p = getattr(getattr(model, "patch_embed", None), "patch_size", None)
        if p is None:
            raise UnsupportedModelError(f"{type(model).__name__}: no patch_embed.patch_size, so its patch size is unknown")
        return patch_side(p)

    @staticmethod
    def grid(model: torch.nn.Module, resolution: int, tower: str = "vision") -> tuple[int, int]:
        """``(rows, columns)`` of patches on a square ``resolution``-pixel input.

        Raises:
            UnsupportedModelError: see :meth:`patch_size`; OptionError: ``resolution`` below one patch.
        """
        return square_grid(resolution, TimmAdapter.patch_size(model, tower))

    @staticmethod
    def token_count(model: torch.nn.Module, resolution: int, tower: str = "vision") -> int:
        """Tokens the attention sees on a square ``resolution``-pixel input: patches + ``num_prefix_tokens``
        (CLS + registers).

        Raises:
            UnsupportedModelError: see :meth:`patch_size`; OptionError: ``resolution`` below one patch.
        """
        rows, cols = TimmAdapter.grid(model, resolution, tower)
        return rows * cols + TimmAdapter.prefix_tokens(model, "vision")

    @staticmethod
    def feature_prefix_tokens(model: torch.nn.Module) -> int:
        """Leading tokens :meth:`encode` leaves out of the patch mean: ``model.num_prefix_tokens`` (CLS + registers; 1 when not said)."""
        return int(getattr(model, "num_prefix_tokens", 1))

    @staticmethod
    def preprocess_config(model: torch.nn.Module, processor: Any = None) -> PreprocessConfig:
        """The model's image preprocessing: of ``processor`` where given (a timm data config dict, or a Hugging Face
        image processor, as the catalogue's timm DINOv2 comes with: :func:`~attnpatch.patchers.adapters.hf.images.image_processor_config`),
        else of ``timm.data.resolve_data_config(model=model)`` (the model's ``pretrained_cfg``).

        Raises:
            UnsupportedModelError: a ``processor`` of neither kind, or a data config without ``input_size``.
        """
        if processor is None:
            from timm.data import resolve_data_config

            return data_config_preprocess(resolve_data_config({}, model=model))
        if isinstance(processor, Mapping):
            return data_config_preprocess(processor)
        return image_processor_config(processor)

    @staticmethod
    def image_pipeline(processor: Any, resolution: int | None):
        """timm's eval transform of a data config: :func:`timm_image_pipeline` (``None`` for anything else)."""
        return timm_image_pipeline(processor, resolution)

    @staticmethod
    @torch.no_grad()
    def encode(
        model: torch.nn.Module, pixel_values: torch.Tensor, layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Final CLS token and mean patch token (and, with ``layers``, intermediate CLS tokens) of a timm ViT:
        ``forward_features`` (after the final norm); intermediate CLS tokens are ``blocks[i]``'s outputs through ``norm``.

        Args:
            model: a timm ``VisionTransformer``.
            pixel_values: ``[B, 3, H, W]`` (moved to the model's device and weight dtype).
            layers: block indices whose output CLS token is returned as well.

        Returns:
            See :func:`~attnpatch.patchers.features.vit_features` (prefix: :meth:`feature_prefix_tokens`).

        Raises:
            UnsupportedModelError: a model without ``forward_features``, or ``layers`` without ``blocks``.
        """
        if not hasattr(model, "forward_features"):
            raise UnsupportedModelError(f"cannot encode images with a {type(model).__name__}: expected a timm ViT (forward_features)")
        x = pixel_values.to(input_device(model), next(model.parameters()).dtype)
        blocks = list(getattr(model, "blocks", None) or []) if layers else []
        norm = getattr(model, "norm", None) if layers else None
        return vit_features(model, lambda: model.forward_features(x), prefix=TimmAdapter.feature_prefix_tokens(model),
                            blocks=blocks, norm=norm, layers=tuple(layers))

    @staticmethod
    @torch.no_grad()
    def patch_tokens(model: torch.nn.Module, pixel_values: torch.Tensor, last: int = 1) -> torch.Tensor:
        """Per-patch features of a timm ViT: the outputs of its last ``last`` ``blocks`` through ``norm`` (as
        ``forward_features`` ends), prefix tokens (``num_prefix_tokens``) dropped, read back at every input patch
        after a token-merging patch (:func:`~attnpatch.patchers.features.vit_patch_tokens`).

        Args:
            model: a timm ``VisionTransformer`` (a model built with ``dynamic_img_size=True`` takes other sizes).
            pixel_values: ``[B, 3, H, W]``; last: how many of the last blocks to read.

        Returns:
            ``[B, H / patch, W / patch, last * C]`` float32 on CPU.

        Raises:
            UnsupportedModelError: a model without ``forward_features`` / ``blocks``; OptionError: ``last`` out of range.
        """
        if not hasattr(model, "forward_features"):
            raise UnsupportedModelError(f"cannot read patch tokens of a {type(model).__name__}: expected a timm ViT (forward_features)")
        check_pixels(pixel_values)
        x = pixel_values.to(input_device(model), next(model.parameters()).dtype)
        p = TimmAdapter.patch_size(model)
        return vit_patch_tokens(model, lambda: model.forward_features(x), prefix=TimmAdapter.feature_prefix_tokens(model),
                                blocks=list(getattr(model, "blocks", None) or []), norm=getattr(model, "norm", None),
                                last=last, grid=(x.shape[-2] // p, x.shape[-1] // p))

    @staticmethod
    def embed_image(model: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        """A timm ViT is an image encoder, not a dual encoder: refused (use :meth:`encode`).

        Raises:
            UnsupportedModelError: always.
        """
        raise UnsupportedModelError(f"{type(model).__name__} is a timm image encoder, not a dual encoder: it has no "
                                    "projected image embedding (use encode for its features)")

    @staticmethod
    def embed_text(model: torch.nn.Module, tokens: Any) -> torch.Tensor:
        """A timm ViT has no text tower: refused.

        Raises:
            UnsupportedModelError: always.
        """
        raise UnsupportedModelError(f"{type(model).__name__} is a timm image encoder: it has no text tower")


def timm_image_pipeline(cfg: Any, resolution: int | None) -> tuple[str, Callable, dict[str, Any], tuple[float, ...], tuple[float, ...]] | None:
    """timm's own eval transform (``timm.data.create_transform``) of the data config ``cfg``
    (``timm.data.resolve_data_config``), rescaled to a square side ``resolution`` (``None``: unchanged) with the
    same crop fraction: the scale size becomes ``floor(R / crop_pct)`` (timm's rule), timm's interpolation and
    ``crop_mode`` kept.

    Returns:
        ``("timm", fn, resize, mean, std)`` as :func:`~attnpatch.patchers.adapters.hf.images.hf_image_pipeline`; ``None``
        when ``cfg`` is not a mapping.

    Raises:
        OptionError: a config without ``input_size``.
    """
    if not isinstance(cfg, Mapping):
        return None
    from timm.data import create_transform

    if "input_size" not in cfg:
        raise OptionError(f"timm data config without 'input_size' (keys: {sorted(cfg)}); pass timm.data.resolve_data_config(...)")
    described = data_config_preprocess(cfg)  # the fields timm's transform takes, resize target, mean / std
    keep = dict(described.native)
    crop_pct = float(keep.get("crop_pct") or 0.875)
    resize = described.resize
    if resolution is not None:
        scale = math.floor(resolution / crop_pct)  # timm's own rule, so the native side gives the default pipeline
        keep["input_size"] = (3, resolution, resolution)
        keep["crop_pct"] = resolution / (scale + 0.5)  # timm sizes the resize step as floor(R / crop_pct): exactly `scale`
        resize = {"scale_size": scale}
    tf = create_transform(**keep, is_training=False)

    def fn(images):
        return torch.stack([tf(im) for im in images])

    return "timm", fn, resize, described.mean, described.std
