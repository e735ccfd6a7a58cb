"""The one timer of the evals waits for the device before it starts and before it stops."""

from __future__ import annotations

import pytest
import torch

from attnpatch import timing


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _fake_device(monkeypatch):
    """A clock that the 'device' advances by 1 s each time it is waited for, and a log of the order of events."""
    clock, events = _Clock(), []

    def sync(device=None):
        events.append(("sync", device))
        clock.now += 1.0  # the queued work finishes only when waited for

    monkeypatch.setattr(timing, "sync", sync)
    monkeypatch.setattr(timing, "time", clock)
    return clock, events


def test_time_call_counts_the_queued_work(monkeypatch):
    """Each timed call is bracketed by two waits: with work that finishes only when waited for, each time is the 1 s
    that the wait before the stop adds (an unsynchronised timer would read 0 s)."""
    _, events = _fake_device(monkeypatch)
    calls = []
    times = timing.time_call(lambda: calls.append(len(events)), repeats=3, warmup=2, device="cuda:1")
    assert times == [1.0, 1.0, 1.0]
    assert len(calls) == 5 and events == [("sync", "cuda:1")] * 6
    assert calls == [0, 0, 1, 3, 5]  # the warm-up calls run without waits, each timed call after the start's wait


def test_median_seconds_and_stopwatch_synchronise(monkeypatch):
    _fake_device(monkeypatch)
    assert timing.median_seconds(lambda: None, 4) == 1.0
    with timing.Stopwatch("cuda") as sw:
        pass
    assert sw.seconds == 1.0


def test_prefill_timer_synchronises(monkeypatch):
    from attnpatch.evals.ruler.runner import PrefillTimer

    _, events = _fake_device(monkeypatch)
    model = torch.nn.Linear(2, 2)
    with PrefillTimer(model) as t:
        model(torch.zeros(1, 2))
        model(torch.zeros(1, 2))  # decoding steps: not timed
    assert t.seconds == 1.0 and len(events) == 2


def test_bad_repeats_are_refused():
    from attnpatch.errors import OptionError

    with pytest.raises(OptionError, match="repeats=0"):
        timing.time_call(lambda: None, repeats=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_time_includes_the_kernel():  # pragma: no cover - runs where a GPU is present
    x = torch.randn(4096, 4096, device="cuda")
    t = min(timing.time_call(lambda: x @ x, repeats=3, device="cuda"))
    assert t > 1e-5
