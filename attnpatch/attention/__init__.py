"""The attention math: pure functions on ``[batch, heads, tokens, head_dim]`` tensors, one package per method family
(its PyTorch reference beside its kernels) over one backend layer.

No model knowledge lives here (that is :mod:`attnpatch.patchers`); each registered method
(:mod:`attnpatch.patchers.methods`) calls the package of its family:

======================  ==================================================================================
method                  math
======================  ==================================================================================
``dense``               none (the model's own attention)
``anchor_attention``    :mod:`.anchor` (config, selection, attention over kept stripes, recall guard, float64 reference,
                        Triton kernels)
``a_shape``             :mod:`.sparse` (:mod:`.sparse.a_shape` on :mod:`.sparse.column_diagonal`)
``vertical_slash``      :mod:`.sparse` (:mod:`.sparse.vertical_slash` on :mod:`.sparse.column_diagonal`)
``block_topk``          :mod:`.sparse` (:mod:`.sparse.block_topk`, on :mod:`.anchor`'s stripe attention)
``fna``                 :mod:`.nystrom` (FNA, the local-window hybrid, the pseudo-inverse, one layer) and :mod:`.landmarks`
``fna+sink_mask``       :mod:`.nystrom` with sink masking (:mod:`.sinks`); exact layers :mod:`.exact`
``sink_mask``           :mod:`.sinks` and :mod:`.exact`
``nystromformer``       :mod:`.nystrom.nystromformer`
``anchorformer``        :mod:`.anchorformer` (anchors: :mod:`.landmarks`)
``relu_linear``         :mod:`.linear`
``tome``                :mod:`.merge`
``tome+fna``            :mod:`.merge`, then :mod:`.nystrom` with a key bias (``log(size)``)
======================  ==================================================================================

Shared by several families: :mod:`.exact` (exact attention with keys masked after the softmax; grouped-query keys
repeated), :mod:`.prefill` (the input checks of a causal call, per-sequence padding), :mod:`.sparse.masks` (the kept
sets of the block-sparse baselines as FlexAttention patterns, one small module each).

:mod:`.backends` is the bottom layer, importing no method: the one guarded Triton import (:mod:`.backends.triton_support`),
the ahead-of-time compile driver (:mod:`.backends.aot`), FlexAttention (:mod:`.backends.flex`), the C++ CPU extension
(:mod:`.backends.cpu_kernel`), BLAS thread control (:mod:`.backends.blas`), and the one place that chooses a kernel
(:mod:`.backends.dispatch`): every method asks :func:`~.backends.dispatch.choose` and runs what it names.
"""
