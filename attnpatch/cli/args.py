"""What the command modules share for parsing: the default models, option and method-spec parsing
(``-o NAME=VALUE``, ``METHOD:NAME=VALUE,...``) and the argparse value types and actions."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from ..errors import AttnpatchError

__all__ = [
    "DEFAULT_MODEL", "DEFAULT_VISION_MODEL", "DEFAULT_CLIP_MODEL", "parse_options", "method_spec", "unique_settings", "checked_settings",
    "tower_settings", "check_fits", "Parser", "OneSetting",
    "Repeatable", "positive_int", "nonnegative_int", "fraction", "positive_seconds",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_VISION_MODEL = "dinov2-small"
DEFAULT_CLIP_MODEL = "ViT-B-32:openai"


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["theta=12", "dense_layers=17,18"]`` -> ``{"theta": "12", "dense_layers": "17,18"}`` (typed later by the registry)."""
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise AttnpatchError(f"option {p!r}: expected NAME=VALUE (e.g. -o theta=12, or METHOD:s=32)")
        k, v = p.split("=", 1)
        k = k.strip().replace("-", "_")
        if not k:
            raise AttnpatchError(f"option {p!r}: the NAME before '=' is empty; expected NAME=VALUE (e.g. -o theta=12)")
        if k in out:
            raise AttnpatchError(f"option {k} given twice ({k}={out[k]} and {k}={v.strip()}): give each option once")
        out[k] = v.strip()
    return out


