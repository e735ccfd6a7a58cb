"""The contract battery: every registered method x every model (tower) it fits, the same checks for all.

The cases are computed from the registry and the adapters (:func:`battery_cases`): each registered
method, each model of :data:`MODELS` and each tower of it whose kind (as the model's adapter
reports it) the method fits.  A method registered later, in a new file of
``attnpatch/patchers/methods``, gets every check below with no edit here
(:func:`test_a_new_method_file_gets_the_battery`).

Checks per (method, model, tower):

1. the exact limit: ``patch(model, name, **method.exact_limit(N))`` computes the unpatched output
   (relative error <= 1e-5 in float32, valid positions only), alone and on top of the small-input
   small settings (the limit's options decide exactness, whatever the others are);
2. an exact method (``Method.exact``) gives the unpatched output bit for bit;
3. ``unpatch`` restores the output bit for bit after a patched forward, and the state dict keeps
   its keys and values (while patched too);
4. batch independence: a row's output does not depend on its batch mate;
5. bfloat16: the model in bfloat16, patched, runs and stays finite;
   for causal LMs also: changing the last token leaves the first half of the outputs unchanged
   (causality), and a left-padded row equals its tokens run alone (key padding);
6. misuse: an unknown option and a wrongly typed value raise ``OptionError`` naming them (and the
   model stays unpatched);

plus: a method refuses, with a clear ``UnsupportedModelError`` naming model and method, every
tower whose kind it does not fit, and a model whose declared features it lacks.

Every model has tiny random weights (no hub).  Checks 3-5 run with the method's defaults and, where
with the method's own ``Method.small_settings`` for the tower's kind: settings that make it
approximate on these tiny inputs (asserted through ``record_stats``: some layer did not run
dense).  Every approximate method must declare them for every kind it fits
(:func:`test_every_approximate_method_declares_small_settings`).
"""

from __future__ import annotations

import copy
import functools
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

from attnpatch import OptionError, UnsupportedModelError, is_patched, patch, patched, record_stats, unpatch
from attnpatch.patchers.adapter import tower_kinds as adapter_tower_kinds
from attnpatch.patchers.api import find_adapter
from attnpatch.patchers.methods import discover
from attnpatch.patchers.contract import Method
from attnpatch.patchers.registry import METHODS, get_method
from throwaway_method import scaled_dense_source

# --------------------------------------------------------------------------- settings (data, not logic)

EXACT_RTOL = 1e-5  # relative Frobenius error of an exact limit (float32)
BATCH_RTOL = 1e-5  # relative Frobenius error between a row run alone and in a batch
CAUSAL_RTOL = 1e-6  # earlier outputs when the last token changes (causal calls)
PAD_RTOL = 1e-4  # a left-padded row vs its tokens alone (float rounding of other rotary positions)

#: (method, model, tower, check) -> reason: genuine library bugs found by the battery (strict xfail).
KNOWN_BUGS: dict[tuple[str, str, str, str], str] = {}

# --------------------------------------------------------------------------- models


@dataclass
class Built:
    """A model with its inputs, per tower: ``inputs[tower]`` (a batch of 2), ``other[tower]`` (a
    different second row for the batch-independence check), ``run[tower](model, inputs) -> tensor``
    and ``valid[tower]`` (bool ``[B, L]`` of the positions to compare, or ``None`` for every one)."""

    model: torch.nn.Module
    inputs: dict[str, dict[str, torch.Tensor]]
    other: dict[str, dict[str, torch.Tensor]]
    run: dict[str, Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]]
    valid: dict[str, torch.Tensor | None]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _images(size: int, seed: int, b: int = 2) -> torch.Tensor:
    return torch.randn(b, 3, size, size, generator=_gen(seed))


