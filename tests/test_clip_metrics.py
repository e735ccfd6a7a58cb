"""The CLIP metric functions (attnpatch.evals.clip.metrics) against values computed by hand.

Every similarity matrix here is small and written out; the expected ranks and metrics are worked
out in the comments, with CLIP_benchmark's definitions (LAION-AI/CLIP_benchmark,
``zeroshot_classification.py`` / ``zeroshot_retrieval.py``) and this package's tie rule: among equal
scores the lower index ranks first (a stable descending sort). Each expected value is a fraction
checked to float32 precision, so a metric stuck at 0 or 1, or one counting the wrong items, fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnpatch.evals.clip import metrics as cm
from attnpatch.evals.clip import retrieval_recall, zeroshot_accuracy


def frac(num: int, den: int):
    """``num / den`` as the metrics compute it (a float32 mean, returned as a Python float)."""
    return pytest.approx(num / den, abs=1e-6)


# --------------------------------------------------------------------------- zero-shot top-k

# rows: images, columns: 6 classes; the classifier is the identity, so the cosine similarity of
# image n and class c is ZS[n, c] / ||ZS[n]|| (the same positive factor along a row: ranks and
# ties within a row are those of the integers below)
ZS = [
    [5, 1, 1, 0, 0, 0],  # label 0: the highest score                                     -> rank 0
    [3, 3, 2, 0, 0, 0],  # label 1: tied with class 0, which has the lower index            -> rank 1
    [3, 3, 2, 0, 0, 0],  # label 0: tied with class 1, class 0 has the lower index          -> rank 0
    [1, 2, 3, 4, 5, 6],  # label 0: 5 classes above it                                      -> rank 5
    [2, 2, 2, 2, 2, 2],  # label 4: all tied, classes 0..3 have lower indices               -> rank 4
    [0, 0, 0, 0, 1, 0],  # label 5: class 4 above, classes 0..3 tied at lower indices       -> rank 5
    [0, 9, 0, 0, 0, 0],  # label 1                                                          -> rank 0
    [-1, -1, -1, -1, -1, 0],  # label 0: class 5 (0) above; classes tied at -1 all later    -> rank 1
]
ZS_LABELS = [0, 1, 0, 0, 4, 5, 1, 0]
# top-1 prediction: the highest score, lowest index on ties
ZS_PREDICTIONS = [0, 0, 0, 5, 0, 4, 1, 5]


def test_zeroshot_topk_by_hand():
    r = zeroshot_accuracy(torch.tensor(ZS, dtype=torch.float32), torch.eye(6), ZS_LABELS, ks=(1, 2, 5, 6, 10))
    # ranks 0, 1, 0, 5, 4, 5, 0, 1
    assert r["top1"] == frac(3, 8)  # images 0, 2, 6
    assert r["top2"] == frac(5, 8)  # + images 1, 7
    assert r["top5"] == frac(6, 8)  # + image 4 (rank 4); images 3 and 5 (rank 5) miss
    assert r["top6"] == frac(8, 8)
    assert r["top10"] == frac(8, 8)  # k above the number of classes: every image counts
    assert r["predictions"].tolist() == ZS_PREDICTIONS
    assert r["n"] == 8 and r["classes"] == 6


def test_zeroshot_scale_of_embeddings_does_not_matter():
    x = torch.tensor(ZS, dtype=torch.float32) * torch.tensor([[0.5], [3.0], [1.0], [7.0], [0.1], [2.0], [1.0], [4.0]])
    w = torch.eye(6) * 5.0
    r = zeroshot_accuracy(x, w, ZS_LABELS, ks=(1, 5))
    assert r["top1"] == frac(3, 8) and r["top5"] == frac(6, 8)


def test_zeroshot_all_right_and_all_wrong():
    x = torch.eye(6)[[0, 1, 2, 3, 4, 5, 0, 1]]
    assert zeroshot_accuracy(x, torch.eye(6), [0, 1, 2, 3, 4, 5, 0, 1], ks=(1,))["top1"] == 1.0
    r = zeroshot_accuracy(x, torch.eye(6), [1, 2, 3, 4, 5, 0, 1, 2], ks=(1, 5, 6))
    # image n = e_c scores 1 for class c and 0 for the others; its label scores 0, behind class c
    # and behind the tied classes of lower index: ranks 1, 2, 3, 4, 5, 1, 1, 2 (labels 1, 2, 3, 4,
    # 5, 0, 1, 2 against matched classes 0, 1, 2, 3, 4, 5, 0, 1)
    assert r["top1"] == 0.0 and r["top5"] == frac(7, 8) and r["top6"] == frac(8, 8)


# --------------------------------------------------------------------------- retrieval recall@k

# 12 images, 14 texts; images 0 and 1 have two captions each, the others one.
T2I = [0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
# S[t][i]: similarity of text t and image i (made exact by _embed below; zeros omitted in comments)
S = np.zeros((14, 12), dtype=np.int64)
S[0, 0] = 5                            # t0 (img 0)
S[1, 0], S[1, 1:7] = 3, 6              # t1 (img 0): 6 images above its own
S[2, 0], S[2, 1] = 5, 5                # t2 (img 1): tied with image 0 (lower index)
S[3, 1], S[3, 2] = 10, 10              # t3 (img 1): tied with image 2 (higher index)
#                                        t4 (img 2): all zeros
S[5, 3], S[5, 4:12] = 5, 7             # t5 (img 3): 8 images above its own
S[6, 4] = 5                            # t6 (img 4): 10 images above its own
S[6, [0, 1, 2, 3, 5, 6, 7, 8, 9, 10]] = 9
for t, i in zip(range(7, 14), range(5, 12)):  # t7..t13 (img 5..11): own image 10
    S[t, i] = 10
S[7:14, 2] = 1                         # ... and 1 for image 2
S[7:11, 4] = 6                         # t7..t10: 6 for image 4

# text -> image, rank of the text's image in its row:
#   t0: 0 | t1: 6 | t2: 1 (tie, image 0 first) | t3: 0 (tie, own image first) | t4: 2 (all tied:
#   images 0, 1 first) | t5: 8 | t6: 10 | t7..t13: 0
T2I_RANKS = [0, 6, 1, 0, 2, 8, 10, 0, 0, 0, 0, 0, 0, 0]
# image -> text, rank of the image's best caption in its column (the best caption is the
# highest-scoring one; texts scoring higher, or equal at a lower index, come before it):
#   img 0: captions t0 (5), t1 (3): best t0; t6 (9) above                           -> 1
#   img 1: captions t2 (5), t3 (10): best t3; nothing above (t6 9, t1 6)            -> 0
#          (with only its first caption t2 counted it would be 3: t1, t3, t6 above)
#   img 2: caption t4 (0): t1, t3, t6, t7..t13 above (10), t0, t2 tied before (2)   -> 12
#   img 3: caption t5 (5): t1 (6), t6 (9) above                                     -> 2
#   img 4: caption t6 (5): t1 (6), t5 (7), t7..t10 (6) above                        -> 6
#   img 5..11: own caption 10, the highest of the column                            -> 0
I2T_RANKS = [1, 0, 12, 2, 6, 0, 0, 0, 0, 0, 0, 0]


def _embed(sim, k: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """Image and text embeddings whose cosine similarities are exactly ``sim / k``.

    Image ``i`` is the unit vector ``e_i``; text ``t`` is ``[sim[t], 1, 1, ..., 1, 0, ...]`` with as
    many ones (in dimensions no image uses) as make its squared norm ``k**2``. Every text then has
    norm exactly ``k`` (integer sums, exact in float32), so equal integers give exactly tied scores
    even between different texts (the image->text direction compares a column).
    """
    sim = np.asarray(sim, dtype=np.int64)
    nt, ni = sim.shape
    pad = k * k - (sim**2).sum(1)
    assert (pad >= 0).all()
    tx = np.zeros((nt, ni + int(pad.max())), dtype=np.float32)
    tx[:, :ni] = sim
    for t in range(nt):
        tx[t, ni : ni + pad[t]] = 1.0
    im = np.zeros((ni, tx.shape[1]), dtype=np.float32)
    im[np.arange(ni), np.arange(ni)] = 1.0
    return torch.from_numpy(im), torch.from_numpy(tx)


def test_embed_gives_the_similarity_matrix():
    im, tx = _embed(S)
    sc = torch.nn.functional.normalize(tx, dim=-1) @ torch.nn.functional.normalize(im, dim=-1).T
    torch.testing.assert_close(sc * 30, torch.from_numpy(S).float(), rtol=0, atol=1e-5)
    assert sc[0, 0] == sc[2, 0] == sc[2, 1]  # exact ties across texts


def test_retrieval_recall_by_hand():
    im, tx = _embed(S)
    r = retrieval_recall(im, tx, T2I, ks=(1, 5, 10))
    # text -> image over the 14 texts (ranks T2I_RANKS)
    assert r["t2i_recall@1"] == frac(9, 14)  # t0, t3, t7..t13
    assert r["t2i_recall@5"] == frac(11, 14)  # + t2 (rank 1), t4 (rank 2)
    assert r["t2i_recall@10"] == frac(13, 14)  # + t1 (6), t5 (8); t6 (10) misses
    # image -> text over the 12 images (ranks I2T_RANKS)
    assert r["i2t_recall@1"] == frac(8, 12)  # images 1, 5..11
    assert r["i2t_recall@5"] == frac(10, 12)  # + image 0 (1), image 3 (2)
    assert r["i2t_recall@10"] == frac(11, 12)  # + image 4 (6); image 2 (12) misses
    assert r["n_images"] == 12 and r["n_texts"] == 14 and r["ks"] == [1, 5, 10]


def test_retrieval_recall_chunks_do_not_change_it():
    im, tx = _embed(S)
    full = retrieval_recall(im, tx, T2I, ks=(1, 5, 10))
    for chunk in (1, 3, 5):
        assert retrieval_recall(im, tx, T2I, ks=(1, 5, 10), chunk=chunk) == full


def test_retrieval_ranks_match_a_reference_sort():
    """The hand-written ranks above equal those of a plain stable sort (a check on the comments)."""
    s = torch.from_numpy(S).float()
    t2i = torch.tensor(T2I)

    def rank(row: torch.Tensor, positive: torch.Tensor) -> int:
        order = torch.sort(-row, stable=True).indices  # descending, lower index first on ties
        return int(torch.nonzero(positive[order]).min())

    assert [rank(s[t], torch.arange(12) == t2i[t]) for t in range(14)] == T2I_RANKS
    assert [rank(s[:, i], t2i == i) for i in range(12)] == I2T_RANKS


def test_retrieval_counts_any_caption_of_an_image():
    # one image, two texts; the second caption is the match; a second image with its own caption
    im = torch.eye(2)
    tx = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    r = retrieval_recall(im, tx, [0, 0, 1], ks=(1,))
    # image 0: its captions are texts 0 ([0, 1]) and 1 ([1, 0]); text 1 is its top text -> found
    # image 1: text 0 and text 2 tie at 1; text 0 (not its caption) has the lower index -> missed
    assert r["i2t_recall@1"] == frac(1, 2)
    # texts: 0 -> image 1 first (miss), 1 -> image 0 (hit), 2 -> image 1 (hit)
    assert r["t2i_recall@1"] == frac(2, 3)


# --------------------------------------------------------------------------- CLIP_benchmark's code, without ties


def _clip_benchmark_recall(scores: torch.Tensor, positive_pairs: torch.Tensor, k: int) -> torch.Tensor:
    """CLIP_benchmark ``zeroshot_retrieval.recall_at_k``: per query, the fraction of its positives in its top k."""
    nb_texts, nb_images = scores.shape
    topk_indices = torch.topk(scores, k, dim=1)[1]
    nb_positive = positive_pairs.sum(dim=1)
    topk_indices_onehot = torch.nn.functional.one_hot(topk_indices, num_classes=nb_images)
    positive_pairs_reshaped = positive_pairs.view(nb_texts, 1, nb_images)
    nb_true_positive = (topk_indices_onehot * positive_pairs_reshaped).sum(dim=(1, 2))
    return nb_true_positive / nb_positive


def test_matches_clip_benchmark_without_ties():
    g = torch.Generator().manual_seed(0)
    ni, d = 15, 8
    t2i = torch.cat([torch.arange(ni), torch.randint(0, ni, (10,), generator=g)])  # 25 texts, some images with 2-3 captions
    im = torch.randn(ni, d, generator=g)
    tx = im[t2i] + 1.5 * torch.randn(len(t2i), d, generator=g)  # noisy captions: recalls strictly between 0 and 1
    ours = retrieval_recall(im, tx, t2i.numpy(), ks=(1, 5, 10))
    imn, txn = torch.nn.functional.normalize(im, dim=-1), torch.nn.functional.normalize(tx, dim=-1)
    scores = txn @ imn.T
    positive = torch.zeros_like(scores, dtype=torch.long)
    positive[torch.arange(len(t2i)), t2i] = 1
    for k in (1, 5, 10):
        t2i_ref = float((_clip_benchmark_recall(scores, positive, k) > 0).float().mean())
        i2t_ref = float((_clip_benchmark_recall(scores.T, positive.T, k) > 0).float().mean())
        assert ours[f"t2i_recall@{k}"] == pytest.approx(t2i_ref, abs=1e-7)
        assert ours[f"i2t_recall@{k}"] == pytest.approx(i2t_ref, abs=1e-7)
    assert 0 < ours["t2i_recall@1"] < 1 and 0 < ours["i2t_recall@1"] < 1

    # zero-shot: CLIP_benchmark's ``accuracy`` (top-k of the logits)
    labels = torch.randint(0, ni, (40,), generator=g)
    x = im[labels] + 1.5 * torch.randn(40, d, generator=g)
    logits = torch.nn.functional.normalize(x, dim=-1) @ imn.T
    pred = logits.topk(5, 1, True, True)[1].t()
    correct = pred.eq(labels.view(1, -1).expand_as(pred))
    acc = zeroshot_accuracy(x, im, labels.numpy(), ks=(1, 5))
    for k in (1, 5):
        ref = float(correct[:k].reshape(-1).float().sum()) / 40
        assert acc[f"top{k}"] == pytest.approx(ref, abs=1e-7)
    assert 0 < acc["top1"] < 1


def test_best_rank_by_hand():
    scores = torch.tensor([[3.0, 1.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    positive = torch.tensor([[False, False, True, True], [False, False, True, False], [True, False, False, True]])
    # row 0: best positive index 2 (3.0), index 0 ties at a lower index -> 1
    # row 1: all tied, positive at index 2 -> 2
    # row 2: best positive index 3 (4.0), the top -> 0
    assert cm._best_rank(scores, positive).tolist() == [1, 2, 0]
