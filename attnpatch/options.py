"""Method options: one declaration per option (kind, default, help, choices, nullable, range).

An option is declared once, on the field of the method's config dataclass::

    @dataclass(frozen=True)
    class FNAConfig:
        s: int = field(default=64, metadata=opt("int", "landmarks per image (tokens)", low=1))

:func:`options_of` builds the :class:`Option` objects the registry, ``patch()`` and the command
line use; :func:`check_fields` lets a config's ``__post_init__`` run the same checks on a directly
constructed config.  This module depends on :mod:`attnpatch.errors` only, so that configs that
live with their math (``AnchorConfig`` in :mod:`attnpatch.attention.anchor`) declare their options
the same way as the patchers' own.
"""

from __future__ import annotations

import dataclasses
import math
import re
import numbers
from dataclasses import dataclass
from typing import Any

from .errors import OptionError

__all__ = ["Option", "opt", "options_of", "check_fields", "KINDS", "at_layer", "parse_schedule"]

_META_KEY = "attnpatch_option"

#: Option kinds and how a wrong value is described.
KINDS: dict[str, str] = {
    "float": "a number",
    "int": "an integer",
    "str": "a string",
    "bool": "true or false",
    "int_or_auto": "an integer or 'auto'",
    "int_list": "a list of integers (e.g. [17, 18] or '17,18')",
    "pair_list": "a list of (layer, head) pairs (e.g. [(17, 3)] or '17:3,18:0')",
    "int_schedule": "an integer, or one integer per layer (e.g. [0, 0, 16, 16], '0/0/16/16' or '0*2/16*2')",
}


