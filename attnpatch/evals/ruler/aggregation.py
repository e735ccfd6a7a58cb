"""Aggregation tasks of RULER: common words (CWE) and frequent coded words (FWE) -- prompt
templates and the sample builders."""

from __future__ import annotations

import math
import random
import string
from typing import Sequence

from .words import WORDS

__all__ = ["CWE_TEMPLATE", "CWE_ANSWER_PREFIX", "CWE_NUM_COMMON", "FWE_TEMPLATE", "FWE_ANSWER_PREFIX", "FWE_ALPHA", "FWE_VOCAB", "FWE_WORD_LEN"]

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
CWE_NUM_COMMON = 10

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_ALPHA = 2.0
FWE_VOCAB = 2000
FWE_WORD_LEN = 6


def _cwe_list(words: Sequence[str], n_common: int, rep_common: int, rep_uncommon: int, shuffle_seed: int) -> str:
    lst = list(words[:n_common]) * rep_common + list(words[n_common:]) * rep_uncommon
    random.Random(shuffle_seed).shuffle(lst)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))


def cwe_builder(rng, length: int):
    vocab = list(WORDS)
    rng.shuffle(vocab)
    shuffle_seed = rng.randrange(1 << 30)
    nc = CWE_NUM_COMMON
    if length < 4096:  # RULER's short-input setting
        ex_words, ex_rep = vocab[:20], (3, 1)
        rep = (6, 1)
    else:
        ex_words, ex_rep = vocab[:40], (10, 3)
        rep = (30, 3)
    words = vocab[len(ex_words):]  # main list's words are disjoint from the example's
    example = (
        CWE_TEMPLATE.format(context=_cwe_list(ex_words, nc, ex_rep[0], ex_rep[1], shuffle_seed + 1))
        + CWE_ANSWER_PREFIX
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_words[:nc]))
    )
    answers = list(words[:nc])

    def make_build(mult: int):
        def build(n: int):
            ctx = _cwe_list(words[:n], nc, rep[0] * mult, rep[1] * mult, shuffle_seed)
            return example + "\n" + CWE_TEMPLATE.format(context=ctx), CWE_ANSWER_PREFIX

        return build

    return nc + 1, len(words), make_build, answers


def fwe_builder(rng):
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < FWE_VOCAB:
        w = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN))
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    vocab[0] = "..."  # the top rank is noise, as in RULER
    shuffle_seed = rng.randrange(1 << 30)
    zeta = math.pi**2 / 6 if FWE_ALPHA == 2.0 else sum(k**-FWE_ALPHA for k in range(1, 100000))
    answers = vocab[1:4]

    def counts(n: int) -> list[int]:
        return [int(n * (k**-FWE_ALPHA) / zeta) for k in range(1, len(vocab) + 1)]

    def build(n: int):
        lst = [w for w, c in zip(vocab, counts(n)) for _ in range(c)]
        random.Random(shuffle_seed).shuffle(lst)
        return FWE_TEMPLATE.format(context=" ".join(lst)), FWE_ANSWER_PREFIX

    # smallest n whose top-3 coded words have distinct counts above the 4th's
    n_min = 1
    while True:
        c = counts(n_min)
        if c[1] > c[2] > c[3] > c[4] >= 0 and c[3] > 0:
            break
        n_min += 1
    return n_min, None, build, answers
