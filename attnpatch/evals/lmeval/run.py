"""``run_lm_eval``: lm-evaluation-harness tasks on a loaded causal LM, unpatched and under each patched setting.

For each setting the model is patched, lm-eval's own ``simple_evaluate`` runs the tasks through
:class:`~attnpatch.evals.lmeval.model.MeasuredHFLM` (lm-eval's ``HFLM`` on the loaded model), and the model is
unpatched; every setting sees the same lm-eval task manager, seeds and limit, so the same prompts.  lm-eval
does all the prompting and scoring; this adds the per-request prefill time, sparsity and recall, and the table.

Source: lm-evaluation-harness (EleutherAI), ``lm_eval.simple_evaluate``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Sequence

from ...errors import AttnpatchError
from ...patchers.api import patch, unpatch
from ...patchers.registry import get_method, validate_options
from ..run.distributed import Ranks
from ..run.report import EvalInterrupted, setting_label
from .table import differing_tasks, sample_records, score_rows
from .tasks import check_metadata, check_tasks, lm_eval_version, require_lm_eval, task_manager

__all__ = ["run_lm_eval", "setting_label", "results_json", "write_results", "installed_packages"]


def results_json(results: dict[str, Any]) -> str:
    """lm-eval's result dict as lm-eval writes it (``default=lm_eval.utils.handle_non_serializable``)."""
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)


def installed_packages() -> dict[str, str]:
    """``{distribution name: version}`` of every installed Python package (``importlib.metadata``)."""
    from importlib.metadata import distributions

    out = {}
    for d in distributions():
        name = d.metadata["Name"]
        if name:
            out[name] = d.version
    return dict(sorted(out.items(), key=lambda kv: kv[0].lower()))


