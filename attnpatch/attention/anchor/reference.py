"""A slow, float64, per-query reference of AnchorAttention (the definition the fast paths are tested against).
"""

from __future__ import annotations

import torch

from .config import AnchorConfig
from ..prefill import check_inputs, split_padding
from .core import anchor_per_sequence
from .guard import causal_probe_blocks, probe_blocks


def anchor_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AnchorConfig,
    *,
    scale: float,
    q_offset: int = 0,
    key_valid: torch.Tensor | None = None,
    dense_heads: list[int] | tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow, explicit AnchorAttention (arXiv 2505.23520 Eq. 2-4) with Python loops, for tests.

    Same arguments and semantics as :func:`anchor_attention` (fp64 arithmetic).

    Returns:
        ``(out, kept)``: ``out`` ``[B, H, Lq, D]`` in ``q.dtype``; ``kept`` ``[B, H, Lq, Lk]`` bool,
        the keys each query attended.  Left-padded sequences are computed with their padding
        stripped (blocks relative to the first real token), exactly as :func:`anchor_attention`.
    """
    check_inputs(q, k, v, scale, q_offset, key_valid)
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    split = split_padding(key_valid, q_offset, lq)
    if split is not None:
        return anchor_per_sequence(
            anchor_attention_reference, q, k, v, cfg, split, scale=scale, q_offset=q_offset, key_valid=key_valid,
            dense_heads=dense_heads, return_stats=False, compute_recall=False,
        )
    g = h // hkv
    bq = cfg.block_size
    out = torch.zeros(b, h, lq, d, dtype=torch.float64)
    kept = torch.zeros(b, h, lq, lk, dtype=torch.bool)
    qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
    valid = torch.ones(b, lk, dtype=torch.bool) if key_valid is None else key_valid.cpu()
    # prompts shorter than min_len run dense; otherwise the last dense_last queries do
    n_sparse = 0 if lq < cfg.min_len_on(q.device) else lq - min(cfg.dense_last, lq)
    nb = -(-lq // bq)
    causal_guard = cfg.guard == "causal"
    probes = set()
    if cfg.min_recall > 0:
        probes = set(causal_probe_blocks(cfg, q_offset, nb) if causal_guard else probe_blocks(cfg, n_sparse))
    for bi in range(b):
        start = next((j for j in range(lk) if valid[bi, j]), lk)
        initial = set(range(start, min(start + cfg.init_block, lk)))
        for hi in range(h):
            kv = hi // g
            sels = {}
            for b0 in range(0, lq, bq):
                rows = list(range(b0, min(b0 + bq, lq)))
                end = q_offset + rows[-1] + 1  # one past the block's last query position
                window = set(range(max(0, end - cfg.local_window), end))
                always = {j for j in initial | window if j < end and valid[bi, j]}
                # anchors of the block's valid queries
                anchors = {}
                for i in rows:
                    p = q_offset + i
                    if not valid[bi, p]:
                        continue
                    cand = [j for j in (initial | window) if j <= p and valid[bi, j]]
                    anchors[i] = max(float(qd[bi, hi, i] @ kd[bi, kv, j]) * scale for j in cand)
                dense_rows = hi in dense_heads or n_sparse == 0
                sel = set(always)
                if not dense_rows and anchors:
                    vis = [i for i in rows if i in anchors]
                    pools = [[i for i in vis if (i - b0) // cfg.stride == p] for p in range(bq // cfg.stride)]
                    for pool in pools:
                        if not pool:
                            continue
                        qbar = sum(qd[bi, hi, i] for i in pool) / len(pool)
                        abar = sum(anchors[i] for i in pool) / len(pool)
                        for j in range(end):
                            if valid[bi, j] and abar - float(qbar @ kd[bi, kv, j]) * scale <= cfg.theta:
                                sel.add(j)
                sels[b0] = (rows, sel, dense_rows)
            # recall guard: exact kept mass over the probe blocks' queries (global: the sparse ones only)
            block_dense = set()  # query block indices that attend densely
            if probes and hi not in dense_heads and n_sparse > 0:
                masses = {}
                for b0, (rows, sel, _) in sels.items():
                    if b0 // bq not in probes:
                        continue
                    for i in rows:
                        p = q_offset + i
                        if (i >= n_sparse and not causal_guard) or not valid[bi, p]:
                            continue
                        cols = [j for j in range(p + 1) if valid[bi, j]]
                        pr = torch.softmax(torch.stack([qd[bi, hi, i] @ kd[bi, kv, j] for j in cols]) * scale, 0)
                        masses.setdefault(b0 // bq, []).append(sum(float(pr[n]) for n, j in enumerate(cols) if j in sel))
                if not causal_guard:
                    allm = [x for m in masses.values() for x in m]
                    if allm and sum(allm) / len(allm) < cfg.min_recall:
                        block_dense = set(range(nb))
                else:
                    # block J: mean recall of the probes <= J, each weighted by the blocks up to the next probe (or J)
                    plist = sorted(probes)
                    rec = {pb: sum(masses[pb]) / len(masses[pb]) if masses.get(pb) else 1.0 for pb in plist}
                    for jb in range(nb):
                        seen = [pb for pb in plist if pb <= jb]
                        if not seen:
                            continue
                        wts = [(seen[n + 1] if n + 1 < len(seen) else jb + 1) - pb for n, pb in enumerate(seen)]
                        if sum(w * rec[pb] for w, pb in zip(wts, seen)) / sum(wts) < cfg.min_recall:
                            block_dense.add(jb)
            for b0, (rows, sel, dense_rows) in sels.items():
                dense_rows = dense_rows or b0 // bq in block_dense
                for i in rows:
                    p = q_offset + i
                    if dense_rows or i >= n_sparse:
                        cols = [j for j in range(p + 1) if valid[bi, j]]
                    else:
                        cols = sorted(j for j in sel if j <= p)
                    if not cols:
                        continue
                    kept[bi, hi, i, cols] = True
                    s = torch.stack([qd[bi, hi, i] @ kd[bi, kv, j] for j in cols]) * scale
                    pr = torch.softmax(s, 0)
                    out[bi, hi, i] = sum(pr[n] * vd[bi, kv, j] for n, j in enumerate(cols))
    return out.to(q.dtype), kept
