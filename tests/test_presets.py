"""Presets (named option sets of a method) and AnchorAttention's ``min_len="auto"`` (the device's break-even length)."""

import json
import subprocess
import sys

import pytest
import torch

import attnpatch
from attnpatch.attention.anchor import AnchorConfig, anchor_attention, anchor_attention_reference
from attnpatch.attention.anchor import config as anchor_config
from attnpatch.errors import OptionError
from attnpatch.patchers.contract import Method, Preset
from attnpatch.patchers.registry import METHODS, get_method, register_method, validate_options
from conftest import tiny_causal_lm


#: What each registered preset changes from its method's defaults, written out by hand from the presets' descriptions
#: (an option a preset lists at its default value is not a change).  A new preset needs its line here.
PRESET_CHANGES = {
    ("anchor_attention", "accurate"): {"pool_stride": 2, "min_len": 512},
    ("anchor_attention", "fast"): {"theta": 8.0, "dense_last": 64, "min_recall": 0.75, "min_len": "auto-fast",
                                   "select_dtype": "auto"},
    ("anchor_attention", "paper"): {"pool_stride": None, "dense_last": 0, "min_recall": 0.0, "min_len": 512},
    ("fna", "accurate"): {},  # "the defaults", by name
    ("fna", "fast"): {"sample_layer": 0, "local_window": 1, "window_until": "auto", "min_tokens": 2048},
    ("fna", "every-layer"): {"sample_layer": 0, "local_window": 1, "min_tokens": 2048},
}
#: Per method: an option and a value that neither a preset nor the defaults have, given beside each preset.
BESIDE = {"anchor_attention": ("theta", 5.0), "fna": ("s", 24)}


def test_every_preset_changes_what_it_says_and_given_options_win():
    assert set(PRESET_CHANGES) == {(m.name, p) for m in METHODS.values() for p in m.presets}
    for (mname, pname), changes in PRESET_CHANGES.items():
        m = get_method(mname)
        defaults, full = validate_options(m, {}), validate_options(m, {"preset": pname})
        assert {k: v for k, v in full.items() if v != defaults[k]} == changes, (mname, pname)
        assert set(changes) <= set(m.presets[pname].options) and "preset" not in full
        # an option given beside the preset wins over the preset's value: the default given back, for each change
        for k in changes:
            assert validate_options(m, {"preset": pname, k: defaults[k]}) == {**full, k: defaults[k]}, (mname, pname, k)
        k, v = BESIDE[mname]
        assert full[k] != v and validate_options(m, {"preset": pname, k: v}) == {**full, k: v}


@pytest.mark.parametrize("mname,pname", sorted(PRESET_CHANGES))
def test_patching_with_a_preset_runs_the_presets_values(mname, pname):
    from attnpatch.patchers.api import handle_of
    from tiny_models import tiny_dinov2

    m = get_method(mname)
    model = tiny_causal_lm("llama") if mname == "anchor_attention" else tiny_dinov2()
    defaults = validate_options(m, {})
    want = {**defaults, **PRESET_CHANGES[(mname, pname)]}
    with attnpatch.patched(model, mname, preset=pname):
        assert attnpatch.patch_info(model)["options"] == want
        config = handle_of(model).config  # the config the method's forward reads
        assert set(PRESET_CHANGES[(mname, pname)]) <= set(vars(config))  # every change is a field of it
        for k, v in want.items():
            assert getattr(config, k, v) == v, (mname, pname, k)


