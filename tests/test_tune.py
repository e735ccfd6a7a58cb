"""``attnpatch tune``: the search's numbers are the numbers a user measures with the chosen config, the chosen
setting meets the target, the exact setting is always a candidate, the written config loads (and is refused on
another model), bad targets fail before any work."""

import json

import pytest
import torch

from attnpatch import patch, patched
from attnpatch.attention.anchor.config import AnchorConfig, bfloat16_is_faster
from attnpatch.errors import OptionError
from attnpatch.evals.recall import attention_recall
from attnpatch.evals.tune import _heads_to_add, recall_scores, tune_causal, tune_vision
from attnpatch.patchers.registry import get_method, write_config
from conftest import tiny_causal_lm

# small blocks so that a prompt of a few hundred tokens has stripes to drop
SMALL = dict(block_size=16, init_block=16, local_window=16, min_len=0, dense_last=0, min_recall=0.0, pool_stride=None,
             select_dtype="float32")


def _prompts(n=2, tokens=192, vocab=128):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, tokens), generator=g) for _ in range(n)]


def test_recall_scores_mean_and_worst_fraction():
    r = torch.tensor([[1.0, 0.5], [0.9, 0.7]])
    assert recall_scores(r, 0.5) == pytest.approx((0.775, 0.6))
    assert recall_scores(r, 0.05) == pytest.approx((0.775, 0.5))  # at least one entry
    with pytest.raises(ValueError, match="worst_fraction=0"):
        recall_scores(r, 0.0)


def test_heads_to_add_takes_the_lowest_heads_until_the_target_holds():
    rec = torch.ones(2, 3, 2, dtype=torch.float64)  # [prompts, layers, heads]
    rec[:, 1, 0] = 0.2
    rec[:, 2, 1] = 0.5
    rec[0, 0, 1] = 0.9
    # mean target alone: (1,0) first (lowest), then (2,1)
    assert _heads_to_add(rec, set(), [0, 1, 2], 0.99, 0.0, 0.05) == [(1, 0), (2, 1)]
    assert _heads_to_add(rec, set(), [0, 1, 2], 0.9, 0.0, 0.05) == [(1, 0)]
    assert _heads_to_add(rec, {(1, 0)}, [0, 1, 2], 0.9, 0.0, 0.05) == []  # already dense: met
    # layer indices come from the records (a patch that routes layers 4, 5, 7)
    assert _heads_to_add(rec, set(), [4, 5, 7], 0.9, 0.0, 0.05) == [(5, 0)]


def test_tune_causal_chosen_setting_meets_the_target_when_measured_again():
    model = tiny_causal_lm("llama", layers=3)
    prompts = _prompts()
    cands = [dict(SMALL, theta=-1e9), dict(SMALL, theta=1.0)]
    # the sparsest candidate alone: measured recall, to set a target it misses without dense heads
    with patched(model, "anchor_attention", **cands[0]):
        base = [attention_recall(model, p) for p in prompts]
    mats = torch.tensor([b["recall_matrix"] for b in base])
    mean0, worst0 = recall_scores(mats)
    assert worst0 < 0.999  # something to gain
    target_mean, target_worst = min(1.0, mean0 + (1 - mean0) / 2), min(1.0, worst0 + (1 - worst0) / 2)
    res = tune_causal(model, prompts, "anchor_attention", target_mean=target_mean, target_worst=target_worst,
                      candidates=cands, repeats=1)
    rows = res["rows"]
    assert len(rows) == 3 and rows[-1].get("exact") and rows[-1]["options"] == {"theta": float("inf")}
    assert rows[0]["dense_heads"] > 0  # the target needed per-head decisions
    heads = 3 * model.config.num_attention_heads
    for r in rows:
        if r["meets"] and r["dense_heads"] < heads:
            assert r["recall_mean"] >= target_mean and r["recall_worst"] >= target_worst and r["seconds"] > 0
        else:  # missed, or every head dense (the exact model with overhead): not timed, never chosen
            assert r["seconds"] is None and (not r["meets"] or "every head dense" in r["note"])
    chosen = res["chosen"]
    assert chosen["meets"] and chosen["seconds"] == min(r["seconds"] for r in rows if r["seconds"] is not None)
    if not chosen.get("exact"):  # the tuner's recall is what a user measures with the chosen options
        with patched(model, "anchor_attention", **chosen["options"]):
            again = torch.tensor([attention_recall(model, p)["recall_matrix"] for p in prompts])
        assert recall_scores(again) == pytest.approx((chosen["recall_mean"], chosen["recall_worst"]), abs=1e-12)
    assert res["geometry"]["num_layers"] == 3 and res["tokens"] == 192


