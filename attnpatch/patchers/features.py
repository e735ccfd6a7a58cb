"""Feature extraction helpers the adapters' eval-facing methods share (library-neutral).

An adapter's ``encode`` runs its library's forward; :func:`vit_features` hooks the blocks, reads the
class token and the (token-size weighted) patch mean; :func:`input_device` says where a model's
inputs go; :func:`square_grid` counts the patches of a square input.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import OptionError, UnsupportedModelError
from .runtime import handle_on

__all__ = ["input_device", "vit_features", "vit_patch_tokens", "last_layers", "patch_side", "square_grid", "check_pixels", "float_dtype"]


def input_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's input embeddings (a causal LM's token embeddings; else its first parameter, e.g. a
    ViT's class token); the CPU when those weights are offloaded (on ``meta``: accelerate's hooks bring them in
    from CPU memory or disk and run the module on the CPU)."""
    try:
        dev = model.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        dev = next(model.parameters()).device
    return torch.device("cpu") if dev.type == "meta" else dev


def vit_features(
    model: torch.nn.Module,
    forward: Callable[[], torch.Tensor],
    *,
    prefix: int,
    blocks: list[torch.nn.Module],
    norm: torch.nn.Module | None,
    layers: tuple[int, ...] | list[int] = (),
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Final CLS token and mean patch token of one ViT forward, the library-neutral part of an adapter's ``encode``.

    Args:
        model: the ViT (patched or not); a patch that merged tokens (ToMe) gives each output token its size.
        forward: runs the model on its input and returns the output tokens ``[B, N, C]`` after the final norm.
        prefix: leading tokens left out of the patch mean (slot 0, read as the image feature, and register tokens).
        blocks: the transformer blocks, in order (hooked for ``layers``).
        norm: the final norm, applied to the intermediate CLS tokens (``None``: none).
        layers: block indices whose output CLS token (through ``norm``) is returned as well.

    Returns:
        ``(cls [B, C], patch_mean [B, C])`` float32 on CPU; with ``layers`` also ``{layer: cls_l [B, C]}``.
        On a model whose last forward merged tokens, the mean weighs each token by the input tokens it
        stands for (:attr:`PatchHandle.last_token_sizes`), so it is the mean over the input patches.

    Raises:
        UnsupportedModelError: ``layers`` given but ``blocks`` empty.
    """
    hooks, got = [], {}
    if layers:
        if not blocks:
            raise UnsupportedModelError(f"cannot find the transformer blocks of a {type(model).__name__} for layers={list(layers)}")
        for li in layers:
            def hook(module, args, out, li=li):
                h = out[0] if isinstance(out, tuple) else out
                got[li] = (norm(h) if norm is not None else h)[:, 0].float().cpu()

            hooks.append(blocks[li].register_forward_hook(hook))
    try:
        h = forward()
    finally:
        for hk in hooks:
            hk.remove()
    handle = handle_on(model)
    sizes = handle.last_token_sizes if handle is not None else None
    if sizes is not None and sizes.shape == h.shape[:2]:  # merged tokens (ToMe): each weighs the tokens it stands for
        w = sizes[:, prefix:].to(h.device, torch.float32)[..., None]
        pm = ((h[:, prefix:].float() * w).sum(1) / w.sum(1).clamp_min(1e-12)).cpu()
    else:
        pm = h[:, prefix:].float().mean(1).cpu()
    cls = h[:, 0].float().cpu()
    return (cls, pm, got) if layers else (cls, pm)


def last_layers(last: int, depth: int, model: torch.nn.Module) -> list[int]:
    """Indices of the last ``last`` of ``depth`` blocks, in order.

    Raises:
        OptionError: ``last`` not an int in ``[1, depth]``.
    """
    if isinstance(last, bool) or not isinstance(last, int) or not 1 <= last <= depth:
        raise OptionError(f"last={last!r}: must be an int from 1 to {depth} (blocks of the {type(model).__name__})")
    return list(range(depth - last, depth))


def vit_patch_tokens(
    model: torch.nn.Module,
    forward: Callable[[], Any],
    *,
    prefix: int,
    blocks: list[torch.nn.Module],
    norm: torch.nn.Module | None,
    last: int,
    grid: tuple[int, int],
    seq_first: bool = False,
) -> torch.Tensor:
    """Per-patch features of one ViT forward, the library-neutral part of an adapter's ``patch_tokens``.

    The outputs of the last ``last`` blocks, each through the model's final norm (as DINOv2's
    ``get_intermediate_layers(n, norm=True)`` reads them for its linear segmentation protocol), without the
    prefix tokens, concatenated on the channel axis.  After a token-merging patch (ToMe), each block's
    output is read back at every input patch through the forward's source map
    (:attr:`~attnpatch.patchers.state.ForwardState.token_source`, as tomesd unmerges), so every setting
    gives one feature per input patch.

    Args:
        model: the ViT (patched or not).
        forward: runs the model once on its input (its output is not read).
        prefix: leading tokens (CLS + registers) dropped.
        blocks: the transformer blocks, in order; norm: the final norm (``None``: none).
        last: how many of the last blocks to read (1: the last block's output only).
        grid: ``(rows, columns)`` of patches of the input.
        seq_first: the blocks' outputs are ``[N, B, C]`` (open_clip's older layout) rather than ``[B, N, C]``.

    Returns:
        ``[B, rows, columns, last * C]`` float32 on CPU, patches in row-major order.

    Raises:
        OptionError: ``last`` out of range; UnsupportedModelError: no blocks found, or a block's output has
        another token count than the input without a source map to read it back (a token-reducing patch that
        keeps none), or the token count does not match ``grid``.
    """
    if not blocks:
        raise UnsupportedModelError(f"cannot find the transformer blocks of a {type(model).__name__} to read patch tokens from")
    layers = last_layers(last, len(blocks), model)
    handle = handle_on(model)
    rows, cols = grid
    got: dict[int, torch.Tensor] = {}

    def hook(module, args, out, li):
        h = out[0] if isinstance(out, tuple) else out
        if seq_first:
            h = h.transpose(0, 1)
        h = norm(h) if norm is not None else h
        state = handle.state if handle is not None else None
        source = state.token_source if state is not None else None
        if source is not None and source.shape[1] != h.shape[1]:
            from ..attention.merge import unmerge

            h = unmerge(h, source.to(h.device))
        if h.shape[1] != prefix + rows * cols:
            raise UnsupportedModelError(
                f"{type(model).__name__}: block {li} gave {h.shape[1]} tokens, expected {prefix} prefix + {rows}x{cols} patches; "
                "a patch that drops tokens without a source map has no per-patch output"
            )
        got[li] = h[:, prefix:].float().reshape(h.shape[0], rows, cols, -1).cpu()

    hooks = [blocks[li].register_forward_hook(lambda m, a, o, li=li: hook(m, a, o, li)) for li in layers]
    try:
        forward()
    finally:
        for hk in hooks:
            hk.remove()
    return torch.cat([got[li] for li in layers], dim=-1)


def patch_side(p: Any) -> int:
    """A patch size as the libraries store it (an int, or a ``(height, width)`` pair) as one side in pixels (the first)."""
    return int(p[0] if isinstance(p, (tuple, list)) else p)


def square_grid(resolution: int, patch: int) -> tuple[int, int]:
    """``(rows, columns)`` of ``patch``-pixel patches on a square ``resolution``-pixel input (``resolution // patch``
    each way: a ViT drops the pixels past the last whole patch).

    Raises:
        OptionError: ``resolution`` is not an int, or smaller than one patch.
    """
    if isinstance(resolution, bool) or not isinstance(resolution, int):
        raise OptionError(f"resolution={resolution!r}: must be an int (square side in pixels)")
    if resolution < patch:
        raise OptionError(f"resolution {resolution}: smaller than the model's patch size ({patch} px)")
    return resolution // patch, resolution // patch


def check_pixels(pixel_values: Any) -> None:
    """Refuse anything but a ``[B, 3, H, W]`` tensor.

    Raises:
        OptionError: ``pixel_values`` is not a 4-D tensor with 3 channels (the message gives its shape).
    """
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4 or pixel_values.shape[1] != 3:
        shape = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values).__name__
        raise OptionError(f"pixel_values: expected a [B, 3, H, W] tensor, got {shape}")


def float_dtype(model: torch.nn.Module) -> torch.dtype:
    """Dtype of the model's first floating-point weight."""
    return next(p for p in model.parameters() if p.is_floating_point()).dtype
