"""Frozen-feature metrics on embeddings whose answers are known by hand or by brute force."""

import math

import numpy as np
import pytest
import torch

from attnpatch.errors import DataError, OptionError
from attnpatch.evals.vision.metrics import (
    image_retrieval,
    knn_classify,
    linear_probe,
    prediction_agreement,
)


def _circle(degrees):
    """Unit vectors in the plane at the given angles: cosine similarity = cos(angle difference)."""
    a = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    return np.stack([np.cos(a), np.sin(a)], axis=1).astype(np.float32)


def _clusters(n_classes=3, per_class=5, dim=8, noise=0.05, seed=0):
    rng = np.random.default_rng(seed)
    centres = np.eye(dim)[:n_classes] * 5.0
    x = np.concatenate([c + noise * rng.standard_normal((per_class, dim)) for c in centres]).astype(np.float32)
    y = np.repeat(np.arange(n_classes), per_class)
    return x, y


# ----------------------------------------------------------------------------- separated clusters


def test_perfectly_separated_clusters_score_one():
    x, y = _clusters()
    knn = knn_classify(x, y, k=4)
    assert knn["top1"] == 1.0 and knn["top5"] == 1.0
    np.testing.assert_array_equal(knn["predictions"], y)
    ret = image_retrieval(x, y, ks=(1, 4))
    assert ret["recall@1"] == 1.0 and ret["recall@4"] == 1.0 and ret["map_at_r"] == 1.0
    assert ret["skipped_queries"] == 0 and ret["map_queries"] == 15
    lp = linear_probe(x, y, folds=5)
    assert lp["mean"] == 1.0 and lp["std"] == 0.0 and lp["folds"] == 5 and len(lp["fold_accuracies"]) == 5


# ----------------------------------------------------------------------------- retrieval by hand


def test_map_at_r_hand_built_five_points():
    # angles 0, 12, 20, 35, 90 degrees; labels A A B A B (A = 0, B = 1). Rankings (most similar first):
    #   q0 (A,  0): 12(A) 20(B) 35(A) 90(B)  R=2  AP = (1/2)(1/1*1 + 1/2*0)         = 1/2
    #   q1 (A, 12): 20(B)  0(A) 35(A) 90(B)  R=2  AP = (1/2)(1/1*0 + 1/2*1)         = 1/4
    #   q2 (B, 20): 12(A) 35(A)  0(A) 90(B)  R=1  AP = 0
    #   q3 (A, 35): 20(B) 12(A)  0(A) 90(B)  R=2  AP = (1/2)(0 + 1/2)               = 1/4
    #   q4 (B, 90): 35(A) 20(B) ...          R=1  AP = 0
    # mAP@R = (1/2 + 1/4 + 0 + 1/4 + 0) / 5 = 0.2
    # recall@1: only q0 finds a same-class item first -> 1/5; recall@2: q0, q1, q3, q4 -> 4/5
    x = _circle([0, 12, 20, 35, 90])
    y = np.array([0, 0, 1, 0, 1])
    ret = image_retrieval(x, y, ks=(1, 2))
    assert ret["map_at_r"] == pytest.approx(0.2)
    assert ret["recall@1"] == pytest.approx(0.2)
    assert ret["recall@2"] == pytest.approx(0.8)
    assert ret["queries"] == 5 and ret["skipped_queries"] == 0 and ret["ks"] == [1, 2]


def test_retrieval_skips_queries_without_other_same_class_items():
    # a third class with one member (R = 0): skipped for mAP@R, a miss for recall
    x = _circle([0, 5, 90, 95, 200])
    y = np.array([0, 0, 1, 1, 2])
    ret = image_retrieval(x, y, ks=(1,))
    assert ret["skipped_queries"] == 1 and ret["map_queries"] == 4
    assert ret["map_at_r"] == 1.0
    assert ret["recall@1"] == pytest.approx(4 / 5)


def test_retrieval_recall_cutoff_larger_than_n_is_clamped():
    x = _circle([0, 12, 20, 35, 90])
    y = np.array([0, 0, 1, 0, 1])
    ret = image_retrieval(x, y, ks=(50,))
    assert ret["recall@50"] == 1.0  # every query has a same-class item among all others