def test_tune_causal_writes_a_config_that_loads_and_is_refused_on_another_model(tmp_path):
    model = tiny_causal_lm("llama", layers=3)
    prompts = _prompts(1)
    res = tune_causal(model, prompts, "anchor_attention", target_mean=0.0, target_worst=0.0,
                      candidates=[dict(SMALL, theta=-1e9)], repeats=1)
    opts = res["rows"][0]["options"]
    path = write_config(tmp_path / "t.json", "anchor_attention", opts, _geometry(model))
    x = prompts[0]
    with torch.no_grad(), patched(model, "anchor_attention", **opts):
        want = model(input_ids=x).logits
    with torch.no_grad(), patched(model, "anchor_attention", config=str(path)):
        got = model(input_ids=x).logits
    assert torch.equal(got, want)
    other = tiny_causal_lm("llama", layers=2)
    with pytest.raises(OptionError, match="was made for another model: num_layers 3 \\(model: 2\\)"):
        patch(other, "anchor_attention", config=str(path))
    assert json.loads(path.read_text())["options"]["theta"] == -1e9


def test_tune_causal_all_heads_dense_is_not_timed_and_the_exact_row_is_chosen():
    model = tiny_causal_lm("llama", layers=2)
    res = tune_causal(model, _prompts(1), "anchor_attention", target_mean=1.0, target_worst=1.0,
                      candidates=[dict(SMALL, theta=-1e9)], repeats=1, max_rounds=3)
    row = res["rows"][0]
    assert row["dense_heads"] == 2 * model.config.num_attention_heads and row["seconds"] is None
    assert "every head dense" in row["note"] and res["chosen"] is res["rows"][-1] and res["chosen"]["exact"]


def test_exact_row_is_exact_at_every_length_where_the_method_has_such_a_setting():
    from attnpatch.evals.tune import _exact_row
    from attnpatch.patchers.registry import get_method

    assert _exact_row(get_method("anchor_attention"), 100) == {"options": {"theta": float("inf")}, "exact": True}
    fna = _exact_row(get_method("fna"), 257)
    assert fna == {"options": {"min_tokens": 2**31 - 1}, "exact": True}
    ny = _exact_row(get_method("nystromformer"), 257)  # s >= N only: the length is recorded
    assert ny["exact_at_tokens"] == 257 and ny["options"]["s"] >= 257


def _geometry(model):
    from attnpatch.patchers.api import model_geometry

    return model_geometry(model)


def test_tune_causal_bad_targets_and_methods_fail_before_any_work():
    model = tiny_causal_lm("llama")
    with pytest.raises(OptionError, match="target_mean=1.5: must be a recall in \\[0, 1\\]"):
        tune_causal(model, _prompts(1), target_mean=1.5)
    with pytest.raises(OptionError, match="at least one calibration prompt"):
        tune_causal(model, [])
    with pytest.raises(OptionError, match="method 'fna' does not fit a causal LM"):
        tune_causal(model, _prompts(1), "fna")
    with pytest.raises(OptionError, match="has no tuning space"):
        tune_causal(model, _prompts(1), "block_topk")
    with pytest.raises(OptionError, match="unknown option"):
        tune_causal(model, _prompts(1), candidates=[{"thetta": 1.0}])


