"""The attention function the Hugging Face adapter registers in ``transformers.AttentionInterface``.

``transformers`` calls :func:`attention_forward` (registered as ``"attnpatch"``, :data:`ATTN_NAME`) from
every attention module of a patched model with ``q, k, v`` ``[B, H, L, D]`` and the 4-D mask it built.
The function reads the module's :class:`~attnpatch.patchers.runtime.PatchHandle` (bound by
:class:`~attnpatch.patchers.adapters.hf.adapter.HFAdapter`), turns the mask into the call's layout (query
offset, key padding, causal or not), refuses model features the method lacks and runs
:func:`~attnpatch.patchers.runtime.run_layer`, with the model's own implementation (eager or SDPA)
as the exact fallback.  Part of the Hugging Face adapter: the patch side (towers, modules, blocks,
apply / restore) is :mod:`.adapter`.
"""

from __future__ import annotations

from typing import Any

import torch

from ....errors import UnsupportedModelError
from ...runtime import PatchHandle, run_layer

__all__ = ["ATTN_NAME", "register_attention", "attention_forward", "remember_eager_config", "forget_eager_config"]

#: The name of the attention implementation (and of its mask builder) the patch registers and switches models to.
ATTN_NAME = "attnpatch"


# configs of patched models whose own implementation is eager -> that config (the masks they get
# are eager's additive float masks, so that ``dense`` passes the model's own mask on unchanged);
# entries live from patch to unpatch only (remember_eager_config / forget_eager_config)
_EAGER_CONFIGS: dict[int, Any] = {}


def remember_eager_config(cfg: Any) -> None:
    """Give the models of config ``cfg`` (whose own implementation is ``"eager"``) eager's additive float
    masks while patched (the ``"attnpatch"`` mask builder asks); undone by :func:`forget_eager_config`."""
    _EAGER_CONFIGS[id(cfg)] = cfg


def forget_eager_config(cfg: Any) -> None:
    """Undo :func:`remember_eager_config` (nothing happens for a config not remembered)."""
    _EAGER_CONFIGS.pop(id(cfg), None)


def _mask(**kwargs):
    """The ``"attnpatch"`` mask builder: the one of the model's own implementation (eager's additive
    float mask for models whose own implementation is eager, SDPA's bool mask otherwise)."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    cfg = kwargs.get("config")
    if cfg is not None and _EAGER_CONFIGS.get(id(cfg)) is cfg:
        return eager_mask(**kwargs)
    return sdpa_mask(**kwargs)


def register_attention() -> None:
    """Register the ``"attnpatch"`` attention function in ``transformers.AttentionInterface`` and its mask
    builder in ``AttentionMaskInterface`` (idempotent; the registration carries no state)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if ALL_MASK_ATTENTION_FUNCTIONS.get(ATTN_NAME) is not _mask:
        AttentionMaskInterface.register(ATTN_NAME, _mask)
    AttentionInterface.register(ATTN_NAME, attention_forward)


def _key_layout(attention_mask: torch.Tensor | None, lq: int, lk: int) -> tuple[int, torch.Tensor | None]:
    """``(q_offset, key_valid [B, Lk] or None)`` from the 4D mask HF passes (bool, or additive float).

    A ``None`` mask means what it means to ``sdpa_attention_forward``: one query sees every key
    (a decoding step); several queries are causal from key 0 (``is_causal`` is top-left aligned,
    which is also right for a static cache whose key length exceeds the prompt).
    """
    if attention_mask is None:
        return (lk - 1 if lq == 1 else 0), None
    last = attention_mask[:, 0, -1, :]
    if last.dtype != torch.bool:
        last = last > torch.finfo(last.dtype).min / 2
    last = last[:, :lk]
    seen = last.any(0)
    if not bool(seen.any()):
        return lk - lq, last
    last_pos = int(torch.nonzero(seen).max())
    # keys after the last one any query sees are an unused cache tail (static cache) or right
    # padding: the first query sits at last_pos + 1 - lq, never before key 0
    return max(0, last_pos + 1 - lq), last


