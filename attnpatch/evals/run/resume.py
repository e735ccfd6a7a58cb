"""What a long eval keeps as it goes, so that ``--resume`` restarts it where it stopped.

* Image evals keep every finished batch (its features, timings and layer records) in a folder next to the
  result JSON, ``<json>.parts/`` (:class:`BatchStore`): one file per batch, written whole (a temporary
  file renamed), plus ``run.json``, the run's identity (model, data, settings, batch size ...).  A resumed
  run with the same identity reads the batches back and encodes only the others; the folder is removed
  once the final JSON is written.
* RULER keeps its finished cells in the result JSON itself (rewritten after each cell);
  :func:`resume_cells` reads them back for a run of the same configuration.

The batch files are Python pickles (``torch.save``) of this project's own records: resume only from a
folder your own run wrote.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from ...errors import AttnpatchError
from .distributed import Ranks

__all__ = ["BatchStore", "same_run", "resume_cells", "same_path"]


def same_path(name: str | None) -> str | None:
    """A model or data name as a run's identity: an existing file or folder by its real path (``./m`` and ``m`` are
    one run), anything else (a catalogue name, a hub id) as given."""
    return os.path.realpath(name) if name and os.path.exists(name) else name


def _plain(obj: Any) -> Any:
    """``obj`` as JSON would read it back (tuples -> lists, keys -> str)."""
    return json.loads(json.dumps(obj, default=str))


def _first_difference(old: Any, new: Any, path: str) -> tuple[str, Any, Any] | None:
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            d = _first_difference(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            d = _first_difference(a, b, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if old == new else (path, old, new)


def same_run(old: dict[str, Any], new: dict[str, Any], what: str) -> str | None:
    """``None`` when the two run identities agree, else one line naming the first field that differs
    (a nested field by its dotted path, e.g. ``settings.seed``)."""
    d = _first_difference(_plain(old), _plain(new), "")
    if d is None:
        return None
    field, a, b = d
    return (f"--resume: {what} was written by a run with {field}={json.dumps(a)}, this run has {field}={json.dumps(b)}; "
            f"run with the same settings, or without --resume to start again")


class BatchStore:
    """The finished batches of an image eval, one file per batch in ``path`` (see the module doc).

    Args:
        path: the folder (made with the first finished batch; without ``resume`` an existing one is removed first).
        key: the run's identity (JSON-able); a resumed run must have the same.
        ranks: the processes of the run (rank 0 prepares the folder; every rank writes its own batches).
        resume: read back the batches of an earlier run with the same ``key``.
        log: where a one-line note goes (e.g. that there was nothing to resume).

    Raises:
        AttnpatchError: ``resume`` and the folder holds another run (the field that differs is named), or an earlier
            run's folder cannot be removed; later, from :meth:`save`, a batch that cannot be written.
    """

    def __init__(self, path: str | os.PathLike, key: dict[str, Any], *, ranks: Ranks | None = None, resume: bool = False,
                 log: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.ranks = ranks or Ranks()
        self.resume = resume
        self._log = log
        self._key = _plain(key)
        err = None
        if self.ranks.main:
            err = self._prepare(log)
        err = self.ranks.broadcast(err)
        if err:
            exc = AttnpatchError(err)
            exc.quiet = not self.ranks.main  # the same error on every process: process 0 says it
            raise exc

    def _prepare(self, log) -> str | None:
        """Rank 0: check an earlier run's identity (``resume``) or clear its folder; the folder itself is made with
        the first finished batch (a run that fails before one leaves nothing behind)."""
        meta = self.path / "run.json"
        try:
            if self.resume and meta.exists():
                return same_run(json.loads(meta.read_text()), self._key, str(self.path))
            if self.resume and log:
                log(f"--resume: no earlier run in {self.path}; starting from the beginning")
            if self.path.exists():
                shutil.rmtree(self.path)
        except OSError as exc:
            return f"cannot keep the finished batches in {self.path}: {exc.strerror or exc}"
        return None

    def _file(self, start: int) -> Path:
        return self.path / f"batch-{start:010d}.pt"

    def load(self) -> dict[int, dict[str, Any]]:
        """The batches kept by an earlier run (``{first image index: record}``; empty without ``resume``)."""
        import torch

        if not self.resume or not self.path.is_dir():
            return {}
        out = {}
        for f in sorted(self.path.glob("batch-*.pt")):
            rec = torch.load(f, map_location="cpu", weights_only=False)
            out[int(rec["start"])] = rec
        if self.ranks.main and self._log:
            self._log(f"--resume: {len(out)} finished batch(es) read back from {self.path}")
        return out

    def save(self, record: dict[str, Any]) -> None:
        """Keep one finished batch (``record["start"]`` names it); written whole or not at all."""
        import torch

        self._ensure()
        self._write(self._file(int(record["start"])), lambda tmp: torch.save(record, tmp))

    def _ensure(self) -> None:
        """The folder and its ``run.json``, made by the first thing kept (of this process, or on this machine)."""
        if not (self.path / "run.json").exists():
            self.path.mkdir(parents=True, exist_ok=True)
            self._write(self.path / "run.json", lambda tmp: tmp.write_text(json.dumps(self._key, indent=1)))

    @staticmethod
    def _write(f: Path, write) -> None:
        """``write(tmp)`` then rename: the file is whole or absent.

        Raises:
            AttnpatchError: the file cannot be written (disk full, no permission), naming it."""
        tmp = f.with_name(f".{f.name}.{os.getpid()}.tmp")
        try:
            write(tmp)
            os.replace(tmp, f)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise AttnpatchError(f"cannot keep the finished batch {f}: {exc.strerror or exc}") from None

    def recall(self, name: str) -> Any:
        """What :meth:`keep` kept under ``name`` in an earlier run (``None`` without ``resume`` or when it did not)."""
        import torch

        f = self.path / f"{name}.pt"
        return torch.load(f, map_location="cpu", weights_only=False) if self.resume and f.is_file() else None

    def keep(self, name: str, value: Any) -> None:
        """Keep ``value`` (e.g. the settings a compare calibrated, which a resumed run must reuse) under ``name``."""
        import torch

        self._ensure()
        self._write(self.path / f"{name}.pt", lambda tmp: torch.save(value, tmp))

    def remove(self) -> None:
        """Delete the folder (rank 0, after every rank is done with it): the run finished and its JSON is written."""
        self.ranks.barrier()
        if self.ranks.main:
            shutil.rmtree(self.path, ignore_errors=True)


def _view(old: Any, key: Any) -> Any:
    """The part of ``old`` that ``key`` names: dicts on ``key``'s keys, recursively."""
    if isinstance(key, dict):
        old = old if isinstance(old, dict) else {}
        return {k: _view(old.get(k), v) for k, v in key.items()}
    return old


