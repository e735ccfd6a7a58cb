"""Float32 precision of AnchorAttention's Triton path at head dim 128 (three bfloat16 products per tile) against the
PyTorch path, both against float64 causal attention, at ``theta = 1e30`` (every causal key kept by the kernels' rule),
for logits of two sizes.  Runs on the CPU under the Triton interpreter, whose products are the GPU's split products
summed in another order.

    python benchmarks/triton_precision.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before attnpatch decorates its kernels

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnpatch.attention.anchor import AnchorConfig, anchor_attention  # noqa: E402


def main() -> int:
    g = torch.Generator().manual_seed(0)
    n, d = 128, 128
    scale = d ** -0.5
    kw = dict(block_size=16, init_block=16, local_window=16, min_len=0, dense_last=16, min_recall=0.0, theta=1e30)
    for size in (1.0, 6.0):
        q, k = (torch.randn(1, h, n, d, generator=g) * size for h in (2, 1))
        v = torch.randn(1, 1, n, d, generator=g)
        std = float((q[0, 0] @ k[0, 0].T * scale).std())
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                                scale=scale, enable_gqa=True)
        for kernel in ("triton", "torch"):
            out, st = anchor_attention(q, k, v, AnchorConfig(**kw, kernel=kernel), scale=scale, return_stats=True)
            assert float(st.kept_pairs.sum()) == float(st.causal_pairs.sum())  # every key kept
            err = float((out.double() - want).norm() / want.norm())
            print(f"float32, head dim 128, logit std {std:.1f}: kernel={kernel} relative error {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
