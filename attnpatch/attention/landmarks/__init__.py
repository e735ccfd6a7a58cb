"""Landmark tokens of the landmark methods (FNA, AnchorFormer): farthest-point sampling in its PyTorch, compiled and
Triton forms (:mod:`.fps`, :mod:`.fps_triton`), the other strategies and the gather of the landmarks' rows
(:mod:`.select`).

Source: "Fast Nyström Attention" (arXiv 2507.16018), Sec. 3; Gonzalez 1985 (farthest-first traversal).
"""

from .fps import farthest_point_sampling, farthest_point_sampling_reference
from .select import STRATEGIES, gather_tokens, kmeans_landmarks, select_landmarks

__all__ = ["farthest_point_sampling", "farthest_point_sampling_reference", "STRATEGIES", "gather_tokens",
           "kmeans_landmarks", "select_landmarks"]
