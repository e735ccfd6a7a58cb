"""The generation-agreement eval: greedy ``model.generate`` dense and under each setting on the same inputs.

Per input, dense first, then each setting (under ``patched(model, method, towers=..., **options)``), each a greedy
generation of at most ``max_new_tokens`` tokens timed with the device synchronised: the prefill (time to first token)
by :class:`~attnpatch.evals.ruler.runner.PrefillTimer`, the whole call by a stopwatch; decode speed is the tokens
after the first over the time after the prefill.

Agreement with dense (:func:`agreement`): over dense's generated positions, the share where the setting generated the
same token at the same position (a generation that stops early counts its missing positions as different); the
first position where the two differ (``None`` when identical); exact match when the whole generation is dense's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import OptionError
from ...patchers.api import patched, record_stats
from ...patchers.registry import get_method, validate_options
from ...patchers.features import input_device
from ...timing import Stopwatch, quietly
from ..vision.image_pass import resolve_settings

__all__ = ["GenerationInput", "text_inputs", "image_inputs", "load_images", "agreement", "run_generate"]


@dataclass
class GenerationInput:
    """One prompt as the model takes it: ``inputs`` (``input_ids``, ``attention_mask`` and, for a VLM,
    ``pixel_values`` and the processor's other tensors), ``name`` (where it came from) and its token count."""

    name: str
    inputs: dict[str, torch.Tensor] = field(repr=False)

    @property
    def tokens(self) -> int:
        return int(self.inputs["input_ids"].shape[-1])


def text_inputs(tokenizer, prompts: Sequence[str], names: Sequence[str] | None = None) -> list[GenerationInput]:
    """Text prompts encoded as a chat user turn when the tokenizer has a chat template, else as plain text."""
    from ..ruler.text import encode_text

    out = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([encode_text(tokenizer, p, "")])
        out.append(GenerationInput(names[i] if names else f"prompt {i}", {"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
    return out


def load_images(folder: str, limit: int) -> list[tuple[str, Any]]:
    """``[(name, PIL image)]``: the first ``limit`` images of an imagefolder (``datasets``' ``imagefolder``, labels
    dropped: one folder of photos or class sub-folders alike), in its order.

    Raises:
        OptionError: not a directory, or no image in it.
    """
    import os

    from datasets import load_dataset

    if not os.path.isdir(folder):
        raise OptionError(f"--images {folder}: not a directory; give a folder of images (imagefolder layout)")
    try:
        ds = load_dataset("imagefolder", data_dir=folder, split="train", drop_labels=True)
    except (ValueError, FileNotFoundError) as err:
        raise OptionError(f"--images {folder}: no image files found ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    n = min(limit, len(ds))
    if n == 0:
        raise OptionError(f"--images {folder}: no image files found")
    return [(f"{os.path.basename(os.path.normpath(folder))} image {i}", ds[i]["image"]) for i in range(n)]


def image_inputs(processor, images: Sequence[Any], prompts: Sequence[str], names: Sequence[str]) -> list[GenerationInput]:
    """One input per image for a VLM: ``prompts[i % len(prompts)]`` asked about ``images[i]`` (PIL), as a user turn with
    one image through the processor's chat template when it has one, else as ``<image token>\\n<prompt>``; encoded by
    the processor (``input_ids``, ``attention_mask``, ``pixel_values`` and the family's other tensors)."""
    if not prompts:
        raise OptionError("image_inputs needs at least one prompt")
    out = []
    for i, image in enumerate(images):
        question = prompts[i % len(prompts)]
        if getattr(processor, "chat_template", None):
            turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            text = processor.apply_chat_template(turn, add_generation_prompt=True)
        else:
            text = f"{getattr(processor, 'image_token', None) or '<image>'}\n{question}"
        enc = processor(images=[image.convert("RGB")], text=[text], return_tensors="pt")
        out.append(GenerationInput(names[i], {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}))
    return out


def agreement(dense: Sequence[int], other: Sequence[int]) -> dict[str, Any]:
    """``{"token_agreement", "first_divergence", "exact_match"}`` of a generation against dense's (token ids).

    ``token_agreement``: over dense's positions, the share where ``other`` holds the same token (positions ``other``
    did not generate count as different; 1.0 for two empty generations); ``first_divergence``: the first position
    where they differ, or where one ends before the other (``None`` when equal); ``exact_match``: equal sequences.
    """
    n = len(dense)
    same = sum(1 for a, b in zip(dense, other) if a == b)
    first = next((i for i, (a, b) in enumerate(zip(dense, other)) if a != b), None)
    if first is None and len(dense) != len(other):
        first = min(len(dense), len(other))
    return {"token_agreement": same / n if n else float(len(other) == 0), "first_divergence": first,
            "exact_match": list(dense) == list(other)}


def _generate(model, item: GenerationInput, max_new_tokens: int, pad_id: int | None) -> dict[str, Any]:
    from ..ruler.runner import PrefillTimer

    device = input_device(model)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in item.inputs.items()}
    with torch.no_grad(), PrefillTimer(model) as timer, Stopwatch() as sw:
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    new = out[0, item.tokens:].tolist()
    ttft = float(timer.seconds or 0.0)
    decode_s = max(sw.seconds - ttft, 0.0)
    return {"tokens": new, "ttft_s": ttft, "seconds": sw.seconds,
            "decode_tokens_per_s": (len(new) - 1) / decode_s if len(new) > 1 and decode_s > 0 else None}


def _summary(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    import statistics

    ttft = [r[key]["ttft_s"] for r in rows]
    tps = [r[key]["decode_tokens_per_s"] for r in rows if r[key]["decode_tokens_per_s"] is not None]
    return {"ttft_s_median": statistics.median(ttft) if ttft else None,
            "decode_tokens_per_s_median": statistics.median(tps) if tps else None}


def _resolve(settings, model, towers) -> tuple[list[tuple[Any, dict]], list[Any]]:
    """:func:`~attnpatch.evals.vision.image_pass.resolve_settings`, where a setting's method may also be a tower -> ``(method,
    options)`` mapping (one method per tower; its options ``{}``): each tower's options validated, the whole patched once."""
    plain = [(m, o) for m, o in settings if not isinstance(m, Mapping)]
    done, given = resolve_settings(plain, model, towers)
    full, shown = iter(done), iter(given)
    out, out_given = [], []
    for m, o in settings:
        if not isinstance(m, Mapping):
            out.append(next(full))
            out_given.append(next(shown))
            continue
        if o:
            raise OptionError(f"setting {dict(m)!r}: a tower -> method mapping carries each tower's options, not {o!r}")
        per = {t: (name, validate_options(get_method(name), dict(opts))) for t, (name, opts) in m.items()}
        with patched(model, per):  # every tower fits its method, before any generation
            pass
        out.append((per, {}))
        out_given.append({t: dict(opts) for t, (_, opts) in m.items()})
    return out, out_given


def _label(m: Any) -> str:
    return m if isinstance(m, str) else " + ".join(f"{t}={name}" for t, (name, _) in m.items())


def run_generate(
    model: torch.nn.Module,
    inputs: Sequence[GenerationInput],
    *,
    settings: Sequence[tuple[str, dict[str, Any]]],
    towers: Any = None,
    max_new_tokens: int = 32,
    pad_token_id: int | None = None,
    decode: Callable[[list[int]], str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Greedy generations, dense and under each setting, on the same inputs; agreement and speed per setting.

    Args:
        model: an unpatched causal LM or VLM with ``generate`` (left unpatched).
        inputs: :class:`GenerationInput` (e.g. :func:`text_inputs`, or a processor's output for a VLM).
        settings: ``[(method, options), ...]`` (validated against the model first; ``towers`` each routes); a method
            may be a tower -> ``(method, options)`` mapping with options ``{}``: one method per tower of a VLM
            (``({"vision": ("fna", {}), "text": ("anchor_attention", {"preset": "accurate"})}, {})``), ``towers`` unused.
        towers: the towers each setting routes (``None``: the model's default).
        max_new_tokens: generation budget per input (tokens).
        pad_token_id: passed to ``generate`` (the tokenizer's pad, else its end-of-sequence token).
        decode: token ids -> text, to keep each generation's text in the result.
        progress: ``progress(done, total)`` after each input.

    Returns:
        ``{"n_inputs", "max_new_tokens", "prompt_tokens": [...], "dense": {"ttft_s_median",
        "decode_tokens_per_s_median"}, "runs": [{"method" (a per-tower setting: ``"vision=fna + text=anchor_attention"``), "options" (per tower: ``{tower:
        options}``), "shown_options", "per_tower" (``{tower: method}`` or ``None``), "token_agreement" (mean),
        "exact_match" (share of inputs), "first_divergence" (per input), "ttft_s_median", "decode_tokens_per_s_median",
        "ttft_speedup" (dense's median over the setting's), "modes" (record modes its layers ran)}], "per_input":
        [{"name", "tokens", "dense": {...}, "runs": [{...}]}]}``; times in seconds.

    Raises:
        OptionError: no inputs, ``max_new_tokens < 1``, a bad setting (before any generation).
    """
    if not inputs:
        raise OptionError("run_generate needs at least one input")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise OptionError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1 (tokens)")
    settings, given = _resolve(settings, model, towers)
    rows = []
    modes: list[set[str]] = [set() for _ in settings]
    for i, item in enumerate(inputs):
        dense = quietly(lambda: _generate(model, item, max_new_tokens, pad_token_id))
        runs = []
        for j, (m, o) in enumerate(settings):
            tw = None if isinstance(m, Mapping) else towers
            with patched(model, m, towers=tw, **o), record_stats(model) as rec:
                got = quietly(lambda: _generate(model, item, max_new_tokens, pad_token_id))
            for f in rec.forwards:  # the prefill's layers (a VLM's image tower may run as a call of its own)
                modes[j].update(r.mode for r in f.values() if r.mode != "dense:decode")
            runs.append({**got, **agreement(dense["tokens"], got["tokens"])})
        row = {"name": item.name, "tokens": item.tokens, "dense": dense, "runs": runs}
        if decode is not None:
            dense["text"] = decode(dense["tokens"])
            for r in runs:
                r["text"] = decode(r["tokens"])
        rows.append(row)
        if progress:
            progress(i + 1, len(inputs))
    dense_sum = _summary(rows, "dense")
    out_runs = []
    for j, ((m, o), g) in enumerate(zip(settings, given)):
        per = [r["runs"][j] for r in rows]
        s = _summary([{"x": p} for p in per], "x")
        per_tower = isinstance(m, Mapping)
        out_runs.append({
            "method": _label(m), "options": {t: dict(x[1]) for t, x in m.items()} if per_tower else o, "shown_options": g,
            "per_tower": {t: x[0] for t, x in m.items()} if per_tower else None,
            "token_agreement": sum(p["token_agreement"] for p in per) / len(per),
            "exact_match": sum(p["exact_match"] for p in per) / len(per),
            "first_divergence": [p["first_divergence"] for p in per], **s,
            "ttft_speedup": (dense_sum["ttft_s_median"] / s["ttft_s_median"]) if s["ttft_s_median"] else None,
            "modes": sorted(modes[j]),
        })
    return {"n_inputs": len(inputs), "max_new_tokens": max_new_tokens, "prompt_tokens": [r["tokens"] for r in rows],
            "dense": dense_sum, "runs": out_runs, "per_input": rows}
