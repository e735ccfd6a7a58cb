"""The registry of attention methods and the validation of their options.

A method is one :class:`Method` entry: its options (name, type, default, help), the model
kinds it fits (``"causal_lm"``, ``"vision"``), and a factory that turns validated options
into the config object its attention function takes.  Adding a method means adding one
entry with :func:`register_method`.
"""

from __future__ import annotations

import math

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..attention.anchor import _GUARDS, _KERNELS, _SELECT_DTYPES, AnchorConfig, anchor_attention
from ..errors import OptionError, UnknownMethodError
from .state import LayerContext, LayerRecord

__all__ = ["Option", "Method", "register_method", "get_method", "list_methods", "validate_options", "METHODS", "MODEL_FEATURES"]


@dataclass(frozen=True)
class Option:
    """One option of a method.

    Attributes:
        name: keyword name passed to :func:`attnpatch.patch`.
        kind: ``"float"``, ``"int"``, ``"str"``, ``"bool"``, ``"int_or_auto"`` (an int or the
            string ``"auto"``), ``"int_list"`` (list of ints) or ``"pair_list"`` (list of
            ``(layer, head)`` pairs).
        default: the value used when the option is not given.
        help: one line, with units.
        choices: allowed values for ``"str"`` options.
        nullable: ``None`` (or the string ``"none"``) is an allowed value.
    """

    name: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    nullable: bool = False

    def coerce(self, value: Any) -> Any:
        """Check ``value``'s type (accepting CLI strings) and return it normalised.

        Raises:
            OptionError: the value's type does not fit ``kind``, or is not among ``choices``.
        """
        where = f"option {self.name}={value!r}"
        if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # numpy / torch scalars
            value = value.item()
        if self.nullable and (value is None or (isinstance(value, str) and value.strip().lower() == "none")):
            return None
        try:
            if self.kind == "float":
                if isinstance(value, str):
                    value = float(value)
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    raise TypeError
                return float(value)
            if self.kind == "int":
                if isinstance(value, str):
                    value = int(value)
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise TypeError
                return int(value)
            if self.kind == "bool":
                if isinstance(value, str):
                    low = value.strip().lower()
                    if low not in ("true", "false", "1", "0", "yes", "no"):
                        raise ValueError
                    value = low in ("true", "1", "yes")
                if not isinstance(value, bool):
                    raise TypeError
                return value
            if self.kind == "int_or_auto":
                if isinstance(value, str):
                    if value.strip().lower() == "auto":
                        return "auto"
                    value = int(value)
                if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                    raise TypeError
                return int(value)
            if self.kind == "str":
                if not isinstance(value, str):
                    raise TypeError
                if self.choices and value not in self.choices:
                    raise OptionError(f"{where}: allowed values are {', '.join(map(repr, self.choices))}")
                return value
            if self.kind == "int_list":
                if isinstance(value, str):
                    value = [int(x) for x in value.replace(",", " ").split()]
                if isinstance(value, int) and not isinstance(value, bool):
                    value = [value]
                out = tuple(value)
                if any(isinstance(x, bool) or not isinstance(x, int) for x in out):
                    raise TypeError
                return out
            if self.kind == "pair_list":
                if isinstance(value, str):  # "17:3,18:0"
                    value = [tuple(int(y) for y in x.split(":")) for x in value.replace(",", " ").split()]
                out = tuple(tuple(x) for x in value)
                if any(len(x) != 2 or any(isinstance(y, bool) or not isinstance(y, int) for y in x) for x in out):
                    raise TypeError
                return out
        except (TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, OptionError):
                raise
            raise OptionError(f"{where}: expected {_KIND_TEXT[self.kind]}" + (" (or none)" if self.nullable else "")) from None
        raise AssertionError(self.kind)


_KIND_TEXT = {
    "float": "a number",
    "int": "an integer",
    "str": "a string",
    "bool": "true or false",
    "int_or_auto": "an integer or 'auto'",
    "int_list": "a list of integers (e.g. [17, 18] or '17,18')",
    "pair_list": "a list of (layer, head) pairs (e.g. [(17, 3)] or '17:3,18:0')",
}


