"""The kept sets of the block-sparse baselines as FlexAttention patterns, one small module each (attention-gym's
``attn_gym/masks/`` layout): :mod:`.a_shape`, :mod:`.column_diagonal` (vertical-slash), :mod:`.block` (block top-k),
over the tile geometry they share (:mod:`.tiles`).
"""

from .a_shape import a_shape_flex
from .block import block_flex
from .column_diagonal import column_diagonal_flex

__all__ = ["a_shape_flex", "block_flex", "column_diagonal_flex"]