def resume_cells(path: str | os.PathLike, key: dict[str, Any], plan: list[tuple[str, int]],
                 log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The earlier result at ``path`` of the RULER run ``key``, for ``--resume``; ``None`` when there is no file.

    Args:
        path: the result JSON the earlier run wrote after each finished cell.
        key: the fields of the result that must equal the earlier run's (model, method, options, settings ...); a
            dict-valued field is compared on the keys it has (recursively).
        plan: this run's ``(task, length)`` cells in order; the earlier cells must be its first ones.
        log: gets one line: how many cells were read back, or that there was no file (the run starts from the beginning).

    Raises:
        AttnpatchError: the file is not a result JSON, comes from another run (the differing field named), or
            its cells are not the first cells of ``plan``.
    """
    p = Path(path)
    if not p.exists():
        if log:
            log(f"--resume: {p} does not exist; starting from the beginning")
        return None
    try:
        old = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise AttnpatchError(f"--resume: cannot read {p} ({exc}); remove it or run without --resume") from None
    if not isinstance(old, dict):
        raise AttnpatchError(f"--resume: {p} is not a result JSON of attnpatch eval")
    # a dict field is compared on the keys this run names (the result's "settings" also record e.g. torch_threads)
    err = same_run(_view(old, key), key, str(p))
    if err:
        raise AttnpatchError(err)
    runner = old.get("result") if isinstance(old.get("result"), dict) else old  # attnpatch compare: the runner's result inside
    cells = runner.get("cells") if "cells" in runner else (runner.get("dense") or {}).get("cells")
    got = [(c.get("task"), c.get("length")) for c in cells or []]
    if got != [tuple(x) for x in plan[: len(got)]]:
        raise AttnpatchError(f"--resume: the finished cells of {p} ({got}) are not the first cells of this run")
    if log:
        log(f"--resume: {len(got)} finished cell(s) read back from {p}")
    return old