@dataclass(frozen=True)
class Method:
    """A registered attention method.

    Attributes:
        name: registry key, e.g. ``"anchor_attention"``.
        summary: one line.
        source: paper and section the algorithm follows.
        options: the method's options, by name.
        model_kinds: model kinds it fits: ``"causal_lm"`` (decoder prefill), ``"vision"`` (bidirectional encoder).
        make_config: builds the config object from the validated option dict.
        forward: ``forward(config, q, k, v, ctx)`` with ``q`` ``[B, H, Lq, D]``, ``k, v``
            ``[B, Hkv, Lk, D]`` and ``ctx`` a :class:`~attnpatch.patchers.state.LayerContext`
            (layer index, scale, positions, padding, token roles, per-forward state); returns
            ``(out [B, H, Lq, D] or None, LayerRecord)`` where ``None`` asks the adapter to run
            the model's exact attention for this call.
        check: ``check(config, num_layers)`` run at patch time against the model's depth
            (raises :class:`~attnpatch.errors.OptionError`), or ``None``.
        exact: the method computes the model's own attention (``dense``): it fits every tower
            and every model feature, and keeps autograd.
        supports: the model features of :data:`MODEL_FEATURES` the method implements exactly;
            ``patch()`` refuses a model that uses any other one (an exact method supports all).
    """

    name: str
    summary: str
    source: str
    options: dict[str, Option]
    model_kinds: frozenset[str]
    make_config: Callable[[dict[str, Any]], Any]
    forward: Callable[..., tuple[torch.Tensor | None, LayerRecord]]
    check: Callable[[Any, int], None] | None = None
    exact: bool = False
    supports: frozenset[str] = frozenset()

    def fits(self, kind: str) -> bool:
        """Whether the method fits a tower of model kind ``kind`` (an exact method fits every kind)."""
        return self.exact or kind in self.model_kinds

    def lacks(self, features: dict[str, str]) -> dict[str, str]:
        """The entries of ``features`` (model feature -> description) this method does not implement."""
        if self.exact:
            return {}
        return {f: d for f, d in features.items() if f not in self.supports}

    def describe(self) -> dict[str, Any]:
        """Plain-data description: name, summary, source, model kinds, options with defaults and help."""
        return {
            "name": self.name,
            "summary": self.summary,
            "source": self.source,
            "model_kinds": sorted(self.model_kinds),
            "exact": self.exact,
            "supports": sorted(MODEL_FEATURES) if self.exact else sorted(self.supports),
            "options": {
                o.name: {"kind": o.kind, "default": o.default, "help": o.help, **({"choices": list(o.choices)} if o.choices else {})}
                for o in self.options.values()
            },
        }


METHODS: dict[str, Method] = {}

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


def register_method(method: Method) -> Method:
    """Add ``method`` to the registry.

    Raises:
        ValueError: a method of that name is already registered.
    """
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
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
    """Fill defaults, check names and types, and build the method config once to check ranges.

    Returns:
        The complete option dict (defaults included).

    Raises:
        OptionError: unknown option name (the message lists the allowed ones), wrong type or
            out-of-range value (the message names the value and what is allowed).
    """
    unknown = sorted(set(options) - set(method.options))
    if unknown:
        allowed = f"allowed: {', '.join(method.options)}" if method.options else "it takes no options"
        raise OptionError(f"unknown option(s) {', '.join(unknown)} for method {method.name!r}; {allowed}")
    full = {n: o.default for n, o in method.options.items()}
    for n, v in options.items():
        full[n] = method.options[n].coerce(v)
    method.make_config(full)  # range checks live in the config's constructor
    return full


# --------------------------------------------------------------------------- methods


def _options_from_dataclass(
    cls, helps: dict[str, tuple[str, str]], nullable: tuple[str, ...] = (), choices: dict[str, tuple[str, ...]] | None = None
):
    opts = {}
    for f in dataclasses.fields(cls):
        kind, help_ = helps[f.name]
        opts[f.name] = Option(f.name, kind, f.default, help_, nullable=f.name in nullable, choices=(choices or {}).get(f.name))
    return opts