def method_spec(spec: str, common: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """``"fna:s=32,sample_layer=0"`` -> ``("fna", {"s": "32", "sample_layer": "0"})``; ``-o`` options apply to every method."""
    name, _, rest = spec.partition(":")
    own = [p for p in rest.split(",") if p.strip()] if rest else []
    return name, {**parse_options(common), **parse_options(own)}


def unique_settings(specs: Sequence[str], common: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    out = [method_spec(m, common) for m in specs]
    seen = set()
    for m, o in out:
        key = (m, tuple(sorted(o.items())))
        if key in seen:
            raise AttnpatchError(f"--method {m} with options {o or '{}'} is given twice")
        seen.add(key)
    return out


def checked_settings(specs: Sequence[str], common: Sequence[str], kind: str) -> list[tuple[str, dict[str, Any]]]:
    """:func:`unique_settings`, each method checked to fit ``kind`` (:func:`check_fits`) and its options validated, before
    any model loads (the options are kept as given)."""
    from ..patchers.registry import get_method, validate_options

    settings = unique_settings(specs, common)
    for m, o in settings:
        check_fits(m, kind)
        validate_options(get_method(m), o)
    return settings


#: The towers of a VLM a per-tower setting names, and the kind of model each is.
VLM_TOWERS = {"vision": "vision", "text": "causal_lm"}


def tower_settings(specs: Sequence[str], common: Sequence[str]) -> list[tuple[Any, dict[str, Any]]]:
    """Settings for a VLM, checked before it loads: ``vision=fna:s=32+text=anchor_attention:preset=accurate`` is one
    setting with one method per tower (``TOWER=METHOD[:NAME=VALUE,...]`` parts joined by ``+``; ``-o`` options are not
    applied to them), returned as ``({tower: (method, options)}, {})``; a plain ``METHOD[:...]`` routes the tower its
    method fits (a vision method the vision tower, a causal-LM method the language model).

    Raises:
        AttnpatchError: an unknown tower, a tower named twice, a method that does not fit its tower, a setting given twice.
        UnknownMethodError / OptionError: an unknown method or a bad option.
    """
    import re

    from ..patchers.registry import get_method, validate_options

    out, seen = [], set()
    for spec in specs:
        if re.match(r"^[A-Za-z_]+=", spec):
            per: dict[str, tuple[str, dict[str, Any]]] = {}
            for part in re.split(r"\+(?=[A-Za-z_]+=)", spec):
                tower, _, rest = part.partition("=")
                if tower not in VLM_TOWERS:
                    raise AttnpatchError(f"--method {spec}: {tower!r} is not a tower; a VLM's towers are "
                                         f"{', '.join(VLM_TOWERS)} (TOWER=METHOD[:NAME=VALUE,...], joined by '+')")
                if tower in per:
                    raise AttnpatchError(f"--method {spec}: the {tower} tower is given twice")
                m, o = method_spec(rest, [])
                if not get_method(m).fits(VLM_TOWERS[tower]):
                    raise AttnpatchError(f"--method {spec}: method {m!r} does not fit the {tower} tower (a "
                                         f"{VLM_TOWERS[tower].replace('_', ' ')} tower; {m!r} fits: "
                                         f"{', '.join(sorted(get_method(m).model_kinds))})")
                validate_options(get_method(m), o)
                per[tower] = (m, o)
            setting: tuple[Any, dict[str, Any]] = ({t: per[t] for t in VLM_TOWERS if t in per}, {})
        else:
            m, o = method_spec(spec, common)
            tower = "vision" if get_method(m).fits("vision") else "text"
            check_fits(m, VLM_TOWERS[tower])
            validate_options(get_method(m), o)
            setting = ({tower: (m, o)}, {})
        key = repr(sorted((t, m, sorted(o.items())) for t, (m, o) in setting[0].items()))
        if key in seen:
            raise AttnpatchError(f"--method {spec}: the same setting is given twice")
        seen.add(key)
        out.append(setting)
    return out


def check_fits(method: str, kind: str) -> None:
    """Refuse, before a model loads, a method that does not fit the kind of model the command loads (``"causal_lm"``,
    ``"vision"``): one line naming the method, the model kind and the kinds it fits.

    Raises:
        UnknownMethodError: an unknown method.  AttnpatchError: the method does not fit.
    """
    from ..patchers.registry import get_method

    meth = get_method(method)
    if not meth.fits(kind):
        raise AttnpatchError(f"method {method!r} does not fit a {kind.replace('_', ' ')} model (it fits: "
                             f"{', '.join(sorted(meth.model_kinds))})")


def _int_at_least(text: str, lo: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < lo:
        raise argparse.ArgumentTypeError(f"{value} is not {what}")
    return value


class Parser(argparse.ArgumentParser):
    """The ``attnpatch`` parser and every subcommand's (``add_subparsers`` makes subparsers of the parser's own class):
    an argument no parser of the command line takes is that subcommand's error, printed with its own usage
    (``attnpatch eval ruler: error: unrecognized arguments: ...``).  argparse alone hands a subcommand's leftovers up
    to the top-level parser, which prints the usage of ``attnpatch`` itself.

    ``parse_known_args`` therefore returns no leftovers: it exits with status 2 on them, as ``parse_args`` does.
    """

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


class OneSetting(argparse.Action):
    """An option that takes one value, once: a second ``--method`` is the subcommand's argparse error, naming both
    values and ``hint`` (where several settings run), where argparse alone keeps the last one silently.  (A second
    value after one ``--method``, ``--method a b``, is an unrecognized argument: :class:`Parser`.)"""

    def __init__(self, option_strings, dest, hint: str = "", **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        seen = f"_{self.dest}_given"
        if hasattr(namespace, seen):
            raise argparse.ArgumentError(self, f"takes one setting, got {getattr(namespace, seen)} and {values}"
                                         + (f"; {self.hint}" if self.hint else ""))
        setattr(namespace, seen, values)
        setattr(namespace, self.dest, values)


class Repeatable(argparse.Action):
    """A ``nargs="+"`` option that may also be repeated: ``--method a --method b`` keeps both
    (argparse's default keeps the last); the values replace the default, they do not extend it."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        if current is None or current is self.default:
            current = []
        setattr(namespace, self.dest, [*current, *values])


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 1]")
    return value


def _positive_number(text: str, what: str, rule: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not 0 < val < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be {rule}")
    return val


def positive_float(text: str) -> float:
    return _positive_number(text, "a number", "a positive finite number")


def positive_seconds(text: str) -> float:
    return _positive_number(text, "a number of seconds", "a positive number of seconds")
