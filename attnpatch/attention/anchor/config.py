"""AnchorConfig and AnchorStats: the options of AnchorAttention and its per-call statistics.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass, field

import torch

from ...errors import OptionError
from ...options import check_fields, opt
from ...timing import sync

_KERNELS = ("auto", "compiled", "torch", "triton")  # the kernels of "anchor_attend" (attention.backends.dispatch)
_GUARDS = ("global", "causal")
_SELECT_DTYPES = ("float32", "bfloat16", "auto")
_LAYERS = "name model layers"  # why dense_layers / dense_heads do not apply to a one-layer benchmark

#: ``min_len="auto"``: the prompt length (tokens) from which the defaults' sparse prefill is faster than the fused dense
#: attention, by device type.  CPU: between the lengths where the defaults were measured not faster (SmolLM2-135M at
#: 8k) and faster (Qwen2.5-Coder-0.5B at 16k) than dense end to end (docs/benchmarks/anchor.md, "The defaults' break-even length");
#: a device type not listed is calibrated at first use by the patch (:func:`attnpatch.patchers.methods.anchor_attention.resolved`);
#: called directly, ``"auto"`` on such a device never runs sparse.
BREAK_EVEN: dict[str, int] = {"cpu": 12288}

#: ``min_len="auto-fast"``: the same for a speed setting (the ``fast`` preset's pooling and threshold, and the tuner's
#: candidates), which skips more keys for a cheaper selection and so pays from shorter prompts.  CPU: between the
#: lengths where the ``fast`` preset was measured slower and faster than dense end to end (docs/benchmarks/anchor.md, "The presets"; docs/methods.md, "anchor_attention presets").
FAST_BREAK_EVEN: dict[str, int] = {"cpu": 3072}

#: The words ``min_len`` takes besides a token count, each with its table of break-even lengths by device type.
BREAK_EVEN_BY_WORD: dict[str, dict[str, int]] = {"auto": BREAK_EVEN, "auto-fast": FAST_BREAK_EVEN}


@functools.lru_cache(maxsize=None)
def bfloat16_is_faster(device_type: str) -> bool:
    """Whether a bfloat16 matrix product (float32 accumulation) is faster than a float32 one on this
    machine's ``device_type`` (``"cpu"``, ``"cuda"``): measured once per process on a selection-sized
    product, ``[256, 64] x [64, 1024]``, best of 3 each.  CPUs without native bfloat16 dot products
    (no AVX512-BF16 / AMX: AVX2-only x86, for one) emulate it, tens of times slower than float32.
    ``select_dtype="auto"`` selects in bfloat16 only where this holds.
    """
    dev = torch.device(device_type)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(256, 64, generator=gen).to(dev)
    b = torch.randn(64, 1024, generator=gen).to(dev)

    def best(x: torch.Tensor, y: torch.Tensor) -> float:
        times = []
        for _ in range(4):
            sync(dev)
            t0 = time.perf_counter()
            torch.matmul(x, y)
            sync(dev)
            times.append(time.perf_counter() - t0)
        return min(times[1:])  # the first call pays one-off costs

    try:
        return best(a.bfloat16(), b.bfloat16()) < best(a, b)
    except RuntimeError:  # a device without bfloat16 products
        return False


@dataclass(frozen=True)
class AnchorConfig:
    """Options of AnchorAttention (all sizes in tokens).

    Attributes:
        theta: threshold on ``a_bar - q_bar.k_j*scale`` (in logit units, natural-log scale);
            ``inf`` keeps every causal key (exactly dense), ``-inf`` keeps only the initial
            block and the local window.
        block_size: number of queries per query block (the pooling unit of the paper).
        init_block: number of initial keys always kept (the attention-sink region).
        local_window: number of keys ending at each query block's last position that are
            always kept; must be ``>= block_size`` so the diagonal block is exact.
        min_len: prompts (query length) shorter than this run dense attention.
        pool_stride: queries per pool: the queries of a pool are averaged into ``q_bar``
            and their anchors into ``a_bar`` (the paper's mean pooling); a stripe is kept for
            the whole block when any of its pools keeps it.  ``None`` means ``block_size``
            (the paper: one pool per block); ``1`` means every query selects for itself (a
            max over the block's queries of ``s_ij - a_i``; costs a full ``Q K^T``).  Must
            divide ``block_size``.
        dense_last: the last ``dense_last`` queries of the prompt attend densely (the
            question at the end of a long-context prompt).
        dense_layers: layer indices that run dense attention.
        dense_heads: ``(layer, head)`` pairs (query-head index) that run dense attention.
        min_recall: recall guard (0 = off): a head whose kept keys carry less than this exact
            softmax mass on average over the queries of some probe blocks attends densely in this
            layer (``guard`` says which probes and for which queries).  The automatic form of
            ``dense_heads``: the retrieval heads that thresholding hurts are found by measurement.
        recall_probes: ``guard="global"`` only: query blocks the recall guard measures (cost: one
            exact ``Q K^T`` over that many blocks per layer).
        guard: scope of the recall guard's decision (no effect when ``min_recall=0``).
            ``"global"`` (the only guard before this option existed): one decision per (sequence,
            head) and call, from ``recall_probes`` evenly spaced blocks of sparse queries over the
            whole prompt (the last one holds the last sparse queries); a head judged low attends
            densely for every query, so any output may depend on any token of the prompt.
            ``"causal"`` (the default: no output depends on later tokens, at a probe cost of the
            same order): one decision per (sequence, head, query block): block ``j`` attends
            densely when the mean recall of the probe blocks at or before ``j`` is below
            ``min_recall``, each probe weighted by the blocks it stands for up to ``j`` (an
            estimate of the mean recall of the blocks so far).  The probe blocks are ``f - 1 + d``,
            ``d`` = 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (two per doubling), where ``f = max(0,
            (init_block + local_window - q_offset) // block_size)`` is the first block that does
            not keep every causal key; they are fixed by the options whatever the prompt's length,
            and every query of a probe block counts (``dense_last`` plays no part).  Cost per head:
            the exact logits of the probe blocks' queries against their causal keys, about
            ``3.4 * (last probe + 1) * block_size ** 2`` for the causal guard, about
            ``recall_probes / 2 * Lq * block_size`` for the global one.  Guarded blocks run the
            compiled kernel over every causal key where it runs, else fused dense attention.  See
            "Which outputs depend on which tokens" below.
        select_dtype: ``"float32"``, ``"bfloat16"`` or ``"auto"``: the precision of the pooled queries and
            keys in the stripe-scoring product (accumulated in float32).  ``"bfloat16"`` makes the selection
            faster on CPUs with native bfloat16 dot products (AVX512-BF16, AMX) and flips stripes only within
            rounding of the threshold (speed and flipped stripes measured: docs/benchmarks/anchor.md); on a CPU without
            them it is emulated and many times slower.  ``"auto"``: ``"bfloat16"`` where
            :func:`bfloat16_is_faster` measures it faster on the input's device type, else ``"float32"``.
            The anchors, the recall guard and the attention itself stay in the input precision.
        kernel: how the selection and the attention over kept stripes run.  ``"auto"``: on CUDA tensors
            (float32, float16, bfloat16) the Triton kernels where Triton is installed
            (:mod:`.triton_select`, :mod:`.triton_attend`: selection into a bitmask and attention over it on
            the device, the recall guard's probes and the statistics from the same bitmask); on the CPU the
            compiled CPU kernel (:mod:`attnpatch.attention.backends.cpu_kernel`, built on first use) for float32
            tensors without padding inside the keys when it can be built here, else PyTorch operations;
            ``"compiled"``: the compiled kernel, an error where it cannot run; ``"torch"``: PyTorch
            operations only; ``"triton"``: the Triton kernels, an error where they cannot run (CPU tensors
            only under the Triton interpreter, ``TRITON_INTERPRET=1``).  All give the same kept keys and the
            same result up to float rounding (a stripe at the threshold within rounding may flip; through a
            whole model with ``select_dtype="bfloat16"``, such a rounding difference in one layer can flip
            a stripe that sits at the threshold in a later one).

    Which outputs depend on which tokens.  Positions count from the call's first query (a
    padded sequence from its first real token, exactly as if it were alone); query ``i`` lies in
    query block ``i // block_size``, which ends before ``e(i) = (i // block_size + 1) *
    block_size`` (the prompt's last block may end sooner, at the prompt's end):

    * stripe selection (the paper's design): a block's stripes come from the pooled queries and
      anchors of all its queries and from the keys before ``e(i)`` (with ``pool_stride=1`` too: a
      stripe one query keeps is kept for the whole block), so query ``i``'s output depends on the
      tokens before ``e(i)``, the later queries of its own block included; it attends only keys
      at or before ``i``.
    * ``min_recall > 0, guard="global"``: the decision for a head changes the output of all its
      sparse queries, and the probes are spread over the whole prompt: any output may depend on
      any token (changing a token in the last block changes the outputs of the first blocks),
      and on the prompt's length (which blocks are probed).
    * ``min_recall > 0, guard="causal"``: block ``j``'s decision reads the probe blocks at or
      before ``j`` only: nothing at or after ``e(i)``.
    * ``dense_last``: the last ``dense_last`` queries of the call attend densely; which ones is
      set by the prompt's length: changing a later token's value changes nothing earlier, but
      appending tokens makes queries that were dense sparse.
    * ``min_len``: a call with fewer queries runs dense: appending tokens past ``min_len`` makes
      the blocks that do not keep every causal key sparse.
    * ``kernel``: the compiled kernel and the Triton kernels compute each query block on its own; the PyTorch path
      processes blocks in buckets sorted by kept count, so a later block can change an earlier
      block's float rounding (about 1e-7), never its kept keys.

    Hence two guarantees.  Causal: with ``guard="causal"`` or ``min_recall=0``, whatever the other
    options, changing tokens at positions ``>= e(i)`` of a prompt (its length kept) leaves query
    ``i``'s output unchanged (bit for bit with the compiled kernel, to float rounding on the
    PyTorch path); every layer of a model keeps this, so the logits at ``i`` depend on the tokens
    before ``e(i)`` only: fit for scoring a text in one pass (perplexity), where the logits at
    ``i`` still see the rest of ``i``'s block through the selection.  Prefix-consistent: with in
    addition ``dense_last=0`` and ``min_len`` at most the end of the first block that does not
    keep every causal key, ``block_size * (1 + (init_block + local_window) // block_size)``,
    query ``i`` gives the same output, to float rounding, in every prompt of at least ``e(i)``
    tokens that agrees on the tokens before ``e(i)``.  The defaults are causal but not
    prefix-consistent (``dense_last=256``, ``min_len="auto"``); ``guard="global"`` is neither.  A
    prompt continued on a cache (chunked prefill) is computed as its own call: blocks from its
    first query, ``dense_last`` and ``min_len`` on its own length, the causal guard's probes from
    its first block; it equals a one-pass prefill only for chunks that are multiples of
    ``block_size`` and at least ``min_len`` long, with ``min_recall=0`` and ``dense_last=0``.

    Defaults: ``theta=12, block_size=128, init_block=128, local_window=128`` as in the paper, plus
    three remedies for the paper setting's loss of multi-key retrieval: ``pool_stride=8`` (queries
    pooled 8 at a time instead of a whole block, since the queries of one block want different keys;
    a stripe is kept for the block when any pool keeps it), ``dense_last=256`` (the question at the
    end of the prompt attends densely) and the recall guard ``min_recall=0.9`` (the retrieval heads
    that thresholding hurts attend densely).  They were chosen by measurement on SmolLM2-135M-Instruct
    and Qwen2.5-Coder-0.5B-Instruct so that needle-in-a-haystack accuracy is not below dense; they buy
    accuracy with sparsity, so their sparse prefill pays only on long prompts: ``min_len="auto"`` runs
    prompts shorter than the device's break-even length (:data:`BREAK_EVEN`) through the model's own
    attention (record mode ``dense:short``, bit for bit the unpatched model).  The ``accurate`` preset is
    the accuracy-first setting before them (``pool_stride=2``, sparse from 512 tokens); ``fast`` skips more
    keys from the shorter break-even length of ``min_len="auto-fast"`` (:data:`FAST_BREAK_EVEN`).  The
    measurements (accuracy, sparsity and recall per setting, and the speed of the defaults and of
    settings chosen for speed) are in docs/methods.md and docs/benchmarks/anchor.md.
    """

    theta: float = field(default=12.0, metadata=opt(
        "float", "stripe threshold on anchor - score, in logits (inf = dense, -inf = initial block + window only)",
        rule="must be a real number (inf and -inf allowed)"))
    block_size: int = field(default=128, metadata=opt("int", "queries per query block (tokens)", low=1,
                                                      rule="must be an integer >= 1 (tokens)"))
    init_block: int = field(default=128, metadata=opt("int", "initial keys always kept (tokens)", low=1,
                                                      rule="must be an integer >= 1 (tokens)"))
    local_window: int = field(default=128, metadata=opt("int", "keys before each block's end always kept (tokens, >= block_size)",
                                                        low=1, rule="must be an integer >= 1 (tokens)"))
    min_len: int | str = field(default="auto", metadata=opt(
        "int_or_auto", "prompts shorter than this run dense (tokens; 'auto' = the device's measured break-even length "
        "of the defaults, where their sparse prefill starts to pay; 'auto-fast' = the same for the fast preset)",
        choices=tuple(BREAK_EVEN_BY_WORD), low=0, rule="must be 'auto', 'auto-fast' or an integer >= 0 (tokens)"))
    pool_stride: int | None = field(default=8, metadata=opt(
        "int", "queries averaged per pool for stripe selection (tokens; None = block_size as in the paper, 1 = per query; "
        "must divide block_size)", nullable=True, low=1, rule="must be None or an integer >= 1"))
    dense_last: int = field(default=256, metadata=opt("int", "the last n prompt queries attend densely (tokens)", low=0,
                                                      rule="must be an integer >= 0 (tokens)"))
    dense_layers: tuple[int, ...] = field(default=(), metadata=opt("int_list", "layer indices that run dense attention",
                                                                   model_scope=_LAYERS))
    dense_heads: tuple[tuple[int, int], ...] = field(default=(), metadata=opt(
        "pair_list", "(layer, head) pairs that run dense attention", model_scope=_LAYERS))
    min_recall: float = field(default=0.9, metadata=opt(
        "float", "recall guard: heads whose kept keys carry less exact softmax mass than this on the probe blocks attend "
        "densely (0 = off)", low=0.0, high=1.0, rule="must be a number in [0, 1] (0 = off)"))
    recall_probes: int = field(default=4, metadata=opt("int", "query blocks the recall guard measures per layer (guard='global')",
                                                       low=1, rule="must be an integer >= 1 (query blocks)"))
    guard: str = field(default="causal", metadata=opt(
        "str", "recall guard scope, 'causal' or 'global': causal = dense/sparse per query block from probe blocks at or "
        "before it (no output depends on later tokens); global = once per head from probes over the whole prompt",
        choices=_GUARDS))
    select_dtype: str = field(default="float32", metadata=opt(
        "str", "precision of the stripe-scoring product (bfloat16: faster selection on CPUs with native bfloat16, "
        "emulated and slow elsewhere; auto: bfloat16 where measured faster than float32 on this machine)",
        choices=_SELECT_DTYPES))
    kernel: str = field(default="auto", metadata=opt(
        "str", "selection and attention over kept stripes: auto = Triton kernels on CUDA, the compiled CPU kernel for "
        "float32 where it builds, else PyTorch operations; triton = the Triton kernels (CUDA, or the CPU under "
        "TRITON_INTERPRET=1)", choices=_KERNELS))

    def __post_init__(self) -> None:
        check_fields(self)  # each field's type and range, as declared above
        if self.local_window < self.block_size:
            raise OptionError(
                f"local_window={self.local_window} < block_size={self.block_size}: the local window must "
                "cover the query block's own (diagonal) keys"
            )
        if self.pool_stride is not None and self.block_size % self.pool_stride:
            raise OptionError(f"pool_stride={self.pool_stride} does not divide block_size={self.block_size}")

    def min_len_on(self, device: torch.device | str) -> int:
        """``min_len`` in tokens on ``device`` (``"auto"`` resolved through :data:`BREAK_EVEN`, ``"auto-fast"`` through
        :data:`FAST_BREAK_EVEN`; ``sys.maxsize`` where the device type has no break-even: every prompt dense)."""
        if isinstance(self.min_len, int):
            return self.min_len
        return BREAK_EVEN_BY_WORD[self.min_len].get(torch.device(device).type, sys.maxsize)

    def select_dtype_on(self, device: torch.device | str) -> str:
        """``select_dtype`` on ``device``: ``"auto"`` resolved by :func:`bfloat16_is_faster`."""
        if self.select_dtype != "auto":
            return self.select_dtype
        return "bfloat16" if bfloat16_is_faster(torch.device(device).type) else "float32"

    @property
    def stride(self) -> int:
        """Queries per pool (``block_size`` when ``pool_stride`` is ``None``)."""
        return self.pool_stride or self.block_size


@dataclass
class AnchorStats:
    """Per-call statistics of one attention layer.

    Attributes:
        causal_pairs: ``[batch, heads]`` number of causal (query, key) pairs among valid tokens.
        kept_pairs: ``[batch, heads]`` how many of those pairs were computed.
        kept_columns: ``[batch, heads, n_blocks]`` kept key columns (stripes) per query block.
        recall: ``[batch, heads]`` mean over valid queries of the exact softmax mass carried by
            the kept keys (1.0 = nothing lost), or ``None`` when not requested.
    """

    causal_pairs: torch.Tensor
    kept_pairs: torch.Tensor
    kept_columns: torch.Tensor | None = None
    recall: torch.Tensor | None = None

    @property
    def sparsity(self) -> torch.Tensor:
        """``[batch, heads]`` skipped fraction of causal query-key pairs."""
        return 1.0 - self.kept_pairs / self.causal_pairs.clamp(min=1)
