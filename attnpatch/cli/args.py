"""What the command modules share for parsing: the default models, option and method-spec parsing
(``-o NAME=VALUE``, ``METHOD:NAME=VALUE,...``) and the argparse value types and actions."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from ..errors import AttnpatchError

__all__ = [
    "DEFAULT_MODEL", "DEFAULT_VISION_MODEL", "DEFAULT_CLIP_MODEL", "parse_options", "method_spec", "unique_settings",
    "check_fits",
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


def positive_seconds(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < val < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number of seconds")
    return val
