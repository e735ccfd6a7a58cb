"""The one fix CLIP_benchmark 1.6.2 needs under numpy >= 2.4, applied only while our calls run.

``clip_benchmark.metrics.zeroshot_classification.accuracy`` ends in
``float(correct[:k].reshape(-1).float().sum(0, keepdim=True).cpu().numpy())``: ``float()`` of a
1-element 1-D array, which numpy 2.4 refuses (``TypeError: only 0-dimensional arrays can be converted to
Python scalars``), so every zero-shot classification run of ``zeroshot_classification.evaluate`` fails
(LAION-AI/CLIP_benchmark issue 147, open at 1.6.2). :func:`accuracy` is that function with the sum
taken to a 0-d value first -- the same numbers; :func:`numpy_shim` swaps it in for the duration of a
``with`` block and puts the upstream one back. ``tests/test_clip_benchmark.py`` runs the upstream
function unshimmed and fails once upstream is fixed, saying to remove this module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["accuracy", "numpy_shim"]


def accuracy(output: torch.Tensor, target: torch.Tensor, topk: Sequence[int] = (1,)) -> list[float]:
    """Top-k accuracies, CLIP_benchmark's ``zeroshot_classification.accuracy`` without the numpy 2.4 crash.

    Args:
        output: ``[N, C]`` logits.
        target: ``[N]`` int true classes.
        topk: cut-offs, each at most ``C``.

    Returns:
        the fraction of rows whose target is among the ``k`` highest logits, for each ``k`` of ``topk``
        (ties ordered as ``torch.topk`` orders them, as upstream).
    """
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    n = len(target)
    return [float(correct[:k].reshape(-1).float().sum()) / n for k in topk]  # upstream: .sum(0, keepdim=True).cpu().numpy()


@contextlib.contextmanager
def numpy_shim() -> Iterator[None]:
    """Inside the block, ``zeroshot_classification.evaluate`` calls :func:`accuracy`; the upstream one is back after."""
    from clip_benchmark.metrics import zeroshot_classification as zc

    upstream = zc.accuracy
    zc.accuracy = accuracy
    try:
        yield
    finally:
        zc.accuracy = upstream