def test_anchor_presets_are_the_documented_settings():
    m = get_method("anchor_attention")
    assert set(m.presets) >= {"accurate", "fast", "paper"}
    fast = validate_options(m, {"preset": "fast"})
    assert (fast["theta"], fast["pool_stride"], fast["dense_last"], fast["min_recall"], fast["select_dtype"], fast["min_len"]) == (
        8.0, 8, 64, 0.75, "auto", "auto-fast")
    accurate = validate_options(m, {"preset": "accurate"})
    assert (accurate["theta"], accurate["pool_stride"], accurate["min_len"], accurate["select_dtype"]) == (12.0, 2, 512, "float32")
    defaults = validate_options(m, {})
    assert (defaults["theta"], defaults["pool_stride"], defaults["dense_last"], defaults["min_recall"], defaults["min_len"],
            defaults["select_dtype"]) == (12.0, 8, 256, 0.9, "auto", "float32")
    paper = validate_options(m, {"preset": "paper"})
    assert (paper["pool_stride"], paper["dense_last"], paper["min_recall"]) == (None, 0, 0.0)


def test_bad_presets_are_refused_with_the_allowed_names():
    with pytest.raises(OptionError, match=r"preset='quick' for method 'anchor_attention': allowed: accurate, fast, paper"):
        validate_options(get_method("anchor_attention"), {"preset": "quick"})
    with pytest.raises(OptionError, match="method 'dense' has no presets"):
        validate_options(get_method("dense"), {"preset": "fast"})
    with pytest.raises(OptionError, match=r"allowed: .*, preset, config$"):
        validate_options(get_method("anchor_attention"), {"presets": "fast"})
    llama = tiny_causal_lm("llama")
    with pytest.raises(OptionError, match="preset='quick'"):
        attnpatch.patch(llama, "anchor_attention", preset="quick")
    assert not attnpatch.is_patched(llama)


def test_a_preset_with_a_bad_value_cannot_register():
    base = get_method("anchor_attention")
    bad = Method(**{**base.__dict__, "name": "anchor_bad_preset", "presets": {"x": Preset({"theta": "much"}, "bad")}})
    with pytest.raises(ValueError, match=r"method 'anchor_bad_preset', preset 'x': option theta='much'"):
        register_method(bad)
    assert "anchor_bad_preset" not in METHODS


def test_min_len_auto_resolves_per_device_type():
    cfg = AnchorConfig(min_len="auto")
    assert cfg.min_len_on("cpu") == anchor_config.BREAK_EVEN["cpu"]
    assert cfg.min_len_on(torch.device("meta")) == sys.maxsize  # no measured break-even: every prompt dense
    assert AnchorConfig(min_len=300).min_len_on("meta") == 300
    with pytest.raises(OptionError, match="min_len='soon'"):
        AnchorConfig(min_len="soon")


def test_min_len_auto_fast_is_the_fast_settings_break_even_length():
    assert anchor_config.FAST_BREAK_EVEN["cpu"] < anchor_config.BREAK_EVEN["cpu"]  # a speed setting pays earlier
    cfg = AnchorConfig(min_len="auto-fast")
    assert cfg.min_len_on("cpu") == anchor_config.FAST_BREAK_EVEN["cpu"]
    assert cfg.min_len_on("meta") == sys.maxsize
    m = get_method("anchor_attention")
    assert m.make_config(validate_options(m, {"preset": "fast"})).min_len_on("cpu") == 3072
    assert validate_options(m, {"min_len": " Auto-Fast "})["min_len"] == "auto-fast"  # CLI text
    with pytest.raises(OptionError, match=r"min_len='fast': expected an integer or one of 'auto', 'auto-fast'"):
        AnchorConfig(min_len="fast")
    with pytest.raises(OptionError, match=r"min_len=-1: must be 'auto', 'auto-fast' or an integer >= 0"):
        AnchorConfig(min_len=-1)


def _modes(model, ids):
    with torch.no_grad(), attnpatch.record_stats(model) as rec:
        out = model(ids).logits
    return out, {r.mode for r in rec.forwards[0].values()}


