"""Fast Nyström Attention (FNA): Nyström-approximated softmax attention on landmark tokens.

Source: "Fast Nyström Attention" (arXiv 2507.16018).  With ``Q, K, V`` ``[N, D]`` per head
and the queries/keys of ``s`` landmark *tokens* ``Q~ = Q[L], K~ = K[L]``:

    softmax(Q K^T c) V  ~=  softmax(Q K~^T c) . pinv(softmax(Q~ K~^T c)) . softmax(Q~ K^T c) . V

(``c`` = the attention scale), the Nyström form of Nyströmformer (Xiong et al. 2021, Eq. 13)
with landmarks that are real tokens picked by farthest-point sampling (FPS) instead of
segment means.  It is evaluated right to left, ``F @ (pinv(A) @ (B @ V))``, so nothing of
size ``N x N`` is ever formed: time ``O(s N D)``, memory ``O(s N + N D)``; the two ``N x s``
products run as fused attention calls.

Landmark selection lives in :mod:`attnpatch.attention.landmarks` (``fps`` by default), the pseudo-inverse of the
``s x s`` landmark kernel in :mod:`.pinv` (``"rtol"``, ``"newton"``, ``"exact"``; on CUDA ``"rtol"`` runs from matrix
products only, so with FPS's Triton kernel the whole layer is CUDA-graph capturable), the BLAS thread control in
:mod:`attnpatch.attention.backends.blas`, exact attention (the methods' fallback) in :mod:`attnpatch.attention.exact`.
The landmark kernel of a pretrained ViT is badly conditioned, so the exact pseudo-inverse amplifies the approximation
error; the defaults of :class:`attnpatch.patchers.methods.fna.FNAConfig` were chosen by measurement (docs/methods.md
and docs/benchmarks/vision.md).

All functions are pure tensor functions: ``q, k, v`` are ``[batch, heads, tokens, head_dim]``.
"""

from __future__ import annotations

import torch

from ..backends.blas import local_blas_threads
from ..landmarks.select import gather_tokens
from .pinv import landmark_pinv_work

__all__ = ["RENORM_MIN_MASS", "nystrom_attention"]

_HALF = (torch.float16, torch.bfloat16)


