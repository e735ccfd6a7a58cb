"""RULER-style long-context eval: dense vs patched accuracy, sparsity, recall and prefill time.

For every (task, context length) cell, the same prompts (:mod:`attnpatch.evals.ruler.tasks`)
are answered greedily by the unpatched model and by the patched model, interleaved sample
by sample so both see the same machine state.  Per cell the result holds: accuracy (RULER's
string-match score) dense and patched, attention sparsity of the patched prefill, attention
recall (mean and worst 5 % of layer-heads, from a separate measuring pass so prefill timings
stay clean) and prefill wall time (seconds, median over samples) dense and patched.

Source of the tasks: RULER (Hsieh et al. 2024, arXiv 2404.06654).
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch

from ...errors import DataError
from ...patchers.api import patch, record_stats, unpatch
from ...patchers.registry import get_method, validate_options
from . import tasks as ruler_tasks
from .dialect import lm_eval_results
from .text import build_input_ids
from ..run.devices import input_device
from ..run.distributed import Ranks
from ..recall import attention_recall, summarize_layers
from ..run.report import EvalInterrupted
from ...timing import Stopwatch

__all__ = ["run_ruler", "run_ruler_settings", "PrefillTimer", "generate_greedy"]


class PrefillTimer:
    """Times the first forward call (the prefill) of ``model.generate`` with forward hooks.

    Use as a context manager; ``seconds`` holds the wall time (seconds) of the first top-level
    forward call made inside the block, with the device synchronised before and after it
    (:class:`~attnpatch.timing.Stopwatch`), so a GPU time counts the prefill's work, not its
    kernel launches.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.seconds: float | None = None
        self._watch: Stopwatch | None = None
        self._hooks: list[Any] = []

    def __enter__(self) -> "PrefillTimer":
        def pre(*_):
            if self._watch is None:
                self._watch = Stopwatch()
                self._watch.start()

        def post(*_):
            if self.seconds is None and self._watch is not None:
                self.seconds = self._watch.stop()

        self._hooks = [self.model.register_forward_pre_hook(pre), self.model.register_forward_hook(post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()


@torch.no_grad()
def generate_greedy(model, tokenizer, input_ids: list[int], max_new_tokens: int) -> tuple[str, float]:
    """Greedy ``model.generate`` on one prompt.

    Args:
        input_ids: the prompt's token ids.
        max_new_tokens: generation budget (tokens).

    Returns:
        ``(text, prefill_seconds)``: the decoded new tokens (special tokens skipped) and the
        wall time of the prefill forward call.
    """
    x = torch.tensor([input_ids], device=input_device(model))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with PrefillTimer(model) as timer:
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return tokenizer.decode(out[0, x.shape[1] :], skip_special_tokens=True), float(timer.seconds or 0.0)


def run_ruler(
    model: torch.nn.Module,
    tokenizer,
    *,
    method: str = "anchor_attention",
    options: dict[str, Any] | None = None,
    tasks: Sequence[str] = ("niah_single",),
    lengths: Sequence[int] = (1024, 2048, 4096),
    num_samples: int = 10,
    seed: int = 0,
    depths: Sequence[float] | None = None,
    haystack: str = "repeat",
    recall: bool = True,
    recall_samples: int | None = None,
    progress: Callable[[str], None] | None = None,
    on_sample: Callable[[dict[str, Any]], None] | None = None,
    on_cell: Callable[[dict[str, Any]], None] | None = None,
    ranks: Ranks | None = None,
    resume: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the RULER-style tasks on ``model``, dense and patched with ``method``.

    Args:
        model: an unpatched causal LM (it is patched and unpatched per sample, and left unpatched).
        tokenizer: its tokenizer (the chat template is used when it has one).
        method: registered method name; an exact method (``"dense"``) without options is a baseline-only run (no patched columns).
        options: the method's options.
        tasks: names from :data:`attnpatch.evals.ruler.tasks.TASKS`.
        lengths: context lengths in the model's tokens.
        num_samples: samples per (task, length) cell.
        seed: sample seed (the same prompts for every method and run).
        depths: needle depths in [0, 1] cycled over samples (NIAH tasks).
        haystack: ``"repeat"`` (RULER's noise sentences) or ``"essay"`` (natural prose).
        recall: measure attention recall of the patched prefill (one extra measuring forward per sample).
        recall_samples: measure recall on the first ``recall_samples`` samples of each cell only
            (``None`` = all); the cell's recall columns then average those samples.
        progress: called with a short line after each sample.
        on_sample: called with each per-sample result dict.
        on_cell: called after each finished (task, length) cell with the result so far (same
            layout as the return value), e.g. to save partial results of a long run.
        ranks: this process's place in a data-parallel run (:mod:`attnpatch.evals.run.distributed`): each process
            answers its contiguous share of every cell's samples, and every process gets all of them in order,
            so the cells equal a one-process run's (prefill times aside); each cell then has ``"ranks"``, per
            process the samples it answered and its median prefill times.
        resume: the result of an earlier run of the same configuration that stopped (its JSON, read back with
            :func:`attnpatch.evals.run.resume.resume_cells`): its finished cells are kept and not run again.

    Returns:
        ``{"method", "options", "cells": [...], "settings": {...}}``; each cell has ``task``,
        ``length`` (target tokens), ``tokens`` (mean actual), ``n``, ``dense_acc``, and for a
        patched run ``patched_acc``, ``sparsity``, ``recall_mean``, ``recall_worst5``,
        ``prefill_dense_s``, ``prefill_patched_s`` (medians, seconds), ``prefill_speedup``,
        ``patched_modes`` (the record modes of the patched prefills' layers, e.g. ``["dense:short"]`` where
        every layer ran the model's own attention; see :func:`attnpatch.record_stats`)
        and ``samples`` (per-sample details); ``world_size``: the processes of the run; ``lm_eval``: the dense
        and patched accuracies per task and length in lm-evaluation-harness's results layout, ``{"dense": {...},
        "patched": {...}}`` (:mod:`attnpatch.evals.ruler.dialect`; no ``"patched"`` in a baseline-only run).

    Raises:
        DataError: unknown task, a length too short for a task, or a tokenizer that encodes text
            to no tokens (all checked before the first generation: every cell's prompts are
            built up front).
        UnknownMethodError, OptionError: bad method or options.
        EvalInterrupted: Ctrl-C (a ``KeyboardInterrupt``) during the run; its ``partial`` holds the
            result over the finished cells (``"interrupted": True``), or ``None`` before the first.
    """
    options = dict(options or {})
    m = get_method(method)
    baseline_only = m.exact and not options  # an exact method computes the baseline itself: nothing to compare
    if not baseline_only:
        options = validate_options(m, options)
    run_settings, plan = _prepare(
        model, tokenizer, tasks=tasks, lengths=lengths, num_samples=num_samples, seed=seed, depths=depths, haystack=haystack,
        recall=recall, recall_samples=recall_samples,
    )
    setting = [] if baseline_only else [(method, options)]
    done = list((resume or {}).get("cells") or [])
    dense_cells: list[dict[str, Any]] = list(done)
    run_cells: list[list[dict[str, Any]]] = [list(done) for _ in setting]
    r = ranks or Ranks()

    def result() -> dict[str, Any]:
        return {**_result(method, options, dense_cells if baseline_only else run_cells[0], run_settings), "world_size": r.world_size,
                "lm_eval": lm_eval_results(dense_cells, run_cells, haystack)}

    return _run_all(
        model, tokenizer, plan, setting, dense_cells, run_cells, result, recall=recall, recall_samples=recall_samples,
        progress=progress, on_sample=on_sample, on_cell=on_cell, ranks=r,
    )


def run_ruler_settings(
    model: torch.nn.Module,
    tokenizer,
    *,
    settings: Sequence[tuple[str, dict[str, Any]]],
    tasks: Sequence[str] = ("niah_single",),
    lengths: Sequence[int] = (1024, 2048, 4096),
    num_samples: int = 10,
    seed: int = 0,
    depths: Sequence[float] | None = None,
    haystack: str = "repeat",
    recall: bool = True,
    recall_samples: int | None = None,
    calibrate: Callable[[list[int]], Sequence[tuple[str, dict[str, Any]]]] | None = None,
    progress: Callable[[str], None] | None = None,
    on_sample: Callable[[dict[str, Any]], None] | None = None,
    on_cell: Callable[[dict[str, Any]], None] | None = None,
    ranks: Ranks | None = None,
    resume: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the RULER-style tasks dense and under several patched settings, on the same prompts in one run.

    Each sample is answered once by the unpatched model (dense) and then by the model patched
    with each setting in turn (interleaved sample by sample, so every setting sees the same
    prompts and machine state); :func:`run_ruler` is this with one setting.

    Args:
        model: an unpatched causal LM (patched and unpatched per sample and setting; left unpatched).
        tokenizer: its tokenizer.
        settings: ``[(method, options), ...]``; options are validated (defaults filled) and each
            setting is patched onto the model once before the first generation, so a method that
            does not fit the model fails early.
        tasks, lengths, num_samples, seed, depths, haystack, recall, recall_samples: as for :func:`run_ruler`.
        calibrate: called once, after every cell's prompts are built and before any generation,
            with the token ids of the first sample of the first cell; returns the settings to run
            instead of ``settings`` (e.g. each method's knob matched to a budget on that sample).
        progress: called with a short line after each sample.
        on_sample: called with each sample's dense row (``"runs"``: one dict per setting).
        on_cell: called after each finished (task, length) cell with the result so far.
        ranks: a data-parallel run, as for :func:`run_ruler`; ``calibrate`` runs on rank 0 alone and its settings
            are sent to the others.
        resume: an earlier result of this configuration that stopped: its finished cells are kept, and its
            settings are run (no new ``calibrate``).

    Returns:
        ``{"settings": {run configuration}, "world_size", "dense": {"cells": [...]}, "runs": [{"method",
        "options", "cells": [...]}, ...]}``; the dense cells have :func:`run_ruler`'s baseline
        columns, each run's cells :func:`run_ruler`'s patched cells (dense columns included,
        from the one dense generation per sample); ``"lm_eval"``: ``{"dense": {...}, "runs": [{...}, ...]}``, the
        same accuracies in lm-evaluation-harness's results layout (:mod:`attnpatch.evals.ruler.dialect`).

    Raises:
        DataError: as :func:`run_ruler` (all checked before the first generation).
        UnknownMethodError, OptionError, UnsupportedModelError: a bad setting.
        EvalInterrupted: Ctrl-C; ``partial`` holds the result over the finished cells
            (``"interrupted": True``, ``"cells_done"``, ``"cells_planned"``), or ``None`` before the first.
    """
    run_settings, plan = _prepare(
        model, tokenizer, tasks=tasks, lengths=lengths, num_samples=num_samples, seed=seed, depths=depths, haystack=haystack,
        recall=recall, recall_samples=recall_samples,
    )
    r = ranks or Ranks()
    try:
        if resume is not None:
            settings = [(x["method"], x["options"]) for x in resume.get("runs") or []]
        elif calibrate is not None and plan and plan[0][2]:
            # calibrated on one process (it may time forward calls), the same settings everywhere
            settings = r.broadcast(calibrate(build_input_ids(tokenizer, plan[0][2][0])) if r.main else None)
    except KeyboardInterrupt as exc:
        if isinstance(exc, EvalInterrupted):
            raise
        raise EvalInterrupted(None, f"0/{len(plan)} cells") from None
    settings = _check_settings(model, settings)
    dense_cells: list[dict[str, Any]] = list(((resume or {}).get("dense") or {}).get("cells") or [])
    run_cells: list[list[dict[str, Any]]] = [list(x.get("cells") or []) for x in (resume or {}).get("runs") or []] or [[] for _ in settings]

    def result() -> dict[str, Any]:
        return {
            "settings": run_settings, "world_size": r.world_size, "dense": {"cells": list(dense_cells)},
            "runs": [{"method": m, "options": o, "cells": list(c)} for (m, o), c in zip(settings, run_cells)],
            "lm_eval": lm_eval_results(dense_cells, run_cells, haystack, one_setting=False),
        }

    return _run_all(
        model, tokenizer, plan, settings, dense_cells, run_cells, result, recall=recall, recall_samples=recall_samples,
        progress=progress, on_sample=on_sample, on_cell=on_cell, ranks=r,
    )


def _run_all(model, tokenizer, plan, settings, dense_cells, run_cells, result, *, recall, recall_samples, progress, on_sample,
             on_cell, ranks) -> dict[str, Any]:
    """:func:`_run_cells` over the whole plan, then ``result()``; Ctrl-C raises :class:`EvalInterrupted` carrying
    ``result()`` over the finished cells (``None`` before the first)."""
    try:
        _run_cells(
            model, tokenizer, plan, settings, dense_cells, run_cells, recall=recall, recall_samples=recall_samples,
            progress=progress, on_sample=on_sample, on_cell=(lambda: on_cell(result())) if on_cell else None, ranks=ranks,
        )
    except KeyboardInterrupt as exc:
        if isinstance(exc, EvalInterrupted):
            raise
        done = f"{len(dense_cells)}/{len(plan)} cells"
        partial = {**result(), "interrupted": True, "cells_done": len(dense_cells), "cells_planned": len(plan)}
        raise EvalInterrupted(partial if dense_cells else None, done) from None
    return result()


def _check_settings(model, settings) -> list[tuple[str, dict[str, Any]]]:
    """Validated ``(method, full options)``; each patched onto ``model`` once (and removed) so a misfit fails early."""
    out = [(m, validate_options(get_method(m), dict(o))) for m, o in settings]
    for m, o in out:
        patch(model, m, **o)
        unpatch(model)
    return out


def _prepare(model, tokenizer, *, tasks, lengths, num_samples, seed, depths, haystack, recall, recall_samples):
    """The run configuration and the plan ``[(task, length, samples)]``, every cell's prompts built up front."""
    bad = [t for t in tasks if t not in ruler_tasks.TASKS]
    if bad:
        raise DataError(f"unknown RULER task(s) {bad}; allowed: {', '.join(ruler_tasks.TASKS)}")
    model.eval()
    settings = {
        "tasks": list(tasks), "lengths": list(lengths), "num_samples": num_samples, "seed": seed,
        "depths": list(depths) if depths else None, "haystack": haystack, "recall": recall, "recall_samples": recall_samples,
        "torch_threads": torch.get_num_threads(),
    }
    # every cell's prompts are built first: a length too short for a task, or a tokenizer that
    # cannot size them, fails before the first generation, not hours into the run
    plan = [
        (task, length, ruler_tasks.make_samples(
            task, tokenizer, length, num_samples, seed=seed, depths=list(depths) if depths else None, haystack=haystack
        ))
        for task in tasks for length in lengths
    ]
    return settings, plan


def _run_cells(model, tokenizer, plan, settings, dense_cells, run_cells, *, recall, recall_samples, progress, on_sample, on_cell,
               ranks) -> None:
    """Run the planned ``(task, length, samples)`` cells in order, from the first one not yet in ``dense_cells`` (a
    resumed run): per sample one dense generation, then one per setting; each finished cell is appended to
    ``dense_cells`` and to each setting's list in ``run_cells``.  In a data-parallel run each process answers
    its share of a cell's samples and the cell is built from all of them, in order, on every process."""
    for task, length, samples in plan[len(dense_cells):]:
        mine = []
        for i in ranks.shard(len(samples)):
            row, runs = _sample(model, tokenizer, task, length, samples[i], i, settings, recall=recall, recall_samples=recall_samples)
            mine.append((i, row, runs))
            if on_sample:
                on_sample(row if not settings else {**row, **runs[0]} if len(settings) == 1 else {**row, "runs": runs})
            if progress:
                msg = f"{task} L={length} sample {i + 1}/{len(samples)}: dense {row['dense_score']:.2f} ({row['prefill_dense_s']:.2f}s)"
                for (method, _), run in zip(settings, runs):
                    name = "patched" if len(settings) == 1 else method
                    msg += f", {name} {run['patched_score']:.2f} ({run['prefill_patched_s']:.2f}s)"
                progress(msg)
        parts = ranks.gather(mine)
        rows = [(row, runs) for _, row, runs in sorted((x for part in parts for x in part), key=lambda x: x[0])]
        per_rank = [
            {"rank": k, "samples": [i for i, _, _ in part],
             "prefill_dense_s": _median([row["prefill_dense_s"] for _, row, _ in part]),
             "prefill_patched_s": [_median([runs[j]["prefill_patched_s"] for _, _, runs in part]) for j in range(len(settings))]}
            for k, part in enumerate(parts)
        ] if ranks.distributed else None
        dense_cells.append(_with_ranks(_aggregate(task, length, [r for r, _ in rows], True), per_rank))
        for k, cells in enumerate(run_cells):
            cells.append(_with_ranks(_aggregate(task, length, [{**r, **runs[k]} for r, runs in rows], False), per_rank))
        if on_cell:
            on_cell()


def _sample(model, tokenizer, task, length, s, i, settings, *, recall, recall_samples) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One sample: the dense generation's row and one dict per patched setting."""
    ids = build_input_ids(tokenizer, s)
    text_d, t_d = generate_greedy(model, tokenizer, ids, s.max_new_tokens)
    row: dict[str, Any] = {
        "task": task, "length": length, "tokens": len(ids), "depth": s.depth, "answers": s.answers,
        "dense_pred": text_d, "dense_score": ruler_tasks.score(task, text_d, s.answers), "prefill_dense_s": t_d,
    }
    runs = []
    for method, options in settings:
        patch(model, method, **options)
        try:
            with record_stats(model) as rec:
                text_p, t_p = generate_greedy(model, tokenizer, ids, s.max_new_tokens)
            summ = summarize_layers(rec.forwards[0]) if rec.forwards else {}
            run: dict[str, Any] = dict(
                patched_pred=text_p,
                patched_score=ruler_tasks.score(task, text_p, s.answers),
                prefill_patched_s=t_p,
                sparsity=summ.get("sparsity"),
                modes=sorted({layer["mode"] for layer in summ.get("per_layer", [])}),
            )
            if recall and (recall_samples is None or i < recall_samples):
                r = attention_recall(model, torch.tensor([ids], device=input_device(model)))
                run.update(recall_mean=r["recall_mean"], recall_worst5=r["recall_worst"], worst_heads=r["worst_heads"][:5])
        finally:
            unpatch(model)
        runs.append(run)
    return row, runs


def _median(xs):
    return statistics.median(xs) if xs else None


def _with_ranks(cell: dict[str, Any], per_rank) -> dict[str, Any]:
    if per_rank is not None:
        cell["ranks"] = per_rank
    return cell


def _result(method: str, options: dict[str, Any], cells: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    return {"method": method, "options": options, "cells": list(cells), "settings": settings}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _aggregate(task: str, length: int, rows: list[dict[str, Any]], baseline_only: bool) -> dict[str, Any]:
    cell: dict[str, Any] = {
        "task": task,
        "length": length,
        "tokens": _mean([r["tokens"] for r in rows]),
        "n": len(rows),
        "dense_acc": _mean([r["dense_score"] for r in rows]),
        "prefill_dense_s": statistics.median(r["prefill_dense_s"] for r in rows),
    }
    if not baseline_only:
        cell.update(
            patched_acc=_mean([r["patched_score"] for r in rows]),
            sparsity=_mean([r.get("sparsity") for r in rows]),
            recall_mean=_mean([r.get("recall_mean") for r in rows]),
            recall_worst5=_mean([r.get("recall_worst5") for r in rows]),
            prefill_patched_s=statistics.median(r["prefill_patched_s"] for r in rows),
            patched_modes=sorted({m for r in rows for m in r.get("modes", [])}),
        )
        cell["prefill_speedup"] = cell["prefill_dense_s"] / cell["prefill_patched_s"] if cell["prefill_patched_s"] else None
    cell["samples"] = rows
    return cell
