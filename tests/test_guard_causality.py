"""Causality of AnchorAttention's recall guard (``min_recall > 0``): which outputs depend on which tokens.

With ``guard="global"`` a head's dense/sparse decision is made once per prompt from probe blocks spread over
the whole prompt, so a later token can change the outputs of earlier query blocks; with ``guard="causal"``
query block ``j``'s decision reads the probe blocks at or before ``j`` only, so the output at position ``i``
depends on the tokens up to the end of ``i``'s block only (AnchorConfig docstring, "Which outputs depend on
which tokens").
"""

import math

import pytest
import torch

import attnpatch
from attnpatch.attention.anchor import (
    AnchorConfig,
    anchor_attention,
    anchor_attention_reference,
    dense_causal_attention,
)
from attnpatch.attention.anchor.guard import causal_guard, causal_probe_blocks
from attnpatch.attention.anchor.select import call_geometry, select_kept
from attnpatch.errors import OptionError

BLOCK = 32
# the setting: theta 8, blocks of 32, guard on; dense_last=0 so that the last block is sparse and probed
MODEL_KW = dict(theta=8.0, block_size=BLOCK, init_block=32, local_window=32, min_len=64, dense_last=0, min_recall=0.9, pool_stride=2)


def _need_compiled():
    from attnpatch.attention.backends.cpu_kernel import kernel_supported

    reason = kernel_supported()
    if reason is not None:
        pytest.skip(reason)


def _kernel(kernel: str) -> str:
    if kernel == "compiled":
        _need_compiled()
    return kernel


def _sharp_llama(seed: int = 0):
    """Tiny random Llama (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 128) with q/k weights x20: sharp attention."""
    from tiny_models import tiny_causal_lm

    return tiny_causal_lm("llama", seed, sharpen=20.0)


@pytest.fixture(scope="module")
def llama():
    return _sharp_llama()


def _ids(n: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _perturbed(ids: torch.Tensor, pos: int) -> torch.Tensor:
    out = ids.clone()
    out[:, pos] = (out[:, pos] + 1) % 128
    return out


def _logits(model, ids, attention_mask=None, **options):
    """Logits of ``model`` patched with ``options`` (unpatched when none are given)."""
    with torch.no_grad():
        if not options:
            return model(ids, attention_mask=attention_mask).logits
        with attnpatch.patched(model, "anchor_attention", **options):
            return model(ids, attention_mask=attention_mask).logits


# ------------------------------------------------------------------------------------------- model level


def test_global_guard_lets_a_later_token_change_earlier_logits(llama):
    """The fault: with guard='global' a token in the last block changes the logits of the first blocks
    (and without the guard it does not), so the causal tests below can fail."""
    n = 512
    ids = _ids(n)
    pos = n - 5
    other = _perturbed(ids, pos)
    start = pos // BLOCK * BLOCK
    a = _logits(llama, ids, **MODEL_KW, guard="global")
    b = _logits(llama, other, **MODEL_KW, guard="global")
    assert float((a[:, :start] - b[:, :start]).abs().max()) > 1e-2
    a0 = _logits(llama, ids, **{**MODEL_KW, "min_recall": 0.0})
    b0 = _logits(llama, other, **{**MODEL_KW, "min_recall": 0.0})
    assert torch.equal(a0[:, :start], b0[:, :start])


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
@pytest.mark.parametrize("pos,dense_last", [(507, 0), (300, 0), (507, 64), (400, 64)])
def test_causal_guard_logits_before_the_changed_block_do_not_move(llama, kernel, pos, dense_last):
    """guard='causal': changing the token at ``pos`` leaves every logit before the start of ``pos``'s block as
    it was (bit for bit with the compiled kernel; within 1e-6 on the PyTorch path, whose buckets of blocks
    change float rounding), and the guard does make blocks dense here (the test is not vacuous)."""
    n = 512
    kw = dict(MODEL_KW, dense_last=dense_last, guard="causal", kernel=_kernel(kernel))
    ids = _ids(n)
    start = pos // BLOCK * BLOCK
    a = _logits(llama, ids, **kw)
    b = _logits(llama, _perturbed(ids, pos), **kw)
    if kernel == "compiled":
        assert torch.equal(a[:, :start], b[:, :start])
    else:
        assert float((a[:, :start] - b[:, :start]).abs().max()) <= 1e-6
    assert float((a[:, start:] - b[:, start:]).abs().max()) > 1e-3  # the change itself is seen where it may be
    unguarded = _logits(llama, ids, **{**kw, "min_recall": 0.0})
    assert float((a - unguarded).abs().max()) > 1e-3  # the guard made some blocks dense


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
def test_causal_guard_with_left_padding(llama, kernel):
    """A left-padded batch: each sequence's blocks start at its first real token; changing a token in a
    sequence's last block moves none of its earlier logits, and each row equals the sequence run alone."""
    n, pad = 480, 37
    ids = _ids(n, batch=2, seed=4)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :pad] = 0
    kw = dict(MODEL_KW, guard="causal", kernel=_kernel(kernel))
    pos = n - 3
    a = _logits(llama, ids, mask, **kw)
    b = _logits(llama, _perturbed(ids, pos), mask, **kw)
    start0 = pos // BLOCK * BLOCK
    start1 = pad + (pos - pad) // BLOCK * BLOCK  # blocks of the padded row count from its first real token
    tol = 0.0 if kernel == "compiled" else 1e-6
    assert float((a[0, :start0] - b[0, :start0]).abs().max()) <= tol
    assert float((a[1, pad:start1] - b[1, pad:start1]).abs().max()) <= tol
    alone = _logits(llama, ids[1:, pad:], **kw)
    assert float((a[1, pad:] - alone[0]).abs().max()) < 1e-4


