"""Vision-language models (tiny random LLaVA, LLaVA-NeXT, Idefics3, SmolVLM, Qwen2-VL): each tower read right."""

from __future__ import annotations

import pytest

from attnpatch.patchers.adapters.hf.modules import prefix_tokens, towers_of
from tiny_models import VLM_FAMILIES, tiny_vlm, tiny_dinov2, tiny_hf_clip

# CLS + registers of each family's vision tower, from its structure: LLaVA / LLaVA-NeXT use CLIP's tower (a class
# embedding); Idefics3 / SmolVLM (SigLIP-style) and Qwen2-VL hand every patch to the language model: no CLS
PREFIX = {"llava": 1, "llava_next": 1, "idefics3": 0, "smolvlm": 0, "qwen2_vl": 0}


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_each_vlm_has_a_vision_and_a_text_tower_and_its_prefix_tokens_come_from_its_structure(family):
    model = tiny_vlm(family)
    towers = towers_of(model)
    assert list(towers) == ["vision", "text"] and len(towers["vision"]) == 2 and len(towers["text"]) == 2
    assert prefix_tokens(model, "vision") == PREFIX[family]


def test_prefix_tokens_of_single_tower_vits_and_clip():
    assert prefix_tokens(tiny_dinov2(0), "vision") == 1
    assert prefix_tokens(tiny_dinov2(4), "vision") == 5
    assert prefix_tokens(tiny_hf_clip("clip"), "vision") == 1
    assert prefix_tokens(tiny_hf_clip("siglip"), "vision") == 0