def test_min_len_auto_runs_the_models_own_attention_below_the_break_even_length(monkeypatch):
    llama = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = llama(ids).logits
    small = dict(theta=-1.0, block_size=16, init_block=16, local_window=16, dense_last=0, min_recall=0.0)
    with attnpatch.patched(llama, "anchor_attention", min_len="auto", **small):
        out, modes = _modes(llama, ids)
    assert modes == {"dense:short"}  # 96 tokens < the CPU break-even length
    assert torch.equal(out, ref)
    # a break-even below the prompt's length: the same options run sparse, and agree with the float64 reference
    monkeypatch.setitem(anchor_config.BREAK_EVEN, "cpu", 64)
    with attnpatch.patched(llama, "anchor_attention", min_len="auto", **small):
        out, modes = _modes(llama, ids)
    assert modes == {"sparse"}
    assert not torch.allclose(out, ref, atol=1e-3)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 96, 16, generator=g) for _ in range(3))
    cfg = AnchorConfig(min_len="auto", **small)
    got, _ = anchor_attention(q, k, v, cfg, scale=0.25)
    want = anchor_attention_reference(q, k, v, cfg, scale=0.25)
    want = want[0]
    torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_cli_lists_presets_and_refuses_a_bad_one():
    exe = [sys.executable, "-m", "attnpatch"]
    out = subprocess.run(exe + ["methods", "--json"], capture_output=True, text=True, check=True).stdout
    anchor = next(m for m in json.loads(out) if m["name"] == "anchor_attention")
    assert anchor["presets"]["fast"]["options"]["min_len"] == "auto-fast"
    r = subprocess.run(exe + ["bench", "attention", "--method", "anchor_attention:preset=quick", "--mode", "causal", "--lengths", "64"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "preset='quick' for method 'anchor_attention': allowed: accurate, fast, paper" in r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------- saved configs: patch(model, method, config=PATH)


def test_a_saved_config_patches_as_its_options_do(tmp_path):
    from attnpatch import write_config

    llama = tiny_causal_lm("llama")
    m = get_method("anchor_attention")
    opts = dict(theta=2.0, block_size=16, init_block=16, local_window=16, min_len=32, dense_last=0, min_recall=0.0,
                dense_layers=(1,), dense_heads=((0, 1),), pool_stride=None)
    path = write_config(tmp_path / "tuned.json", "anchor_attention", opts, attnpatch.model_geometry(llama),
                        measured={"recall_mean": 0.99})
    assert not attnpatch.is_patched(llama)
    saved = json.loads(path.read_text())
    assert saved["geometry"] == {"num_layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16}
    assert saved["measured"] == {"recall_mean": 0.99}
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), attnpatch.patched(llama, "anchor_attention", **opts):
        want = llama(ids).logits
    with torch.no_grad(), attnpatch.patched(llama, "anchor_attention", config=str(path)):
        assert attnpatch.patch_info(llama)["options"] == {**validate_options(m, opts), "config": str(path)}
        got = llama(ids).logits
    assert torch.equal(got, want)
    # an option given beside the config wins; the CLI form loads the same file
    assert validate_options(m, {"config": str(path), "theta": 5})["theta"] == 5.0
    assert validate_options(m, {"config": str(path), "theta": "5"})["dense_heads"] == ((0, 1),)


def test_patch_reads_a_config_file_once(tmp_path, monkeypatch):
    """``patch(config=PATH)`` reads the file once, for its options and its recorded geometry alike."""
    from pathlib import Path

    from attnpatch import write_config

    llama = tiny_causal_lm("llama")
    path = write_config(tmp_path / "once.json", "anchor_attention", {"dense_layers": (1,)}, attnpatch.model_geometry(llama))
    reads = []
    real = Path.read_text

    def counting(self, *a, **k):
        if Path(self) == path:
            reads.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", counting)
    with attnpatch.patched(llama, "anchor_attention", config=str(path)):
        pass
    assert len(reads) == 1
    # still checked against the model: a file recording another geometry is refused, read once too
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"method": "anchor_attention", "options": {}, "geometry": {"num_layers": 30}}))
    reads.clear()
    path = big
    with pytest.raises(OptionError, match="made for another model"):
        attnpatch.patch(llama, "anchor_attention", config=str(big))
    assert len(reads) == 1 and not attnpatch.is_patched(llama)


