"""``fna``'s hooks outside the forward: the break-even calibration of ``min_tokens="auto"`` (:func:`min_tokens_for`),
the patch-time preparation (:func:`prepare_fna`), the one-layer bench (:func:`fna_bench`) and ``attnpatch tune``'s
search space (:func:`tune_space`) and knob.

Source: FNA, arXiv 2507.16018.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from ....attention.backends.dispatch import Call, needs_warm_up
from ....attention.exact import exact_attention, repeat_kv
from ....attention.landmarks import farthest_point_sampling, select_landmarks
from ....attention.nystrom import landmark_pinv
from ....errors import OptionError
from ...bench_hook import BenchCase, BenchInputs
from ...break_even import probe_inputs, resolve_break_even
from ...contract import ModelGeometry
from . import config
from .config import FNAConfig, approximate

__all__ = ["CALIBRATION_LENGTHS", "calibration_case", "min_tokens_for", "prepare_fna", "fna_bench", "TUNE_S",
           "tune_space", "knob", "every_token"]

#: Lengths (tokens: square patch grids plus the class token) the calibration of ``min_tokens="auto"`` tries.
CALIBRATION_LENGTHS = (257, 577, 1025, 2305, 4097, 9217, 16385, 36865, 65537)
_SPEED_OPTIONS = ("s", "strategy", "features", "pinv", "rtol", "newton_iters", "local_window", "window_tile")


def calibration_case(cfg: FNAConfig, q: torch.Tensor, k: torch.Tensor):
    """``n -> (fna_call, sdpa_call)`` for the break-even calibration on standard normal ``q, k, v`` ``[1, H, n, D]``
    (seed 0; ``q``'s heads, head size, dtype, device): one whole layer, landmark sampling included (an upper bound:
    a model samples once per forward), against the model's own bidirectional attention (SDPA)."""
    heads, d = q.shape[1], q.shape[-1]
    scale = d ** -0.5

    def case(n: int):
        g = torch.Generator(device="cpu").manual_seed(0)
        qq, kk, vv = (torch.randn(1, heads, n, d, generator=g).to(q.device, q.dtype) for _ in range(3))
        feats = kk.transpose(1, 2).reshape(1, n, heads * d)
        cfg0 = dataclasses.replace(cfg, min_tokens=0)

        def fna_call():
            lm = select_landmarks(feats, cfg0.s_max, prefix=1, strategy=cfg0.strategy, seed=cfg0.seed)
            return approximate(cfg0, qq, kk, vv, lm, scale=scale, prefix=1, window=cfg0.local_window > 0)

        def sdpa_call():
            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, scale=scale)

        return fna_call, sdpa_call

    return case


def min_tokens_for(cfg: FNAConfig, q: torch.Tensor, k: torch.Tensor) -> int:
    """``min_tokens`` for a call on ``q`` / ``k``; ``"auto"``: :func:`~attnpatch.patchers.break_even.resolve_break_even`
    (``ATTNPATCH_FNA_BREAK_EVEN``, :data:`~.config.BREAK_EVEN`, or calibrated once; never faster: every image exact)."""
    if cfg.min_tokens != "auto":
        return int(cfg.min_tokens)
    found = resolve_break_even(
        "fna", {n: cfg.s_max if n == "s" else getattr(cfg, n) for n in _SPEED_OPTIONS}, q, k, table=config.BREAK_EVEN,
        env="ATTNPATCH_FNA_BREAK_EVEN",
        lengths=[n for n in CALIBRATION_LENGTHS if n > cfg.s_max], case=calibration_case(cfg, q, k),
    )
    return sys.maxsize if found.tokens is None else found.tokens


#: Landmarks of :func:`prepare_fna`'s warm-up calls, at most (the largest side the pseudo-inverse's Triton kernel takes).
WARM_UP_LANDMARKS = 64


