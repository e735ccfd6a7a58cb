"""Where a Hugging Face model's attention lives: its attention modules, towers, blocks and prefix tokens.

An attention module is one whose ``forward`` calls transformers' attention dispatch: it loads the global
``ALL_ATTENTION_FUNCTIONS`` (``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` or ``ALL_ATTENTION_FUNCTIONS[...]``), read
from the compiled code of the (unwrapped) ``forward`` and the functions it defines, once per class: what the code
calls, not how its source is worded.  A module that looks like attention (query, key and value projections) but does
not dispatch is listed by :func:`undispatched_attention`, so a patch can refuse it by name instead of skipping it.
Towers: a module whose config is a ``vision_config`` /
``text_config`` sub-config (``config.base_config_key``) belongs to the ``"vision"`` / ``"text"`` tower;
any other to ``"text"`` if causal and to ``"vision"`` otherwise (ViTs).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...runtime import PatchHandle

__all__ = [
    "attention_modules", "undispatched_attention", "check_dispatch", "towers_of", "tower_kind", "routed_in", "routed_modules", "sub_config_key", "stack_of", "block_of",
    "prefix_tokens", "vision_config", "packs_sequences",
]

_DISPATCH_CLASSES: dict[type, bool] = {}
#: The global transformers' attention modules dispatch through (``AttentionInterface``'s mapping).
DISPATCH_NAME = "ALL_ATTENTION_FUNCTIONS"
#: Child names of query / key / value projections (fused or not), across the model families.
_PROJECTIONS = ({"q_proj", "k_proj", "v_proj"}, {"query", "key", "value"}, {"qkv"}, {"qkv_proj"}, {"in_proj"},
                {"to_q", "to_k", "to_v"}, {"c_attn"}, {"Wqkv"}, {"query_key_value"})


def _names_loaded(code) -> set[str]:
    """Global and attribute names a code object and the code objects it defines (closures, comprehensions) load."""
    out = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            out |= _names_loaded(const)
    return out


def _dispatches_through_interface(cls: type) -> bool:
    if cls not in _DISPATCH_CLASSES:
        fn = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
        code = getattr(fn, "__code__", None)
        _DISPATCH_CLASSES[cls] = code is not None and DISPATCH_NAME in _names_loaded(code)
    return _DISPATCH_CLASSES[cls]


def _looks_like_attention(module: torch.nn.Module) -> bool:
    """Query, key and value projections among the module's direct children (any family's names)."""
    names = {n for n, c in module.named_children() if isinstance(c, torch.nn.Linear)}
    return any(p <= names for p in _PROJECTIONS)


def undispatched_attention(model: torch.nn.Module, routed: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, type]]:
    """``(name, class)`` of the modules in the routed attention modules' blocks that look like attention (query, key
    and value projections) but do not call transformers' attention dispatch: their attention would not be routed,
    so a patch refuses them naming the class rather than leaving them exact without a word."""
    blocks = {id(b): b for b in (block_of(model, n) for n, _ in routed) if b is not None}
    blocks = blocks or {id(model): model}  # no block found: the whole model
    seen = {id(m) for _, m in routed}
    out = []
    for n, m in model.named_modules():
        if id(m) in seen or _dispatches_through_interface(type(m)) or not _looks_like_attention(m):
            continue
        if any(m is sub for b in blocks.values() for sub in b.modules()):
            out.append((n, type(m)))
    return out


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


def check_dispatch(model: torch.nn.Module, routed: list[tuple[str, torch.nn.Module]]) -> None:
    """Refuse a model whose routed blocks hold attention the patch cannot route (:func:`undispatched_attention`).

    Raises:
        UnsupportedModelError: naming the class, one of its modules, and what is supported.
    """
    stray = undispatched_attention(model, routed)
    if stray:
        from ....errors import UnsupportedModelError

        classes = sorted({c.__name__ for _, c in stray})
        raise UnsupportedModelError(
            f"{type(model).__name__}: {', '.join(classes)} ({stray[0][0]}{' and others' if len(stray) > 1 else ''}) has "
            f"query, key and value projections but does not call transformers' attention dispatch ({DISPATCH_NAME}), "
            "so the patch cannot route its attention; supported are attention modules that dispatch through it")


def towers_of(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Module]]]:
    """Tower name -> its attention modules (in model order); the vision tower first, as in open_clip."""
    image_model = getattr(model, "main_input_name", None) == "pixel_values"
    out: dict[str, list] = {}
    for n, m in attention_modules(model):
        out.setdefault(_tower_of(m, image_model), []).append((n, m))
    return dict(sorted(out.items(), key=lambda kv: kv[0] != "vision"))


def tower_kind(name: str, mods: list[tuple[str, torch.nn.Module]]) -> str:
    """The kind of tower ``name`` with attention modules ``mods``: ``"causal_lm"`` when every module is causal,
    else ``"vision"`` for the vision tower and ``"text"`` (a text encoder) for the text tower."""
    if all(bool(getattr(m, "is_causal", False)) for _, m in mods):
        return "causal_lm"
    return "vision" if name == "vision" else "text"


def routed_in(model: torch.nn.Module, towers: tuple[str, ...]) -> list[tuple[str, torch.nn.Module, str]]:
    """``(name, module, tower)`` of the attention modules of ``towers`` (every tower when empty), in model order."""
    chosen = set(towers) if towers else None
    return [(n, m, t) for t, mods in towers_of(model).items() if chosen is None or t in chosen for n, m in mods]


def routed_modules(handle: PatchHandle) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the attention modules of the handle's chosen towers, in model order."""
    return [(n, m) for n, m, _ in routed_in(handle.model, handle.towers)]


