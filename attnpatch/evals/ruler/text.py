"""Shared text generation of the RULER-style tasks: the sample record, model inputs, and sizing.

:func:`build_input_ids` is the model input of a sample (chat template or plain text);
:func:`fit_length` sizes a task's filler by a bracketed binary search over the filler count so the
input stays within a length in tokens of the model's own tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...errors import DataError

__all__ = ["RulerSample", "build_input_ids"]


@dataclass
class RulerSample:
    """One generated task instance.

    Attributes:
        task: one of :data:`TASKS`.
        prompt: the user message (context + question).
        answer_prefix: text the assistant turn starts with (RULER appends it after the prompt);
            it begins with a space, which :func:`build_input_ids` drops after a chat template.
        answers: reference strings; :func:`score` checks each is contained in the prediction.
        max_new_tokens: generation budget in tokens.
        depth: depth of the target needle as a fraction of the haystack (NIAH tasks), else None.
        length: number of tokens of :func:`build_input_ids` for this sample (the model's tokens).
        seed: the ``random.Random`` seed that generated this sample.
    """

    task: str
    prompt: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int
    depth: float | None
    length: int
    seed: int


_PROBE_TEXT = "The grass is green. The sky is blue. 1234567"


def check_tokenizer(tokenizer) -> None:
    """A tokenizer must turn text into tokens, or no prompt can be sized (an empty vocabulary, as
    ``AutoTokenizer`` builds for a model folder without tokenizer files, encodes everything to [])."""
    try:
        ids = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    except Exception as err:  # noqa: BLE001 - any failure to encode means the same thing here
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise DataError(f"the tokenizer ({type(tokenizer).__name__}) cannot encode text ({type(err).__name__}: {first})") from err
    if not ids:
        size = len(tokenizer) if hasattr(tokenizer, "__len__") else "?"
        raise DataError(
            f"the tokenizer ({type(tokenizer).__name__}, vocabulary of {size} token(s)) encodes text to no tokens, "
            f"so no prompt can be sized to a length; its model folder probably lacks its tokenizer files"
        )


def build_input_ids(tokenizer, sample: RulerSample) -> list[int]:
    """Token ids of the full model input for ``sample``.

    With a chat template (``tokenizer.chat_template`` set): the template applied to one user
    turn holding ``sample.prompt`` with the generation prompt added, then
    ``sample.answer_prefix`` (leading whitespace removed) appended, tokenized without adding
    further special tokens. Without one: ``sample.prompt + sample.answer_prefix`` tokenized
    with the tokenizer's default special tokens (e.g. BOS).

    Args:
        tokenizer: a Hugging Face tokenizer (a fast one keeps :func:`make_samples` quick).
        sample: the sample to encode.

    Returns:
        The token ids; ``len(...)`` is the input length in tokens.
    """
    return encode_text(tokenizer, sample.prompt, sample.answer_prefix)


def encode_text(tokenizer, prompt: str, answer_prefix: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        text = text + answer_prefix.lstrip()
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt + answer_prefix)["input_ids"])


# ---------------------------------------------------------------------------------------------
# sizing


def fit_length(count: Callable[[int], int], n_min: int, n_max: int | None, length: int, what: str) -> int:
    """Largest ``n >= n_min`` (``<= n_max`` if given) with ``count(n) <= length``.

    ``count`` is assumed non-decreasing. Brackets the answer from a linear estimate, then
    bisects, so it costs about a dozen calls of ``count``.

    Raises:
        DataError: even ``count(n_min)`` exceeds ``length``.
    """
    c_min = count(n_min)
    if c_min > length:
        raise DataError(
            f"length={length} tokens is too small for {what}: the shortest input already has "
            f"{c_min} tokens; use length >= {c_min}"
        )
    cap = n_max if n_max is not None else 1 << 40
    if n_min >= cap:
        return n_min
    probe = min(cap, n_min + 64)
    c_probe = count(probe)
    if probe > n_min and c_probe <= c_min:
        # a filler that adds no tokens would send the search below towards an unbounded input
        raise DataError(
            f"cannot size {what} to {length} tokens: adding filler does not add tokens ({c_min} tokens "
            f"with {n_min} filler units, {c_probe} with {probe}); the tokenizer encodes the text to (almost) nothing"
        )
    if c_probe <= length and probe == cap:
        return cap
    per = max((c_probe - c_min) / max(1, probe - n_min), 1e-3)
    lo, hi = n_min, None  # count(lo) <= length < count(hi)
    if c_probe <= length:
        lo = probe
    else:
        hi = probe
    if hi is None:
        guess = min(cap, max(lo + 1, n_min + int((length - c_min) / per)))
        c = count(guess)
        if c <= length:
            lo = guess
            step = max(8, guess // 32)
            while hi is None:
                nxt = min(cap, lo + step)
                if nxt == lo:
                    return lo
                if count(nxt) <= length:
                    lo = nxt
                    if nxt == cap:
                        return cap
                    step *= 2
                else:
                    hi = nxt
        else:
            hi = guess
            step = max(8, guess // 32)
            while True:
                nxt = max(lo, hi - step)
                if nxt == lo or count(nxt) <= length:
                    lo = nxt
                    break
                hi = nxt
                step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= length:
            lo = mid
        else:
            hi = mid
    return lo
