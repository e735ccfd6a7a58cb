"""The block-sparse causal prefills that AnchorAttention is compared with, each over a gather path and a FlexAttention
pattern (:mod:`.masks`): A-shape (:mod:`.a_shape`: StreamingLLM's sinks + window), vertical-slash
(:mod:`.vertical_slash`: MInference), both on column + diagonal attention (:mod:`.column_diagonal`), and XAttention's
block top-k (:mod:`.block_topk`, on AnchorAttention's stripe attention).  Which path a call takes:
:func:`attnpatch.attention.backends.dispatch.choose`.
"""

from .a_shape import a_shape_attention, a_shape_recall
from .block_topk import block_topk_attention
from .column_diagonal import column_diagonal_attention, column_diagonal_recall
from .vertical_slash import vertical_slash_attention, vertical_slash_recall

__all__ = ["a_shape_attention", "a_shape_recall", "block_topk_attention", "column_diagonal_attention",
           "column_diagonal_recall", "vertical_slash_attention", "vertical_slash_recall"]
