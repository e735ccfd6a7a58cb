"""The method contract: what a registered attention method is (:class:`Method`) and what it is told about a model.

A method is one :class:`Method` entry: its options (declared once, see :mod:`attnpatch.options`), what it
is and needs (exact or approximate, model kinds, the calls and model features it handles, the
token roles it reads), the options that make it exact (:class:`ExactLimit`), its main knob
(:class:`Knob`), named option sets (:class:`Preset`), a check of its options against the model
(:class:`ModelGeometry`), and how to benchmark one attention layer (:mod:`.bench_hook`).  The patch,
the adapters and the benches ask the method; none of them compares its name.  The registry of
methods is :mod:`.registry`; saved configs are :mod:`.config_file`; the table in docs/methods.md is
:mod:`.method_table`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..options import Option
from .bench_hook import BenchCase, BenchInputs, default_bench
from .state import LayerRecord

__all__ = ["Option", "Method", "ExactLimit", "Knob", "Preset", "ModelGeometry", "MODEL_FEATURES", "MODEL_KINDS"]


#: Model features an attention method may or may not implement; the adapters report which ones a
#: model uses (``adapter.features``) and :func:`attnpatch.patch` refuses a method that lacks one.
MODEL_FEATURES: dict[str, str] = {
    "sliding_window": "sliding-window (local) attention layers",
    "softcap": "attention logit soft-capping (tanh(logits / cap) * cap)",
    "layer_types": "attention layer types other than full attention",
    "attention_sinks": "learned attention-sink logits (an extra softmax column per head)",
    "logit_bias": "an additive bias on the attention logits (relative position bias)",
    "value_head_dim": "a value head size different from the query/key head size",
    "packed_sequences": (
        "several images packed into one sequence, the attention called once per image in each layer (a varlen tower "
        "with cu_seqlens, such as Qwen2-VL's)"
    ),
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
    keeps is measured in BENCHMARKS.md and docs/methods.md, not here.

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
        prepare: ``prepare(config, geometry, device, dtype)`` run at patch time after ``check``, for work that must not
            fall inside a timed forward (resolving a break-even length, :mod:`~attnpatch.patchers.break_even`), or ``None``.
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
        details: a paragraph for the method table of docs/methods.md (default: ``summary``).
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
        token_map: a ``block_hook`` method keeps, per forward, the output token each input token went to
            (:attr:`~attnpatch.patchers.state.ForwardState.token_source`), so a dense read-out can give one
            output per input patch; see :attr:`per_patch_output`.
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
    prepare: Callable[[Any, ModelGeometry, torch.device, torch.dtype], None] | None = None
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
    token_map: bool = False
    presets: dict[str, Preset] = field(default_factory=dict)
    tune_space: Callable[[ModelGeometry], list[dict[str, Any]]] | None = None

    @property
    def pseudo_options(self) -> list[str]:
        """The option names :func:`~attnpatch.patchers.registry.validate_options` takes beside the method's own: ``preset`` (where it has
        presets) and ``config`` (where it has options to save)."""
        return (["preset"] if self.presets else []) + (["config"] if self.options else [])

    def build_config(self, options: dict[str, Any]) -> Any:
        """The config object of a complete option dict (:func:`~attnpatch.patchers.registry.validate_options`'s result; its ``config`` path,
        if any, is not an option of the method and is left out)."""
        return self.make_config({k: v for k, v in options.items() if k != "config"})

    @property
    def per_patch_output(self) -> bool:
        """Whether a patched model gives one output per input patch (dense tasks): every method that keeps the
        token count, and a token-merging method that keeps its source map (:attr:`token_map`)."""
        return self.block_hook is None or self.token_map

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
            "per_patch_output": self.per_patch_output,
            "options": {o.name: o.describe() for o in self.options.values()},
            "presets": {n: {"text": p.text, "options": dict(p.options)} for n, p in self.presets.items()},
        }
