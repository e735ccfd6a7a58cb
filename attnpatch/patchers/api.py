"""The public API: ``patch`` / ``unpatch`` / ``patched``, ``record_stats``, ``time_attention`` and friends.

:func:`patch` finds the model's adapter in :data:`~attnpatch.patchers.adapters.ADAPTERS`, checks
the method against the model (model kinds of the routed towers, model features, the method's own
option checks against the :class:`~attnpatch.patchers.contract.ModelGeometry`) and installs a
:class:`~attnpatch.patchers.runtime.PatchHandle`.  Layering: this module sits on top; the
adapters, the runtime and the methods never import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

from ..errors import OptionError, PatchStateError, UnsupportedModelError
from .adapter import KIND_NOTE, Adapter, choose_towers, routed_kind, tower_kinds, tower_methods
from .adapters import detect, supported_text
from .config_file import check_config_geometry
from .contract import MODEL_FEATURES, Method, ModelGeometry
from .registry import get_method, resolve_options
from .runtime import PatchHandle, Recorder, handle_on, handles_on
from .state import GROUP_ATTR, ForwardState, LayerRecord, PatchGroup

__all__ = [
    "PatchHandle",
    "ForwardState",
    "LayerRecord",
    "patch",
    "unpatch",
    "model_geometry",
    "patched",
    "is_patched",
    "handle_of",
    "patch_info",
    "token_sizes",
    "token_source",
    "record_stats",
    "time_attention",
    "find_adapter",
    "prefix_tokens",
]

def find_adapter(model: torch.nn.Module) -> tuple[Adapter, str]:
    """``(adapter, kind)``: the first adapter of :data:`~attnpatch.patchers.adapters.ADAPTERS` that handles ``model``.

    Raises:
        UnsupportedModelError: no adapter handles it; the message lists what each adapter supports.
    """
    found = detect(model)
    if found is None:
        raise UnsupportedModelError(
            f"cannot patch a {type(model).__module__}.{type(model).__name__}: supported are {supported_text()}"
        )
    return found


def prefix_tokens(model: torch.nn.Module, kind: str | None = None) -> int:
    """Leading special tokens (CLS + registers) of ``model``'s tower of kind ``kind`` (default: the
    kind its adapter detects), as the adapters give them to the methods; 0 for causal LMs.

    Raises:
        UnsupportedModelError: no adapter handles the model.
    """
    adapter, detected = find_adapter(model)
    return int(adapter.prefix_tokens(model, kind or detected))


def _check_features(model: torch.nn.Module, method: Method, adapter: Adapter, handle: PatchHandle) -> None:
    """Refuse a model whose routed attention uses a feature (sliding windows, soft-capping, ...) the method lacks."""
    lacking = method.lacks(adapter.features(handle))
    if lacking:
        what = "; ".join(f"{MODEL_FEATURES.get(f, f)}: {d}" for f, d in lacking.items())
        from .registry import METHODS

        able = [n for n, x in METHODS.items() if not x.exact and x.fits(handle.kind.split("+")[0]) and not x.lacks(lacking)]
        instead = f"methods that implement it: {', '.join(able)}, or 'dense'" if able else "use method 'dense'"
        raise UnsupportedModelError(
            f"{type(model).__name__} uses {what}. Method {method.name!r} does not implement this, so its output would "
            f"differ from the model's; {instead} (the model's own attention)"
        )


def patch(model: torch.nn.Module, method: Any = "anchor_attention", *, towers: Any = None, **options: Any) -> torch.nn.Module:
    """Replace ``model``'s attention with ``method``, in place; one method per tower by calling it once per tower.

    Args:
        model: a supported model (see :func:`attnpatch.list_methods` for methods and the model kinds each fits).
        method: a registered method name, e.g. ``"anchor_attention"`` or ``"dense"``; or a mapping tower -> method
            (``{"vision": "fna", "text": ("anchor_attention", {"preset": "accurate"})}``: a name, or ``(name,
            options)``) that patches each tower with its method in one call (all or none: a refusal of one tower
            leaves the model as it was); ``towers`` and ``**options`` are not taken beside a mapping.
        towers: which towers of a multi-tower model to route (keyword only): a tower name, a
            sequence of names, ``"all"``, or ``None`` for the adapter's default. Dual-tower
            models (Hugging Face ``CLIPModel`` / ``SiglipModel``, open_clip ``CLIP``) have the
            towers ``"vision"`` and ``"text"`` and route ``("vision",)`` by default, so the text
            tower stays exactly as it was; single-tower models have one tower (``"vision"`` for
            ViTs, ``"text"`` for causal LMs and text encoders), routed by default. Each routed
            tower must fit the method: ``"vision"`` towers are of kind ``"vision"``, causal LM
            towers ``"causal_lm"``, and CLIP/SigLIP text towers ``"text"``, which only ``dense`` fits.
        **options: the method's options; unknown names, wrong types and out-of-range values are refused.
            ``preset=NAME`` starts from one of the method's named option sets (``attnpatch methods``);
            ``config=PATH`` from a saved JSON config (:func:`attnpatch.patchers.registry.write_config`),
            refused when it records another model's layers or heads; options given beside them win.

    Returns:
        The same ``model`` object, patched.

    Raises:
        UnknownMethodError: ``method`` is not registered.
        OptionError: an option is unknown, of the wrong type or out of range; ``towers`` names no
            tower of this model (the message lists the model's towers).
        UnsupportedModelError: no adapter handles this model class, or the method does not fit
            the model or one of the chosen towers (e.g. a causal-only method on a bidirectional
            vision encoder, or ``fna`` on CLIP's causal text tower).
        PatchStateError: a chosen tower is already patched (the message names the tower and its method; a model
            patched on its vision tower takes another patch on its text tower, and the reverse).
    """
    if isinstance(method, Mapping):
        return _patch_towers(model, method, towers, options)
    if not isinstance(method, str):
        raise OptionError(f"method={method!r}: give a method name (attnpatch methods lists them) or a tower -> method "
                          "mapping such as {'vision': 'fna', 'text': 'anchor_attention'}")
    m = get_method(method)
    full, saved = resolve_options(m, options)  # a config file is read here, once
    adapter, kind = find_adapter(model)
    kinds = tower_kinds(adapter, model, kind)
    chosen = choose_towers(model, adapter, kinds, towers)
    taken = {t: h for h in handles_on(model) for t in h.towers}
    clash = [t for t in chosen if t in taken]
    if clash:
        t = clash[0]
        raise PatchStateError(
            f"{type(model).__name__}: its {t!r} tower is already patched with {taken[t].method.name!r}; call "
            f"attnpatch.unpatch(model, towers={t!r}) first (attnpatch.unpatch(model) restores every tower)"
        )
    if len(kinds) == 1:
        (only,) = kinds.values()
        if not m.fits(only):
            raise UnsupportedModelError(
                f"method {m.name!r} fits model kinds {sorted(m.model_kinds)}, but {type(model).__name__} is a {only!r} model"
                + KIND_NOTE.get(only, "")
            )
    else:
        for t in chosen:
            if not m.fits(kinds[t]):
                fitting = [n for n in kinds if m.fits(kinds[n])]
                raise UnsupportedModelError(
                    f"method {m.name!r} does not fit the {t!r} tower of {type(model).__name__}: that tower is a "
                    f"{kinds[t]!r} tower{KIND_NOTE.get(kinds[t], '')}, and {m.name!r} fits kinds {sorted(m.model_kinds)}. "
                    + (f"Route only {', '.join(map(repr, fitting))} (towers={tuple(fitting)!r})" if fitting else "No tower of this model fits it")
                    + f"; the default is towers={tuple(adapter.default_towers(model))!r}"
                )
    kind = routed_kind(kinds, chosen)
    handle = PatchHandle(model, m, full, adapter, kind, towers=chosen, tower_kinds=kinds)
    adapter.check(handle)
    _check_features(model, m, adapter, handle)
    geometry = adapter.geometry(model, chosen, kind)
    if full.get("config") is not None:
        check_config_geometry(full["config"], geometry, type(model).__name__, data=saved)
    if m.check is not None:
        try:
            m.check(handle.config, geometry)
        except OptionError as e:
            if full.get("config") is None:
                raise
            raise OptionError(f"config={full['config']!r}: {e}") from None
    if m.prepare is not None:
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        if param is not None:
            try:
                m.prepare(handle.config, geometry, param.device, param.dtype)
            except OptionError as e:  # an option the model's device or dtype cannot run: say which model
                raise OptionError(f"{type(model).__name__} ({param.dtype} on {param.device.type}): {e}") from None
    handle.install()
    group = getattr(model, GROUP_ATTR, None)
    if group is None:
        group = PatchGroup(model)
        object.__setattr__(model, GROUP_ATTR, group)
    group.add(handle, list(kinds))
    return model


def _patch_towers(model: torch.nn.Module, methods: Any, towers: Any, options: dict[str, Any]) -> torch.nn.Module:
    """``patch(model, {tower: method or (method, options)})``: each tower its method, all or none."""
    if towers is not None or options or not methods:
        raise OptionError(f"patch(model, {methods!r}, ...): a non-empty tower -> method mapping carries each tower's "
                          "options ({'vision': ('fna', {'s': 32})}); towers= and options beside it are not taken")
    adapter, kind = find_adapter(model)
    plan = tower_methods(model, tower_kinds(adapter, model, kind), methods)
    done: list[str] = []
    try:
        for tower, name, opts in plan:
            patch(model, name, towers=tower, **opts)
            done.append(tower)
    except Exception:
        if done:
            unpatch(model, towers=done)
        raise
    return model


def model_geometry(model: torch.nn.Module, *, towers: Any = None) -> ModelGeometry:
    """The geometry of the attention a patch routes: layers, heads, KV heads, head size (what a saved config records).

    Of ``model``'s own patch when it is patched (its routed towers; ``towers`` is not used then; a model patched
    per tower with several patches: of ``towers``, which must be given), else of the
    towers ``patch(model, ..., towers=towers)`` would route, read by the model's adapter from the model
    itself: nothing is patched, the model is left as it is.

    Raises:
        UnsupportedModelError: no adapter handles this model class, or its adapter refuses the model (as
            :func:`patch` would, e.g. an open_clip image tower that is not a ViT).
        OptionError: ``towers`` names no tower of this model.
        PatchStateError: ``towers`` not given for a model patched per tower with several patches.
    """
    hs = handles_on(model)
    if len(hs) == 1 or (hs and towers is None):
        handle = handle_on(model)  # several patches and no towers: refused, naming them
        return handle.adapter.geometry(handle.model, handle.towers, handle.kind)
    adapter, kind = find_adapter(model)
    kinds = tower_kinds(adapter, model, kind)
    chosen = choose_towers(model, adapter, kinds, towers)
    kind = routed_kind(kinds, chosen)
    # the adapter's refusals of the model, as patch(model, "dense") gives them; the handle is never installed
    adapter.check(PatchHandle(model, get_method("dense"), {}, adapter, kind, towers=chosen, tower_kinds=kinds))
    return adapter.geometry(model, chosen, kind)


def unpatch(model: torch.nn.Module, *, towers: Any = None) -> torch.nn.Module:
    """Undo :func:`patch`: the model computes exactly what it computed before (bit for bit).

    Args:
        towers: ``None`` or ``"all"`` (every patch of the model), or the towers whose patches to undo (a name or a
            sequence); the other towers stay patched.  Towers patched in one call (``towers="all"``) are undone together.

    Raises:
        PatchStateError: ``model`` is not patched, or a named tower is not patched (or not a tower of the model).
        OptionError: ``towers`` is not a name or a non-empty sequence of names; a named tower shares its patch with a tower not named (they were patched in one call: undo them
            together).
    """
    hs = handles_on(model)
    if not hs:
        raise PatchStateError(f"{type(model).__name__} is not patched; nothing to unpatch")
    if towers is None:
        chosen = hs
    else:
        routed = {t: h for h in hs for t in h.towers}
        every = dict(hs[0].tower_kinds) or routed
        where = f"patched towers: {', '.join(map(repr, routed))} (towers=None or 'all': every one)"
        if isinstance(towers, str):
            names = list(routed) if towers == "all" else [towers]
        elif isinstance(towers, (list, tuple, set, frozenset)) and all(isinstance(t, str) for t in towers) and towers:
            names = list(towers)
        else:
            raise OptionError(f"unpatch(towers={towers!r}): give a tower name or a non-empty sequence of names; {where}")
        for t in names:
            if t not in routed:
                what = "is not patched" if t in every else f"is not a tower of this model (its towers: {', '.join(map(repr, every))})"
                raise PatchStateError(f"{type(model).__name__}: tower {t!r} {what}; {where}")
        chosen = [h for h in hs if any(t in names for t in h.towers)]
        for h in chosen:
            left = [t for t in h.towers if t not in names]
            if left:
                raise OptionError(
                    f"{type(model).__name__}: towers {h.towers!r} were patched together with {h.method.name!r}; unpatch "
                    f"them together (towers={h.towers!r}), not without {', '.join(map(repr, left))}"
                )
    group = getattr(model, GROUP_ATTR)
    for h in reversed(chosen):
        h.remove()
        group.discard(h)
    if not group.handles:
        object.__delattr__(model, GROUP_ATTR)
    return model


@contextlib.contextmanager
def patched(model: torch.nn.Module, method: Any = "anchor_attention", *, towers: Any = None, **options: Any) -> Iterator[torch.nn.Module]:
    """Context-manager form of :func:`patch` (same arguments, ``towers`` and a tower -> method mapping included):
    patched inside the ``with`` block; on exit (also on error) the towers it patched are restored, and a patch
    made before it on other towers stays.

    Raises:
        The errors of :func:`patch`.
    """
    before = {id(h) for h in handles_on(model)}
    patch(model, method, towers=towers, **options)
    mine = [t for h in handles_on(model) if id(h) not in before for t in h.towers]
    try:
        yield model
    finally:
        # the block may have unpatched them already; do not mask its own error
        left = [t for t in mine if handle_on(model, t) is not None]
        if left:
            unpatch(model, towers=left)


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``model`` is currently patched (any tower)."""
    return bool(handles_on(model))


def handle_of(model: torch.nn.Module, tower: str | None = None) -> PatchHandle:
    """The :class:`PatchHandle` of a patched model (``tower``: the one routing that tower).

    Raises:
        PatchStateError: ``model`` is not patched (or ``tower`` is not), or it is patched per tower with several
            patches and ``tower`` is not given.
    """
    handle = handle_on(model, tower)
    if handle is None:
        raise PatchStateError(f"{type(model).__name__} is not patched" + (f" on its {tower!r} tower" if tower else ""))
    return handle


def patch_info(model: torch.nn.Module) -> dict[str, Any] | None:
    """What a patched model runs, or ``None`` if it is not patched.

    Returns:
        ``{"method", "options", "kind", "layers", "towers", "per_tower"}``: ``towers`` every routed tower (model
        order), ``layers`` the attention modules routed, and ``per_tower`` ``{tower: {"method", "options", "kind"}}``.
        With one patch (one method, on one tower or several), ``method`` / ``options`` / ``kind`` are that patch's,
        as they always were.  With several patches (one method per tower), ``method`` and ``options`` are ``None``
        (read ``per_tower``), ``kind`` joins the towers' kinds with ``+`` in model order, and ``layers`` counts every
        patch's modules.
    """
    hs = handles_on(model)
    if not hs:
        return None
    per = {t: {"method": h.method.name, "options": dict(h.options), "kind": h.tower_kinds.get(t, h.kind)}
           for h in hs for t in h.towers}
    if len(hs) == 1:
        (h,) = hs
        return {"method": h.method.name, "options": dict(h.options), "kind": h.kind, "layers": h.adapter.layer_count(h),
                "towers": list(h.towers), "per_tower": per}
    return {"method": None, "options": None, "kind": "+".join(dict.fromkeys(v["kind"] for v in per.values())),
            "layers": sum(h.adapter.layer_count(h) for h in hs), "towers": list(per), "per_tower": per}


def _merging(model: torch.nn.Module) -> PatchHandle:
    """The patch whose tokens a merge changes: the model's one patch, or among several the one with a block hook."""
    hs = handles_on(model)
    if not hs:
        raise PatchStateError(f"{type(model).__name__} is not patched")
    return next((h for h in hs if h.method.block_hook is not None), hs[0])


def token_sizes(model: torch.nn.Module) -> torch.Tensor | None:
    """Sizes of the output tokens of the last forward call through the routed towers of a model patched
    with a method that merges tokens (``tome``): ``[B, N']`` float, the input tokens each output token
    stands for (the prefix tokens count 1), in the order of the tower's output tokens; ``None`` when that
    forward merged nothing (any other method, ``r = 0``) or none has run.  A call of a tower the patch
    does not route (a CLIP text tower) leaves it as it was.

    A mean over the output tokens that should equal the mean over the input tokens weighs each token
    by its size: ``(h * s[..., None]).sum(1) / s.sum(1, keepdim=True)``.

    Raises:
        PatchStateError: ``model`` is not patched.
    """
    return _merging(model).last_token_sizes


def token_source(model: torch.nn.Module) -> torch.Tensor | None:
    """The source map of the last forward call through the routed towers of a model patched with a method that
    merges tokens (``tome``): ``[B, N0]`` int64, for each input token (prefix tokens included) the position of the
    output token it was merged into; ``None`` when that forward merged nothing or none has run.

    ToMe (arXiv 2210.09461) traces sources as a ``[B, N', N0]`` one-hot matrix (``trace_source``); every input
    token joins exactly one output token, so this index says the same.  One output per input patch, as a dense
    task needs (tomesd's unmerge), is ``out.gather(1, source[..., None].expand(-1, -1, out.shape[-1]))``
    (:func:`attnpatch.attention.merge.unmerge`); the model's own output keeps its merged tokens.

    Raises:
        PatchStateError: ``model`` is not patched.
    """
    return _merging(model).last_token_source


@contextlib.contextmanager
def record_stats(
    model: torch.nn.Module,
    recall: bool = False,
    *,
    teacher_forced: bool = False,
    capture: bool = False,
    probe: Callable[..., None] | None = None,
) -> Iterator[Recorder]:
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
        decoding step of ``generate``), a dict ``{layer_index: LayerRecord}`` (a model patched per tower: every
        patch's layers, indexed across the patched towers in model order) (and, with
        ``capture``, ``outputs`` a dict ``{layer_index: tensor}`` per call).

    Raises:
        PatchStateError: ``model`` is not patched.
    """
    group = _group_of(model)
    rec = Recorder(recall=recall, teacher_forced=teacher_forced, capture=capture, probe=probe)
    group.recorders.append(rec)
    try:
        yield rec
    finally:
        group.recorders.remove(rec)


@contextlib.contextmanager
def time_attention(model: torch.nn.Module) -> Iterator[Recorder]:
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
    group = _group_of(model)
    rec = Recorder(recall=False, stats=False, timing=True)
    group.recorders.append(rec)
    try:
        yield rec
    finally:
        group.recorders.remove(rec)


def _group_of(model: torch.nn.Module) -> PatchGroup:
    group = getattr(model, GROUP_ATTR, None)
    if group is None:
        raise PatchStateError(f"{type(model).__name__} is not patched")
    return group
