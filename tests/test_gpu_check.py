"""``benchmarks/gpu_check.py --dry-run``: the prepared GPU check runs on the CPU (Triton interpreter, tiny sizes) so
that it cannot rot, its exactness checks pass, and ``make_benchmarks.py render`` turns its JSON into tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run_and_its_tables(tmp_path):
    import torch

    # a captured layer of its own (not benchmarks/results/qkv/, which only some checkouts have): the run is the same
    # wherever it runs
    gen = torch.Generator().manual_seed(0)
    torch.save({x: torch.randn(1, 2 if x == "q" else 1, 512, 16, generator=gen) * 2 for x in "qkv"}, tmp_path / "layer.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path),
                           "--qkv", str(tmp_path / "layer.pt")],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["dry_run"] is True and r["skipped"] == []
    checks = {c["check"]: c for c in r["checks"]}
    assert set(checks) == {"fps_triton_indices_equal_float64", "fps_triton_copies_equal_float64", "pinv_matmul_vs_float64_same_filter",
                           "nystrom_all_landmarks_vs_float64_exact", "fna_layer_vs_float64_same_landmarks",
                           "a_shape_flex_vs_gather", "vertical_slash_flex_vs_gather", "block_topk_flex_vs_gather",
                           "a_shape_flex_exact_limit_vs_float64_sdpa", "anchor_triton_theta_1e30_d32_vs_float64_sdpa",
                           "anchor_triton_theta_1e30_d128_vs_float64_sdpa",
                           "anchor_triton_kept_set_equals_torch", "anchor_triton_vs_torch_path"}
    assert all(c["ok"] for c in checks.values())
    assert checks["fna_layer_vs_float64_same_landmarks"]["rel_err"] < 1e-3
    assert [x["N"] for x in r["fna"]] == [129, 257] and all(x["fna_ms"] > 0 and x["sdpa_ms"] > 0 for x in r["fna"])
    assert [(x["method"], x["N"]) for x in r["flex"]] == [("a_shape", 256)] and r["flex"][0]["flex_ms"] > 0
    assert r["flex_stats"]["fallbacks"] == 0
    assert checks["anchor_triton_kept_set_equals_torch"]["agreement"] == 1.0
    assert [(x["setting"], x["input"], x["N"]) for x in r["anchor"]] == [
        ("defaults", "synthetic", 512), ("paper", "synthetic", 512), ("defaults", "captured", 512), ("paper", "captured", 512)]
    assert all(x["anchor_ms"] > 0 and 0.0 <= x["sparsity"] < 1.0 and x["recall"] is not None for x in r["anchor"])
    assert r["anchor"][1]["sparsity"] > 0.1  # the paper's setting (no dense tail, no guard) runs sparse
    assert r["qkv"] == str(tmp_path / "layer.pt")
    for syn, cap in zip(r["anchor"][:2], r["anchor"][2:]):  # the generator's figures beside the captured layer's
        assert (cap["generator_sparsity"], cap["generator_recall"]) == (syn["sparsity"], syn["recall"])
        assert cap["qkv"] == "layer.pt" and "generator_sparsity" not in syn
    assert list(r["seconds"]) == ["checks", "fna", "break_even", "anchor", "flex", "kernels"]
    assert r["kernels"] == []  # nothing is compiled under the interpreter
    assert [b["method"] for b in r["break_even"]] == ["fna", "anchor_attention", "anchor_attention"]
    assert all(b["source"] == "calibrated" and b["timings"] for b in r["break_even"])
    assert "gpu_check: wrote" in proc.stdout

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import make_benchmarks
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = "\n".join(make_benchmarks.gpu_check_tables(r))
    assert "| fna_layer_vs_float64_same_landmarks | float32 |" in text
    assert "| paper | synthetic | 512 |" in text and "| paper | captured | 512 |" in text and "AnchorAttention with `kernel=\"triton\"`" in text
    assert "The captured layer (`layer.pt`) beside the synthetic prefill" in text
    assert "| 257 |" in text and "| a_shape | 256 |" in text and "| fna | 6 / 6 × 64 | float32 |" in text
