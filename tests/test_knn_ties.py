"""k-NN ties: equally similar neighbours of different classes are chosen by label, never by row order."""

import numpy as np
import pytest

from attnpatch.evals.vision.metrics import knn_classify


def _tied_set():
    """Items whose nearest neighbours tie exactly across classes (duplicate vectors with different labels).

    * ``q0 = [1, 0]`` (class 0) and ``q1 = [0, 1]`` (class 4): their nearest others are the ten identical
      ``[1, 1]`` items (cosine 0.707 each), of classes 9, 8, ..., 1 and 2 -- more than faiss returns at once.
    * each ``[1, 1]`` item's nearest others are the nine other ``[1, 1]`` items (cosine 1).
    """
    x = np.array([[1, 0], [0, 1]] + [[1, 1]] * 10, dtype=np.float32)
    y = np.array([0, 4, 9, 8, 7, 6, 5, 4, 3, 2, 1, 2])
    return x, y


@pytest.mark.parametrize("k", [1, 2, 3])
def test_knn_ties_do_not_depend_on_row_order(k):
    x, y = _tied_set()
    n = len(y)
    rng = np.random.default_rng(0)
    perms = [np.arange(n), np.arange(n)[::-1].copy(), *(rng.permutation(n) for _ in range(3))]
    base = knn_classify(x, y, k=k)
    for p in perms:
        out = knn_classify(x[p], y[p], k=k)
        back = np.empty(n, dtype=np.int64)
        back[p] = out["predictions"]  # row i of the permuted set is item p[i]
        np.testing.assert_array_equal(back, base["predictions"], err_msg=f"k={k}, permutation {p.tolist()}")
        assert out["top1"] == base["top1"] and out["top5"] == base["top5"]


def test_knn_tie_rule_prefers_the_lower_label():
    x, y = _tied_set()
    # k = 1: the ten [1, 1] items tie for q0 and q1 -> the lowest label among them, 1; each [1, 1] item -> the lowest
    # label among the nine others (1, or 2 for the item of class 1)
    assert knn_classify(x, y, k=1)["predictions"].tolist() == [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 1]
    assert knn_classify(x[::-1], y[::-1], k=1)["predictions"][::-1].tolist() == [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 1]
    # equal summed votes: two equally similar neighbours of classes 5 and 3 -> class 3, in either row order
    x2 = np.array([[1, 0], [1, 1], [1, 1], [0, 1]], dtype=np.float32)
    for y2 in (np.array([0, 5, 3, 7]), np.array([0, 3, 5, 7])):
        assert knn_classify(x2, y2, k=2)["predictions"][0] == 3
