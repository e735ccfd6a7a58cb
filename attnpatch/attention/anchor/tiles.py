"""Tile and chunk sizes of AnchorAttention's fast paths (elements, rows or keys).

The other modules read them as ``tiles.NAME`` at call time, so a test may shrink one with
``monkeypatch.setattr(tiles, NAME, ...)`` to make tiles end inside blocks; none changes a result
beyond float rounding.
"""

# Scores buffer budget (elements) for one chunk of query blocks in the fast path.
CHUNK_ELEMENTS = 1 << 24
# Pooled-score buffer (elements) per chunk of query blocks in the stripe selection: small enough for cache.
SELECT_CHUNK_ELEMENTS = 1 << 21
# Pooled queries per key/value head in one stripe-selection GEMM (fewer give a less efficient matrix product).
SELECT_ROWS = 512
# Fewest keys per stripe-selection tile.
SELECT_MIN_TILE = 128
# Compiled selection: pooled queries per work item and keys per tile (a [rows, tile] float32 score
# buffer of 256 KiB per thread).
SELECT_KERNEL_ROWS = 256
SELECT_KERNEL_TILE = 256
# Keys and query rows per step of the compiled kernel (its per-thread buffers: Q_TILE x KV_TILE scores,
# KV_TILE keys and values, whatever the block size).
KV_TILE = 512
Q_TILE = 256
