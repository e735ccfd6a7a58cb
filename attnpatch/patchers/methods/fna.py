"""``fna``: Fast Nyström Attention for ViTs (the math: :mod:`attnpatch.attention.nystrom`).

Landmark indices are sampled once per forward call (at ``sample_layer``) and kept in the
per-forward :class:`~attnpatch.patchers.state.ForwardState`, so later layers reuse them.  What
each option does is declared once on :class:`FNAConfig`; how the defaults were chosen, and the
accuracy and speed they give, is measured in docs/benchmarks/vision.md and docs/methods.md.

Kept whole: the config, forward, bench hook and break-even resolution of one method, each short, read together.
"""

from __future__ import annotations

import os
import sys
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ...attention.exact import exact_attention
from ...attention.landmarks import STRATEGIES, select_landmarks
from ...attention.nystrom import PINV_MODES, nystrom_attention
from ...attention.nystrom_local import nystrom_local_attention, window_keys
from ...attention.sinks import massive_tokens
from ...errors import OptionError
from ..bench_hook import BenchCase, BenchInputs
from ...options import check_fields, opt, options_of
from ..contract import ExactLimit, Knob, Method, ModelGeometry, Preset
from ..break_even import parse_env, probe_inputs, resolve_break_even
from ..registry import register_method
from ..state import LayerContext, LayerRecord
from ._shared import repeat_kv, say

__all__ = ["FNA", "FNAConfig", "FEATURES", "fna_forward", "fna_core", "fna_bench", "check_fna", "exact_reason", "min_tokens_for", "calibration_case",
           "prepare_fna"]

FEATURES = ("keys", "hidden")

#: ``min_tokens="auto"``: the token count (CLS and registers included) from which FNA's defaults are faster than the
#: model's exact attention end to end, by device type (CPU: measured on dinov2-small, docs/benchmarks/vision.md); other device
#: types are calibrated at first use (:func:`min_tokens_for`).  ``ATTNPATCH_FNA_BREAK_EVEN`` (tokens) overrides it on
#: every device (the test suite sets 0 so that tiny models are approximated).
BREAK_EVEN: dict[str, int] = {"cpu": 600}
_ACROSS = "act across layers"
_LAYER_RULE = "must be 'auto' or a layer index >= 0"


