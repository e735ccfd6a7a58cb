"""Per-forward state and per-layer records shared by the patch, the adapters and the methods, and the group of a
model's patches (:class:`PatchGroup`, one patch per set of towers) that makes that state at every top-level call."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LayerRecord", "ForwardState", "LayerContext", "PatchGroup", "PatchRepr", "GROUP_ATTR"]

#: The attribute of a patched model that holds its :class:`PatchGroup` (set by :func:`attnpatch.patch`).
GROUP_ATTR = "_attnpatch_patches"


@dataclass
class LayerRecord:
    """What one patched attention layer did in one forward call.

    Attributes:
        layer: layer index (tower-local to its patch; in a recorder of a model patched per tower, the index across
            the patched towers in model order, as the recorder's keys).
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


class PatchGroup:
    """The patches of one model (one :class:`~attnpatch.patchers.runtime.PatchHandle` per ``patch()`` call, each on
    its own towers) and the per-forward hooks they share.

    At every top-level forward call (through any routed root: the model, a tower called alone, a block stack) each
    patch gets a fresh :class:`ForwardState` of its own (so one tower's method state never reaches another's), and the
    recorders get *one* entry per call: the layers of every patch, keyed by the index across the patched towers in
    model order (a patch's layers are offset by the layers of the patches on earlier towers), with attention times
    summed.  With one patch, the keys are the patch's own layer indices, as they always were.

    Attributes:
        model: the patched model.
        handles: the patches, in the model order of their first tower.
        recorders: the active :func:`~attnpatch.record_stats` / :func:`~attnpatch.time_attention` recorders.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.handles: list[Any] = []
        self.recorders: list[Any] = []
        self._hooks: list[Any] = []
        self._depth = 0
        self._repr = False

    def add(self, handle: Any, tower_order: list[str]) -> None:
        """Add an installed patch; ``tower_order``: every tower of the model, in model order."""
        handle.group = self
        self.handles.append(handle)
        self.handles.sort(key=lambda h: min((tower_order.index(t) for t in h.towers if t in tower_order), default=0))
        self._rehook()

    def discard(self, handle: Any) -> None:
        """Drop a patch its adapter has restored."""
        self.handles.remove(handle)
        handle.group = None
        self._rehook()

    def _rehook(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        offset = 0
        for h in self.handles:
            h.layer_offset = offset
            offset += h.num_layers
        if self._repr:
            self.model.__dict__.pop("extra_repr", None)
            self._repr = False
        if not self.handles:
            return
        if "extra_repr" not in self.model.__dict__:
            one = len(self.handles) == 1
            line = "; ".join(h.describe() + ("" if one else f" [{', '.join(h.towers)}]") for h in self.handles)
            self.model.extra_repr = PatchRepr(self.model, line)
            self._repr = True
        roots: list[torch.nn.Module] = []
        for h in self.handles:
            roots += [r for r in h.adapter.roots(h) if all(r is not o for o in roots)]
        for root in roots:
            # prepended: the state exists before the adapters' own input hooks on the same module run
            self._hooks.append(root.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
            self._hooks.append(root.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def _pre(self, module, args, kwargs):
        self._depth += 1
        if self._depth > 1:
            return None
        rs = self.recorders
        probes = [r.probe for r in rs if r.probe is not None]
        flags = dict(record=any(r.stats for r in rs), timing=any(r.timing for r in rs), recall=any(r.recall for r in rs),
                     teacher_forced=any(r.teacher_forced for r in rs), capture=any(r.capture for r in rs),
                     probe=probes[-1] if probes else None)
        for h in self.handles:
            h.state = ForwardState(**flags)
        return None

    def _post(self, module, args, kwargs, output):
        self._depth = max(0, self._depth - 1)
        if self._depth > 0:
            return None
        layers: dict[int, LayerRecord] = {}
        outputs: dict[int, torch.Tensor] = {}
        seconds, any_state = 0.0, False
        for h in self.handles:
            state, h.state = h.state, None
            if state is None:
                continue
            any_state = True
            h.last_token_sizes = state.token_sizes
            h.last_token_source = state.token_source
            off = getattr(h, "layer_offset", 0)
            for k, rec in state.layers.items():
                if off:
                    rec.layer = off + k
                layers[off + k] = rec
            outputs.update({off + k: o for k, o in state.outputs.items()})
            seconds += state.attention_seconds
        if not any_state:
            return None
        for r in self.recorders:
            if r.stats:
                r.forwards.append(layers)
            if r.capture:
                r.outputs.append(outputs)
            if r.timing:
                r.attention_seconds.append(seconds)
        return None


class PatchRepr:
    """A patched module's (or model's) ``extra_repr``: its class's own text, then the patch line (picklable, unlike a
    closure)."""

    def __init__(self, module: torch.nn.Module, line: str):
        self.module = module
        self.line = line

    def __call__(self) -> str:
        own = type(self.module).extra_repr(self.module)
        return ", ".join(x for x in (own, self.line) if x)
