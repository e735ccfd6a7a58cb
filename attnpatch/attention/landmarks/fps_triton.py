"""Farthest-point sampling as one Triton kernel: every step of the greedy traversal on the device, no host sync.

:func:`farthest_point_sampling_triton` has the contract of
:func:`~attnpatch.attention.landmarks.fps.farthest_point_sampling` (``[B, N, D]`` features in, ``[B, s]`` int64 token
indices out, the prefix tokens first, ties to the lowest index), which runs it for CUDA tensors.

Kernel (:func:`_fps_kernel`).  The grid is ``(B, P)``: ``P`` programs per item, each owning the token blocks
``p, p + P, p + 2P, ...`` (``BLOCK_N`` tokens each) and their running minimum distance (a float32 ``[B, N]``
scratch, read and written once per step).  One *pass* with a new centre ``c`` streams the program's blocks of
``x`` once (float32 in registers whatever the input dtype, ``BLOCK_D`` columns at a time), updates
``dist_i = min(dist_i, |x_i - x_c|^2)`` with the exact squared difference (never negative, no cancellation
between ``|x|^2`` terms, as the float64 reference computes it), marks the centre and the prefix tokens ``-1``
and returns the program's best candidate as one int64 key ``bits(dist) << 32 | (2^31 - 1 - i)``: for
``dist >= 0`` the float's bit pattern orders like the float, so the largest key is the largest distance and,
among equal distances, the lowest index.  The programs of an item combine their keys with one
``atomic_max`` per step into ``best[b, t]``; the next step's centre is decoded from it.  With ``P = 1`` (the
default when ``B`` fills the GPU, and under the interpreter) that is the whole algorithm: all ``s - prefix``
steps inside one program, no barrier.  With ``P > 1`` the programs of an item meet at a grid barrier after each
step (an arrival counter per step; acquire/release atomics, a bounded spin), which needs every program of the
launch resident at once: the launcher keeps ``B * P`` at most the multiprocessor count.  ``stepwise=True``
launches one kernel per step instead (the kernel boundary is the barrier): the same arithmetic without the spin,
for comparison and for running ``P > 1`` under the interpreter, whose programs run one after another.

Cost: ``s - 1`` passes, each reading ``x`` once (``N D`` elements) and the distance scratch twice; ``O(N)``
scratch, no ``N x s`` or ``N x N`` buffer.  The indices can differ from the PyTorch path's on near-ties (the
distances are rounded differently: float32 sums in another order).

Source: Gonzalez 1985 (farthest-first traversal); landmarks of FNA (arXiv 2507.16018, Sec. 3).
"""

from __future__ import annotations

import torch

from ...errors import OptionError
from ..backends.triton_support import TRITON_AVAILABLE, interpreted, launchable, on_gpu, sm_count

if TRITON_AVAILABLE:  # imported here, on first use of a kernel: `import attnpatch` loads no Triton module
    from ..backends.triton_support import tl, triton

__all__ = ["farthest_point_sampling_triton", "fps_programs"]

#: Spins of the per-step grid barrier before a program gives up waiting (about a second on a GPU); a give-up is
#: counted in the launch's status word (:func:`_fps_launch`), so a test can tell a missed barrier from a result.
MAX_SPINS = 1 << 22

_KEY_LOW = 0x7FFFFFFF  # low half of a key: 2^31 - 1 - token index (larger for lower indices; a literal in the kernels)


