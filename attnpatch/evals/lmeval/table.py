"""The side-by-side table of ``attnpatch eval lm-eval``: lm-eval's scores of the unpatched model and of each
setting, per task and metric, with the prefill times, sparsity and recall measured on the same requests.

Rows are task x metric as lm-eval reports them (``results[task]["<metric>,<filter>"]``): for RULER tasks the
metric names are the context lengths (``"4096"``); a RULER sample is scored under its own length only (lm-eval
gives it ``-1`` under the others), so a length with no sample (value ``-1``) has no row.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from ..run.report import Column
from ..run.report import handback_note as report_note

__all__ = ["LMEVAL_COLUMNS", "sample_records", "score_rows", "handback_note", "differing_tasks"]

LMEVAL_COLUMNS = [
    Column("task", "task"),
    Column("metric", "metric"),
    Column("setting", "setting"),
    Column("n", "n", "int"),
    Column("dense", "dense", "f3"),
    Column("score", "patched", "f3"),
    Column("delta", "Δ", "f3"),
    Column("prefill_dense_s", "prefill dense", "s"),
    Column("prefill_s", "prefill patched", "s"),
    Column("speedup", "speed-up", "x"),
    Column("sparsity", "sparsity", "pct"),
    Column("recall_mean", "recall mean", "f3"),
    Column("recall_worst5", "recall worst5%", "f3"),
    Column("modes", "modes"),
]

_SKIP = {"name", "alias", "sample_len", "samples"}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def sample_records(results: dict[str, Any], calls: dict[tuple, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per lm-eval sample (``results["samples"]``, from ``log_samples=True``), sorted by task and document.

    Args:
        results: what ``lm_eval.simple_evaluate`` returned.
        calls: :attr:`~attnpatch.evals.lmeval.model.MeasuredHFLM.calls` of every process.

    Returns:
        dicts with ``task``, ``doc_id``, ``prompt_hash`` (lm-eval's), ``target``, ``answer`` (lm-eval's filtered
        response(s)), ``metrics`` (the scores lm-eval gave it), ``tokens`` (prompt tokens of its first request),
        ``prefill_s`` (seconds, summed over its requests' forward calls), and where measured ``sparsity``
        (mean over its calls), ``modes``, ``recall_mean``, ``recall_worst5``.
    """
    by_doc: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for (task, doc, _idx), rows in sorted(calls.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2])):
        by_doc.setdefault((task, doc), []).extend(rows)
    out = []
    for task, samples in (results.get("samples") or {}).items():
        for s in samples:
            rows = by_doc.get((task, s["doc_id"])) or []
            answer = s.get("filtered_resps")
            if isinstance(answer, list) and len(answer) == 1:
                answer = answer[0]
            rec: dict[str, Any] = {
                "task": task, "doc_id": s["doc_id"], "prompt_hash": s.get("prompt_hash"), "target": s.get("target"),
                "answer": answer, "metrics": {m: s.get(m) for m in s.get("metrics") or []}, "filter": s.get("filter"),
                "tokens": rows[0]["tokens"] if rows else None, "prefill_s": sum(r["prefill_s"] for r in rows) if rows else None,
            }
            if any("sparsity" in r for r in rows):
                rec.update(sparsity=_mean([r.get("sparsity") for r in rows]), modes=sorted({m for r in rows for m in r.get("modes") or []}))
            measured = [r for r in rows if "recall_mean" in r]
            if measured:
                rec.update(recall_mean=_mean([r["recall_mean"] for r in measured]), recall_worst5=_mean([r["recall_worst5"] for r in measured]))
            out.append(rec)
    return sorted(out, key=lambda r: (r["task"], _order(r["doc_id"]), r.get("filter") or ""))


def _order(doc_id: Any):
    return (0, int(doc_id), "") if isinstance(doc_id, int) or str(doc_id).isdigit() else (1, 0, str(doc_id))


def differing_tasks(runs: Sequence[Sequence[dict[str, Any]]]) -> list[str]:
    """The tasks whose settings did not all answer the same prompts (lm-eval's ``prompt_hash`` per document), sorted."""
    per: list[dict[str, list]] = []
    for recs in runs:
        by: dict[str, list] = {}
        for r in recs:
            by.setdefault(r["task"], []).append((str(r["doc_id"]), r.get("filter") or "", r.get("prompt_hash")))
        per.append({t: sorted(v) for t, v in by.items()})
    tasks = sorted({t for p in per for t in p})
    return [t for t in tasks if any(p.get(t) != per[0].get(t) for p in per)]


