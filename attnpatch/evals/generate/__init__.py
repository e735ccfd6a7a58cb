"""Generation agreement, patched against unpatched: ``attnpatch eval generate``.

Greedy generations of a causal LM or a VLM on the same prompts (images optional), dense and under each setting, in
one run: token agreement with dense, the first position where they diverge, the share of prompts generated exactly
as dense does, time to first token (the prefill) and decode tokens per second.  Entry point: :func:`run_generate`.
"""

from .runner import GenerationInput, agreement, image_inputs, load_images, run_generate, text_inputs

__all__ = ["run_generate", "agreement", "GenerationInput", "text_inputs", "image_inputs", "load_images"]
