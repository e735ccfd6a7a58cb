"""A causal LM's context length, read from its ``config.json`` before anything loads, and the check of the lengths an
eval asks for against it.

``eval ruler --lengths`` and ``eval lm-eval --metadata max_seq_lengths=[...]`` build prompts of those lengths; one
beyond the model's context runs for hours (RULER's haystack generation, then a prefill past the positions the
model was trained on) and answers nothing that means anything.  :func:`check_lengths` refuses it in one line
before the weights load.

Where the limit comes from (:func:`config_context`), in a transformers ``config.json`` (or its ``text_config``):

* ``max_position_embeddings`` (``n_positions`` for GPT-2-style configs);
* RoPE scaling, ``rope_parameters`` (transformers 5) or ``rope_scaling`` (earlier configs), possibly one dict per
  layer type: a ``rope_type`` (or ``type``) other than ``"default"`` with a ``factor`` stretches the positions the
  model was trained on, ``original_max_position_embeddings`` (in the dict or beside it; else
  ``max_position_embeddings``), to ``factor`` times that, as transformers' ``modeling_rope_utils`` computes the
  scaled frequencies.  The larger of the two limits counts.

A catalogue model is read from its prepared folder; before its first preparation, from the catalogue entry's
``context`` (the converted config's ``max_position_embeddings``).  A hub id is read from the local hub cache, or
downloaded alone (``config.json``) when the hub is reachable and offline mode is off.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import OptionError
from ..hub import HUB_ID, hub_cached_or_reachable, hub_offline
from .entries import CATALOGUE, is_complete, model_dir

__all__ = ["ModelContext", "config_context", "model_context", "check_lengths"]


@dataclass(frozen=True)
class ModelContext:
    """A model's context length: ``tokens`` (positions), and ``source``, the config field(s) and file it comes from,
    as the error messages name it (``"max_position_embeddings in /m/config.json"``)."""

    tokens: int
    source: str


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value <= 0:
        return None
    return int(value)


def config_context(config: Mapping[str, Any], where: str = "config.json") -> ModelContext | None:
    """The context length a transformers config declares (see the module docstring), or ``None`` when it declares
    none.

    Args:
        config: the parsed ``config.json`` (a dict); a ``text_config`` inside it is read when the top level has no
            position limit (multimodal configs).
        where: the file named in :attr:`ModelContext.source`.
    """
    text = config.get("text_config")
    if isinstance(text, Mapping) and not any(_positive_int(config.get(k)) for k in ("max_position_embeddings", "n_positions")):
        return config_context(text, f"{where} (text_config)")
    best: ModelContext | None = None
    for key in ("max_position_embeddings", "n_positions"):
        n = _positive_int(config.get(key))
        if n is not None:
            best = ModelContext(n, f"{key} in {where}")
            break
    base = best.tokens if best is not None else None
    for field in ("rope_parameters", "rope_scaling"):
        rope = config.get(field)
        if not isinstance(rope, Mapping):
            continue
        per_type = [(f"{field}[{k!r}]", v) for k, v in rope.items() if isinstance(v, Mapping)]
        for name, params in per_type or [(field, rope)]:
            kind = params.get("rope_type", params.get("type", "default"))
            factor = params.get("factor")
            original = _positive_int(params.get("original_max_position_embeddings")) or _positive_int(
                config.get("original_max_position_embeddings")) or base
            if kind in (None, "default") or _positive_int(factor) is None or original is None:
                continue
            n = int(float(factor) * original)
            if best is None or n > best.tokens:
                best = ModelContext(n, f"{name} {kind}: factor {factor} x original_max_position_embeddings {original}, in {where}")
        break  # rope_parameters, where present, is what transformers 5 reads
    return best


def _config_file(name_or_path: str | os.PathLike) -> Path | None:
    """The ``config.json`` of a catalogue model's prepared folder, a local folder, or a hub id (cache or download)."""
    name = os.fspath(name_or_path)
    if name in CATALOGUE:
        folder = model_dir(name)
        return folder / "config.json" if is_complete(folder) else None
    path = Path(name).expanduser()
    if path.exists() or not HUB_ID.match(name):
        return path / "config.json" if (path / "config.json").is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        local = hub_offline() or not hub_cached_or_reachable(name)
        return Path(hf_hub_download(name, "config.json", local_files_only=local))
    except Exception:  # noqa: BLE001 - not cached, not reachable, no such repo: the loader says which
        return None


def model_context(name_or_path: str | os.PathLike) -> ModelContext | None:
    """The context length of a causal LM named as the loaders take it (catalogue name, local folder, hub id), from
    its ``config.json`` alone (no weights, no tokenizer), or ``None`` when no config is at hand or it declares no
    limit; a catalogue model not prepared yet answers from its catalogue entry."""
    name = os.fspath(name_or_path)
    path = _config_file(name)
    if path is None:
        entry = CATALOGUE.get(name)
        if entry is not None and entry.context:
            return ModelContext(entry.context, f"max_position_embeddings of catalogue model {name}")
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the loader's file check names a config that does not parse
    return config_context(config, str(path)) if isinstance(config, Mapping) else None


def check_lengths(name_or_path: str | os.PathLike, lengths: Sequence[int], flag: str) -> ModelContext | None:
    """Refuse a context length beyond the model's (:func:`model_context`), before anything loads.

    Args:
        name_or_path: the model as the loaders take it.
        lengths: the lengths asked for, in tokens.
        flag: the option they came from, as the message names it (``"--lengths"``, ``"--metadata max_seq_lengths"``).

    Returns:
        The model's context, or ``None`` when it is unknown (nothing is refused then).

    Raises:
        OptionError: one line naming the first length beyond the context, the context and where it comes from.
    """
    context = model_context(name_or_path)
    if context is None:
        return None
    over = [n for n in lengths if n > context.tokens]
    if over:
        raise OptionError(
            f"{flag} {over[0]}: beyond the model's context of {context.tokens} tokens ({context.source}); give "
            f"lengths up to {context.tokens}")
    return context
