"""Method registry and model adapters."""

from .core import handle_of, is_patched, patch, patch_info, patched, record_stats, time_attention, unpatch
from .registry import get_method, list_methods, register_method
from . import vision_methods  # noqa: F401  (registers fna, sink_mask, fna+sink_mask)
from .state import ForwardState, LayerRecord

__all__ = [
    "patch", "unpatch", "patched", "is_patched", "patch_info", "record_stats", "time_attention", "handle_of",
    "get_method", "list_methods", "register_method", "ForwardState", "LayerRecord",
]