def test_tune_vision_cosine_is_the_cosine_of_the_chosen_setting(tiny_vit_dir):
    from transformers import Dinov2Model

    from attnpatch.evals.vision.runner import encode

    model = Dinov2Model.from_pretrained(tiny_vit_dir).eval()
    torch.manual_seed(0)
    pixels = torch.randn(6, 3, 70, 70)
    cands = [dict(s=4, sample_layer=0, min_tokens=0), dict(s=8, sample_layer=2, min_tokens=0),
             dict(s=4, sample_layer=0, local_window=1, window_tile=2, window_until=None, min_tokens=0)]
    res = tune_vision(model, pixels, "fna", target_cos=-1.0, candidates=cands, repeats=1, batch_size=4)
    assert [r["meets"] for r in res["rows"]] == [True] * 4 and res["rows"][-1]["options"] == {"min_tokens": 2**31 - 1}
    with torch.no_grad():
        ref = encode(model, pixels)[0]
    for r in res["rows"][:-1]:
        with torch.no_grad(), patched(model, "fna", **r["options"]):
            got = encode(model, pixels)[0]
        cos = torch.nn.functional.cosine_similarity(got.double(), ref.double(), dim=-1)
        assert r["cls_cos"] == pytest.approx(float(cos.mean()), abs=1e-9)
        assert r["cls_cos_min"] == pytest.approx(float(cos.min()), abs=1e-9)
        assert r["cls_cos"] < 1.0  # approximate
    # a target none of them meets: the exact setting is chosen
    best = max(r["cls_cos"] for r in res["rows"][:-1])
    strict = tune_vision(model, pixels, "fna", target_cos=best + (1 - best) / 2, candidates=cands, repeats=1, batch_size=4)
    assert strict["chosen"].get("exact") and [r["meets"] for r in strict["rows"]] == [False, False, False, True]
    bigger = torch.randn(2, 3, 140, 140)
    with torch.no_grad():
        ref_bigger = encode(model, bigger)[0]
    with torch.no_grad(), patched(model, "fna", **strict["chosen"]["options"]):  # the unpatched model, at any size
        assert torch.allclose(encode(model, pixels)[0], ref, atol=1e-5)
        assert torch.allclose(encode(model, bigger)[0], ref_bigger, atol=1e-5)


def test_tune_space_of_the_methods_validates():
    from attnpatch.patchers.contract import ModelGeometry
    from attnpatch.patchers.registry import validate_options

    for name, n in (("anchor_attention", 30), ("fna", 12)):
        m = get_method(name)
        space = m.tune_space(ModelGeometry(num_layers=n))
        assert len(space) >= 3
        for c in space:
            validate_options(m, c)
    fna = get_method("fna").tune_space(ModelGeometry(num_layers=12))
    assert {c["sample_layer"] for c in fna} == {0, 3, 6, 9} and {c["s"] for c in fna} == {32, 64, 128}


def test_select_dtype_auto_follows_the_measured_bfloat16_speed(monkeypatch):
    from attnpatch.attention.anchor import config as anchor_config

    asked = []
    for faster, want in ((True, "bfloat16"), (False, "float32")):
        def measured(device_type, faster=faster):
            asked.append(device_type)
            return faster

        monkeypatch.setattr(anchor_config, "bfloat16_is_faster", measured)  # the global select_dtype_on reads
        assert AnchorConfig(select_dtype="auto").select_dtype_on("cpu") == want
        assert AnchorConfig(select_dtype="auto").select_dtype_on(torch.device("meta")) == want
        # a dtype given is used as it is, never measured
        assert AnchorConfig(select_dtype="bfloat16").select_dtype_on("cpu") == "bfloat16"
        assert AnchorConfig(select_dtype="float32").select_dtype_on("cpu") == "float32"
    assert asked == ["cpu", "meta", "cpu", "meta"]  # measured once per call, by device type
    assert get_method("anchor_attention").presets["fast"].options["select_dtype"] == "auto"


class _FakeClock:
    """``time.perf_counter`` of a timing loop that alternates start and stop readings: each stop reading
    advances the clock by the next of ``durations``."""

    def __init__(self, durations):
        self.durations, self.now, self.readings = list(durations), 0.0, 0

    def perf_counter(self):
        self.readings += 1
        if self.readings % 2 == 0:
            self.now += self.durations.pop(0)
        return self.now


