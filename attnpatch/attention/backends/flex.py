"""FlexAttention for the block-sparse baselines: the compiled ``flex_attention``, its length buckets and the fallback
to the gather paths.  The patterns themselves (tile tables and ``mask_mod``): :mod:`attnpatch.attention.sparse.masks`;
the rule that picks FlexAttention for a call (the methods' ``kernel`` option):
:mod:`attnpatch.attention.backends.dispatch`.

Sources: FlexAttention, Dong et al., "Flex Attention: A Programming Model for Generating Optimized Attention
Kernels", arXiv 2412.05496 (``mask_mod``, ``BlockMask``: per (query tile, key tile) the tiles to skip, to
compute with the mask, and to compute whole); attention-gym's ``attn_gym/masks/``.

Length buckets.  ``flex_attention`` is compiled for static shapes; a new shape is a new compilation, and past
the compile cache's limit Dynamo would silently run its eager path, which builds every ``queries x keys``
score.  So queries are padded to :func:`bucket_length` ``(Lq)`` rows and the (shifted) keys to
:func:`bucket_length` ``(base + Lq)`` (:func:`padded_lengths`), and every tensor a ``mask_mod`` reads is sized by
these two buckets (and the batch and heads) alone, with positions and sizes passed as 0-d tensors: one
compilation per (bucket pair, batch, heads, head dim, dtype, pattern kind).  Padded keys are masked, padded query
rows have no tile and are dropped.  The compiled function is isolated (``isolate_recompiles``) with a limit of
:data:`RECOMPILE_LIMIT` compilations and ``fullgraph=True``, so that reaching the limit raises instead of running
eager: :func:`flex_attend` then runs the caller's gather path and warns once; :data:`FLEX_STATS` counts both.

Grouped-query attention runs with ``enable_gqa=True`` (keys and values are not repeated).
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Callable

import torch

__all__ = [
    "FLEX_BLOCK", "RECOMPILE_LIMIT", "FLEX_STATS", "FLEX_DTYPES", "bucket_length", "padded_lengths",
    "flex_unsupported", "flex_unavailable", "flex_broken", "forget_failures", "flex_attention_compiled", "run_tiles", "flex_attend", "FlexCompileError",
]

#: Queries and keys per tile of the ``BlockMask`` (FlexAttention's default sparse block size).
FLEX_BLOCK = 128
#: Compilations of the isolated compiled ``flex_attention`` before it raises instead of compiling again.
RECOMPILE_LIMIT = 64
#: Per process: ``calls`` run by the compiled kernel, ``fallbacks`` to the gather path (compile limit or failure).
FLEX_STATS = {"calls": 0, "fallbacks": 0}
#: Input dtypes the compiled kernel takes.
FLEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_BROKEN: list[str] = []  # why torch.compile failed in this process ("auto" then stays on the gather path)


def bucket_length(n: int) -> int:
    """The padded length of ``n`` tokens: the smallest of ``FLEX_BLOCK x {1, 2, 3, 4, 6, 8, 12, 16, 24, ...}``
    (powers of two and 1.5 times them, two per doubling) that is ``>= n``; so at most 1.5 times ``n`` above
    ``2 FLEX_BLOCK`` and about ``2 log2(N / FLEX_BLOCK)`` buckets up to ``N`` tokens."""
    t = max(1, -(-n // FLEX_BLOCK))
    p = 1 << (t - 1).bit_length()  # next power of two >= t
    if p >= 4 and 3 * p // 4 >= t:
        p = 3 * p // 4
    return p * FLEX_BLOCK


def flex_unsupported(device: torch.device, dtype: torch.dtype) -> str | None:
    """``None`` when the compiled FlexAttention kernel takes tensors of ``dtype`` on ``device`` here, else why not."""
    if dtype not in FLEX_DTYPES:
        return f"flex_attention's compiled kernel takes {', '.join(str(d) for d in FLEX_DTYPES)}, not {dtype}"
    if device.type not in ("cpu", "cuda"):
        return f"flex_attention is compiled here for CPU and CUDA tensors, not {device.type}"
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as exc:  # an older PyTorch
        return f"torch.nn.attention.flex_attention is not available ({exc})"
    return None


def flex_unavailable(q: torch.Tensor) -> str | None:
    """``None`` when the compiled FlexAttention kernel can take ``q`` here, else why not."""
    if q.requires_grad and torch.is_grad_enabled():
        return "the flex path is inference-only (inputs require grad)"
    return flex_unsupported(q.device, q.dtype)


def flex_broken() -> str | None:
    """Why ``torch.compile(flex_attention)`` failed in this process (``kernel="auto"`` then stays on the gather
    path), or ``None``."""
    with _lock:
        return _BROKEN[-1] if _BROKEN else None


def forget_failures() -> None:
    """Forget this process's compile failures (tests that simulate one clean up with it)."""
    with _lock:
        _BROKEN.clear()


@functools.lru_cache(maxsize=None)
def flex_attention_compiled() -> Callable:
    """``torch.compile(flex_attention)``: static shapes, ``fullgraph=True``, its own compile cache of at most
    :data:`RECOMPILE_LIMIT` entries (``isolate_recompiles=True``; on a torch without those arguments, dynamo's
    process-wide limit raised to at least it), built once per process."""
    import inspect

    from torch.nn.attention.flex_attention import flex_attention

    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(flex_attention, dynamic=False, fullgraph=True, recompile_limit=RECOMPILE_LIMIT,
                             isolate_recompiles=True)
    # older torch (2.11 and before): no per-function limit; raise dynamo's process-wide one to at least ours
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(int(getattr(dynamo_config, name)), RECOMPILE_LIMIT))
            break
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def _ordered(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num [..., nq] int32, indices [..., nq, nk] int32)``: each row's True columns first, ascending."""
    nk = table.shape[-1]
    col = torch.arange(nk, device=table.device, dtype=torch.int32)
    key = torch.where(table, col, col + nk)
    return table.sum(-1, dtype=torch.int32), key.sort(dim=-1).indices.to(torch.int32)


