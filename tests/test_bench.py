"""Benchmarks: the measuring code (smoke runs at small sizes), its errors, the memory bound of FNA at large N,
the attention timer, and the no-op cost of settings that approximate nothing.  Speed targets are not asserted
here: they live in BENCHMARKS.md, measured side by side by ``benchmarks/make_benchmarks.py``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnpatch import OptionError, patch, patched, time_attention, unpatch
from attnpatch.attention.landmarks import farthest_point_sampling
from attnpatch.attention.nystrom import nystrom_attention
from attnpatch.cli import main
from attnpatch.evals.bench import (
    bench_attention, bench_causal_lm, capture_qkv, load_qkv, peak_extra_bytes, scaling_exponent,
)

from conftest import tiny_causal_lm
from test_cli import tiny_dir  # noqa: F401  (fixture)
from test_vision_eval import tiny_images  # noqa: F401  (fixture)


def test_scaling_exponent_recovers_power_laws():
    ns = [256, 512, 1024, 2048]
    assert scaling_exponent(ns, [1e-6 * n for n in ns]) == pytest.approx(1.0)
    assert scaling_exponent(ns, [3e-9 * n**2 for n in ns]) == pytest.approx(2.0)
    assert scaling_exponent([256], [1.0]) is None


def test_peak_extra_bytes_sees_the_score_matrix():
    n = 1024
    q = torch.randn(1, 2, n, 32)
    naive = peak_extra_bytes(lambda: torch.softmax(q @ q.transpose(-1, -2), -1) @ q)
    assert naive >= 2 * n * n * 4  # the scores and their softmax are alive together
    fused = peak_extra_bytes(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert fused < naive / 10


def test_fna_memory_is_o_s_n_at_large_n():
    """No N x N buffer anywhere in FNA: at N = 16384 the peak extra memory of FPS + Nyström stays within a
    small multiple of s*N per head, far below one N x N score matrix."""
    b, h, n, d, s = 1, 2, 16384, 32, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    feats = k.transpose(1, 2).reshape(b, n, h * d)

    def fna():
        lm = farthest_point_sampling(feats, s, 1)
        return nystrom_attention(q, k, v, lm, scale=d**-0.5)

    peak = peak_extra_bytes(fna)
    nxn = b * h * n * n * 4
    o_sn = b * h * s * n * 4
    assert peak < 8 * o_sn, (peak, o_sn)
    assert peak < nxn / 50, (peak, nxn)


def test_bench_attention_noncausal_rows():
    res = bench_attention([("fna", {"s": 16})], lengths=[64, 128], repeats=1, warmup=0, heads=2, head_dim=16)
    rows = res["rows"]
    assert [(r["N"], r["method"]) for r in rows] == [(64, "sdpa"), (64, "fna (s=16)"), (128, "sdpa"), (128, "fna (s=16)")]
    for r in rows:
        assert r["seconds"] > 0 and r["speedup"] > 0 and r["peak_bytes"] >= 0
        assert r["nxn_bytes"] == 2 * r["N"] ** 2 * 4
    fna = rows[1]
    assert fna["fps_seconds"] > 0 and fna["nystrom_seconds"] > 0
    assert fna["seconds"] == pytest.approx(fna["nystrom_seconds"] + fna["fps_seconds"] / 6)
    assert fna["fna_incl_seconds"] == pytest.approx(fna["nystrom_seconds"] + fna["fps_seconds"])
    assert set(res["exponents"]) == {"sdpa", "fna (s=16)", "fna (s=16) [fps]", "fna (s=16) [nystrom]"}


def test_bench_attention_causal_gqa_and_bf16():
    res = bench_attention(
        [("anchor_attention", {"theta": 2.0, "block_size": 16, "init_block": 8, "local_window": 16, "min_len": 0})],
        lengths=[96], causal=True, heads=4, kv_heads=2, head_dim=16, repeats=1, warmup=0, dtype=torch.bfloat16, memory=False,
    )
    row = res["rows"][1]
    assert row["select_seconds"] > 0 and 0 <= row["sparsity"] < 1 and 0 < row["recall"] <= 1
    assert res["config"]["dtype"] == "bfloat16" and res["rows"][0]["peak_bytes"] is None


def test_theta_inf_costs_nothing_and_is_the_model_s_own_attention():
    """theta = inf approximates nothing: every layer hands back to the model's own attention (bit-identical logits)."""
    model = tiny_causal_lm("qwen2")
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        with patched(model, "anchor_attention", theta=math.inf, min_len=0):
            from attnpatch import record_stats

            with record_stats(model) as rec:
                out = model(ids).logits
    assert torch.equal(out, ref)
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:theta=inf"}


