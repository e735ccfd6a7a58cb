import os

import pytest
import torch

# Without a CUDA device, Triton kernels (attnpatch.attention.landmarks.fps_triton) run on CPU tensors under Triton's
# interpreter.  Triton reads the variable when a kernel is decorated (when attnpatch imports the module), so it is set
# here, before any attnpatch import; on a CUDA machine the kernels compile for the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# FNA's min_tokens="auto" runs exact attention below the device's break-even token count (600 on CPU), which every
# tiny test model is under: the suite approximates at every size (subprocesses inherit it); the tests of min_tokens
# itself set their own value
os.environ["ATTNPATCH_FNA_BREAK_EVEN"] = "0"

# Threads: one for the tiny-model tests (their ops are too small to gain from a second thread, and two OpenMP threads
# wait on each other whenever another process holds a core: a battery case took 2.4 s with two threads beside another
# PyTorch process, 0.09 s with one), up to two for the `slow` tests' real checkpoints.  Set per test and put back
# after it, so a CLI run's --threads does not carry over into the tests after it.
THREADS = max(1, min(2, torch.get_num_threads()))
torch.set_num_threads(1)

from tiny_models import tiny_causal_lm, tiny_dinov2  # noqa: E402  (tests import tiny_causal_lm from here too)


@pytest.fixture(autouse=True)
def _torch_threads(request):
    torch.set_num_threads(THREADS if request.node.get_closest_marker("slow") else 1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct of the offline catalogue, ``(model, tokenizer)``, loaded once per session (prepared
    on first use); every test that takes it leaves it unpatched and in float32."""
    from attnpatch.checkpoints import load_causal_lm

    return load_causal_lm("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def dinov2_small():
    """The real DINOv2-S of the offline catalogue, ``(model, image processor)``, loaded once per session (prepared on
    first use); every test that takes it leaves it unpatched and in float32."""
    from attnpatch.checkpoints import load_vision_model

    return load_vision_model("dinov2-small")


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def causal_lm(request):
    return tiny_causal_lm(request.param)


@pytest.fixture(scope="module")
def tiny_vit_dir(tmp_path_factory):
    """A tiny random DINOv2 (4 layers, 26 tokens at 70 px) saved with its image processor, as a model folder."""
    from attnpatch.checkpoints import dinov2_image_processor

    d = tmp_path_factory.mktemp("tiny-dinov2")
    tiny_dinov2().save_pretrained(d)
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
