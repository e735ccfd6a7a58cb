"""RULER-style synthetic long-context tasks: sample generation and scoring.

Written after the task definitions and prompt templates of RULER (Hsieh et al. 2024,
"RULER: What's the Real Context Size of Your Long-Context Language Models?",
arXiv 2404.06654, and its public repository's synthetic task scripts). Tasks:

``niah_single``
    One needle ``"One of the special magic numbers for {key} is: {value}."`` in a haystack;
    the question asks for the value of ``key``.
``niah_multikey``
    The target needle plus 3 distractor needles with other (distinct) keys.
``niah_multivalue``
    4 needles with the same key and 4 different values; the answer must list all 4.
``niah_multiquery``
    4 needles with 4 different keys, all queried at once; the answer must list all 4 values.
``variable_tracking``
    A chain ``VAR ABCDE = 12345``, ``VAR FGHIJ = VAR ABCDE``, ... (4 hops) interleaved with the
    haystack, after a short one-shot example; the answer is every variable holding the value.
``common_words``
    CWE: a numbered list where 10 words appear 30 times and the others 3 times (for inputs
    under 4096 tokens: 6 and 1), after a one-shot example; the answer is the 10 common words.
``frequent_words``
    FWE: random 6-letter coded words with Zipf frequencies (alpha 2.0, 2000-word vocabulary,
    the top rank replaced by the noise word ``"..."``); the answer is the 3 most frequent words.

Keys are ``adjective-noun`` words (as RULER's ``words`` keys), values are 7-digit numbers.
Lengths are in tokens of the model's own tokenizer: the haystack (or word list) is sized by
a bracketed binary search so that :func:`build_input_ids` gives between 98% and 100% of
the requested ``length`` (a search over the word count, like RULER's).

Needle depth (NIAH tasks): ``depths`` are fractions of the haystack's units (sentences of
the essay haystack, lines of the repeat haystack) that precede the target needle (the first
reference answer's needle); they cycle over the samples and default to
:data:`DEFAULT_DEPTHS`. Other needles of a sample go at random depths, as in RULER.

Everything random comes from ``random.Random(seed + i)`` for sample ``i`` and is drawn
before the haystack is sized, so the keys, values, words and depths of a sample do not
depend on the tokenizer; only the amount of filler does.
"""

from __future__ import annotations

import numbers
import random

from ...errors import DataError
from .aggregation import cwe_builder, fwe_builder
from .haystack import HAYSTACKS, get_haystack
from .niah import niah_builder
from .text import RulerSample, check_tokenizer, encode_text, fit_length
from .tracing import vt_builder

#: Task names, in the order the eval runner reports them.
TASKS: tuple[str, ...] = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "common_words",
    "frequent_words",
)

#: Default needle depths (fractions of the haystack before the target needle), cycled over samples.
DEFAULT_DEPTHS: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)

#: Generation budget in new tokens per task (RULER uses 128 for NIAH, 30 VT, 120 CWE, 50 FWE;
#: the NIAH budgets here are cut to what the answers need).
MAX_NEW_TOKENS: dict[str, int] = {
    "niah_single": 32,
    "niah_multikey": 32,
    "niah_multivalue": 64,
    "niah_multiquery": 64,
    "variable_tracking": 30,
    "common_words": 120,
    "frequent_words": 50,
}


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise DataError(f"unknown RULER task {task!r}; allowed: {', '.join(TASKS)}")


def score(task: str, prediction: str, answers: list[str]) -> float:
    """RULER's ``string_match_all`` score of one prediction, in [0, 1].

    The mean over the references of ``ref.lower() in prediction.lower()``
    (e.g. 2 of 4 values found gives 0.5).

    Raises:
        DataError: ``task`` is not one of :data:`TASKS`, or ``answers`` is empty.
    """
    _check_task(task)
    if not answers:
        raise DataError(f"score({task!r}, ...) needs at least one reference answer; got an empty list")
    pred = prediction.lower()
    return sum(1.0 for ref in answers if ref.lower() in pred) / len(answers)


