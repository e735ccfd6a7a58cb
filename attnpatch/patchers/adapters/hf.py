"""Hugging Face adapter: binds a method through ``transformers.AttentionInterface``.

One attention function, ``"attnpatch"``, is registered in ``AttentionInterface`` (with
``sdpa_mask`` as its mask builder in ``AttentionMaskInterface``).  Patching a model switches
its attention implementation to it with ``model.set_attn_implementation`` and binds the
model's :class:`~attnpatch.patchers.runtime.PatchHandle` to each attention module; the
registered function reads the handle from the module it is called with, so the global
registration carries no state.  Unpatching restores the original implementation name.

Any model whose attention modules dispatch through ``ALL_ATTENTION_FUNCTIONS.get_interface``
is covered (Llama, Qwen2, Qwen3, Mistral, DINOv2, CLIP, SigLIP, ...).

Towers: an attention module whose config is a ``vision_config`` / ``text_config`` sub-config
(``config.base_config_key``) belongs to the ``"vision"`` / ``"text"`` tower; any other module to
``"text"`` if it is causal (causal LMs) and to ``"vision"`` otherwise (ViTs). A dual-tower model
(``CLIPModel``, ``SiglipModel``) routes only the chosen towers: the ``"attnpatch"``
implementation is set on those towers' sub-configs alone (``set_attn_implementation`` with a
dict), so the other tower keeps its own implementation and computes bit for bit what it did.
Tower kinds: ``"vision"``; ``"causal_lm"`` for a text tower whose modules are causal LM
attention (``is_causal``); ``"text"`` for a text *encoder* (CLIP's causal-masked text
transformer, SigLIP's bidirectional one), which only ``dense`` fits.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...errors import UnsupportedModelError
from ..registry import ModelGeometry
from ..runtime import PatchHandle, block_refusal, input_hook, run_layer, undo_class_swap, wrap_blocks
from .blocks import HF_TOKEN_READOUT_MODELS, hf_block_forwards

__all__ = ["HFAdapter", "attention_modules", "routed_modules", "prefix_tokens"]

ATTN_NAME = "attnpatch"
_DISPATCH_CLASSES: dict[type, bool] = {}
_BLOCK_CLASSES: dict[type, type] = {}


def _dispatches_through_interface(cls: type) -> bool:
    if cls not in _DISPATCH_CLASSES:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        _DISPATCH_CLASSES[cls] = "get_interface(" in src and "ALL_ATTENTION_FUNCTIONS" in src
    return _DISPATCH_CLASSES[cls]


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every attention module of ``model`` that dispatches through AttentionInterface."""
    return [(n, m) for n, m in model.named_modules() if _dispatches_through_interface(type(m))]


_SUB_TOWERS = {"vision_config": "vision", "text_config": "text"}


def _tower_of(module: torch.nn.Module, image_model: bool) -> str:
    """``"vision"`` / ``"text"`` from the module's config (``base_config_key``), else ``"vision"`` for
    the bidirectional attention of an image model (``main_input_name == "pixel_values"``) and
    ``"text"`` for everything else (causal LMs, and text encoders such as BERT)."""
    key = getattr(getattr(module, "config", None), "base_config_key", "") or ""
    if key in _SUB_TOWERS:
        return _SUB_TOWERS[key]
    if bool(getattr(module, "is_causal", False)):
        return "text"
    return "vision" if image_model else "text"


def _towers(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Module]]]:
    """Tower name -> its attention modules (in model order); the vision tower first, as in open_clip."""
    image_model = getattr(model, "main_input_name", None) == "pixel_values"
    out: dict[str, list] = {}
    for n, m in attention_modules(model):
        out.setdefault(_tower_of(m, image_model), []).append((n, m))
    return dict(sorted(out.items(), key=lambda kv: kv[0] != "vision"))


def _tower_kind(name: str, mods: list[tuple[str, torch.nn.Module]]) -> str:
    if all(bool(getattr(m, "is_causal", False)) for _, m in mods):
        return "causal_lm"
    return "vision" if name == "vision" else "text"


