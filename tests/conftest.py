import os

import pytest
import torch

# FNA's min_tokens="auto" runs exact attention below the device's break-even token count (600 on CPU), which every
# tiny test model is under: the suite approximates at every size (subprocesses inherit it); the tests of min_tokens
# itself set their own value
os.environ["ATTNPATCH_FNA_BREAK_EVEN"] = "0"

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def tiny_causal_lm(kind: str, seed: int = 0, layers: int = 2, vocab: int = 128):
    """A randomly initialised Llama / Qwen2 / Qwen3 of a few hundred thousand parameters."""
    from transformers import (
        LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    cfg = cls[0](
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = cls[1](cfg).eval()
    # sharpen attention so that thresholds select something (random init gives near-uniform attention)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
            layer.self_attn.k_proj.weight.mul_(6.0)
    return model


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def causal_lm(request):
    return tiny_causal_lm(request.param)


@pytest.fixture(scope="module")
def tiny_vit_dir(tmp_path_factory):
    """A tiny random DINOv2 (4 layers, 26 tokens at 70 px) saved with its image processor, as a model folder."""
    from transformers import Dinov2Config, Dinov2Model

    from attnpatch.checkpoints import dinov2_image_processor

    d = tmp_path_factory.mktemp("tiny-dinov2")
    torch.manual_seed(0)
    cfg = Dinov2Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, image_size=70, patch_size=14)
    Dinov2Model(cfg).eval().save_pretrained(d)
    dinov2_image_processor().save_pretrained(d)
    return d


def write_image_folder(root, n: int, shape=(64, 64, 3), classes: int = 3):
    """``n`` random images in ``datasets``' imagefolder layout (``root/train/*.png`` + ``metadata.jsonl``), class
    ``i % classes`` (the classes differ in brightness); returns ``root``."""
    import json

    import numpy as np
    from PIL import Image

    (root / "train").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        label = i % classes
        Image.fromarray((rng.random(shape) * 60 + 60 * label).astype(np.uint8)).save(root / "train" / f"img{i:02d}.png")
        rows.append({"file_name": f"img{i:02d}.png", "label": label})
    (root / "train" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory):
    """A tiny random Llama (:func:`tiny_causal_lm`) saved with a chat-template tokenizer, as a model folder."""
    from test_ruler_tasks import _make_tokenizer

    d = tmp_path_factory.mktemp("tiny-llama")
    tok = _make_tokenizer(chat=True)
    tiny_causal_lm("llama", vocab=len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d