def nystrom_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    landmarks: torch.Tensor,
    *,
    scale: float,
    pinv: str = "rtol",
    rtol: float = 1e-2,
    iters: int = 6,
    key_keep: torch.Tensor | None = None,
    renormalize: bool = False,
    pinv_kernel: str = "auto",
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Nyström attention on landmark tokens, evaluated right to left (no ``N x N`` tensor).

    ``out = F @ (pinv(A) @ (B @ V))`` with ``F = softmax(Q K~^T c)`` ``[N, s]``,
    ``A = softmax(Q~ K~^T c)`` ``[s, s]``, ``B = softmax(Q~ K^T c)`` ``[s, N]`` (FNA, arXiv
    2507.16018, Eq. 3; Nyströmformer Eq. 13).  With every token a landmark and ``pinv="exact"``
    this equals exact attention up to floating-point error.

    Without ``key_keep``, ``B @ V`` is attention of the ``s`` landmark queries over all ``N``
    keys and ``F @ W`` attention of all ``N`` queries over the ``s`` landmark keys, so both run
    as fused ``scaled_dot_product_attention`` calls (no ``[N, s]`` buffer either; the speed against
    SDPA over all keys is in docs/benchmarks/cpu.md).

    Half-precision inputs (bfloat16, float16): the landmark kernel's logits, its
    pseudo-inverse and ``W = pinv(A) (B V)`` are computed in float32 and the pseudo-inverse is
    never cast back (``pinv="exact"`` can exceed float16's range); ``F W`` runs in the
    input dtype for ``pinv="rtol"`` (``||pinv|| <= 1/rtol`` keeps ``W`` small; in float16 ``W``
    is also scaled by an exact power of two when ``max|W| > 2^12``) and in float32 for
    ``"exact"`` and ``"newton"``; with ``key_keep`` and ``renormalize`` every logit and product
    is float32.  The small ``s x s`` work runs on one MKL thread on the CPU
    (:func:`~attnpatch.attention.backends.blas.local_blas_threads`).

    Args:
        q, k, v: ``[B, H, N, D]`` (same head count; non-causal).
        landmarks: ``[B, s]`` token indices (shared by the heads).
        scale: attention scale ``c`` (usually ``D ** -0.5``).
        pinv, rtol, iters: see :func:`~.pinv.landmark_pinv`.
        key_keep: ``[B, N]`` bool or ``None``; keys marked ``False`` get zero attention
            probability (sink masking in Nyström form: their columns of ``B`` are zeroed after
            the softmax, FNA Sec. 4; computed as ``B (keep * V)``, the same fused calls as
            without a mask).
        renormalize: with ``key_keep``, renormalise each output row to its remaining attention
            mass instead of leaving the mass removed (the estimator, one that cannot divide by a
            mass near or below zero, is described in :func:`_renormalized`).
        pinv_kernel: the ``"rtol"`` pseudo-inverse's kernel (:func:`~.pinv.landmark_pinv`'s ``kernel``).
        key_bias: ``[B, N]`` float or ``None``: a logit added to each key, as in ``softmax(Q K^T c + 1 b^T)``
            (ToMe's proportional attention, ``b = log(size)``, arXiv 2210.09461 Eq. 1).  It enters every factor
            whose keys it belongs to: ``F`` and ``A`` take ``b~ = b[L]``, ``B`` takes ``b``.  In kernel form
            ``exp(Q K^T c) diag(e^b)`` is approximated by ``exp(Q K~^T c) diag(e^b~) (exp(Q~ K~^T c) diag(e^b~))^+
            exp(Q~ K^T c) diag(e^b)``, whose ``diag(e^b~)`` factors cancel: the Nyström form of the biased kernel,
            exact with every token a landmark.  Not with ``renormalize``.

    Returns:
        ``[B, H, N, D]`` in ``q``'s dtype.  Peak extra memory ``O(B H (s + D) N)`` elements
        (``O(B H s N)`` more with ``renormalize``).
    """
    half = q.dtype in _HALF
    wd = torch.float32 if half else q.dtype  # the small s x s work: float32 for half inputs
    if key_bias is not None and key_keep is not None and renormalize:
        raise ValueError("nystrom_attention: key_bias with renormalised key_keep is not implemented")
    bias_all = bias_l = None
    if key_bias is not None:
        bias_all = key_bias[:, None, None, :]  # [B,1,1,N]
        bias_l = key_bias.gather(1, landmarks)[:, None, None, :]  # [B,1,1,s]
    if key_keep is not None and not renormalize:
        # B_kept V = B (keep * V): zeroing the masked keys' values is zeroing their columns of B
        # after the softmax, so plain sink masking takes the fused path below
        v = v * key_keep[:, None, :, None].to(v.dtype)
        key_keep = None
    q_l = gather_tokens(q, landmarks)
    k_l = gather_tokens(k, landmarks)
    with local_blas_threads(1, q.device):
        logits = (q_l.to(wd) * scale) @ k_l.to(wd).transpose(-1, -2)
        a = torch.softmax(logits if bias_l is None else logits + bias_l.to(wd), dim=-1)  # [B,H,s,s]
        z = landmark_pinv_work(a, pinv, rtol, iters, kernel=pinv_kernel).to(wd)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if key_keep is None:
        # B V = softmax(Q~ K^T c) V and F W = softmax(Q K~^T c) W are attention calls themselves
        # (s queries over N keys; N queries over s keys): two fused kernels, no [N, s] buffer.
        bv = sdpa(q_l, k, v, attn_mask=_mask(bias_all, q), scale=scale)  # [B,H,s,D], convex combinations of V rows
        fmask = _mask(bias_l, q)
        with local_blas_threads(1, q.device):
            w = z @ bv.to(wd)  # [B,H,s,D] in float32 for half inputs
        if not half:
            return sdpa(q, k_l, w.to(q.dtype), attn_mask=fmask, scale=scale)
        if pinv != "rtol":
            # exact / Newton-Schulz: z is unbounded (1e5-1e6 on a ViT's kernel) and W cancels in
            # F W, so the last product runs in float32 too (rounding W to half would cost
            # |W| x 2^-11 absolutely, and float16 cannot even hold it).  Where the unregularised
            # estimate itself leaves float16's range (9.5e3 in float32 where exact attention
            # gives 1.2, on a kernel sharpened 200x) the cast saturates instead of making inf.
            out = sdpa(q.to(wd), k_l.to(wd), w, attn_mask=_mask(bias_l, w), scale=scale)
            if q.dtype == torch.float16:
                big = torch.finfo(torch.float16).max
                out = out.clamp(-big, big)
            return out.to(q.dtype)
        # rtol: ||z||_2 <= 1 / (rtol sigma_max) <= 1 / rtol (sigma_max >= 1 for a row-stochastic
        # kernel), so W stays within a few hundred x max|V|; float16 still gets a guard: W is
        # divided by a power of two (exact; 1 unless max|W| > 2^12) and the output multiplied back.
        if q.dtype == torch.float16:
            c = torch.exp2(torch.ceil(torch.log2(w.abs().amax((-2, -1), keepdim=True) / 4096.0)).clamp(min=0.0))
            return sdpa(q, k_l, (w / c).to(q.dtype), attn_mask=fmask, scale=scale).mul_(c.to(q.dtype))
        return sdpa(q, k_l, w.to(q.dtype), attn_mask=fmask, scale=scale)
    # renormalised sink masking: the masked B is needed explicitly ([B,H,s,N] and [B,H,N,s]; O(s N)
    # memory), with the logits in float32 for half inputs (the raw products overflow float16 first)
    qw, kw, vw = q.to(wd), k.to(wd), v.to(wd)
    q_lw, k_lw = q_l.to(wd), k_l.to(wd)
    f = torch.softmax(qw @ (k_lw * scale).transpose(-1, -2), dim=-1)  # [B,H,N,s]
    bm = torch.softmax((q_lw * scale) @ kw.transpose(-1, -2), dim=-1)  # [B,H,s,N]
    bm = bm * key_keep[:, None, None, :].to(wd)
    return _renormalized(f, z, bm, vw).to(q.dtype)


def _mask(bias: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A ``[B, 1, 1, N]`` key bias as an SDPA float mask in ``like``'s dtype (``None`` stays ``None``)."""
    return None if bias is None else bias.to(like.dtype)


#: Renormalised sink masking keeps the ratio estimate where the estimated kept mass is above this.
RENORM_MIN_MASS = 0.1


def _renormalized(f: torch.Tensor, z: torch.Tensor, bm: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Sink-masked Nyström attention with each row renormalised to its kept attention mass.

    ``f`` ``[.., N, s]``, ``z`` ``[.., s, s]``, ``bm`` ``[.., s, N]`` (B with the masked keys'
    columns zeroed), ``v`` ``[.., N, D]``.  Two estimates of row ``i`` of ``P_kept / m_i``:

    * ratio: ``F z (B_kept V) / F z (B_kept 1)``: consistent with unmasked FNA (exact with
      every token a landmark), but the Nyström estimate of the kept mass ``m_i`` in the
      denominator can be near or below zero (where the exact kept mass is not), and dividing by
      it amplifies the
      Nyström error without bound (the earlier ``clamp(min=1e-6)`` multiplied such rows by 1e6);
    * rows: ``F z (B' V)`` with each landmark query's row of ``B_kept`` renormalised over the kept
      keys (``B`` holds complete softmax rows, so their kept mass is exact and ``B' V`` is a
      convex combination of V rows): bounded by construction, but it interpolates the landmarks'
      normalisations instead of using the query's own.

    The ratio is used where the estimated mass exceeds :data:`RENORM_MIN_MASS` (0.1: the
    division amplifies the Nyström error at most 10x), rows elsewhere.  The rule and its threshold
    were chosen by measurement (final-CLS cosine to dense of ``fna+sink_mask`` with
    ``renormalize=True`` on dinov2-small: docs/benchmarks/vision.md); ``tests/test_precision.py`` holds the
    image whose estimated kept mass goes below zero.
    """
    kept = bm.sum(-1, keepdim=True)  # [.., s, 1] exact kept mass of each landmark query's row
    bn = torch.where(kept > 0, bm / kept.clamp(min=torch.finfo(bm.dtype).tiny), bm)
    d = v.shape[-1]
    # one chain for the three right-hand sides: [B_kept V | B_kept 1 | B' V]
    rhs = torch.cat([bm @ v, kept, bn @ v], dim=-1)
    with local_blas_threads(1, f.device):
        w = z @ rhs
    y = f @ w
    num, mass, rows = y[..., :d], y[..., d : d + 1], y[..., d + 1 :]
    ok = mass > RENORM_MIN_MASS
    return torch.where(ok, num / torch.where(ok, mass, 1.0), rows)