def _block_mask(partial: torch.Tensor, full: torch.Tensor, mask_mod, lqp: int, lkp: int):
    """A ``BlockMask`` of ``FLEX_BLOCK`` tiles from the ``[B, Hm, nq, nk]`` bool tile tables."""
    from torch.nn.attention.flex_attention import BlockMask

    num, idx = _ordered(partial)
    fnum, fidx = _ordered(full)
    return BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(lqp, lkp))


def _pad_rows(x: torch.Tensor, front: int, total: int) -> torch.Tensor:
    """``x`` ``[B, H, L, D]`` at rows ``front .. front + L - 1`` of ``total`` zero rows (``x`` when nothing moves)."""
    b, h, n, d = x.shape
    if front == 0 and n == total:
        return x.contiguous()
    out = x.new_zeros(b, h, total, d)
    out[:, :, front : front + n] = x
    return out


def run_tiles(q, k, v, partial, full, mask_mod, *, scale: float, s: int, lqp: int, lkp: int, lc: int) -> torch.Tensor:
    """The compiled kernel over tile tables: ``q`` padded to ``lqp`` rows, the keys up to ``lc`` placed after ``s``
    empty slots of ``lkp``; ``partial``/``full`` ``[B, 1 or H, lqp / 128, lkp / 128]`` bool tile tables and the
    ``mask_mod`` of the partial tiles.  Returns ``[B, H, Lq, Dv]`` (padded rows dropped).

    Raises:
        FlexCompileError: ``torch.compile`` failed or reached :data:`RECOMPILE_LIMIT` (:func:`flex_attend`).
    """
    lq = q.shape[2]
    k, v = k[:, :, :lc], v[:, :, :lc]
    bm = _block_mask(partial, full, mask_mod, lqp, lkp)
    qp = _pad_rows(q, 0, lqp)
    kp = _pad_rows(k, s, lkp)
    vp = _pad_rows(v, s, lkp)
    try:
        out = flex_attention_compiled()(qp, kp, vp, block_mask=bm, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch.compile's own failures (and its limit), for flex_attend
        raise FlexCompileError(f"{type(exc).__name__}: {exc}") from exc
    return out[:, :, :lq] if lqp != lq else out


class FlexCompileError(RuntimeError):
    """``torch.compile(flex_attention)`` failed or reached its compile limit (``__cause__``: the original error)."""


def flex_attend(run_flex: Callable[[], torch.Tensor], run_gather: Callable[[], torch.Tensor], *,
                kernel: str) -> torch.Tensor:
    """``run_flex()``, falling back to ``run_gather()`` (the same kept set) where the compiled kernel cannot run.

    ``kernel`` is the method's ``kernel`` option that chose FlexAttention: ``"flex"`` (asked for by name: an error where
    it cannot run) or ``"auto"``.  With ``"auto"``, where the compiled function has reached :data:`RECOMPILE_LIMIT`
    compilations or ``torch.compile`` fails here (no C++ compiler, an Inductor or Triton error: a
    :class:`FlexCompileError` from the compiled call), the gather path runs instead, with a ``RuntimeWarning`` once
    per process; after a compile failure ``"auto"`` no longer picks flex in this process.  Other errors (out of
    memory, bad inputs) propagate.  Counted in :data:`FLEX_STATS`.

    Raises:
        RuntimeError: ``kernel="flex"`` and the compiled kernel cannot run (limit reached or compile error).
    """
    from torch._dynamo.exc import FailOnRecompileLimitHit

    strict = kernel == "flex"
    try:
        out = run_flex()
    except (FlexCompileError, FailOnRecompileLimitHit) as exc:  # the compiled call only: other errors are bugs
        cause = exc.__cause__ if isinstance(exc, FlexCompileError) and exc.__cause__ is not None else exc
        limit = isinstance(cause, FailOnRecompileLimitHit)
        if strict:
            if limit:
                raise RuntimeError(
                    f"kernel='flex': the compiled flex_attention reached its limit of {RECOMPILE_LIMIT} compiled shapes "
                    "in this process; use kernel='auto' (falls back to the gather path) or 'gather'") from exc
            raise RuntimeError(f"kernel='flex': torch.compile(flex_attention) failed here: {cause}") from exc
        with _lock:
            FLEX_STATS["fallbacks"] += 1
            first = FLEX_STATS["fallbacks"] == 1
            if not limit:
                _BROKEN.append(f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
        if first:
            why = (f"reached its limit of {RECOMPILE_LIMIT} compiled shapes in this process" if limit
                   else f"failed to compile here ({_BROKEN[-1][:200]})")
            warnings.warn(f"attnpatch: flex_attention {why}; running the gather path", RuntimeWarning, stacklevel=3)
        return run_gather()
    with _lock:
        FLEX_STATS["calls"] += 1
    return out


def padded_lengths(lq: int, base: int) -> tuple[int, int, int, int]:
    """``(lqp, lkp, lqt, lkt)``: the padded query rows and shifted key slots (:func:`bucket_length`), and the same
    rounded up to whole tiles (the tables' sizes; equal to them for the buckets)."""
    lqp, lkp = bucket_length(lq), bucket_length(base + lq)
    return lqp, lkp, -(-lqp // FLEX_BLOCK) * FLEX_BLOCK, -(-lkp // FLEX_BLOCK) * FLEX_BLOCK