@dataclass(frozen=True)
class Option:
    """One option of a method.

    Attributes:
        name: keyword name passed to :func:`attnpatch.patch`.
        kind: one of :data:`KINDS`: ``"float"``, ``"int"``, ``"str"``, ``"bool"``, ``"int_or_auto"``
            (an int or the string ``"auto"``), ``"int_list"`` (list of ints) or ``"pair_list"``
            (list of ``(layer, head)`` pairs).
        default: the value used when the option is not given.
        help: one line, with units.
        choices: allowed values for ``"str"`` options; for ``"int_or_auto"`` the allowed words besides an integer
            (default ``("auto",)``).
        nullable: ``None`` (or the string ``"none"``) is an allowed value.
        low, high: the allowed range of a number (``None``: unbounded on that side); NaN is never
            allowed for ``"float"`` options.
        low_open, high_open: the bound itself is excluded.
        finite: infinities are refused.
        rule: the text after ``"name=value: "`` when the value is out of range (default: generated
            from the range, e.g. ``"must be an integer >= 1"``).
        model_scope: why the option acts on the model as a whole rather than on one attention call
            (e.g. ``"act across layers"``); such options do not apply to a one-layer benchmark.
    """

    name: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    nullable: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = False
    rule: str | None = None
    model_scope: str | None = None

    def coerce(self, value: Any) -> Any:
        """Check ``value``'s type (accepting CLI strings) and range and return it normalised.

        Raises:
            OptionError: the value's type does not fit ``kind``, is not among ``choices``, or is out of range.
        """
        value = self._typed(value)
        if value is not None and not isinstance(value, str) and not self.in_range(value):
            shown = list(value) if isinstance(value, tuple) and self.kind == "int_schedule" else value
            raise OptionError(f"{self.name}={shown!r}: {self.rule or 'must be ' + (self.range_text() or 'a number, not NaN')}")
        return value

    def in_range(self, value: Any) -> bool:
        """Whether a typed number (or every number of a list) lies in the declared range."""
        if isinstance(value, tuple):
            # a schedule's 0 entry is that layer left exact, whatever the scalar range
            return all((self.kind == "int_schedule" and x == 0) or self.in_range(x) for x in value)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return True
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.finite and math.isinf(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def range_text(self) -> str:
        """The declared range in words, e.g. ``"an integer >= 1"``, ``"a number in (0, 1)"``; ``""`` if none."""
        what = {"int": "an integer", "int_schedule": "an integer (a per-layer list: each entry 0 or such)",
                "int_or_auto": f"{self._words()} or an integer", "float": "a number"}.get(self.kind, "")
        if self.nullable and what:
            what = "None or " + what
        if self.low is not None and self.high is not None:
            lo, hi = ("(" if self.low_open else "["), (")" if self.high_open else "]")
            text = f"{what} in {lo}{_num(self.low)}, {_num(self.high)}{hi}"
        elif self.low is not None:
            text = f"{what} {'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            text = f"{what} {'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            return ""
        return ("a finite " + text[2:] if self.finite and text.startswith("a ") else text).strip()

    def _auto_words(self) -> tuple[str, ...]:
        """The words an ``"int_or_auto"`` option takes besides an integer: its ``choices``, else ``("auto",)``."""
        return self.choices or ("auto",)

    def _words(self) -> str:
        """:meth:`_auto_words` quoted for a message: ``"'auto'"``, ``"one of 'auto', 'auto-fast'"``."""
        words = [repr(w) for w in self._auto_words()]
        return words[0] if len(words) == 1 else "one of " + ", ".join(words)

    def _typed(self, value: Any) -> Any:
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
                    if value.strip().lower() in self._auto_words():
                        return value.strip().lower()
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
            if self.kind == "int_schedule":
                return parse_schedule(value)
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
            kind = f"an integer or {self._words()}" if self.kind == "int_or_auto" else KINDS[self.kind]
            raise OptionError(f"{where}: expected {kind}" + (" (or none)" if self.nullable else "")) from None
        raise AssertionError(self.kind)

    def describe(self) -> dict[str, Any]:
        """Plain data: kind, default, help, and choices / nullable / range where declared."""
        out: dict[str, Any] = {"kind": self.kind, "default": self.default, "help": self.help}
        if self.choices:
            out["choices"] = list(self.choices)
        if self.nullable:
            out["nullable"] = True
        if self.range_text():
            out["range"] = self.range_text()
        if self.model_scope:
            out["model_scope"] = self.model_scope
        return out


def parse_schedule(value: Any) -> int | tuple[int, ...]:
    """An ``"int_schedule"`` value: an integer (every layer), or one integer per layer as a list or a string.

    The string form separates layers by ``/``, ``,`` or spaces (``/`` fits inside a ``METHOD:NAME=VALUE,...``
    setting) and ``V*C`` repeats ``V`` ``C`` times: ``"0*4/16*8"`` is four 0 then eight 16.  A one-entry list is
    kept as a list (its length is checked against the model's layers at ``patch()``).

    Raises:
        TypeError, ValueError: not an integer, a list of integers or such a string.
    """
    if isinstance(value, str):
        text = value.strip().removeprefix("[").removesuffix("]").strip()
        if not text or text[0] in "/," or text[-1] in "/," or re.search(r"[/,]\s*[/,]", text):
            raise ValueError(value)  # an empty entry: "8,", "/8", "0*4/", "8//8"
        parts = text.replace("/", " ").replace(",", " ").split()
        listed = any(sep in value for sep in "/, *") or value.strip().startswith("[")
        out: list[int] = []
        for part in parts:
            part = part.strip("[]()")
            v, star, c = part.partition("*")
            count = int(c) if star else 1
            if count < 1:
                raise ValueError(part)
            out.extend([int(v)] * count)
        return tuple(out) if listed else out[0]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    out_t = tuple(value)
    if not out_t or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in out_t):
        raise TypeError
    return tuple(int(x) for x in out_t)


def at_layer(value: int | tuple[int, ...], layer: int) -> int:
    """An ``"int_schedule"`` option's value at ``layer`` (0-based): the integer itself, or the layer's entry."""
    return value[layer] if isinstance(value, tuple) else value


def _num(x: float) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return repr(x)


def opt(
    kind: str,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    nullable: bool = False,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = False,
    rule: str | None = None,
    model_scope: str | None = None,
) -> dict[str, Any]:
    """Field metadata declaring a config field as a method option (see :class:`Option` for the arguments).

    Use as ``field(default=..., metadata=opt(...))``.
    """
    if kind not in KINDS:
        raise ValueError(f"option kind {kind!r}: one of {', '.join(KINDS)}")
    spec = dict(kind=kind, help=help, choices=tuple(choices) if choices else None, nullable=nullable, low=low, high=high,
                low_open=low_open, high_open=high_open, finite=finite, rule=rule, model_scope=model_scope)
    return {_META_KEY: spec}


def options_of(cls: type) -> dict[str, Option]:
    """The :class:`Option` of every field of the config dataclass ``cls``, in field order: each
    field's ``metadata=opt(...)`` declaration with the field's default.

    Raises:
        TypeError: a field without a declaration.
    """
    out: dict[str, Option] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META_KEY)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name}: no option declaration (metadata=opt(...))")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out[f.name] = Option(f.name, default=default, **meta)
    return out


def check_fields(config: Any) -> None:
    """Run every declared field of a config dataclass through :meth:`Option.coerce` and store the
    normalised value (for a frozen dataclass too); a config's ``__post_init__`` calls it so that a
    config built directly is checked like one built from options.

    Raises:
        OptionError: a field of the wrong type or out of range.
    """
    for name, option in options_of(type(config)).items():
        value = option.coerce(getattr(config, name))
        object.__setattr__(config, name, value)
