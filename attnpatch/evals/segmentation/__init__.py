"""Semantic segmentation on frozen patch features, patched against unpatched: ``attnpatch eval segmentation``.

Entry point: :func:`run_segmentation`; data: :func:`load_segmentation_set` (VOC, ADE20k, ``datasets``); read-outs
(linear probe, dense k-NN): :mod:`.heads`; metrics: :mod:`.metrics`.
"""

from .data import SegmentationSet, load_segmentation_set
from .runner import FITS, READOUTS, Fitted, check_dense_methods, fit_readouts, run_segmentation, square_preprocess

__all__ = ["run_segmentation", "fit_readouts", "Fitted", "load_segmentation_set", "SegmentationSet", "square_preprocess",
           "check_dense_methods", "READOUTS", "FITS"]
