"""Break-even lengths by measurement (``min_len="auto"`` / ``min_tokens="auto"`` on a device type without a table):
the calibration's rule, the cache and its lock, the overrides, the wiring into both methods, and the result JSON."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import attnpatch
from attnpatch import OptionError, patched, record_stats
from attnpatch.patchers import break_even
from attnpatch.patchers.break_even import calibrate, resolve_break_even, resolved_break_evens
from attnpatch.patchers.methods import anchor_attention as anchor_method
from attnpatch.patchers.methods import fna as fna_method


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    with torch.no_grad():
        yield _fresh(monkeypatch, tmp_path)


def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNPATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(break_even, "_RESOLVED", {})
    monkeypatch.setattr(break_even, "_USED", {})
    return tmp_path


def _fake(times: dict[int, tuple[float, float]]):
    """A case and a timer that report the given (method, dense) seconds per length, and the lengths measured."""
    seen: list[int] = []

    def case(n):
        seen.append(n)
        return (lambda: ("m", n)), (lambda: ("d", n))

    def timer(fn, repeats, device):
        which, n = fn()
        return times[n][0] if which == "m" else times[n][1]

    return case, timer, seen


@pytest.mark.parametrize("times,want", [
    ({1: (2, 1), 2: (1.5, 1), 4: (0.9, 1), 8: (0.5, 1)}, 4),   # pays from 4 on
    ({1: (0.5, 1), 2: (2, 1), 4: (0.9, 1), 8: (0.5, 1)}, 4),   # faster at 1 but slower at 2: from 4, not 1
    ({1: (2, 1), 2: (0.5, 1), 4: (0.5, 1), 8: (1.1, 1)}, None),  # slower at the longest measured: never
    ({1: (2, 1), 2: (2, 1), 4: (2, 1), 8: (2, 1)}, None),
    ({1: (0.1, 1), 2: (0.1, 1), 4: (0.1, 1), 8: (0.1, 1)}, 1),
])
def test_calibration_rule(times, want):
    case, timer, seen = _fake(times)
    tokens, rows = calibrate(case, [1, 2, 4, 8], torch.device("cpu"), timer=timer)
    assert tokens == want
    assert [r[0] for r in rows] == seen == [1, 2, 4, 8]
    assert [r[1:] for r in rows] == [times[n] for n in (1, 2, 4, 8)]


def test_calibration_stops_at_the_budget():
    now = [0.0]

    def clock():
        return now[0]

    def case(n):
        now[0] += n  # each length costs n "seconds"
        return (lambda: None), (lambda: None)

    tokens, rows = calibrate(case, [1, 2, 4, 8, 16], torch.device("cpu"), budget=10.0, clock=clock,
                             timer=lambda fn, repeats, device: 1.0)
    # 1 + 2 = 3 spent; 4 estimated at 2 * (4/2)^2 = 8, 3 + 8 > 10: not measured
    assert [r[0] for r in rows] == [1, 2] and tokens is None
    now[0] = 0.0
    _, rows = calibrate(case, [1, 2, 4, 8, 16], torch.device("cpu"), budget=11.0, clock=clock, timer=lambda fn, repeats, device: 1.0)
    assert [r[0] for r in rows] == [1, 2, 4]  # 3 + 8 <= 11; then 7 + 16 > 11


def _qk(n=64, heads=2, kv=1, d=16):
    return torch.randn(1, heads, n, d), torch.randn(1, kv, n, d)


def test_table_env_cache_and_calibration(monkeypatch, fresh):
    q, k = _qk()
    calls = []

    def case(n):
        calls.append(n)
        slow = torch.randn(256, 256)
        return (lambda: None), (lambda: slow @ slow)  # the "method" does nothing: faster at every length

    kw = dict(env="ATTNPATCH_TEST_BREAK_EVEN", lengths=[32, 64], case=case)
    monkeypatch.delenv("ATTNPATCH_TEST_BREAK_EVEN", raising=False)
    got = resolve_break_even("m", {"a": 1}, q, k, table={"cpu": 123}, **kw)
    assert (got.tokens, got.source) == (123, "table:cpu") and calls == []
    got = resolve_break_even("m", {"a": 1}, q, k, table={}, **kw)
    assert (got.tokens, got.source) == (32, "calibrated") and calls == [32, 64]
    assert [r[0] for r in got.timings] == [32, 64]
    saved = json.loads(break_even.cache_file().read_text())
    assert len(saved) == 1 and saved[0]["tokens"] == 32 and saved[0]["device"] == "cpu"
    assert (saved[0]["heads"], saved[0]["kv_heads"], saved[0]["head_dim"], saved[0]["dtype"]) == (2, 1, 16, "float32")
    assert resolve_break_even("m", {"a": 1}, q, k, table={}, **kw).source == "calibrated" and calls == [32, 64]
    monkeypatch.setattr(break_even, "_RESOLVED", {})  # a new process: read from the cache, not measured again
    got = resolve_break_even("m", {"a": 1}, q, k, table={}, **kw)
    assert got.tokens == 32 and got.source.startswith("cache:") and calls == [32, 64]
    got = resolve_break_even("m", {"a": 2}, q, k, table={}, **kw)  # another setting: measured for itself
    assert got.source == "calibrated" and calls == [32, 64, 32, 64]
    got = resolve_break_even("m", {"a": 1}, q.double(), k.double(), table={}, **kw)  # another dtype, too
    assert got.source == "calibrated" and len(json.loads(break_even.cache_file().read_text())) == 3
    monkeypatch.setenv("ATTNPATCH_TEST_BREAK_EVEN", "never")
    assert resolve_break_even("m", {"a": 1}, q, k, table={"cpu": 5}, **kw).tokens is None
    monkeypatch.setenv("ATTNPATCH_TEST_BREAK_EVEN", "77")
    got = resolve_break_even("m", {"a": 1}, q, k, table={"cpu": 5}, **kw)
    assert (got.tokens, got.source) == (77, "env:ATTNPATCH_TEST_BREAK_EVEN")
    monkeypatch.setenv("ATTNPATCH_TEST_BREAK_EVEN", "-3")
    with pytest.raises(OptionError, match=r"ATTNPATCH_TEST_BREAK_EVEN='-3': must be a token count >= 0 or 'never'"):
        resolve_break_even("m", {"a": 1}, q, k, table={}, **kw)


def _fixed_calibration(monkeypatch, tokens):
    """Calibrations answer ``tokens``, as in a new process on a machine without a cache file."""
    monkeypatch.setattr(break_even, "_RESOLVED", {})
    monkeypatch.setattr(break_even, "_USED", {})
    break_even.cache_file().unlink(missing_ok=True)
    seen = []

    def fake(case, lengths, device, **kw):
        seen.append(list(lengths))
        return tokens, ((lengths[0], 1.0, 2.0),)

    monkeypatch.setattr(break_even, "calibrate", fake)
    return seen


def test_fna_min_tokens_auto_is_calibrated_where_the_device_has_no_table(monkeypatch):
    from tiny_models import tiny_dinov2

    monkeypatch.delenv("ATTNPATCH_FNA_BREAK_EVEN")
    monkeypatch.setattr(fna_method.config, "BREAK_EVEN", {})  # as on a device type without a measured value
    model = tiny_dinov2()
    x = torch.randn(1, 3, 70, 70)  # 26 tokens
    seen = _fixed_calibration(monkeypatch, 27)
    with patched(model, "fna", s=8, sample_layer=0), record_stats(model) as rec:
        model(pixel_values=x)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:short"}  # 26 < 27: exact
    assert seen and all(n > 8 for n in seen[0])
    _fixed_calibration(monkeypatch, 26)
    with patched(model, "fna", s=8, sample_layer=0), record_stats(model) as rec:
        model(pixel_values=x)
    assert {r.mode for r in rec.forwards[0].values()} == {"fna"}
    _fixed_calibration(monkeypatch, None)  # never faster on this device: exact everywhere
    with patched(model, "fna", s=8, sample_layer=0), record_stats(model) as rec:
        model(pixel_values=x)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:short"}
    (entry,) = resolved_break_evens()
    assert entry["method"] == "fna" and entry["tokens"] is None and entry["source"] == "calibrated"
    assert entry["setting"]["s"] == 8 and entry["heads"] == model.config.num_attention_heads


def test_anchor_min_len_auto_is_calibrated_and_the_sparse_path_runs(monkeypatch):
    from tiny_models import tiny_causal_lm

    monkeypatch.setitem(anchor_method.BREAK_EVEN_BY_WORD, "auto", {})
    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 100, (1, 96))
    opts = dict(block_size=16, init_block=16, local_window=16, dense_last=0, min_recall=0.0, pool_stride=None)
    _fixed_calibration(monkeypatch, 64)
    with patched(model, "anchor_attention", **opts), record_stats(model) as rec:
        model(ids[:, :48])
        model(ids)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:short"}
    assert {r.mode for r in rec.forwards[1].values()} == {"sparse"}
    _fixed_calibration(monkeypatch, None)
    with patched(model, "anchor_attention", **opts), record_stats(model) as rec:
        model(ids)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:short"}
    (entry,) = resolved_break_evens()
    assert entry["method"] == "anchor_attention" and entry["tokens"] is None and "min_len" not in entry["setting"]


def test_anchor_cpu_table_is_unchanged(monkeypatch):
    q, k = _qk()
    cfg = anchor_method.resolved(attnpatch.attention.anchor.AnchorConfig(), q, k)
    assert cfg.min_len == anchor_method.BREAK_EVEN_BY_WORD["auto"]["cpu"] == 12288
    assert resolved_break_evens()[0]["source"] == "table:cpu"


def test_real_calibration_on_this_cpu_runs_within_budget(monkeypatch):
    """The real FNA case on the CPU (no table) with a small budget: measured rows, a cache entry."""
    monkeypatch.delenv("ATTNPATCH_FNA_BREAK_EVEN")
    monkeypatch.setattr(fna_method.config, "BREAK_EVEN", {})
    monkeypatch.setattr(break_even, "BUDGET_SECONDS", 2.0)
    cfg = fna_method.FNAConfig(s=16)
    q, k = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    monkeypatch.setattr(fna_method.hooks, "CALIBRATION_LENGTHS", (65, 129, 257))
    tokens = fna_method.min_tokens_for(cfg, q, k)
    (entry,) = resolved_break_evens()
    assert [r[0] for r in entry["timings"]][:1] == [65] and all(r[1] > 0 and r[2] > 0 for r in entry["timings"])
    assert tokens == (sys.maxsize if entry["tokens"] is None else entry["tokens"])


def test_synthetic_prefill_has_the_documented_structure():
    """The logits are ``bias_j + local * mean_f cos(w_f (i - j)) + noise * z_ij`` as documented: the deterministic part
    exactly (noise and column bias off), then the random parts' spread at the fitted defaults."""
    p = anchor_method.SYNTHETIC_PREFILL
    n, d, f = 512, 32, 4  # f = D // 8 frequencies
    q, k, v = anchor_method.synthetic_prefill(n, 4, 2, d, dtype=torch.float32, device="cpu")
    assert q.shape == (1, 4, n, d) and k.shape == v.shape == (1, 2, n, d)
    every = int(p["stripe_every"])
    assert every < n and p["stripe"] > 0 and p["sink"] > 0 and p["local"] > 0 and p["noise"] > 0

    def logits(**kw):
        qq, kk, _ = anchor_method.synthetic_prefill(n, 4, 2, d, dtype=torch.float64, device="cpu", **kw)
        return (qq[:, ::2] @ kk.transpose(-1, -2)).double() * d ** -0.5  # query heads 0 and 2: KV heads 0 and 1

    pos = torch.arange(n, dtype=torch.float64)
    w = float(p["local_span"]) ** -(torch.arange(f, dtype=torch.float64) / (f - 1))
    local = float(p["local"]) * torch.cos(w * (pos[:, None] - pos[None, :])[..., None]).mean(-1)
    bias = torch.zeros(n, dtype=torch.float64)
    bias[every::every] = p["stripe"]
    bias[0] = p["sink"]
    exact = logits(noise=0.0, column=0.0)
    assert torch.allclose(exact, (bias + local).expand_as(exact), atol=1e-3)
    assert torch.allclose(exact.diagonal(dim1=-2, dim2=-1)[..., 1:every], torch.tensor(float(p["local"]), dtype=torch.float64),
                          atol=1e-3)
    assert torch.allclose(logits(noise=0.0, column=0.0, sink=3.0, stripe=-2.0, local=1.5, stripe_every=32),
                          torch.where(pos == 0, 3.0, torch.where(pos % 32 == 0, -2.0, 0.0)) + local / p["local"] * 1.5,
                          atol=1e-3)

    rest = logits() - exact  # column * c_j + noise * z_ij
    column = rest.mean(-2)  # per key, over the queries: column * c_j (+ noise / sqrt(n))
    assert column.std().item() == pytest.approx((p["column"] ** 2 + p["noise"] ** 2 / n) ** 0.5, rel=0.2)
    assert (rest - column[..., None, :]).std().item() == pytest.approx(p["noise"], rel=0.1)
    assert not torch.equal(q, anchor_method.synthetic_prefill(n, 4, 2, d, dtype=torch.float32, device="cpu", seed=1)[0])


