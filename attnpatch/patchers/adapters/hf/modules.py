"""Where a Hugging Face model's attention lives: its attention modules, towers, blocks and prefix tokens.

An attention module is one whose ``forward`` dispatches through ``ALL_ATTENTION_FUNCTIONS.get_interface``
(read from its source once per class).  Towers: a module whose config is a ``vision_config`` /
``text_config`` sub-config (``config.base_config_key``) belongs to the ``"vision"`` / ``"text"`` tower;
any other to ``"text"`` if causal and to ``"vision"`` otherwise (ViTs).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...runtime import PatchHandle

__all__ = [
    "attention_modules", "towers_of", "tower_kind", "routed_in", "routed_modules", "sub_config_key", "stack_of", "block_of",
    "prefix_tokens", "vision_config",
]

_DISPATCH_CLASSES: dict[type, bool] = {}


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