def _causal_lm(family: str) -> Built:
    from tiny_models import tiny_causal_lm

    model = tiny_causal_lm(family, max_position_embeddings=512)  # q/k sharpened so that thresholds select something
    n, pad = 96, 24
    ids = torch.randint(0, 128, (2, n), generator=_gen(1))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :pad] = 0  # left padding
    ids[1, :pad] = 0
    other = torch.randint(0, 128, (1, n), generator=_gen(2))

    def run(m, inp):
        return m(**inp).logits

    return Built(model, {"text": {"input_ids": ids, "attention_mask": mask}},
                 {"text": {"input_ids": other, "attention_mask": torch.ones(1, n, dtype=torch.long)}},
                 {"text": run}, {"text": mask.bool()})


def _hf_vit(registers: bool) -> Built:
    from tiny_models import tiny_dinov2

    model = tiny_dinov2(4 if registers else 0, num_hidden_layers=3, image_size=42)

    def run(m, inp):
        return m(**inp).last_hidden_state

    return Built(model, {"vision": {"pixel_values": _images(42, 1)}}, {"vision": {"pixel_values": _images(42, 2, 1)}},
                 {"vision": run}, {"vision": None})


def _hf_dual(family: str) -> Built:
    from tiny_models import tiny_hf_clip

    model = tiny_hf_clip(family)

    def run_vision(m, inp):
        return m.vision_model(**inp).last_hidden_state

    def run_text(m, inp):
        return m.text_model(**inp).last_hidden_state

    ids = torch.randint(1, 100, (2, 16), generator=_gen(3))
    return Built(
        model,
        {"vision": {"pixel_values": _images(32, 1)}, "text": {"input_ids": ids}},
        {"vision": {"pixel_values": _images(32, 2, 1)}, "text": {"input_ids": torch.randint(1, 100, (1, 16), generator=_gen(4))}},
        {"vision": run_vision, "text": run_text},
        {"vision": None, "text": None},
    )


def _timm(**kw) -> Built:
    from tiny_models import tiny_timm_vit

    model = tiny_timm_vit(img_size=32, depth=3, mlp_ratio=2.0, **kw)

    def run(m, inp):
        return m.forward_features(inp["x"])

    return Built(model, {"vision": {"x": _images(32, 1)}}, {"vision": {"x": _images(32, 2, 1)}}, {"vision": run},
                 {"vision": None})


def _open_clip() -> Built:
    from tiny_models import tiny_open_clip

    model = tiny_open_clip(vision=dict(image_size=32, layers=3), text=dict(context_length=16, vocab_size=100))

    def run_vision(m, inp):
        return m.encode_image(inp["image"])

    def run_text(m, inp):
        return m.encode_text(inp["text"])

    ids = torch.randint(1, 100, (2, 16), generator=_gen(3))
    return Built(
        model,
        {"vision": {"image": _images(32, 1)}, "text": {"text": ids}},
        {"vision": {"image": _images(32, 2, 1)}, "text": {"text": torch.randint(1, 100, (1, 16), generator=_gen(4))}},
        {"vision": run_vision, "text": run_text},
        {"vision": None, "text": None},
    )


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


#: name -> builder.  open_clip models are left out (and said so) only where open_clip is not installed.
MODELS: dict[str, Callable[[], Built]] = {
    "llama": lambda: _causal_lm("llama"),
    "qwen2": lambda: _causal_lm("qwen2"),
    "qwen3": lambda: _causal_lm("qwen3"),
    "dinov2": lambda: _hf_vit(False),
    "dinov2_registers": lambda: _hf_vit(True),
    "hf_clip": lambda: _hf_dual("clip"),
    "siglip": lambda: _hf_dual("siglip"),
    "timm_vit_cls": lambda: _timm(),
    "timm_vit_nocls": lambda: _timm(class_token=False, global_pool="avg"),
    "timm_vit_registers": lambda: _timm(reg_tokens=4),
}
if _have("open_clip"):
    MODELS["open_clip_vit"] = _open_clip


@functools.lru_cache(maxsize=None)
def built(name: str) -> Built:
    """Each model built once per session (the checks leave it unpatched and in float32)."""
    return MODELS[name]()


