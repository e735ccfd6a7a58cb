"""The bottom layer of the attention math: everything that depends on what the machine has, and the one place that
chooses a kernel.  It imports no method.

* :mod:`.dispatch`: the capability table of every operation's kernels and :func:`~.dispatch.choose`, which every
  method asks;
* :mod:`.triton_support`: the one guarded Triton import, the interpreter and device checks of the launchers;
* :mod:`.aot`: the Triton kernels compiled ahead of time for a GPU that is not here (:func:`~.aot.compile_only`);
* :mod:`.flex`: FlexAttention (the compiled ``flex_attention``, length buckets, the fallback to the gather paths);
* :mod:`.cpu_kernel`: the C++ CPU extension (``csrc/anchor_cpu.cpp``), built on first use;
* :mod:`.blas`: BLAS thread control for small matrix work.
"""
