"""Class swaps: how the adapters route a module through the patch by swapping its class, and undo it.

:func:`wrap_blocks` swaps a transformer block's class for a subclass whose forward runs a method's block
hook (ToMe) between the attention and the MLP branch, given the library's block forward (which each
adapter keeps: :func:`attnpatch.patchers.adapters.timm.timm_block_forwards` and its relatives);
:func:`refuse_calls` shadows model methods a patch cannot serve; :func:`undo_class_swap` puts the
original classes back.  Library-neutral: nothing here knows a model library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import UnsupportedModelError
from .state import LayerContext

if TYPE_CHECKING:  # annotations only
    from .runtime import PatchHandle

__all__ = ["run_block_hook", "wrap_blocks", "refuse_calls", "block_refusal", "undo_class_swap"]


def run_block_hook(handle: "PatchHandle", layer: int, x: torch.Tensor) -> torch.Tensor:
    """Run the method's block hook on a block's residual stream between its attention and MLP branch.

    Adapters whose blocks :func:`wrap_blocks` wrapped call it with ``x`` ``[B, N, C]`` (batch first)
    after ``x + attention(...)``; the method returns ``[B, N', C]`` (ToMe: ``N' = N - r``).
    """
    state = handle.state
    ctx = LayerContext(
        layer=layer, num_layers=handle.num_layers, scale=1.0, causal=False, prefix_tokens=handle.prefix_tokens,
        state=state, record=state is not None and state.record,
    )
    return handle.method.block_hook(handle.config, x, ctx)


def wrap_blocks(handle: "PatchHandle", blocks: list[tuple[int, torch.nn.Module]], forwards: dict[type, Callable], cache: dict) -> list:
    """Class-swap each ``(layer, block)`` so that its forward runs the method's block hook between the
    attention and the MLP branch (for a method with ``block_hook``; adapters call it from ``apply``).

    Args:
        handle: the model's patch.
        blocks: ``(attention-layer index, block module)`` pairs.
        forwards: block class -> ``forward(block, hook, *args, **kwargs)``, the library's block forward
            with ``x = hook(x)`` between the two branches (``hook`` takes and returns ``[B, N, C]``).
        cache: the adapter's cache of generated subclasses.

    Returns:
        ``[(block, original class), ...]`` for :func:`undo_class_swap`.

    Raises:
        UnsupportedModelError: a block whose class has no entry in ``forwards``.
    """
    swapped = []
    for layer, block in blocks:
        cls = type(block)
        fwd = forwards.get(cls)
        if fwd is None:
            raise UnsupportedModelError(block_refusal(handle, [block], forwards))
        if cls not in cache:
            def forward(self, *args, _fwd=fwd, **kwargs):
                h = self._attnpatch

                def hook(x):
                    return run_block_hook(h, self._attnpatch_layer, x)

                return _fwd(self, hook, *args, **kwargs)

            cache[cls] = type(f"AttnpatchBlock{cls.__name__}", (cls,), {"forward": forward, "_attnpatch_original_class": cls})
        block._attnpatch = handle
        block._attnpatch_layer = layer
        block.__class__ = cache[cls]
        swapped.append((block, cls))
    return swapped


class _RefusedCall:
    """An instance attribute that shadows a model method the patch cannot serve; ``remove()`` restores the method."""

    def __init__(self, module: torch.nn.Module, name: str, message: str):
        self.module, self.name, self.message = module, name, message
        module.__dict__[name] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError(self.message)

    def remove(self) -> None:
        if self.module.__dict__.get(self.name) is self:
            del self.module.__dict__[self.name]


def refuse_calls(handle: "PatchHandle", module: torch.nn.Module, names: tuple[str, ...], why: str) -> list[_RefusedCall]:
    """Make ``module``'s methods ``names`` (those it has) raise :class:`UnsupportedModelError` while patched
    (e.g. timm's ``forward_intermediates``, which reshapes tokens into the patch grid, under a method that
    merges tokens); each returned object's ``remove()`` restores the method (adapters put them with their hooks)."""
    out = []
    for name in names:
        if callable(getattr(module, name, None)):
            msg = f"{type(handle.model).__name__} patched with {handle.method.name!r}: {type(module).__name__}.{name} {why}; unpatch first"
            out.append(_RefusedCall(module, name, msg))
    return out


def block_refusal(handle: "PatchHandle", blocks: list[torch.nn.Module], forwards: dict[type, Callable]) -> str:
    """The error text for blocks a block-hook method cannot split (between attention and MLP)."""
    bad = sorted({f"{type(b).__module__}.{type(b).__name__}" for b in blocks if type(b) not in forwards})
    known = ", ".join(sorted(c.__name__ for c in forwards)) or "none"
    return (
        f"method {handle.method.name!r} changes the token count between the attention and the MLP branch of each block, "
        f"which needs a block forward the patch knows; {type(handle.model).__name__} has blocks of class {', '.join(bad)} "
        f"(supported blocks: {known})"
    )


def undo_class_swap(undo: Any) -> None:
    """Undo a class-swap adapter's ``apply``: ``undo = (swapped, hooks)`` with ``swapped`` a list of
    ``(module, original_class)``; removes the hooks, puts each original class back and drops the
    bindings (``_attnpatch``, ``_attnpatch_layer``, ``_attnpatch_tower``) set on the module."""
    swapped, hooks = undo
    for h in hooks:
        h.remove()
    for m, original in swapped:
        m.__class__ = original
        for attr in ("_attnpatch", "_attnpatch_layer", "_attnpatch_tower"):
            m.__dict__.pop(attr, None)