ANCHOR_OPTION_HELP = {
    "theta": ("float", "stripe threshold on anchor - score, in logits (inf = dense, -inf = initial block + window only)"),
    "block_size": ("int", "queries per query block (tokens)"),
    "init_block": ("int", "initial keys always kept (tokens)"),
    "local_window": ("int", "keys before each block's end always kept (tokens, >= block_size)"),
    "min_len": ("int", "prompts shorter than this run dense (tokens)"),
    "pool_stride": ("int", "queries averaged per pool for stripe selection (tokens; None = block_size as in the paper, 1 = per query; 2 chosen by measurement)"),
    "dense_last": ("int", "the last n prompt queries attend densely (tokens)"),
    "dense_layers": ("int_list", "layer indices that run dense attention"),
    "dense_heads": ("pair_list", "(layer, head) pairs that run dense attention"),
    "min_recall": ("float", "recall guard: heads whose kept keys carry less exact softmax mass than this on the probe blocks attend densely (0 = off)"),
    "recall_probes": ("int", "query blocks the recall guard measures per layer (guard='global')"),
    "guard": ("str", "recall guard scope, 'causal' or 'global': causal = dense/sparse per query block from probe "
              "blocks at or before it (no output depends on later tokens); global = once per head from probes over "
              "the whole prompt"),
    "select_dtype": ("str", "precision of the stripe-scoring product (bfloat16: faster selection on CPUs with native bfloat16)"),
    "kernel": ("str", "attention over kept stripes: auto = the compiled CPU kernel for float32 where it builds, else PyTorch operations"),
}

def _anchor_config(options: dict[str, Any]) -> AnchorConfig:
    return AnchorConfig(**options)


def anchor_forward(
    cfg: AnchorConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext
) -> tuple[torch.Tensor | None, LayerRecord]:
    """AnchorAttention on prefill; exact attention for decoding steps, short prompts and ``dense_layers``."""
    layer, state = ctx.layer, ctx.state
    lq, lk = q.shape[2], k.shape[2]
    if lq == 1:
        return None, LayerRecord(layer, "dense:decode", lq, lk)
    if lq < cfg.min_len:
        return None, LayerRecord(layer, "dense:short", lq, lk)
    if layer in cfg.dense_layers:
        return None, LayerRecord(layer, "dense:layer", lq, lk)
    if cfg.theta == math.inf:  # every causal key kept: the model's own attention, at no extra cost
        return None, LayerRecord(layer, "dense:theta=inf", lq, lk)
    heads = [hd for (li, hd) in cfg.dense_heads if li == layer]
    recall = bool(state is not None and state.recall)
    out, st = anchor_attention(
        q, k, v, cfg, scale=ctx.scale, q_offset=ctx.q_offset, key_valid=ctx.key_valid, dense_heads=heads,
        return_stats=ctx.record, compute_recall=recall,
    )
    rec = LayerRecord(layer, "sparse", lq, lk)
    if st is not None:
        rec.causal_pairs = st.causal_pairs.cpu()
        rec.kept_pairs = st.kept_pairs.cpu()
        rec.kept_columns = None if st.kept_columns is None else st.kept_columns.cpu()
        rec.recall = None if st.recall is None else st.recall.cpu()
    return out, rec


def dense_forward(cfg, q, k, v, ctx: LayerContext):
    """The ``dense`` baseline: always the model's exact attention."""
    return None, LayerRecord(ctx.layer, "dense", q.shape[2], k.shape[2])


register_method(
    Method(
        name="anchor_attention",
        summary="AnchorAttention sparse prefill: anchor-relative stripe selection, exact attention on kept keys; decoding dense",
        source="AnchorAttention, arXiv 2505.23520, Sec. 3 (Eq. 2-4)",
        options=_options_from_dataclass(
            AnchorConfig, ANCHOR_OPTION_HELP, nullable=("pool_stride",), choices={"kernel": _KERNELS, "select_dtype": _SELECT_DTYPES, "guard": _GUARDS}
        ),
        model_kinds=frozenset({"causal_lm"}),
        make_config=_anchor_config,
        forward=anchor_forward,
    )
)


@dataclass(frozen=True)
class DenseConfig:
    """The ``dense`` baseline has no options: exact attention through the patch machinery."""


def _dense_config(options: dict[str, Any]) -> DenseConfig:
    return DenseConfig()


register_method(
    Method(
        name="dense",
        summary="exact attention routed through the patch (a baseline and an overhead check)",
        source="softmax attention (Vaswani et al. 2017, Eq. 1)",
        options={},
        model_kinds=frozenset({"causal_lm", "vision"}),
        make_config=_dense_config,
        forward=dense_forward,
        exact=True,
    )
)
