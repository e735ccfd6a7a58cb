"""lm-evaluation-harness's side of ``attnpatch eval lm-eval`` before the model loads: is the harness installed,
the ``--metadata`` text parsed as lm-eval's own command line parses it, the task names checked against lm-eval's
task index, and the metadata keys checked against the keys the chosen tasks read.

lm-eval hands the whole metadata dict to every task's dataset builder (``custom_dataset``, e.g. RULER's
generators) and records it; a key no builder reads changes nothing, silently.  Which keys a builder reads is
taken from its own source (``kwargs.get("key")``, ``kwargs.pop("key")``, ``kwargs["key"]``; RULER's tokenizer
look-up reads lm-eval's ``TOKENIZER_ARG_KEYS``).  A task without a dataset builder reads no metadata key.

Source: lm-evaluation-harness (EleutherAI), ``lm_eval.tasks.TaskManager``, ``lm_eval._cli.utils``.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path
from typing import Any, Sequence

from ...errors import AttnpatchError, DataError, OptionError

__all__ = [
    "INSTALL_HINT", "require_lm_eval", "parse_metadata", "check_metadata_value", "task_manager", "check_tasks", "metadata_readers", "check_metadata",
    "lm_eval_version",
]

#: The one line printed when lm-evaluation-harness is not installed.
INSTALL_HINT = "attnpatch eval lm-eval needs lm-evaluation-harness: pip install 'attnpatch[lm-eval]'"

#: The keys RULER's tokenizer look-up reads (lm-eval's ``TOKENIZER_ARG_KEYS``), when lm-eval does not say.
_TOKENIZER_KEYS = ("tokenizer", "pretrained", "model")
_KWARG = re.compile(r"""kwargs\s*(?:\.\s*(?:get|pop)\s*\(\s*|\[\s*)["']([A-Za-z_][A-Za-z0-9_]*)["']""")


def require_lm_eval() -> None:
    """Raise :class:`~attnpatch.errors.AttnpatchError` (:data:`INSTALL_HINT`) when ``lm_eval`` cannot be imported."""
    try:
        import lm_eval  # noqa: F401
        import lm_eval.models.huggingface  # noqa: F401
    except ImportError:
        raise AttnpatchError(INSTALL_HINT) from None


def lm_eval_version() -> str | None:
    """The installed lm-evaluation-harness version (``importlib.metadata``), or ``None``."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("lm_eval", "lm-eval"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def parse_metadata(values: Sequence[str] | None) -> dict[str, Any]:
    """``--metadata`` values as lm-eval's command line reads them: a JSON object, or ``key=value`` items (values
    parsed by lm-eval, e.g. ``max_seq_lengths=[4096,8192]``), each value checked (:func:`check_metadata_value`).

    Raises:
        OptionError: a value that is neither a JSON object nor ``key=value`` items, a malformed value, or a key given
            twice (one line, naming it).
    """
    from lm_eval._cli.utils import key_val_to_dict, try_parse_json

    out: dict[str, Any] = {}
    for text in values or []:
        try:
            got = try_parse_json(text)
            if not isinstance(got, dict):
                got = key_val_to_dict(text)
        except (ValueError, SyntaxError) as err:
            why = "not a valid JSON object" if text.strip().startswith("{") else str(err)
            raise OptionError(f"--metadata {text!r}: {why}; expected a JSON object or key=value items "
                              "(e.g. --metadata 'max_seq_lengths=[4096,8192]')") from None
        for key, value in got.items():
            if key in out:
                raise OptionError(f"--metadata {key} is given twice ({key}={out[key]!r} and {key}={value!r}): give "
                                  "each key once")
            check_metadata_value(key, value)
            out[key] = value
    return out


#: Metadata keys whose values lm-eval's task builders read in one shape: ``(check, what is allowed)``.
_VALUE_RULES = {
    "max_seq_lengths": (lambda v: isinstance(v, (list, tuple)) and len(v) > 0
                        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v),
                        "a list of context lengths in tokens, e.g. max_seq_lengths=[4096,8192] (RULER)"),
}


def check_metadata_value(key: str, value: Any) -> None:
    """One ``--metadata`` value, before anything loads: a text that opens or closes a list, dict or tuple but did not
    parse as one (``max_seq_lengths=[1024``) is refused, and so is a value of a shape the key's readers do not take
    (:data:`_VALUE_RULES`, e.g. ``max_seq_lengths=4096``, which RULER would iterate).

    Raises:
        OptionError: naming the key, the value and what is allowed.
    """
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in "[{(" and text or text[-1:] in "]})" and text:
            raise OptionError(f"--metadata {key}={value}: not a valid list, dict or tuple (unbalanced or malformed); "
                              f"e.g. --metadata 'max_seq_lengths=[4096,8192]'")
    rule = _VALUE_RULES.get(key)
    if rule is not None and not rule[0](value):
        raise OptionError(f"--metadata {key}={value!r}: must be {rule[1]}")


@functools.lru_cache(maxsize=1)
def _index_manager():
    from .index import cached_task_manager

    return cached_task_manager()


def task_manager(metadata: dict[str, Any]):
    """lm-eval's ``TaskManager`` handing ``metadata`` to every task it loads.

    lm-eval's task index (built by reading every task file lm-eval ships) is read once per process from its copy on
    disk (:mod:`.index`; built and written there the first time) and shared:
    the manager for ``metadata`` is the indexed one with its own task factory (``TaskFactory(meta=metadata)``, what
    ``TaskManager(metadata=...)`` makes); a fresh ``TaskManager(metadata=metadata)`` where this lm-eval lays it out
    otherwise.
    """
    import copy

    base = _index_manager()
    try:
        from lm_eval.tasks._factory import TaskFactory

        if not hasattr(base, "_factory"):
            raise AttributeError
        manager = copy.copy(base)
        manager._factory = TaskFactory(meta=dict(metadata) or None)
        manager.metadata = dict(metadata) or None
    except (ImportError, AttributeError, TypeError):
        from lm_eval.tasks import TaskManager

        manager = TaskManager(metadata=dict(metadata) or None)
    return _load_once(manager)


def _load_once(manager):
    """``manager`` whose ``load`` builds each task list once and hands the same task objects to every later call: every
    setting of a run evaluates the very documents the first one did.  lm-eval rebuilds a task's documents on each
    load, and some of its generators draw from a module-level random generator that the global seeds of
    ``simple_evaluate`` do not reset (RULER's ``ruler_cwe``), so a second load gives other prompts."""
    if not hasattr(manager, "load"):
        return manager
    real, loaded = manager.load, {}

    def load(tasks, *args, **kwargs):
        key = repr((tasks, args, sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = real(tasks, *args, **kwargs)
        return loaded[key]

    manager.load = load
    return manager


def check_tasks(manager, names: Sequence[str]) -> None:
    """Every name must be an lm-eval task, group or tag (or a glob over them, or a task YAML file).

    Raises:
        DataError: an unknown name, with lm-eval's closest names.
    """
    known = manager.all_tasks
    for name in names:
        if name in manager.task_index or Path(name).is_file() or (any(c in name for c in "*?[") and manager.match_tasks([name])):
            continue
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
        hint = f"closest: {', '.join(close)}" if close else "see `lm-eval ls tasks`"
        raise DataError(f"--tasks {name}: not an lm-eval task, group or tag ({len(known)} known; {hint})")


def _leaves(manager, name: str, seen: set[str]) -> list[tuple[str, dict[str, Any] | None]]:
    """``[(task name, its YAML config or None)]`` of the tasks a task/group/tag name stands for."""
    if name in seen:
        return []
    seen.add(name)
    index = manager.task_index
    entry = index.get(name)
    if entry is None:
        return [(n, index[n].cfg) for n in manager.match_tasks([name]) if n in index] if any(c in name for c in "*?[") else [(name, None)]
    kind = getattr(entry.kind, "name", str(entry.kind)).upper()
    if kind.endswith("GROUP"):
        out = []
        for child in (entry.cfg or {}).get("task") or []:
            if isinstance(child, str):
                out += _leaves(manager, child, seen)
            elif isinstance(child, dict) and isinstance(child.get("task"), str):
                base = index[child["task"]].cfg if child["task"] in index else None
                out.append((child["task"], {**(base or {}), **child}))
        return out
    if kind.endswith("TAG"):
        return [(n, e.cfg) for n, e in index.items() if name in (e.tags or ()) and n not in seen]
    return [(name, None if kind.startswith("PY") else entry.cfg)]


def _builder_keys(builder: Any) -> set[str] | None:
    """The metadata keys a ``custom_dataset`` function reads, from its module's source; ``None`` when unknown."""
    if not isinstance(builder, str) or "." not in builder:
        return None
    module, _, func = builder.rpartition(".")
    path = Path(module + ".py")
    if not path.is_file():
        return None
    src = path.read_text(errors="replace")
    keys = set(_KWARG.findall(src))
    if "resolve_tokenizer_name" in src or "get_tokenizer(" in src:
        try:
            from lm_eval.tasks.ruler.common_utils import TOKENIZER_ARG_KEYS
        except ImportError:
            TOKENIZER_ARG_KEYS = _TOKENIZER_KEYS
        keys |= set(TOKENIZER_ARG_KEYS)
    return keys


def metadata_readers(manager, names: Sequence[str]) -> dict[str, set[str] | None]:
    """Per task the names stand for: the metadata keys its dataset builder reads (empty: it reads none; ``None``:
    unknown, e.g. a task written in Python)."""
    out: dict[str, set[str] | None] = {}
    seen: set[str] = set()
    for name in names:
        for task, cfg in _leaves(manager, name, seen):
            if cfg is None or cfg.get("class") is not None:
                out[task] = None
            elif cfg.get("custom_dataset") is not None:
                out[task] = _builder_keys(cfg["custom_dataset"])
            else:
                out[task] = set()
    return out


def check_metadata(manager, names: Sequence[str], given: dict[str, Any]) -> None:
    """Every ``--metadata`` key must be read by at least one chosen task (unless a task's readers are unknown).

    Raises:
        OptionError: a key no chosen task reads, naming the keys they do read.
    """
    readers = metadata_readers(manager, names)
    if any(keys is None for keys in readers.values()):
        return
    read = set().union(*readers.values()) if readers else set()
    for key in given:
        if key not in read:
            which = ", ".join(sorted(read)) if read else "none (no chosen task builds its data from metadata)"
            raise OptionError(f"--metadata key {key!r} is read by none of the chosen tasks ({', '.join(readers)}); "
                              f"the keys they read: {which}")
