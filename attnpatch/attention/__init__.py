"""The attention math: pure functions on ``[batch, heads, tokens, head_dim]`` tensors, one module per method.

No model knowledge lives here (that is :mod:`attnpatch.patchers`); each registered method
(:mod:`attnpatch.patchers.methods`) calls the module(s) of its kernel:

======================  ==================================================================================
method                  module(s)
======================  ==================================================================================
``dense``               none (the model's own attention)
``anchor_attention``    :mod:`.anchor` (package: config, selection, attention, recall guard, reference)
``a_shape``             :mod:`.streaming` (on :mod:`.column_diagonal`)
``block_topk``          :mod:`.block_topk` (on :mod:`.anchor`'s sparse attention)
``fna``                 :mod:`.nystrom` and :mod:`.nystrom_local` (landmarks: :mod:`.landmarks`; GPU: below)
``fna+sink_mask``       :mod:`.nystrom` with sink masking (:mod:`.sinks`); fallback :mod:`.exact`
``sink_mask``           :mod:`.sinks` and :mod:`.exact`
``nystromformer``       :mod:`.nystromformer`
``anchorformer``        :mod:`.anchorformer` (anchors: :mod:`.landmarks`)
``relu_linear``         :mod:`.linear`
``tome``                :mod:`.merge`
``vertical_slash``      :mod:`.vertical_slash` (on :mod:`.column_diagonal`)
======================  ==================================================================================

Shared by several methods: :mod:`.exact` (exact attention, with keys masked after the softmax),
:mod:`.landmarks` (landmark selection: farthest-point sampling, k-means, ...), :mod:`.column_diagonal`
(attention over kept columns and diagonals), :mod:`.prefill` (input checks, per-sequence padding),
:mod:`.blas_threads` (one-thread BLAS for small matrix work), :mod:`.cpu_kernel` (the compiled CPU
kernel of ``csrc/``), :mod:`.flex` and :mod:`.flex_patterns` (the kept sets of ``a_shape``, ``vertical_slash``
and ``block_topk`` as a FlexAttention ``BlockMask``: their ``kernel="flex"``).  FNA's GPU path: :mod:`.landmarks_triton` (FPS as one Triton launch), :mod:`.pinv_matmul` and
:mod:`.pinv_triton` (the landmark pseudo-inverse from products only), :mod:`.fna_layer` (one layer from ``q, k, v``,
and the inputs a benchmark times it on).
"""
