"""End to end on the real SmolLM2-135M-Instruct checkpoint (offline catalogue): NIAH at ~2k tokens."""

import pytest
import torch

pytestmark = pytest.mark.slow


def test_niah_single_2k_patched_not_below_dense(smollm2):
    from attnpatch.evals.ruler.runner import run_ruler

    model, tok = smollm2
    # the accuracy-first preset: sparse from 512 tokens (the defaults run dense below the CPU's break-even length)
    res = run_ruler(model, tok, method="anchor_attention", options={"preset": "accurate"}, tasks=["niah_single"],
                    lengths=[2048], num_samples=5, recall=True)
    cell = res["cells"][0]
    print({k: v for k, v in cell.items() if k != "samples"})
    assert cell["n"] == 5
    assert 1900 <= cell["tokens"] <= 2048
    assert cell["dense_acc"] >= 0.8  # the dense model finds the needle at 2k
    assert cell["patched_acc"] >= cell["dense_acc"]
    assert 0.02 < cell["sparsity"] < 1.0  # the preset really skips work (4.2 % at 2k with pool_stride=2)
    assert 0.9 < cell["recall_mean"] <= 1.0
    assert not hasattr(model, "_attnpatch_patches")  # left unpatched


def test_defaults_run_the_models_own_attention_below_the_break_even_length(smollm2):
    from attnpatch import patched, record_stats
    from attnpatch.attention.anchor.config import BREAK_EVEN

    model, tok = smollm2
    ids = tok("The quick brown fox jumps over the lazy dog. " * 400, return_tensors="pt").input_ids[:, :min(BREAK_EVEN["cpu"] - 1, 3071)]
    with torch.no_grad():
        ref = model(ids).logits
        with patched(model, "anchor_attention"), record_stats(model) as rec:
            got = model(ids).logits
    assert {r.mode for r in rec.forwards[0].values()} == {"dense:short"}
    assert torch.equal(got, ref)  # handed back to the model's own attention: bit for bit


def test_unpatch_bit_exact_on_real_model(smollm2):
    import math

    from attnpatch import patched

    model, tok = smollm2
    ids = tok("The quick brown fox jumps over the lazy dog. " * 80, return_tensors="pt").input_ids[:, :700]
    with torch.no_grad():
        ref = model(ids).logits
        with patched(model, "anchor_attention", min_len=0, pool_stride=2):  # the accurate preset's pooling
            out = model(ids).logits
        again = model(ids).logits
        with patched(model, "anchor_attention", min_len=0, theta=1e9):  # every key kept, through the sparse path
            kept_all = model(ids).logits
        with patched(model, "anchor_attention", min_len=0, theta=math.inf):  # exact limit: dispatched to dense
            inf = model(ids).logits
    assert torch.equal(again, ref)
    assert torch.equal(inf, ref)
    scale = float(ref.abs().max())  # 35.86 here
    # measured: max |kept_all - ref| = 7.4e-5 (2.1e-6 of max |logit|): float rounding of the stripe-gathered softmax only
    assert float((kept_all - ref).abs().max()) <= 1e-5 * scale
    # theta=12, pool_stride=2 at 700 tokens, min_len=0: measured max |out - ref| = 0.065 logit and a largest per-position
    # KL(ref || out) of 1.3e-5 nats, argmax equal at all 700 positions.  Tolerances are ~3x the measurement; a
    # broken selection fails them: theta=4 gives 2.4 / 7.6e-3, theta=-inf (init block + window only) 27 / 7.2
    # (and both still agree on the argmax of the last 50 positions of this repetitive text, which the old check was).
    diff = float((out - ref).abs().max())
    kl = torch.nn.functional.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    assert 0 < diff < 0.2  # sparse at 700 tokens with min_len=0, yet close
    assert float(kl.max()) < 4e-5
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