def test_result_json_records_the_break_evens(tmp_path):
    from attnpatch.evals.run.report import machine_info, write_json

    q, k = _qk()
    anchor_method.resolved(attnpatch.attention.anchor.AnchorConfig(), q, k)
    path = write_json(tmp_path / "r.json", {"machine": machine_info(), "rows": []})
    got = json.loads(path.read_text())["break_even"]
    assert got == [{**break_even.break_even_key("anchor_attention", got[0]["setting"], q, k), "tokens": 12288,
                    "source": "table:cpu", "timings": []}]
    assert "break_even" not in json.loads(write_json(tmp_path / "p.json", {"rows": []}).read_text())
    break_even.begin_run()  # a new command: a new record (the measurements stay cached)
    assert json.loads(write_json(tmp_path / "r2.json", {"machine": {}}).read_text())["break_even"] == []
    assert break_even._RESOLVED


def test_other_ranks_wait_for_local_rank_zero(monkeypatch):
    """A process with LOCAL_RANK != 0 does not measure: it waits for rank 0's cache entry (here written by a thread
    after a delay) and reads it."""
    import threading

    q, k = _qk()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("ATTNPATCH_TEST_BREAK_EVEN", raising=False)

    def measured(n):
        raise AssertionError("a rank other than 0 measured")

    key = break_even.break_even_key("m", {"a": 1}, q, k)

    def rank0():
        import time

        time.sleep(0.5)
        path = break_even.cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([{**key, "tokens": 4096, "source": "calibrated", "timings": [[4096, 1.0, 2.0]]}]))

    t = threading.Thread(target=rank0)
    t.start()
    got = resolve_break_even("m", {"a": 1}, q, k, table={}, env="ATTNPATCH_TEST_BREAK_EVEN", lengths=[32], case=measured)
    t.join()
    assert got.tokens == 4096 and got.source.startswith("cache:") and got.timings == ((4096, 1.0, 2.0),)