def sub_config_key(model: torch.nn.Module, cfg) -> str | None:
    """The key of ``model.config``'s sub-config that *is* ``cfg`` (e.g. ``"vision_config"``), or ``None``."""
    for key in getattr(model.config, "sub_configs", None) or {}:
        if getattr(model.config, key, None) is cfg:
            return key
    return None


def stack_of(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """``(owner of the block list, block)`` for the attention module called ``name``: the block is
    the ancestor that is an item of a ModuleList, the owner the module holding that list (the encoder)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = model.get_submodule(".".join(parts[: i - 1])) if i > 1 else model
        child = getattr(parent, parts[i - 1], None)
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) and parts[i].isdigit():
            return parent, child[int(parts[i])]
    return None


def block_of(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The transformer block holding the attention module called ``name``: the ancestor that is an item of a ModuleList."""
    found = stack_of(model, name)
    return None if found is None else found[1]


def prefix_tokens(model: torch.nn.Module, kind: str) -> int:
    """CLS + register tokens of a Hugging Face ViT encoder (token roles FNA and sink masking need); 0 for causal LMs and text towers.

    Read from the model's structure, never assumed: a class token is a ``cls_token`` / ``class_embedding`` parameter
    (DINOv2, ViT, CLIP); registers are the vision config's ``num_register_tokens``.  A vision tower without a class
    token (SigLIP, which pools with an attention head; the vision towers of Qwen2-VL and Idefics3 / SmolVLM, which
    hand every patch to the language model) has none.
    """
    if kind != "vision":
        return 0
    cfg = model.config
    vcfg = getattr(cfg, "vision_config", None) or cfg
    registers = int(getattr(vcfg, "num_register_tokens", 0) or 0)
    has_cls = any(n.endswith(("cls_token", "class_embedding")) for n, _ in model.named_parameters())
    return int(has_cls) + registers


def vision_config(model: torch.nn.Module) -> Any:
    """The config of the model's vision tower: ``model.config.vision_config`` of a dual encoder, else ``model.config``."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "vision_config", None) or cfg


def packs_sequences(module: torch.nn.Module) -> bool:
    """Whether an attention module takes packed sequences (its forward has a ``cu_seqlens`` parameter: Qwen2-VL's
    vision attention, which calls the attention function once per packed image outside flash attention)."""
    import inspect

    try:
        return "cu_seqlens" in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin forward
        return False