if TRITON_AVAILABLE:

    @triton.jit
    def _fps_pass(x_row, dist_row, c, first, n, d, stride_n, stride_d, pid_p, n_prog,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """One pass over program ``pid_p``'s token blocks with the new centre ``c``: ``dist = min(dist, |x - x_c|^2)``,
        the centre and the tokens below ``first`` set to -1; returns the best key of the blocks (-1: none)."""
        best = tl.full([], -1, tl.int64)
        for nb in range(pid_p, tl.cdiv(n, BLOCK_N), n_prog):
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for d0 in range(0, d, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                mask_d = offs_d < d
                xt = tl.load(x_row + offs_n.to(tl.int64)[:, None] * stride_n + offs_d[None, :] * stride_d,
                             mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
                # int64 offset whether c is a loop index (a Python int under the interpreter) or a tensor
                c_off = (c + tl.zeros([BLOCK_D], dtype=tl.int64)) * stride_n
                xc = tl.load(x_row + c_off + offs_d * stride_d, mask=mask_d, other=0.0).to(tl.float32)
                diff = xt - xc[None, :]
                acc += tl.sum(diff * diff, axis=1)
            old = tl.load(dist_row + offs_n, mask=mask_n, other=-1.0)
            new = tl.minimum(old, acc)
            new = tl.where((offs_n == c) | (offs_n < first), -1.0, new)
            tl.store(dist_row + offs_n, new, mask=mask_n)
            key = (new.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - offs_n).to(tl.int64)
            key = tl.where(mask_n & (new >= 0.0), key, -1)
            best = tl.maximum(best, tl.max(key, axis=0))
        return best

    @triton.jit
    def _fps_kernel(x_ptr, dist_ptr, best_ptr, count_ptr, status_ptr,
                    n, d, s, first, step_lo, step_hi, stride_b, stride_n, stride_d, n_prog, max_spins,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SYNC: tl.constexpr):
        """Steps ``step_lo .. step_hi - 1`` of FPS for item ``program_id(0)``, part ``program_id(1)`` of ``n_prog``
        (module docstring).  ``best[b, t]`` (int64, -1 before the step) receives step ``t``'s winning key;
        ``count[b, t]`` (int32, 0) counts the programs past step ``t`` when ``SYNC``; ``status`` counts barrier
        give-ups.  The launch with ``step_lo == first`` also runs the passes of the prefix centres ``0..first-2``."""
        pid_b = tl.program_id(0).to(tl.int64)
        pid_p = tl.program_id(1)
        x_row = x_ptr + pid_b * stride_b
        dist_row = dist_ptr + pid_b * n
        best_row = best_ptr + pid_b * s
        count_row = count_ptr + pid_b * s
        if step_lo == first:
            for j in range(0, first - 1):
                _fps_pass(x_row, dist_row, j, first, n, d, stride_n, stride_d, pid_p, n_prog, BLOCK_N, BLOCK_D)
        for t in range(step_lo, step_hi):
            # the newest centre: the last prefix token, else the previous step's winner (an atomic read: L2, coherent)
            prev = tl.atomic_add(best_row + t - 1, 0)  # t - 1 >= first - 1 >= 0; unused when t == first
            c = tl.where(t == first, first - 1, 0x7FFFFFFF - prev.to(tl.int32))  # low half: 2^31 - 1 - index
            key = _fps_pass(x_row, dist_row, c, first, n, d, stride_n, stride_d, pid_p, n_prog, BLOCK_N, BLOCK_D)
            tl.atomic_max(best_row + t, key)
            if SYNC:
                tl.atomic_add(count_row + t, 1, sem="release")
                seen = tl.atomic_add(count_row + t, 0, sem="acquire")
                spins = 0
                while (seen < n_prog) & (spins < max_spins):
                    seen = tl.atomic_add(count_row + t, 0, sem="acquire")
                    spins += 1
                if seen < n_prog:
                    tl.atomic_add(status_ptr, 1)


def _blocks(n: int, d: int) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_D)`` for ``n`` tokens of ``d`` features: on a GPU at most 128 columns and 8192 elements per
    tile (registers); under the interpreter, whose cost is per operation, not per element, up to 512 tokens a tile."""
    block_d = min(128, max(16, triton.next_power_of_2(d)))
    if interpreted():
        return max(16, min(512, triton.next_power_of_2(n))), block_d
    return max(16, min(128, 8192 // block_d)), block_d


def fps_programs(x: torch.Tensor) -> int:
    """Programs per item the launcher uses for ``x`` ``[B, N, D]`` by default: on a GPU, enough to spread the items
    over the multiprocessors (``B * P`` at most their count, at most one token block each); 1 under the
    interpreter or when ``B`` alone fills the GPU."""
    b, n, d = x.shape
    if not on_gpu(x) or interpreted():
        return 1
    block_n, _ = _blocks(n, d)
    return max(1, min(sm_count(x.device) // max(b, 1), triton.cdiv(n, block_n)))


def _fps_launch(
    x: torch.Tensor, s: int, prefix: int, programs: int | None, stepwise: bool, block_n: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`farthest_point_sampling_triton` plus its status word (int32 ``[1]``: barrier give-ups, 0 when sound);
    ``block_n`` (a power of two >= 16) overrides the token tile, so that tests can give several programs work."""
    b, n, d = x.shape
    if not max(prefix, 1) <= s <= n:
        raise OptionError(f"s={s}: farthest-point sampling needs {max(prefix, 1)} <= s <= N={n} tokens")
    if not TRITON_AVAILABLE:
        raise RuntimeError("farthest_point_sampling_triton needs Triton (pip install triton); use kernel='torch'")
    if not launchable(x):
        raise RuntimeError(
            f"farthest_point_sampling_triton on a {x.device.type} tensor needs TRITON_INTERPRET=1 set before "
            "attnpatch is imported; use kernel='torch' on the CPU")
    if interpreted() and x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()  # exact; the interpreter's NumPy has no bfloat16 (the kernel computes in float32 anyway)
    p = fps_programs(x) if programs is None else int(programs)
    if p < 1:
        raise OptionError(f"programs={programs}: must be an integer >= 1")
    sync = p > 1 and not stepwise
    if sync and interpreted():
        raise OptionError(
            "programs > 1 in one launch needs co-resident programs; under the interpreter use stepwise=True")
    if sync and b * p > sm_count(x.device):
        raise OptionError(f"programs={p} x batch {b} exceeds the {sm_count(x.device)} multiprocessors: the grid "
                          "barrier needs every program resident; use fewer programs or stepwise=True")
    first = max(prefix, 1)
    dev = x.device
    idx = torch.empty(b, s, dtype=torch.long, device=dev)
    idx[:, :first] = torch.arange(first, device=dev)
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    if s == first or b == 0:
        return idx, status
    dist = torch.full((b, n), float("inf"), dtype=torch.float32, device=dev)
    best = torch.full((b, s), -1, dtype=torch.long, device=dev)
    count = torch.zeros(b, s, dtype=torch.int32, device=dev)
    block_n, block_d = (_blocks(n, d)[0] if block_n is None else block_n), _blocks(n, d)[1]
    steps = [(first, s)] if not stepwise else [(t, t + 1) for t in range(first, s)]
    for lo, hi in steps:
        _fps_kernel[(b, p)](
            x, dist, best, count, status, n, d, s, first, lo, hi, x.stride(0), x.stride(1), x.stride(2), p, MAX_SPINS,
            BLOCK_N=block_n, BLOCK_D=block_d, SYNC=sync, num_warps=4,
        )
    idx[:, first:] = _KEY_LOW - (best[:, first:] & 0xFFFFFFFF)
    return idx, status


def farthest_point_sampling_triton(
    x: torch.Tensor, s: int, prefix: int = 1, *, programs: int | None = None, stepwise: bool = False
) -> torch.Tensor:
    """Farthest-point sampling of ``s`` token indices per item in one Triton kernel launch (module docstring).

    The contract of :func:`~attnpatch.attention.landmarks.fps.farthest_point_sampling`: the ``max(prefix, 1)`` first
    tokens are taken first, then ``s - max(prefix, 1)`` times the token whose squared Euclidean distance to the
    nearest taken token is largest (ties: lowest index).  Distances are the exact ``sum_k (x_ik - x_ck)^2`` in
    float32, so on near-ties the indices can differ from the PyTorch path's (``|x_i|^2 + |x_c|^2 - 2 x_i.x_c``).
    Nothing is read back to the host and no tensor shape depends on the data: the call can be captured in a CUDA
    graph (after one warm-up call that compiles the kernel).

    Args:
        x: ``[B, N, D]`` features on a CUDA device (any strides; float32, float16 or bfloat16, computed in
            float32), or on the CPU when the module was imported under ``TRITON_INTERPRET=1`` (:func:`interpreted`).
        s: indices per item, ``max(prefix, 1) <= s <= N``.
        prefix: leading tokens always included (CLS, registers); ``prefix = 0`` starts from token 0.
        programs: programs per item (``None``: :func:`fps_programs`).  Above 1
            in one launch they meet at a grid barrier after each step, which needs all ``B x programs`` programs
            resident at once (at most the number of multiprocessors; a GPU shared under MPS with a thread limit
            may not honour that: use ``stepwise=True`` or ``programs=1`` there).
        stepwise: launch one kernel per step instead of one in all (no grid barrier; ``s - prefix`` launches).

    Returns:
        ``[B, s]`` int64 indices on ``x``'s device, distinct per item (for inputs without NaN), prefix first.

    Raises:
        OptionError: ``s`` outside ``[max(prefix, 1), N]``, ``programs < 1``, or a grid barrier that cannot be
            honoured (more programs than multiprocessors; ``programs > 1`` without ``stepwise`` under the
            interpreter).
        RuntimeError: Triton is not installed, or a CPU tensor without ``TRITON_INTERPRET=1``.

    Source: Gonzalez 1985 (farthest-first traversal); landmarks of FNA (arXiv 2507.16018, Sec. 3).
    """
    return _fps_launch(x, s, prefix, programs, stepwise)[0]