def test_bad_configs_are_refused_in_one_line(tmp_path):
    m = get_method("anchor_attention")
    with pytest.raises(OptionError, match=r"config='/nonexistent/x.json': no such file"):
        validate_options(m, {"config": "/nonexistent/x.json"})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(OptionError, match="not a readable JSON config"):
        validate_options(m, {"config": str(bad)})
    bad.write_text(json.dumps({"options": {}}))
    with pytest.raises(OptionError, match='expected a JSON object with "method"'):
        validate_options(m, {"config": str(bad)})
    other = tmp_path / "fna.json"
    other.write_text(json.dumps({"method": "fna", "options": {"s": 32}}))
    with pytest.raises(OptionError, match="is a config for method 'fna', not 'anchor_attention'"):
        validate_options(m, {"config": str(other)})
    wrong_value = tmp_path / "wrong.json"
    wrong_value.write_text(json.dumps({"method": "anchor_attention", "options": {"theta": "high"}}))
    with pytest.raises(OptionError, match="theta='high'"):
        validate_options(m, {"config": str(wrong_value)})
    # made for a bigger model: refused at patch() with both geometries, and the model stays unpatched
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"method": "anchor_attention", "options": {"dense_layers": [20]},
                               "geometry": {"num_layers": 30, "heads": 9}}))
    llama = tiny_causal_lm("llama")
    with pytest.raises(OptionError, match=r"made for another model: num_layers 30 \(model: 2\), heads 9 \(model: 4\)"):
        attnpatch.patch(llama, "anchor_attention", config=str(big))
    assert not attnpatch.is_patched(llama)


def test_configs_carry_their_name_into_errors_and_evals(tmp_path):
    from attnpatch import write_config

    m = get_method("anchor_attention")
    llama = tiny_causal_lm("llama")
    path = str(write_config(tmp_path / "c.json", m, {"theta": 3.0}, attnpatch.model_geometry(llama)))
    # the expanded options keep the path, so a patch made from them (as the evals do) still checks the geometry
    full = validate_options(m, {"config": path})
    assert full["config"] == path and full["theta"] == 3.0
    assert validate_options(m, full) == full
    geo = json.loads(open(path).read())
    geo["geometry"]["heads"] = 8
    other = tmp_path / "other.json"
    other.write_text(json.dumps(geo))
    with pytest.raises(OptionError, match=r"heads 8 \(model: 4\)"):
        attnpatch.patch(llama, "anchor_attention", **validate_options(m, {"config": str(other)}))
    assert not attnpatch.is_patched(llama)
    # errors from inside a config name the file
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"method": "anchor_attention", "options": {"dense_layers": [5]}}))
    with pytest.raises(OptionError, match=r"config='.*bad.json': dense_layers contains 5: layer indices must be in 0..1"):
        attnpatch.patch(llama, "anchor_attention", config=str(bad))
    bad.write_text(json.dumps({"method": "anchor_attention", "options": {"theta": "much"}}))
    with pytest.raises(OptionError, match=r"config='.*bad.json': option theta='much'"):
        validate_options(m, {"config": str(bad)})
    bad.write_text(json.dumps({"method": "anchor_attention", "options": {}, "geometry": {"num_layers": "2"}}))
    with pytest.raises(OptionError, match='"geometry" must be an object of integers'):
        validate_options(m, {"config": str(bad)})
    for value, msg in [(None, "config=None: must be the path"), (3, "config=3: must be the path")]:
        with pytest.raises(OptionError, match=msg):
            attnpatch.patch(llama, "anchor_attention", config=value)
    with pytest.raises(OptionError, match="give one of them"):
        validate_options(m, {"config": path, "preset": "paper"})
    with pytest.raises(OptionError, match=r"preset=\['fast'\] for method 'anchor_attention': allowed"):
        validate_options(m, {"preset": ["fast"]})
    assert not attnpatch.is_patched(llama)