@dataclass(frozen=True)
class FNAConfig:
    """Options of Fast Nyström Attention (arXiv 2507.16018).

    Attributes:
        s: landmarks per image (tokens), CLS and register tokens included.  When ``s >= N``
            the layer runs exact attention (Nyström with every token a landmark is exact) and
            the patch says so once.
        sample_layer: layer where landmarks are sampled (an int, 0-based) or ``"auto"``: the
            first layer whose input has a massive token (L2 norm above ``massive_ratio x`` the
            median token norm, per image), and at the latest the layer ``auto_fallback`` when
            no massive token appears.  Layers before it run exact attention; the same indices
            are reused in every later layer.  Early layers attend sharply and locally, which a
            few landmarks represent poorly, so later sampling layers approximate better and
            approximate fewer layers.
        resample: run landmark selection again at every patched layer.
        strategy: ``"fps"`` (farthest-point sampling), ``"random"``, ``"strided"``, ``"kmeans"``.
        features: what landmark selection runs on: ``"keys"`` (the layer's keys, heads
            concatenated; every adapter has them) or ``"hidden"`` (the attention layer's input
            hidden states).
        pinv: pseudo-inverse of the landmark kernel: ``"rtol"`` (regularised: singular values
            below ``rtol`` x the largest dropped; on CUDA a smooth cut-off at ``rtol`` from batched products,
            :func:`~attnpatch.attention.pinv_matmul.landmark_pinv_matmul`), ``"newton"`` (Newton-Schulz), ``"exact"``
            (unregularised; amplifies the Nyström error).
        rtol: relative singular-value cut-off of ``pinv="rtol"``.
        newton_iters: iterations of ``pinv="newton"``.
        massive_ratio: norm ratio defining a massive token for ``sample_layer="auto"``.
        auto_fallback: ``sample_layer="auto"`` samples at this layer at the latest (an int, or
            ``"auto"`` = half the depth, ``num_layers // 2``: a model without massive tokens
            then has half its layers approximated).
        seed: seed of the ``random`` and ``kmeans`` strategies.
        local_window: radius in patches of each query's exact window (:mod:`attnpatch.attention.nystrom_local`):
            the queries of a ``window_tile x window_tile`` tile attend exactly to the tile grown by ``local_window``
            patches on each side and to the CLS/register tokens; the Nyström estimate of the unnormalised kernel
            covers the other keys, and one softmax normalises the union (Scatterbrain's sparse + low-rank, arXiv
            2110.15343).  ``0``: plain FNA.  The patch grid is taken as square (``N - prefix`` a perfect square),
            else as one row (the window then runs along the token order).
        window_tile: query tile side in patches (``local_window > 0``).
        window_until: layers from this index on run plain FNA (``None``: every approximated layer keeps the window;
            ``"auto"``: half the depth, ``num_layers // 2``).
        min_tokens: images with fewer tokens (CLS and registers included) run exact attention, recorded as
            ``dense:short``; ``"auto"`` = :data:`BREAK_EVEN` of the device type (or ``ATTNPATCH_FNA_BREAK_EVEN``).

    The defaults were chosen by measurement on the offline ``dinov2-small``; the sweeps (sample
    layer, pseudo-inverse, landmark features and strategy; final-CLS cosine to dense and
    teacher-forced layer error) are in docs/benchmarks/vision.md and docs/methods.md.
    """

    s: int = field(default=64, metadata=opt(
        "int", "landmarks per image (tokens, CLS and registers included; s >= N runs exact attention)", low=1,
        rule="the number of landmarks must be an integer >= 1 (tokens)"))
    sample_layer: int | str = field(default="auto", metadata=opt(
        "int_or_auto", "layer where landmarks are sampled once and reused later ('auto' = first layer with a massive "
        "token, else auto_fallback)", low=0, rule=_LAYER_RULE, model_scope=_ACROSS))
    resample: bool = field(default=False, metadata=opt(
        "bool", "sample landmarks again at every patched layer", model_scope=_ACROSS))
    strategy: str = field(default="fps", metadata=opt("str", "landmark selection strategy", choices=STRATEGIES))
    features: str = field(default="keys", metadata=opt(
        "str", "what landmark selection runs on: the keys (heads concatenated) or the attention input hidden states",
        choices=FEATURES, model_scope=_ACROSS))
    pinv: str = field(default="rtol", metadata=opt(
        "str", "pseudo-inverse of the s x s landmark kernel (rtol: singular values below rtol x the largest dropped, "
        "float32 eigendecomposition of A^T A on the CPU, a smooth cut-off from batched products on CUDA; newton: "
        "Newton-Schulz; exact: float64 SVD, unregularised)", choices=PINV_MODES))
    rtol: float = field(default=1e-2, metadata=opt(
        "float", "relative singular-value cut-off of pinv=rtol", low=0.0, high=1.0, low_open=True, high_open=True,
        rule="must be in (0, 1)"))
    newton_iters: int = field(default=6, metadata=opt("int", "iterations of pinv=newton", low=1, rule="must be an integer >= 1"))
    massive_ratio: float = field(default=5.0, metadata=opt(
        "float", "massive token: block-input L2 norm above this many times the median (sample_layer=auto)", low=1.0,
        low_open=True, finite=True, rule="must be a finite number > 1", model_scope=_ACROSS))
    auto_fallback: int | str = field(default="auto", metadata=opt(
        "int_or_auto", "sample_layer=auto samples here at the latest ('auto' = num_layers // 2)", low=0, rule=_LAYER_RULE,
        model_scope=_ACROSS))
    seed: int = field(default=0, metadata=opt("int", "seed of the random and kmeans strategies", low=0, high=2**63 - 1))
    local_window: int = field(default=0, metadata=opt(
        "int", "radius (patches) of the exact 2-D window of each query, CLS and registers included; the low-rank "
        "estimate covers only the keys outside it (0 = plain FNA)", low=0, rule="must be an integer >= 0 (patches)"))
    window_tile: int = field(default=4, metadata=opt(
        "int", "side (patches) of the query tiles that share one window box (local_window > 0)", low=1,
        rule="must be an integer >= 1 (patches)"))
    window_until: int | str | None = field(default=None, metadata=opt(
        "int_or_auto", "layers from this index on run plain FNA without the local window (None = every approximated "
        "layer keeps it; 'auto' = num_layers // 2)", nullable=True, low=0,
        rule="must be None, 'auto' or a layer index >= 0", model_scope=_ACROSS))
    min_tokens: int | str = field(default="auto", metadata=opt(
        "int_or_auto", "images with fewer tokens run exact attention ('auto' = the device's break-even length, where "
        "the approximation starts to pay)", low=0, rule="must be 'auto' or an integer >= 0 (tokens)"))

    def min_tokens_on(self, device: torch.device | str) -> int | None:
        """``min_tokens`` on ``device`` from the option, ``ATTNPATCH_FNA_BREAK_EVEN`` or :data:`BREAK_EVEN`;
        ``None`` where the device type has no measured value (the patch then calibrates it: :func:`min_tokens_for`)."""
        if self.min_tokens != "auto":
            return int(self.min_tokens)
        env = os.environ.get("ATTNPATCH_FNA_BREAK_EVEN")
        if env is not None:
            found = parse_env("ATTNPATCH_FNA_BREAK_EVEN", env)
            return sys.maxsize if found is None else found
        return BREAK_EVEN.get(torch.device(device).type)

    def __post_init__(self) -> None:
        check_fields(self)


