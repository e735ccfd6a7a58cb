"""The needle-in-a-haystack heatmap of ``eval ruler`` (:mod:`attnpatch.evals.ruler.plots`): the binning by context
length and needle depth, the PNG, ``--plot``, and the interrupted run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnpatch.cli import main
from attnpatch.evals.ruler.plots import niah_grids, plot_niah_heatmap, task_grid

ANCHOR_SMALL = ["-o", "theta=2", "-o", "min_len=0", "-o", "block_size=32", "-o", "local_window=32", "-o", "init_block=16"]


def _sample(depth, dense, patched=None):
    s = {"depth": depth, "dense_score": dense}
    if patched is not None:
        s["patched_score"] = patched
    return s


def _cell(task, length, samples):
    cell = {"task": task, "length": length, "n": len(samples), "dense_acc": float(np.mean([s["dense_score"] for s in samples])),
            "samples": samples}
    if "patched_score" in samples[0]:
        cell["patched_acc"] = float(np.mean([s["patched_score"] for s in samples]))
    return cell


def _png(path):
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return imread(path).shape


def test_niah_grids_are_the_per_length_and_depth_means():
    result = {"cells": [
        _cell("niah_single", 2048, [_sample(0.5, 1.0, 0.0), _sample(0.0, 1.0, 1.0), _sample(0.5, 0.0, 0.5), _sample(1.0, 1.0, 1.0)]),
        _cell("niah_single", 1024, [_sample(0.0, 0.0, 1.0), _sample(0.5, 1.0, 1.0), _sample(1.0, 0.5, 0.0)]),
        _cell("variable_tracking", 1024, [_sample(None, 1.0, 0.0)]),  # no depth: not in any heatmap
        _cell("niah_multikey", 1024, [_sample(0.25, 1.0, 0.75)]),
    ]}
    grids = niah_grids(result)
    assert list(grids) == ["niah_single", "niah_multikey"]
    g = grids["niah_single"]
    assert g["depths"] == [0.0, 0.5, 1.0] and g["lengths"] == [1024, 2048]
    # rows: depth 0, 0.5, 1; columns: 1024, 2048
    np.testing.assert_array_equal(g["dense"], [[0.0, 1.0], [1.0, (1.0 + 0.0) / 2], [0.5, 1.0]])
    np.testing.assert_array_equal(g["patched"], [[1.0, 1.0], [1.0, (0.0 + 0.5) / 2], [0.0, 1.0]])
    np.testing.assert_array_equal(g["diff"], g["patched"] - g["dense"])
    np.testing.assert_array_equal(g["diff"], [[1.0, 0.0], [0.0, -0.25], [-0.5, 0.0]])
    np.testing.assert_array_equal(g["n"], [[1, 1], [1, 2], [1, 1]])
    m = grids["niah_multikey"]
    assert m["depths"] == [0.25] and m["lengths"] == [1024] and m["diff"][0, 0] == -0.25


def test_tasks_without_a_depth_get_a_row_of_their_own_beside_the_niah_heatmap(tmp_path):
    niah = [_cell("niah_single", 1024, [_sample(0.0, 1.0, 1.0), _sample(1.0, 1.0, 0.0)])]
    mixed = niah + [_cell("variable_tracking", 1024, [_sample(None, 1.0, 0.0)])]
    h_niah = _png(plot_niah_heatmap({"cells": niah}, tmp_path / "niah.png"))[0]
    h_mixed = _png(plot_niah_heatmap({"cells": mixed}, tmp_path / "mixed.png"))[0]
    assert h_mixed > h_niah + 150  # variable_tracking is drawn (task x length), not left out


def test_a_depth_missing_at_a_length_is_empty_and_a_baseline_run_has_no_patched_grid(tmp_path):
    result = {"cells": [_cell("niah_single", 512, [_sample(0.0, 1.0), _sample(0.5, 0.0)]), _cell("niah_single", 1024, [_sample(0.0, 1.0)])]}
    g = niah_grids(result)["niah_single"]
    assert g["patched"] is None and g["diff"] is None
    assert g["dense"][0].tolist() == [1.0, 1.0] and g["dense"][1, 0] == 0.0 and np.isnan(g["dense"][1, 1]) and g["n"][1, 1] == 0
    h, w, _ = _png(plot_niah_heatmap(result, tmp_path / "dense.png", "dense only"))
    assert 250 < h < 1000 and 400 < w < 900  # one panel


def test_without_a_niah_task_the_heatmap_is_task_by_length(tmp_path):
    result = {"cells": [_cell("variable_tracking", 1024, [_sample(None, 1.0, 0.0), _sample(None, 0.0, 0.0)]),
                        _cell("common_words", 1024, [_sample(None, 0.3, 0.4)]), _cell("variable_tracking", 2048, [_sample(None, 1.0, 1.0)])]}
    assert niah_grids(result) == {}
    g = task_grid(result)
    assert g["tasks"] == ["variable_tracking", "common_words"] and g["lengths"] == [1024, 2048]
    np.testing.assert_array_equal(g["dense"][:, 0], [0.5, 0.3])
    np.testing.assert_allclose(g["diff"][:, 0], [-0.5, 0.1])
    assert np.isnan(g["dense"][1, 1]) and g["n"].tolist() == [[2, 1], [1, 0]]
    h, w, _ = _png(plot_niah_heatmap(result, tmp_path / "tasks.png", "t"))
    assert w > 1200 and h > 250  # three panels side by side
    assert plot_niah_heatmap({"cells": []}, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def _fake_generation(monkeypatch, stop_at=None):
    """Replace the greedy generation: dense finds every needle (the prompt echoed); patched finds the needle at depth
    0 at the first length and at depths 0 and 0.5 at the second (samples cycle the depths 0, 0.5, 1; per sample one
    dense then one patched call, no recall pass).  The ``stop_at``-th call raises Ctrl-C."""
    import attnpatch.evals.ruler.runner as ruler

    calls = {"n": 0}

    def gen(model, tokenizer, input_ids, max_new_tokens):
        k = calls["n"]
        calls["n"] += 1
        if calls["n"] == stop_at:
            raise KeyboardInterrupt
        cell, sample, patched = k // 6, (k % 6) // 2, k % 2
        found = not patched or sample <= cell % 2
        return (tokenizer.decode(input_ids, skip_special_tokens=True) if found else "no idea"), 0.01

    monkeypatch.setattr(ruler, "generate_greedy", gen)


def test_eval_ruler_writes_depth_data_the_lm_eval_block_and_the_heatmap(tiny_lm_dir, tmp_path, capsys, monkeypatch):
    _fake_generation(monkeypatch)
    out = tmp_path / "r.json"
    rc = main(["eval", "ruler", "--model", str(tiny_lm_dir), *ANCHOR_SMALL, "--tasks", "niah_single", "niah_multikey",
               "--lengths", "300", "400", "--samples", "3", "--depths", "0", "0.5", "1", "--no-recall", "--json", str(out)])
    assert rc == 0
    png = tmp_path / "r.png"  # the default: next to the JSON
    assert f"wrote {png}" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [(c["task"], c["length"], [s["depth"] for s in c["samples"]]) for c in res["cells"]] == [
        (t, n, [0.0, 0.5, 1.0]) for t in ("niah_single", "niah_multikey") for n in (300, 400)]
    assert [[s["patched_score"] for s in c["samples"]] for c in res["cells"]] == [[1, 0, 0], [1, 1, 0]] * 2
    # the lm-eval block: one entry per task (niah_multikey on the repeat haystack keeps its name), its values the cells'
    for row, key in (("dense", "dense_acc"), ("patched", "patched_acc")):
        results = res["lm_eval"][row]["results"]
        assert list(results) == ["niah_single_1", "niah_multikey_repeat"]
        for c in res["cells"]:
            name = "niah_single_1" if c["task"] == "niah_single" else "niah_multikey_repeat"
            assert results[name][f"{c['length']},none"] == c[key]
            assert results[name]["4096,none"] == -1 and results[name]["sample_len"] == 6
    assert res["lm_eval"]["patched"]["results"]["niah_single_1"]["400,none"] == pytest.approx(2 / 3)
    grids = niah_grids(res)
    assert list(grids) == ["niah_single", "niah_multikey"]
    for g in grids.values():  # rows: depth 0, 0.5, 1; columns: 300, 400
        assert g["dense"].tolist() == [[1, 1], [1, 1], [1, 1]] and g["patched"].tolist() == [[1, 1], [0, 1], [0, 0]]
        assert g["diff"].tolist() == [[0, 0], [-1, 0], [-1, -1]]
    h, w, ch = _png(png)
    assert ch in (3, 4) and 1200 < w < 2500 and 500 < h < 1500  # two task rows of three panels


def test_plot_that_is_not_a_png_is_refused_before_loading(capsys):
    assert main(["eval", "ruler", "--model", "/nonexistent", "--plot", "foo.txt"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["attnpatch: error: --plot foo.txt: give a .png path"]


def test_interrupted_eval_ruler_draws_the_finished_cells(tiny_lm_dir, tmp_path, capsys, monkeypatch):
    _fake_generation(monkeypatch, stop_at=7)  # cell 1: 3 samples x (dense + patched) = 6 calls; the 7th is in cell 2
    out, png = tmp_path / "r.json", tmp_path / "plots" / "h.png"
    rc = main(["eval", "ruler", "--model", str(tiny_lm_dir), *ANCHOR_SMALL, "--lengths", "300", "400", "--samples", "3",
               "--depths", "0", "0.5", "1", "--no-recall", "--json", str(out), "--plot", str(png)])
    assert rc == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f'attnpatch: interrupted (Ctrl-C) after 1/2 cells; wrote the finished part to {out} and {png} (marked "interrupted": true)')
    res = json.loads(out.read_text())
    g = niah_grids(res)["niah_single"]
    assert g["lengths"] == [300] and g["dense"][:, 0].tolist() == [1.0, 1.0, 1.0] and g["diff"][:, 0].tolist() == [0.0, -1.0, -1.0]
    assert res["lm_eval"]["patched"]["results"]["niah_single_1"]["300,none"] == pytest.approx(1 / 3)
    h, w, _ = _png(png)
    assert w > 1000 and h > 250


def test_ruler_takes_the_method_colon_options_form(tmp_path, capsys, monkeypatch):
    """``--method a_shape:window=...`` is the setting syntax of every eval: its options are validated as ``-o``'s."""
    seen = {}

    def fake_load(*a, **k):  # stop at the model load: what came before it is the parsing under test
        seen["loaded"] = True
        raise KeyboardInterrupt

    monkeypatch.setattr("attnpatch.checkpoints.load_causal_lm", fake_load)
    assert main(["eval", "ruler", "--method", "a_shape:window=0", "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "unknown method" not in err and "window" in err and "loaded" not in seen
    # a valid setting in that form gets as far as the model load (Ctrl-C there: exit 130)
    assert main(["eval", "ruler", "--method", "a_shape:window=64,init_tokens=4", "--json", str(tmp_path / "r.json")]) == 130
    assert seen == {"loaded": True}