@pytest.mark.parametrize("bf16,fp32,faster", [
    ([9.0, 1.0, 8.0, 8.0], [9.0, 2.0, 2.0, 2.0], True),  # best of calls 2-4: 1 < 2
    ([0.1, 5.0, 3.0, 4.0], [9.0, 2.0, 6.0, 7.0], False),  # 3 > 2: the fast first call (one-off costs) is not counted
    ([9.0, 2.0, 5.0, 5.0], [9.0, 2.0, 3.0, 3.0], False),  # a tie is not faster
])
def test_bfloat16_is_faster_compares_the_best_timed_calls(monkeypatch, bf16, fp32, faster):
    from attnpatch.attention.anchor import config as anchor_config

    clock = _FakeClock(bf16 + fp32)  # bfloat16 is timed first, 4 calls each
    monkeypatch.setattr(anchor_config, "time", clock)  # the module whose `time` the measurement reads
    assert bfloat16_is_faster.__wrapped__("cpu") is faster  # the measurement itself, past the per-process cache
    assert clock.readings == 16 and clock.durations == []


def test_select_dtype_auto_selects_what_its_resolved_dtype_selects():
    from attnpatch.attention.anchor import select_stripes

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 256, 16, generator=g) * 3, torch.randn(1, 2, 256, 16, generator=g) * 3
    kw = dict(theta=2.0, block_size=16, init_block=16, local_window=16, pool_stride=4)
    auto = select_stripes(q, k, AnchorConfig(**kw, select_dtype="auto"), scale=0.25)
    resolved = select_stripes(q, k, AnchorConfig(**kw, select_dtype=AnchorConfig(select_dtype="auto").select_dtype_on("cpu")),
                              scale=0.25)
    assert torch.equal(auto, resolved)


# --------------------------------------------------------------------------- the command line

from test_compare import images_dir, vit_dir  # noqa: E402,F401  (fixtures)
from test_ruler_tasks import _make_tokenizer  # noqa: E402

SMALL_CLI = "block_size=16,init_block=16,local_window=16,min_len=0,dense_last=0,min_recall=0,pool_stride=none,select_dtype=float32"


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune-llama")
    tok = _make_tokenizer(chat=True)
    model = tiny_causal_lm("llama", vocab=len(tok), layers=2)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_tune_cli_causal_writes_a_config_the_evals_load(llm_dir, tmp_path, capsys):
    from attnpatch.cli import main

    cfg, rep = tmp_path / "new" / "folder" / "cfg.json", tmp_path / "tune.json"  # --out in a folder made for it
    rc = main(["tune", "--model", str(llm_dir), "--kind", "causal_lm", "--length", "400", "--calibration", "1", "--holdout", "1",
               "--candidate", f"theta=-1e9,{SMALL_CLI}", "--candidate", f"theta=2,{SMALL_CLI}",
               "--target-recall", "0", "--target-worst", "0", "--repeats", "1", "--out", str(cfg), "--json", str(rep)])
    assert rc == 0
    saved, res = json.loads(cfg.read_text()), json.loads(rep.read_text())
    assert saved["method"] == "anchor_attention" and saved["geometry"]["num_layers"] == 2
    for k, v in res["chosen"]["options"].items():
        assert saved["options"][k] == (list(v) if isinstance(v, (list, tuple)) else v)
    assert saved["tuned_for"]["tokens"] == res["tokens"] and 0.98 * 400 <= res["tokens"] <= 400
    assert len(res["rows"]) == 3 and res["rows"][-1]["exact"]
    assert [c["task"] for c in res["holdout"]["cells"]] == ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"]
    assert all(c["samples"] == 1 for c in res["holdout"]["cells"])
    out = capsys.readouterr().out
    assert "chosen:" in out and f"-o config={cfg}" in out and "held-out (1 sample(s) per task at 400 tokens" in out
    # the config is what -o config= loads
    r2 = tmp_path / "r.json"
    assert main(["eval", "ruler", "--model", str(llm_dir), "--lengths", "400", "--samples", "1", "--no-recall",
                 "-o", f"config={cfg}", "--json", str(r2)]) == 0
    assert json.loads(r2.read_text())["options"]["theta"] == saved["options"]["theta"]


