"""CLIP evals, dense vs patched image tower: zero-shot classification and image-text retrieval.

The package splits by concern; its public names are importable from here:

* :mod:`.prompts` -- class names and prompt templates (:func:`resolve_templates`,
  :func:`resolve_classnames`, :func:`imagenet_classnames`, :data:`TEMPLATE_SETS`).
* :mod:`.captions` -- caption sets for retrieval (:class:`CaptionSet`, :func:`load_caption_set`).
* :mod:`.metrics` -- pure metric functions on embeddings, CLIP_benchmark's definitions
  (:func:`zeroshot_classifier`, :func:`zeroshot_accuracy`, :func:`retrieval_recall`,
  :func:`retrieval_chance`), and CLIP_benchmark's result keys (:func:`classification_metrics`,
  :func:`retrieval_metrics`) with the per-query ranks (:func:`retrieval_predictions`).
* :mod:`.runner` -- :func:`run_zeroshot_eval` and :func:`run_retrieval_eval`, both on the image pass
  shared with the vision evals (:func:`attnpatch.evals.vision.image_pass.run_image_pass`).
* :mod:`.plots` -- each eval's PNG: top-1 or recall against speed-up per setting, chance as a line.
* :mod:`.table` -- each eval's table columns and rows (:data:`~.table.ZEROSHOT_COLUMNS`, :func:`~.table.clip_rows`).
"""

from __future__ import annotations

from .captions import CAPTION_COLUMNS, CaptionSet, load_caption_set
from .metrics import (
    classification_metrics, retrieval_chance, retrieval_metrics, retrieval_predictions, retrieval_recall, zeroshot_accuracy,
    zeroshot_classifier,
)
from .prompts import CLASSNAME_SETS, TEMPLATE_SETS, imagenet_classnames, resolve_classnames, resolve_templates
from .runner import run_retrieval_eval, run_zeroshot_eval

__all__ = [
    "TEMPLATE_SETS", "CLASSNAME_SETS", "CaptionSet", "imagenet_classnames", "resolve_templates", "resolve_classnames",
    "zeroshot_classifier", "zeroshot_accuracy", "retrieval_recall", "retrieval_chance", "load_caption_set",
    "classification_metrics", "retrieval_metrics", "retrieval_predictions",
    "run_zeroshot_eval", "run_retrieval_eval",
]