def _allowed(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """A 4-D mask as bool "may attend" (an additive float mask: entries above half the dtype's
    minimum), or ``None`` when an additive mask also biases some logits (a finite non-zero entry:
    relative position bias, ALiBi, a user's recency bias), which no method represents."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    if bool((allowed & (attention_mask != 0)).any()):
        return None
    return allowed


def _mask_is_layout(attention_mask: torch.Tensor, lq: int, lk: int, q_offset: int, key_valid: torch.Tensor, causal: bool) -> bool:
    """Whether the 4-D mask is exactly what ``(q_offset, key_valid, causal)`` describes.

    The methods see a call only as causal (or bidirectional) attention over the valid keys; any
    other mask (packed documents, sliding windows, bidirectional image spans, per-head masks) is
    not representable. A query row with no valid key (a padding query) may be fully masked or fully
    open. Checked in query chunks (no second ``[B, Lq, Lk]`` buffer at long prompts).
    """
    b = attention_mask.shape[0]
    valid = key_valid[:, None, None, :]  # [B, 1, 1, Lk]
    cols = torch.arange(lk, device=attention_mask.device)
    for i in range(0, lq, 1024):
        rows = torch.arange(i, min(lq, i + 1024), device=attention_mask.device)
        got = _allowed(attention_mask[:, :, i : i + 1024, :lk])
        if got is None:
            return False
        want = valid.expand(b, 1, len(rows), lk)
        if causal:
            want = want & (cols[None, :] <= (q_offset + rows)[:, None])[None, None]
        # a row with no valid key (a padding query) may come fully masked or fully open (some
        # versions unmask such rows for SDPA); any other row must match exactly
        empty = ~want.any(-1, keepdim=True)
        ok = (got == want).all(-1, keepdim=True) | (empty & (got.all(-1, keepdim=True) | ~got.any(-1, keepdim=True)))
        if not bool(ok.all()):
            return False
    return True


def _mask_checked(handle: PatchHandle, attention_mask, lq: int, lk: int, q_offset: int, key_valid, causal: bool) -> bool:
    """:func:`_mask_is_layout`, once per mask tensor and forward call (the layers share the model's mask)."""
    state = handle.state
    key = (attention_mask.data_ptr(), tuple(attention_mask.shape), lq, lk, q_offset, causal)
    cache = state.shared.setdefault("_mask_layout", {}) if state is not None else {}
    if key not in cache:
        cache[key] = _mask_is_layout(attention_mask, lq, lk, q_offset, key_valid, causal)
    return cache[key]


def _eager_mask(attention_mask: torch.Tensor | None, lq: int, lk: int, causal: bool, dtype: torch.dtype, device) -> torch.Tensor | None:
    """The additive float mask ``transformers``' eager implementation gets (``masking_utils.eager_mask``:
    0 where attending, the dtype's minimum elsewhere) from the bool mask built for the patch
    (``sdpa_mask``, which may skip a plain causal mask: ``None`` with several queries means causal)."""
    if attention_mask is None:
        if not causal or lq == 1:
            return None
        attention_mask = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)[None, None]
    if attention_mask.dtype != torch.bool:
        return attention_mask
    return torch.where(attention_mask, torch.zeros((), device=attention_mask.device, dtype=dtype), torch.finfo(dtype).min)


def _original_attention(module, original: str | None):
    """``(function, mask_kind)`` of the model's own attention implementation ``original``: the
    module's ``eager_attention_forward`` for ``"eager"`` (with the additive float mask eager gets),
    and ``transformers``' SDPA function otherwise (the bool mask built for the patch). Both are the
    unpatched model's computation bit for bit; other implementations (flash, flex: their masks
    have other formats) run as SDPA, the same attention up to rounding."""
    import sys

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if original == "eager" or original is None:
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is not None:
            return fn, "eager"
    return sdpa_attention_forward, "bool"


def _attention_collector() -> list | None:
    """The list the current ``transformers`` forward collects attention weights in (``output_attentions=True``), one
    entry per layer, or ``None`` when it collects none."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - older transformers
        return None
    try:
        collected = _active_collector.get()
    except LookupError:
        return None
    return collected.get("attentions") if isinstance(collected, dict) else None


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The ``"attnpatch"`` attention function (``transformers.AttentionInterface`` calling convention).

    Args:
        module: the calling attention module (bound to a patch by the adapter, else SDPA runs).
        query: ``[B, H, Lq, D]``; key, value: ``[B, Hkv, Lk, D]``.
        attention_mask: the 4-D mask the ``"attnpatch"`` mask builder made (bool, or eager's additive float), or ``None``.
        dropout: attention dropout probability; scaling: the logit scale (``None``: ``D ** -0.5``).

    Returns:
        ``(out [B, Lq, H, D] contiguous, attention weights or None)``, as ``transformers`` expects.  With
        ``output_attentions=True`` on a model whose own implementation is eager, a layer the method approximates
        (no weights) adds ``None`` to the attentions transformers collects, so the tuple keeps one entry per layer.

    Raises:
        UnsupportedModelError: an approximate method called with a sliding window, soft-capping,
            learned sink logits or a value head size other than the query's.
        InferenceOnlyError: see :func:`~attnpatch.patchers.runtime.run_layer`.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    handle: PatchHandle | None = getattr(module, "_attnpatch", None)
    if handle is None:  # a module of a model that is not patched (cannot happen through patch())
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    lq, lk, d = query.shape[2], key.shape[2], query.shape[3]
    scale = scaling if scaling is not None else d**-0.5
    q_offset, key_valid = _key_layout(attention_mask, lq, lk)
    # CLIP's text attention modules say is_causal=False but are called with is_causal=True and a causal mask
    causal = bool(getattr(module, "is_causal", True)) or bool(kwargs.get("is_causal", False))
    fn, mask_kind = _original_attention(module, getattr(module, "_attnpatch_original", None))
    weights: list[Any] = [None]

    def exact() -> torch.Tensor:
        mask = attention_mask
        if mask_kind == "eager" and (mask is None or mask.dtype == torch.bool) and not module.__dict__.get("_attnpatch_eager_mask"):
            mask = _eager_mask(attention_mask, lq, lk, causal, query.dtype, query.device)  # a mask built for SDPA
        out, w = fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
        weights[0] = w
        return out.transpose(1, 2)

    decline = None
    if not handle.method.exact:
        found = {n: kwargs.get(n) for n in ("sliding_window", "softcap") if kwargs.get(n) is not None}
        if kwargs.get("s_aux") is not None:
            found["s_aux"] = "learned attention-sink logits"
        if value.shape[-1] != query.shape[-1]:
            found["value head size"] = f"{value.shape[-1]} (query/key head size {query.shape[-1]})"
        if found:  # patch() refuses such models; a model that sets them only at call time is refused here
            raise UnsupportedModelError(
                f"{type(handle.model).__name__} layer {module._attnpatch_layer} is called with "
                + ", ".join(f"{n}={v}" for n, v in found.items())
                + f", which method {handle.method.name!r} does not implement; use method 'dense'"
            )
        if attention_mask is not None and not _mask_checked(handle, attention_mask, lq, lk, q_offset, key_valid, causal):
            decline = "mask"
            handle.say(
                f"{type(handle.model).__name__} was called with an attention mask that is not "
                f"{'causal' if causal else 'bidirectional'} attention over the non-padding keys (e.g. packed documents, "
                f"a custom 4-D mask); method {handle.method.name!r} cannot represent it, so such calls run the model's "
                "own attention (recorded as mode 'dense:mask')"
            )
    out = run_layer(
        handle, module._attnpatch_layer, query, key, value, scale=scale, exact=exact, q_offset=q_offset,
        key_valid=key_valid, causal=causal, dropout=float(dropout or 0.0), decline=decline,
    )
    collected = _attention_collector() if weights[0] is None and not handle.method.exact else None
    if collected is not None:
        handle.say(
            f"output_attentions=True: method {handle.method.name!r} forms no attention matrix, so the patched layers "
            "return None for their attention weights (method 'dense' on a model loaded with attn_implementation='eager' returns them)"
        )
        if mask_kind == "eager":
            # transformers' collecting hook skips a None: this layer's place is kept by hand (the hook of this module
            # runs after this function returns), so that outputs.attentions[i] stays layer i's weights, as unpatched
            collected.append(None)
    return out.transpose(1, 2).contiguous(), weights[0]
