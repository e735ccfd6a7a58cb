"""The Nyström methods: Fast Nyström Attention (:mod:`.fna`) with its exact-local-window hybrid (:mod:`.local`) and
one layer from ``q, k, v`` (:mod:`.layer`), Nyströmformer (:mod:`.nystromformer`), and the landmark kernel's
pseudo-inverse with its one dispatcher (:mod:`.pinv`; the product form :mod:`.pinv_matmul` and its Triton kernel
:mod:`.pinv_triton`).  Landmark selection: :mod:`attnpatch.attention.landmarks`.

Sources: FNA, arXiv 2507.16018 (Sec. 3, Eq. 3); Nyströmformer, arXiv 2102.03902 (Eq. 13-16); Scatterbrain, arXiv
2110.15343 (sparse + low-rank, the local-window hybrid).
"""

from .fna import RENORM_MIN_MASS, nystrom_attention
from .layer import fna_layer, fna_layer_case
from .local import grid_of, nystrom_local_attention, nystrom_local_reference, window_keys
from .nystromformer import nystromformer_attention, segment_means, segment_plan
from .pinv import PINV_MODES, landmark_pinv, landmark_pinv_work
from .pinv_matmul import landmark_pinv_matmul

__all__ = [
    "RENORM_MIN_MASS", "nystrom_attention", "fna_layer", "fna_layer_case", "grid_of", "nystrom_local_attention",
    "nystrom_local_reference", "window_keys", "nystromformer_attention", "segment_means", "segment_plan", "PINV_MODES",
    "landmark_pinv", "landmark_pinv_work", "landmark_pinv_matmul",
]