@pytest.mark.parametrize("kw", [dict(theta=1e9), dict(min_recall=1.0)])
@pytest.mark.parametrize("kernel", ["compiled", "torch"])
def test_causal_guard_keeping_every_key_equals_the_unpatched_model(llama, kw, kernel):
    """theta=1e9 (every stripe kept through the sparse path) or min_recall=1.0 (every probed block, and so
    every block that does not keep every causal key, dense) with guard='causal' is the unpatched model."""
    ids = _ids(480, batch=2, seed=6)
    mask = torch.ones(2, 480, dtype=torch.long)
    mask[0, :21] = 0
    ref = _logits(llama, ids, mask)
    out = _logits(llama, ids, mask, **{**MODEL_KW, **kw, "guard": "causal", "kernel": _kernel(kernel)})
    assert float((out[0, 21:] - ref[0, 21:]).abs().max()) < 1e-5
    assert float((out[1] - ref[1]).abs().max()) < 1e-5


def test_guard_option_is_checked(llama):
    with pytest.raises(OptionError, match="guard='future': allowed values are 'global', 'causal'"):
        attnpatch.patch(llama, "anchor_attention", guard="future")
    with pytest.raises(OptionError, match="guard='future'"):
        AnchorConfig(guard="future")


# --------------------------------------------------------------------------------------- attention level


def _qkv(b, h, hkv, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, x, n, d, generator=g) for x in (h, hkv, hkv))
    q[..., 0] *= 3  # a few strong directions: logits spread, thresholds matter
    k[..., 0] *= 3
    return q, k, v


ATT_KW = dict(theta=0.8, block_size=8, init_block=4, local_window=8, min_len=0, pool_stride=None)
GUARD = 0.4  # min_recall at which the causal guard makes some 30-55 % of these random inputs' blocks dense


def _guarded_fraction(q, k, cfg, scale, q_offset=0):
    geo = call_geometry(q, k, cfg.block_size, q_offset, None)
    low = causal_guard(q, k, select_kept(q, k, cfg, scale, geo), geo, cfg, scale)
    return 0.0 if low is None else float(low.float().mean())


