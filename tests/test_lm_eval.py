"""``attnpatch eval lm-eval``: lm-evaluation-harness's own tasks and scoring on the unpatched model and each setting.

Offline: lm-eval's RULER tasks on the repeat haystack generate their prompts with the model's tokenizer (no hub).
The unpatched row must be lm-eval's own numbers on the same model, every setting must answer the same prompts, and a
2-process run must give the 1-process answers and metrics.
"""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from attnpatch.cli import main  # noqa: E402
from test_scale_out import _launch  # noqa: E402

TASKS = ["niah_single_1", "niah_multikey_2"]
LENGTH = 1024
# anchor_attention scaled to the tiny model so it skips keys at ~900 tokens (min_len=0: no short-prompt hand-back;
# min_recall=0: no recall guard turning the random heads dense)
SETTING = ("anchor_attention:theta=-2,min_len=0,pool_stride=2,block_size=32,local_window=32,init_block=16,dense_last=0,"
           "min_recall=0")
ARGS = ["eval", "lm-eval", "--tasks", *TASKS, "--metadata", f"max_seq_lengths=[{LENGTH}]", "--limit", "2",
        "--gen-kwargs", "max_gen_toks=8", "--method", SETTING]


@pytest.fixture(scope="module", autouse=True)
def _one_task_index():
    """Every lm-eval ``TaskManager`` reads the ~14k task files lm-eval ships into an index (about 10 s on 2 cores):
    ours and ``simple_evaluate``'s own read the same folder, so the module builds that index once and hands each
    manager its own deep copy (nothing one manager does to its entries reaches another)."""
    import copy

    from lm_eval.tasks import _index

    real, built = _index.TaskIndex.build, {}

    def build(paths, **kwargs):
        paths = list(paths)
        key = (tuple(map(str, paths)), tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = real(paths, **kwargs)
        return copy.deepcopy(built[key])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_index.TaskIndex, "build", staticmethod(build))
        yield


def _answers(samples):
    return [(s["task"], s["doc_id"], s["prompt_hash"], s["answer"], s["metrics"]) for s in samples]