def check_fna(cfg: FNAConfig, geo: ModelGeometry) -> None:
    """``sample_layer`` and ``auto_fallback`` must name a layer the model has.

    Raises:
        OptionError: a layer index out of range.
    """
    num_layers = geo.num_layers
    for name in ("sample_layer", "auto_fallback", "window_until"):
        val = getattr(cfg, name)
        if val not in ("auto", None) and val >= num_layers:
            raise OptionError(f"{name}={val}: the model has {num_layers} attention layers (0..{num_layers - 1})")


def _landmark_features(cfg: FNAConfig, k: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
    if cfg.features == "keys":
        b, h, n, d = k.shape
        return k.transpose(1, 2).reshape(b, n, h * d)
    if ctx.hidden is None:
        raise OptionError("features='hidden': this adapter does not expose the attention layer's input; use features='keys'")
    return ctx.hidden


def _fna_landmarks(cfg: FNAConfig, k: torch.Tensor, ctx: LayerContext) -> tuple[torch.Tensor | None, torch.Tensor, bool]:
    """``(landmarks [B, s] or None, active [B] bool, every row active)`` for this layer; updates the per-forward state.

    With a numeric ``sample_layer`` (and no ``resample``) which rows are active is known on the host: nothing is
    read back from the device, so on CUDA the layers run without a host sync.  ``sample_layer="auto"`` reads the
    massive-token test back in each layer until every image has sampled.
    """
    b = k.shape[0]
    st = ctx.shared("fna")
    active = st.get("active")
    if active is None or active.shape[0] != b:
        active = torch.zeros(b, dtype=torch.bool, device=k.device)
        st["active"] = active
        st["landmarks"] = torch.zeros(b, cfg.s, dtype=torch.long, device=k.device)
        st["sampled_at"] = torch.full((b,), -1, dtype=torch.long)
        st["all_active"] = False
    if st["all_active"] and not cfg.resample:
        return st["landmarks"], active.clone(), True
    if cfg.sample_layer != "auto" and not cfg.resample:  # every row samples at sample_layer, at once
        if ctx.layer < cfg.sample_layer:
            return None, active.clone(), False
        st["landmarks"].copy_(select_landmarks(_landmark_features(cfg, k, ctx), cfg.s, prefix=ctx.prefix_tokens,
                                               strategy=cfg.strategy, seed=cfg.seed))
        st["sampled_at"].fill_(ctx.layer)
        active.fill_(True)
        st["all_active"] = True
        return st["landmarks"], active.clone(), True
    if cfg.sample_layer == "auto":
        fallback = ctx.num_layers // 2 if cfg.auto_fallback == "auto" else cfg.auto_fallback
        trigger = ~active
        if ctx.layer < fallback:
            if ctx.residual is None:
                raise OptionError("sample_layer='auto' needs the block input hidden states, which this adapter does not expose")
            trigger = trigger & massive_tokens(ctx.residual, cfg.massive_ratio).any(-1)
    else:
        trigger = ~active if ctx.layer >= cfg.sample_layer else torch.zeros_like(active)
    if cfg.resample:
        trigger = trigger | active
    if bool(trigger.any()):
        rows = torch.nonzero(trigger).flatten()
        feats = _landmark_features(cfg, k, ctx)[rows]
        st["landmarks"][rows] = select_landmarks(feats, cfg.s, prefix=ctx.prefix_tokens, strategy=cfg.strategy, seed=cfg.seed)
        st["sampled_at"][rows.cpu()] = ctx.layer
        active |= trigger
    st["all_active"] = every = bool(active.all())
    return (st["landmarks"] if every or bool(active.any()) else None), active.clone(), every


def _approximate(cfg: FNAConfig, q, k, v, landmarks, *, scale, prefix, window, key_keep=None, renormalize=False):
    """The layer's approximation with the given landmarks: Nyström + exact local window (``window``; no key mask:
    ``fna+sink_mask`` refuses ``local_window > 0``) or plain Nyström (optionally sink-masked)."""
    if window:
        return nystrom_local_attention(q, k, v, landmarks, scale=scale, prefix=prefix, radius=cfg.local_window,
                                       tile=cfg.window_tile, pinv=cfg.pinv, rtol=cfg.rtol, iters=cfg.newton_iters)
    return nystrom_attention(q, k, v, landmarks, scale=scale, pinv=cfg.pinv, rtol=cfg.rtol, iters=cfg.newton_iters,
                             key_keep=key_keep, renormalize=renormalize)


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
            lm = select_landmarks(feats, cfg0.s, prefix=1, strategy=cfg0.strategy, seed=cfg0.seed)
            return _approximate(cfg0, qq, kk, vv, lm, scale=scale, prefix=1, window=cfg0.local_window > 0)

        def sdpa_call():
            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, scale=scale)

        return fna_call, sdpa_call

    return case