def test_global_guard_attention_depends_on_a_later_key():
    """The fault on the attention function: a key in the last block moves a head's probe recall across
    min_recall, and with it the outputs of the first blocks."""
    from attnpatch.attention.anchor.guard import probe_recall

    q, k, v = _qkv(1, 6, 2, 96, 8, seed=21)
    scale = 8**-0.5
    k2 = k.clone()
    k2[:, :, 93] = 4 * q[:, ::3, 94]  # a key the last queries attend to strongly: their kept mass rises
    base = AnchorConfig(**ATT_KW, dense_last=0, recall_probes=3, guard="global")
    rec = []
    for kk in (k, k2):
        geo = call_geometry(q, kk, base.block_size, 0, None)
        rec.append(probe_recall(q, kk, select_kept(q, kk, base, scale, geo), geo, base, scale, 96)[0])
    head = int((rec[0] - rec[1]).abs().argmax())
    assert abs(float(rec[0][head] - rec[1][head])) > 1e-3
    between = float(rec[0][head] + rec[1][head]) / 2
    cfg = AnchorConfig(**ATT_KW, dense_last=0, recall_probes=3, guard="global", min_recall=between)
    a = anchor_attention(q, k, v, cfg, scale=scale)[0]
    b = anchor_attention(q, k2, v, cfg, scale=scale)[0]
    assert float((a[:, :, :88] - b[:, :, :88]).abs().max()) > 1e-3
    causal = AnchorConfig(**{**cfg.__dict__, "guard": "causal"})
    a = anchor_attention(q, k, v, causal, scale=scale)[0]
    b = anchor_attention(q, k2, v, causal, scale=scale)[0]
    assert float((a[:, :, :88] - b[:, :, :88]).abs().max()) <= 1e-6


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
@pytest.mark.parametrize("what", ["q", "k", "v"])
@pytest.mark.parametrize("pos", [93, 50])
@pytest.mark.parametrize("dense_last,q_offset,pad", [(0, 0, None), (5, 0, None), (0, 11, None), (3, 0, [0, 9])])
def test_causal_guard_attention_before_the_changed_block_does_not_move(kernel, what, pos, dense_last, q_offset, pad):
    """guard='causal' on random q/k/v (and a prompt continued on a cache, left padding): changing the query,
    key or value at ``pos`` leaves the outputs of the queries before ``pos``'s block unchanged, while the
    guard makes some but not all blocks dense."""
    b, h, hkv, n, d = 2, 6, 2, 96, 8
    q, k, v = _qkv(b, h, hkv, n + q_offset, d, seed=21)
    q = q[:, :, q_offset:]
    key_valid = None
    if pad is not None:
        key_valid = torch.ones(b, n + q_offset, dtype=torch.bool)
        for i, p in enumerate(pad):
            key_valid[i, :p] = False
    cfg = AnchorConfig(**ATT_KW, dense_last=dense_last, min_recall=GUARD, guard="causal", kernel=_kernel(kernel))
    scale = d**-0.5
    frac = _guarded_fraction(q, k, cfg, scale, q_offset)
    assert 0.2 < frac < 0.8
    x = {"q": q, "k": k, "v": v}
    changed = dict(x)
    changed[what] = x[what].clone()
    p = pos if what == "q" else q_offset + pos
    changed[what][:, :, p] += 3 * torch.randn(x[what].shape[1], d, generator=torch.Generator().manual_seed(1))
    out = anchor_attention(q, k, v, cfg, scale=scale, q_offset=q_offset, key_valid=key_valid)[0]
    out2 = anchor_attention(
        changed["q"], changed["k"], changed["v"], cfg, scale=scale, q_offset=q_offset, key_valid=key_valid
    )[0]
    for bi in range(b):
        first = 0 if pad is None else pad[bi]  # the padded row's blocks count from its first real token
        start = first + (pos - first) // 8 * 8
        diff = float((out[bi, :, first:start] - out2[bi, :, first:start]).abs().max())
        assert diff <= (0.0 if kernel == "compiled" else 1e-6)
    assert float((out - out2).abs().max()) > 1e-3


