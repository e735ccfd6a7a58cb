"""The method and adapter contracts: the adapter list and protocol, capabilities instead of names,
one declaration per option (and the method table of docs/methods.md generated from them), the exact limits,
and a new method as one new file (discovered, patched, benchmarked with no other edit)."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import attnpatch
from attnpatch import OptionError, UnsupportedModelError, list_methods, patch, patched
from attnpatch.cli import main
from attnpatch.evals.bench import bench_attention
from attnpatch.options import KINDS
from attnpatch.patchers.adapter import Adapter
from attnpatch.patchers.adapters import ADAPTERS, HFAdapter
from attnpatch.patchers.api import find_adapter, handle_of, prefix_tokens
from attnpatch.patchers.methods import discover
from attnpatch.patchers.contract import ModelGeometry
from attnpatch.patchers.method_table import methods_markdown
from attnpatch.patchers.registry import METHODS, get_method, register_method, validate_options

from conftest import tiny_causal_lm
from throwaway_method import scaled_dense_source

REPO = Path(__file__).resolve().parents[1]


def _dinov2(layers: int = 3):
    from tiny_models import tiny_dinov2

    return tiny_dinov2(num_hidden_layers=layers)


X = torch.randn(2, 3, 70, 70, generator=torch.Generator().manual_seed(1))  # 25 patches + CLS = 26 tokens


# --------------------------------------------------------------------------- adapters


def test_adapters_follow_the_protocol_and_the_error_lists_them():
    assert len(ADAPTERS) >= 3
    for a in ADAPTERS:
        assert isinstance(a, Adapter), a
        assert a.library and a.supports
    with pytest.raises(UnsupportedModelError) as err:
        patch(torch.nn.Linear(2, 2), "dense")
    for a in ADAPTERS:  # the message is built from the list, one phrase per adapter
        assert a.supports in str(err.value)


def test_adapter_lookup_geometry_and_prefix_tokens():
    lm = tiny_causal_lm("llama")
    assert find_adapter(lm) == (HFAdapter, "causal_lm")
    with patched(lm, "dense"):
        h = handle_of(lm)
        geo = h.adapter.geometry(h.model, h.towers, h.kind)
    assert geo == ModelGeometry(num_layers=2, heads=4, kv_heads=2, head_dim=16, kind="causal_lm")
    assert prefix_tokens(lm) == 0 and prefix_tokens(_dinov2()) == 1


# --------------------------------------------------------------------------- capabilities, not names


_NAME_TEST = re.compile(r"""(==|!=)\s*["']([\w+]+)["']|\bin\s*\((\s*["'][^)]*)\)|startswith\(\s*["']([\w+]+)["']""")


def test_no_method_name_is_compared_outside_the_registry_and_the_method_files():
    names = set(METHODS)
    bad = []
    for path in (REPO / "attnpatch").rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("attnpatch/patchers/methods/") or rel == "attnpatch/patchers/registry.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for m in _NAME_TEST.finditer(code):
                compared = {m.group(2), m.group(4)} | set(re.findall(r"""["']([\w+]+)["']""", m.group(3) or ""))
                if compared & names and "args.method" not in code:  # the CLI's own default handling is not a capability test
                    bad.append(f"{rel}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_a_renamed_copy_of_a_method_behaves_the_same():
    """Benches and the patch ask the method, not its name: fna registered again under another name
    is benchmarked with the same parts and notes, and patches a model to the same output."""
    fna = get_method("fna")
    copy = register_method(dataclasses.replace(fna, name="contract_copy_of_fna"))
    try:
        res = bench_attention([(copy.name, {"s": 16, "min_tokens": 0})], lengths=[64], repeats=1, warmup=0, heads=2, head_dim=16, memory=False)
        row = res["rows"][1]
        assert row["method"] == "contract_copy_of_fna (s=16, min_tokens=0)" and row["fps_seconds"] > 0 and row["nystrom_seconds"] > 0
        assert f"{row['method']} [fps]" in res["exponents"]
        model = _dinov2()
        with torch.no_grad(), patched(model, "fna", s=9, sample_layer=1, min_tokens=0):
            ref = model(pixel_values=X).last_hidden_state
        with torch.no_grad(), patched(model, copy.name, s=9, sample_layer=1, min_tokens=0):
            out = model(pixel_values=X).last_hidden_state
        assert torch.equal(out, ref)
        with pytest.raises(OptionError, match="contract_copy_of_fna' is non-causal"):
            bench_attention([(copy.name, {})], lengths=[64], causal=True)
    finally:
        METHODS.pop(copy.name)


def test_declared_capabilities():
    fna, anchor, dense = get_method("fna"), get_method("anchor_attention"), get_method("dense")
    assert dense.exact and dense.exact_limit(100) == {} and dense.fits("text")
    assert not anchor.noncausal_calls and anchor.causal_calls and anchor.key_padding
    assert not fna.causal_calls and not fna.key_padding and "prefix" in fna.token_roles
    for m in METHODS.values():
        d = m.describe()
        assert set(d["calls"]) == {"causal", "noncausal", "key_padding"} and d["exactness"]


def test_method_checks_get_the_model_geometry():
    """Layer and head ranges are the method's own checks (same messages as before)."""
    lm = tiny_causal_lm("llama")
    with pytest.raises(OptionError, match=r"dense_layers contains 2: layer indices must be in 0\.\.1"):
        patch(lm, "anchor_attention", dense_layers=[2])
    with pytest.raises(OptionError, match=r"dense_heads contains \(1, 4\): layers must be in 0\.\.1, heads in 0\.\.3"):
        patch(lm, "anchor_attention", dense_heads=[(1, 4)])
    with pytest.raises(OptionError, match="sample_layer=3: the model has 3 attention layers"):
        patch(_dinov2(), "fna", sample_layer=3)
    with pytest.raises(OptionError, match="dense_heads contains"):
        get_method("anchor_attention").check(get_method("anchor_attention").make_config(
            {**{n: o.default for n, o in get_method("anchor_attention").options.items()}, "dense_heads": ((0, 9),)}),
            ModelGeometry(num_layers=1, heads=2))


# --------------------------------------------------------------------------- options: one declaration each


def test_every_option_is_declared_once_with_kind_help_and_a_valid_default():
    for m in METHODS.values():
        for name, o in m.options.items():
            assert o.name == name and o.kind in KINDS and len(o.help) > 10, (m.name, name)
            if o.choices:  # a str option's values, or the words an int_or_auto option takes besides an integer
                assert o.kind in ("str", "int_or_auto") and (o.default in o.choices or isinstance(o.default, int))
            assert o.coerce(o.default) == o.default or (o.kind.endswith("list") and tuple(o.coerce(o.default)) == tuple(o.default))


def test_declared_ranges_are_checked_with_the_messages_of_before():
    lm, vit = tiny_causal_lm("llama"), _dinov2()
    for model, method, opts, match in [
        (lm, "anchor_attention", {"block_size": 0}, r"block_size=0: must be an integer >= 1 \(tokens\)"),
        (lm, "anchor_attention", {"theta": float("nan")}, r"theta=nan: must be a real number"),
        (lm, "anchor_attention", {"min_recall": 1.5}, r"min_recall=1.5: must be a number in \[0, 1\]"),
        (lm, "anchor_attention", {"pool_stride": 48}, "pool_stride=48 does not divide block_size=128"),
        (vit, "fna", {"s": 0}, r"s=0: the number of landmarks must be an integer >= 1"),
        (vit, "fna", {"rtol": 1.0}, r"rtol=1.0: must be in \(0, 1\)"),
        (vit, "fna", {"massive_ratio": float("inf")}, "massive_ratio=inf: must be a finite number > 1"),
        (vit, "sink_mask", {"mass_ratio": 1.0}, "mass_ratio=1.0: must be a finite number > 1"),
        (vit, "sink_mask", {"detect_layer": -1}, "detect_layer=-1: must be 'auto' or a layer index >= 0"),
    ]:
        with pytest.raises(OptionError, match=match):
            patch(model, method, **opts)
    from attnpatch.patchers.methods.fna import FNAConfig

    with pytest.raises(OptionError, match="s=0"):  # a config built directly is checked by the same declarations
        FNAConfig(s=0)
    assert FNAConfig(s="12").s == 12


def test_readme_method_table_is_generated_from_the_registry(capsys):
    text = (REPO / "docs" / "methods.md").read_text()
    begin, end = "<!-- methods:begin -->\n", "<!-- methods:end -->"
    assert begin in text and end in text
    section = text[text.index(begin) + len(begin): text.index(end)]
    assert section.strip() == methods_markdown().strip(), "regenerate with: attnpatch methods --markdown"
    assert main(["methods", "--markdown"]) == 0
    assert capsys.readouterr().out == methods_markdown()
    for m in list_methods():
        assert f"`{m['name']}`" in section


# --------------------------------------------------------------------------- exact limits


def test_exact_limits_give_the_unpatched_model():
    lm = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    vit = _dinov2()
    with torch.no_grad():
        ref_lm = lm(ids).logits
        ref_vit = vit(pixel_values=X).last_hidden_state
        for m in METHODS.values():
            if m.name.startswith("contract_"):
                continue
            if m.fits("causal_lm"):
                limit = m.exact_limit(ids.shape[1])
                assert limit is not None, m.name
                with patched(lm, m.name, **limit):
                    torch.testing.assert_close(lm(ids).logits, ref_lm, rtol=1e-5, atol=1e-5)
                assert m.is_exact(attnpatch.patchers.registry.validate_options(m, limit), ids.shape[1])
            if m.fits("vision"):
                limit = m.exact_limit(26)
                assert limit is not None, m.name
                with pytest.warns() if "s" in limit else _nothing(), patched(vit, m.name, **limit):
                    torch.testing.assert_close(vit(pixel_values=X).last_hidden_state, ref_vit, rtol=1e-5, atol=1e-5)
    assert not get_method("fna").is_exact({**{n: o.default for n, o in get_method("fna").options.items()}, "s": 25}, 26)
    assert get_method("anchor_attention").exact_limit(10) == {"theta": math.inf}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------- a new method is one new file




def test_a_new_method_file_is_discovered_patched_and_benchmarked(tmp_path, monkeypatch):
    pkg = tmp_path / "contract_methods"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scaled_dense.py").write_text(scaled_dense_source("contract_scaled_dense"))
    (pkg / "_helper.py").write_text("raise RuntimeError('modules starting with _ are not imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        mods = discover("contract_methods")
        assert [m.__name__ for m in mods] == ["contract_methods.scaled_dense"]
        assert "contract_scaled_dense" in {m["name"] for m in list_methods()}
        model = tiny_causal_lm("qwen2")
        ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = model(ids).logits
            with patched(model, "contract_scaled_dense"):
                out = model(ids).logits
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            with patched(model, "contract_scaled_dense", factor=2.0):
                assert not torch.allclose(model(ids).logits, ref, atol=1e-3)
        for causal in (True, False):
            res = bench_attention([("contract_scaled_dense", {})], lengths=[32, 64], causal=causal, repeats=1, warmup=0,
                                  heads=2, head_dim=16, memory=False)
            rows = [r for r in res["rows"] if r["method"] == "contract_scaled_dense"]
            assert len(rows) == 2 and all(r["seconds"] > 0 and r["speedup"] > 0 for r in rows)
        assert main(["bench", "attention", "--method", "contract_scaled_dense", "--lengths", "32", "--heads", "2",
                     "--head-dim", "16", "--repeats", "1", "--no-memory"]) == 0
        assert "contract_scaled_dense" in methods_markdown()
    finally:
        METHODS.pop("contract_scaled_dense", None)
        for name in [n for n in sys.modules if n.startswith("contract_methods")]:
            del sys.modules[name]


def test_the_methods_package_discovers_every_file_in_its_folder():
    import pkgutil

    import attnpatch.patchers.methods as pkg

    files = {i.name for i in pkgutil.iter_modules(pkg.__path__) if not i.name.startswith("_")}
    modules = {fn.__module__.rsplit(".", 1)[1] for fn in (m.forward for m in METHODS.values()) if fn.__module__.startswith(pkg.__name__)}
    assert files == modules  # every file registers a method, every method comes from a file
    assert {"anchor_attention", "dense", "fna", "fna_sink_mask", "sink_mask"} <= files


@pytest.mark.parametrize("name", ["dense", "sink_mask", "fna+sink_mask"])
def test_methods_without_their_own_hook_are_benchmarked_by_the_default(name):
    res = bench_attention([(name, {})], lengths=[80], repeats=1, warmup=0, heads=2, head_dim=16, memory=False)
    row = res["rows"][1]
    assert row["method"] == name and row["seconds"] > 0



def test_fna_seed_is_refused_beyond_what_a_generator_takes():
    """A seed past 2**63 - 1 used to pass patch() and fail at the first forward with 'Overflow when unpacking long long'."""
    from tiny_models import NARROW_DINOV2, tiny_dinov2

    model = tiny_dinov2(seed=None, **NARROW_DINOV2, num_hidden_layers=2, image_size=28)
    with pytest.raises(OptionError, match=r"seed=1180591620717411303424: must be an integer in \[0, 9223372036854775807\]"):
        patch(model, "fna", strategy="random", seed=2**70)
    patch(model, "fna", strategy="random", seed=2**63 - 1, s=2, sample_layer=0)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 28, 28)).last_hidden_state).all()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_knob_gives_valid_options_that_grow_with_t(name):
    """A method's main knob (what ``attnpatch compare --match`` turns) gives valid options at every
    position and, for a token-count knob, counts that never shrink as ``t`` grows."""
    m = METHODS[name]
    if m.knob is None:
        assert m.exact or name in {"sink_mask"}, f"{name}: an approximate method with a budget should declare its knob"
        return
    for n in (17, 256, 4097):
        prev = None
        for t in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
            opts = m.knob.at(t, n)
            full = validate_options(m, opts)
            assert set(opts) <= set(full)
            if m.knob.tokens is not None:
                assert m.knob.tokens in opts
                if prev is not None:
                    assert opts[m.knob.tokens] >= prev
                prev = opts[m.knob.tokens]


def test_every_method_is_findable_from_the_attention_package():
    """``attnpatch/attention/__init__.py`` maps each method to the module(s) of its math; every module it names exists."""
    import importlib

    import attnpatch.attention as attention

    doc = attention.__doc__
    shipped = [m.name for m in METHODS.values() if m.forward.__module__.startswith("attnpatch.patchers.methods.")]
    assert shipped and [n for n in shipped if f"``{n}``" not in doc] == []
    named = set(re.findall(r":mod:`\.([\w.]+)`", doc))
    assert {"anchor", "sparse", "nystrom", "landmarks", "backends.dispatch"} <= named
    for mod in named:
        importlib.import_module(f"attnpatch.attention.{mod}")