def min_tokens_for(cfg: FNAConfig, q: torch.Tensor, k: torch.Tensor) -> int:
    """``min_tokens`` for a call on ``q`` / ``k``; ``"auto"``: :func:`~attnpatch.patchers.break_even.resolve_break_even`
    (``ATTNPATCH_FNA_BREAK_EVEN``, :data:`BREAK_EVEN`, or calibrated once; never faster: every image exact)."""
    if cfg.min_tokens != "auto":
        return int(cfg.min_tokens)
    found = resolve_break_even(
        "fna", {n: getattr(cfg, n) for n in _SPEED_OPTIONS}, q, k, table=BREAK_EVEN, env="ATTNPATCH_FNA_BREAK_EVEN",
        lengths=[n for n in CALIBRATION_LENGTHS if n > cfg.s], case=calibration_case(cfg, q, k),
    )
    return sys.maxsize if found.tokens is None else found.tokens


def prepare_fna(cfg: FNAConfig, geo: ModelGeometry, device: torch.device, dtype: torch.dtype) -> None:
    """At patch time: resolve ``min_tokens="auto"`` for the model's heads, device and dtype (a calibration then runs
    here, not inside the first, timed, forward); on the CPU build the compiled farthest-point sampling kernel
    (:func:`~attnpatch.attention.cpu_kernel.stripe_kernel`: a C++ build the first time on a machine, then a load),
    so that no timed forward pays it."""
    probe = probe_inputs(geo, device, dtype) if cfg.min_tokens == "auto" else None
    if probe is not None:
        min_tokens_for(cfg, *probe)
    if torch.device(device).type == "cpu" and cfg.strategy == "fps":
        from ...attention.cpu_kernel import stripe_kernel

        stripe_kernel()
    elif torch.device(device).type == "cuda" and cfg.strategy == "fps" and geo.heads and geo.head_dim:
        # the Triton kernels' JIT compile: farthest-point sampling on keys of the model's width, the pseudo-inverse
        from ...attention.landmarks import farthest_point_sampling
        from ...attention.nystrom import landmark_pinv

        g = torch.Generator().manual_seed(0)
        feats = torch.randn(1, 2 * cfg.s + 1, geo.heads * geo.head_dim, generator=g).to(device, dtype)
        farthest_point_sampling(feats, cfg.s, 1)
        landmark_pinv(torch.softmax(torch.randn(1, geo.heads, cfg.s, cfg.s, generator=g), -1).to(device, dtype),
                      cfg.pinv, rtol=cfg.rtol, iters=cfg.newton_iters)


