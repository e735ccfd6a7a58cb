"""Captured attention inputs: a causal LM's ``q, k, v`` at some layers (``attnpatch bench capture``) and loading them back."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from ...errors import AttnpatchError, OptionError

__all__ = ["capture_qkv", "load_qkv"]


def capture_qkv(model, input_ids: torch.Tensor, layers: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Queries, keys and values of the given attention layers of a causal LM on ``input_ids``.

    The model is patched with ``dense`` for the call (unpatched afterwards) and the forward
    stops after the last requested layer, so the cost is that of those layers only.

    Args:
        model: a Hugging Face causal LM the patch supports.
        input_ids: ``[1, L]`` token ids.
        layers: attention-layer indices.

    Returns:
        ``{layer: {"q": [1, H, L, D], "k": [1, Hkv, L, D], "v": [1, Hkv, L, D], "scale": float}}`` (detached copies).

    Raises:
        OptionError: a layer index outside the model.
    """
    from ...patchers.api import handle_of, patch, record_stats, unpatch

    want = sorted({int(x) for x in layers})
    got: dict[int, dict[str, Any]] = {}

    class _Done(Exception):
        pass

    def probe(ctx, q, k, v):
        if ctx.layer in want:
            got[ctx.layer] = {"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone(), "scale": float(ctx.scale)}
            if len(got) == len(want):
                raise _Done

    patch(model, "dense")
    try:
        n = handle_of(model).num_layers
        bad = [x for x in want if not 0 <= x < n]
        if bad:
            raise OptionError(f"layers={bad}: the model has attention layers 0..{n - 1}")
        with torch.no_grad(), record_stats(model, probe=probe):
            try:
                model(input_ids, use_cache=False)
            except _Done:
                pass
    finally:
        unpatch(model)
    return got


def load_qkv(path: str | Path, layer: int | None = None) -> tuple[dict[str, Any], int]:
    """Load a file written by ``attnpatch bench capture``: ``(entry, layer)`` for ``layer`` (default: the first).

    ``entry`` is ``{"q": [B, H, L, D], "k": [B, Hkv, L, D], "v": [B, Hkv, L, D], "scale": float}`` on the CPU.

    Raises:
        AttnpatchError: missing file or layer.
    """
    p = Path(path)
    if p.is_dir():
        raise AttnpatchError(f"--qkv {path}: is a directory; give the file `attnpatch bench capture` wrote")
    if not p.is_file():
        raise AttnpatchError(f"--qkv {path}: no such file (write one with `attnpatch bench capture`)")
    bad = AttnpatchError(f"--qkv {path}: not a file written by `attnpatch bench capture` (expected {{layer: {{'q', 'k', 'v', 'scale'}}}})")
    try:
        data = torch.load(p, map_location="cpu")
    except Exception:
        raise bad from None
    ok = isinstance(data, dict) and data and all(
        isinstance(lk, int) and isinstance(e, dict) and {"q", "k", "v", "scale"} <= set(e)
        and all(isinstance(e[x], torch.Tensor) and e[x].dim() == 4 for x in "qkv")
        for lk, e in data.items()
    )
    if not ok:
        raise bad
    if layer is None:
        layer = min(data)
    if layer not in data:
        raise AttnpatchError(f"--layer {layer}: {path} holds layers {sorted(data)}")
    return data[layer], layer