def _brute_map_at_r(x, y):
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = xn @ xn.T
    np.fill_diagonal(s, -np.inf)
    aps = []
    for q in range(len(y)):
        r = int((y == y[q]).sum() - 1)
        if r == 0:
            continue
        order = np.argsort(-s[q])[:r]
        rel = (y[order] == y[q]).astype(float)
        prec = np.cumsum(rel) / np.arange(1, r + 1)
        aps.append((prec * rel).sum() / r)
    return float(np.mean(aps))


def test_map_at_r_matches_brute_force_on_random_features():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((60, 16)).astype(np.float32)
    y = rng.integers(0, 4, size=60)
    assert image_retrieval(x, y)["map_at_r"] == pytest.approx(_brute_map_at_r(x.astype(np.float64), y), abs=1e-9)


def test_recall_at_1_equals_knn_top1_at_k1():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((80, 12)).astype(np.float32)
    y = rng.integers(0, 5, size=80)
    y[0] = 99  # a singleton class: a miss for both
    knn = knn_classify(x, y, k=1)
    ret = image_retrieval(x, y, ks=(1,))
    assert ret["recall@1"] == pytest.approx(knn["top1"])
    # and the 1-NN prediction is the label of the most similar other item
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = xn @ xn.T
    np.fill_diagonal(s, -np.inf)
    np.testing.assert_array_equal(knn["predictions"], y[np.argmax(s, axis=1)])


# ----------------------------------------------------------------------------- k-NN


def test_knn_weighting_changes_the_vote():
    # query q (class 1) at 0 deg; one class-1 neighbour at 8 deg (cos 0.990) and two class-0
    # neighbours at +-37 deg (cos 0.799). With k = 3:
    #   T = 0.07: weight exp(0.990/0.07) = e^14.1 beats 2 * exp(0.799/0.07) = 2 e^11.4 -> class 1
    #   T = 100 : all weights ~ 1, so the 2 class-0 votes win                       -> class 0
    x = _circle([0, 8, 37, -37])
    y = np.array([1, 1, 0, 0])
    sharp = knn_classify(x, y, k=3, temperature=0.07)
    flat = knn_classify(x, y, k=3, temperature=100.0)
    assert sharp["predictions"][0] == 1
    assert flat["predictions"][0] == 0
    w1 = math.exp(math.cos(math.radians(8)) / 0.07)
    w0 = 2 * math.exp(math.cos(math.radians(37)) / 0.07)
    assert w1 > w0  # the hand computation behind the first assertion


def _brute_dino_knn(x, y, k, t):
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = xn @ xn.T
    np.fill_diagonal(s, -np.inf)
    classes = np.unique(y)
    preds = []
    for q in range(len(y)):
        nn = np.argsort(-s[q])[:k]
        votes = {c: 0.0 for c in classes}
        for j in nn:
            votes[y[j]] += math.exp(s[q, j] / t)
        preds.append(max(classes, key=lambda c: votes[c]))
    return np.array(preds)


def test_knn_matches_brute_force_dino_rule():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 10)).astype(np.float32)
    y = rng.integers(0, 6, size=50) * 7 + 3  # non-contiguous labels
    for k, t in [(1, 0.07), (5, 0.07), (10, 0.5)]:
        got = knn_classify(x, y, k=k, temperature=t)
        want = _brute_dino_knn(x.astype(np.float64), y, k, t)
        np.testing.assert_array_equal(got["predictions"], want)
        assert got["top1"] == pytest.approx(float(np.mean(want == y)))
        assert set(np.unique(got["predictions"])) <= set(np.unique(y))


def test_knn_k_is_clamped_and_recorded():
    x, y = _clusters(n_classes=2, per_class=3)
    out = knn_classify(x, y, k=100)
    assert out["k"] == 5 and out["k_requested"] == 100 and out["n"] == 6 and out["classes"] == 2


def test_knn_top5_ignores_classes_without_votes():
    # 8 singleton-ish classes, k = 1: only one class gets a vote, so top-5 = top-1 here
    x = _circle([0, 40, 80, 120, 160, 200, 240, 280])
    y = np.arange(8)
    out = knn_classify(x, y, k=1)
    assert out["top1"] == 0.0 and out["top5"] == 0.0


