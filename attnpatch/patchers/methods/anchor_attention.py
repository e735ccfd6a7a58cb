"""``anchor_attention``: AnchorAttention sparse prefill for causal LMs (the math: :mod:`attnpatch.attention.anchor`).

What each option does is declared once, on the fields of
:class:`~attnpatch.attention.anchor.AnchorConfig` (kind, default, help, range); how the defaults were chosen and what they
cost and keep is measured in docs/benchmarks/anchor.md and docs/methods.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any

import torch

from ...attention.anchor import AnchorConfig, anchor_attention, select_stripes
from ...attention.anchor.config import BREAK_EVEN_BY_WORD
from ...attention.backends.dispatch import Call, needs_warm_up, refusal
from ...errors import OptionError
from ..bench_hook import BenchCase, BenchInputs
from ...options import options_of
from ..contract import ExactLimit, Knob, Method, ModelGeometry, Preset
from ..break_even import probe_inputs, resolve_break_even
from ..registry import register_method
from ..state import LayerContext, LayerRecord

__all__ = ["ANCHOR", "anchor_forward", "anchor_bench", "synthetic_prefill", "SYNTHETIC_PREFILL", "calibration_case", "resolved"]


#: Prompt lengths (tokens) the calibration of ``min_len="auto"`` / ``"auto-fast"`` tries on a device type without a table.
CALIBRATION_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_NOT_SPEED = ("min_len", "dense_layers", "dense_heads")  # options a one-layer calibration does not depend on


#: The parameters of :func:`synthetic_prefill`, in logit units (natural-log scale, after ``D ** -0.5``) and tokens:
#: fitted by ``benchmarks/fit_synthetic_prefill.py`` so that the sparsity and mean recall of the defaults, ``fast`` and
#: ``paper`` settings on the generator at 8k match their means on SmolLM2-135M prefill layers captured on natural prose
#: (the fit and the match: docs/benchmarks/gpu.md, "AnchorAttention's synthetic prefill, fitted to SmolLM2 captures").
SYNTHETIC_PREFILL = dict(sink=6.0, stripe=8.0, stripe_every=256, column=2.5, local=10.0, local_span=1024, noise=2.5)


def synthetic_prefill(n: int, heads: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device, seed: int = 0,
                      sink: float | None = None, stripe: float | None = None, stripe_every: int | None = None,
                      column: float | None = None, local: float | None = None, local_span: int | None = None,
                      noise: float | None = None):
    """The documented synthetic prefill input of the break-even calibration and the GPU check: ``q`` ``[1, heads, n, D]``,
    ``k, v`` ``[1, kv_heads, n, D]``, whose causal attention has the structure AnchorAttention exploits (arXiv
    2505.23520, Sec. 3: an attention sink, a local window, vertical stripes).  The logit of query ``i`` on key ``j``
    (``q_i . k_j * D ** -0.5``, natural-log units) is

        ``bias_j + local * mean_f cos(w_f * (i - j)) + noise * z_ij``

    * ``bias_0 = sink`` (the attention sink, key 0); ``bias_j = stripe + column * c_j`` for ``j`` a positive multiple
      of ``stripe_every`` (vertical stripes, one key in ``stripe_every``); ``bias_j = column * c_j`` otherwise, ``c_j``
      standard normal: a per-key bias shared by every query (weaker stripes of every strength);
    * the local term: ``F = max(1, D // 8)`` frequencies ``w_f`` log-spaced from 1 down to ``1 / local_span`` radians
      per token (as rotary position embeddings make them), so the boost is ``local`` on the diagonal, falls about
      linearly in ``log(i - j)`` and is near 0 (a fluctuation of about ``local / sqrt(2 F)``) beyond ``local_span``
      tokens;
    * ``z_ij`` standard normal scores, independent across queries (``q``'s remaining ``D - 1 - 2F`` coordinates
      against ``k``'s).

    Values standard normal.  Every parameter left ``None`` takes its value in :data:`SYNTHETIC_PREFILL` (fitted to
    captured layers; the fit and how closely the generator's sparsity and recall match: docs/benchmarks/gpu.md).  Deterministic
    in ``seed`` (built on the CPU in float32, then moved to ``device`` and cast to ``dtype``).  ``D >= 4``.
    """
    p = {**SYNTHETIC_PREFILL, **{name: value for name, value in dict(
        sink=sink, stripe=stripe, stripe_every=stripe_every, column=column, local=local, local_span=local_span,
        noise=noise).items() if value is not None}}
    d = head_dim
    f = max(1, min(d // 8, (d - 2) // 2))  # local-term frequencies: 2f coordinates, at least one left for the noise
    r = d - 1 - 2 * f
    g = torch.Generator(device="cpu").manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=g))  # column 0: the bias direction; 1..2f: local; rest: noise
    pos = torch.arange(n, dtype=torch.float64)
    w = float(p["local_span"]) ** -(torch.arange(f, dtype=torch.float64) / max(f - 1, 1))
    phase = pos[:, None] * w[None, :]
    rot = torch.cat([phase.cos(), phase.sin()], -1).float() * (float(p["local"]) * d ** 0.5 / f) ** 0.5  # [n, 2f]
    bias = float(p["column"]) * torch.randn(n, generator=g)
    every = int(p["stripe_every"])
    bias[every::every] += float(p["stripe"])
    bias[0] = float(p["sink"])
    qc = torch.cat([torch.full((1, heads, n, 1), d ** 0.5), rot.expand(1, heads, n, 2 * f),
                    float(p["noise"]) * (d / r) ** 0.5 * torch.randn(1, heads, n, r, generator=g)], -1)
    kc = torch.cat([bias.expand(1, kv_heads, n)[..., None], rot.expand(1, kv_heads, n, 2 * f),
                    torch.randn(1, kv_heads, n, r, generator=g)], -1)
    v = torch.randn(1, kv_heads, n, d, generator=g)
    q, k = qc @ basis.T, kc @ basis.T  # q_i . k_j = qc_i . kc_j: the logit above times sqrt(D)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def calibration_case(cfg: AnchorConfig, q: torch.Tensor, k: torch.Tensor):
    """``n -> (anchor_call, sdpa_call)`` on :func:`synthetic_prefill` of ``q`` / ``k``'s geometry, dtype and device:
    the method's layer (sparse at every length) and the model's own causal attention (SDPA, grouped-query keys as they are)."""
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[-1]

    def case(n: int):
        sparse = _with_min_len(cfg, 0)
        qq, kk, vv = synthetic_prefill(n, heads, kv_heads, d, dtype=q.dtype, device=q.device)

        def anchor_call():
            return anchor_attention(qq, kk, vv, sparse, scale=d ** -0.5)[0]

        def sdpa_call():
            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=d ** -0.5,
                                                                    enable_gqa=heads != kv_heads)

        return anchor_call, sdpa_call

    return case


def resolved(cfg: AnchorConfig, q: torch.Tensor, k: torch.Tensor) -> AnchorConfig:
    """``cfg`` with ``min_len`` a token count for a call on ``q`` / ``k``: a word (``"auto"``, ``"auto-fast"``)
    resolves through :func:`~attnpatch.patchers.break_even.resolve_break_even` (``ATTNPATCH_ANCHOR_BREAK_EVEN``, else
    the word's table for the device type, else calibrated on this device once; a length that never pays: every
    prompt dense)."""
    if isinstance(cfg.min_len, int):
        return cfg
    found = resolve_break_even(
        "anchor_attention", {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _NOT_SPEED}, q, k,
        table=BREAK_EVEN_BY_WORD[cfg.min_len], env="ATTNPATCH_ANCHOR_BREAK_EVEN", lengths=CALIBRATION_LENGTHS,
        case=calibration_case(cfg, q, k),
    )
    return _with_min_len(cfg, sys.maxsize if found.tokens is None else found.tokens)


@functools.lru_cache(maxsize=64)
def _with_min_len(cfg: AnchorConfig, tokens: int) -> AnchorConfig:
    """``cfg`` with ``min_len=tokens``, built (and validated) once per config and value: a layer asks on every call."""
    return dataclasses.replace(cfg, min_len=tokens)


def kernel_refusal(cfg: AnchorConfig, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why ``cfg.kernel`` cannot run a model whose weights are ``dtype`` on ``device`` with heads of ``head_dim``
    (one line, naming the kernels that can), or ``None``: :func:`attnpatch.attention.backends.dispatch.refusal` for the
    attention over kept stripes (``"triton"`` needs a CUDA device and head dims up to 128, ``"compiled"`` float32 on the
    CPU)."""
    return refusal("anchor_attend", cfg.kernel, Call(torch.device(device), dtype, head_dim=head_dim))


def prepare_anchor(cfg: AnchorConfig, geo: ModelGeometry, device: torch.device, dtype: torch.dtype) -> None:
    """At patch time: refuse a ``kernel`` that cannot run on the model's device and dtype (:func:`kernel_refusal`);
    resolve a ``min_len`` word for the model's heads, device and dtype (a calibration then runs here, not inside the
    first, timed, prefill).

    Raises:
        OptionError: ``kernel="triton"`` where Triton cannot run (a CPU model outside the Triton interpreter, no
            Triton, float64, heads wider than 128), ``kernel="compiled"`` for a model that is not float32 on the CPU.
    """
    reason = kernel_refusal(cfg, device, dtype, geo.head_dim)
    if reason is not None:
        raise OptionError(reason)
    probe = None if isinstance(cfg.min_len, int) else probe_inputs(geo, device, dtype)
    if probe is not None:
        resolved(cfg, *probe)
    warm_up(cfg, geo, torch.device(device), dtype)


def warm_up(cfg: AnchorConfig, geo: ModelGeometry, device: torch.device, dtype: torch.dtype) -> None:
    """At patch time, the one-time work of the kernels the patched prefill will run, so that no timed call pays it:
    where the kernels :func:`attnpatch.attention.backends.dispatch.choose` picks for the model's device and dtype need
    a build or a JIT compile (:func:`~attnpatch.attention.backends.dispatch.needs_warm_up`: the compiled CPU kernel,
    a C++ build the first time on a machine, then a load; the Triton kernels), one call of the method on a small
    :func:`synthetic_prefill` of the model's head geometry (``3 * block_size + min(dense_last, block_size)`` tokens:
    a sparse block, the guard's probes, a dense tail).  Raises nothing of its own: a failed C++ build warns once and leaves the
    PyTorch path (:func:`~attnpatch.attention.backends.cpu_kernel.stripe_kernel`)."""
    if cfg.theta == math.inf or not (geo.heads and geo.head_dim):
        return  # every layer hands back to the model's own attention, or nothing to build the input from
    call = Call(device, dtype, head_dim=geo.head_dim, select_dtype=cfg.select_dtype_on(device))
    if not (needs_warm_up("anchor_attend", cfg.kernel, call) or needs_warm_up("anchor_select", cfg.kernel, call)):
        return
    # the kernels' variants depend on the block size and on whether there are dense rows, not on how many
    small = dataclasses.replace(cfg, min_len=0, dense_last=min(cfg.dense_last, cfg.block_size))
    n = 3 * small.block_size + small.dense_last
    q, k, v = synthetic_prefill(n, geo.heads, geo.kv_heads or geo.heads, geo.head_dim, dtype=dtype, device=device)
    with torch.no_grad():
        anchor_attention(q, k, v, small, scale=geo.head_dim ** -0.5, return_stats=True, compute_recall=True)


def anchor_forward(
    cfg: AnchorConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext
) -> tuple[torch.Tensor | None, LayerRecord]:
    """AnchorAttention on prefill; exact attention for decoding steps, short prompts and ``dense_layers``."""
    layer, state = ctx.layer, ctx.state
    lq, lk = q.shape[2], k.shape[2]
    if lq == 1:
        return None, LayerRecord(layer, "dense:decode", lq, lk)
    cfg = resolved(cfg, q, k)
    if lq < cfg.min_len:
        return None, LayerRecord(layer, "dense:short", lq, lk)
    if layer in cfg.dense_layers:
        return None, LayerRecord(layer, "dense:layer", lq, lk)
    if cfg.theta == math.inf:  # every causal key kept: the model's own attention, at no extra cost
        return None, LayerRecord(layer, "dense:theta=inf", lq, lk)
    heads = [hd for (li, hd) in cfg.dense_heads if li == layer]
    recall = bool(state is not None and state.recall)
    out, st = anchor_attention(
        q, k, v, cfg, scale=ctx.scale, q_offset=ctx.q_offset, key_valid=ctx.key_valid, dense_heads=heads,
        return_stats=ctx.record, compute_recall=recall,
    )
    rec = LayerRecord(layer, "sparse", lq, lk)
    if st is not None:
        rec.causal_pairs = st.causal_pairs.cpu()
        rec.kept_pairs = st.kept_pairs.cpu()
        rec.kept_columns = None if st.kept_columns is None else st.kept_columns.cpu()
        rec.recall = None if st.recall is None else st.recall.cpu()
    return out, rec


def _check(cfg: AnchorConfig, geo: ModelGeometry) -> None:
    """``dense_layers`` and ``dense_heads`` must name layers and heads the model has.

    Raises:
        OptionError: a layer or head index out of range.
    """
    n_layers, n_heads = geo.num_layers, geo.heads
    for li in cfg.dense_layers:
        if not 0 <= li < n_layers:
            raise OptionError(f"dense_layers contains {li}: layer indices must be in 0..{n_layers - 1}")
    for li, hi in cfg.dense_heads:
        if not 0 <= li < n_layers or (n_heads is not None and not 0 <= hi < n_heads):
            raise OptionError(
                f"dense_heads contains ({li}, {hi}): layers must be in 0..{n_layers - 1}, heads in 0..{(n_heads or 1) - 1}"
            )


def anchor_bench(cfg: AnchorConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: BenchInputs) -> BenchCase:
    """One causal layer: the whole call timed; the stripe selection alone as ``select_seconds`` (``None`` where the
    layer runs dense: ``N < min_len`` or ``theta = inf``); sparsity and recall (exact softmax mass on the kept keys)
    measured outside the timed calls."""
    n, scale = q.shape[2], inputs.scale
    cfg = resolved(cfg, q, k)

    def call():
        return anchor_attention(q, k, v, cfg, scale=scale)[0]

    def select():
        return select_stripes(q, k, cfg, scale=scale)

    def stats() -> dict[str, Any]:
        _, st = anchor_attention(q, k, v, cfg, scale=scale, return_stats=True, compute_recall=True)
        return {
            "sparsity": float(1.0 - st.kept_pairs.sum() / st.causal_pairs.sum().clamp(min=1)),
            "recall": float(st.recall.mean()),
            "recall_min_head": float(st.recall.min()),
        }

    short = n < cfg.min_len
    if short or cfg.theta == math.inf:
        note = "ran dense: N < min_len" if short else "ran dense: theta = inf"
        return BenchCase(call=call, extra=lambda t, ref: {"select_seconds": None}, stats=stats, note=note)
    return BenchCase(call=call, parts={"select": select}, stats=stats)


def _config(options: dict[str, Any]) -> AnchorConfig:
    return AnchorConfig(**options)


def _every_key(tokens: int) -> dict[str, Any]:
    # theta = inf keeps every causal key: every layer hands back to the model's own attention
    return {"theta": math.inf}


def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"theta": 30.0 * t}


#: Named option sets (``patch(model, "anchor_attention", preset=...)``); what each is for: docs/methods.md; measured
#: speed and accuracy of each: docs/benchmarks/anchor.md ("The presets").
PRESETS = {
    "accurate": Preset(
        dict(theta=12.0, pool_stride=2, dense_last=256, min_recall=0.9, min_len=512, select_dtype="float32"),
        "accuracy first: finer pooling than the defaults and sparse from 512 tokens; trades speed for NIAH accuracy "
        "(measured: BENCHMARKS.md)",
    ),
    "fast": Preset(
        dict(theta=8.0, pool_stride=8, dense_last=64, min_recall=0.75, min_len="auto-fast", select_dtype="auto"),
        "speed first: sparse from the device's break-even length of this setting (dense below it), a lower threshold, "
        "bfloat16 selection where this machine has it (measured), a looser recall guard; loses multi-value and "
        "multi-query NIAH answers",
    ),
    "paper": Preset(
        dict(theta=12.0, pool_stride=None, dense_last=0, min_recall=0.0, min_len=512, select_dtype="float32"),
        "the paper's setting: one pool per 128-query block, no dense tail, no recall guard",
    ),
}

#: ``attnpatch tune``'s thresholds and pooling strides (``None``: one pool per block, as in the paper), each with the
#: ``fast`` preset's other options and the online recall guard off: the tuner's measured per-head decisions
#: (``dense_heads``) take its place.
TUNE_THETAS = (4.0, 8.0, 12.0)
TUNE_POOL_STRIDES = (None, 8)


def _tune_space(geometry) -> list[dict[str, Any]]:
    base = dict(PRESETS["fast"].options, min_recall=0.0)
    return [dict(base, theta=t, pool_stride=p) for p in TUNE_POOL_STRIDES for t in TUNE_THETAS]


ANCHOR = register_method(
    Method(
        name="anchor_attention",
        summary="AnchorAttention sparse prefill: anchor-relative stripe selection, exact attention on kept keys; decoding dense",
        source="AnchorAttention, arXiv 2505.23520, Sec. 3 (Eq. 2-4)",
        options=options_of(AnchorConfig),
        model_kinds=frozenset({"causal_lm"}),
        make_config=_config,
        forward=anchor_forward,
        check=_check,
        prepare=prepare_anchor,
        causal_calls=True,
        noncausal_calls=False,
        key_padding=True,
        exact_limit_decl=ExactLimit(_every_key, at_least=("theta",), text="theta = inf"),
        bench_hook=anchor_bench,
        knob=Knob("theta, 0 to 30 logits", _knob),
        presets=PRESETS,
        tune_space=_tune_space,
        small_settings={"causal_lm": dict(theta=1.0, block_size=16, init_block=16, local_window=16, min_len=32,
                                          dense_last=16, min_recall=0.0)},
        details=(
            "AnchorAttention: per-query anchor = max logit over the initial block and local window; pooled queries scored against all "
            "causal keys; key stripes within `theta` of the pooled anchor kept for the whole query block; exact softmax "
            "over kept keys. Decoding steps run dense."
        ),
    )
)