def test_time_attention_measures_each_forward():
    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    patch(model, "anchor_attention", theta=1.0, min_len=0, block_size=16, init_block=8, local_window=16)
    try:
        with torch.no_grad(), time_attention(model) as rec:
            model(ids)
            model(ids)
    finally:
        unpatch(model)
    assert len(rec.attention_seconds) == 2 and all(t > 0 for t in rec.attention_seconds)


class _StepClock:
    """``time.perf_counter`` that moves ``step`` seconds per reading: a timed call reads it at its start and its end,
    so lasts exactly ``step``."""

    def __init__(self, step: float):
        self.step, self.now = step, 0.0

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_bench_causal_lm_rows(monkeypatch):
    """The rows' numbers from a fake timer: prefills of 2.0 s (unpatched), 2.5 s (dense) and 0.8 s (anchor), each of
    whose 2 layer attention calls lasts 0.125 s; the sparsity against the float64 reference's kept keys."""
    from attnpatch import record_stats
    from attnpatch.attention.anchor import AnchorConfig, anchor_attention_reference
    from attnpatch.evals import bench
    from attnpatch.evals.bench import models as bench_models
    from attnpatch.patchers import runtime

    prompts = []

    def fake_prefill(tok, n):
        prompts.append(n)
        return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))

    seconds = iter([2.0, 2.5, 0.8])  # unpatched, dense, anchor_attention: one timed prefill each

    def fake_time_call(fn, *, repeats, warmup, device):
        assert (repeats, warmup) == (1, 0)
        fn()
        return [next(seconds)]

    # bench_causal_lm reads prefill_ids from the package at call time, time_call from its own module's globals, and the
    # attention timer reads the runtime module's `time`
    monkeypatch.setattr(bench, "prefill_ids", fake_prefill)
    monkeypatch.setattr(bench_models, "time_call", fake_time_call)
    monkeypatch.setattr(runtime, "time", _StepClock(0.125))
    model = tiny_causal_lm("llama")
    opts = {"theta": 1.0, "min_len": 0, "block_size": 16, "init_block": 8, "local_window": 16, "dense_last": 16, "min_recall": 0}
    res = bench_causal_lm(model, None, [("anchor_attention", opts)], lengths=[160], repeats=1)
    assert prompts == [160] and next(seconds, None) is None  # both fakes were used
    label = "anchor_attention (theta=1.0, min_len=0, block_size=16, init_block=8, local_window=16, dense_last=16, min_recall=0)"
    assert [r["setting"] for r in res["rows"]] == ["unpatched", "dense", label]
    unpatched, dense, anchor = res["rows"]
    assert unpatched == {"length": 160, "setting": "unpatched", "seconds": 2.0, "tokens_per_s": 80.0, "speedup": 1.0}
    # attention: 2 layers x 0.125 s = 0.25 s of each patched prefill
    assert {k: dense[k] for k in ("seconds", "tokens_per_s", "sparsity")} == {"seconds": 2.5, "tokens_per_s": 64.0, "sparsity": None}
    assert dense["speedup"] == pytest.approx(0.8) and dense["attention_share"] == pytest.approx(0.1)
    assert {k: anchor[k] for k in ("seconds", "tokens_per_s")} == {"seconds": 0.8, "tokens_per_s": 200.0}
    assert anchor["speedup"] == pytest.approx(2.5) and anchor["attention_share"] == pytest.approx(0.3125)
    # sparsity: the share of the 2 layers x 4 heads x (160 x 161 / 2) causal pairs that the float64 reference drops, on
    # each layer's q, k as the patched model computes them (layer 1's input is layer 0's approximated output)
    qkv = {}

    def probe(ctx, q, k, v):
        qkv[ctx.layer] = (q.clone(), k.clone(), v.clone(), ctx.scale)

    with torch.no_grad(), patched(model, "anchor_attention", **opts), record_stats(model, probe=probe):
        model(fake_prefill(None, 160), use_cache=False, logits_to_keep=1)
    cfg = AnchorConfig(**opts)
    kept = sum(int(anchor_attention_reference(q, k, v, cfg, scale=scale)[1].sum()) for q, k, v, scale in qkv.values())
    assert sorted(qkv) == [0, 1]
    want = 1 - kept / (2 * 4 * 160 * 161 // 2)
    assert 0.05 < want < 0.95  # the setting drops some keys and keeps others
    assert anchor["sparsity"] == pytest.approx(want, abs=1e-4)  # equal here; a few pairs of float32 selection leeway


def test_capture_and_bench_on_captured_inputs(tmp_path):
    model = tiny_causal_lm("qwen2", layers=3)
    ids = torch.randint(0, 128, (1, 128), generator=torch.Generator().manual_seed(0))
    got = capture_qkv(model, ids, [1, 2])
    assert sorted(got) == [1, 2] and got[1]["q"].shape == (1, 4, 128, 16) and got[1]["k"].shape == (1, 2, 128, 16)
    from attnpatch import is_patched

    assert not is_patched(model) and model.config._attn_implementation == "sdpa"  # unpatched again, its own attention back
    path = tmp_path / "qkv.pt"
    torch.save(got, path)
    entry, layer = load_qkv(path, 2)
    assert layer == 2
    res = bench_attention([("anchor_attention", {"theta": 2.0, "block_size": 16, "init_block": 8, "local_window": 16, "min_len": 0})],
                          lengths=[64, 128], causal=True, qkv=entry, repeats=1, warmup=0, memory=False)
    assert res["config"]["inputs"] == "captured" and res["config"]["kv_heads"] == 2
    with pytest.raises(OptionError, match=r"lengths \[256\]: the captured inputs have 128 tokens"):
        bench_attention([("anchor_attention", {})], lengths=[256], causal=True, qkv=entry)
    with pytest.raises(OptionError, match="layers=\\[7\\]"):
        capture_qkv(model, ids, [7])


@pytest.mark.parametrize("methods,causal,match", [
    ([("fna", {})], True, "'fna' is non-causal"),
    ([("anchor_attention", {})], False, "'anchor_attention' is a causal prefill method"),
    ([("sink_mask", {"mask_layers": 2})], False, r"sink_mask options \['mask_layers'\] act across layers"),
    ([("dense", {"theta": 1.0})], False, "unknown option"),
    ([("fna", {"sample_layer": 3})], False, r"fna options \['sample_layer'\] act across layers"),
    ([("fna", {"s": 64})], False, "every length must exceed s"),
    ([("anchor_attention", {"dense_layers": [1]})], True, "name model layers"),
    ([("fna", {"s": "x"})], False, "s="),
])
def test_bench_attention_errors(methods, causal, match):
    with pytest.raises(OptionError, match=match):
        bench_attention(methods, lengths=[64], causal=causal, repeats=1)


def test_bench_cli_attention_plots_and_json(tmp_path, capsys):
    out, png = tmp_path / "a.json", tmp_path / "plots" / "a.png"
    assert main(["bench", "attention", "--lengths", "64", "128", "--heads", "2", "--head-dim", "16", "--repeats", "1",
                 "--method", "fna:s=16", "--json", str(out), "--plot", str(png)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["mode"] == "noncausal" and res["machine"]["torch"] == torch.__version__
    assert (tmp_path / "plots" / "a_time.png").stat().st_size > 1000 and (tmp_path / "plots" / "a_speedup.png").is_file()
    printed = capsys.readouterr().out
    assert "vs SDPA" in printed and "Scaling exponents" in printed and "FNA time = Nyström + FPS / 6" in printed
    assert main(["bench", "attention", "--mode", "causal", "--method", "fna"]) == 2
    assert main(["bench", "attention", "--layer", "3"]) == 2


@pytest.mark.parametrize("argv,match", [
    (["bench", "attention", "--device", "foo"], "--device 'foo'"),
    (["bench", "attention", "--json", "."], "is a directory"),
    (["bench", "attention", "--plot", "x.jpg"], "give a .png path"),
    (["bench", "attention", "--mode", "causal", "--reuse-layers", "3"], "--reuse-layers"),
    (["bench", "attention", "--method", "fna", "fna"], "given twice"),
    (["bench", "attention", "--method", "fna:bogus=1"], "unknown option"),
    (["bench", "attention", "--method", "fna:s"], "expected NAME=VALUE"),
    (["bench", "model", "--model", "dinov2-small", "--method", "anchor_attention"], "does not fit a vision model"),
    (["bench", "model", "--model", "smollm2-135m-instruct", "--resolutions", "224"], "apply to ViTs only"),
    (["bench", "model", "--model", "dinov2-small", "--lengths", "1024"], "--lengths"),
    (["bench", "model", "--model", "smollm2-135m-instruct", "-o", "theta=abc"], "theta"),
])
def test_bench_cli_errors_before_any_work(argv, match, capsys, tmp_path):
    """Bad input is refused with one line naming it, before a model loads or a timing starts."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_load_qkv_refuses_foreign_files(tmp_path):
    from attnpatch import AttnpatchError

    (tmp_path / "x.json").write_text("{}")
    torch.save(torch.zeros(3), tmp_path / "t.pt")
    torch.save({0: {"q": torch.zeros(1, 1, 4, 2)}}, tmp_path / "d.pt")
    for name in ("x.json", "t.pt", "d.pt"):
        with pytest.raises(AttnpatchError, match="not a file written by `attnpatch bench capture`"):
            load_qkv(tmp_path / name)


def test_bench_cli_capture_then_causal_bench(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    from attnpatch.evals import bench

    asked = []

    def fake_prefill(tok, n):
        asked.append(n)
        return torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(1))

    # both commands read prefill_ids from the package at call time (bench capture: the CLI; bench model: bench_causal_lm)
    monkeypatch.setattr(bench, "prefill_ids", fake_prefill)
    qkv = tmp_path / "q.pt"
    assert main(["bench", "capture", "--model", str(tiny_dir), "--length", "256", "--layers", "1", "-O", str(qkv)]) == 0
    assert main(["bench", "attention", "--mode", "causal", "--qkv", str(qkv), "--lengths", "128", "256", "--repeats", "1",
                 "--method", "anchor_attention:theta=2,min_len=0,block_size=32,init_block=16,local_window=32", "--no-memory"]) == 0
    assert main(["bench", "attention", "--mode", "causal", "--qkv", str(qkv), "--layer", "0"]) == 2
    assert main(["bench", "attention", "--mode", "causal", "--qkv", str(qkv), "--heads", "8"]) == 2  # shape comes from the file
    out = tmp_path / "m.json"
    assert main(["bench", "model", "--model", str(tiny_dir), "--lengths", "200", "--repeats", "1", "--warmup", "0",
                 "--method", "anchor_attention:theta=2,min_len=0,block_size=32,init_block=16,local_window=32,dense_last=32,min_recall=0,pool_stride=16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["setting"] for r in rows][:2] == ["unpatched", "dense"] and rows[2]["sparsity"] > 0
    assert asked == [256, 200]  # the fake prompts, one per command


def test_bench_cli_vision_model(tiny_vit_dir, tiny_images, tmp_path):  # noqa: F811  (tiny_images)
    out = tmp_path / "v.json"
    assert main(["bench", "model", "--model", str(tiny_vit_dir), "--data", str(tiny_images), "--resolutions", "70", "140",
                 "--batch", "2", "--repeats", "1", "--warmup", "0", "--method", "fna:s=9", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["resolution"], r["tokens"], r["setting"]) for r in rows] == [
        (70, 26, "unpatched"), (70, 26, "dense"), (70, 26, "fna (s=9)"),
        (140, 101, "unpatched"), (140, 101, "dense"), (140, 101, "fna (s=9)"),
    ]
    assert all(r["images_per_s"] > 0 for r in rows)
    assert rows[0]["attention_share"] is None and 0 < rows[1]["attention_share"] < 1


# --------------------------------------------------------------------------- --background-load


def _gone(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_background_load_starts_a_competitor_and_kills_it_on_exit_and_on_error():
    import os

    from attnpatch.evals.bench import background_load

    with background_load(60) as info:
        assert info["pid"] != os.getpid() and not _gone(info["pid"])
        assert info["threads"] >= 1 and info["size"] == 512 and info["limit_s"] == 60.0
        pid = info["pid"]
    assert info["alive_at_end"] is True and info["seconds"] >= 0
    assert _gone(pid)
    with pytest.raises(RuntimeError, match="boom"):
        with background_load(60) as info:
            pid = info["pid"]
            raise RuntimeError("boom")
    assert _gone(pid)
    with background_load(None) as info:  # no load asked: nothing started
        assert info is None
    with pytest.raises(OptionError, match="limit_s"):
        with background_load(0):
            pass


@pytest.mark.slow
def test_background_load_stops_itself_at_its_time_limit():
    import time

    from attnpatch.evals.bench import background_load

    with background_load(1.0) as info:
        deadline = time.monotonic() + 60
        while not _gone_or_zombie(info["pid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
    assert info["alive_at_end"] is False, info  # the block outlived the limit: recorded


def _gone_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_bench_cli_attention_under_background_load_records_it(tmp_path, capsys):
    out = tmp_path / "a.json"
    assert main(["bench", "attention", "--lengths", "64", "--heads", "2", "--head-dim", "16", "--repeats", "1", "--no-memory",
                 "--method", "fna:s=16", "--background-load", "120", "--json", str(out)]) == 0
    load = json.loads(out.read_text())["config"]["background_load"]
    assert load["alive_at_end"] is True and load["limit_s"] == 120.0 and load["threads"] >= 1 and "tanh(a @ a)" in load["command"]
    assert _gone(load["pid"])
    cap = capsys.readouterr()
    assert "under background load" in cap.out and "Ran under background load" in cap.out
    assert "competing PyTorch process started" in cap.err
    # without the flag the JSON says so
    assert main(["bench", "attention", "--lengths", "64", "--heads", "2", "--head-dim", "16", "--repeats", "1", "--no-memory",
                 "--method", "fna:s=16", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["background_load"] is None
    with pytest.raises(SystemExit):  # argparse: "must be a positive number of seconds"
        main(["bench", "attention", "--background-load", "-3"])
    assert "must be a positive number of seconds" in capsys.readouterr().err
