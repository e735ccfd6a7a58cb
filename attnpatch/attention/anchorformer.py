"""AnchorFormer's bipartite token-anchor attention, training-free, with anchors that are tokens.

Source: Shan et al. 2025, "AnchorFormer: Differentiable Anchor Attention for Efficient Vision
Transformer" (arXiv 2505.16463), Sec. 3 (bipartite attention between tokens and anchors; global
attention through a Markov process).  The paper learns ``m`` anchor vectors ``U`` (the weights of a
linear layer) and ties queries and keys into one projection ``k``; with ``A_ij = p(u_j | v_i) =
softmax_j(k_i u_j^T c)`` ``[N, m]`` it estimates the token-to-token transition of attention by a
two-step Markov chain token -> anchor -> token, ``p(v_j | v_i) = sum_l p(u_l | v_i) p(v_j | u_l)``,
with ``p(v_j | u_l)`` from Bayes' rule under a uniform prior on the tokens,
``p(v_j | u_l) = A_jl / sum_t A_tl``:

    P = A Delta^{-1} A^T,   Delta = diag(A^T 1)  ([m, m], the anchors' degrees),
    out = A (Delta^{-1} (A^T V))                  (right to left: O(N m D), never N x N).

``P 1 = A Delta^{-1} A^T 1 = A 1 = 1``: ``Delta`` is the diagonal normaliser that makes the
product row-stochastic, so every output row is a convex combination of value rows.

**Training-free form used here** (:func:`anchor_bipartite_attention`).  A pretrained model has
no anchor vectors and separate queries and keys, so the anchors are ``m`` tokens ``a_1..a_m``
(chosen by the caller: farthest-point sampling, CLS and registers always among them), and each
side of the chain uses the model's own attention logits, query against key:

* token -> anchor (the query side): ``A_q = softmax_l(q_i . k_{a_l} c)`` ``[N, m]``, attention of
  every query over the anchors' keys (the paper's ``A`` with the anchor vector in key space);
* anchor -> token (the key side): ``A_k = softmax_l(k_j . q_{a_l} c)`` ``[N, m]``, each key's
  distribution over the anchors by the anchors' queries (the paper's ``A`` with the anchor vector
  in query space), turned around by Bayes' rule: ``p(v_j | a_l) = A_k[j, l] / Delta_l`` with
  ``Delta = diag(A_k^T 1)``;
* ``out = A_q . Delta^{-1} . A_k^T . V``, row-stochastic as above.

With tied queries and keys (``Q = K``) both sides are one matrix and this is the paper's formula
with ``U = K[anchors]`` (``tests/test_anchorformer.py`` checks it against the official code's
expression).  ``Delta^{-1} A_k^T V`` is computed as a softmax over the keys of the logits
``log A_k[j, l]`` (a column-wise softmax, max-shifted): an anchor whose column underflows in
floating point gets a well-defined average instead of ``0 / 0`` (the official code sets such an
anchor's ``1 / Delta`` to 0).

**How it differs from Nyström** (:mod:`attnpatch.attention.nystrom`, :mod:`.nystromformer`):
Nyström attention is ``softmax(Q K~^T c) . pinv(softmax(Q~ K~^T c)) . softmax(Q~ K^T c) . V``: the
two ``N x m`` factors are joined by the pseudo-inverse of the ``m x m`` landmark kernel, which
makes it exact when every token is a landmark but can amplify errors (the kernel of a pretrained
ViT is badly conditioned).  The bipartite product joins them by a *diagonal* normaliser
``Delta^{-1}`` (no inverse of an anchor kernel, no ``m x m`` matrix at all): the result is always
a convex combination of value rows (stable in any dtype), but it is not exact for any number of
anchors (with every token an anchor it is ``A_q Delta^{-1} A_k^T``, two softmax steps, not one).
"""

from __future__ import annotations

import torch

from .landmarks.select import gather_tokens

__all__ = ["anchor_bipartite_attention", "KEY_CHUNK_ELEMENTS"]

_HALF = (torch.float16, torch.bfloat16)

