"""lm-evaluation-harness tasks on a patched causal LM, the unpatched model and each setting side by side
(``attnpatch eval lm-eval``).

lm-eval (the optional extra ``attnpatch[lm-eval]``) is imported only when a run starts: :func:`run_lm_eval`
(:mod:`.run`), lm-eval's ``HFLM`` measuring each request (:mod:`.model`), the task and ``--metadata`` checks
(:mod:`.tasks`), lm-eval's task index kept on disk (:mod:`.index`) and the table (:mod:`.table`).
"""

from __future__ import annotations

from .run import installed_packages, results_json, run_lm_eval, setting_label, write_results
from .table import LMEVAL_COLUMNS, differing_tasks, handback_note, sample_records, score_rows
from .tasks import (
    INSTALL_HINT, check_metadata, check_tasks, lm_eval_version, metadata_readers, parse_metadata, require_lm_eval, task_manager,
)

__all__ = [
    "run_lm_eval", "setting_label", "results_json", "write_results", "installed_packages", "LMEVAL_COLUMNS", "handback_note",
    "differing_tasks", "sample_records", "score_rows", "INSTALL_HINT", "check_metadata", "check_tasks", "lm_eval_version",
    "metadata_readers", "parse_metadata", "require_lm_eval", "task_manager",
]
