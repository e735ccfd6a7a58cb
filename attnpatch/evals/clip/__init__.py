"""CLIP evals, dense vs patched image tower: zero-shot classification and image-text retrieval.

The package splits by concern; every name is importable from here as before:

* :mod:`.prompts` -- class names and prompt templates (:func:`resolve_templates`,
  :func:`resolve_classnames`, :func:`imagenet_classnames`, :data:`TEMPLATE_SETS`).
* :mod:`.captions` -- caption sets for retrieval (:class:`CaptionSet`, :func:`load_caption_set`).
* :mod:`.metrics` -- pure metric functions on embeddings, CLIP_benchmark's definitions
  (:func:`zeroshot_classifier`, :func:`zeroshot_accuracy`, :func:`retrieval_recall`,
  :func:`retrieval_chance`).
* :mod:`.runner` -- :func:`run_zeroshot_eval` and :func:`run_retrieval_eval`, both on the image pass
  shared with the vision evals (:func:`attnpatch.evals.image_pass.run_image_pass`).
"""

from __future__ import annotations

# the private helpers of the former single module stay importable from here too (not API)
from .captions import CAPTION_COLUMNS, CaptionSet, Log, _captions_of, load_caption_set  # noqa: F401
from .metrics import _as_float, _as_index, _best_rank, _check_ks, retrieval_chance, retrieval_recall, zeroshot_accuracy, zeroshot_classifier  # noqa: F401
from .prompts import (  # noqa: F401
    CLASSNAME_SETS, TEMPLATE_SETS, _is_imagenet1k, _openai_templates, _read_text, _timm_info, imagenet_classnames, resolve_classnames,
    resolve_templates,
)
from .runner import _cos, _image_pass, _row_common, _text_or_interrupt, _text_pass, run_retrieval_eval, run_zeroshot_eval  # noqa: F401

__all__ = [
    "TEMPLATE_SETS", "CLASSNAME_SETS", "CaptionSet", "imagenet_classnames", "resolve_templates", "resolve_classnames",
    "zeroshot_classifier", "zeroshot_accuracy", "retrieval_recall", "retrieval_chance", "load_caption_set",
    "run_zeroshot_eval", "run_retrieval_eval",
]
