"""Method registry and model adapters.

Layers, each importing only the ones below it (and :mod:`attnpatch.options`, :mod:`attnpatch.errors`,
:mod:`attnpatch.attention`): :mod:`.state` ->
:mod:`.bench_hook` -> :mod:`.contract` (the method contract) -> :mod:`.config_file` (saved configs) ->
:mod:`.registry` (the registry, option validation) -> :mod:`.method_table` (the table in docs/methods.md) and
:mod:`.runtime` (what adapters call) -> :mod:`.adapter` / :mod:`.adapters` and :mod:`.methods` ->
:mod:`.api` (the public functions).
"""

from . import methods  # noqa: F401  (imports every method module: each registers its method)
from .api import (
    handle_of, is_patched, model_geometry, patch, patch_info, patched, record_stats, time_attention, token_sizes, token_source, unpatch,
)
from .config_file import load_config
from .method_table import methods_markdown
from .registry import get_method, list_methods, register_method, write_config
from .state import ForwardState, LayerRecord

__all__ = [
    "patch", "unpatch", "patched", "is_patched", "patch_info", "token_sizes", "token_source", "record_stats", "time_attention", "handle_of",
    "model_geometry", "write_config", "load_config", "get_method", "list_methods", "register_method", "methods_markdown", "ForwardState", "LayerRecord",
]