def _routed(handle: PatchHandle) -> list[tuple[str, torch.nn.Module, str]]:
    chosen = set(handle.towers) if handle.towers else None
    return [(n, m, t) for t, mods in _towers(handle.model).items() if chosen is None or t in chosen for n, m in mods]


def routed_modules(handle: PatchHandle) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the attention modules of the handle's chosen towers, in model order."""
    return [(n, m) for n, m, _ in _routed(handle)]


def _sub_config_key(model: torch.nn.Module, cfg) -> str | None:
    """The key of ``model.config``'s sub-config that *is* ``cfg`` (e.g. ``"vision_config"``), or ``None``."""
    for key in getattr(model.config, "sub_configs", None) or {}:
        if getattr(model.config, key, None) is cfg:
            return key
    return None


# configs of patched models whose own implementation is eager -> that config (the masks they get
# are eager's additive float masks, so that ``dense`` passes the model's own mask on unchanged);
# entries live from patch to unpatch only
_EAGER_CONFIGS: dict[int, Any] = {}


def _mask(**kwargs):
    """The ``"attnpatch"`` mask builder: the one of the model's own implementation (eager's additive
    float mask for models whose own implementation is eager, SDPA's bool mask otherwise)."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    cfg = kwargs.get("config")
    if cfg is not None and _EAGER_CONFIGS.get(id(cfg)) is cfg:
        return eager_mask(**kwargs)
    return sdpa_mask(**kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if ALL_MASK_ATTENTION_FUNCTIONS.get(ATTN_NAME) is not _mask:
        AttentionMaskInterface.register(ATTN_NAME, _mask)
    AttentionInterface.register(ATTN_NAME, _dispatch)


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


def _attentions_requested() -> bool:
    """Whether the current ``transformers`` forward collects attention weights (``output_attentions=True``)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - older transformers
        return False
    try:
        collected = _active_collector.get()
    except LookupError:
        return False
    return isinstance(collected, dict) and "attentions" in collected