@pytest.mark.parametrize("kernel", ["compiled", "torch"])
@pytest.mark.parametrize(
    "dense_last,q_offset,pad,dense_heads", [(0, 0, None, ()), (5, 0, None, (1,)), (3, 9, None, ()), (0, 0, [0, 9], ())]
)
def test_causal_guard_matches_the_reference(kernel, dense_last, q_offset, pad, dense_heads):
    """The fast path and the explicit reference agree on the guarded blocks (kept pairs) and the outputs."""
    b, h, hkv, n, d = 2, 6, 2, 88, 8
    q, k, v = _qkv(b, h, hkv, n + q_offset, d, seed=5)
    q = q[:, :, q_offset:]
    key_valid = None
    if pad is not None:
        key_valid = torch.ones(b, n + q_offset, dtype=torch.bool)
        for i, p in enumerate(pad):
            key_valid[i, :p] = False
    cfg = AnchorConfig(**ATT_KW, dense_last=dense_last, min_recall=GUARD, guard="causal", kernel=_kernel(kernel))
    scale = d**-0.5
    assert 0.2 < _guarded_fraction(q, k, cfg, scale, q_offset) < 0.8
    out, st = anchor_attention(
        q, k, v, cfg, scale=scale, q_offset=q_offset, key_valid=key_valid, dense_heads=dense_heads,
        return_stats=True, compute_recall=True,
    )
    ref, kept = anchor_attention_reference(
        q, k, v, cfg, scale=scale, q_offset=q_offset, key_valid=key_valid, dense_heads=dense_heads
    )
    rows = torch.ones(b, n, dtype=torch.bool) if key_valid is None else key_valid[:, q_offset:]
    rows = rows[:, None, :, None]
    assert torch.allclose(out * rows, ref * rows, atol=1e-5)
    assert torch.equal((kept.sum(-1) * rows[..., 0]).sum(-1).double(), st.kept_pairs)
    # the kept mass of the reference's kept keys is the reported recall
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(h // hkv, 1)) * scale
    i = q_offset + torch.arange(n)
    allowed = (torch.arange(n + q_offset)[None, :] <= i[:, None])[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :]
    prob = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    mass = (prob * kept).sum(-1)
    r = rows[..., 0].double()
    assert torch.allclose((mass * r).sum(-1) / r.sum(-1), st.recall, atol=1e-5)


def test_causal_guard_is_prefix_consistent_without_dense_last():
    """guard='causal', dense_last=0, min_len=0: a prompt cut at a block boundary gives the same outputs as the
    same positions of the longer prompt (up to float rounding); dense_last > 0 breaks this (the last queries
    of each prompt attend densely), as documented."""
    q, k, v = _qkv(1, 6, 2, 96, 8, seed=21)
    scale = 8**-0.5
    cfg = AnchorConfig(**ATT_KW, dense_last=0, min_recall=GUARD, guard="causal")
    assert 0.2 < _guarded_fraction(q, k, cfg, scale) < 0.8
    full = anchor_attention(q, k, v, cfg, scale=scale)[0]
    for cut in (40, 64, 88):
        part = anchor_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], cfg, scale=scale)[0]
        assert float((part - full[:, :, :cut]).abs().max()) < 1e-5
    cfg_last = AnchorConfig(**ATT_KW, dense_last=8, min_recall=0.0)
    full = anchor_attention(q, k, v, cfg_last, scale=scale)[0]
    part = anchor_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], cfg_last, scale=scale)[0]
    assert float((part - full[:, :, :64]).abs().max()) > 1e-3
    # and the global guard is not prefix-consistent either, dense_last=0 or not
    cfg_global = AnchorConfig(**ATT_KW, dense_last=0, min_recall=GUARD, recall_probes=3, guard="global")
    full = anchor_attention(q, k, v, cfg_global, scale=scale)[0]
    part = anchor_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], cfg_global, scale=scale)[0]
    assert float((part - full[:, :, :64]).abs().max()) > 1e-3


