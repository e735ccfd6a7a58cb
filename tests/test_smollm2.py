"""End to end on the real SmolLM2-135M-Instruct checkpoint (offline catalogue): NIAH at ~2k tokens."""

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from attnpatch.checkpoints import load_causal_lm

    return load_causal_lm("smollm2-135m-instruct")


def test_niah_single_2k_patched_not_below_dense(smollm2):
    from attnpatch.evals.ruler import run_ruler

    model, tok = smollm2
    res = run_ruler(model, tok, method="anchor_attention", tasks=["niah_single"], lengths=[2048], num_samples=5, recall=True)
    cell = res["cells"][0]
    print({k: v for k, v in cell.items() if k != "samples"})
    assert cell["n"] == 5
    assert 1900 <= cell["tokens"] <= 2048
    assert cell["dense_acc"] >= 0.8  # the dense model finds the needle at 2k
    assert cell["patched_acc"] >= cell["dense_acc"]
    assert 0.02 < cell["sparsity"] < 1.0  # the default really skips work (4.2 % at 2k with pool_stride=2)
    assert 0.9 < cell["recall_mean"] <= 1.0
    assert not hasattr(model, "_attnpatch_handle")  # left unpatched


def test_unpatch_bit_exact_on_real_model(smollm2):
    from attnpatch import patched

    model, tok = smollm2
    ids = tok("The quick brown fox jumps over the lazy dog. " * 80, return_tensors="pt").input_ids[:, :700]
    with torch.no_grad():
        ref = model(ids).logits
        with patched(model, "anchor_attention", min_len=0):
            out = model(ids).logits
        again = model(ids).logits
    assert torch.equal(again, ref)
    assert (out - ref).abs().max() > 0  # sparse at 700 tokens with min_len=0
    assert torch.equal(out.argmax(-1)[0, -50:], ref.argmax(-1)[0, -50:]) or (out - ref).abs().max() < 5
