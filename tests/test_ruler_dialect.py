"""RULER results in lm-evaluation-harness's dialect (:mod:`attnpatch.evals.ruler.dialect`): the task names, the
``"<length>,none"`` keys and values as lm-eval's own scoring and aggregation give them, and lm-eval's table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attnpatch.evals.ruler import dialect
from attnpatch.evals.ruler.tasks import TASKS, score


def _cell(task, length, preds_answers, patched=None):
    samples = []
    for k, (pred, answers) in enumerate(preds_answers):
        s = {"task": task, "length": length, "depth": None, "answers": answers, "dense_pred": pred, "dense_score": score(task, pred, answers)}
        if patched is not None:
            s.update(patched_pred=patched[k], patched_score=score(task, patched[k], answers))
        samples.append(s)
    cell = {"task": task, "length": length, "n": len(samples), "dense_acc": sum(s["dense_score"] for s in samples) / len(samples),
            "samples": samples}
    if patched is not None:
        cell["patched_acc"] = sum(s["patched_score"] for s in samples) / len(samples)
    return cell


# hand-made cells: niah_single at 1024 (3 samples) and 4096 (2), common_words at 1024 (2); some answers half found
NIAH = [("is 1234567.", ["1234567"]), ("no idea", ["7654321"]), ("It is 5555555", ["5555555"])]
NIAH_4K = [("none", ["1111111"]), ("1111112 and 2222222", ["2222222"])]
CWE = [("1. apple 2. pear", ["apple", "pear", "plum", "fig"]), ("plum", ["plum", "fig"])]


@pytest.fixture
def cells():
    return [_cell("niah_single", 1024, NIAH, patched=["1234567", "7654321", "x"]), _cell("niah_single", 4096, NIAH_4K, patched=["1111111", "x"]),
            _cell("common_words", 1024, CWE, patched=["apple pear plum fig", "x"])]


def test_task_names_map_to_lm_evals_where_the_generators_match():
    assert {(t, h): dialect.lm_eval_task_name(t, h) for t in TASKS for h in ("repeat", "essay")} == {
        ("niah_single", "repeat"): "niah_single_1", ("niah_single", "essay"): "niah_single_2",
        ("niah_multikey", "repeat"): "niah_multikey_repeat", ("niah_multikey", "essay"): "niah_multikey_1",
        ("niah_multivalue", "repeat"): "niah_multivalue_repeat", ("niah_multivalue", "essay"): "niah_multivalue",
        ("niah_multiquery", "repeat"): "niah_multiquery_repeat", ("niah_multiquery", "essay"): "niah_multiquery",
        ("variable_tracking", "repeat"): "ruler_vt", ("variable_tracking", "essay"): "variable_tracking_essay",
        ("common_words", "repeat"): "ruler_cwe", ("common_words", "essay"): "ruler_cwe",
        ("frequent_words", "repeat"): "ruler_fwe", ("frequent_words", "essay"): "ruler_fwe",
    }


def test_mapped_names_are_lm_eval_ruler_tasks_and_ours_never_take_another_tasks_name():
    lm_eval = pytest.importorskip("lm_eval")
    folder = Path(lm_eval.__file__).parent / "tasks" / "ruler"
    names = {m.group(1) for p in folder.glob("*.yaml") for m in re.finditer(r"^task:\s*(\S+)\s*$", p.read_text(), re.M)}
    assert set(dialect.LM_EVAL_NAMES.values()) <= names
    unmapped = {dialect.lm_eval_task_name(t, h) for t in TASKS for h in ("repeat", "essay")} - set(dialect.LM_EVAL_NAMES.values())
    assert unmapped and not unmapped & names
    # the lm-eval constants copied here are lm-eval's own
    from lm_eval.tasks.ruler import common_utils

    assert tuple(common_utils.DEFAULT_SEQ_LENGTHS) == dialect.LM_EVAL_DEFAULT_LENGTHS
    yaml = (folder / "niah_single_1.yaml").read_text()
    assert tuple(int(x) for x in re.findall(r'metric: "(\d+)"', yaml)) == dialect.LM_EVAL_METRIC_LENGTHS


def test_block_keys_are_lm_evals_and_values_the_cells_accuracies(cells):
    block = dialect.lm_eval_block(cells, "dense_score", "repeat")
    assert set(block) == {"results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples"}
    niah, cwe = block["results"]["niah_single_1"], block["results"]["ruler_cwe"]
    assert list(block["results"]) == ["niah_single_1", "ruler_cwe"]
    assert list(niah) == ["name", "alias", "sample_len", "4096,none", "4096_stderr,none", "1024,none", "1024_stderr,none"]
    assert list(cwe) == ["name", "alias", "sample_len", "4096,none", "4096_stderr,none", "1024,none", "1024_stderr,none"]
    assert niah["1024,none"] == cells[0]["dense_acc"] == 2 / 3 and niah["4096,none"] == cells[1]["dense_acc"] == 0.5
    assert cwe["1024,none"] == cells[2]["dense_acc"] == (0.5 + 0.5) / 2
    assert cwe["4096,none"] == -1  # lm-eval's default length, not run: -1
    assert niah["4096_stderr,none"] == "N/A" and niah["sample_len"] == 5 and block["n-samples"]["niah_single_1"] == {"original": 5, "effective": 5}
    patched = dialect.lm_eval_block(cells, "patched_score", "repeat")["results"]
    assert patched["niah_single_1"]["1024,none"] == cells[0]["patched_acc"] == 2 / 3
    assert patched["niah_single_1"]["4096,none"] == cells[1]["patched_acc"] == 0.5
    assert patched["ruler_cwe"]["1024,none"] == cells[2]["patched_acc"] == 0.5


def test_block_equals_lm_evals_own_scoring_and_aggregation(cells):
    """Every sample through lm-eval's ``process_results`` (its scoring and its ``-1`` for other lengths), then its
    ``_compute_task_aggregations`` with the RULER metric list: the same keys and values as ours."""
    pytest.importorskip("lm_eval")
    from lm_eval.evaluator_utils import _compute_task_aggregations
    from lm_eval.tasks.ruler import common_utils

    class Task:  # what _compute_task_aggregations reads of a RULER task: its metric list's aggregations
        task_name = "ruler"

        def aggregation(self):
            return {str(n): common_utils.aggregate_metrics for n in dialect.LM_EVAL_METRIC_LENGTHS}

    for key, pred in (("dense_score", "dense_pred"), ("patched_score", "patched_pred")):
        ours = dialect.lm_eval_block(cells, key, "repeat")["results"]
        for name, task in (("niah_single_1", "niah_single"), ("ruler_cwe", "common_words")):
            raw: dict = {}
            for c in cells:
                if c["task"] != task:
                    continue
                for s in c["samples"]:
                    for metric, v in common_utils.process_results({"max_length": c["length"], "outputs": s["answers"]}, [s[pred]]).items():
                        raw.setdefault((metric, "none"), []).append(v)
            theirs, n = _compute_task_aggregations(Task(), raw, bootstrap_iters=100000)
            assert {k: v for k, v in ours[name].items() if "," in k} == pytest.approx(theirs)
            assert list(ours[name])[3:] == list(theirs) and ours[name]["sample_len"] == n


def test_a_length_off_lm_evals_metric_list_has_its_mean_stderr():
    cell = _cell("niah_single", 300, [("1234567", ["1234567"]), ("no", ["7654321"]), ("no", ["1"]), ("1", ["1"])])
    row = dialect.lm_eval_block([cell], "dense_score", "repeat")["results"]["niah_single_1"]
    assert row["300,none"] == 0.5
    assert row["300_stderr,none"] == pytest.approx((1 / 3) ** 0.5 / 2)  # sample std sqrt(1/3) over sqrt(4)
    one = dialect.lm_eval_block([_cell("niah_single", 300, NIAH[:1])], "dense_score", "repeat")["results"]["niah_single_1"]
    assert one["300_stderr,none"] == "N/A"


def test_lm_evals_table_takes_the_block(cells):
    pytest.importorskip("lm_eval")
    from lm_eval.utils import make_table

    table = make_table(dialect.lm_eval_block(cells, "dense_score", "essay"))
    assert "niah_single_2" in table and "ruler_cwe" in table
    rows = [[x.strip() for x in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    # Tasks, Version, Filter, n-shot, Metric, higher is better (lm-eval's metric list only), Value, ±, Stderr
    assert rows == [
        ["niah_single_2", "1", "none", "0", "1024", "", "0.6667", "±", "0.3333"],
        ["", "", "none", "0", "4096", "↑", "0.5000", "±", "N/A"],
        ["ruler_cwe", "1", "none", "0", "1024", "", "0.5000", "±", "0"],
        ["", "", "none", "0", "4096", "↑", "-1.0000", "±", "N/A"],
    ]


def test_result_layouts_for_one_and_several_settings(cells):
    one = dialect.lm_eval_results(cells, [cells], "repeat")
    assert set(one) == {"dense", "patched"}
    assert one["patched"]["results"]["niah_single_1"]["1024,none"] == cells[0]["patched_acc"]
    assert set(dialect.lm_eval_results(cells, [], "repeat")) == {"dense"}  # a baseline-only run
    several = dialect.lm_eval_results(cells, [cells, cells[:1]], "repeat", one_setting=False)
    assert set(several) == {"dense", "runs"} and len(several["runs"]) == 2
    assert list(several["runs"][1]["results"]) == ["niah_single_1"]