def prepare_fna(cfg: FNAConfig, geo: ModelGeometry, device: torch.device, dtype: torch.dtype) -> None:
    """At patch time: resolve ``min_tokens="auto"`` for the model's heads, device and dtype (a calibration then runs
    here, not inside the first, timed, forward); where the kernels
    :func:`~attnpatch.attention.backends.dispatch.choose` picks for farthest-point sampling or the pseudo-inverse need
    a build or a JIT compile (:func:`~attnpatch.attention.backends.dispatch.needs_warm_up`: the compiled CPU kernel,
    a C++ build the first time on a machine, then a load; the Triton kernels), one call of each on inputs of the
    model's width and ``min(s, WARM_UP_LANDMARKS)`` landmarks, so that no timed forward pays it."""
    if cfg.s_max == 0:  # a schedule that leaves every layer exact
        return
    probe = probe_inputs(geo, device, dtype) if cfg.min_tokens == "auto" else None
    if probe is not None:
        min_tokens_for(cfg, *probe)
    if cfg.strategy != "fps" or not (geo.heads and geo.head_dim):
        return
    device = torch.device(device)
    if not (needs_warm_up("fps", "auto", Call(device, dtype)) or needs_warm_up("pinv", "auto", Call(device, dtype))):
        return
    g = torch.Generator().manual_seed(0)
    s = min(cfg.s_max, WARM_UP_LANDMARKS)  # the kernels' one-time cost, not the work of an s >= N setting
    feats = torch.randn(1, 2 * s + 1, geo.heads * geo.head_dim, generator=g).to(device, dtype)
    farthest_point_sampling(feats, s, 1)
    landmark_pinv(torch.softmax(torch.randn(1, geo.heads, s, s, generator=g), -1).to(device, dtype),
                  cfg.pinv, rtol=cfg.rtol, iters=cfg.newton_iters)


def fna_bench(cfg: FNAConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: BenchInputs) -> BenchCase:
    """One non-causal layer, three ways: ``fps`` (landmark selection on the keys, heads concatenated, alone),
    ``nystrom`` (landmarks given), and the layer's time = Nyström + the FPS amortised over the
    ``inputs.reuse_layers`` layers that reuse one sampling (FNA samples once per forward); besides
    ``fna_incl_seconds`` = Nyström + one whole FPS.  Peak memory: FPS + Nyström in one call.

    Raises:
        OptionError: ``N <= s`` (nothing to approximate).
    """
    b, heads, n, d = q.shape
    kr, vr = repeat_kv(k, heads), repeat_kv(v, heads)
    prefix, scale, reuse = inputs.prefix_tokens, inputs.scale, inputs.reuse_layers
    floor = min_tokens_for(cfg, q, k)
    if n < floor:
        def exact():
            return exact_attention(q, kr, vr, scale=scale)
        return BenchCase(call=exact, note=f"ran exact: N < min_tokens={floor if floor < sys.maxsize else 'never (slower at every calibrated length)'}")
    if n <= cfg.s_max:
        raise OptionError(f"fna s={cfg.s_max}: every length must exceed s (got N={n})")
    feats = kr.transpose(1, 2).reshape(b, n, heads * d)
    lm = select_landmarks(feats, cfg.s_max, prefix=prefix, strategy=cfg.strategy, seed=cfg.seed)

    def fps():
        return select_landmarks(feats, cfg.s_max, prefix=prefix, strategy=cfg.strategy, seed=cfg.seed)

    def nys():
        return approximate(cfg, q, kr, vr, lm, scale=scale, prefix=prefix, window=cfg.local_window > 0)

    def whole():
        return approximate(cfg, q, kr, vr, fps(), scale=scale, prefix=prefix, window=cfg.local_window > 0)

    def extra(t: dict[str, float], ref: float) -> dict[str, Any]:
        incl = t["nystrom"] + t["fps"]
        return {"fna_incl_seconds": incl, "speedup_incl": ref / incl, "speedup_nystrom": ref / t["nystrom"],
                "reuse_layers": reuse, "s": cfg.s_max}

    return BenchCase(
        call=whole, parts={"fps": fps, "nystrom": nys}, seconds=lambda t: t["nystrom"] + t["fps"] / reuse, extra=extra,
        exponents=("fps", "nystrom"), plot={"fps": "FPS alone"},
    )


def every_token(tokens: int) -> dict[str, Any]:
    # every token a landmark: Nyström attention is exact attention, and the layer runs the model's own
    return {"s": max(1, int(tokens))}


def knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"s": max(1, round(n ** t))}


#: ``attnpatch tune``'s landmark counts.
TUNE_S = (32, 64, 128)


def tune_space(geometry) -> list[dict[str, Any]]:
    """Per landmark count: sampling at 0, 1/4, 1/2 and 3/4 depth (plain FNA from there, the layers before it
    exact), and sampling at layer 0 with the exact local window on the first half or on every layer; always
    approximate (``min_tokens=0``: the tuner measures the exact model beside them)."""
    n = geometry.num_layers
    depths = sorted({0, n // 4, n // 2, (3 * n) // 4})
    out: list[dict[str, Any]] = []
    for s in TUNE_S:
        out += [dict(s=s, sample_layer=d, local_window=0, min_tokens=0) for d in depths]
        out += [dict(s=s, sample_layer=0, local_window=1, window_tile=4, window_until=u, min_tokens=0) for u in ("auto", None)]
    return out