def test_tune_cli_vision_on_an_imagefolder(vit_dir, images_dir, tmp_path, capsys):
    from attnpatch.cli import main

    cfg, rep = tmp_path / "cfg.json", tmp_path / "tune.json"
    rc = main(["tune", "--model", str(vit_dir), "--kind", "vision", "--data", str(images_dir), "--resolution", "56",
               "--calibration", "4", "--candidate", "s=4,sample_layer=0,min_tokens=0", "--candidate", "s=8,sample_layer=1,min_tokens=0",
               "--target-cos", "-1", "--repeats", "1", "--out", str(cfg), "--json", str(rep)])
    assert rc == 0
    res = json.loads(rep.read_text())
    assert res["images"] == 4 and res["resolution"] == 56 and res["tokens"] == 17
    assert res["holdout"]["images"] == 5  # every image not used for calibration
    assert json.loads(cfg.read_text())["method"] == "fna"
    assert "held-out (5 images): k-NN top-1" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--target-recall", "1.5"], "argument --target-recall: 1.5 is not in [0, 1]"),
    (["--kind", "causal_lm", "--data", "x"], "--data: apply to ViTs only; an LLM is tuned on prompts"),
    (["--kind", "causal_lm", "--method", "fna"], "method 'fna' does not fit a causal lm model"),
    (["--kind", "causal_lm", "--method", "block_topk"], "method 'block_topk' has no tuning space"),
    (["--kind", "causal_lm", "--candidate", "thetta=1"], "unknown option(s) thetta"),
    (["--kind", "causal_lm", "--prompts", "/nonexistent/p.txt"], "--prompts /nonexistent/p.txt: no such file or folder"),
    (["--kind", "causal_lm", "--prompts", "BLANK"], "is empty or blank; a calibration prompt needs text"),
    (["--kind", "causal_lm", "--prompts", "TEXT", "--calibration", "3"], "--calibration 3: with --prompts every prompt file"),
    (["--kind", "causal_lm", "--candidate", ""], "--candidate '': empty"),
    (["--kind", "causal_lm", "--candidate", " , "], "--candidate ' , ': empty"),
    (["--kind", "causal_lm", "--candidate", "=3"], "the NAME before '=' is empty"),
    (["--target-recall", "abc"], "argument --target-recall: 'abc' is not a number in [0, 1]"),
    (["--kind", "causal_lm", "--prompts", "BOM"], "is empty or blank; a calibration prompt needs text"),
    (["--kind", "causal_lm", "--prompts", "NUL"], "holds NUL bytes"),
    (["--kind", "causal_lm", "--prompts", "/dev/null"], "--prompts /dev/null: not a regular file or folder"),
    (["--kind", "causal_lm", "--prompts", "TEXT", "--out", "TEXT"], "is a calibration prompt (--prompts)"),
    (["--kind", "causal_lm", "--out", "MODEL/config.json"], "lies inside the input folder"),
    (["--kind", "causal_lm", "--out", ""], "--out '': empty"),
    (["--model", "/missing/dir"], "--model /missing/dir: no such folder"),
    (["--kind", "vision", "--holdout", "1"], "--holdout 1: the held-out k-NN check needs at least 2 images"),
])
def test_tune_cli_bad_input_is_one_line(argv, message, tmp_path, capsys, llm_dir):
    from attnpatch.cli import main

    (tmp_path / "blank.txt").write_text("  \n\t\n")
    (tmp_path / "bom.txt").write_text("\ufeff \n", encoding="utf-8")
    (tmp_path / "nul.txt").write_text("abc\0\0def")
    (tmp_path / "text.txt").write_text("a calibration prompt")
    files = {"BLANK": "blank.txt", "BOM": "bom.txt", "NUL": "nul.txt", "TEXT": "text.txt"}
    argv = [str(tmp_path / files[a]) if a in files else a.replace("MODEL", str(llm_dir)) for a in argv]
    if "--out" in argv:  # the case under test names its own --out
        i = argv.index("--out")
        out = [argv.pop(i), argv.pop(i)]
    else:
        out = ["--out", str(tmp_path / "c.json")]
    if "--model" not in argv and "vision" not in argv:
        argv = ["--model", str(llm_dir), *argv]
    try:
        rc = main(["tune", *argv, *out, "--json", str(tmp_path / "t.json")])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "t.json").exists()
    assert (tmp_path / "text.txt").read_text() == "a calibration prompt"


