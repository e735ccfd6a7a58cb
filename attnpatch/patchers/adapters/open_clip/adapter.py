"""The open_clip adapter class (:class:`OpenClipAdapter`): detection, towers, checks, geometry, apply / restore, and
the evals' questions (patch size, token count, preprocessing, embeddings).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ....errors import UnsupportedModelError
from ...adapter import PreprocessConfig
from ...class_swap import block_refusal, refuse_calls, undo_class_swap, wrap_blocks
from ...contract import ModelGeometry
from ...features import check_pixels, float_dtype, input_device, patch_side, square_grid, vit_patch_tokens
from ...runtime import PatchHandle, input_hook
from ..timm import TimmAdapter
from .forwards import open_clip_block_forwards, patched_class
from .towers import is_open_clip, open_clip_transformer, text_root, tower_modules, vision_root

__all__ = ["OpenClipAdapter"]

_BLOCK_CLASSES: dict[type, type] = {}
_INPUT_NAMES = ("q_x", "x", "query")  # how open_clip blocks / attentions name their input


def _need_vit(model: torch.nn.Module, tower: str, what: str) -> torch.nn.Module:
    """The open_clip ``VisionTransformer`` of ``model`` (for ``tower="vision"``), else a refusal naming the model."""
    if tower != "vision":
        raise UnsupportedModelError(f"open_clip {type(model).__name__}: the {tower!r} tower has no {what} (only the 'vision' tower has image patches)")
    root = vision_root(model)
    if root is None:
        visual = getattr(model, "visual", None)
        raise UnsupportedModelError(
            f"open_clip {type(model).__name__}: its image tower is a {type(visual).__module__}.{type(visual).__name__}, "
            f"not an open_clip VisionTransformer, so its {what} is unknown here"
        )
    return root


def _need_clip(model: torch.nn.Module, call: str) -> None:
    if not callable(getattr(model, call, None)):
        raise UnsupportedModelError(f"open_clip {type(model).__name__} has no {call} (expected a whole model: CLIP, CustomTextCLIP, CoCa)")


class OpenClipAdapter:
    """Adapter for open_clip models (``CLIP``, ``CustomTextCLIP``, ``CoCa``) and their ``VisionTransformer`` tower."""

    library = "open_clip"
    supports = "open_clip models with a VisionTransformer image tower"

    @staticmethod
    def detect(model: torch.nn.Module) -> str | None:
        """``"vision"`` for an open_clip model (or tower) this adapter handles, else ``None``."""
        if open_clip_transformer() is None or not is_open_clip(model):
            return None
        if vision_root(model) is not None or hasattr(model, "visual"):
            return "vision"
        return "text" if text_root(model) is not None else None

    @staticmethod
    def towers(model: torch.nn.Module) -> dict[str, str]:
        """``{"vision": "vision", "text": "text"}`` for a whole CLIP; ``{"vision": "vision"}`` for a
        ``VisionTransformer`` alone (or a model whose text tower is a Hugging Face encoder)."""
        out = {}
        if vision_root(model) is not None or hasattr(model, "visual"):
            out["vision"] = "vision"
        if text_root(model) is not None:
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
            root = vision_root(handle.model)
            out += [root, root.transformer]
        if "text" in handle.towers:
            found = text_root(handle.model)
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
        """None of :data:`~attnpatch.patchers.contract.MODEL_FEATURES` (scaled-cosine logits and head scaling are folded into ``q`` / applied outside the attention)."""
        return {}

    @staticmethod
    def geometry(model: torch.nn.Module, towers: tuple[str, ...], kind: str) -> ModelGeometry:
        """Layers of ``towers``; heads and head size of their first attention module, read from the model."""
        mods = [a for t in towers for _, a in tower_modules(model, t)]
        heads = int(mods[0].num_heads) if mods else None
        head_dim = int(mods[0].head_dim) if mods and getattr(mods[0], "head_dim", None) else None
        return ModelGeometry(num_layers=len(mods), heads=heads, kv_heads=heads, head_dim=head_dim, kind=kind)

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
        if "vision" in handle.towers and vision_root(handle.model) is None:
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
            visual = vision_root(handle.model)
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
                    cls = patched_class(original)
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
                    handle, vision_root(model), ("forward_intermediates",),
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


    # ------------------------------------------------------------------ what the evals ask

    @staticmethod
    def patch_size(model: torch.nn.Module, tower: str = "vision") -> int:
        """Side in pixels of the image tower's square patches (``VisionTransformer.patch_size``).

        Raises:
            UnsupportedModelError: ``tower`` is not ``"vision"``, or the image tower is not an open_clip
                ``VisionTransformer`` (``ModifiedResNet``, a timm trunk; the message names the model).
        """
        return patch_side(_need_vit(model, tower, "patch size").patch_size)

    @staticmethod
    def grid(model: torch.nn.Module, resolution: int, tower: str = "vision") -> tuple[int, int]:
        """``(rows, columns)`` of patches on a square ``resolution``-pixel input.

        Raises:
            UnsupportedModelError: see :meth:`patch_size`; OptionError: ``resolution`` below one patch.
        """
        return square_grid(resolution, OpenClipAdapter.patch_size(model, tower))

    @staticmethod
    def token_count(model: torch.nn.Module, resolution: int, tower: str = "vision") -> int:
        """Tokens the image tower's attention sees on a square ``resolution``-pixel input: patches + the class token.

        Raises:
            UnsupportedModelError: see :meth:`patch_size`; OptionError: ``resolution`` below one patch.
        """
        rows, cols = OpenClipAdapter.grid(model, resolution, tower)
        return rows * cols + OpenClipAdapter.prefix_tokens(model, "vision")

    @staticmethod
    def feature_prefix_tokens(model: torch.nn.Module) -> int:
        """The class token: 1 (open_clip's ViT has no register tokens).

        Raises:
            UnsupportedModelError: the image tower is not an open_clip ``VisionTransformer``.
        """
        _need_vit(model, "vision", "image features")
        return 1

    @staticmethod
    def preprocess_config(model: torch.nn.Module, processor: Any = None) -> PreprocessConfig:
        """The image tower's preprocessing as open_clip's factory recorded it (``visual.preprocess_cfg``; or
        ``processor``, a ``preprocess_cfg`` dict, where given): resize the shortest edge (``resize_mode``
        ``"shortest"``; ``"longest"`` pads, ``"squash"`` does not crop) to the tower's ``image_size`` and crop it,
        with the config's interpolation, mean and std.

        Raises:
            UnsupportedModelError: a model built without open_clip's factory (no ``preprocess_cfg``), or a
                ``processor`` that is not a dict.
        """
        visual = vision_root(model) or getattr(model, "visual", model)
        cfg = processor if processor is not None else getattr(visual, "preprocess_cfg", None)
        if not isinstance(cfg, Mapping):
            raise UnsupportedModelError(
                f"open_clip {type(model).__name__}: no preprocess_cfg on its image tower (a model built without "
                "open_clip.create_model / create_model_and_transforms) and no preprocess_cfg dict given"
                if processor is None else f"processor: expected open_clip's preprocess_cfg dict, got {type(processor).__name__}"
            )
        size = getattr(visual, "image_size", None) or cfg.get("size")
        res = int(size[0] if isinstance(size, (tuple, list)) else size)
        mode = cfg.get("resize_mode", "shortest")
        return PreprocessConfig(
            library="open_clip", resolution=res, resize={"shortest_edge": res, "mode": mode},
            crop=None if mode == "squash" else res, interpolation=cfg.get("interpolation"),
            mean=tuple(float(v) for v in cfg.get("mean", ())), std=tuple(float(v) for v in cfg.get("std", ())), native=dict(cfg),
        )

    @staticmethod
    def image_pipeline(processor: Any, resolution: int | None) -> None:
        """open_clip builds its transform with the model (``create_model_and_transforms``): no pipeline from a
        processor here (``None``)."""
        return None

    @staticmethod
    def encode(
        model: torch.nn.Module, pixel_values: torch.Tensor, layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Frozen CLS / patch-mean features are not read from open_clip towers: refused (use :meth:`embed_image`).

        Raises:
            UnsupportedModelError: always.
        """
        raise UnsupportedModelError(
            f"open_clip {type(model).__name__}: frozen token features (CLS, patch mean) are not read from open_clip towers; "
            "use embed_image for the projected image embedding"
        )

    @staticmethod
    @torch.no_grad()
    def patch_tokens(model: torch.nn.Module, pixel_values: torch.Tensor, last: int = 1) -> torch.Tensor:
        """Per-patch features of the image tower: the outputs of its last ``last`` residual blocks through ``ln_post``
        (the tokens open_clip returns with ``output_tokens=True``), the class token dropped, read back at every input
        patch after a token-merging patch (:func:`~attnpatch.patchers.features.vit_patch_tokens`).

        Args:
            model: an open_clip CLIP or its ``VisionTransformer``; pixel_values: ``[B, 3, R, R]`` at the tower's
                ``image_size`` (its positional embedding is not interpolated); last: how many of the last blocks to read.

        Returns:
            ``[B, R / patch, R / patch, last * C]`` float32 on CPU.

        Raises:
            UnsupportedModelError: the image tower is not a ``VisionTransformer``, pools with attention (``attn_pool``:
            its tokens are not per patch), or the input is not of its ``image_size``; OptionError: ``last`` out of range.
        """
        visual = _need_vit(model, "vision", "per-patch features")
        check_pixels(pixel_values)
        if getattr(visual, "attn_pool", None) is not None:
            raise UnsupportedModelError(f"open_clip {type(model).__name__}: its image tower pools with attention (attn_pool), "
                                        "so its output tokens are not one per patch")
        size = getattr(visual, "image_size", None)
        side = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        if size is not None and tuple(pixel_values.shape[-2:]) != tuple(side):
            raise UnsupportedModelError(
                f"open_clip {type(model).__name__}: images of {tuple(pixel_values.shape[-2:])} px, but its positional embedding is "
                f"for {side} px and open_clip does not interpolate it; use --resolution {side[0]}")
        x = pixel_values.to(input_device(visual), float_dtype(visual))
        p = OpenClipAdapter.patch_size(model)
        blocks = [b for b, _ in tower_modules(model, "vision")]
        return vit_patch_tokens(model, lambda: visual(x), prefix=OpenClipAdapter.feature_prefix_tokens(model), blocks=blocks,
                                norm=getattr(visual, "ln_post", None), last=last, grid=(x.shape[-2] // p, x.shape[-1] // p),
                                seq_first=not getattr(visual.transformer, "batch_first", True))

    @staticmethod
    @torch.no_grad()
    def embed_image(model: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        """``model.encode_image(x)``: ``[B, D]`` projected image embeddings in the model's dtype, not normalised.

        Raises:
            UnsupportedModelError: a model without ``encode_image`` (a tower alone); OptionError: ``pixel_values``
                not ``[B, 3, H, W]``.
        """
        _need_clip(model, "encode_image")
        check_pixels(pixel_values)
        return model.encode_image(pixel_values.to(next(model.parameters()).device, float_dtype(model)))

    @staticmethod
    @torch.no_grad()
    def embed_text(model: torch.nn.Module, tokens: Any) -> torch.Tensor:
        """``model.encode_text(tokens)``: ``[T, D]`` projected text embeddings, not normalised.

        Args:
            model: an open_clip ``CLIP`` / ``CustomTextCLIP`` / ``CoCa``.
            tokens: ``[T, L]`` int64 token ids (``open_clip.get_tokenizer(...)(texts)``), moved to the model's device.

        Raises:
            UnsupportedModelError: a model without ``encode_text``.
        """
        _need_clip(model, "encode_text")
        return model.encode_text(tokens.to(next(model.parameters()).device))
