"""Data-parallel evals: which process this is, its shard of the work, and gathering results on every rank.

An eval launched by ``torchrun --nproc_per_node N`` or ``accelerate launch --multi_gpu --num_processes N``
(``torch.distributed.run`` underneath) sees ``WORLD_SIZE``/``RANK`` in its environment; :func:`ranks`
then joins the process group (``gloo`` on CPU, ``nccl`` for CUDA tensors plus a ``gloo`` group for the
Python objects gathered here), each process takes its shard of the images or RULER samples, and every
rank receives every rank's results in the original order (:meth:`Ranks.gather`), so the metrics are
computed once on the gathered data, identically on each rank, and rank 0 alone prints and writes.
Without those variables (a plain ``attnpatch`` call) everything here is the one-process identity.

Shards are contiguous runs of whole batches (images) or of samples (RULER cells): every batch holds the same
images as in a one-process run, so the features and predictions are the same.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Ranks", "ranks", "shard"]


def shard(n: int, rank: int, world_size: int) -> range:
    """The contiguous part ``[lo, hi)`` of ``range(n)`` that ``rank`` of ``world_size`` takes: sizes differ by at most
    one, the first ``n % world_size`` ranks take one more (a rank may get none when ``n < world_size``)."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return range(lo, lo + base + (1 if rank < extra else 0))


@dataclass
class Ranks:
    """This process's place in a data-parallel run.

    Attributes:
        rank: this process (0 .. world_size - 1); world_size: processes in the run (1 without a launcher).
        local_rank: the process's index on its machine (its CUDA device under a GPU launch).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    _group: Any = field(default=None, repr=False)

    @property
    def main(self) -> bool:
        """Rank 0: the process that prints and writes."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def shard(self, n: int) -> range:
        """This rank's contiguous part of ``range(n)`` (:func:`shard`)."""
        return shard(n, self.rank, self.world_size)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` in a one-process run."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (e.g. settings calibrated on rank 0 by measured time)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self._group)

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first, the others after it is done (e.g. preparing a catalogue checkpoint or a
        dataset cache once, not N times at the same moment)."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()

    def device(self, requested: str) -> str:
        """The device this rank runs on: under a multi-process launch ``cuda`` (or ``auto`` on a machine with
        CUDA) becomes ``cuda:<local_rank>``; any other request is returned unchanged."""
        if self.distributed and requested in ("cuda", "auto"):
            import torch

            if torch.cuda.is_available():
                return f"cuda:{self.local_rank}"
        return requested

    def info(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "rank": self.rank}


_RANKS: Ranks | None = None


def _warn_one_process() -> None:
    """``accelerate launch --cpu --num_processes N`` starts one process unless MPI is configured (accelerate's CPU launcher
    is ``mpirun``); it leaves ``MASTER_ADDR`` for N > 1 but no ``WORLD_SIZE``: say so once, the run goes on as one process."""
    global _WARNED
    if not _WARNED:
        import sys

        _WARNED = True
        print("attnpatch: warning: launched by `accelerate launch --cpu` with several processes, but only this one started "
              "(accelerate's CPU launcher needs MPI); this run is one process. For N processes on CPU: `accelerate launch "
              "--multi_gpu --num_processes N` on a machine without GPUs, or `torchrun --nproc_per_node N`", file=sys.stderr)


_WARNED = False


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def ranks() -> Ranks:
    """This process's :class:`Ranks`: from ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` (set by ``torchrun`` and
    ``accelerate launch``), joining the process group on first use; a one-process :class:`Ranks` without them."""
    global _RANKS
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        if "WORLD_SIZE" not in os.environ and "MASTER_ADDR" in os.environ and os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true":
            _warn_one_process()
        return Ranks()
    if _RANKS is not None and _RANKS.world_size == world:
        return _RANKS
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    _RANKS = Ranks(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=_env_int("LOCAL_RANK", 0), _group=group)
    return _RANKS
