"""Needle-in-a-haystack tasks (RULER's retrieval family): ``niah_single``, ``niah_multikey``,
``niah_multivalue``, ``niah_multiquery`` -- needles, prompt templates and the sample builder."""

from __future__ import annotations

from typing import Sequence

from .haystack import Haystack
from .words import ADJECTIVES, NOUNS

__all__ = ["NEEDLE", "NIAH_TEMPLATE", "NIAH_ANSWER_PREFIX", "NIAH_SINGLE_TEMPLATE", "NIAH_SINGLE_ANSWER_PREFIX"]

_NIAH_NEEDLES = {  # task -> (number of keys in the text, values per key, keys queried)
    "niah_single": (1, 1, 1),
    "niah_multikey": (4, 1, 1),
    "niah_multivalue": (1, 4, 1),
    "niah_multiquery": (4, 1, 4),
}

NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
NIAH_SINGLE_TEMPLATE = (
    "A special magic {type_v} is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What is the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_SINGLE_ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text is"


def _join_query(keys: Sequence[str]) -> str:
    return ", ".join(keys[:-1]) + ", and " + keys[-1] if len(keys) > 1 else keys[0]


def niah_builder(task, rng, hay: Haystack, depth: float):
    n_keys, n_values, n_query = _NIAH_NEEDLES[task]
    pairs = rng.sample(range(len(ADJECTIVES) * len(NOUNS)), n_keys)
    keys = [f"{ADJECTIVES[p // len(NOUNS)]}-{NOUNS[p % len(NOUNS)]}" for p in pairs]
    numbers = rng.sample(range(1_000_000, 10_000_000), n_keys * n_values)
    values = [[str(numbers[k * n_values + j]) for j in range(n_values)] for k in range(n_keys)]
    type_v = "numbers"
    needles = [NEEDLE.format(type_v=type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    queried = list(range(n_query))  # the first n_query keys are asked for
    answers = [v for k in queried for v in values[k]]
    query = _join_query([keys[k] for k in queried])
    if n_query * n_values == 1:
        template, prefix, type_v = NIAH_SINGLE_TEMPLATE, NIAH_SINGLE_ANSWER_PREFIX, "number"
    else:
        template, prefix = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX
    # needles[0] carries answers[0]; it goes at `depth`, the others at random depths
    inserts = [(depth, needles[0])] + [(rng.random(), nd) for nd in needles[1:]]
    start = rng.randrange(len(hay.units))
    answer_prefix = prefix.format(type_v=type_v, query=query)

    def build(n: int):
        context = hay.render(hay.take(n, start), inserts)
        return template.format(type_v=type_v, context=context, query=query), answer_prefix

    return 16, None, build, answers