def test_knn_excludes_the_query_but_keeps_exact_duplicates():
    x = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], dtype=np.float32)
    y = np.array([0, 0, 1, 1])
    assert knn_classify(x, y, k=1)["top1"] == 1.0
    assert image_retrieval(x, y, ks=(1,))["map_at_r"] == 1.0


def test_accepts_torch_tensors():
    x, y = _clusters()
    out = knn_classify(torch.from_numpy(x).double(), torch.from_numpy(y), k=3)
    assert out["top1"] == 1.0 and out["predictions"].dtype == np.int64


# ----------------------------------------------------------------------------- linear probe


def test_linear_probe_drops_singletons_and_reduces_folds():
    x, y = _clusters(n_classes=3, per_class=3, dim=3)  # every dimension carries class signal
    x = np.concatenate([x, np.full((1, x.shape[1]), 9.0, dtype=np.float32)])
    y = np.concatenate([y, [7]])  # a singleton class
    out = linear_probe(x, y, folds=5)
    assert out["dropped_classes"] == 1 and out["dropped_samples"] == 1
    assert out["folds"] == 3 and out["folds_requested"] == 5
    assert out["n"] == 9 and out["classes"] == 3 and out["mean"] == 1.0


def test_linear_probe_is_deterministic_and_near_chance_on_noise():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((120, 6)).astype(np.float32)
    y = np.repeat(np.arange(4), 30)
    a = linear_probe(x, y, folds=4, seed=1)
    b = linear_probe(x, y, folds=4, seed=1)
    assert a == b
    assert a["converged"] and a["folds"] == 4 and a["n"] == 120 and a["classes"] == 4
    assert a["mean"] == pytest.approx(np.mean(a["fold_accuracies"]))
    # chance is 1/4 (measured 0.25 exactly); 5 binomial standard deviations on 120 samples: 0.20
    assert abs(a["mean"] - 0.25) < 5 * math.sqrt(0.25 * 0.75 / 120)
    # one feature carrying the class lifts it well above chance (measured 0.72), so it is not stuck near chance
    x[:, 0] += 3.0 * y
    assert linear_probe(x, y, folds=4, seed=1)["mean"] > 0.6


def test_linear_probe_errors():
    x, y = _clusters()
    with pytest.raises(OptionError, match="folds=1"):
        linear_probe(x, y, folds=1)
    with pytest.raises(OptionError, match="C=0"):
        linear_probe(x, y, C=0)
    with pytest.raises(DataError, match="at least 2 classes"):
        linear_probe(x[:6], np.array([0, 0, 0, 0, 0, 1]))


# ----------------------------------------------------------------------------- agreement and errors


def test_prediction_agreement():
    assert prediction_agreement([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    assert prediction_agreement(np.array([5]), torch.tensor([5])) == 1.0
    with pytest.raises(DataError, match="differ in length"):
        prediction_agreement([1, 2], [1])
    with pytest.raises(DataError, match="empty"):
        prediction_agreement([], [])
    with pytest.raises(DataError, match="1-D"):
        prediction_agreement(np.zeros((2, 2)), np.zeros((2, 2)))


def test_input_errors():
    x, y = _clusters()
    with pytest.raises(DataError, match="rows"):
        knn_classify(x, y[:-1])
    with pytest.raises(DataError, match="2-D"):
        knn_classify(x[0], y[:1])
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(DataError, match="non-finite"):
        image_retrieval(bad, y)
    with pytest.raises(DataError, match="integer"):
        knn_classify(x, y + 0.5)
    with pytest.raises(DataError, match="at least 2"):
        knn_classify(x[:1], y[:1])
    with pytest.raises(OptionError, match="k=0"):
        knn_classify(x, y, k=0)
    with pytest.raises(OptionError, match="temperature=0"):
        knn_classify(x, y, temperature=0)
    with pytest.raises(OptionError, match="ks"):
        image_retrieval(x, y, ks=())
    with pytest.raises(OptionError, match="ks entry=0"):
        image_retrieval(x, y, ks=(0, 1))
