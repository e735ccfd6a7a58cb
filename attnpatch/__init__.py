"""attnpatch: training-free attention patcher for pretrained transformers.

    from attnpatch import patch, unpatch
    patch(model, method="anchor_attention", theta=12.0)   # in place
    unpatch(model)                                         # bit-exact restore
"""

from .errors import (
    AttnpatchError,
    DataError,
    InferenceOnlyError,
    ModelNotFoundError,
    OptionError,
    PatchStateError,
    UnknownMethodError,
    UnsupportedModelError,
)
from .evals.vision.sinks import sink_diagnostic
from .patchers import (
    is_patched, list_methods, model_geometry, patch, patch_info, patched, record_stats, time_attention, token_sizes, token_source, unpatch,
    write_config,
)

__version__ = "0.1.0"

__all__ = [
    "patch", "unpatch", "patched", "is_patched", "patch_info", "token_sizes", "token_source", "list_methods", "record_stats", "time_attention", "sink_diagnostic",
    "model_geometry", "write_config",
    "AttnpatchError", "OptionError", "UnknownMethodError", "UnsupportedModelError", "PatchStateError",
    "ModelNotFoundError", "DataError", "InferenceOnlyError",
]
