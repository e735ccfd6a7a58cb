"""``patch`` / ``unpatch``: binding a registered method to a model through an adapter.

State that crosses layers lives in one :class:`ForwardState`, created by the patch at the
start of every top-level forward call (a forward pre-hook) and dropped at its end; nothing
is global, so two models patched side by side do not interfere and no state leaks from one
batch to the next.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..errors import InferenceOnlyError, PatchStateError, UnsupportedModelError
from .registry import Method, get_method, validate_options
from .state import ForwardState, LayerContext, LayerRecord

__all__ = [
    "PatchHandle",
    "ForwardState",
    "LayerRecord",
    "patch",
    "unpatch",
    "patched",
    "is_patched",
    "patch_info",
    "record_stats",
    "run_layer",
    "time_attention",
]

_HANDLE_ATTR = "_attnpatch_handle"


@dataclass
class _Recorder:
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
        method: the registered :class:`~attnpatch.patchers.registry.Method`.
        options: complete option dict (defaults filled in).
        config: the method's config object built from ``options``.
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
        self.config = method.make_config(options)
        self.method_forward = method.forward
        self.adapter = adapter
        self.kind = kind
        self.towers = tuple(towers)  # the towers the patch routes (see patch(towers=...))
        self.tower_kinds = dict(tower_kinds or {})  # every tower of the model -> its kind
        self.state: ForwardState | None = None
        self.recorders: list[_Recorder] = []
        self._hooks: list[Any] = []
        self._undo: Any = None
        self._repr_modules: list[torch.nn.Module] = []
        self.num_layers = 0  # set by the adapter
        self.prefix_tokens = 0  # set by the adapter (CLS + registers for ViTs)
        self._depth = 0
        self._said: set[str] = set()

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

    # forward hooks: one ForwardState per top-level call (nested roots share it)
    def _pre(self, module, args, kwargs):
        self._depth += 1
        if self._depth > 1:
            return None
        rs = self.recorders
        probes = [r.probe for r in rs if r.probe is not None]
        self.state = ForwardState(
            record=any(r.stats for r in rs),
            timing=any(r.timing for r in rs),
            recall=any(r.recall for r in rs),
            teacher_forced=any(r.teacher_forced for r in rs),
            capture=any(r.capture for r in rs),
            probe=probes[-1] if probes else None,
        )
        return None

    def _post(self, module, args, kwargs, output):
        self._depth = max(0, self._depth - 1)
        if self._depth > 0:
            return None
        state, self.state = self.state, None
        if state is not None:
            for r in self.recorders:
                if r.stats and state.record:
                    r.forwards.append(state.layers)
                if r.capture:
                    r.outputs.append(state.outputs)
                if r.timing:
                    r.attention_seconds.append(state.attention_seconds)
        return None

    def install(self) -> None:
        """Apply the adapter and the per-forward hooks; routed modules and the model show the patch in ``repr``."""
        self._undo = self.adapter.apply(self)
        text = self.describe()
        for m in [self.model] + [m for m in self.model.modules() if m.__dict__.get("_attnpatch") is self]:
            if "extra_repr" not in m.__dict__:
                layer = m.__dict__.get("_attnpatch_layer")
                m.extra_repr = _PatchRepr(m, text if layer is None else f"{text}, layer={layer}")
                self._repr_modules.append(m)
        roots = getattr(self.adapter, "roots", None)
        for root in roots(self) if roots is not None else [self.model]:
            # prepended: the state exists before the adapters' own input hooks on the same module run
            self._hooks.append(root.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
            self._hooks.append(root.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def remove(self) -> None:
        """Remove the hooks and let the adapter restore the model."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for m in self._repr_modules:
            m.__dict__.pop("extra_repr", None)
        self._repr_modules.clear()
        self.adapter.restore(self, self._undo)
        self.state = None
        self._depth = 0


class _PatchRepr:
    """A patched module's ``extra_repr``: its class's own text, then the patch (picklable, unlike a closure)."""

    def __init__(self, module: torch.nn.Module, line: str):
        self.module = module
        self.line = line

    def __call__(self) -> str:
        own = type(self.module).extra_repr(self.module)
        return ", ".join(x for x in (own, self.line) if x)


