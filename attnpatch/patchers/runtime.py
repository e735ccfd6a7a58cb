"""The runtime the adapters call: the patch bound to one model (:class:`PatchHandle`) and one attention call (:func:`run_layer`).

State that crosses layers lives in one :class:`~attnpatch.patchers.state.ForwardState`, created
by the patch at the start of every top-level forward call (a forward pre-hook) and dropped at its
end; nothing is global, so two models patched side by side do not interfere and no state leaks
from one batch to the next.

Layering: this module knows methods (:mod:`.contract`) and per-forward state (:mod:`.state`),
never the adapters nor the public API (:mod:`.api`); adapters import it, and :mod:`.class_swap`
(block hooks, class swaps) and :mod:`.features` (the adapters' feature extraction) beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import AttnpatchError, InferenceOnlyError, OptionError, PatchStateError, UnsupportedModelError
from ..timing import sync
from .contract import Method
from .state import GROUP_ATTR, ForwardState, LayerContext, LayerRecord, PatchRepr

__all__ = [
    "PatchHandle",
    "Recorder",
    "run_layer",
    "run_module",
    "needs_attention_tensors",
    "input_hook",
    "set_layer_inputs",
    "count_pairs",
    "check_call",
    "handle_on",
    "handles_on",
]



@dataclass
class Recorder:
    """What :func:`~attnpatch.patchers.api.record_stats` / :func:`~attnpatch.patchers.api.time_attention` collect."""

    recall: bool
    teacher_forced: bool = False
    capture: bool = False
    probe: Any = None
    stats: bool = True
    timing: bool = False
    forwards: list[dict[int, LayerRecord]] = field(default_factory=list)
    outputs: list[dict[int, torch.Tensor]] = field(default_factory=list)
    attention_seconds: list[float] = field(default_factory=list)


class PatchHandle:
    """The patch applied to one model: method, validated options, config, adapter, hooks.

    Attributes:
        model: the patched model.
        method: the registered :class:`~attnpatch.patchers.contract.Method`.
        options: complete option dict (defaults filled in).
        config: the method's config object built from ``options``.
        adapter: the :class:`~attnpatch.patchers.adapter.Adapter` that routes the model's attention.
        kind: model kind detected by the adapter (``"causal_lm"`` or ``"vision"``; for a
            dual-tower model the kinds of the routed towers, e.g. ``"vision"`` or ``"vision+text"``).
        towers: names of the routed towers, e.g. ``("vision",)``.
        tower_kinds: every tower of the model and its kind (``"vision"``: bidirectional
            image attention; ``"causal_lm"``: causal LM attention; ``"text"``: a text encoder
            such as CLIP's, which only ``dense`` fits).
        state: the current :class:`ForwardState` while a forward call runs, else ``None``.
    """

    def __init__(
        self, model: torch.nn.Module, method: Method, options: dict[str, Any], adapter, kind: str,
        towers: tuple[str, ...] = (), tower_kinds: dict[str, str] | None = None,
    ):
        self.model = model
        self.method = method
        self.options = options
        self.config = method.build_config(options)
        self.method_forward = method.forward
        self.adapter = adapter
        self.kind = kind
        self.towers = tuple(towers)  # the towers the patch routes (see patch(towers=...))
        self.tower_kinds = dict(tower_kinds or {})  # every tower of the model -> its kind
        self.state: ForwardState | None = None
        self.group: Any = None  # the model's PatchGroup, once installed
        self.layer_offset = 0  # layers of the patches on earlier towers (record keys across towers)
        self._undo: Any = None
        self._repr_modules: list[torch.nn.Module] = []
        self.num_layers = 0  # set by the adapter
        self.prefix_tokens = 0  # set by the adapter (CLS + registers for ViTs)
        self._said: set[str] = set()
        self.last_token_sizes: torch.Tensor | None = None  # [B, N'] of the last forward, for methods that merge tokens
        self.last_token_source: torch.Tensor | None = None  # [B, N0] of the last forward: the output token of each input token

    def say(self, message: str) -> None:
        """Warn once per patch (``UserWarning``, prefixed ``attnpatch:``) about what the patch did instead."""
        if message not in self._said:
            self._said.add(message)
            import warnings

            warnings.warn(f"attnpatch: {message}", UserWarning, stacklevel=3)

    def describe(self) -> str:
        """One line for ``repr``: method and the options that differ from the defaults."""
        defaults = {n: o.default for n, o in self.method.options.items()}
        changed = ", ".join(f"{k}={v!r}" for k, v in self.options.items() if defaults.get(k) != v)
        return f"attnpatch={self.method.name}({changed})"

    @property
    def recorders(self) -> list[Recorder]:
        """The active recorders of the model's :class:`~attnpatch.patchers.state.PatchGroup` (none before it joins one)."""
        return self.group.recorders if self.group is not None else []

    def install(self) -> None:
        """Apply the adapter; routed modules show the patch in ``repr`` (the per-forward hooks and the model's own
        ``repr`` line belong to the model's :class:`~attnpatch.patchers.state.PatchGroup`)."""
        self._undo = self.adapter.apply(self)
        text = self.describe()
        for m in [m for m in self.model.modules() if m.__dict__.get("_attnpatch") is self and m is not self.model]:
            if "extra_repr" not in m.__dict__:
                layer = m.__dict__.get("_attnpatch_layer")
                m.extra_repr = PatchRepr(m, text if layer is None else f"{text}, layer={layer}")
                self._repr_modules.append(m)

    def remove(self) -> None:
        """Let the adapter restore the model (the group drops the patch's hooks)."""
        for m in self._repr_modules:
            m.__dict__.pop("extra_repr", None)
        self._repr_modules.clear()
        self.adapter.restore(self, self._undo)
        self.state = None


def count_pairs(key_valid: torch.Tensor | None, q_offset: int, lq: int, lk: int, b: int, h: int, causal: bool) -> torch.Tensor:
    """``[B, H]`` query-key pairs among valid keys (causal: only keys at or before each query)."""
    if not causal:
        if key_valid is None:
            return torch.full((b, h), float(lq * lk), dtype=torch.float64)
        return (key_valid.sum(-1).double().cpu() * lq)[:, None].expand(b, h).clone()
    if key_valid is None:
        n = lq * q_offset + lq * (lq + 1) // 2
        return torch.full((b, h), float(n), dtype=torch.float64)
    cum = key_valid.to(torch.int64).cumsum(-1)
    pos = q_offset + torch.arange(lq, device=key_valid.device)
    per_q = cum[:, pos] * key_valid[:, pos]
    return per_q.sum(-1).double().cpu()[:, None].expand(b, h).clone()


def check_call(method: Method, ctx: LayerContext) -> None:
    """Refuse an attention call the method's declared capabilities exclude (:func:`run_layer` calls it
    before every method forward, so a method never sees a call it did not declare).

    Raises:
        OptionError: a causal call to a method without ``causal_calls``, or a bidirectional call to
            one without ``noncausal_calls``.
        UnsupportedModelError: a key-padding mask that hides some keys, for a method without ``key_padding``.
    """
    if ctx.causal and not method.causal_calls:
        raise OptionError(f"method {method.name!r} is for bidirectional (vision) attention; layer {ctx.layer} is causal")
    if not ctx.causal and not method.noncausal_calls:
        raise OptionError(f"method {method.name!r} is for causal attention; layer {ctx.layer} is bidirectional")
    if not method.key_padding and ctx.key_valid is not None and not bool(ctx.key_valid.all()):
        raise UnsupportedModelError(
            f"method {method.name!r} got an attention mask that hides some keys (padding) in layer {ctx.layer}; "
            "it supports unmasked bidirectional attention only"
        )


def _check_output(method: Method, layer: int, out: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> None:
    """A method's output must be ``[B, H, Lq, Dv]`` in the dtype and on the device of ``q`` (a method bug otherwise)."""
    want = (q.shape[0], q.shape[1], q.shape[2], v.shape[-1])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device:
        got = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise AttnpatchError(
            f"method {method.name!r} returned {got} for layer {layer}; a method's forward must return "
            f"[batch, heads, queries, value head dim] = {list(want)} {q.dtype} on {q.device} (or None to run the "
            "model's own attention)"
        )


def run_layer(
    handle: "PatchHandle",
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    exact: Callable[[], torch.Tensor],
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    causal: bool = False,
    dropout: float = 0.0,
    decline: str | None = None,
    own_forward: bool = False,
) -> torch.Tensor | None:
    """Run the patch's method for one attention call; what every adapter calls.

    Args:
        handle: the model's patch.
        layer: attention-layer index.
        q: ``[B, H, Lq, D]``; k, v: ``[B, Hkv, Lk, D]``.
        scale: attention scale.
        exact: computes the model's own exact attention for this call, ``[B, H, Lq, D]``.
        q_offset, key_valid, causal: see :class:`~attnpatch.patchers.state.LayerContext`.
        dropout: the attention dropout probability of this call (non-zero only in training mode).
        decline: a reason to run ``exact()`` for this call without asking the method (the adapter
            found something the method cannot represent, e.g. an attention mask that is not causal
            + padding); recorded as the layer's mode ``"dense:<reason>"``.  A call whose ``key_valid`` hides keys
            runs exact as ``"dense:padding"`` (said once) for a method without ``key_padding``.
        own_forward: the adapter runs the attention module's own forward (projections included) for a call the
            method hands back (``None``) or that is declined, because ``exact()`` followed by the adapter's output
            projection is not that forward bit for bit (``torch.nn.MultiheadAttention`` runs a fused kernel in
            inference).  Such a call then returns ``None`` instead of ``exact()``, unless the forward asks for the
            attention tensors (:func:`needs_attention_tensors`: capture, teacher forcing, a probe, timing).  What
            ``dense`` gets from :func:`run_module`, for the other methods' hand-backs.

    Returns:
        ``[B, H, Lq, D]``: the method's output, or ``exact()`` where the method declines (and
        always ``exact()`` in a teacher-forced run, after recording the method's error); ``None`` where the
        method declines and ``own_forward`` leaves the call to the module's own forward.

    Raises:
        InferenceOnlyError: an approximate method called with autograd recording on inputs that
            require grad, or with attention dropout (training mode): its gradients and dropout are
            not implemented, so it refuses rather than return wrong gradients.
    """
    if not handle.method.exact:
        _check_inference(handle, layer, q, k, v, dropout)
    state = handle.state
    record = state is not None and state.record
    shared = state.shared if state is not None else {}
    ctx = LayerContext(
        layer=layer, num_layers=handle.num_layers, scale=scale, q_offset=q_offset, key_valid=key_valid,
        causal=causal, prefix_tokens=handle.prefix_tokens, state=state, record=record,
        hidden=shared.get("_hidden"), residual=shared.get("_residual"),
    )
    if state is not None and state.probe is not None:
        state.probe(ctx, q, k, v)
    if decline is None and not handle.method.key_padding and key_valid is not None and not bool(key_valid.all()):
        decline = "padding"  # exact there, never the method on keys it would not hide
        handle.say(
            f"{type(handle.model).__name__}: an attention mask hides some keys (padded images or patches, e.g. a "
            f"patch-attention mask); method {handle.method.name!r} does not implement key padding, so such calls run the "
            "model's own attention (recorded as mode 'dense:padding')"
        )
    timing = state is not None and state.timing
    if timing:
        sync(q.device)
        t0 = time.perf_counter()
    if decline is None:
        check_call(handle.method, ctx)
        out, rec = handle.method_forward(handle.config, q, k, v, ctx)
        if out is not None:
            _check_output(handle.method, layer, out, q, v)
    else:
        out, rec = None, LayerRecord(layer, f"dense:{decline}", q.shape[2], k.shape[2])
    if state is not None and state.teacher_forced:
        ref = exact()
        if out is not None and rec is not None:
            num = (out.float() - ref.float()).flatten(1).norm(dim=-1)
            rec.rel_error = (num / ref.float().flatten(1).norm(dim=-1).clamp(min=1e-30)).cpu()
        elif rec is not None:
            rec.rel_error = torch.zeros(q.shape[0])
        out = ref
    elif out is None and not (own_forward and not needs_attention_tensors(handle)):
        out = exact()
    if timing:
        sync(q.device)
        state.attention_seconds += time.perf_counter() - t0
    if record and rec is not None:
        if rec.causal_pairs is None:
            b, h, lq, _ = q.shape
            rec.causal_pairs = count_pairs(key_valid, q_offset, lq, k.shape[2], b, h, causal)
            rec.kept_pairs = rec.causal_pairs.clone() if rec.kept_pairs is None else rec.kept_pairs
        state.layers[layer] = _merged(state.layers.get(layer), rec)
    if state is not None and state.capture:
        prev = state.outputs.get(layer)
        # a layer called again in one forward (packed sequences: one call per image) keeps every call's tokens
        state.outputs[layer] = out.detach() if prev is None or prev.shape[:2] != out.shape[:2] else torch.cat([prev, out.detach()], 2)
    return out


def _merged(prev: LayerRecord | None, rec: LayerRecord) -> LayerRecord:
    """One record per layer and forward: a layer called again in the same forward (a packed tower, one call per image)
    adds its tokens and pairs to the first call's record; the other fields are the last call's."""
    if prev is None or prev.causal_pairs is None or rec.causal_pairs is None or prev.causal_pairs.shape != rec.causal_pairs.shape:
        return rec
    rec.queries += prev.queries
    rec.keys += prev.keys
    rec.causal_pairs = rec.causal_pairs + prev.causal_pairs
    rec.kept_pairs = rec.kept_pairs + prev.kept_pairs
    return rec


def needs_attention_tensors(handle: "PatchHandle") -> bool:
    """Whether the current forward asks for per-layer ``q, k, v``, attention outputs or attention
    time (capture, teacher forcing, a probe, :func:`time_attention`); when it does not, an adapter
    may run an exact method (``dense``) as the model's own module forward, bit for bit, through
    :func:`run_module`."""
    state = handle.state
    return state is not None and (state.capture or state.teacher_forced or state.probe is not None or state.timing)


def run_module(
    handle: "PatchHandle", layer: int, forward: Callable[[], Any], *, batch: int, heads: int, queries: int, keys: int,
    causal: bool = False,
) -> Any:
    """Run an exact method's layer as the model's own attention-module forward (``forward()``,
    projections included), with the patch's records (mode ``"dense"``, every pair kept); a forward timed by :func:`time_attention` does not come here.

    Returns:
        Whatever ``forward()`` returns.
    """
    state = handle.state  # never timing: a timed forward computes the attention apart (needs_attention_tensors)
    out = forward()
    if state is not None and state.record:
        rec = LayerRecord(layer, "dense", queries, keys)
        rec.causal_pairs = count_pairs(None, keys - queries if causal else 0, queries, keys, batch, heads, causal)
        rec.kept_pairs = rec.causal_pairs.clone()
        state.layers[layer] = rec
    return out


def _check_inference(handle: "PatchHandle", layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> None:
    name = handle.method.name
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise InferenceOnlyError(
            f"{type(handle.model).__name__} patched with {name!r}: the method is inference-only (its gradients are not "
            f"implemented), but layer {layer} runs with autograd on inputs that require grad; run the model under "
            "torch.no_grad() or torch.inference_mode(), or use method 'dense' (the model's own attention) for training"
        )
    if dropout > 0:
        raise InferenceOnlyError(
            f"{type(handle.model).__name__} patched with {name!r}: layer {layer} is called with attention dropout "
            f"p={dropout} (training mode), which the method does not implement; call model.eval() first, or use method 'dense'"
        )


def set_layer_inputs(handle: "PatchHandle", hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> None:
    """Adapters' hooks: remember the current layer's attention input / block input for the method (no copy)."""
    state = handle.state
    if state is None:
        return
    if hidden is not None:
        state.shared["_hidden"] = hidden
    if residual is not None:
        state.shared["_residual"] = residual


def input_hook(handle: "PatchHandle", which: str, names: tuple[str, ...], batch_first: bool = True):
    """A forward pre-hook (``with_kwargs=True``) that hands a module's first input to the method as the
    layer's ``which`` (``"hidden"``: the attention input, ``"residual"``: the block input), ``[B, N, C]``.

    Args:
        handle: the model's patch.
        which: ``"hidden"`` or ``"residual"``.
        names: keyword names the input may be passed under when it is not positional.
        batch_first: ``False`` for sequence-first inputs ``[N, B, C]`` (transposed, no copy).
    """

    def hook(module, args, kwargs):
        x = args[0] if args else next((kwargs[k] for k in names if k in kwargs), None)
        if isinstance(x, torch.Tensor):
            set_layer_inputs(handle, **{which: x if batch_first else x.transpose(0, 1)})

    return hook


def handles_on(model: torch.nn.Module) -> "list[PatchHandle]":
    """The patches of ``model`` (one per ``patch()`` call, each on its own towers), in the model order of their towers;
    ``[]`` when it is not patched."""
    group = getattr(model, GROUP_ATTR, None)
    return list(group.handles) if group is not None else []


def handle_on(model: torch.nn.Module, tower: str | None = None) -> "PatchHandle | None":
    """The :class:`PatchHandle` that routes ``tower`` of ``model`` (``None``: the model's one patch), or ``None``
    when that is not patched.

    Raises:
        PatchStateError: ``tower`` is ``None`` and the model is patched per tower with several patches.
    """
    hs = handles_on(model)
    if tower is not None:
        return next((h for h in hs if tower in h.towers), None)
    if len(hs) > 1:
        raise PatchStateError(
            f"{type(model).__name__} is patched per tower ("
            + "; ".join(f"{', '.join(map(repr, h.towers))}: {h.method.name!r}" for h in hs)
            + "); name the tower (tower=...)"
        )
    return hs[0] if hs else None