@pytest.fixture(scope="module")
def one_process(tiny_lm_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm-eval-one")
    path = out / "one.json"
    assert main([*ARGS, "--model", str(tiny_lm_dir), "--json", str(path), "--recall-samples", "1", "--threads", "1"]) == 0
    return path, json.loads(path.read_text())


def test_dense_and_a_sparse_setting_side_by_side(one_process, tiny_lm_dir):
    path, res = one_process
    assert res["tasks"] == TASKS and res["limit"] == 2 and res["apply_chat_template"] is False and res["complete"]
    assert res["metadata"] == {"tokenizer": str(tiny_lm_dir), "pretrained": str(tiny_lm_dir), "max_seq_lengths": [LENGTH]}
    assert res["lm_eval_version"] and res["packages"]["lm_eval"] == res["lm_eval_version"] and "torch" in res["machine"]
    # lm-eval's own result file per setting, next to ours
    files = res["lm_eval_files"]
    assert list(files) == ["dense", res["runs"][0]["label"]]
    for label, f in files.items():
        own = json.loads(Path(f).read_text())
        assert Path(f).parent == path.parent and set(own["samples"]) == set(TASKS)
        entry = res["dense"] if label == "dense" else res["runs"][0]
        assert own["results"] == entry["lm_eval"]["results"]
    # rows: task x length, one per setting; the -1 of lm-eval's default length (no sample there) is no row
    assert [(r["task"], r["metric"]) for r in res["rows"]] == [(t, str(LENGTH)) for t in TASKS]
    dense = {s["task"]: [] for s in res["dense"]["samples"]}
    for s in res["dense"]["samples"]:
        dense[s["task"]].append(s)
    run = res["runs"][0]
    for row in res["rows"]:
        assert row["n"] == 2 and row["dense"] == res["dense"]["lm_eval"]["results"][row["task"]][f"{LENGTH},none"]
        assert row["score"] == run["lm_eval"]["results"][row["task"]][f"{LENGTH},none"]
        assert row["delta"] == pytest.approx(row["score"] - row["dense"])
        assert row["dense"] == pytest.approx(sum(s["metrics"][str(LENGTH)] for s in dense[row["task"]]) / 2)
        assert row["modes"] == "sparse" and 0 < row["sparsity"] < 1  # really sparse, not the dense:short hand-back
        assert 0 < row["recall_mean"] <= 1 + 1e-6
    # the same prompts in every setting; per-sample answers and scores kept
    assert res["same_samples"]
    keys = lambda xs: [(s["task"], s["doc_id"], s["prompt_hash"]) for s in xs]  # noqa: E731
    assert keys(res["dense"]["samples"]) == keys(run["samples"]) and len(run["samples"]) == 4
    for s in run["samples"]:
        assert s["tokens"] > LENGTH // 2 and s["prefill_s"] > 0 and isinstance(s["answer"], str)
        assert ("recall_mean" in s) == (s["doc_id"] < 1)


def test_the_png_draws_each_tasks_score_against_speedup(one_process):
    from matplotlib.image import imread

    from attnpatch.evals.lmeval.plots import lmeval_panels

    path, res = one_process
    png = path.with_suffix(".png")
    assert imread(png).shape[0] > 200  # written next to the JSON by default
    panels = lmeval_panels(res["rows"])
    assert [(p["task"], p["metric"]) for p in panels] == [(t, str(LENGTH)) for t in TASKS]
    for panel, row in zip(panels, res["rows"]):
        dense, patched = panel["points"]
        assert dense.dense and (dense.speedup, dense.value) == (1.0, row["dense"])
        assert (patched.label, patched.speedup, patched.value) == (row["setting"], row["speedup"], row["score"])


def test_the_dense_row_is_lm_evals_own_hf_model(one_process, tiny_lm_dir):
    from lm_eval import simple_evaluate

    _, res = one_process
    own = simple_evaluate(
        model="hf", model_args={"pretrained": str(tiny_lm_dir), "dtype": "float32", "device": "cpu"}, tasks=TASKS,
        limit=2, gen_kwargs="max_gen_toks=8", metadata={"max_seq_lengths": [LENGTH]}, log_samples=True,
    )
    for task in TASKS:
        assert own["results"][task][f"{LENGTH},none"] == res["dense"]["lm_eval"]["results"][task][f"{LENGTH},none"]
        theirs = sorted((s["doc_id"], s["filtered_resps"][0], s[str(LENGTH)]) for s in own["samples"][task])
        ours = sorted((s["doc_id"], s["answer"], s["metrics"][str(LENGTH)]) for s in res["dense"]["samples"] if s["task"] == task)
        assert ours == theirs


@pytest.mark.slow
def test_two_processes_answer_as_one(one_process, tiny_lm_dir, tmp_path):
    _, one = one_process
    _launch([*ARGS, "--model", str(tiny_lm_dir), "--json", str(tmp_path / "two.json")], cwd=tmp_path)
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2
    assert _answers(two["dense"]["samples"]) == _answers(one["dense"]["samples"])
    assert _answers(two["runs"][0]["samples"]) == _answers(one["runs"][0]["samples"])
    assert [{k: r[k] for k in ("task", "metric", "n", "dense", "score", "sparsity")} for r in two["rows"]] == [
        {k: r[k] for k in ("task", "metric", "n", "dense", "score")} | {"sparsity": pytest.approx(r["sparsity"])} for r in one["rows"]]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [x for x in err if x.startswith("attnpatch: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture()
def no_loading(monkeypatch):
    import attnpatch.checkpoints as ck

    def fail(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(ck, "load_causal_lm", fail)


def test_a_metadata_key_no_task_reads_is_one_line(no_loading, tiny_lm_dir, capsys, tmp_path):
    argv = ["eval", "lm-eval", "--model", str(tiny_lm_dir), "--tasks", "niah_single_1", "--metadata", "max_seq_length=[512]",
            "--json", str(tmp_path / "x.json")]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert "'max_seq_length'" in line and "max_seq_lengths" in line and "niah_single_1" in line


def test_an_unknown_task_is_one_line(no_loading, tiny_lm_dir, capsys, tmp_path):
    assert main(["eval", "lm-eval", "--model", str(tiny_lm_dir), "--tasks", "niah_single_9", "--json", str(tmp_path / "x.json")]) == 2
    line = _one_error_line(capsys)
    assert "niah_single_9" in line and "niah_single_1" in line


def test_the_task_check_says_what_it_waits_for(no_loading, tiny_lm_dir, capsys, tmp_path):
    """One line on stderr before lm-eval's task index is consulted, so that the wait has a reason."""
    assert main(["eval", "lm-eval", "--model", str(tiny_lm_dir), "--tasks", "niah_single_9", "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.splitlines()
    said = err.index("[attnpatch] checking task names (niah_single_9) against lm-eval's task index ...")
    assert said < next(i for i, line in enumerate(err) if line.startswith("attnpatch: error: --tasks niah_single_9"))


def test_a_bad_output_path_is_refused_before_the_task_index(no_loading, tiny_lm_dir, capsys, tmp_path, monkeypatch):
    from attnpatch.evals.lmeval import tasks

    monkeypatch.setattr(tasks, "_index_manager", lambda: pytest.fail("the task index was built before the output paths were checked"))
    assert main(["eval", "lm-eval", "--model", str(tiny_lm_dir), "--tasks", "niah_single_1", "--json", str(tmp_path)]) == 2
    assert str(tmp_path) in _one_error_line(capsys)


def test_the_task_index_is_built_once_and_read_back_from_disk(tmp_path, monkeypatch):
    """lm-eval builds its index by reading every task file it ships (13 s idle, 24-50 s under load, on each run);
    it is written once under the cache folder and read back, equal, by later runs."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import TaskIndex

    from attnpatch.errors import DataError
    from attnpatch.evals.lmeval import index, tasks

    monkeypatch.setenv("ATTNPATCH_CACHE", str(tmp_path))
    real, builds = vars(TaskIndex)["build"], []

    def build(paths, **kwargs):  # lm-eval's own build, over its RULER folder only (seconds, not a minute)
        builds.append(list(paths))
        return real.__func__([Path(p) / "ruler" for p in paths], **kwargs)

    monkeypatch.setattr(TaskIndex, "build", staticmethod(build))
    said = []
    first = index.cached_task_manager(log=said.append)
    assert len(builds) == 1 and index.index_file().is_file() and index.index_file().parent == tmp_path / "lm-eval"
    assert said == [f"building lm-eval's task index (it reads every task file lm-eval ships; once, then kept in {index.index_file()}) ..."]
    assert "niah_single_1" in first.task_index and "ruler" in first.task_index
    second = index.cached_task_manager(log=said.append)
    assert len(builds) == 1 and len(said) == 1  # read back, not built
    assert second.task_index == first.task_index and second.all_tasks == first.all_tasks
    assert vars(TaskIndex)["build"].__func__ is build  # the class's build is put back
    with pytest.raises(DataError, match="--tasks niah_single_9: .* closest: niah_single_"):
        tasks.check_tasks(second, ["niah_single_9"])
    index.index_file().write_text("{")  # a partial file is built again
    assert index.cached_task_manager(log=said.append).task_index == first.task_index and len(builds) == 2
    assert isinstance(second, TaskManager)


def test_a_bad_method_option_fails_before_loading(no_loading, tiny_lm_dir, capsys, tmp_path):
    assert main([*ARGS, "--model", str(tiny_lm_dir), "-o", "nosuch=1", "--json", str(tmp_path / "x.json")]) == 2
    assert "nosuch" in _one_error_line(capsys)


def test_without_lm_eval_it_says_how_to_install(no_loading, monkeypatch, tiny_lm_dir, capsys):
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    assert main(["eval", "lm-eval", "--model", str(tiny_lm_dir), "--tasks", "niah_single_1"]) == 2
    assert _one_error_line(capsys) == "attnpatch: error: attnpatch eval lm-eval needs lm-evaluation-harness: pip install 'attnpatch[lm-eval]'"


SMOLLM2 = Path("~/.cache/attnpatch/models/smollm2-135m-instruct").expanduser()


@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="smollm2-135m-instruct is not prepared")
def test_smollm2_unpatched_answers_are_lm_evals_own_at_4k(smollm2):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from attnpatch.evals.lmeval import run_lm_eval

    meta = {"max_seq_lengths": [4096]}
    model, tok = smollm2  # the catalogue's folder, SMOLLM2, loaded once per session
    ours = run_lm_eval(model, tok, tasks=["niah_single_1"], settings=[], metadata=meta, limit=2)
    own = simple_evaluate(model=HFLM(pretrained=str(SMOLLM2), dtype="float32", batch_size=1, device="cpu"), tasks=["niah_single_1"],
                          limit=2, metadata={"tokenizer": str(SMOLLM2), **meta}, log_samples=True)
    theirs = sorted((s["doc_id"], s["filtered_resps"][0], s["4096"]) for s in own["samples"]["niah_single_1"])
    assert sorted((s["doc_id"], s["answer"], s["metrics"]["4096"]) for s in ours["dense"]["samples"]) == theirs
    assert ours["rows"][0]["dense"] == own["results"]["niah_single_1"]["4096,none"] and ours["rows"][0]["n"] == 2
    assert all(s["tokens"] > 3500 for s in ours["dense"]["samples"])


# ------------------------------------------------------------------------------------------------ faults found outside


@pytest.fixture(scope="module")
def three_settings(tmp_path_factory):
    """ruler_cwe and niah_single_1 at 2048 tokens (lm-eval's ruler_cwe has no answer words at 1024) under the dense
    method, a_shape with a window of 2048 keys (exact at these lengths) and a sparse anchor_attention, with a
    compiled-kernel build that takes BUILD_S seconds (the kernel's state reset): the build must not land in a timed
    request.  The tiny Llama of ``tiny_lm_dir`` with 2048 positions (a longer length than the config's is refused)."""
    import time

    import torch.utils.cpp_extension as cpp

    from test_ruler_tasks import _make_tokenizer
    from tiny_models import tiny_causal_lm

    import attnpatch.attention.backends.cpu_kernel as ck

    tiny_lm_dir = tmp_path_factory.mktemp("tiny-llama-2k")
    tok = _make_tokenizer(chat=True)
    tiny_causal_lm("llama", vocab=len(tok), max_position_embeddings=2048).save_pretrained(tiny_lm_dir)
    tok.save_pretrained(tiny_lm_dir)
    out = tmp_path_factory.mktemp("lm-eval-three")
    path = out / "three.json"
    real = cpp.load

    def slow_load(*a, **k):
        time.sleep(BUILD_S)
        return real(*a, **k)

    argv = ["eval", "lm-eval", "--model", str(tiny_lm_dir), "--tasks", "ruler_cwe", "niah_single_1", "--metadata",
            "max_seq_lengths=[2048]", "--limit", "1", "--gen-kwargs", "max_gen_toks=8", "--method", "dense",
            "a_shape:window=2048", SETTING, "--json", str(path), "--threads", "1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "_state", {})
        mp.setattr(cpp, "load", slow_load)
        import io
        from contextlib import redirect_stdout

        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main(argv) == 0
    return path, json.loads(path.read_text()), buf.getvalue()


BUILD_S = 6.0


def test_the_dense_method_does_not_overwrite_the_unpatched_rows_file(three_settings):
    path, res, _ = three_settings
    files = res["lm_eval_files"]
    assert list(files)[:2] == ["dense", "dense-routed"] and len(set(files.values())) == len(files) == 4
    assert all(Path(f).is_file() for f in files.values())
    assert json.loads(Path(files["dense"]).read_text())["results"] == res["dense"]["lm_eval"]["results"]
    assert json.loads(Path(files["dense-routed"]).read_text())["results"] == res["runs"][0]["lm_eval"]["results"]


def test_every_setting_answers_the_same_ruler_cwe_prompts(three_settings):
    _, res, printed = three_settings
    cwe = lambda xs: [(s["doc_id"], s["prompt_hash"]) for s in xs if s["task"] == "ruler_cwe"]  # noqa: E731
    assert cwe(res["dense"]["samples"]) and all(cwe(r["samples"]) == cwe(res["dense"]["samples"]) for r in res["runs"])
    assert res["differing_tasks"] == [] and res["same_samples"] and "did not answer the same prompts" not in printed
    assert all(r["delta"] is not None for r in res["rows"])


def test_a_setting_exact_at_the_prompt_length_gets_a_note(three_settings):
    _, res, printed = three_settings
    a_shape = [r for r in res["rows"] if r["setting"] == "a_shape (window=2048)"]
    assert len(a_shape) == 2 and all(r["modes"] == "dense:window>=N" for r in a_shape)
    note = [line for line in printed.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "(a_shape (window=2048))" in note[0] and "dense:window>=N" in note[0]
    assert "anchor_attention" not in note[0] and "dense-routed" not in note[0]


def test_the_kernel_build_is_not_in_a_timed_request(three_settings):
    _, res, _ = three_settings
    anchor = next(r for r in res["runs"] if r["method"] == "anchor_attention")
    assert all(s["modes"] == ["sparse"] for s in anchor["samples"])  # the compiled kernel ran
    assert max(s["prefill_s"] for s in anchor["samples"]) < BUILD_S


def test_a_malformed_metadata_value_is_one_line_before_loading(no_loading, tiny_lm_dir, capsys, tmp_path):
    for value, says in (("max_seq_lengths=[1024", "not a valid list"), ("max_seq_lengths=1024", "a list of context lengths")):
        assert main(["eval", "lm-eval", "--model", str(tiny_lm_dir), "--tasks", "niah_single_1", "--metadata", value,
                     "--json", str(tmp_path / "x.json")]) == 2
        line = _one_error_line(capsys)
        assert value in line and says in line


def test_a_length_beyond_the_models_context_is_one_line_before_the_task_index(no_loading, tiny_lm_dir, capsys, tmp_path,
                                                                              monkeypatch):
    """max_seq_lengths=[10000000] on a model of 1024 positions ran RULER's haystack generation for more than 10 minutes
    with no word; it is refused from the model's config.json, before lm-eval's task index is built."""
    from attnpatch.evals.lmeval import tasks

    monkeypatch.setattr(tasks, "_index_manager", lambda: pytest.fail("the task index was built before the lengths were checked"))
    assert main(["eval", "lm-eval", "--model", str(tiny_lm_dir), "--tasks", "niah_single_1",
                 "--metadata", "max_seq_lengths=[512,10000000]", "--json", str(tmp_path / "x.json")]) == 2
    assert _one_error_line(capsys) == (
        "attnpatch: error: --metadata max_seq_lengths 10000000: beyond the model's context of 1024 tokens "
        f"(max_position_embeddings in {tiny_lm_dir / 'config.json'}); give lengths up to 1024")


def test_a_vision_method_is_refused_before_loading(no_loading, tiny_lm_dir, capsys, tmp_path):
    assert main(["eval", "lm-eval", "--model", str(tiny_lm_dir), "--tasks", "niah_single_1", "--method", "fna",
                 "--json", str(tmp_path / "x.json")]) == 2
    line = _one_error_line(capsys)
    assert "'fna'" in line and "causal lm" in line and "vision" in line