def _dispatch(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
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
    if weights[0] is None and not handle.method.exact and _attentions_requested():
        handle.say(
            f"output_attentions=True: method {handle.method.name!r} forms no attention matrix, so the patched layers "
            "return None for their attention weights (method 'dense' on a model loaded with attn_implementation='eager' returns them)"
        )
    return out.transpose(1, 2).contiguous(), weights[0]


def _stack_of(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(owner of the block list, block)`` for the attention module called ``name``: the block is
    the ancestor that is an item of a ModuleList, the owner the module holding that list (the encoder)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = model.get_submodule(".".join(parts[: i - 1])) if i > 1 else model
        child = getattr(parent, parts[i - 1], None)
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) and parts[i].isdigit():
            return parent, child[int(parts[i])]
    return None


def _block_of(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The transformer block holding the attention module called ``name``: the ancestor that is an item of a ModuleList."""
    found = _stack_of(model, name)
    return None if found is None else found[1]


def prefix_tokens(model: torch.nn.Module, kind: str) -> int:
    """CLS + register tokens of a Hugging Face ViT encoder (token roles FNA and sink masking need); 0 for causal LMs and text towers.

    A vision tower without a class token (SigLIP: ``*.embeddings`` holds no ``cls_token`` /
    ``class_embedding``; it pools with an attention head) has no CLS prefix.
    """
    if kind != "vision":
        return 0
    cfg = model.config
    vcfg = getattr(cfg, "vision_config", None) or cfg
    registers = int(getattr(vcfg, "num_register_tokens", 0) or 0)
    names = [n for n, _ in model.named_parameters() if not n.startswith("text_model.")]
    has_cls = any(n.endswith(("cls_token", "class_embedding")) for n in names)
    if not has_cls and "siglip" in str(getattr(vcfg, "model_type", "")):
        return registers
    return 1 + registers


class HFAdapter:
    """Adapter for Hugging Face ``PreTrainedModel`` subclasses that dispatch attention through AttentionInterface."""

    library = "Hugging Face transformers"
    supports = (
        "Hugging Face transformers models whose attention dispatches through transformers.AttentionInterface "
        "(e.g. LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Dinov2Model, Dinov2WithRegistersModel, "
        "CLIPModel, CLIPVisionModel, SiglipModel)"
    )

    @staticmethod
    def detect(model: torch.nn.Module) -> str | None:
        """``"causal_lm"`` or ``"vision"`` if this adapter handles ``model``, else ``None``."""
        try:
            from transformers import PreTrainedModel
        except ImportError:  # pragma: no cover
            return None
        if not isinstance(model, PreTrainedModel):
            return None
        mods = attention_modules(model)
        if not mods:
            return None
        causal = {bool(getattr(m, "is_causal", False)) for _, m in mods}
        return "causal_lm" if causal == {True} else "vision"

    @staticmethod
    def towers(model: torch.nn.Module) -> dict[str, str]:
        """Tower name -> kind: ``{"vision": "vision", "text": "text"}`` for ``CLIPModel`` /
        ``SiglipModel``; one tower for single-tower models (``{"text": "causal_lm"}`` for causal
        LMs, ``{"vision": "vision"}`` for ViTs such as DINOv2 or ``CLIPVisionModel``)."""
        return {t: _tower_kind(t, mods) for t, mods in _towers(model).items()}

    @staticmethod
    def default_towers(model: torch.nn.Module) -> tuple[str, ...]:
        """``("vision",)`` for a model with a vision tower and another tower; every tower otherwise."""
        names = tuple(_towers(model))
        return ("vision",) if len(names) > 1 and "vision" in names else names

    @staticmethod
    def roots(handle: PatchHandle) -> list[torch.nn.Module]:
        """Modules whose call is one whole forward pass: the model, the routed towers'
        sub-models (``vision_model`` / ``text_model``), so that ``get_image_features`` /
        ``get_text_features`` (which call a tower without the model's own ``forward``) also get
        exactly one per-forward state, and the block stacks and blocks of the routed modules
        (``model.encoder(x)`` or one block called alone; nested calls share the outer state)."""
        out = [handle.model]
        for t in handle.towers:
            sub = getattr(handle.model, f"{t}_model", None)
            if isinstance(sub, torch.nn.Module) and sub is not handle.model:
                out.append(sub)
        # a sub-module called on its own (model.encoder(x), one block) is a forward pass of its own
        for name, _ in routed_modules(handle):
            found = _stack_of(handle.model, name)
            if found is not None:
                out += [m for m in found if all(m is not o for o in out)]
        return out

    @staticmethod
    def layer_count(handle: PatchHandle) -> int:
        """Number of attention modules the patch routes (those of the chosen towers)."""
        return len(routed_modules(handle))

    @staticmethod
    def features(handle: PatchHandle) -> dict[str, str]:
        """Model features (keys of :data:`~attnpatch.patchers.registry.MODEL_FEATURES`) the routed
        attention modules use, each with where it was found: sliding windows (a module's
        ``sliding_window``, or ``config.sliding_window`` where the model applies it to every layer,
        as Mistral and Phi-3 do, unless ``use_sliding_window`` is false), layer types other than
        full attention (``config.layer_types``), and logit soft-capping (``attn_logit_softcapping``)."""
        found: dict[str, list[str]] = {}
        for name, m in routed_modules(handle):
            cfg = getattr(m, "config", None) or handle.model.config
            li = getattr(m, "layer_idx", None)
            types = getattr(cfg, "layer_types", None)
            ltype = types[li] if isinstance(types, (list, tuple)) and isinstance(li, int) and li < len(types) else None
            if "sliding_window" in m.__dict__ or hasattr(type(m), "sliding_window"):
                window = getattr(m, "sliding_window", None)
            elif getattr(cfg, "use_sliding_window", True) is False:
                window = None
            else:
                window = getattr(cfg, "sliding_window", None)
            if window is not None:
                found.setdefault("sliding_window", []).append(f"{name} (window {window} tokens)")
            elif ltype is not None and ltype != "full_attention":
                found.setdefault("layer_types", []).append(f"{name} ({ltype!r})")
            cap = getattr(m, "attn_logit_softcapping", getattr(cfg, "attn_logit_softcapping", None))
            if cap is not None:
                found.setdefault("softcap", []).append(f"{name} (cap {cap})")
            if isinstance(getattr(m, "sinks", None), torch.Tensor):
                found.setdefault("attention_sinks", []).append(f"{name} (learned sink logits, {tuple(m.sinks.shape)})")
            if getattr(cfg, "use_relative_position_bias", False) or getattr(cfg, "use_shared_relative_position_bias", False):
                found.setdefault("logit_bias", []).append(f"{name} (relative position bias)")
            v_dim = getattr(cfg, "v_head_dim", None)
            qk_dim = getattr(cfg, "qk_head_dim", None) or (
                (getattr(cfg, "qk_nope_head_dim", 0) or 0) + (getattr(cfg, "qk_rope_head_dim", 0) or 0) or getattr(cfg, "head_dim", None)
            )
            if v_dim is not None and qk_dim and v_dim != qk_dim:
                found.setdefault("value_head_dim", []).append(f"{name} (value head size {v_dim}, query/key head size {qk_dim})")
        return {f: (v[0] if len(v) == 1 else f"{v[0]} and {len(v) - 1} more layers") for f, v in found.items()}

    @staticmethod
    def check(handle: PatchHandle) -> None:
        """For a method with a block hook (ToMe): the model must read its output from the class token
        (:data:`~attnpatch.patchers.adapters.blocks.HF_TOKEN_READOUT_MODELS`) and every routed block
        be one the patch can split; nothing else beyond what :meth:`apply` verifies (the method checks
        its own options against :meth:`geometry`).

        Raises:
            UnsupportedModelError: another model class (e.g. ``Dinov2ForImageClassification``, which
                averages the patch tokens) or block class.
        """
        if handle.method.block_hook is None:
            return
        model = handle.model
        name = type(model).__name__
        if name not in HF_TOKEN_READOUT_MODELS:
            raise UnsupportedModelError(
                f"method {handle.method.name!r} merges tokens, so a model's read-out must take the class token (or every "
                f"token); {name} is not one known to do so (supported: {', '.join(sorted(HF_TOKEN_READOUT_MODELS))})"
            )
        forwards = hf_block_forwards()
        blocks = [_block_of(model, n) for n, _ in routed_modules(handle)]
        if any(b is None or type(b) not in forwards for b in blocks):
            raise UnsupportedModelError(block_refusal(handle, [b for b in blocks if b is not None], forwards))

    @staticmethod
    def geometry(handle: PatchHandle) -> ModelGeometry:
        """Routed layers; query heads, key/value heads and head size from the routed modules' config
        (the text config for a multi-tower model whose modules carry none)."""
        cfg = handle.model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        mods = routed_modules(handle)
        mcfg = getattr(mods[0][1], "config", None) if mods else None
        src = mcfg if getattr(mcfg, "num_attention_heads", None) is not None else text_cfg
        heads = getattr(src, "num_attention_heads", None)
        kv = getattr(src, "num_key_value_heads", None) or heads
        head_dim = getattr(src, "head_dim", None) or (getattr(src, "hidden_size", 0) // heads if heads else None)
        return ModelGeometry(num_layers=len(mods), heads=heads, kv_heads=kv, head_dim=head_dim or None, kind=handle.kind)

    @staticmethod
    def prefix_tokens(model: torch.nn.Module, kind: str) -> int:
        """See :func:`prefix_tokens`."""
        return prefix_tokens(model, kind)

    @staticmethod
    def apply(handle: PatchHandle) -> Any:
        """Bind ``handle`` to the chosen towers' attention modules and switch them to the ``"attnpatch"`` implementation.

        When every attention module of the model is routed, the whole model is switched (as for
        a causal LM or a ViT); otherwise only the chosen towers' sub-configs are
        (``set_attn_implementation({"vision_config": "attnpatch"})``), and the other towers keep
        their implementation.

        Returns:
            What :meth:`restore` needs: the original implementation(s), the modules and the hooks.

        Raises:
            UnsupportedModelError: the model refuses ``set_attn_implementation``, or a chosen
                tower's sub-config could not be switched alone.
        """
        _register()
        model = handle.model
        all_mods = attention_modules(model)
        routed = _routed(handle)
        mods = [(n, m) for n, m, _ in routed]
        kinds = handle.tower_kinds or HFAdapter.towers(model)
        whole = len(mods) == len(all_mods)
        if whole:
            original: Any = model.config._attn_implementation
            request: Any = ATTN_NAME
        else:
            keys = {_sub_config_key(model, getattr(m, "config", None)) for _, m in mods}
            if None in keys:
                raise UnsupportedModelError(
                    f"{type(model).__name__}: the towers {handle.towers} have no sub-config of their own in "
                    f"model.config.sub_configs, so they cannot be switched to {ATTN_NAME!r} apart from the other "
                    f"towers; route every tower (towers='all') with method 'dense', or patch the tower's own sub-model"
                )
            original = {k: getattr(model.config, k)._attn_implementation for k in sorted(keys)}
            request = {k: ATTN_NAME for k in sorted(keys)}
        handle.num_layers = len(mods)
        vision = any(kinds.get(t) == "vision" for t in handle.towers)
        handle.prefix_tokens = prefix_tokens(model, "vision" if vision else handle.kind)
        multi = len(handle.towers) > 1
        hooks = []
        eager_cfgs: list[Any] = []
        for i, (name, m, tower) in enumerate(routed):
            m._attnpatch = handle
            m._attnpatch_original = getattr(getattr(m, "config", None), "_attn_implementation", None) or model.config._attn_implementation
            if m._attnpatch_original == "eager":
                cfg = getattr(m, "config", None) or model.config
                _EAGER_CONFIGS[id(cfg)] = cfg
                eager_cfgs.append(cfg)
                m._attnpatch_eager_mask = True
            li = getattr(m, "layer_idx", None)
            # encoders often carry no layer_idx; with several towers, number the routed modules in order
            m._attnpatch_layer = int(li) if isinstance(li, int) and not multi else i
            if kinds.get(tower) == "vision":  # token features for landmark selection and sink detection
                hooks.append(m.register_forward_pre_hook(input_hook(handle, "hidden", ("hidden_states",)), with_kwargs=True))
                block = _block_of(model, name)
                if block is not None:
                    hooks.append(block.register_forward_pre_hook(input_hook(handle, "residual", ("hidden_states",)), with_kwargs=True))
        model.set_attn_implementation(request)
        if whole:
            switched = model.config._attn_implementation == ATTN_NAME
        else:
            switched = all(getattr(m, "config", model.config)._attn_implementation == ATTN_NAME for _, m in mods)
        others_kept = whole or all(
            getattr(m, "config", model.config)._attn_implementation != ATTN_NAME for _, m in all_mods if not hasattr(m, "_attnpatch")
        )
        if not switched or not others_kept:
            for _, m in mods:
                for attr in ("_attnpatch", "_attnpatch_layer", "_attnpatch_original", "_attnpatch_eager_mask"):
                    m.__dict__.pop(attr, None)
            for cfg in eager_cfgs:
                _EAGER_CONFIGS.pop(id(cfg), None)
            for h in hooks:
                h.remove()
            try:
                model.set_attn_implementation(original)
            except Exception:  # noqa: BLE001  # pragma: no cover - best effort before raising
                pass
            raise UnsupportedModelError(
                f"{type(model).__name__} refused set_attn_implementation({request!r}); it does not dispatch "
                "attention through transformers.AttentionInterface"
                + ("" if whole else f", or its towers {handle.towers} cannot be switched apart from the others")
            )
        blocks = []
        if handle.method.block_hook is not None:  # checked by check(): every routed block splits
            blocks = wrap_blocks(
                handle, [(m._attnpatch_layer, _block_of(model, n)) for n, m in mods], hf_block_forwards(), _BLOCK_CLASSES
            )
        return original, mods, hooks, eager_cfgs, blocks

    @staticmethod
    def restore(handle: PatchHandle, undo: Any) -> None:
        """Switch back to the original attention implementation(s), unbind the modules and restore split blocks."""
        original, mods, hooks, eager_cfgs, blocks = undo
        undo_class_swap((blocks, []))
        for h in hooks:
            h.remove()
        handle.model.set_attn_implementation(original)
        for cfg in eager_cfgs:
            _EAGER_CONFIGS.pop(id(cfg), None)
        for _, m in mods:
            for attr in ("_attnpatch", "_attnpatch_layer", "_attnpatch_original", "_attnpatch_eager_mask"):
                m.__dict__.pop(attr, None)
