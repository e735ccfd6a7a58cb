"""lm-eval's Hugging Face model class on an already-loaded (and possibly patched) model, measuring each request.

:class:`MeasuredHFLM` is ``lm_eval.models.huggingface.HFLM`` handed the model instance and its tokenizer; it
changes nothing in lm-eval's prompting, generation or scoring.  It

- answers the requests one at a time (batch size 1, as lm-eval's default), so each request's forward calls are
  known: per request it keeps the prompt tokens, the prefill wall time (:class:`~attnpatch.evals.ruler.runner.PrefillTimer`),
  and on a patched model the attention sparsity and the record modes of the prefill
  (:func:`attnpatch.patchers.api.record_stats`), and attention recall for the first documents
  (:func:`attnpatch.evals.recall.attention_recall`, one extra measuring forward);
- takes its place in a data-parallel run: handed a model instance, HFLM sets rank 0 of 1; here ``_rank``,
  ``_world_size`` and ``accelerator`` are those of the launch (lm-eval shards the requests by ``rank`` and
  ``world_size`` and gathers with the accelerator).

Source: lm-evaluation-harness (EleutherAI), ``lm_eval/models/huggingface.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from lm_eval.models.huggingface import HFLM

from ...patchers.api import is_patched, record_stats
from ..recall import attention_recall, summarize_layers
from ..ruler.runner import PrefillTimer
from ..run.distributed import Ranks

__all__ = ["MeasuredHFLM", "RanksAccelerator"]


class MeasuredHFLM(HFLM):
    """``HFLM`` on a loaded model that records, per request, what its forward calls cost.

    Args:
        model: a causal LM (``transformers`` ``PreTrainedModel``), patched or not; it may be patched and unpatched
            between evaluations (the calls go to it).
        tokenizer: its tokenizer.
        ranks: this process's place in a data-parallel run (:func:`attnpatch.evals.run.distributed.ranks`).
        recall_samples: measure attention recall of the patched prefill for documents with ``doc_id`` below this.
        progress: called with a short line after each request.

    Attributes:
        calls: ``{(task, doc_id, request index): [record, ...]}``, one record per forward-measured call: ``tokens``
            (prompt tokens), ``prefill_s`` (seconds), and on a patched model ``sparsity``, ``modes``, and where
            measured ``recall_mean``, ``recall_worst5``.
    """

    def __init__(self, model, tokenizer, *, ranks: Ranks | None = None, recall_samples: int = 0,
                 progress: Callable[[str], None] | None = None, label: str = "dense"):
        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=1)
        r = ranks or Ranks()
        if r.distributed:
            self._rank, self._world_size = r.rank, r.world_size
            self.accelerator = _accelerator(r)
        self.recall_samples = recall_samples
        self.progress = progress
        self.label = label
        self.calls: dict[tuple[str, Any, int], list[dict[str, Any]]] = {}
        self._key: tuple[str, Any, int] | None = None
        self._done = 0

    # one request at a time, so that each forward call belongs to one known request
    def _each(self, fn, requests, disable_tqdm: bool = False):
        out = []
        for req in requests:
            self._key = (req.task_name, req.doc_id, req.idx)
            out.extend(fn([req], disable_tqdm=True))
            self._done += 1
            if self.progress is not None:
                self.progress(self._line())
        self._key = None
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._each(super().generate_until, requests, disable_tqdm)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._each(super().loglikelihood, requests, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._each(super().loglikelihood_rolling, requests, disable_tqdm)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        with self._measure(context, generation_kwargs.get("attention_mask")):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def _model_call(self, inps, attn_mask=None, labels=None):
        with self._measure(inps, None):
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

    @contextlib.contextmanager
    def _measure(self, ids: torch.Tensor, mask: torch.Tensor | None):
        if self._key is None:  # a call outside a request (e.g. batch-size detection): not measured
            yield
            return
        model = self.model
        patched = is_patched(model)
        rec_ctx = record_stats(model) if patched else contextlib.nullcontext()
        with rec_ctx as rec, PrefillTimer(model) as timer:
            yield
        tokens = int(mask.sum().item()) if mask is not None and ids.shape[0] == 1 else int(ids.shape[1])
        row: dict[str, Any] = {"tokens": tokens, "prefill_s": float(timer.seconds or 0.0)}
        if patched:
            summ = summarize_layers(rec.forwards[0]) if rec is not None and rec.forwards else {}
            row.update(sparsity=summ.get("sparsity"), modes=sorted({layer["mode"] for layer in summ.get("per_layer", [])}))
            calls = self.calls.get(self._key) or []
            if not calls and _doc_index(self._key[1]) < self.recall_samples:
                with torch.no_grad():
                    r = attention_recall(model, ids, attention_mask=mask)
                row.update(recall_mean=r["recall_mean"], recall_worst5=r["recall_worst"])
        self.calls.setdefault(self._key, []).append(row)

    def _line(self) -> str:
        task, doc, idx = self._key
        rows = self.calls.get(self._key) or []
        what = f"{self.label}: {task} doc {doc}" + (f" request {idx}" if idx else "")
        if rows:
            what += f", {rows[0]['tokens']} tokens, prefill {sum(r['prefill_s'] for r in rows):.2f} s"
            if rows[0].get("sparsity") is not None:
                what += f", sparsity {100 * rows[0]['sparsity']:.1f}%"
        return f"[{self._done}] {what}"


class RanksAccelerator:
    """What lm-eval asks of ``HFLM.accelerator`` (``gather``, ``wait_for_everyone``, ``unwrap_model`` and the process
    numbers), on the process group of :func:`attnpatch.evals.run.distributed.ranks`: accelerate's own
    ``Accelerator`` sees one process on a CPU launch without MPI, where the group holds several."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.process_index = self.local_process_index = ranks.rank
        self.num_processes = ranks.world_size
        self.is_local_main_process = self.is_main_process = ranks.main

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` concatenated along dim 0 (0-d tensors stacked), in rank order, on every process."""
        parts = self.ranks.gather(tensor.detach().cpu())
        return torch.cat([p.reshape(1) if p.dim() == 0 else p for p in parts]).to(tensor.device)

    def wait_for_everyone(self) -> None:
        self.ranks.barrier()

    def unwrap_model(self, model):
        return model


def _accelerator(ranks: Ranks):
    """accelerate's ``Accelerator`` where it sees the launch's processes (a GPU launch), else :class:`RanksAccelerator`."""
    try:
        from accelerate import Accelerator

        acc = Accelerator()
        if acc.num_processes == ranks.world_size and acc.process_index == ranks.rank:
            return acc
    except (ImportError, RuntimeError, ValueError):
        pass
    return RanksAccelerator(ranks)


def _doc_index(doc_id: Any) -> int:
    try:
        return int(doc_id)
    except (TypeError, ValueError):
        return 1 << 62
