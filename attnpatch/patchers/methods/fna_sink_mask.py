"""``fna+sink_mask``: FNA in every patched layer, with sink tokens masked (in Nyström form) in the last layers."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from ...errors import OptionError
from ..contract import ExactLimit, Knob, Method, ModelGeometry
from ..registry import register_method
from ..state import LayerContext, LayerRecord
from .fna import FNA, FNAConfig, check_fna, exact_reason, fna_core, prepare_fna
from .sink_mask import NO_SINKS, SINK_MASK, SinkMaskConfig, check_sink, sink_mask_forward, sinks_of

__all__ = ["FNA_SINK_MASK", "FNASinkConfig", "fna_sink_forward"]

_FNA_NAMES = tuple(f.name for f in fields(FNAConfig))


@dataclass(frozen=True)
class FNASinkConfig:
    """``fna+sink_mask``: FNA in every patched layer, with sink tokens masked in the last layers."""

    fna: FNAConfig
    sink: SinkMaskConfig


def _config(options: dict[str, Any]) -> FNASinkConfig:
    if options.get("local_window", 0):
        raise OptionError(
            f"local_window={options['local_window']}: fna+sink_mask does not implement sink masking with the local "
            "window; use local_window=0 (plain FNA with sink masking) or fna with local_window"
        )
    return FNASinkConfig(
        FNAConfig(**{k: v for k, v in options.items() if k in _FNA_NAMES}),
        SinkMaskConfig(**{k: v for k, v in options.items() if k not in _FNA_NAMES}),
    )


def _check(cfg: FNASinkConfig, geo: ModelGeometry) -> None:
    check_fna(cfg.fna, geo)
    check_sink(cfg.sink, geo)


def fna_sink_forward(cfg: FNASinkConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext):
    """FNA in every patched layer; sink tokens masked (in Nyström form) in the last ``mask_layers`` layers."""
    sinks = sinks_of(cfg.sink, q, k, ctx)
    n = q.shape[2]
    reason = exact_reason(cfg.fna, q, k, ctx)
    if reason is not None:
        if sinks is None:
            return None, LayerRecord(ctx.layer, reason, n, n)
        return sink_mask_forward(cfg.sink, q, k, v, ctx)
    keep = None if sinks is None else ~sinks
    out, rec = fna_core(cfg.fna, q, k, v, ctx, key_keep=keep, renormalize=cfg.sink.renormalize, mode="fna+sink_mask")
    if ctx.record and sinks is not None:
        rec.sinks = sinks.cpu()
    return out, rec


def _exact(tokens: int) -> dict[str, Any]:
    return {**FNA.exact_limit(tokens), **NO_SINKS.options(tokens)}


assert not set(FNA.options) & set(SINK_MASK.options)

def _knob(t: float, n: int) -> dict[str, Any]:
    """The main knob at position ``t`` in [0, 1] for ``n`` tokens (see :class:`~attnpatch.patchers.contract.Knob`)."""
    return {"s": max(1, round(n ** t))}


FNA_SINK_MASK = register_method(
    Method(
        name="fna+sink_mask",
        summary="fna in every patched layer, with sink tokens masked (in Nyström form) in the last layers",
        source="FNA, arXiv 2507.16018, Sec. 3-4",
        options={**FNA.options, **SINK_MASK.options},
        model_kinds=frozenset({"vision"}),
        make_config=_config,
        forward=fna_sink_forward,
        check=_check,
        prepare=lambda cfg, geo, device, dtype: prepare_fna(cfg.fna, geo, device, dtype),
        causal_calls=False,
        noncausal_calls=True,
        key_padding=False,
        token_roles=FNA.token_roles | SINK_MASK.token_roles,
        exact_limit_decl=ExactLimit(_exact, at_least=("s", "mass_ratio"), text=f"s >= N, {NO_SINKS.text}"),
        details="Both: FNA everywhere it applies, sink columns zeroed in Nyström form in the last layers.",
        knob=Knob("s, 1 to N landmarks (log scale)", _knob, tokens="s"),
        small_settings={"vision": dict(s=8, sample_layer=0, min_tokens=0, mask_layers=2, detect="attention", mass_ratio=1.5)},
    )
)