def _count_pairs(key_valid: torch.Tensor | None, q_offset: int, lq: int, lk: int, b: int, h: int, causal: bool) -> torch.Tensor:
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
) -> torch.Tensor:
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
            + padding); recorded as the layer's mode ``"dense:<reason>"``.

    Returns:
        ``[B, H, Lq, D]``: the method's output, or ``exact()`` where the method declines (and
        always ``exact()`` in a teacher-forced run, after recording the method's error).

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
    timing = state is not None and state.timing
    if timing:
        _sync(q.device)
        t0 = time.perf_counter()
    if decline is None:
        out, rec = handle.method_forward(handle.config, q, k, v, ctx)
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
    elif out is None:
        out = exact()
    if timing:
        _sync(q.device)
        state.attention_seconds += time.perf_counter() - t0
    if record and rec is not None:
        if rec.causal_pairs is None:
            b, h, lq, _ = q.shape
            rec.causal_pairs = _count_pairs(key_valid, q_offset, lq, k.shape[2], b, h, causal)
            rec.kept_pairs = rec.causal_pairs.clone() if rec.kept_pairs is None else rec.kept_pairs
        state.layers[layer] = rec
    if state is not None and state.capture:
        state.outputs[layer] = out.detach()
    return out


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
        rec.causal_pairs = _count_pairs(None, keys - queries if causal else 0, queries, keys, batch, heads, causal)
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