#: Keys are processed in chunks of ``max(256, KEY_CHUNK_ELEMENTS // (heads x m))`` tokens, so one
#: chunk's ``[heads, chunk, m]`` logits hold at most about this many float32 elements per item.
KEY_CHUNK_ELEMENTS = 1 << 22


def anchor_bipartite_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    anchors: torch.Tensor,
    *,
    scale: float,
    key_chunk: int | None = None,
) -> torch.Tensor:
    """Bipartite token-anchor attention ``A_q . Delta^{-1} . A_k^T . V`` (module docstring).

    ``A_q = softmax(Q K_a^T c)`` ``[N, m]`` (softmax over the anchors), ``A_k = softmax(K Q_a^T c)``
    ``[N, m]`` (softmax over the anchors, per key), ``Delta = diag(A_k^T 1)`` ``[m]``;
    ``K_a, Q_a`` the anchors' keys and queries.  Evaluated right to left:
    ``W = Delta^{-1} A_k^T V`` ``[m, Dv]`` (each row a convex combination of value rows), computed
    over chunks of keys with a running column maximum (an online softmax over the keys of
    ``log A_k``), then ``out = A_q W``, one fused attention call (``N`` queries over the ``m``
    anchor keys).  No ``N x N`` tensor; the ``[chunk, m]`` logits are the largest buffer.

    Half-precision inputs (bfloat16, float16): the logits ``K Q_a^T c``, ``log A_k`` and ``W`` are
    float32; ``W`` is cast to the input dtype for the last attention call (a convex combination of
    value rows, so within their range), which accumulates in float32.

    Args:
        q: ``[B, H, N, D]`` queries; k: ``[B, Hkv, N, D]`` keys; v: ``[B, Hkv, N, Dv]`` values
            (``H`` a multiple of ``Hkv``: grouped-query attention).  Non-causal, no padding.
        anchors: ``[B, m]`` int64 token indices (shared by the heads), ``1 <= m``; distinct
            indices are expected (a repeated anchor counts twice).
        scale: attention scale ``c`` (usually ``D ** -0.5``).
        key_chunk: keys per chunk (default: ``max(256, KEY_CHUNK_ELEMENTS // (H m))``, independent
            of the batch size, so a row's result does not depend on its batch mates).

    Returns:
        ``[B, H, N, Dv]`` in ``q``'s dtype.  Peak extra memory ``O(B H (chunk m + (m + D) N))``
        elements.
    """
    b, h, n, _ = q.shape
    m = anchors.shape[1]
    if k.shape[1] != h:
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
    wd = torch.float32 if q.dtype in _HALF else q.dtype
    q_a = gather_tokens(q, anchors).to(wd) * scale  # [B,H,m,D]
    k_a = gather_tokens(k, anchors)  # [B,H,m,D]
    step = key_chunk or max(256, KEY_CHUNK_ELEMENTS // max(1, h * m))
    run_max = acc = den = None
    for c0 in range(0, n, step):
        kc, vc = k[:, :, c0 : c0 + step].to(wd), v[:, :, c0 : c0 + step].to(wd)
        logits = kc @ q_a.transpose(-1, -2)  # [B,H,c,m]: key j against anchor query l
        log_ak = torch.log_softmax(logits, dim=-1)  # log A_k: each key's distribution over the anchors
        cmax = log_ak.amax(dim=-2)  # [B,H,m]
        if run_max is None:
            new_max = cmax
        else:
            new_max = torch.maximum(run_max, cmax)
            shrink = torch.exp(run_max - new_max)  # [B,H,m]
            acc = acc * shrink[..., None]
            den = den * shrink
        e = torch.exp(log_ak - new_max[:, :, None, :])  # [B,H,c,m], A_k / exp(column max)
        part = e.transpose(-1, -2) @ vc  # [B,H,m,Dv]
        acc = part if acc is None else acc + part
        den = e.sum(dim=-2) if den is None else den + e.sum(dim=-2)
        run_max = new_max
    w = acc / den[..., None]  # Delta^{-1} A_k^T V; den >= 1 (the column maximum contributes exp(0))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return sdpa(q, k_a, w.to(q.dtype), scale=scale)
