"""lm-evaluation-harness's task index, built once per lm-eval installation and kept on disk.

lm-eval's ``TaskManager`` indexes its task, group and tag names by reading every task file it ships (lm-eval 0.4.13:
about 14,000 YAML files, 13 s on an idle core, 24-50 s on a busy 2-core machine) each time it is made, so that a
misspelt task name or metadata key waited that long to be refused.  :func:`cached_task_manager` makes the
``TaskManager`` once per process with the index read back from a JSON file under ``cache_dir()/lm-eval/`` (about
1 s), written the first time it is built.  The file is keyed by lm-eval's version and its task folder (path, number
of YAML files, their total size and newest modification time), so an upgrade or an edited task file builds it again.

The index is lm-eval's own (``TaskIndex.build``: names, kinds, YAML paths, parsed configs, tags); it is written
only when its JSON form reads back equal to it, and a file that does not read back (another layout, a partial
write) is ignored and rebuilt.  ``TaskManager.__init__`` runs unchanged with the stored index in place of its
file walk.

Source: lm-evaluation-harness (EleutherAI), ``lm_eval.tasks.manager.TaskManager``, ``lm_eval.tasks._index``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ...log import Log, log_stderr

__all__ = ["cached_task_manager", "index_file"]

_FORMAT = 1  # the layout of the JSON file below


def _tasks_folder() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def index_file() -> Path:
    """The JSON file holding the task index of the installed lm-eval (whether or not it exists yet): named after
    lm-eval's version and a fingerprint of its task folder (path, count, total size, newest mtime of its YAML files)."""
    import lm_eval

    from ...fetch import cache_dir

    root = _tasks_folder()
    count = size = newest = 0
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".yaml"):
                st = os.stat(os.path.join(folder, name))
                count, size, newest = count + 1, size + st.st_size, max(newest, st.st_mtime_ns)
    key = hashlib.sha256(f"{_FORMAT}|{root}|{count}|{size}|{newest}".encode()).hexdigest()[:16]
    return cache_dir() / "lm-eval" / f"task-index-{getattr(lm_eval, '__version__', 'unknown')}-{key}.json"


def _to_json(index: dict[str, Any]) -> dict[str, Any]:
    return {name: {"name": e.name, "kind": e.kind.name, "yaml_path": None if e.yaml_path is None else str(e.yaml_path),
                   "cfg": e.cfg, "tags": sorted(e.tags)} for name, e in index.items()}


def _from_json(data: dict[str, Any]) -> dict[str, Any]:
    from lm_eval.tasks._index import Entry, Kind

    return {name: Entry(name=d["name"], kind=Kind[d["kind"]], yaml_path=None if d["yaml_path"] is None else Path(d["yaml_path"]),
                        cfg=d["cfg"], tags=set(d["tags"])) for name, d in data.items()}


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return _from_json(json.loads(path.read_text(encoding="utf-8")))
    except Exception:  # noqa: BLE001 - missing, partial, or written by another lm-eval layout: build it again
        return None


def _write(path: Path, index: dict[str, Any]) -> None:
    from ..run.report import write_text

    try:
        text = json.dumps(_to_json(index))
        if _from_json(json.loads(text)) != index:  # a config value JSON does not keep (a tuple, a non-string key)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, text)
    except (TypeError, ValueError, OSError):
        return  # not cached: the next run builds the index again


def cached_task_manager(log: Log = log_stderr):
    """lm-eval's ``TaskManager()`` (its default task folder, no metadata), its index read from :func:`index_file`,
    or built and written there when absent (``log`` says so first: it takes seconds to minutes)."""
    from lm_eval.tasks import TaskManager

    try:  # lm-eval's own index class (lm-eval 0.4.13 and later in the pinned range); another layout: no cache
        from lm_eval.tasks._index import TaskIndex

        real = vars(TaskIndex)["build"]  # the staticmethod itself, put back as it was
    except (ImportError, KeyError):
        return TaskManager()
    path = index_file()
    index = _read(path)
    if index is None:
        log(f"building lm-eval's task index (it reads every task file lm-eval ships; once, then kept in {path}) ...")
        manager = TaskManager()
        _write(path, manager.task_index)
        return manager
    TaskIndex.build = staticmethod(lambda paths, **kwargs: index)
    try:
        return TaskManager()
    finally:
        TaskIndex.build = real