def test_causal_probe_blocks_do_not_depend_on_the_prompt_length():
    """Probes at f - 1 + (1, 2, 3, 4, 6, 8, 12, ...), f the first block that does not keep every causal key;
    a longer prompt only adds probes after the shorter one's."""
    cfg = AnchorConfig(block_size=128, init_block=128, local_window=128)
    assert causal_probe_blocks(cfg, 0, 128) == [2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97]
    for nb in range(1, 128):
        assert causal_probe_blocks(cfg, 0, nb) == [p for p in causal_probe_blocks(cfg, 0, 128) if p < nb]
    assert causal_probe_blocks(cfg, 1000, 20) == [0, 1, 2, 3, 5, 7, 11, 15]  # continued on a cache: f = 0
    cfg = AnchorConfig(block_size=8, init_block=4, local_window=8)
    assert causal_probe_blocks(cfg, 0, 12) == [1, 2, 3, 4, 6, 8]
    # block f - 1 keeps every causal key, block f does not
    q, k, _ = _qkv(1, 2, 1, 96, 8, seed=3)
    keep = select_kept(q, k, AnchorConfig(theta=-math.inf, block_size=8, init_block=4, local_window=8, min_len=0), 8**-0.5,
                   call_geometry(q, k, 8, 0, None))
    assert bool(keep[0, 0, 0, :8].all()) and not bool(keep[0, 0, 1, :16].all())


def test_causal_guard_dense_blocks_are_exact():
    """Guarded blocks attend densely: min_recall=1.0 makes every block from f on dense, and the earlier
    blocks keep every causal key: the whole output is exact causal attention."""
    q, k, v = _qkv(2, 6, 2, 200, 16, seed=2)
    cfg = AnchorConfig(**{**ATT_KW, "block_size": 16, "local_window": 16}, dense_last=0, min_recall=1.0, guard="causal")
    out = anchor_attention(q, k, v, cfg, scale=0.25)[0]
    assert float((out - dense_causal_attention(q, k, v, scale=0.25)).abs().max()) < 1e-5


@pytest.mark.parametrize("lse", [True, False])
@pytest.mark.parametrize("q_offset,r0,r1", [(0, 0, 90), (0, 16, 85), (7, 40, 48)])
def test_dense_rows_are_exact_causal_attention(monkeypatch, lse, q_offset, r0, r1):
    """The guarded blocks' dense rows on the PyTorch path: flash attention over the keys before the rows
    merged with causal attention over their own keys, or (other devices, inner padding) masked attention in
    chunks of rows; both equal exact causal attention for the selected heads and give zeros elsewhere."""
    from attnpatch.attention.anchor import attend, tiles

    if not lse:
        monkeypatch.setattr(attend, "_lse_path_ok", lambda q, geo: False)
        monkeypatch.setattr(tiles, "CHUNK_ELEMENTS", 7 * (90 + q_offset))  # chunks of 7 rows
    q, k, v = _qkv(2, 6, 2, 90 + q_offset, 16, seed=8)
    q = q[:, :, q_offset:]
    geo = call_geometry(q, k, 8, q_offset, None)
    heads = torch.tensor([True, False, True, True, False, False])
    out = attend.dense_rows_attention(q, k, v, heads, 0.25, geo, r0, r1)
    ref = dense_causal_attention(q, k, v, scale=0.25, q_offset=q_offset)[:, :, r0:r1]
    assert float((out[:, heads] - ref[:, heads]).abs().max()) < 1e-5
    assert not bool(out[:, ~heads].any())


def test_a_prompt_continued_on_a_cache_is_its_own_call():
    """Chunked prefill: a chunk continued on a cache (q_offset > 0) has its own blocks, dense_last and guard
    probes.  With the guard off, dense_last=0 and chunks that are multiples of block_size it equals the
    one-pass prefill exactly; with the guard on (either scope) it does not, as documented."""
    q, k, v = _qkv(1, 6, 2, 96, 8, seed=21)
    scale = 8**-0.5
    for min_recall, guard, equal in ((0.0, "causal", True), (GUARD, "causal", False), (GUARD, "global", False)):
        cfg = AnchorConfig(**ATT_KW, dense_last=0, min_recall=min_recall, guard=guard)
        full = anchor_attention(q, k, v, cfg, scale=scale)[0]
        part = anchor_attention(q[:, :, 48:], k, v, cfg, scale=scale, q_offset=48)[0]
        assert (float((part - full[:, :, 48:]).abs().max()) < 1e-6) == equal