def make_samples(
    task: str,
    tokenizer,
    length: int,
    num_samples: int,
    seed: int = 0,
    depths: list[float] | None = None,
    haystack: str = "repeat",
) -> list[RulerSample]:
    """Generate ``num_samples`` instances of a RULER task at a context length in tokens.

    Sample ``i`` uses ``random.Random(seed + i)``; its keys, values, words and depths depend
    only on ``task``, ``seed + i``, the depth list and (CWE) whether ``length < 4096``, not on
    the tokenizer. The filler is then sized with the tokenizer so that
    ``len(build_input_ids(tokenizer, sample))`` is at most ``length`` and, for lengths of a
    few hundred tokens and more, at least 98% of it. Source: RULER, arXiv 2404.06654.

    Args:
        task: one of :data:`TASKS`.
        tokenizer: the model's Hugging Face tokenizer; its chat template is used if it has one.
        length: target input length in tokens (the whole templated input, answer prefix included).
        num_samples: number of samples (>= 1).
        seed: base random seed.
        depths: NIAH target-needle depths in [0, 1], fractions of the haystack before the
            needle, cycled over the samples; default :data:`DEFAULT_DEPTHS`. Ignored by the
            other tasks (their ``depth`` is None).
        haystack: ``"repeat"`` (RULER's noise) or ``"essay"`` (public-domain prose, fetched on
            first use; see :mod:`attnpatch.evals.ruler.haystack`). Used by NIAH and variable
            tracking; ignored by CWE and FWE.

    Returns:
        The samples, in order.

    Raises:
        DataError: unknown ``task`` or ``haystack``; ``num_samples < 1``; a depth outside
            [0, 1] or an empty depth list; ``length`` too small to hold the task; the essay
            text cannot be fetched; a tokenizer that encodes text to no tokens (e.g. an empty
            vocabulary).
    """
    _check_task(task)
    check_tokenizer(tokenizer)
    if haystack not in HAYSTACKS:
        raise DataError(f"unknown haystack {haystack!r}; allowed: {', '.join(HAYSTACKS)}")
    if not isinstance(length, numbers.Integral) or length < 1:
        raise DataError(f"length must be a positive number of tokens; got {length!r}")
    if not isinstance(num_samples, numbers.Integral) or num_samples < 1:
        raise DataError(f"num_samples must be a positive integer; got {num_samples!r}")
    if depths is None:
        depths = list(DEFAULT_DEPTHS)
    length, num_samples, depths = int(length), int(num_samples), list(depths)
    if not depths:
        raise DataError("depths must hold at least one fraction in [0, 1]; got an empty list")
    for d in depths:
        if not isinstance(d, (int, float)) or not 0.0 <= float(d) <= 1.0:
            raise DataError(f"needle depth {d!r} is outside [0, 1]; depths are fractions of the haystack")

    is_niah = task.startswith("niah_")
    hay = get_haystack(haystack) if (is_niah or task == "variable_tracking") else None
    samples: list[RulerSample] = []
    for i in range(num_samples):
        s = seed + i
        rng = random.Random(s)
        depth = float(depths[i % len(depths)]) if is_niah else None
        if is_niah:
            n_min, n_max, build, answers = niah_builder(task, rng, hay, depth)
            builds = [build]
        elif task == "variable_tracking":
            n_min, n_max, build, answers = vt_builder(rng, hay)
            builds = [build]
        elif task == "common_words":
            n_min, n_max, make_build, answers = cwe_builder(rng, length)
            # raise the repeat counts (10:1 ratio kept) when the vocabulary cannot fill `length`
            builds = (make_build(m) for m in range(1, 1 << 20))
        else:
            n_min, n_max, build, answers = fwe_builder(rng)
            builds = [build]

        for build in builds:

            def count(n: int, build=build) -> int:
                return len(encode_text(tokenizer, *build(n)))

            n = fit_length(count, n_min, n_max, length, f"task {task!r}")
            if n_max is None or n < n_max or count(n_max) >= 0.98 * length:
                break
        prompt, answer_prefix = build(n)
        ids = encode_text(tokenizer, prompt, answer_prefix)
        samples.append(
            RulerSample(
                task=task,
                prompt=prompt,
                answer_prefix=answer_prefix,
                answers=list(answers),
                max_new_tokens=MAX_NEW_TOKENS[task],
                depth=depth,
                length=len(ids),
                seed=s,
            )
        )
    return samples


__all__ = [
    "TASKS",
    "DEFAULT_DEPTHS",
    "MAX_NEW_TOKENS",
    "make_samples",
    "score",
]