def _check_settings(model, settings) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``[(method, options as given, full options)]``, each patched onto ``model`` once (and removed) so a setting that
    does not fit the model fails before the first evaluation."""
    out = []
    for method, given in settings:
        full = validate_options(get_method(method), dict(given))
        patch(model, method, **full)
        unpatch(model)
        out.append((method, dict(given), full))
    return out


def run_lm_eval(
    model,
    tokenizer,
    *,
    tasks: Sequence[str],
    settings: Sequence[tuple[str, dict[str, Any]]],
    metadata: dict[str, Any] | None = None,
    tokenizer_path: str | None = None,
    limit: int | float | None = None,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = False,
    gen_kwargs: str | None = None,
    recall_samples: int = 0,
    ranks: Ranks | None = None,
    progress: Callable[[str], None] | None = None,
    on_setting: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run lm-eval ``tasks`` on ``model`` unpatched, then patched with each setting in turn.

    Args:
        model: an unpatched causal LM (patched and unpatched per setting; left unpatched).
        tokenizer: its tokenizer.
        tasks: lm-eval task, group or tag names (``niah_single_1``, ``ruler``, ``longbench`` ...).
        settings: ``[(method, options), ...]``, options as given (validated here, defaults filled).
        metadata: lm-eval's ``--metadata`` (e.g. ``{"max_seq_lengths": [4096]}``); each key must be read by one of
            the tasks.  ``tokenizer`` and ``pretrained`` default to ``tokenizer_path`` (RULER builds its prompts
            with that tokenizer).
        tokenizer_path: the folder (or hub id) the tokenizer was loaded from; default ``tokenizer.name_or_path``.
        limit: lm-eval's ``limit``: documents per task (a fraction of them below 1); ``None`` = all (RULER
            generates 500 per length).
        apply_chat_template, fewshot_as_multiturn, gen_kwargs: passed to ``simple_evaluate`` as given.
        recall_samples: measure attention recall of the patched prefill for documents with ``doc_id`` below this
            (one extra forward each); 0 = off.
        ranks: this process's place in a data-parallel run: lm-eval shards the requests, the measurements of every
            process are gathered, and process 0 gets the result.
        progress: called with a short line after each request.
        on_setting: called (on process 0) with the result so far after each finished setting.

    Returns:
        On process 0: ``{"tasks", "metadata" (as handed to lm-eval), "user_metadata", "tokenizer_path", "limit",
        "apply_chat_template", "fewshot_as_multiturn", "gen_kwargs", "recall_samples", "world_size",
        "lm_eval_version", "dense": {...}, "runs": [{...}, ...], "rows": [...], "same_samples": bool,
        "differing_tasks": [task, ...]}``; ``dense`` and each run hold ``label``, ``results`` (lm-eval's result dict, samples included) and ``samples``
        (:func:`~attnpatch.evals.lmeval.table.sample_records`); a run also ``method``, ``options`` (as given) and
        ``full_options``.  ``rows``: :func:`~attnpatch.evals.lmeval.table.score_rows`.  On other processes:
        ``{"world_size", "rank"}``.

    Raises:
        AttnpatchError: lm-eval not installed (first, before anything else).
        DataError: an unknown task.  OptionError: a metadata key no chosen task reads; a bad method option.
        UnknownMethodError, UnsupportedModelError: a bad setting.
        EvalInterrupted: Ctrl-C; ``partial`` holds the finished settings (``"interrupted": True``), or ``None``.
    """
    require_lm_eval()
    from lm_eval import simple_evaluate

    from .model import MeasuredHFLM

    r = ranks or Ranks()
    user = dict(metadata or {})
    path = tokenizer_path or getattr(tokenizer, "name_or_path", None)
    if not path:
        raise AttnpatchError("the tokenizer does not say where it was loaded from; pass tokenizer_path (a folder or hub id)")
    meta = {"tokenizer": str(path), "pretrained": str(path), **user}
    manager = task_manager(meta)
    check_tasks(manager, tasks)
    check_metadata(manager, tasks, user)
    checked = _check_settings(model, settings)
    plan: list[tuple[str | None, dict[str, Any], dict[str, Any]]] = [(None, {}, {})] + list(checked)
    out: dict[str, Any] = {
        "tasks": list(tasks), "metadata": meta, "user_metadata": user, "tokenizer_path": str(path), "limit": limit,
        "apply_chat_template": apply_chat_template, "fewshot_as_multiturn": fewshot_as_multiturn, "gen_kwargs": gen_kwargs,
        "recall_samples": recall_samples, "world_size": r.world_size, "lm_eval_version": lm_eval_version(),
        "dense": None, "runs": [],
    }
    done = 0
    try:
        for method, given, full in plan:
            label = setting_label(method, given)
            if method is not None:
                patch(model, method, **full)
            try:
                lm = MeasuredHFLM(model, tokenizer, ranks=r, recall_samples=recall_samples if method else 0, progress=progress, label=label)
                results = simple_evaluate(
                    model=lm, tasks=list(tasks), limit=limit, task_manager=manager, log_samples=True,
                    apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn, gen_kwargs=gen_kwargs,
                )
            finally:
                if method is not None:
                    unpatch(model)
            calls: dict = {}
            for part in r.gather(lm.calls):
                for key, rows in part.items():
                    calls.setdefault(key, rows)  # a request padded onto a shorter shard is measured twice: keep one
            done += 1
            if not r.main:
                continue
            entry = {"label": label, "results": results, "samples": sample_records(results, calls)}
            if method is None:
                out["dense"] = entry
            else:
                out["runs"].append({**entry, "method": method, "options": given, "full_options": full})
            if on_setting is not None:
                on_setting(_finish(out))
    except KeyboardInterrupt as exc:
        if isinstance(exc, EvalInterrupted):
            raise
        partial = {**_finish(out), "interrupted": True} if r.main and out["dense"] is not None else None
        raise EvalInterrupted(partial, f"{done}/{len(plan)} settings") from None
    if not r.main:
        return {"world_size": r.world_size, "rank": r.rank}
    return _finish(out)


def _finish(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` with its ``rows``, ``same_samples`` and ``differing_tasks`` (over the finished settings)."""
    if out["dense"] is None:
        return {**out, "rows": [], "same_samples": True, "differing_tasks": []}
    differ = differing_tasks([out["dense"]["samples"], *(x["samples"] for x in out["runs"])])
    return {**out, "rows": score_rows(out["dense"], out["runs"], differ), "same_samples": not differ,
            "differing_tasks": differ}


def write_results(json_path: str | Path, label: str, results: dict[str, Any]) -> Path:
    """Write lm-eval's result dict of one setting next to ``json_path``: ``<stem>.<setting>.lm-eval.json``."""
    from ..run.report import write_text

    p = Path(json_path)
    name = re.sub(r"[^A-Za-z0-9_.=-]+", "-", label).strip("-")
    return write_text(p.with_name(f"{p.stem}.{name}.lm-eval.json"), results_json(results))
