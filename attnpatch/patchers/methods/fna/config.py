"""``fna``'s options (:class:`FNAConfig`), their checks, presets and the layer's approximation given landmarks.

The method itself (landmark bookkeeping, forward, registration): :mod:`attnpatch.patchers.methods.fna`; its
calibration, bench and tune hooks: :mod:`.hooks`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

from ....attention.landmarks import STRATEGIES
from ....attention.nystrom import PINV_MODES, nystrom_attention, nystrom_local_attention
from ....errors import OptionError
from ....options import at_layer, check_fields, opt
from ...break_even import parse_env
from ...contract import ModelGeometry, Preset

__all__ = ["FNAConfig", "FEATURES", "BREAK_EVEN", "PRESETS", "check_fna", "approximate"]

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
            :func:`~attnpatch.attention.nystrom.pinv_matmul.landmark_pinv_matmul`), ``"newton"`` (Newton-Schulz), ``"exact"``
            (unregularised; amplifies the Nyström error).
        rtol: relative singular-value cut-off of ``pinv="rtol"``.
        newton_iters: iterations of ``pinv="newton"``.
        massive_ratio: norm ratio defining a massive token for ``sample_layer="auto"``.
        auto_fallback: ``sample_layer="auto"`` samples at this layer at the latest (an int, or
            ``"auto"`` = half the depth, ``num_layers // 2``: a model without massive tokens
            then has half its layers approximated).
        seed: seed of the ``random`` and ``kmeans`` strategies.
        local_window: radius in patches of each query's exact window (:mod:`attnpatch.attention.nystrom.local`):
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

    s: int | tuple[int, ...] = field(default=64, metadata=opt(
        "int_schedule", "landmarks per image (tokens, CLS and registers included; s >= N runs exact attention), or one "
        "per layer (0 = that layer exact)", low=1,
        rule="the number of landmarks must be an integer >= 1 (tokens; in a per-layer list, 0 leaves the layer exact)"))
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

    @property
    def s_max(self) -> int:
        """The most landmarks any layer takes (``s`` itself without a per-layer schedule): the count sampled once."""
        return max(self.s) if isinstance(self.s, tuple) else self.s

    def s_at(self, layer: int) -> int:
        """Landmarks at ``layer`` (0-based); ``0``: the schedule leaves the layer exact."""
        return at_layer(self.s, layer)

    def __post_init__(self) -> None:
        check_fields(self)
        if isinstance(self.s, tuple) and self.strategy != "fps" and len({x for x in self.s if x}) > 1:
            raise OptionError(
                f"s={list(self.s)} with strategy={self.strategy!r}: a per-layer s takes each layer's landmarks as the "
                "first s of one sample, which is a sample of its own only for strategy='fps'; use strategy='fps' or "
                "one s for every approximated layer")


def check_fna(cfg: FNAConfig, geo: ModelGeometry) -> None:
    """``sample_layer`` and ``auto_fallback`` must name a layer the model has; a per-layer ``s`` has one entry per layer.

    Raises:
        OptionError: a layer index out of range, or a schedule of the wrong length.
    """
    num_layers = geo.num_layers
    if isinstance(cfg.s, tuple) and len(cfg.s) != num_layers:
        raise OptionError(f"s={list(cfg.s)}: a per-layer schedule needs one entry per attention layer; the model has "
                          f"{num_layers}")
    for name in ("sample_layer", "auto_fallback", "window_until"):
        val = getattr(cfg, name)
        if val not in ("auto", None) and val >= num_layers:
            raise OptionError(f"{name}={val}: the model has {num_layers} attention layers (0..{num_layers - 1})")


def approximate(cfg: FNAConfig, q, k, v, landmarks, *, scale, prefix, window, key_keep=None, renormalize=False,
                key_bias=None):
    """The layer's approximation of ``q, k, v`` ``[B, H, N, D]`` with the given landmarks ``[B, s]``: Nyström + exact
    local window (``window``; no key mask: ``fna+sink_mask`` refuses ``local_window > 0``;
    :func:`~attnpatch.attention.nystrom.local.nystrom_local_attention`) or plain Nyström, optionally sink-masked
    (:func:`~attnpatch.attention.nystrom.fna.nystrom_attention`; FNA, arXiv 2507.16018, Eq. 3).  Returns
    ``[B, H, N, D]``.  ``key_bias`` ``[B, N]``: a logit added to each key (``tome+fna``'s ``log(size)``; not with the
    window, which ``tome+fna`` refuses)."""
    if window:
        return nystrom_local_attention(q, k, v, landmarks, scale=scale, prefix=prefix, radius=cfg.local_window,
                                       tile=cfg.window_tile, pinv=cfg.pinv, rtol=cfg.rtol, iters=cfg.newton_iters)
    return nystrom_attention(q, k, v, landmarks, scale=scale, pinv=cfg.pinv, rtol=cfg.rtol, iters=cfg.newton_iters,
                             key_keep=key_keep, renormalize=renormalize, key_bias=key_bias)


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