@functools.lru_cache(maxsize=None)
def tower_kinds(name: str) -> dict[str, str]:
    """Tower -> kind, as the model's adapter reports it (what ``patch()`` checks methods against)."""
    model = built(name).model
    adapter, kind = find_adapter(model)
    return dict(adapter_tower_kinds(adapter, model, kind))


def battery_cases(fitting: bool = True) -> list[tuple[str, str, str]]:
    """``(method, model, tower)`` for every registered method and every tower of every model of
    :data:`MODELS` that the method fits (``fitting=False``: that it does not fit)."""
    out = []
    for mname in sorted(METHODS):
        method = METHODS[mname]
        for model in MODELS:
            for tower, kind in tower_kinds(model).items():
                if method.fits(kind) == fitting:
                    out.append((mname, model, tower))
    return out


def _params(check: str, cases: list[tuple[str, str, str]] | None = None, settings: bool = False) -> list:
    out = []
    for mname, model, tower in battery_cases() if cases is None else cases:
        kind = tower_kinds(model)[tower]
        names = ["default"] + (["small"] if settings and kind in METHODS[mname].small_settings else [])
        for setting in names:
            marks = []
            reason = KNOWN_BUGS.get((mname, model, tower, check)) or KNOWN_BUGS.get((mname, model, tower, f"{check}:{setting}"))
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            ident = f"{mname}-{model}-{tower}" + (f"-{setting}" if settings else "")
            out.append(pytest.param(mname, model, tower, setting, id=ident, marks=marks))
    return out


# --------------------------------------------------------------------------- helpers


