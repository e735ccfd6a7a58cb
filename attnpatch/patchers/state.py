"""Per-forward state and per-layer records shared by the patch, the adapters and the methods."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LayerRecord", "ForwardState", "LayerContext"]


@dataclass
class LayerRecord:
    """What one patched attention layer did in one forward call.

    Attributes:
        layer: layer index.
        mode: ``"sparse"``, or why it ran dense: ``"dense:decode"`` (one query),
            ``"dense:short"`` (prompt shorter than ``min_len``), ``"dense:theta=inf"`` (every key kept), ``"dense:layer"`` (in
            ``dense_layers``), ``"dense"`` (the dense method).
        queries: query tokens in this call.
        keys: key tokens in this call.
        causal_pairs: ``[batch, heads]`` causal query-key pairs among valid tokens.
        kept_pairs: ``[batch, heads]`` pairs computed.
        recall: ``[batch, heads]`` mean exact softmax mass on kept keys, or ``None``.
        kept_columns: ``[batch, heads, blocks]`` stripes kept per query block (-1 for dense heads), or ``None``.
        landmarks: ``[batch, s]`` landmark token indices used in this layer (FNA), or ``None``.
        sinks: ``[batch, tokens]`` bool, the sink tokens masked in this layer, or ``None``.
        rel_error: ``[batch]`` relative Frobenius error ``||H_patched - H_exact|| / ||H_exact||`` of
            this layer's attention output on the same inputs (teacher-forced runs only), or ``None``.
    """

    layer: int
    mode: str
    queries: int
    keys: int
    causal_pairs: torch.Tensor | None = None
    kept_pairs: torch.Tensor | None = None
    recall: torch.Tensor | None = None
    kept_columns: torch.Tensor | None = None
    landmarks: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    rel_error: torch.Tensor | None = None

    @property
    def sparsity(self) -> torch.Tensor | None:
        """``[batch, heads]`` skipped fraction of causal query-key pairs (0 for dense)."""
        if self.causal_pairs is None:
            return None
        return 1.0 - self.kept_pairs / self.causal_pairs.clamp(min=1)


@dataclass
class ForwardState:
    """Per-forward state shared by the layers of one model call.

    Attributes:
        record: whether layers store a :class:`LayerRecord`.
        recall: whether sparse layers also measure attention recall (costs a dense ``Q K^T`` pass).
        layers: the records, by layer index.
        teacher_forced: every patched layer also computes exact attention on the same inputs,
            records the relative error of the method's output, and passes the *exact* output on
            (so each layer's error is measured in isolation).
        capture: store every layer's attention output (``[B, H, N, D]``, detached) in ``outputs``.
        probe: called as ``probe(ctx, q, k, v)`` at every routed layer (diagnostics), or ``None``.
        timing: accumulate the wall time of the patched attention calls in ``attention_seconds``.
        attention_seconds: seconds spent in the patched attention calls of this forward so far.
        layers: the records, by layer index.
        outputs: captured attention outputs, by layer index.
        shared: free slot for state one layer computes and later layers reuse (landmark
            indices sampled once, detected sink tokens, the current layer's input hidden states).
        token_sizes: ``[B, N']`` float, the input tokens each output token stands for, set by a
            method that merges tokens (ToMe); ``None`` when the token count does not change.
        token_source: ``[B, N0]`` int64, for each input token the position of the output token it was merged
            into (ToMe's source map), set with ``token_sizes``; ``None`` when the token count does not change.
    """

    record: bool = False
    recall: bool = False
    teacher_forced: bool = False
    capture: bool = False
    probe: Any = None
    timing: bool = False
    attention_seconds: float = 0.0
    layers: dict[int, LayerRecord] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    token_sizes: torch.Tensor | None = None
    token_source: torch.Tensor | None = None


@dataclass
class LayerContext:
    """What a method's forward knows about the call besides ``q, k, v``.

    Attributes:
        layer: index of this attention layer (0-based, in model order).
        num_layers: number of attention layers the patch routes.
        scale: attention scale (the model's, usually ``head_dim ** -0.5``).
        q_offset: absolute position of the first query (causal models; 0 otherwise).
        key_valid: ``[B, Lk]`` bool of non-padding keys, or ``None`` (all valid).
        causal: whether the layer is causal.
        prefix_tokens: leading special tokens (CLS + register tokens; 0 for causal LMs).
        state: the forward's :class:`ForwardState` (``None`` when a sub-module is called directly).
        record: whether to fill a :class:`LayerRecord` with statistics.
        hidden: ``[B, N, C]`` the attention module's input (after the block's norm), or ``None``.
        residual: ``[B, N, C]`` the block's input (residual stream), or ``None``.
    """

    layer: int
    num_layers: int
    scale: float
    q_offset: int = 0
    key_valid: torch.Tensor | None = None
    causal: bool = True
    prefix_tokens: int = 0
    state: ForwardState | None = None
    record: bool = False
    hidden: torch.Tensor | None = None
    residual: torch.Tensor | None = None

    def shared(self, key: str) -> dict[str, Any]:
        """The per-forward dict ``state.shared[key]`` (a throwaway dict when there is no forward state)."""
        if self.state is None:
            return {}
        return self.state.shared.setdefault(key, {})

    def say(self, message: str) -> None:
        """Warn (``UserWarning``, prefixed ``attnpatch:``) once per forward call (every call without forward state)."""
        if self.state is not None:
            said = self.state.shared.setdefault("_said", set())
            if message in said:
                return
            said.add(message)
        warnings.warn(f"attnpatch: {message}", UserWarning, stacklevel=4)
