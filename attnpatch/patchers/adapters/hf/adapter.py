"""The Hugging Face adapter class (:class:`HFAdapter`): detection, towers, checks, geometry, apply / restore, and
the evals' questions (patch size, token count, preprocessing, features, embeddings).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ....errors import UnsupportedModelError
from ...adapter import PreprocessConfig
from ...class_swap import block_refusal, undo_class_swap, wrap_blocks
from ...contract import ModelGeometry
from ...features import check_pixels, float_dtype, input_device, patch_side, square_grid, vit_features
from ...runtime import PatchHandle, input_hook
from .attention import ATTN_NAME, forget_eager_config, register_attention, remember_eager_config
from .blocks import HF_TOKEN_READOUT_MODELS, hf_block_forwards
from .images import hf_image_pipeline, image_processor_config, interpolate_kwargs, pooled, vision_patch_tokens
from .modules import (attention_modules, block_of, check_dispatch, packs_sequences, prefix_tokens, routed_in, routed_modules,
                      stack_of, sub_config_key, tower_kind, towers_of, vision_config)

__all__ = ["HFAdapter"]

_BLOCK_CLASSES: dict[type, type] = {}


def _need_vision(model: torch.nn.Module, tower: str, what: str, *, only: bool = False) -> None:
    """Refuse a model without a ``"vision"`` tower (``only``: without exactly that one tower), or another ``tower``."""
    towers = HFAdapter.towers(model)
    if tower != "vision" or "vision" not in towers or (only and len(towers) > 1):
        have = ", ".join(f"{t!r} ({k})" for t, k in towers.items()) or "none"
        need = "a single vision tower (an image encoder such as Dinov2Model or CLIPVisionModel)" if only else "a vision tower"
        raise UnsupportedModelError(f"{type(model).__name__}: {what} needs {need}; its towers: {have}" +
                                    ("" if tower == "vision" else f" (asked for tower {tower!r})"))


def _need_dual(model: torch.nn.Module, what: str) -> None:
    if not (hasattr(model, "get_image_features") and hasattr(model, "get_text_features")):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no get_image_features / get_text_features, so it has no {what}; expected a "
            "dual encoder such as CLIPModel or SiglipModel"
        )


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
            check_dispatch(model, [])  # attention it cannot route is refused by name, not passed over
            return None
        causal = {bool(getattr(m, "is_causal", False)) for _, m in mods}
        return "causal_lm" if causal == {True} else "vision"

    @staticmethod
    def towers(model: torch.nn.Module) -> dict[str, str]:
        """Tower name -> kind: ``{"vision": "vision", "text": "text"}`` for ``CLIPModel`` /
        ``SiglipModel``; one tower for single-tower models (``{"text": "causal_lm"}`` for causal
        LMs, ``{"vision": "vision"}`` for ViTs such as DINOv2 or ``CLIPVisionModel``)."""
        return {t: tower_kind(t, mods) for t, mods in towers_of(model).items()}

    @staticmethod
    def default_towers(model: torch.nn.Module) -> tuple[str, ...]:
        """``("vision",)`` for a model with a vision tower and another tower; every tower otherwise."""
        names = tuple(towers_of(model))
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
            found = stack_of(handle.model, name)
            if found is not None:
                out += [m for m in found if all(m is not o for o in out)]
        return out

    @staticmethod
    def layer_count(handle: PatchHandle) -> int:
        """Number of attention modules the patch routes (those of the chosen towers)."""
        return len(routed_modules(handle))

    @staticmethod
    def features(handle: PatchHandle) -> dict[str, str]:
        """Model features (keys of :data:`~attnpatch.patchers.contract.MODEL_FEATURES`) the routed
        attention modules use, each with where it was found: sliding windows (a module's
        ``sliding_window``, or ``config.sliding_window`` where the model applies it to every layer,
        as Mistral and Phi-3 do, unless ``use_sliding_window`` is false), layer types other than
        full attention (``config.layer_types``), logit soft-capping (``attn_logit_softcapping``), packed sequences
        (:func:`~.modules.packs_sequences`)."""
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
            if packs_sequences(m):
                found.setdefault("packed_sequences", []).append(f"{name} ({type(m).__name__} takes cu_seqlens)")
        return {f: (v[0] if len(v) == 1 else f"{v[0]} and {len(v) - 1} more layers") for f, v in found.items()}

    @staticmethod
    def check(handle: PatchHandle) -> None:
        """Every attention of the routed blocks must dispatch through transformers (:func:`~.modules.check_dispatch`).
        For a method with a block hook (ToMe): the model must read its output from the class token
        (:data:`HF_TOKEN_READOUT_MODELS`) and every routed block be one the patch can split.

        Raises:
            UnsupportedModelError: attention that does not dispatch; another model class (e.g.
                ``Dinov2ForImageClassification``, which averages the patch tokens) or block class.
        """
        model, name = handle.model, type(handle.model).__name__
        check_dispatch(model, routed_modules(handle))
        if handle.method.block_hook is None:
            return
        if name not in HF_TOKEN_READOUT_MODELS:
            raise UnsupportedModelError(
                f"method {handle.method.name!r} merges tokens, so a model's read-out must take the class token (or every "
                f"token); {name} is not one known to do so (supported: {', '.join(sorted(HF_TOKEN_READOUT_MODELS))})"
            )
        forwards = hf_block_forwards()
        blocks = [block_of(model, n) for n, _ in routed_modules(handle)]
        if any(b is None or type(b) not in forwards for b in blocks):
            raise UnsupportedModelError(block_refusal(handle, [b for b in blocks if b is not None], forwards))

    @staticmethod
    def geometry(model: torch.nn.Module, towers: tuple[str, ...], kind: str) -> ModelGeometry:
        """Layers of ``towers``; query heads, key/value heads and head size from their attention modules'
        config (the text config for a multi-tower model whose modules carry none); read from the model,
        which is left as it is."""
        cfg = model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        mods = routed_in(model, towers)
        mcfg = getattr(mods[0][1], "config", None) if mods else None
        src = mcfg if getattr(mcfg, "num_attention_heads", None) is not None else text_cfg
        heads = getattr(src, "num_attention_heads", None)
        kv = getattr(src, "num_key_value_heads", None) or heads
        head_dim = getattr(src, "head_dim", None) or (getattr(src, "hidden_size", 0) // heads if heads else None)
        return ModelGeometry(num_layers=len(mods), heads=heads, kv_heads=kv, head_dim=head_dim or None, kind=kind)

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
        register_attention()
        model = handle.model
        all_mods = attention_modules(model)
        routed = routed_in(model, handle.towers)
        mods = [(n, m) for n, m, _ in routed]
        kinds = handle.tower_kinds or HFAdapter.towers(model)
        whole = len(mods) == len(all_mods)
        if whole:
            original: Any = model.config._attn_implementation
            request: Any = ATTN_NAME
        else:
            keys = {sub_config_key(model, getattr(m, "config", None)) for _, m in mods}
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
                remember_eager_config(cfg)
                eager_cfgs.append(cfg)
                m._attnpatch_eager_mask = True
            li = getattr(m, "layer_idx", None)
            # encoders often carry no layer_idx; with several towers, number the routed modules in order
            m._attnpatch_layer = int(li) if isinstance(li, int) and not multi else i
            if kinds.get(tower) == "vision":  # token features for landmark selection and sink detection
                hooks.append(m.register_forward_pre_hook(input_hook(handle, "hidden", ("hidden_states",)), with_kwargs=True))
                block = block_of(model, name)
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
                forget_eager_config(cfg)
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
                handle, [(m._attnpatch_layer, block_of(model, n)) for n, m in mods], hf_block_forwards(), _BLOCK_CLASSES
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
            forget_eager_config(cfg)
        for _, m in mods:
            for attr in ("_attnpatch", "_attnpatch_layer", "_attnpatch_original", "_attnpatch_eager_mask"):
                m.__dict__.pop(attr, None)

    # ------------------------------------------------------------------ what the evals ask

    @staticmethod
    def patch_size(model: torch.nn.Module, tower: str = "vision") -> int:
        """Side in pixels of the vision tower's square patches: ``patch_size`` of the model's vision config
        (``config.vision_config`` of a dual encoder, else ``config``).

        Raises:
            UnsupportedModelError: the model has no vision tower (a causal LM), ``tower`` is not ``"vision"``,
                or its config does not say (the message names the model).
        """
        _need_vision(model, tower, "a patch size")
        vcfg = vision_config(model)
        p = getattr(vcfg, "patch_size", None)
        if p is None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: its config ({type(vcfg).__name__}) has no patch_size, so the patch size of its "
                "vision tower is unknown"
            )
        return patch_side(p)

    @staticmethod
    def grid(model: torch.nn.Module, resolution: int, tower: str = "vision") -> tuple[int, int]:
        """``(rows, columns)`` of patches on a square ``resolution``-pixel input.

        Raises:
            UnsupportedModelError: see :meth:`patch_size`; OptionError: ``resolution`` below one patch.
        """
        return square_grid(resolution, HFAdapter.patch_size(model, tower))

    @staticmethod
    def token_count(model: torch.nn.Module, resolution: int, tower: str = "vision") -> int:
        """Tokens the vision tower's attention sees on a square ``resolution``-pixel input: patches + CLS +
        registers (:func:`prefix_tokens`; a SigLIP tower has no CLS).

        Raises:
            UnsupportedModelError: see :meth:`patch_size`; OptionError: ``resolution`` below one patch.
        """
        rows, cols = HFAdapter.grid(model, resolution, tower)
        return rows * cols + prefix_tokens(model, "vision")

    @staticmethod
    def feature_prefix_tokens(model: torch.nn.Module) -> int:
        """Leading tokens :meth:`encode` leaves out of the patch mean: slot 0 (read as the image feature; a SigLIP
        tower's first patch) plus the register tokens of the vision config.

        Raises:
            UnsupportedModelError: the model has no vision tower.
        """
        _need_vision(model, "vision", "image features")
        return 1 + int(getattr(vision_config(model), "num_register_tokens", 0) or 0)

    @staticmethod
    def preprocess_config(model: torch.nn.Module, processor: Any = None) -> PreprocessConfig:
        """The model's image preprocessing, from its image processor (:func:`image_processor_config`): a
        ``transformers`` model does not carry it, so ``processor`` (``AutoImageProcessor.from_pretrained`` of
        the model's folder or hub id, or a ``CLIPProcessor``) is required.

        Raises:
            UnsupportedModelError: no vision tower, no ``processor``, or one that is not an image processor.
        """
        _need_vision(model, "vision", "image preprocessing")
        if processor is None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: a transformers model does not carry its image preprocessing; pass its image "
                "processor (AutoImageProcessor.from_pretrained(<the model's folder or hub id>))"
            )
        return image_processor_config(processor)

    image_pipeline = staticmethod(hf_image_pipeline)

    @staticmethod
    @torch.no_grad()
    def encode(
        model: torch.nn.Module, pixel_values: torch.Tensor, layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """Final CLS token and mean patch token (and, with ``layers``, intermediate CLS tokens) of a ViT encoder.

        Runs ``model(pixel_values=x).last_hidden_state`` (after the final norm; ``interpolate_pos_encoding=True``
        on another size than ``config.image_size`` where the forward takes it); intermediate CLS tokens are
        the outputs of ``encoder.layer[i]`` / ``encoder.layers[i]`` / ``layers[i]`` through ``layernorm`` / ``post_layernorm``.

        Args:
            model: a single-tower vision model (``Dinov2Model``, ``ViTModel``, ``CLIPVisionModel``, ...).
            pixel_values: ``[B, 3, H, W]`` (moved to the model's input device and weight dtype).
            layers: block indices whose output CLS token is returned as well.

        Returns:
            See :func:`~attnpatch.patchers.features.vit_features` (prefix: :meth:`feature_prefix_tokens`).

        Raises:
            UnsupportedModelError: not a single-tower vision model (a dual encoder: :meth:`embed_image`), an output
                without ``last_hidden_state`` (a classifier head), or ``layers`` where the blocks are not found.
        """
        _need_vision(model, "vision", "encode (frozen image features)", only=True)
        x = pixel_values.to(input_device(model), next(model.parameters()).dtype)
        blocks, norm = [], None
        if layers:
            enc = getattr(model, "encoder", None)
            found = getattr(enc, "layer", None) or getattr(enc, "layers", None) or getattr(model, "layers", None)
            blocks, norm = list(found or []), getattr(model, "layernorm", None) or getattr(model, "post_layernorm", None)

        def hidden():
            out = model(pixel_values=x, **interpolate_kwargs(model, x))
            h = getattr(out, "last_hidden_state", None)
            if h is None:
                raise UnsupportedModelError(
                    f"{type(model).__name__}: its output ({type(out).__name__}) has no last_hidden_state to read image "
                    "features from; pass the bare encoder (e.g. model.vit / model.dinov2 of a classifier)"
                )
            return h

        return vit_features(
            model, hidden,
            prefix=HFAdapter.feature_prefix_tokens(model), blocks=blocks, norm=norm, layers=tuple(layers),
        )

    patch_tokens = staticmethod(vision_patch_tokens)

    @staticmethod
    @torch.no_grad()
    def embed_image(model: torch.nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        """``get_image_features`` of a dual encoder (``CLIPModel``, ``SiglipModel``): ``[B, D]`` projected image
        embeddings in the model's dtype, not normalised; ``interpolate_pos_encoding=True`` when the images are
        not of the vision config's ``image_size``.

        Raises:
            UnsupportedModelError: not a dual encoder; OptionError: ``pixel_values`` not ``[B, 3, H, W]``.
        """
        _need_dual(model, "image embeddings")
        check_pixels(pixel_values)
        x = pixel_values.to(next(model.parameters()).device, float_dtype(model))
        size = getattr(vision_config(model), "image_size", None)
        side = (size, size) if isinstance(size, int) else tuple(size) if size is not None else None
        kw = {"interpolate_pos_encoding": True} if side is not None and tuple(x.shape[-2:]) != side else {}
        return pooled(model.get_image_features(pixel_values=x, **kw))

    @staticmethod
    @torch.no_grad()
    def embed_text(model: torch.nn.Module, tokens: Any) -> torch.Tensor:
        """``get_text_features`` of a dual encoder: ``[T, D]`` projected text embeddings, not normalised.

        Args:
            model: ``CLIPModel`` / ``SiglipModel``.
            tokens: the tokenizer's output (``input_ids``, ``attention_mask``, ... ``[T, L]``), moved to the model's device.

        Raises:
            UnsupportedModelError: not a dual encoder.
        """
        _need_dual(model, "text embeddings")
        dev = next(model.parameters()).device
        return pooled(model.get_text_features(**{k: v.to(dev) for k, v in tokens.items()}))