def _metrics(res: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """``[(row metric name, lm-eval key, value)]`` of one task's results (stderr entries left out)."""
    out = []
    for key, value in res.items():
        if key in _SKIP or "_stderr" in key or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        metric, _, filt = key.partition(",")
        out.append((metric if filt in ("", "none") else f"{metric} ({filt})", key, value))
    return out


def _leaf_tasks(results: dict[str, Any], task: str) -> list[str]:
    subs = (results.get("group_subtasks") or {}).get(task)
    if not subs:
        return [task]
    return [t for s in subs for t in _leaf_tasks(results, s)]


def _under(samples: Sequence[dict[str, Any]], tasks: Sequence[str], key: str) -> list[dict[str, Any]]:
    """The samples of ``tasks`` scored under the lm-eval result key ``key`` (``metric,filter``)."""
    metric, _, filt = key.partition(",")
    out = []
    for s in samples:
        if s["task"] not in tasks or (s.get("filter") or "none") != (filt or "none") or metric not in s["metrics"]:
            continue
        if s["metrics"][metric] == -1:  # RULER: a sample of another length
            continue
        out.append(s)
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def score_rows(dense: dict[str, Any], runs: Sequence[dict[str, Any]], differ: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The table rows: per task (lm-eval's result order, groups included) and metric, one row per setting (one
    ``dense`` row when there is none).

    Args:
        dense: ``{"results": lm-eval's result, "samples": sample_records(...)}`` of the unpatched model.
        runs: the same per setting, plus ``"label"``.

    Returns:
        dicts with ``task``, ``metric``, ``setting``, ``n`` (samples under the row), ``dense`` and ``score``
        (lm-eval's aggregate), ``delta`` (score - dense), ``prefill_dense_s`` and ``prefill_s`` (median seconds
        over the row's samples), ``speedup``, and for patched settings ``sparsity``, ``recall_mean``,
        ``recall_worst5`` (means over the samples that have them) and ``modes`` (record modes of the prefills).
        Where a row's tasks are in ``differ`` (:func:`differing_tasks`: the settings answered other prompts) its
        ``delta`` is ``None`` and ``prompts`` is ``"differ"``: the scores are not of the same documents.
    """
    res_d = dense["results"].get("results") or {}
    rows = []
    for task, res in res_d.items():
        tasks = _leaf_tasks(dense["results"], task)
        for metric, key, value in _metrics(res):
            d_samples = _under(dense["samples"], tasks, key)
            if value == -1 and not d_samples:
                continue
            base = {"task": task, "metric": metric, "n": len(d_samples), "dense": value,
                    "prefill_dense_s": _median([s["prefill_s"] for s in d_samples])}
            if not runs:
                rows.append({**base, "setting": "dense"})
            for run in runs:
                score = (run["results"].get("results") or {}).get(task, {}).get(key)
                samples = _under(run["samples"], tasks, key)
                apart = any(t in differ for t in tasks)
                row = {**base, "setting": run["label"], "score": score,
                       "delta": score - value if isinstance(score, (int, float)) and not apart else None,
                       "prefill_s": _median([s["prefill_s"] for s in samples])}
                row["speedup"] = row["prefill_dense_s"] / row["prefill_s"] if row["prefill_dense_s"] and row["prefill_s"] else None
                if apart:
                    row["prompts"] = "differ"
                if any("sparsity" in s for s in samples):
                    row.update(sparsity=_mean([s.get("sparsity") for s in samples]),
                               recall_mean=_mean([s.get("recall_mean") for s in samples]),
                               recall_worst5=_mean([s.get("recall_worst5") for s in samples]),
                               modes=", ".join(sorted({m for s in samples for m in s.get("modes") or []})) or None)
                rows.append(row)
    return rows


def handback_note(rows: Sequence[dict[str, Any]]) -> str | None:
    """One line naming the rows whose patched prefills ran the model's own attention in every layer (every record mode
    ``dense:<why>``: prompts below the method's minimum length, a_shape's window at least the prompt, ...), or
    ``None``."""
    patched = [r for r in rows if "modes" in r]
    return report_note([(f"{r['task']} {r['metric']} ({r['setting']})", r.get("modes")) for r in patched], len(patched),
                       "row")
