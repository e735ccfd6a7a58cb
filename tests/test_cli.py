"""The command line, end to end on a tiny random model saved to disk (no hub, no real checkpoint)."""

import json

import pytest

from attnpatch.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tiny_lm_dir):
    return tiny_lm_dir


def test_methods_json(capsys):
    assert main(["methods", "--json"]) == 0
    methods = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert methods["anchor_attention"]["options"]["theta"]["default"] == 12.0


def test_eval_ruler_end_to_end(tiny_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    rc = main([
        "eval", "ruler", "--model", str(tiny_dir), "--method", "anchor_attention", "-o", "theta=2", "-o", "min_len=0",
        "-o", "pool_stride=2", "-o", "block_size=32", "-o", "local_window=32", "-o", "init_block=16",
        "--tasks", "niah_single", "variable_tracking", "--lengths", "900", "--samples", "2", "--json", str(out), "--markdown", str(md),
    ])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["method"] == "anchor_attention" and res["options"]["theta"] == 2.0
    assert [(c["task"], c["length"], c["n"]) for c in res["cells"]] == [("niah_single", 900, 2), ("variable_tracking", 900, 2)]
    from attnpatch.evals.ruler.tasks import score

    for c in res["cells"]:
        assert 0.98 * 900 <= c["tokens"] <= 900
        assert 0 < c["sparsity"] < 1
        # measured: recall_mean 1 - 4e-6, recall_worst5 1 - 3e-5 (the random model's attention is near-uniform)
        assert 1 - 1.5e-5 < c["recall_mean"] <= 1 and 1 - 1e-4 < c["recall_worst5"] <= c["recall_mean"]
        assert c["prefill_dense_s"] > 0 and c["prefill_patched_s"] > 0
        assert len(c["samples"]) == 2
        # accuracies are the means of the samples' string-match scores of the texts generated
        for s in c["samples"]:
            assert s["dense_score"] == score(c["task"], s["dense_pred"], s["answers"])
            assert s["patched_score"] == score(c["task"], s["patched_pred"], s["answers"])
            assert s["patched_pred"] == s["dense_pred"]  # measured: identical greedy texts (recall above)
        assert c["dense_acc"] == pytest.approx(sum(s["dense_score"] for s in c["samples"]) / 2)
        assert c["patched_acc"] == pytest.approx(sum(s["patched_score"] for s in c["samples"]) / 2)
    printed = capsys.readouterr().out
    assert "patched acc" in printed and "recall worst5%" in printed
    assert "note:" not in printed  # sparse in every cell
    assert md.read_text().count("\n|") >= 3


def test_eval_ruler_says_when_the_defaults_ran_the_models_own_attention(tiny_dir, tmp_path, capsys):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert main(["eval", "ruler", "--model", str(tiny_dir), "--lengths", "300", "--samples", "1", "--no-recall",
                 "--json", str(out), "--markdown", str(md)]) == 0
    note = ("note: in every cell the patch ran the model's own attention in every layer (record mode dense:short: the "
            "prompt is below the method's minimum length")
    assert note in capsys.readouterr().out and note in md.read_text()
    cell = json.loads(out.read_text())["cells"][0]
    assert cell["patched_modes"] == ["dense:short"] and cell["samples"][0]["patched_pred"] == cell["samples"][0]["dense_pred"]


def test_eval_ruler_dense_baseline(tiny_dir, tmp_path, monkeypatch):
    import attnpatch.evals.ruler.runner as ruler

    orig = ruler.generate_greedy

    def echo(model, tokenizer, input_ids, max_new_tokens):
        # the random model's own text, then the prompt echoed: the needle is in it, so every sample scores 1
        text, seconds = orig(model, tokenizer, input_ids, max_new_tokens)
        return text + " " + tokenizer.decode(input_ids, skip_special_tokens=True), seconds

    monkeypatch.setattr(ruler, "generate_greedy", echo)
    out = tmp_path / "d.json"
    assert main(["eval", "ruler", "--model", str(tiny_dir), "--method", "dense", "--lengths", "400", "--samples", "2", "--json", str(out), "--no-recall"]) == 0
    cell = json.loads(out.read_text())["cells"][0]
    assert "patched_acc" not in cell and "patched_pred" not in cell["samples"][0]
    assert cell["n"] == 2 and [s["dense_score"] for s in cell["samples"]] == [1.0, 1.0] and cell["dense_acc"] == 1.0


def test_bad_option_fails_before_loading(capsys):
    assert main(["eval", "ruler", "--model", "/nonexistent", "-o", "theta=abc"]) == 2
    assert "theta='abc'" in capsys.readouterr().err
    assert main(["eval", "ruler", "--model", "/nonexistent", "-o", "nope=1"]) == 2
    assert "unknown option(s) nope" in capsys.readouterr().err


def test_missing_model_dir_is_clear(capsys):
    assert main(["eval", "ruler", "--model", "/nonexistent/dir", "--samples", "1"]) == 2
    assert "/nonexistent/dir" in capsys.readouterr().err


def test_repeated_list_options_accumulate():
    """`--method a --method b` keeps both (argparse alone keeps the last); given values replace the default."""
    from attnpatch.cli import build_parser

    p = build_parser()
    a = p.parse_args(["bench", "attention", "--method", "anchor_attention:kernel=torch", "--method", "fna:s=8", "fna",
                      "--lengths", "64", "--lengths", "128"])
    assert a.method == ["anchor_attention:kernel=torch", "fna:s=8", "fna"] and a.lengths == [64, 128]
    assert p.parse_args(["eval", "ruler", "--model", "m"]).lengths == [1024, 2048, 4096]
    assert p.parse_args(["eval", "ruler", "--model", "m", "--lengths", "512", "--lengths", "768"]).lengths == [512, 768]


def test_an_option_given_twice_is_refused(capsys):
    from attnpatch.cli import main

    assert main(["eval", "fidelity", "--model", "dinov2-small", "--method", "fna:s=8,s=9"]) == 2
    err = capsys.readouterr().err
    assert "option s given twice (s=8 and s=9)" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,says", [
    (["eval", "ruler", "--method", "fna", "a_shape"], "unrecognized arguments: a_shape"),
    (["eval", "ruler", "--method", "a_shape", "--method", "dense"],
     "argument --method: takes one setting, got a_shape and dense; several settings side by side: attnpatch compare --eval ruler"),
    (["tune", "--method", "fna", "--method", "tome"], "argument --method: takes one setting, got fna and tome; tune one method per run"),
    (["eval", "knn", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_subcommand_refuses_extra_arguments_with_its_own_usage(argv, says, capsys):
    """The subcommand's usage and one error line of its own (argparse alone printed the top-level ``attnpatch`` usage
    for a leftover value, and kept the last of two ``--method`` silently)."""
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--model", "/nonexistent/dir"])  # nothing loads even where the arguments are taken
    assert stop.value.code == 2
    err = capsys.readouterr().err
    command = "attnpatch " + " ".join(argv[: 2 if argv[0] == "eval" else 1])
    assert err.startswith(f"usage: {command} [-h]")
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert errors == [f"{command}: error: {says}"], err


@pytest.mark.slow
@pytest.mark.parametrize("module", ["attnpatch", "attnpatch.cli"])
def test_python_dash_m_runs_the_command(module):
    import subprocess
    import sys

    from attnpatch.patchers.method_table import methods_markdown
    from attnpatch.patchers.registry import METHODS

    proc = subprocess.run([sys.executable, "-m", module, "methods", "--markdown"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == methods_markdown()  # the registry's table, whole
    rows = proc.stdout.splitlines()
    assert rows[0] == "| method | model kinds | what it does | exact? | options (default) |"
    assert [r.split(" | ")[0] for r in rows[2:]] == [f"| `{name}`" for name in sorted(METHODS)]  # one row per method
