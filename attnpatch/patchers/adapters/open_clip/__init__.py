"""open_clip adapter: binds a method to open_clip's transformer towers by class swap of their attention modules.

open_clip (``open_clip_torch``) builds its ViT image tower (``open_clip.transformer.VisionTransformer``)
and its text tower (``TextTransformer``, or the ``transformer`` of the ``CLIP`` class) from
``ResidualAttentionBlock`` (attention: ``torch.nn.MultiheadAttention``) or
``CustomResidualAttentionBlock`` (attention: open_clip's own ``open_clip.transformer.Attention``,
used when qk-norm, scaled-cosine attention, head scaling or inner norms are configured). The
attention module of every block of a routed tower gets its class swapped for a subclass whose
``forward`` computes ``q, k, v`` exactly as the original does (the packed ``in_proj`` projection,
open_clip's ``ln_q`` / ``ln_k``, scaled-cosine logits folded into ``q``) and routes the attention
itself through :func:`attnpatch.patchers.runtime.run_layer`. A call the method hands back (``dense``, ``fna`` below
``min_tokens`` or with ``s >= N``, ``sink_mask`` outside its masked layers or with no sink found) runs the module's
own forward, bit for bit the unpatched one (``nn.MultiheadAttention``'s fused inference kernel included); where the
forward asks for the attention tensors (capture, teacher forcing, a probe, timing) it runs exact scaled-dot-product
attention on the same ``q, k, v`` (with the call's mask) instead, equal up to rounding. Unpatching swaps the original class
back, so the module computes bit for bit what it did before.

Towers: ``"vision"`` (kind ``"vision"``: bidirectional, one class token first, so
``handle.prefix_tokens = 1``) and ``"text"`` (kind ``"text"``: causal, 77 tokens; only ``dense``
fits it). ``patch(model, ...)`` routes the vision tower by default. The model passed may be a
whole open_clip model (``CLIP``, ``CustomTextCLIP``, ``CoCa``) or its ``visual`` tower alone.

Per-forward state: ``model(...)``, ``model.encode_image(x)``, ``model.visual(x)`` and
``model.visual.transformer(x)`` each get exactly one :class:`~attnpatch.patchers.state.ForwardState`
(the model, the tower and its block stack are all roots; nested calls share the outer state).

Not covered: image towers that are not a ``VisionTransformer`` (``ModifiedResNet`` for the RN50
family, ``TimmModel`` trunks such as open_clip's SigLIP / ConvNeXt models -- a timm ViT trunk can
be patched directly with ``patch(model.visual.trunk, ...)`` through the timm adapter), and
Hugging Face text encoders (``HFTextEncoder``).

Modules: :mod:`.adapter` (:class:`OpenClipAdapter`), :mod:`.towers` (towers and their blocks),
:mod:`.forwards` (the routed attention forwards and the block forwards for token merging).
"""

from .adapter import OpenClipAdapter
from .forwards import open_clip_block_forwards
from .towers import tower_modules

__all__ = ["OpenClipAdapter", "tower_modules", "open_clip_block_forwards"]