def exact_reason(cfg: FNAConfig, q: torch.Tensor, k: torch.Tensor, ctx: LayerContext) -> str | None:
    """Why a call on ``q`` ``[B, H, N, D]`` runs exact attention whatever the layer (``"dense:short"``: below
    ``min_tokens``, :func:`min_tokens_for`; ``"dense:s>=N"``: every token would be a landmark, said once), or
    ``None``; shared with ``fna+sink_mask``."""
    n = q.shape[2]
    if n < min_tokens_for(cfg, q, k):
        return "dense:short"
    if cfg.s >= n:
        say(ctx, f"fna: s={cfg.s} >= N={n} tokens, so Nyström attention is exact attention; running exact attention")
        return "dense:s>=N"
    return None


def fna_core(cfg: FNAConfig, q, k, v, ctx: LayerContext, key_keep=None, renormalize=False, mode="fna"):
    """FNA for the images whose landmarks are sampled, exact attention for the others (shared with ``fna+sink_mask``)."""
    b, h, n, _ = q.shape
    k, v = repeat_kv(k, h), repeat_kv(v, h)
    rec = LayerRecord(ctx.layer, mode, n, n)
    landmarks, active, every = _fna_landmarks(cfg, k, ctx)
    if landmarks is None:
        if key_keep is None:
            rec.mode = "dense:before_sample"
            return None, rec
        return exact_attention(q, k, v, scale=ctx.scale, key_keep=key_keep, renormalize=renormalize), rec
    until = ctx.num_layers // 2 if cfg.window_until == "auto" else cfg.window_until
    window = cfg.local_window > 0 and (until is None or ctx.layer < until)
    if window:
        rec.mode = mode + "+window"
    kw = dict(scale=ctx.scale, prefix=ctx.prefix_tokens, window=window, renormalize=renormalize)
    if every:  # known on the host: no read-back
        out = _approximate(cfg, q, k, v, landmarks, key_keep=key_keep, **kw)
    else:
        out = exact_attention(q, k, v, scale=ctx.scale, key_keep=key_keep, renormalize=renormalize)
        rows = torch.nonzero(active).flatten()
        out[rows] = _approximate(
            cfg, q[rows], k[rows], v[rows], landmarks[rows], key_keep=None if key_keep is None else key_keep[rows], **kw
        )
    if ctx.record:
        s = landmarks.shape[1]
        rec.landmarks = torch.where(active[:, None], landmarks, torch.full_like(landmarks, -1)).cpu()
        full = float(n * n)
        pairs = 2.0 * s * n + s * s
        if window:
            p = ctx.prefix_tokens
            pairs += (n - p) * (window_keys(n - p, None, cfg.local_window, cfg.window_tile) + p) + p * n
        kept = torch.where(active.cpu(), torch.full((b,), min(pairs, full)), torch.full((b,), full)).double()
        rec.causal_pairs = torch.full((b, h), full, dtype=torch.float64)
        rec.kept_pairs = kept[:, None].expand(b, h).clone()
    return out, rec


