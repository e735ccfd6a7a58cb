"""The hot path's small matrix work runs on one MKL thread, locally (no timings here: speed under load is in docs/benchmarks/contention.md).

A multi-threaded ``torch.linalg.eigh`` of six 64 x 64 landmark kernels takes 1-2 ms on an idle
machine and 60-1000 ms while another PyTorch process keeps the cores busy (its OpenMP team
waits for descheduled threads); :func:`attnpatch.attention.backends.blas.local_blas_threads` runs it
on the calling thread alone, through MKL's thread-local setting, so other threads and the rest
of the process keep their thread counts.
"""

from __future__ import annotations

import threading

import pytest
import torch

from attnpatch.attention.backends import blas as ny
from attnpatch.attention.backends.blas import local_blas_threads
from attnpatch.attention.nystrom import landmark_pinv, nystrom_attention

needs_mkl = pytest.mark.skipif(not ny.mkl_local_setter(), reason="this PyTorch build has no MKL thread-local setter")


def _local_value() -> int:
    """This thread's MKL local thread count (0 = the global setting), read without changing it."""
    fn = ny.mkl_local_setter()
    prev = fn(0)
    fn(prev)
    return prev


@needs_mkl
def test_local_one_thread_region_is_set_nested_and_restored():
    before = torch.get_num_threads()
    initial = _local_value()  # PyTorch sets it to its thread count on a thread's first operator
    with local_blas_threads(1):
        assert _local_value() == 1
        with local_blas_threads(3):
            assert _local_value() == 3
        assert _local_value() == 1
    assert _local_value() == initial
    assert torch.get_num_threads() == before  # the process-wide setting is never touched
    with pytest.raises(RuntimeError):
        with local_blas_threads(1):
            raise RuntimeError
    assert _local_value() == initial


@needs_mkl
def test_other_threads_are_not_affected():
    seen = {}
    inside, release = threading.Event(), threading.Event()

    def other():
        torch.zeros(1) + 1  # PyTorch's per-thread init
        seen["other_before"] = _local_value()
        inside.wait(30)
        seen["other"] = _local_value()
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with local_blas_threads(7):  # a value no thread has by itself
        inside.set()
        release.wait(30)
        seen["self"] = _local_value()
    t.join(30)
    assert seen["self"] == 7 and seen["other"] == seen["other_before"] != 7


def test_results_do_not_depend_on_the_thread_region():
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(torch.randn(2, 3, 32, 32, generator=g) * 3, -1)
    ref = landmark_pinv(a)
    with local_blas_threads(1):
        torch.testing.assert_close(landmark_pinv(a), ref, rtol=1e-5, atol=1e-5)
    q, k, v = (torch.randn(1, 2, 200, 16, generator=g) for _ in range(3))
    lm = torch.arange(0, 200, 10)[None]
    out = nystrom_attention(q, k, v, lm, scale=0.25)
    # from several Python threads at once (each sets its own MKL thread count)
    results = [None] * 4

    def work(i):
        results[i] = nystrom_attention(q, k, v, lm, scale=0.25)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in results:
        torch.testing.assert_close(r, out, rtol=1e-5, atol=1e-6)


def test_switch_off_and_non_cpu_are_no_ops(monkeypatch):
    real = ny.mkl_local_setter()  # this build's setter (False without MKL), looked up before the switch
    calls = []

    def setter(n):
        calls.append(n)
        return 5  # "the previous count"

    # a resolved setter: a CPU region sets n and restores the previous count; a region on another device never calls it
    monkeypatch.setattr(ny, "_MKL_LOCAL", setter)
    with local_blas_threads(1, device="meta"):
        assert calls == []
    with local_blas_threads(3, device="cpu"):
        assert calls == [3]
    assert calls == [3, 5]
    # the switch: the lookup answers False and a region calls no setter, so MKL's local count stays as it was
    monkeypatch.setattr(ny, "_MKL_LOCAL", None)
    monkeypatch.setenv("ATTNPATCH_LOCAL_BLAS_THREADS", "0")
    assert ny.mkl_local_setter() is False and ny._MKL_LOCAL is False
    if real:
        prev = real(2)  # a count of this thread's own, to see it untouched
        try:
            with local_blas_threads(1):
                assert real(2) == 2  # reads (and keeps) the count: not set to 1
                out = landmark_pinv(torch.eye(4)[None])
            assert real(2) == 2
        finally:
            real(prev)
    else:
        with local_blas_threads(1):
            out = landmark_pinv(torch.eye(4)[None])
    torch.testing.assert_close(out, torch.eye(4)[None])  # the identity's pseudo-inverse, as without the region
    assert calls == [3, 5]
    # switched back on, the next lookup finds this build's setter again
    monkeypatch.setattr(ny, "_MKL_LOCAL", None)
    monkeypatch.delenv("ATTNPATCH_LOCAL_BLAS_THREADS")
    assert bool(ny.mkl_local_setter()) == bool(real)
