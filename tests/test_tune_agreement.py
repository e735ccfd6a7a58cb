"""``attnpatch tune --target knn-agreement=X``: the per-layer families, the bisection, the choice among the family
winners, the split, the written config, and the choice beside a competing process."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from attnpatch import patched
from attnpatch.errors import OptionError
from attnpatch.evals.tune.search import Family, choose, families_of, parse_target, search_agreement, searchable_methods
from attnpatch.evals.tune.targets import knn_agreement, tune_knn_agreement
from conftest import write_image_folder


def test_families_apply_the_knob_from_each_start_layer():
    fams = families_of("tome", layers=4, tokens=1025)
    assert [f.start for f in fams] == [0, 1, 2]
    assert fams[0].options(0.0)["r"] == 128 and fams[0].options(1.0)["r"] == 0  # t = 0 cheapest, t = 1 exact
    assert fams[2].options(0.0)["r"] == (0, 0, 128, 128)
    fna = families_of("fna", layers=12, tokens=1025)
    mid = fna[2].options(0.5)
    assert mid["s"] == (0,) * 6 + (32,) * 6 and mid["sample_layer"] == 6 and mid["min_tokens"] == 0
    # from layer 0 samples at layer 0, not at FNA's default sample_layer (6): the family would equal "from layer 6"
    assert fna[0].options(0.5)["sample_layer"] == 0 and fna[0].shown(0.5)["sample_layer"] == 0
    comp = families_of("tome+fna", layers=4, tokens=1025, given={"s": 64})
    assert comp[1].shown(0.5) == {"s": 64, "min_tokens": 0, "r": (0, 64, 64, 64)}
    assert {"tome", "fna", "tome+fna"} <= set(searchable_methods()) and "anchorformer" not in searchable_methods()
    with pytest.raises(OptionError, match="has no per-layer schedule"):
        families_of("nystromformer", layers=4, tokens=1025)


def _fake(agree_at):
    """Families over a fake knob ``v = round(10 * (1 - t))`` (10 cheapest, 0 exact); agreement ``agree_at(v)``."""
    seen = []

    def measure(settings, deadline=None):
        seen.append(len(settings))
        return [agree_at(o["v"]) for _, o in settings]

    fams = [Family(f"f{d}", d, lambda t, d=d: {"v": round(10 * (1 - t)), "d": d}, lambda t: {"v": round(10 * (1 - t))})
            for d in (0, 1)]
    return fams, measure, seen


def test_bisection_finds_the_cheapest_knob_that_meets_the_target_within_the_bound(monkeypatch):
    from attnpatch.evals.tune import search

    # agreement falls as the knob gets cheaper: v <= 6 meets 0.9
    fams, measure, seen = _fake(lambda v: 1.0 - 0.025 * v)
    monkeypatch.setattr(search, "interleaved_speedup",
                        lambda fn, cand, repeats: {"speedup": 1.5, "spread": [1.4, 1.6], "best": 1.5})
    monkeypatch.setattr(search, "patched", lambda *a, **k: contextlib.nullcontext())
    res = search_agreement(None, "x", measure, lambda: None, target=0.9, families=fams, max_candidates=12)
    assert res["rounds"] == 6 and len(res["measured"]) == 12 and sum(seen) <= 12
    assert [w["shown"]["v"] for w in res["winners"]] == [4, 4]  # 1 - 0.025 * 4 = 0.9
    assert all(r["meets"] == (r["agreement"] >= 0.9) for r in res["measured"])
    # nothing meets: no winner, the exact model is chosen
    fams, measure, _ = _fake(lambda v: 0.5)
    res = search_agreement(None, "x", measure, lambda: None, target=0.9, families=fams, max_candidates=6)
    assert res["winners"] == [] and res["chosen"]["exact"] is True


def test_max_minutes_bounds_the_search_setting_by_setting(monkeypatch):
    """The dense pass and each setting take 5 (fake) minutes in ten batches: with a 25-minute bound the dense pass,
    round 1 and round 2 (two families each) end at 25 minutes, and round 3's first setting is not started.  A setting
    longer than any before that runs past the bound is dropped at its next batch.  Each family keeps its best so far,
    and the result says where the search stopped and why."""
    from attnpatch.evals.tune import search

    clock = [0.0]
    monkeypatch.setattr(search.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(search, "interleaved_speedup",
                        lambda fn, cand, repeats: {"speedup": 1.5, "spread": [1.4, 1.6], "best": 1.5})
    monkeypatch.setattr(search, "patched", lambda *a, **k: contextlib.nullcontext())

    def timed(measure, minutes):
        def run(settings, deadline=None):
            for _, o in settings or [(None, None)]:  # the dense pass: one pass of 5 minutes
                for _ in range(10):
                    search.check_deadline(deadline)
                    clock[0] += 6.0 * (5 if o is None else minutes(o["v"]))
            return measure(settings, deadline)
        return run

    fams, measure, seen = _fake(lambda v: 1.0 - 0.025 * v)
    res = search_agreement(None, "x", timed(measure, lambda v: 5), lambda: None, target=0.9, families=fams,
                           max_candidates=12, max_minutes=25)
    assert res["rounds"] == 6 and seen == [0, 1, 1, 1, 1] and len(res["measured"]) == 4 and clock[0] == 1500.0
    assert res["stopped"] == ("in round 3 of 6, f0 v=4 not started: 25.0 min used, a setting takes up to 5.0 min, the "
                              "bound is 25.0 min")
    assert [w["shown"]["v"] for w in res["winners"]] == [2, 2]  # round 2's, which met the target (0.95)
    # v = 2 takes 30 minutes: started at 15 minutes, it is past the bound before its fifth batch and is dropped
    clock[0] = 0.0
    fams, measure, seen = _fake(lambda v: 1.0 - 0.025 * v)
    res = search_agreement(None, "x", timed(measure, lambda v: 30 if v <= 2 else 5), lambda: None, target=0.9,
                           families=fams, max_candidates=12, max_minutes=25)
    assert seen == [0, 1, 1] and len(res["measured"]) == 2 and clock[0] == 1620.0
    assert res["stopped"] == "in round 2 of 6, f0 v=2 dropped: the bound of 25.0 min passed while it was measured"
    assert res["winners"] == [] and res["chosen"]["exact"] is True  # round 1's v = 5 (0.875) missed the target
    unbounded = search_agreement(None, "x", measure, lambda: None, target=0.9, families=fams, max_candidates=12)
    assert unbounded["stopped"] is None and len(unbounded["measured"]) == 12
    with pytest.raises(OptionError, match="max_minutes=0"):
        search_agreement(None, "x", measure, lambda: None, target=0.9, families=fams, max_minutes=0)


def test_the_choice_among_winners():
    a = {"name": "a", "speedup": 1.50, "spread": [1.45, 1.55], "best": 1.52, "agreement": 0.991, "flops": 900}
    b = {"name": "b", "speedup": 1.48, "spread": [1.40, 1.52], "best": 1.49, "agreement": 0.998, "flops": 800}  # tied with a
    c = {"name": "c", "speedup": 1.20, "spread": [1.15, 1.25], "best": 1.21, "agreement": 1.0, "flops": 500}
    assert choose([a, b, c])["name"] == "b"  # a and b are not told apart: the fewer FLOPs; c is slower, FLOPs aside
    assert choose([a, c])["name"] == "a"
    assert choose([dict(a, flops=800), b])["name"] == "b"  # equal FLOPs: the higher agreement
    slow = {"name": "d", "speedup": 1.02, "spread": [0.97, 1.06], "best": 0.99, "agreement": 1.0, "flops": 1}
    assert choose([slow])["exact"] is True and choose([])["exact"] is True  # not faster at best, FLOPs aside
    noisy = {"name": "e", "speedup": 1.05, "spread": [0.9, 1.3], "best": 1.4, "agreement": 1.0, "flops": 950}
    assert choose([noisy])["name"] == "e"
    # a busy machine widens every range: the FLOP count an idle run also sees decides, not the noisy best times
    busy = [dict(w, spread=[0.8, 2.0]) for w in (dict(a, best=1.9), b, dict(c, best=1.3))]
    assert choose(busy)["name"] == "c"


def test_the_chosen_line_says_why_the_unpatched_model_was_chosen():
    from attnpatch.evals.tune.search import agreement_line

    none = {"chosen": {"exact": True}, "held_out_result": None, "winners": []}
    assert agreement_line(none, "knn-agreement") == "chosen: exact (unpatched): no setting met the target"
    slow = dict(none, winners=[{"speedup": 0.9, "spread": [0.85, 0.95], "best": 0.9, "agreement": 1.0}])
    assert agreement_line(slow, "knn-agreement").endswith("no setting met the target faster than the unpatched model "
                                                          "on this machine")


def test_forward_flops_counts_the_patched_forward():
    """ToMe's fewer tokens and FNA's landmarks both count fewer FLOPs than dense, whose attention runs in PyTorch's
    fused CPU kernel (counted as its two products: FlopCounterMode alone counts it as 0 on a CPU)."""
    from attnpatch.evals.tune.search import forward_flops
    from tiny_models import tiny_dinov2

    q = torch.randn(2, 3, 100, 16)
    assert forward_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q)) == 2 * (2 * 2 * 3 * 100 * 100 * 16)
    model = tiny_dinov2(image_size=224)
    x = torch.randn(1, 3, 224, 224)
    dense = forward_flops(lambda: model(pixel_values=x))
    with patched(model, "dense"):
        assert forward_flops(lambda: model(pixel_values=x)) == dense
    with patched(model, "tome", r=16):
        assert 0 < forward_flops(lambda: model(pixel_values=x)) < dense
    with patched(model, "fna", s=16, min_tokens=0, sample_layer=0):
        assert 0 < forward_flops(lambda: model(pixel_values=x)) < dense

    def broken():
        raise RuntimeError("cannot trace")

    assert forward_flops(broken) is None
    a = {"name": "a", "speedup": 1.5, "spread": [1.4, 1.6], "best": 1.5, "agreement": 0.99, "flops": None}
    b = dict(a, name="b", agreement=0.995)
    assert choose([a, b])["name"] == "b"  # no counts: the higher agreement
    assert choose([dict(a, agreement=1.0), dict(b, flops=10)])["name"] == "a"  # one uncounted: agreement, not the count
    assert choose([dict(a, flops=5), dict(b, flops=10)])["name"] == "a"
    assert choose([dict(a, flops=0), dict(b, flops=10)])["name"] == "a"


def test_targets_are_parsed_with_one_line_errors():
    assert parse_target("knn-agreement=0.99") == ("knn-agreement", 0.99)
    for bad, words in (("knn=0.9", "expected one of knn-agreement=X"), ("knn-agreement=x", "is not a number"),
                       ("knn-agreement=1.5", "an agreement in [0, 1]")):
        with pytest.raises(OptionError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_target(bad)


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    from attnpatch.checkpoints import dinov2_image_processor, load_vision_model
    from attnpatch.evals.vision.images import load_image_set
    from attnpatch.evals.vision.preprocess import make_preprocess
    from tiny_models import tiny_dinov2

    d = tmp_path_factory.mktemp("agree-dinov2")
    tiny_dinov2(num_hidden_layers=4).save_pretrained(d)
    dinov2_image_processor().save_pretrained(d)
    data = write_image_folder(tmp_path_factory.mktemp("agree-imgs"), 16)
    model, processor = load_vision_model(str(d))
    return d, data, model, load_image_set(str(data)), make_preprocess(processor, 70)


def test_the_agreement_of_the_chosen_setting_is_what_the_calibration_split_measures_again(vit):
    _, _, model, images, pre = vit
    cal, hold = images.subset(range(8)), images.subset(range(8, 16))
    assert list(cal.labels) == list(images.labels[:8]) and len(hold) == 8
    res = tune_knn_agreement(model, cal, hold, pre, "tome", target=0.75, batch_size=4, knn_k=3, max_candidates=6, repeats=3)
    assert len(res["measured"]) <= 6 and res["calibration"] == 8 and res["held_out"] == 8
    from attnpatch.evals.vision.runner import run_feature_eval

    measure = knn_agreement(model, cal, pre, batch_size=4, knn_k=3)
    for w in res["winners"]:
        assert w["agreement"] >= 0.75
        assert measure([("tome", w["options"])]) == [pytest.approx(w["agreement"])]
        # what eval knn reports as k-NN agreement
        ev = run_feature_eval(model, cal, pre, settings=[("tome", w["options"])], tasks=("fidelity", "knn"), batch_size=4,
                              layer_error_images=0, knn_k=3)
        assert ev["runs"][0]["knn_agreement"] == pytest.approx(w["agreement"])
    if not res["chosen"].get("exact"):
        assert 0.0 <= res["held_out_result"]["knn_agreement"] <= 1.0
    with pytest.raises(OptionError, match="at least 2 in each"):
        tune_knn_agreement(model, cal, images.subset([9]), pre, "tome")


def test_tune_cli_target_writes_a_config_that_loads(vit, tmp_path, capsys):
    from attnpatch.cli import main

    model_dir, data, model, _, _ = vit
    cfg, rep = tmp_path / "cfg.json", tmp_path / "rep.json"
    rc = main(["tune", "--model", str(model_dir), "--kind", "vision", "--data", str(data), "--resolution", "70",
               "--method", "tome", "--target", "knn-agreement=0.5", "--max-candidates", "3", "--batch-size", "4",
               "--out", str(cfg), "--json", str(rep)])
    assert rc == 0
    res = json.loads(rep.read_text())
    assert res["calibration"] == 8 and res["held_out"] == 8 and res["target"] == 0.5 and len(res["measured"]) <= 3
    saved = json.loads(cfg.read_text())
    assert saved["method"] == "tome" and saved["tuned_for"]["target"] == {"knn-agreement": 0.5}
    with patched(model, "tome", config=str(cfg)), torch.no_grad():
        model(pixel_values=torch.randn(1, 3, 70, 70))
    out = capsys.readouterr().out
    assert "chosen:" in out and f"wrote {cfg}" in out


@pytest.mark.parametrize("argv, words", [
    (["--target", "knn=1"], "expected one of knn-agreement=X"),
    (["--method", "nystromformer", "--target", "knn-agreement=0.9"], "has no per-layer knob to search"),
    (["--method", "tome", "--target", "knn-agreement=0.9", "--candidate", "r=4"], "--candidate: the agreement search builds"),
    (["--method", "tome", "--target", "knn-agreement=0.9", "-o", "rr=4"], "unknown option(s) rr"),
])
def test_tune_cli_target_bad_input_is_one_line(vit, argv, words, capsys):
    from attnpatch.cli import main

    model_dir, data, *_ = vit
    rc = main(["tune", "--model", str(model_dir), "--kind", "vision", "--data", str(data), *argv])
    err = capsys.readouterr().err
    assert rc != 0 and words in err and len(err.strip().splitlines()) == 1


def _step(res) -> int:
    """The chosen setting's place on the family knob: the start layer's index among the families, -1 exact."""
    ch = res["chosen"]
    return -1 if ch.get("exact") else sorted({w["start"] for w in res["winners"]}).index(ch["start"])


def test_tune_cli_max_minutes_must_be_positive(vit, capsys):
    from attnpatch.cli import main

    model_dir, data, *_ = vit
    with pytest.raises(SystemExit):
        main(["tune", "--model", str(model_dir), "--kind", "vision", "--data", str(data), "--method", "tome",
              "--target", "knn-agreement=0.9", "--max-minutes", "0"])
    assert "--max-minutes: 0: must be a positive finite number" in capsys.readouterr().err


@pytest.mark.slow
def test_a_busy_machine_keeps_every_knob_and_chooses_within_a_step_or_the_unpatched_model(tmp_path):
    """The agreement search beside a competing PyTorch process (as ``bench --background-load`` starts) finds the
    knob an idle run finds in every family (the knob comes from predictions, not from time), and chooses the idle
    run's setting or the next family's (winners the busy machine does not tell apart go by their FLOP count), or
    the unpatched model where that machine timed no winner faster than it."""
    from attnpatch.evals.bench import background_load
    from attnpatch.evals.vision.images import load_image_set
    from attnpatch.evals.vision.preprocess import make_preprocess
    from attnpatch.checkpoints import dinov2_image_processor
    from tiny_models import tiny_dinov2

    model = tiny_dinov2(hidden_size=192, num_hidden_layers=6, num_attention_heads=6, intermediate_size=768, image_size=224)
    images = load_image_set(str(write_image_folder(tmp_path / "imgs", 24, shape=(224, 224, 3))))
    pre = make_preprocess(dinov2_image_processor(), 224)
    cal, hold = images.subset(range(0, 24, 2)), images.subset(range(1, 24, 2))

    def run():
        return tune_knn_agreement(model, cal, hold, pre, "tome", target=0.9, batch_size=6, knn_k=3, max_candidates=9, repeats=9)

    idle = run()
    with background_load(300) as load:
        busy = run()
    assert load["alive_at_end"]
    assert [w["shown"] for w in busy["winners"]] == [w["shown"] for w in idle["winners"]]
    assert [m["agreement"] for m in busy["measured"]] == [m["agreement"] for m in idle["measured"]]
    assert [w["flops"] for w in busy["winners"]] == [w["flops"] for w in idle["winners"]]
    if busy["chosen"].get("exact") and not idle["chosen"].get("exact"):
        # the one way a busy run leaves the idle choice by more than a step: that machine timed no winner faster
        assert all(w["best"] <= 1.0 for w in busy["winners"]), busy["winners"]
    else:
        assert abs(_step(busy) - _step(idle)) <= 1, (idle["winners"], busy["winners"])


def test_tune_cli_segmentation_target(vit, tmp_path, capsys):
    from attnpatch.cli import main
    from test_segmentation import write_voc

    model_dir = vit[0]
    voc = write_voc(tmp_path / "voc", n_train=4, n_val=4)
    cfg, rep = tmp_path / "cfg.json", tmp_path / "rep.json"
    rc = main(["tune", "--model", str(model_dir), "--kind", "vision", "--data", str(voc), "--resolution", "56",
               "--method", "fna", "--target", "seg-agreement=0.5", "--max-candidates", "3", "--batch-size", "2",
               "--out", str(cfg), "--json", str(rep)])
    assert rc == 0
    res = json.loads(rep.read_text())
    assert res["calibration"] == 2 and res["held_out"] == 2 and res["target_key"] == "seg-agreement"
    assert json.loads(cfg.read_text())["tuned_for"]["target"] == {"seg-agreement": 0.5}
    assert "chosen:" in capsys.readouterr().out


@pytest.mark.slow
def test_tune_on_zeroshot_agreement_of_a_random_clip(tmp_path):
    """A random-init ViT-B-32 (no CLIP weights exist offline): the search runs on its image tower, each family's
    winner agrees with dense as the zero-shot eval measures it again."""
    from attnpatch.clip_models import load_clip
    from attnpatch.evals.tune.targets import tune_zeroshot_agreement, zeroshot_agreement
    from attnpatch.evals.vision.images import load_image_set
    from test_clip_benchmark import NAMES, TEMPLATES, _folder

    bundle = load_clip("ViT-B-32:random", resolution=128, log=lambda m: None)
    images = load_image_set(str(_folder(tmp_path / "cls", 12, captions=False)))
    cal, hold = images.subset(range(0, 12, 2)), images.subset(range(1, 12, 2))
    res = tune_zeroshot_agreement(bundle, cal, hold, NAMES[:6], TEMPLATES, "tome", target=0.5, batch_size=6,
                                  max_candidates=3, repeats=3)
    assert res["tokens"] == 17 and res["calibration"] == 6 and len(res["measured"]) <= 3  # 128 px at patch 32: 16 + CLS
    measure = zeroshot_agreement(bundle, cal, NAMES[:6], TEMPLATES, batch_size=6)
    for w in res["winners"]:
        assert measure([("tome", w["options"])]) == [pytest.approx(w["agreement"])] and w["agreement"] >= 0.5
    # the measure is the eval's agreement, the text tower encoded once
    from attnpatch.evals.clip import run_zeroshot_eval

    settings = [("tome", {"r": 4}), ("tome", {"r": 8})]
    texts = []
    encode_text = bundle.encode_text
    bundle.encode_text = lambda *a, **k: texts.append(1) or encode_text(*a, **k)
    try:
        got = measure(settings)
    finally:
        bundle.encode_text = encode_text
    assert texts == []  # kept from the first call
    ev = run_zeroshot_eval(bundle, cal, NAMES[:6], TEMPLATES, settings=settings, batch_size=6, ks=(1,), log=lambda m: None)
    assert got == [r["agreement"] for r in ev["runs"]]


def test_tune_cli_ruler_agreement_on_a_causal_lm(tmp_path, capsys):
    """A tiny random Llama: the causal target searches the method's knob (one family, every layer) on RULER samples
    from seed 1000, reports held-out samples from seed 0, and writes a config."""
    from attnpatch.cli import main
    from test_tune import SMALL_CLI, _make_tokenizer, tiny_causal_lm

    d = tmp_path / "llama"
    tok = _make_tokenizer(chat=True)
    tiny_causal_lm("llama", vocab=len(tok), layers=2).save_pretrained(d)
    tok.save_pretrained(d)
    cfg, rep = tmp_path / "cfg.json", tmp_path / "rep.json"
    fixed = [x for kv in SMALL_CLI.split(",") for x in ("-o", kv)]
    rc = main(["tune", "--model", str(d), "--kind", "causal_lm", "--length", "400", "--calibration", "1", "--holdout", "1",
               "--method", "anchor_attention", "--target", "ruler-agreement=1", "--max-candidates", "2", *fixed,
               "--out", str(cfg), "--json", str(rep)])
    assert rc == 0
    res = json.loads(rep.read_text())
    assert res["calibration"] == 4 and res["held_out"] == 4 and len(res["measured"]) <= 2
    assert [m["family"] for m in res["measured"]] == ["theta from layer 0"] * len(res["measured"])
    assert json.loads(cfg.read_text())["tuned_for"]["target"] == {"ruler-agreement": 1.0}
    assert "chosen:" in capsys.readouterr().out
    rc = main(["tune", "--model", str(d), "--kind", "causal_lm", "--target", "knn-agreement=0.9"])
    assert rc != 0 and "fits a ViT; this model is a causal lm" in capsys.readouterr().err


def test_ruler_agreement_is_what_eval_ruler_scores_and_generates_dense_once(monkeypatch):
    """The RULER target's measure: the share of samples whose score under a setting equals dense's, as
    ``run_ruler_settings`` scores the same prompts; dense generates at the first call only."""
    import attnpatch.evals.ruler.runner as runner
    from attnpatch.evals.ruler import run_ruler_settings
    from attnpatch.evals.tune.targets import ruler_agreement
    from test_tune import SMALL, _make_tokenizer, tiny_causal_lm

    tok = _make_tokenizer(chat=True)
    model = tiny_causal_lm("llama", vocab=len(tok), layers=2).eval()
    calls = []
    real = runner.generate_greedy
    monkeypatch.setattr(runner, "generate_greedy", lambda *a, **k: calls.append(1) or real(*a, **k))
    tasks = ("niah_single", "niah_multikey")
    settings = [("anchor_attention", dict(SMALL, theta=2.0)), ("anchor_attention", dict(SMALL, theta=8.0))]
    measure = ruler_agreement(model, tok, tasks=tasks, length=400, samples=2, seed=1000)
    got = measure(settings)
    assert len(calls) == 4 * 3  # 4 samples: dense, then each setting
    assert measure(settings[:1]) == got[:1] and len(calls) == 4 * 4  # the setting alone
    ev = run_ruler_settings(model, tok, settings=settings, tasks=list(tasks), lengths=[400], num_samples=2, seed=1000,
                            recall=False)
    want = []
    for run in ev["runs"]:
        rows = [r for c in run["cells"] for r in c["samples"]]
        assert len(rows) == 4
        want.append(sum(r["patched_score"] == r["dense_score"] for r in rows) / 4)
    assert got == want


@pytest.mark.parametrize("argv, words", [
    (["--method", "tome+fna", "--target", "knn-agreement=0.9", "-o", "r=2"], "r=2: the search sets r, sample_layer itself"),
    (["--method", "fna", "--target", "knn-agreement=0.9", "-o", "sample_layer=3"], "sample_layer=3: the search sets"),
    (["--method", "tome", "--target", "knn-agreement=0.9", "--target-cos", "0.9"], "--target-cos: not with --target"),
    (["--method", "tome", "--target", "knn-agreement=0.9", "--target", "knn-agreement=0.8"], "takes one setting"),
    (["--method", "tome", "--target", "seg-agreement=0.9"], "reads a VOC or ADE20k segmentation folder"),
])
def test_tune_cli_target_refuses_conflicting_input(vit, argv, words, capsys):
    from attnpatch.cli import main

    model_dir, data, *_ = vit
    try:
        rc = main(["tune", "--model", str(model_dir), "--kind", "vision", "--data", str(data), *argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc != 0 and words in err, err


def test_families_keep_given_options_typed():
    fams = families_of("tome+fna", layers=4, tokens=1025, given={"s": "8", "min_tokens": "0"})
    assert fams[0].shown(0.5) == {"s": 8, "min_tokens": 0, "r": 64}