def fna_forward(cfg: FNAConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """FNA from ``sample_layer`` on; exact attention before it and wherever ``s >= N``."""
    n = q.shape[2]
    reason = exact_reason(cfg, q, k, ctx)
    if reason is not None:
        return None, LayerRecord(ctx.layer, reason, n, n)
    return fna_core(cfg, q, k, v, ctx)


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
    if n <= cfg.s:
        raise OptionError(f"fna s={cfg.s}: every length must exceed s (got N={n})")
    feats = kr.transpose(1, 2).reshape(b, n, heads * d)
    lm = select_landmarks(feats, cfg.s, prefix=prefix, strategy=cfg.strategy, seed=cfg.seed)

    def fps():
        return select_landmarks(feats, cfg.s, prefix=prefix, strategy=cfg.strategy, seed=cfg.seed)

    def nys():
        return _approximate(cfg, q, kr, vr, lm, scale=scale, prefix=prefix, window=cfg.local_window > 0)

    def whole():
        return _approximate(cfg, q, kr, vr, fps(), scale=scale, prefix=prefix, window=cfg.local_window > 0)

    def extra(t: dict[str, float], ref: float) -> dict[str, Any]:
        incl = t["nystrom"] + t["fps"]
        return {"fna_incl_seconds": incl, "speedup_incl": ref / incl, "speedup_nystrom": ref / t["nystrom"],
                "reuse_layers": reuse, "s": cfg.s}

    return BenchCase(
        call=whole, parts={"fps": fps, "nystrom": nys}, seconds=lambda t: t["nystrom"] + t["fps"] / reuse, extra=extra,
        exponents=("fps", "nystrom"), plot={"fps": "FPS alone"},
    )


def _config(options: dict[str, Any]) -> FNAConfig:
    return FNAConfig(**options)


def _every_token(tokens: int) -> dict[str, Any]:
    # every token a landmark: Nyström attention is exact attention, and the layer runs the model's own
    return {"s": max(1, int(tokens))}


def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"s": max(1, round(n ** t))}


#: Named option sets (``patch(model, "fna", preset=...)``); what each is for: docs/methods.md ("FNA presets"); measured
#: speed and CLS cosine of each: docs/benchmarks/vision.md ("FNA presets").
PRESETS = {
    "accurate": Preset(
        dict(s=64, sample_layer="auto", local_window=0, window_until=None, min_tokens="auto"),
        "the defaults: landmarks sampled at half depth (no massive tokens), the early layers exact; exact below the "
        "device's break-even token count",
    ),
    "fast": Preset(
        dict(s=64, sample_layer=0, local_window=1, window_tile=4, window_until="auto", min_tokens=2048),
        "every layer approximated: the first half with the exact local window (Nyström + window), the second half "
        "plain FNA; exact below 2048 tokens; pays at large token counts (measured: BENCHMARKS.md)",
    ),
    "every-layer": Preset(
        dict(s=64, sample_layer=0, local_window=1, window_tile=4, window_until=None, min_tokens=2048),
        "every layer approximated with the exact local window: the most accurate way to approximate every layer, "
        "slower than 'fast'",
    ),
}

#: ``attnpatch tune``'s landmark counts.
TUNE_S = (32, 64, 128)


def _tune_space(geometry) -> list[dict[str, Any]]:
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


FNA = register_method(
    Method(
        name="fna",
        summary="Fast Nyström Attention: s landmark tokens by farthest-point sampling, sampled once and reused",
        source="FNA, arXiv 2507.16018, Sec. 3 (Eq. 3); Nyströmformer, arXiv 2102.03902, Eq. 13-16",
        options=options_of(FNAConfig),
        model_kinds=frozenset({"vision"}),
        make_config=_config,
        forward=fna_forward,
        check=check_fna,
        prepare=prepare_fna,
        causal_calls=False,
        noncausal_calls=True,
        key_padding=False,
        token_roles=frozenset({"prefix", "hidden", "residual"}),
        exact_limit_decl=ExactLimit(_every_token, at_least=("s",), text="s >= N", everywhere={"min_tokens": 2**31 - 1}),
        bench_hook=fna_bench,
        knob=Knob("s, 1 to N landmarks (log scale)", _knob, tokens="s"),
        presets=PRESETS,
        tune_space=_tune_space,
        small_settings={"vision": dict(s=8, sample_layer=0, min_tokens=0)},
        details=(
            "Fast Nyström Attention: `s` landmark tokens (CLS and registers always among them) chosen by farthest-point sampling once, at "
            "`sample_layer`, and reused by every later layer; `softmax(QK̃ᵀ)·pinv(softmax(Q̃K̃ᵀ))·softmax(Q̃Kᵀ)·V` "
            "evaluated right to left, never forming an N×N matrix. `s ≥ N` runs exact attention and says so."
        ),
    )
)
