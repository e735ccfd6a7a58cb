"""The method contract (:class:`Method`), the registry of methods, and the validation of their options.

A method is one :class:`Method` entry: its options (declared once, see :mod:`attnpatch.options`), what it
is and needs (exact or approximate, model kinds, the calls and model features it handles, the
token roles it reads), the options that make it exact (:class:`ExactLimit`), a check of its
options against the model (:class:`ModelGeometry`), and how to benchmark one attention layer
(:mod:`.bench_hook`).  The patch, the adapters and the benches ask the method; none of them
compares its name.  Methods live one per file in :mod:`attnpatch.patchers.methods` and register
themselves with :func:`register_method` when that package imports them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import OptionError, UnknownMethodError
from ..options import Option
from .bench_hook import BenchCase, BenchInputs, default_bench
from .state import LayerRecord

__all__ = [
    "Option", "Method", "ExactLimit", "Knob", "Preset", "ModelGeometry", "register_method", "get_method", "list_methods", "validate_options",
    "methods_markdown", "METHODS", "MODEL_FEATURES", "MODEL_KINDS", "load_config", "check_config_geometry", "write_config",
]


#: Model features an attention method may or may not implement; the adapters report which ones a
#: model uses (``adapter.features``) and :func:`attnpatch.patch` refuses a method that lacks one.
MODEL_FEATURES: dict[str, str] = {
    "sliding_window": "sliding-window (local) attention layers",
    "softcap": "attention logit soft-capping (tanh(logits / cap) * cap)",
    "layer_types": "attention layer types other than full attention",
    "attention_sinks": "learned attention-sink logits (an extra softmax column per head)",
    "logit_bias": "an additive bias on the attention logits (relative position bias)",
    "value_head_dim": "a value head size different from the query/key head size",
}

#: Model (tower) kinds the adapters report, in words.
MODEL_KINDS: dict[str, str] = {
    "causal_lm": "causal LM (prefill; decoding runs exact)",
    "vision": "vision (ViT, bidirectional)",
    "text": "text encoder (CLIP / SigLIP / BERT-style)",
}


@dataclass(frozen=True)
class ModelGeometry:
    """What a method's :attr:`Method.check` knows about the routed attention of a model (built by the adapter).

    Attributes:
        num_layers: attention layers the patch routes.
        heads: query heads per layer, or ``None`` where the adapter cannot tell.
        kv_heads: key/value heads per layer (``heads`` without grouped-query attention), or ``None``.
        head_dim: size of a query/key head, or ``None``.
        tokens: tokens per call where fixed by the model (a ViT at its configured resolution), else ``None``.
        kind: the routed towers' kind (``"causal_lm"``, ``"vision"``, ``"vision+text"``, ...).
    """

    num_layers: int
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    tokens: int | None = None
    kind: str = ""


@dataclass(frozen=True)
class ExactLimit:
    """The options that make a method compute exact attention (its "exact limit").

    Attributes:
        options: ``options(tokens)`` -> the option values that make the method exact on calls of
            ``tokens`` tokens: ``patch(model, name, **options(n))`` computes what the unpatched
            model computes (to float rounding where the method evaluates exact attention in its own code).
        at_least: options whose larger values are exact too (``fna``'s ``s``: every ``s >= N``).
        text: the condition in words, e.g. ``"s >= N"``.
        everywhere: option values exact on calls of every length, where ``options(tokens)`` depends on the
            length (``fna``: ``min_tokens`` above any input); ``None`` when no such setting exists or
            ``options`` does not depend on the length (see :meth:`Method.exact_everywhere`).
    """

    options: Callable[[int], dict[str, Any]]
    at_least: tuple[str, ...] = ()
    text: str = ""
    everywhere: dict[str, Any] | None = None

    def holds(self, options: dict[str, Any], tokens: int) -> bool:
        """Whether the complete option dict ``options`` makes the method exact at ``tokens`` tokens."""
        for name, want in self.options(tokens).items():
            got = options.get(name)
            if name in self.at_least:
                if got is None or got < want:
                    return False
            elif got != want:
                return False
        return True


@dataclass(frozen=True)
class Knob:
    """A method's main knob: the one scalar ``attnpatch compare --match`` turns to put methods at one budget.

    The knob is a position ``t`` in ``[0, 1]``, 0 the sparsest (cheapest) setting it offers and 1 the
    densest; the method maps it to option values for inputs of ``N`` tokens.  The map must be
    monotone: a larger ``t`` never computes fewer query-key pairs (or keeps fewer tokens).

    Attributes:
        text: what turns, in words (``"theta, 0-30 logits"``).
        options: ``options(t, tokens) -> {option: value}``; the other options keep the user's values.
        tokens: the option that is a token count (landmarks ``s``, anchors ``m``), which
            ``--match tokens=S`` sets to ``S`` directly; ``None`` when the knob counts no tokens.
    """

    text: str
    options: Callable[[float, int], dict[str, Any]]
    tokens: str | None = None

    def at(self, t: float, tokens: int) -> dict[str, Any]:
        """The option values at knob position ``t`` (clamped to ``[0, 1]``) for ``tokens`` tokens."""
        return dict(self.options(min(1.0, max(0.0, float(t))), int(tokens)))


@dataclass(frozen=True)
class Preset:
    """A named set of option values of one method: ``patch(model, name, preset="fast")``.

    The preset's values replace the defaults; options given beside it win over both
    (``patch(model, "anchor_attention", preset="fast", theta=10)``).  What each preset costs and
    keeps is measured in BENCHMARKS.md and the README, not here.

    Attributes:
        options: option values (validated like user options when the method registers).
        text: what the preset is for, in one line.
    """

    options: dict[str, Any]
    text: str


@dataclass(frozen=True)
class Method:
    """A registered attention method.

    Attributes:
        name: registry key, e.g. ``"anchor_attention"``.
        summary: one line.
        source: paper and section the algorithm follows.
        options: the method's options, by name (:func:`~attnpatch.options.options_of`).
        model_kinds: model kinds it fits: ``"causal_lm"`` (decoder prefill), ``"vision"`` (bidirectional encoder).
        make_config: builds the config object from the validated option dict.
        forward: ``forward(config, q, k, v, ctx)`` with ``q`` ``[B, H, Lq, D]``, ``k, v``
            ``[B, Hkv, Lk, D]`` and ``ctx`` a :class:`~attnpatch.patchers.state.LayerContext`
            (layer index, scale, positions, padding, token roles, per-forward state); returns
            ``(out [B, H, Lq, D] or None, LayerRecord)`` where ``None`` asks the adapter to run
            the model's exact attention for this call.
        check: ``check(config, geometry)`` run at patch time against the routed attention's
            :class:`ModelGeometry` (layer and head ranges; raises
            :class:`~attnpatch.errors.OptionError`), or ``None``.
        exact: the method computes the model's own attention (``dense``): it fits every tower
            and every model feature, and keeps autograd.
        supports: the model features of :data:`MODEL_FEATURES` the method implements exactly;
            ``patch()`` refuses a model that uses any other one (an exact method supports all).
        causal_calls: it handles causal attention calls.
        noncausal_calls: it handles bidirectional attention calls.
        key_padding: it handles key-padding masks (some keys of a sequence hidden).
        token_roles: the token roles it reads from the :class:`~attnpatch.patchers.state.LayerContext`
            (``"prefix"``: the leading CLS / register tokens; ``"hidden"``: the attention input;
            ``"residual"``: the block input).
        exact_limit_decl: the options that make it exact (:class:`ExactLimit`); ``None`` for an
            exact method (no options needed) and for a method that has no exact setting.
        bench_hook: ``bench_hook(config, q, k, v, inputs) -> BenchCase``: how to benchmark one
            attention layer (see :mod:`.bench_hook`); ``None`` runs the forward on a synthetic
            layer context (:func:`~attnpatch.patchers.bench_hook.default_bench`).
        details: a paragraph for the README's method table (default: ``summary``).
        small_settings: by model kind, options that make an approximate method approximate (some
            layer not dense) on inputs of a few dozen tokens: the contract battery
            (``tests/test_contract_battery.py``) runs its checks with them as well as with the
            defaults, and requires them of every approximate method for every kind it fits.
        knob: the method's main knob (:class:`Knob`) that ``attnpatch compare --match`` turns, or
            ``None`` (exact methods, and methods with no budget to match).
        block_hook: ``block_hook(config, x, ctx) -> x`` for a method that changes the token count
            between blocks (ToMe): the adapters run it on each routed block's residual stream
            ``[B, N, C]`` between the attention and the MLP branch (``ctx`` as for the forward, of
            that block's attention layer), and it returns ``[B, N', C]``; ``None`` for a method that
            only replaces attention.  ``patch()`` refuses such a method on a model whose adapter
            cannot split its blocks that way.
        presets: named option sets (:class:`Preset`), chosen with the pseudo-option ``preset``;
            empty for a method without presets.
        tune_space: ``tune_space(geometry) -> [options, ...]``: the candidate settings ``attnpatch tune``
            measures on a model of that :class:`ModelGeometry` (each a partial option dict, validated
            like user options); ``None`` for a method the tuner does not search.  Where the method has a
            ``dense_heads`` option and records recall, the tuner adds per-head decisions on top.
    """

    name: str
    summary: str
    source: str
    options: dict[str, Option]
    model_kinds: frozenset[str]
    make_config: Callable[[dict[str, Any]], Any]
    forward: Callable[..., tuple[torch.Tensor | None, LayerRecord]]
    check: Callable[[Any, ModelGeometry], None] | None = None
    exact: bool = False
    supports: frozenset[str] = frozenset()
    causal_calls: bool = True
    noncausal_calls: bool = True
    key_padding: bool = True
    token_roles: frozenset[str] = frozenset()
    exact_limit_decl: ExactLimit | None = None
    bench_hook: Callable[..., BenchCase] | None = None
    details: str = ""
    small_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    knob: Knob | None = None
    block_hook: Callable[..., torch.Tensor] | None = None
    presets: dict[str, Preset] = field(default_factory=dict)
    tune_space: Callable[[ModelGeometry], list[dict[str, Any]]] | None = None

    @property
    def pseudo_options(self) -> list[str]:
        """The option names :func:`validate_options` takes beside the method's own: ``preset`` (where it has
        presets) and ``config`` (where it has options to save)."""
        return (["preset"] if self.presets else []) + (["config"] if self.options else [])

    def build_config(self, options: dict[str, Any]) -> Any:
        """The config object of a complete option dict (:func:`validate_options`'s result; its ``config`` path,
        if any, is not an option of the method and is left out)."""
        return self.make_config({k: v for k, v in options.items() if k != "config"})

    def fits(self, kind: str) -> bool:
        """Whether the method fits a tower of model kind ``kind`` (an exact method fits every kind)."""
        return self.exact or kind in self.model_kinds

    def lacks(self, features: dict[str, str]) -> dict[str, str]:
        """The entries of ``features`` (model feature -> description) this method does not implement."""
        if self.exact:
            return {}
        return {f: d for f, d in features.items() if f not in self.supports}

    def exact_limit(self, tokens: int) -> dict[str, Any] | None:
        """Options that make the method exact on calls of ``tokens`` tokens: ``{}`` for an exact
        method, ``None`` when no setting is exact; ``patch(model, name, **exact_limit(n))`` then
        computes what the unpatched model computes."""
        if self.exact:
            return {}
        if self.exact_limit_decl is None:
            return None
        return dict(self.exact_limit_decl.options(tokens))

    def exact_everywhere(self) -> dict[str, Any] | None:
        """Options that make the method exact on calls of every length (``anchor_attention``: ``theta=inf``),
        for a saved config that must stay exact on inputs of another size; ``None`` when the exact setting
        depends on the length (``nystromformer``: ``s >= N``)."""
        if self.exact:
            return {}
        if self.exact_limit_decl is None:
            return None
        if self.exact_limit_decl.everywhere is not None:
            return dict(self.exact_limit_decl.everywhere)
        short, long = self.exact_limit_decl.options(1), self.exact_limit_decl.options(2**31 - 1)
        return dict(short) if short == long else None

    def is_exact(self, options: dict[str, Any], tokens: int) -> bool:
        """Whether the complete option dict ``options`` makes the method exact at ``tokens`` tokens."""
        if self.exact:
            return True
        return self.exact_limit_decl is not None and self.exact_limit_decl.holds(options, tokens)

    def exactness(self) -> str:
        """In words: ``"exact"``, or ``"approximate; exact when <condition>"``."""
        if self.exact:
            return "exact"
        if self.exact_limit_decl is None:
            return "approximate"
        return f"approximate; exact when {self.exact_limit_decl.text}"

    def bench(self, config: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: BenchInputs) -> BenchCase:
        """How to benchmark one attention layer on ``q, k, v``: the method's hook, else :func:`default_bench`."""
        if self.bench_hook is not None:
            return self.bench_hook(config, q, k, v, inputs)
        return default_bench(self.forward, config, q, k, v, inputs)

    def describe(self) -> dict[str, Any]:
        """Plain-data description: name, summary, source, model kinds, capabilities, options with defaults and help."""
        return {
            "name": self.name,
            "summary": self.summary,
            "source": self.source,
            "model_kinds": sorted(self.model_kinds),
            "exact": self.exact,
            "exactness": self.exactness(),
            "supports": sorted(MODEL_FEATURES) if self.exact else sorted(self.supports),
            "calls": {"causal": self.causal_calls, "noncausal": self.noncausal_calls, "key_padding": self.key_padding},
            "token_roles": sorted(self.token_roles),
            "options": {o.name: o.describe() for o in self.options.values()},
            "presets": {n: {"text": p.text, "options": dict(p.options)} for n, p in self.presets.items()},
        }


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add ``method`` to the registry.

    Raises:
        ValueError: a method of that name is already registered, or one of its presets sets an
            unknown option or a value its option refuses.
    """
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    for name, p in method.presets.items():
        try:
            validate_options(method, dict(p.options))
        except OptionError as e:
            raise ValueError(f"method {method.name!r}, preset {name!r}: {e}") from None
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The registered method called ``name``.

    Raises:
        UnknownMethodError: no such method; the message lists the registered ones.
    """
    if name not in METHODS:
        raise UnknownMethodError(f"unknown method {name!r}; registered methods: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def list_methods() -> list[dict[str, Any]]:
    """Every registered method as a plain dict (see :meth:`Method.describe`), sorted by name."""
    return [METHODS[n].describe() for n in sorted(METHODS)]


def validate_options(method: Method, options: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults, check names, types and declared ranges, and build the method config once
    for its cross-option checks.

    The pseudo-option ``preset`` (a name of :attr:`Method.presets`) puts the preset's values in
    place of the defaults; the pseudo-option ``config`` (the path of a JSON config, see
    :func:`load_config`) puts its saved options over those; the other options given win over both.

    Returns:
        The complete option dict (defaults included; ``preset`` replaced by the values it stands for;
        ``config`` kept beside the values it stands for, so that passing the dict on to ``patch()``
        still checks the model against the config's recorded geometry).

    Raises:
        OptionError: unknown option name (the message lists the allowed ones), unknown preset (the
            message lists the method's presets), a config file that cannot be read, is for another
            method or holds a bad option (the message names the file), a preset beside a config, wrong type or out-of-range value (the message
            names the value and what is allowed).
    """
    options = dict(options)
    base = {n: o.default for n, o in method.options.items()}
    config = None
    if "config" in options and "config" in method.pseudo_options:  # else refused below as unknown
        config = options.pop("config")
        if isinstance(config, Path):
            config = str(config)
        if not isinstance(config, str):
            raise OptionError(f"config={config!r}: must be the path of a JSON config (a string)")
        if "preset" in options:
            raise OptionError(
                f"preset={options['preset']!r} and config={config!r}: give one of them (a saved config holds every option; "
                "options given beside a config win over it)"
            )
        saved = load_config(config, method)["options"]
        if "config" in saved:
            raise OptionError(f"config={config!r}: its options name another config ({saved['config']!r}); a config cannot")
        try:
            base = validate_options(method, saved)
        except OptionError as e:
            raise OptionError(f"config={config!r}: {e}") from None
    if "preset" in options:
        name = options.pop("preset")
        if not method.presets:
            raise OptionError(f"preset={name!r}: method {method.name!r} has no presets")
        if not isinstance(name, str) or name not in method.presets:
            raise OptionError(f"preset={name!r} for method {method.name!r}: allowed: {', '.join(method.presets)}")
        for n, v in method.presets[name].options.items():
            base[n] = method.options[n].coerce(v)
    unknown = sorted(set(options) - set(method.options))
    if unknown:
        names = list(method.options) + method.pseudo_options
        allowed = f"allowed: {', '.join(names)}" if names else "it takes no options"
        raise OptionError(f"unknown option(s) {', '.join(unknown)} for method {method.name!r}; {allowed}")
    full = base
    for n, v in options.items():
        full[n] = method.options[n].coerce(v)
    method.build_config(full)  # cross-option checks live in the config's constructor
    if config is not None:
        full["config"] = config  # kept, so that patch() checks the model against the geometry the config records
    return full


# --------------------------------------------------------------------------- saved configs (config=PATH)

#: Geometry fields a saved config may record and :func:`check_config_geometry` compares.
_GEOMETRY_FIELDS = ("num_layers", "heads", "kv_heads", "head_dim")


def write_config(path: str | Path, method: Method | str, options: dict[str, Any], geometry: ModelGeometry | None = None,
                 **extra: Any) -> Path:
    """Write ``{"method", "options", "geometry", ...extra}`` as JSON to ``path``, for ``patch(model, method, config=path)``.

    ``options`` are validated first (:func:`validate_options`); ``geometry`` is the model's
    (:class:`ModelGeometry`) when the options name its layers or heads, so that loading them on another
    model is refused; ``extra`` holds plain data (what was measured, how it was chosen).

    Raises:
        UnknownMethodError: ``method`` is a name no method is registered under.
        OptionError: an option is invalid.
    """
    if isinstance(method, str):
        method = get_method(method)
    full = validate_options(method, options)
    full.pop("config", None)
    data = {"method": method.name, "options": full}  # tuples are written as JSON lists
    if geometry is not None:
        data["geometry"] = {k: v for k, v in asdict(geometry).items() if k in _GEOMETRY_FIELDS and v is not None}
    data.update(extra)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")  # serialised whole before the file is opened
    return path


def load_config(path: str | Path, method: Method | None = None) -> dict[str, Any]:
    """Read a saved config (``config=PATH``): ``{"method": NAME, "options": {...}, "geometry": {...}}``.

    Infinite floats may be written as JSON's ``Infinity``.  Only ``options`` (and ``geometry``, checked
    by :func:`check_config_geometry` at ``patch()``) are used; other keys are notes.

    Raises:
        OptionError: the file is missing or not such a JSON object, or it is for a method other than ``method``.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise OptionError(f"config={str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OptionError(f"config={str(path)!r}: not a readable JSON config ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("options"), dict) or not isinstance(data.get("method"), str):
        raise OptionError(f"config={str(path)!r}: expected a JSON object with \"method\" (a name) and \"options\" (an object)")
    geo = data.get("geometry")
    if geo is not None and (not isinstance(geo, dict) or any(
            not isinstance(geo.get(k, 0), int) or isinstance(geo.get(k), bool) for k in _GEOMETRY_FIELDS)):
        raise OptionError(f"config={str(path)!r}: \"geometry\" must be an object of integers ({', '.join(_GEOMETRY_FIELDS)})")
    if method is not None and data["method"] != method.name:
        raise OptionError(f"config={str(path)!r} is a config for method {data['method']!r}, not {method.name!r}")
    return data


def check_config_geometry(path: str | Path, geometry: ModelGeometry, model_name: str) -> None:
    """Refuse a saved config whose recorded geometry differs from the model's.

    Raises:
        OptionError: a recorded field (layers, heads, KV heads, head size) differs; the message gives both.
    """
    saved = load_config(path).get("geometry") or {}
    have = asdict(geometry)
    diff = [f"{k} {saved[k]} (model: {have[k]})" for k in _GEOMETRY_FIELDS if k in saved and have.get(k) is not None and saved[k] != have[k]]
    if diff:
        raise OptionError(f"config={str(path)!r} was made for another model: {', '.join(diff)}; {model_name} does not fit it")


# --------------------------------------------------------------------------- the README's method table


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _value(v: Any) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, tuple):
        return "()" if not v else repr(v)
    return repr(v) if isinstance(v, str) else str(v)


def methods_markdown() -> str:
    """The README's "Methods" table, generated from the registry (one row per method, sorted by name).

    Columns: method, model kinds, what it does (with its source), exactness, options with defaults (and
    the allowed values of string options).  ``attnpatch methods --markdown`` prints it; a test keeps the
    README's copy (between ``<!-- methods:begin -->`` and ``<!-- methods:end -->``) equal to it.
    """
    lines = [
        "| method | model kinds | what it does | exact? | options (default) |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(METHODS):
        m = METHODS[name]
        kinds = "any" if m.exact else ", ".join(MODEL_KINDS.get(k, k) for k in sorted(m.model_kinds))
        text = (m.details or m.summary).rstrip()
        what = f"{text}{'' if text.endswith('.') else '.'} Source: {m.source}."
        opts = ", ".join(
            f"`{o.name}={_value(o.default)}`" + (f" ({'/'.join(o.choices)})" if o.choices else "") for o in m.options.values()
        ) or "none"
        if m.presets:
            opts += "; presets: " + ", ".join(f"`{p}`" for p in m.presets)
        lines.append(f"| `{name}` | {_cell(kinds)} | {_cell(what)} | {_cell(m.exactness())} | {_cell(opts)} |")
    return "\n".join(lines) + "\n"