def test_candidates_that_run_exact_on_the_calibration_input_are_not_timed_and_the_run_says_so():
    model = tiny_causal_lm("llama", layers=2)
    lines = []
    res = tune_causal(model, _prompts(1), "anchor_attention", target_mean=0.0, target_worst=0.0,
                      candidates=[dict(SMALL, theta=-1e9, min_len=10_000), dict(SMALL, theta=2.0, min_len=10_000)],
                      repeats=1, progress=lines.append)
    for row in res["rows"][:-1]:  # 192 tokens < min_len: every layer ran dense, whatever theta says
        assert row["seconds"] is None and row["note"].startswith("every layer ran exact attention") and "dense:short" in row["note"]
    assert res["chosen"]["exact"] and any("every candidate ran exact attention at 192 tokens" in w for w in res["warnings"])


def test_a_preset_candidate_keeps_what_the_preset_sets():
    from attnpatch.evals.tune import _candidates
    from attnpatch.patchers.methods.anchor_attention import PRESETS

    meth = get_method("anchor_attention")
    (fast,) = _candidates(meth, None, [{"preset": "fast"}])
    assert {k: fast[k] for k in PRESETS["fast"].options} == PRESETS["fast"].options and "preset" not in fast
    (mixed,) = _candidates(meth, None, [{"preset": "fast", "theta": 4.0}])
    assert mixed["theta"] == 4.0 and mixed["pool_stride"] == PRESETS["fast"].options["pool_stride"]
    with pytest.raises(OptionError, match="no candidates"):
        _candidates(meth, None, [])


def test_a_config_candidate_keeps_what_the_config_sets(tmp_path):
    from attnpatch.evals.tune import _candidates

    meth = get_method("anchor_attention")
    path = write_config(tmp_path / "c.json", meth, dict(SMALL, theta=3.0, dense_heads=((0, 1),)))
    (cand,) = _candidates(meth, None, [{"config": str(path)}])
    assert cand["theta"] == 3.0 and cand["dense_heads"] == ((0, 1),) and cand["block_size"] == 16 and "config" not in cand


def test_a_candidate_the_model_cannot_run_fails_before_anything_is_timed():
    model = tiny_causal_lm("llama", layers=2)
    lines = []
    with pytest.raises(OptionError, match=r"dense_heads contains \(1, 99\)"):
        tune_causal(model, _prompts(1), "anchor_attention", candidates=[dict(SMALL, dense_heads=((1, 99),))],
                    repeats=1, progress=lines.append)
    assert lines == []  # the unpatched model was not timed


@pytest.mark.parametrize("prompt", [torch.zeros(5, dtype=torch.long), torch.zeros(1, 5), torch.zeros(2, 5, dtype=torch.long)])
def test_tune_causal_refuses_prompts_that_are_not_one_row_of_token_ids(prompt):
    with pytest.raises(OptionError, match=r"prompts\[0\] of shape"):
        tune_causal(tiny_causal_lm("llama"), [prompt], target_mean=0.5)


def test_tune_vision_refuses_an_llm_and_non_square_images():
    with pytest.raises(OptionError, match="needs a vision encoder"):
        tune_vision(tiny_causal_lm("llama"), torch.zeros(1, 3, 28, 28))
    with pytest.raises(OptionError, match="expected square float images"):
        tune_vision(tiny_causal_lm("llama"), torch.zeros(1, 3, 28, 56))
    with pytest.raises(OptionError, match="target_cos='0.9': must be a cosine"):
        tune_vision(tiny_causal_lm("llama"), torch.zeros(1, 3, 28, 28), target_cos="0.9")


def test_timing_warning_when_the_unpatched_times_drift():
    from attnpatch.evals.tune import _timing_warning

    assert _timing_warning([1.0, 1.2]) is None
    assert "1.50x apart" in _timing_warning([1.0, 1.5])


def test_tune_cli_a_length_too_short_for_the_held_out_tasks_fails_before_the_search(llm_dir, tmp_path, capsys):
    from attnpatch.cli import main

    rc = main(["tune", "--model", str(llm_dir), "--kind", "causal_lm", "--length", "100", "--prompts", str(_text(tmp_path)),
               "--candidate", f"theta=2,{SMALL_CLI}", "--repeats", "1", "--out", str(tmp_path / "c.json"),
               "--json", str(tmp_path / "t.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "too small for task" in err and "unpatched:" not in err
    assert not (tmp_path / "c.json").exists() and not (tmp_path / "t.json").exists()


def _text(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a calibration prompt " * 20)
    return f
