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

Modules: :mod:`.adapter` (:class:`HFAdapter`), :mod:`.modules` (attention modules, towers, blocks,
prefix tokens), :mod:`.attention` (the registered attention function and its masks), :mod:`.blocks`
(block forwards for token merging, the read-out rule), :mod:`.images` (image processors, embeddings).
"""

from .adapter import HFAdapter
from .blocks import HF_TOKEN_READOUT_MODELS, hf_block_forwards
from .images import image_processor_config
from .modules import attention_modules, prefix_tokens, routed_modules

__all__ = ["HFAdapter", "attention_modules", "routed_modules", "prefix_tokens", "hf_block_forwards", "HF_TOKEN_READOUT_MODELS",
           "image_processor_config"]