def undo_class_swap(undo: Any) -> None:
    """Undo a class-swap adapter's ``apply``: ``undo = (swapped, hooks)`` with ``swapped`` a list of
    ``(module, original_class)``; removes the hooks, puts each original class back and drops the
    bindings (``_attnpatch``, ``_attnpatch_layer``, ``_attnpatch_tower``) set on the module."""
    swapped, hooks = undo
    for h in hooks:
        h.remove()
    for m, original in swapped:
        m.__class__ = original
        for attr in ("_attnpatch", "_attnpatch_layer", "_attnpatch_tower"):
            m.__dict__.pop(attr, None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _find_adapter(model: torch.nn.Module):
    from . import hf, open_clip_adapter, timm_adapter

    for adapter in (hf.HFAdapter, timm_adapter.TimmAdapter, open_clip_adapter.OpenClipAdapter):
        kind = adapter.detect(model)
        if kind is not None:
            return adapter, kind
    raise UnsupportedModelError(
        f"cannot patch a {type(model).__module__}.{type(model).__name__}: supported are Hugging Face "
        "transformers models whose attention dispatches through transformers.AttentionInterface "
        "(e.g. LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Dinov2Model, Dinov2WithRegistersModel, "
        "CLIPModel, CLIPVisionModel, SiglipModel), timm VisionTransformer models (timm.layers.Attention) "
        "and open_clip models with a VisionTransformer image tower"
    )


# --------------------------------------------------------------------------- towers

_KIND_NOTE = {
    "vision": " (bidirectional attention; this method is causal-only)",
    "text": (
        " (a text encoder: BERT-style bidirectional, or CLIP's / SigLIP's text transformer; the approximate methods "
        "are built for ViT image tokens (CLS + patches) and causal LM prefill, so only 'dense' fits it)"
    ),
}


def _tower_kinds(adapter, model: torch.nn.Module, kind: str) -> dict[str, str]:
    """Every tower of ``model`` and its kind, in model order (an adapter without ``towers`` has one tower)."""
    fn = getattr(adapter, "towers", None)
    if fn is not None:
        kinds = dict(fn(model))
        if kinds:
            return kinds
    return {("vision" if kind == "vision" else "text"): kind}


def _default_towers(adapter, model: torch.nn.Module, kinds: dict[str, str]) -> tuple[str, ...]:
    fn = getattr(adapter, "default_towers", None)
    if fn is not None:
        return tuple(fn(model))
    return tuple(kinds)


def _choose_towers(model: torch.nn.Module, adapter, kinds: dict[str, str], towers: Any) -> tuple[str, ...]:
    """Validate ``towers`` (``None``, ``"all"``, a name, or a sequence of names) against ``kinds``.

    Raises:
        OptionError: an empty selection, a value that is not a tower name, or a tower the model lacks.
    """
    from ..errors import OptionError

    default = _default_towers(adapter, model, kinds)
    allowed = ", ".join(map(repr, kinds))
    where = f"{type(model).__name__} has the tower(s) {allowed} (default: {', '.join(map(repr, default))}; 'all' = every tower)"
    if towers is None:
        return default
    names = [towers] if isinstance(towers, str) else towers
    try:
        names = list(names)
    except TypeError:
        raise OptionError(f"towers={towers!r}: expected a tower name or a sequence of names; {where}") from None
    if any(not isinstance(t, str) for t in names):
        raise OptionError(f"towers={towers!r}: tower names must be strings; {where}")
    if names == ["all"]:
        return tuple(kinds)
    if not names:
        raise OptionError(f"towers={towers!r}: empty; {where}")
    bad = [t for t in names if t not in kinds]
    if bad:
        raise OptionError(f"towers={towers!r}: {', '.join(map(repr, bad))} is not a tower of this model; {where}")
    return tuple(t for t in kinds if t in names)  # model order, no duplicates


def _fits(method: Method, kind: str) -> bool:
    return method.fits(kind)


def _check_features(model: torch.nn.Module, method: Method, adapter, handle: "PatchHandle") -> None:
    """Refuse a model whose routed attention uses a feature (sliding windows, soft-capping, ...) the method lacks."""
    fn = getattr(adapter, "features", None)
    lacking = method.lacks(fn(handle) if fn is not None else {})
    if lacking:
        from .registry import MODEL_FEATURES

        what = "; ".join(f"{MODEL_FEATURES.get(f, f)}: {d}" for f, d in lacking.items())
        supported = ", ".join(MODEL_FEATURES[f] for f in sorted(method.supports)) or "none of the checked model features"
        raise UnsupportedModelError(
            f"{type(model).__name__} uses {what}. Method {method.name!r} does not implement this, so its output would "
            f"differ from the model's (it supports: {supported}); use method 'dense' (the model's own attention), "
            "or a model without it"
        )


def patch(model: torch.nn.Module, method: str = "anchor_attention", *, towers: Any = None, **options: Any) -> torch.nn.Module:
    """Replace ``model``'s attention with ``method``, in place.

    Args:
        model: a supported model (see :func:`attnpatch.list_methods` for methods and the model kinds each fits).
        method: a registered method name, e.g. ``"anchor_attention"`` or ``"dense"``.
        towers: which towers of a multi-tower model to route (keyword only): a tower name, a
            sequence of names, ``"all"``, or ``None`` for the adapter's default. Dual-tower
            models (Hugging Face ``CLIPModel`` / ``SiglipModel``, open_clip ``CLIP``) have the
            towers ``"vision"`` and ``"text"`` and route ``("vision",)`` by default, so the text
            tower stays exactly as it was; single-tower models have one tower (``"vision"`` for
            ViTs, ``"text"`` for causal LMs and text encoders), routed by default. Each routed
            tower must fit the method: ``"vision"`` towers are of kind ``"vision"``, causal LM
            towers ``"causal_lm"``, and CLIP/SigLIP text towers ``"text"``, which only ``dense`` fits.
        **options: the method's options; unknown names, wrong types and out-of-range values are refused.

    Returns:
        The same ``model`` object, patched.

    Raises:
        UnknownMethodError: ``method`` is not registered.
        OptionError: an option is unknown, of the wrong type or out of range; ``towers`` names no
            tower of this model (the message lists the model's towers).
        UnsupportedModelError: no adapter handles this model class, or the method does not fit
            the model or one of the chosen towers (e.g. a causal-only method on a bidirectional
            vision encoder, or ``fna`` on CLIP's causal text tower).
        PatchStateError: ``model`` is already patched (call :func:`unpatch` first).
    """
    m = get_method(method)
    full = validate_options(m, options)
    if getattr(model, _HANDLE_ATTR, None) is not None:
        cur = getattr(model, _HANDLE_ATTR)
        raise PatchStateError(
            f"{type(model).__name__} is already patched with {cur.method.name!r}; call attnpatch.unpatch(model) first"
        )
    adapter, kind = _find_adapter(model)
    kinds = _tower_kinds(adapter, model, kind)
    chosen = _choose_towers(model, adapter, kinds, towers)
    if len(kinds) == 1:
        (only,) = kinds.values()
        if not _fits(m, only):
            raise UnsupportedModelError(
                f"method {m.name!r} fits model kinds {sorted(m.model_kinds)}, but {type(model).__name__} is a {only!r} model"
                + _KIND_NOTE.get(only, "")
            )
        kind = only
    else:
        for t in chosen:
            if not _fits(m, kinds[t]):
                fitting = [n for n in kinds if _fits(m, kinds[n])]
                raise UnsupportedModelError(
                    f"method {m.name!r} does not fit the {t!r} tower of {type(model).__name__}: that tower is a "
                    f"{kinds[t]!r} tower{_KIND_NOTE.get(kinds[t], '')}, and {m.name!r} fits kinds {sorted(m.model_kinds)}. "
                    + (f"Route only {', '.join(map(repr, fitting))} (towers={tuple(fitting)!r})" if fitting else "No tower of this model fits it")
                    + f"; the default is towers={_default_towers(adapter, model, kinds)!r}"
                )
        kind = "+".join(dict.fromkeys(kinds[t] for t in chosen))
    handle = PatchHandle(model, m, full, adapter, kind, towers=chosen, tower_kinds=kinds)
    adapter.check(handle)
    _check_features(model, m, adapter, handle)
    if m.check is not None:
        m.check(handle.config, adapter.layer_count(handle))
    handle.install()
    object.__setattr__(model, _HANDLE_ATTR, handle)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: the model computes exactly what it computed before (bit for bit).

    Raises:
        PatchStateError: ``model`` is not patched.
    """
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is None:
        raise PatchStateError(f"{type(model).__name__} is not patched; nothing to unpatch")
    handle.remove()
    object.__delattr__(model, _HANDLE_ATTR)
    return model


@contextlib.contextmanager
def patched(model: torch.nn.Module, method: str = "anchor_attention", *, towers: Any = None, **options: Any) -> Iterator[torch.nn.Module]:
    """Context-manager form of :func:`patch` (same arguments, ``towers`` included): patched inside
    the ``with`` block, restored on exit (also on error).

    Raises:
        The errors of :func:`patch`.
    """
    patch(model, method, towers=towers, **options)
    try:
        yield model
    finally:
        if is_patched(model):  # the block may have unpatched it already; do not mask its own error
            unpatch(model)


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` is currently patched."""
    return getattr(model, _HANDLE_ATTR, None) is not None


def handle_of(model: torch.nn.Module) -> PatchHandle:
    """The :class:`PatchHandle` of a patched model.

    Raises:
        PatchStateError: ``model`` is not patched.
    """
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is None:
        raise PatchStateError(f"{type(model).__name__} is not patched")
    return handle


def patch_info(model: torch.nn.Module) -> dict[str, Any] | None:
    """``{"method", "options", "kind", "layers", "towers"}`` of a patched model, or ``None`` if not patched."""
    handle = getattr(model, _HANDLE_ATTR, None)
    if handle is None:
        return None
    return {
        "method": handle.method.name,
        "options": dict(handle.options),
        "kind": handle.kind,
        "layers": handle.adapter.layer_count(handle),
        "towers": list(handle.towers),
    }


@contextlib.contextmanager
def record_stats(
    model: torch.nn.Module,
    recall: bool = False,
    *,
    teacher_forced: bool = False,
    capture: bool = False,
    probe: Callable[..., None] | None = None,
) -> Iterator[_Recorder]:
    """Record per-layer statistics of every forward call made inside the block.

    Args:
        model: a patched model.
        recall: also measure attention recall in sparse layers (one extra dense ``Q K^T`` pass per layer).
        teacher_forced: every patched layer also computes exact attention on its inputs, records
            ``rel_error`` (relative Frobenius error of the method's output) and passes the exact
            output on, so each layer's error is measured with exact inputs.
        capture: keep every layer's attention output ``[B, H, N, D]`` (in ``outputs``; memory:
            one activation per layer).
        probe: called as ``probe(ctx, q, k, v)`` at every routed layer (diagnostics).

    Yields:
        A recorder whose ``forwards`` list gets, per top-level forward call (prefill and each
        decoding step of ``generate``), a dict ``{layer_index: LayerRecord}`` (and, with
        ``capture``, ``outputs`` a dict ``{layer_index: tensor}`` per call).

    Raises:
        PatchStateError: ``model`` is not patched.
    """
    handle = handle_of(model)
    rec = _Recorder(recall=recall, teacher_forced=teacher_forced, capture=capture, probe=probe)
    handle.recorders.append(rec)
    try:
        yield rec
    finally:
        handle.recorders.remove(rec)


@contextlib.contextmanager
def time_attention(model: torch.nn.Module) -> Iterator[_Recorder]:
    """Measure the wall time spent in the patched attention calls of every forward made inside the block.

    Times the method's forward plus the model's own exact attention wherever the method
    declines (decode steps, layers before FNA's sample layer, ...), i.e. everything that
    replaces the model's attention function, with a CUDA synchronisation before and after
    each call on GPU.  No per-layer statistics are recorded.

    Yields:
        A recorder whose ``attention_seconds`` list gets one float (seconds) per top-level forward call.

    Raises:
        PatchStateError: ``model`` is not patched.
    """
    handle = handle_of(model)
    rec = _Recorder(recall=False, stats=False, timing=True)
    handle.recorders.append(rec)
    try:
        yield rec
    finally:
        handle.recorders.remove(rec)