def _forward(model, b: Built, tower: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "s >= N: running exact attention"
        return b.run[tower](model, inputs)


def _valid(out: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    return out.float() if valid is None else out.float()[valid]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def _towers_arg(model: str, tower: str) -> dict[str, Any]:
    return {"towers": tower} if len(tower_kinds(model)) > 1 else {}


@functools.lru_cache(maxsize=None)
def _reference(model: str, tower: str) -> torch.Tensor:
    b = built(model)
    return _forward(b.model, b, tower, b.inputs[tower])


@functools.lru_cache(maxsize=None)
def tokens(model: str, tower: str) -> int:
    """Tokens per attention call of this tower on the battery's inputs, as the patched layers see them."""
    b = built(model)
    with patched(b.model, "dense", **_towers_arg(model, tower)), record_stats(b.model) as rec:
        _forward(b.model, b, tower, b.inputs[tower])
    counts = {r.queries for fwd in rec.forwards for r in fwd.values()}
    assert len(counts) == 1, counts
    return counts.pop()


def _options(method: Method, model: str, tower: str, setting: str) -> dict[str, Any]:
    return dict(method.small_settings[tower_kinds(model)[tower]]) if setting == "small" else {}


def _patch(b: Built, method: str, model: str, tower: str, **options: Any) -> None:
    try:
        patch(b.model, method, **_towers_arg(model, tower), **options)
    except UnsupportedModelError as err:
        # only a declared model feature the method lacks may refuse a fitting tower, or, for a method that
        # changes the token count between blocks (block_hook), a model whose blocks or read-out it cannot handle
        msg = str(err)
        declared = "does not implement" in msg or (
            get_method(method).block_hook is not None and ("merges tokens" in msg or "changes the token count" in msg)
        )
        assert type(b.model).__name__ in msg and repr(method) in msg and declared, msg
        pytest.skip(f"refused at patch(), as declared: {msg}")


def _approximated(rec) -> bool:
    return any(not r.mode.startswith("dense") for fwd in rec.forwards for r in fwd.values())


# --------------------------------------------------------------------------- the checks (plain functions, reused below)


def check_exact_limit(mname: str, model: str, tower: str, setting: str) -> None:
    method, b = get_method(mname), built(model)
    n = tokens(model, tower)
    limit = method.exact_limit(n)
    assert limit is not None, f"{mname} declares no exact limit; every method must have one"
    options = {**_options(method, model, tower, setting), **limit}
    ref = _reference(model, tower)
    _patch(b, mname, model, tower, **options)
    try:
        out = _forward(b.model, b, tower, b.inputs[tower])
    finally:
        unpatch(b.model)
    valid = b.valid[tower]
    rel = _rel(_valid(out, valid), _valid(ref, valid))
    assert rel <= EXACT_RTOL, f"{mname} at its exact limit {options} on {model}/{tower} (N={n}): relative error {rel:.3g}"
    assert torch.isfinite(_valid(out, valid)).all()


def check_exact_method(mname: str, model: str, tower: str) -> None:
    b = built(model)
    ref = _reference(model, tower)
    _patch(b, mname, model, tower)
    try:
        out = _forward(b.model, b, tower, b.inputs[tower])
    finally:
        unpatch(b.model)
    assert torch.equal(out, ref), f"{mname} on {model}/{tower}: max |diff| {float((out - ref).abs().max()):.3g}"


def check_unpatch(mname: str, model: str, tower: str, setting: str) -> None:
    method, b = get_method(mname), built(model)
    ref = _reference(model, tower)
    before = {k: v.clone() for k, v in b.model.state_dict().items()}
    _patch(b, mname, model, tower, **_options(method, model, tower, setting))
    try:
        with record_stats(b.model) as rec:
            out = _forward(b.model, b, tower, b.inputs[tower])
        during = b.model.state_dict()
        assert list(during) == list(before), "patch() changed the state dict's keys"
        assert all(torch.equal(during[k], v) for k, v in before.items()), "patch() changed state dict values"
    finally:
        unpatch(b.model)
    assert not is_patched(b.model)
    assert torch.isfinite(_valid(out, b.valid[tower])).all()
    if setting == "small":
        assert _approximated(rec), f"the small settings of {mname} ran dense everywhere on {model}/{tower}"
    after = b.model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    again = _forward(b.model, b, tower, b.inputs[tower])
    assert torch.equal(again, ref), f"unpatch after {mname}: max |diff| {float((again - ref).abs().max()):.3g}"


def _row(inputs: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    return {k: v[i: i + 1] for k, v in inputs.items()}


def _cat(a: dict[str, torch.Tensor], c: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([a[k], c[k]]) for k in a}


def check_batch_independence(mname: str, model: str, tower: str, setting: str) -> None:
    method, b = get_method(mname), built(model)
    row0 = _row(b.inputs[tower], 0)  # the unpadded row (a causal LM's row 1 is left-padded)
    if b.valid[tower] is not None:
        assert bool(b.valid[tower][0].all())
    _patch(b, mname, model, tower, **_options(method, model, tower, setting))
    try:
        alone = _forward(b.model, b, tower, row0)[0]
        paired = _forward(b.model, b, tower, _cat(row0, b.other[tower]))[0]
        swapped = _forward(b.model, b, tower, _cat(b.other[tower], row0))[1]
    finally:
        unpatch(b.model)
    for what, got in (("first", paired), ("second", swapped)):
        rel = _rel(got, alone)
        assert rel <= BATCH_RTOL, f"{mname} on {model}/{tower}: row alone vs {what} in a batch: relative difference {rel:.3g}"


def check_bfloat16(mname: str, model: str, tower: str, setting: str) -> None:
    method, b = get_method(mname), built(model)
    half = Built(copy.deepcopy(b.model).to(torch.bfloat16), b.inputs, b.other, b.run, b.valid)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in b.inputs[tower].items()}
    _patch(half, mname, model, tower, **_options(method, model, tower, setting))
    try:
        out = _forward(half.model, half, tower, inputs)
    finally:
        unpatch(half.model)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(_valid(out, b.valid[tower])).all(), f"{mname} on {model}/{tower} in bfloat16: non-finite output"


def check_causality(mname: str, model: str, tower: str, setting: str) -> None:
    """Causal calls: changing the last token changes no output in the first half of the sequence."""
    method, b = get_method(mname), built(model)
    row0 = _row(b.inputs[tower], 0)
    changed = {k: v.clone() for k, v in row0.items()}
    ids = changed["input_ids"]
    ids[0, -1] = (ids[0, -1] + 1) % b.model.config.vocab_size
    _patch(b, mname, model, tower, **_options(method, model, tower, setting))
    try:
        before = _forward(b.model, b, tower, row0)
        after = _forward(b.model, b, tower, changed)
    finally:
        unpatch(b.model)
    half = ids.shape[1] // 2
    assert not torch.equal(before[:, -1], after[:, -1])  # the change is seen where it is
    rel = _rel(after[:, :half], before[:, :half])
    assert rel <= CAUSAL_RTOL, f"{mname} on {model}: changing the last token moved the first {half} outputs by {rel:.3g}"


def check_padding(mname: str, model: str, tower: str, setting: str) -> None:
    """Key padding: a left-padded row gives, at its real tokens, what those tokens give alone (rotary
    positions are relative, so the shift by the padding changes only float rounding)."""
    method, b = get_method(mname), built(model)
    padded = _row(b.inputs[tower], 1)
    pad = int((padded["attention_mask"][0] == 0).sum())
    assert pad > 0
    alone = {k: v[:, pad:] for k, v in padded.items()}
    _patch(b, mname, model, tower, **_options(method, model, tower, setting))
    try:
        out_padded = _forward(b.model, b, tower, padded)[:, pad:]
        out_alone = _forward(b.model, b, tower, alone)
    finally:
        unpatch(b.model)
    rel = _rel(out_padded, out_alone)
    assert rel <= PAD_RTOL, f"{mname} on {model}: a left-padded row vs its tokens alone: relative difference {rel:.3g}"


def _numeric_option(method: Method) -> str | None:
    return next((o.name for o in method.options.values() if o.kind in ("int", "float", "int_or_auto")), None)


def check_misuse(mname: str, model: str, tower: str) -> None:
    method, b = get_method(mname), built(model)
    with pytest.raises(OptionError) as err:
        patch(b.model, mname, **_towers_arg(model, tower), no_such_option_xyz=1)
    assert "no_such_option_xyz" in str(err.value) and repr(mname) in str(err.value), str(err.value)
    assert not is_patched(b.model)
    name = _numeric_option(method)
    if name is not None:
        with pytest.raises(OptionError) as err:
            patch(b.model, mname, **_towers_arg(model, tower), **{name: "not-a-number"})
        msg = str(err.value)
        assert name in msg and "'not-a-number'" in msg, msg
        assert not is_patched(b.model)


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("mname,model,tower,setting", _params("exact_limit", settings=True))
def test_exact_limit_equals_unpatched(mname, model, tower, setting):
    check_exact_limit(mname, model, tower, setting)


@pytest.mark.parametrize("mname,model,tower,setting",
                         _params("exact_method", [c for c in battery_cases() if METHODS[c[0]].exact]))
def test_exact_method_is_bit_exact(mname, model, tower, setting):
    check_exact_method(mname, model, tower)


@pytest.mark.parametrize("mname,model,tower,setting", _params("unpatch", settings=True))
def test_unpatch_restores_bit_for_bit(mname, model, tower, setting):
    check_unpatch(mname, model, tower, setting)


@pytest.mark.parametrize("mname,model,tower,setting", _params("batch", settings=True))
def test_batch_independence(mname, model, tower, setting):
    check_batch_independence(mname, model, tower, setting)


def _causal_cases() -> list[tuple[str, str, str]]:
    return [c for c in battery_cases() if tower_kinds(c[1])[c[2]] == "causal_lm"]


@pytest.mark.parametrize("mname,model,tower,setting", _params("causality", _causal_cases(), settings=True))
def test_causal_calls_do_not_see_later_tokens(mname, model, tower, setting):
    check_causality(mname, model, tower, setting)


@pytest.mark.parametrize("mname,model,tower,setting", _params("padding", _causal_cases(), settings=True))
def test_left_padding_equals_the_tokens_alone(mname, model, tower, setting):
    check_padding(mname, model, tower, setting)


@pytest.mark.parametrize("mname,model,tower,setting", _params("bfloat16", settings=True))
def test_bfloat16_runs_and_stays_finite(mname, model, tower, setting):
    check_bfloat16(mname, model, tower, setting)


@pytest.mark.parametrize("mname,model,tower,setting", _params("misuse"))
def test_misuse_gets_the_methods_own_error(mname, model, tower, setting):
    check_misuse(mname, model, tower)


@pytest.mark.parametrize("mname,model,tower,setting", _params("refusal", battery_cases(fitting=False)))
def test_unfit_towers_are_refused_by_name(mname, model, tower, setting):
    b = built(model)
    with pytest.raises(UnsupportedModelError) as err:
        patch(b.model, mname, **_towers_arg(model, tower))
    msg = str(err.value)
    assert type(b.model).__name__ in msg and repr(mname) in msg and repr(tower_kinds(model)[tower]) in msg, msg
    assert not is_patched(b.model)


def test_every_model_and_method_is_covered():
    cases = battery_cases()
    assert {m for m, _, _ in cases} == set(METHODS), "a registered method fits none of the battery's models"
    assert {(mo, t) for _, mo, t in cases} == {(mo, t) for mo in MODELS for t in tower_kinds(mo)}, "a tower no method fits"


def test_every_approximate_method_declares_small_settings():
    """Without them a method is checked only at its defaults, which may run exact on the battery's
    17-96-token inputs (``fna``'s default ``s=64`` does): declare ``small_settings`` in the method file."""
    missing = []
    for mname, model, tower in battery_cases():
        method, kind = METHODS[mname], tower_kinds(model)[tower]
        if not method.exact and kind not in method.small_settings:
            missing.append(f"{mname} ({kind})")
    assert not missing, f"declare Method.small_settings for: {sorted(set(missing))}"


@pytest.mark.parametrize("mname,words,skips", [
    ("tome", "changes the token count between the attention and the MLP branch", True),  # a block hook: declared
    ("tome", "merges tokens, but this model reads its output out with a pooled average", True),
    ("fna", "does not implement this", True),  # a model feature the method lacks: declared
    ("fna", "changes the token count between the attention and the MLP branch", False),  # fna has no block hook
    ("fna", "merges tokens, but this model reads its output out with a pooled average", False),
    ("fna", "is broken", False),
])
def test_only_a_declared_refusal_skips_a_case(monkeypatch, mname, words, skips):
    """_patch skips a case on a refusal the method declared (a model feature it lacks; for a block-hook method, a
    model whose blocks or read-out it cannot handle) and fails it on any other refusal."""
    assert (get_method(mname).block_hook is not None) == (mname == "tome")
    calls = []

    def refuse(model, method, **options):
        calls.append(method)
        raise UnsupportedModelError(f"{type(model).__name__}: method {method!r} {words}")

    monkeypatch.setattr(sys.modules[__name__], "patch", refuse)  # the global _patch reads
    try:  # caught here: a skip escaping would report a wrongly skipped case as skipped, not failed
        _patch(built("dinov2"), mname, "dinov2", "vision")
        outcome = "patched"
    except pytest.skip.Exception as err:
        outcome = "skipped"
        assert str(err).startswith("refused at patch(), as declared: Dinov2Model: method")
    except AssertionError:
        outcome = "failed"
    assert calls == [mname]
    assert outcome == ("skipped" if skips else "failed")


# --------------------------------------------------------------------------- a new method is one new file




def test_a_new_method_file_gets_the_battery(tmp_path, monkeypatch):
    pkg = tmp_path / "battery_methods"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scaled_dense.py").write_text(scaled_dense_source("battery_scaled_dense"))
    monkeypatch.syspath_prepend(str(tmp_path))
    before = battery_cases()
    try:
        assert [m.__name__ for m in discover("battery_methods")] == ["battery_methods.scaled_dense"]
        cases = battery_cases()
        new = [c for c in cases if c[0] == "battery_scaled_dense"]
        want = [(mo, t) for mo in MODELS for t, k in tower_kinds(mo).items() if k in ("causal_lm", "vision")]
        assert [(mo, t) for _, mo, t in new] == want and len(want) == len(MODELS)
        assert sorted(set(cases) - set(new)) == sorted(before)
        assert {(mo, t) for m, mo, t in battery_cases(fitting=False) if m == "battery_scaled_dense"} == {
            (mo, t) for mo in MODELS for t, k in tower_kinds(mo).items() if k == "text"}
        assert [p.id for p in _params("exact_limit", new, settings=True)][:1] == ["battery_scaled_dense-llama-text-default"]
        # and the checks run on it as they are: one causal LM and one ViT
        for _, mo, t in [new[0], next(c for c in new if tower_kinds(c[1])[c[2]] == "vision")]:
            check_exact_limit("battery_scaled_dense", mo, t, "default")
            check_unpatch("battery_scaled_dense", mo, t, "default")
            check_batch_independence("battery_scaled_dense", mo, t, "default")
            check_bfloat16("battery_scaled_dense", mo, t, "default")
            check_misuse("battery_scaled_dense", mo, t)
    finally:
        METHODS.pop("battery_scaled_dense", None)
        for name in [n for n in sys.modules if n.startswith("battery_methods")]:
            del sys.modules[name]
    assert battery_cases() == before


def _register(tmp_path, monkeypatch, name: str, **breakage: bool) -> None:
    pkg = tmp_path / f"{name}_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "method.py").write_text(scaled_dense_source(name, **breakage))
    monkeypatch.syspath_prepend(str(tmp_path))
    discover(f"{name}_pkg")


@pytest.mark.parametrize("breakage,checks", [
    ("bidirectional", ("exact_limit", "causality")),
    ("ignore_padding", ("exact_limit", "padding")),
])
def test_the_battery_catches_a_broken_method(tmp_path, monkeypatch, breakage, checks):
    """A method that attends to later keys, or to padding keys, fails the checks meant for it."""
    name = f"broken_{breakage}"
    run = {"exact_limit": check_exact_limit, "causality": check_causality, "padding": check_padding}
    try:
        _register(tmp_path, monkeypatch, name, **{breakage: True})
        for check in checks:
            with pytest.raises(AssertionError):
                run[check](name, "llama", "text", "small")
        check_batch_independence(name, "llama", "text", "small")  # row 0 alone is unpadded: this one cannot tell
    finally:
        METHODS.pop(name, None)
        for mod in [n for n in sys.modules if n.startswith(f"{name}_pkg")]:
            del sys.modules[mod]


@pytest.mark.parametrize("breakage,error,words", [
    ("layout", "AttnpatchError", "returned (1, 96, 4, 16) torch.float32"),
    ("bad_calls", "OptionError", "is for bidirectional (vision) attention; layer 0 is causal"),
])
def test_the_runtime_refuses_what_a_method_did_not_declare(tmp_path, monkeypatch, breakage, error, words):
    """The runtime checks every method call: the output layout ``[B, H, Lq, Dv]`` in q's dtype, and the
    calls the method declared (``causal_calls``, ``noncausal_calls``, ``key_padding``)."""
    import attnpatch

    name = f"broken_{breakage}"
    b = built("llama")
    try:
        _register(tmp_path, monkeypatch, name, **{breakage: True})
        with patched(b.model, name), pytest.raises(getattr(attnpatch, error)) as err:
            _forward(b.model, b, "text", _row(b.inputs["text"], 0))
        assert words in str(err.value) and repr(name) in str(err.value), str(err.value)
    finally:
        METHODS.pop(name, None)
        for mod in [n for n in sys.modules if n.startswith(f"{name}_pkg")]:
            del sys.modules[mod]
