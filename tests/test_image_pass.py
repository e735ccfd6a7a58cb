"""The image pass shared by the vision and CLIP evals (attnpatch.evals.image_pass), on a stand-in
"model" (no settings, so nothing is patched): batching, progress, hooks, and what a Ctrl-C keeps."""

from __future__ import annotations

import pytest
import torch

from attnpatch.errors import OptionError
from attnpatch.evals.vision.image_pass import finish, run_image_pass, run_labels, throughput
from attnpatch.evals.run.report import EvalInterrupted


class Items:
    """``n`` "images" (the ints 0..n-1, labelled), raising KeyboardInterrupt at ``stop_at`` as Ctrl-C would."""

    def __init__(self, n: int, stop_at: int | None = None):
        self.n, self.stop_at = n, stop_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.stop_at:
            raise KeyboardInterrupt
        return (i, i % 2)  # (image, label), as an ImageSet gives


def _pre(items):
    return torch.tensor(items, dtype=torch.float32)[:, None, None, None].expand(-1, 3, 4, 4)


def _run(items, **kw):
    return run_image_pass(torch.nn.Identity(), items, _pre, lambda x: x[:, 0, 0, 0].clone(), [], **kw)


def test_batches_progress_and_hooks():
    seen, dense_calls = [], []
    ip = _run(Items(7), batch_size=3, progress=lambda d, n: seen.append((d, n)),
              after_dense=lambda x, start: dense_calls.append(start))
    assert seen == [(3, 7), (6, 7), (7, 7)] and dense_calls == [0, 3, 6]
    assert torch.cat(ip.dense).tolist() == list(range(7))
    assert (ip.n, ip.n_planned, ip.batch_size, ip.interrupted, ip.resolution, ip.tokens) == (7, 7, 3, False, 4, None)
    assert ip.runs == [] and ip.dense_seconds > 0
    res = finish({"x": 1}, ip)
    assert res["x"] == 1 and res["world_size"] == 1 and res["resumed_batches"] == 0
    assert [(r["rank"], r["batches"], r["images"]) for r in res["ranks"]] == [(0, [0, 3, 6], 7)]


def test_ctrl_c_keeps_whole_batches():
    ip = _run(Items(7, stop_at=4), batch_size=3)  # the second batch (3, 4, 5) is cut: only the first is kept
    assert ip.interrupted and ip.n == 3 and torch.cat(ip.dense).tolist() == [0, 1, 2]
    with pytest.raises(EvalInterrupted) as exc:
        finish({"n_images": ip.n}, ip)
    got = exc.value.partial
    assert {k: got[k] for k in ("n_images", "interrupted", "n_images_planned", "world_size")} == {"n_images": 3, "interrupted": True, "n_images_planned": 7, "world_size": 1}
    assert got["ranks"][0]["batches"] == [0]
    assert exc.value.done == "3/7 images"


def test_ctrl_c_before_the_first_batch_keeps_nothing():
    with pytest.raises(EvalInterrupted) as exc:
        _run(Items(7, stop_at=1), batch_size=3)
    assert exc.value.partial is None and exc.value.done == "0/7 images"


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_batch_size_must_be_a_positive_int(bad):
    with pytest.raises(OptionError, match="batch_size="):
        _run(Items(3), batch_size=bad)


def test_row_helpers():
    assert throughput(2.0, 10) == {"seconds": 2.0, "images_per_s": 5.0}
    assert throughput(2.0, 10, 4.0) == {"seconds": 2.0, "images_per_s": 5.0, "speedup": 2.0}
    assert throughput(0.0, 10, 4.0) == {"seconds": 0.0, "images_per_s": None, "speedup": None}
    from attnpatch.evals.vision.image_pass import SettingRun

    assert run_labels(SettingRun(sampled_at={3: 2, 1: 5}, modes={"fna"})) == {
        "sampled_at": {"1": 5, "3": 2}, "speedup_spread": None, "speedup_within_noise": None}
    spread = run_labels(SettingRun(modes={"fna"}, batch_speedups=[1.2, 1.4, 1.3]))
    assert spread["speedup_spread"] == [pytest.approx(1.25), pytest.approx(1.35)] and spread["speedup_within_noise"] is False
    assert run_labels(SettingRun(modes={"dense:s>=N"}))["note"] == "exact attention: s >= N tokens"
    assert run_labels(SettingRun(modes={"dense:short"}))["note"] == "exact attention: N below min_tokens (the break-even length)"
    assert "note" not in run_labels(SettingRun(modes={"dense:before_sample", "fna"}))
