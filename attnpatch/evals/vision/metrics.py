"""Frozen-feature metrics: k-NN classification, linear probe, retrieval, prediction agreement.

Pure functions on feature matrices (``numpy`` arrays or ``torch`` tensors, ``[N, D]``) and integer
labels (``[N]``, any int values: they need not be contiguous). They compare what a dense and a
patched model *represent*, without training the model: the same metric on the two feature sets,
plus :func:`prediction_agreement` between their predictions.

Definitions and sources
-----------------------
* :func:`knn_classify` -- weighted k-NN classifier of DINO (Caron et al., "Emerging Properties in
  Self-Supervised Vision Transformers", ICCV 2021; ``knn_classifier`` in their ``eval_knn.py``):
  cosine similarity of L2-normalised features, the ``k`` most similar items, each voting for its
  class with weight ``exp(sim / T)``; the prediction is the class with the largest summed weight.
  Here it is run leave-one-out on one set (each image against all others), as a self-contained
  eval for a small labelled set. Top-5 ranks classes by summed weight.
* :func:`image_retrieval` -- each image queries all others by cosine similarity; ``recall@k`` is
  the fraction of queries with at least one same-class item among the top ``k`` (the "Recall@K"
  of the deep-metric-learning literature, e.g. Song et al. 2016), and ``mAP@R`` is the metric of
  Musgrave, Belongie & Lim, "A Metric Learning Reality Check" (ECCV 2020): for a query with ``R``
  other same-class items, ``AP@R = (1/R) * sum_{i=1..R} P(i) * rel(i)``, where ``rel(i)`` is 1 if the
  ``i``-th retrieved item is of the query's class and ``P(i)`` is the precision of the top ``i``;
  ``mAP@R`` is its mean over queries.
* :func:`linear_probe` -- multinomial logistic regression (scikit-learn ``LogisticRegression``,
  L-BFGS) on standardised features (``StandardScaler`` fitted on each training fold only),
  scored by accuracy under stratified k-fold cross-validation (``StratifiedKFold``).

Nearest neighbours are found exactly with faiss (``IndexFlatIP`` on L2-normalised float32
features, i.e. cosine similarity), in chunks of queries, so memory is ``O(chunk * depth)`` beyond
the features. A zero feature vector stays zero after normalisation (similarity 0 to everything).
k-NN recomputes the similarities of faiss's candidates in float64 and breaks ties by class label, so its
result does not depend on the order of the rows (see :func:`knn_classify`).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ...errors import DataError, OptionError

__all__ = ["image_retrieval", "knn_classify", "linear_probe", "prediction_agreement"]

_CHUNK = 4096  # queries per faiss search call


# ----------------------------------------------------------------------------- helpers


def _to_numpy(x, what: str) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        x = x.detach().cpu()
        if x.dtype.is_floating_point:
            x = x.float()
        x = x.numpy()
    try:
        return np.asarray(x)
    except Exception as err:  # pragma: no cover - exotic inputs
        raise DataError(f"{what}: cannot convert {type(x).__name__} to an array ({err})") from err


def _check_inputs(features, labels, min_n: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """``features [N, D]`` float32 (finite) and ``labels [N]`` int64, or DataError."""
    x = _to_numpy(features, "features")
    y = _to_numpy(labels, "labels")
    if x.ndim != 2:
        raise DataError(f"features: expected a 2-D array [N, D], got shape {tuple(x.shape)}")
    if y.ndim != 1:
        raise DataError(f"labels: expected a 1-D array [N], got shape {tuple(y.shape)}")
    if x.shape[0] != y.shape[0]:
        raise DataError(f"features has {x.shape[0]} rows but labels has {y.shape[0]} entries")
    if x.shape[0] < min_n:
        raise DataError(f"need at least {min_n} items, got {x.shape[0]}")
    if x.shape[1] < 1:
        raise DataError("features: D = 0 (no feature dimensions)")
    if not np.issubdtype(y.dtype, np.integer):
        if np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
            y = y.astype(np.int64)
        else:
            raise DataError(f"labels: expected integer class labels, got dtype {y.dtype}")
    x = np.asarray(x, dtype=np.float32)
    if not np.all(np.isfinite(x)):
        raise DataError(f"features: {int((~np.isfinite(x)).sum())} non-finite values (NaN or inf)")
    return x, y.astype(np.int64)


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.maximum(norms, 1e-12), dtype=np.float32)


def _check_pos_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise OptionError(f"{name}={value!r}: must be a positive int")
    return int(value)


def _neighbours(x: np.ndarray, depth: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(start, sims [c, depth], idx [c, depth])`` chunk by chunk: each row's ``depth`` most
    cosine-similar *other* rows of ``x`` (already L2-normalised), most similar first.

    The query itself is removed by index (not by rank), so an exact duplicate of the query still
    counts as a neighbour. ``depth`` must be at most ``N - 1``.
    """
    import faiss

    n, d = x.shape
    index = faiss.IndexFlatIP(d)
    index.add(x)
    for start in range(0, n, _CHUNK):
        q = x[start : start + _CHUNK]
        c = q.shape[0]
        sims, idx = index.search(q, depth + 1)
        self_mask = idx == np.arange(start, start + c)[:, None]
        has_self = self_mask.any(axis=1)
        self_mask[~has_self, -1] = True  # self fell outside depth + 1 (ties): drop the last one instead
        keep = ~self_mask
        yield start, sims[keep].reshape(c, depth), idx[keep].reshape(c, depth)


# ----------------------------------------------------------------------------- k-NN

_SIM_SLACK = 1e-3  # bound on faiss's float32 error of a cosine similarity (it only decides when to fetch more)
_GATHER = 1 << 23  # candidate entries (queries x candidates x D) gathered at once for the exact similarities
_SEARCH = 1 << 22  # faiss results (queries x candidates) per search call when more candidates are fetched


def _knn_neighbours(x: np.ndarray, inv: np.ndarray, k: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Yield ``(start, sims [c, k] float64, idx [c, k])`` chunk by chunk: each row's ``k`` nearest *other* rows
    of ``x`` (already L2-normalised), in the order ``(-similarity, class, row)``.

    faiss proposes candidates; their similarities are then recomputed exactly (float64, the same arithmetic
    for every pair, so equal vectors give equal similarities wherever they sit), and a row fetches more
    candidates (doubling) until every item that could tie with or beat its ``k``-th neighbour has been seen.
    So which neighbours are chosen among equal similarities does not depend on the order of the rows
    (the lower class wins; among one class the row index only orders items whose votes are equal).
    ``k`` must be at most ``N - 1``; ``inv`` is the ``[N]`` class index of each row.
    """
    import faiss

    n, d = x.shape
    index = faiss.IndexFlatIP(d)
    index.add(x)
    x64 = x.astype(np.float64)
    for start in range(0, n, _CHUNK):
        rows = np.arange(start, min(n, start + _CHUNK))
        out_s = np.empty((rows.shape[0], k), dtype=np.float64)
        out_i = np.empty((rows.shape[0], k), dtype=np.int64)
        todo = np.arange(rows.shape[0])
        fetch = min(n, 2 * k + 2)
        while todo.size:
            again = []
            for s0 in range(0, todo.size, max(1, _SEARCH // fetch)):  # faiss's result arrays stay bounded
                t_all = todo[s0 : s0 + max(1, _SEARCH // fetch)]
                fs_all, fi_all = index.search(x[rows[t_all]], fetch)
                step = max(1, _GATHER // (fetch * d))
                for g0 in range(0, t_all.size, step):
                    t, fs, fi = t_all[g0 : g0 + step], fs_all[g0 : g0 + step], fi_all[g0 : g0 + step]
                    q = rows[t]
                    valid = fi >= 0
                    cand = np.where(valid, fi, 0)
                    exact = (x64[cand] * x64[q][:, None, :]).sum(axis=-1)  # [c, fetch]
                    exact[~valid | (cand == q[:, None])] = -np.inf  # the query itself (by index) and padding go last
                    order = np.lexsort((cand, inv[cand], -exact), axis=-1)[:, :k]
                    ss = np.take_along_axis(exact, order, axis=1)
                    ii = np.take_along_axis(cand, order, axis=1)
                    # an item faiss did not return has similarity <= its last one (+ float32 error): it cannot
                    # tie with the k-th neighbour if that bound is below the k-th similarity
                    unsure = (fs[:, -1].astype(np.float64) + _SIM_SLACK >= ss[:, -1]) if fetch < n else np.zeros(t.size, dtype=bool)
                    out_s[t[~unsure]] = ss[~unsure]
                    out_i[t[~unsure]] = ii[~unsure]
                    again.append(t[unsure])
            todo = np.concatenate(again)
            fetch = min(n, fetch * 2)
        yield start, out_s, out_i


def knn_classify(features, labels, k: int = 20, temperature: float = 0.07) -> dict[str, Any]:
    """Leave-one-out weighted k-NN classification (DINO's ``eval_knn``), with faiss.

    Every item is classified from its ``k`` most cosine-similar *other* items: neighbour ``j``
    votes for its class with weight ``exp(s_j / T)`` (``s_j`` = cosine similarity in [-1, 1]), and
    classes are ranked by summed weight. Unlike DINO's ``sort`` over all classes, a class that got
    no vote never counts as a top-5 hit (relevant when fewer than 5 classes are voted for).

    Ties are broken deterministically, so the result does not depend on the order of the rows:
    neighbours are ranked by ``(-similarity, class label, row)`` -- among items equally similar to
    the query, those of the smaller label are taken first (e.g. with ``k = 1`` and two equally
    similar items of classes 3 and 5, class 3 is predicted), and every item tied with the ``k``-th
    neighbour is considered, not only those faiss happened to return; equal summed weights are
    broken by the smaller class label. Similarities are recomputed exactly (float64) for the
    neighbours faiss proposes, so "equal" means equal to the last bit (e.g. duplicate images).

    Args:
        features: ``[N, D]`` float features (numpy or torch), one row per item; need not be normalised.
        labels: ``[N]`` integer class labels.
        k: number of neighbours (positive int); clamped to ``N - 1``.
        temperature: ``T > 0`` of the vote weights (DINO: 0.07). Large ``T`` approaches an
            unweighted majority vote; small ``T`` approaches 1-NN.

    Returns:
        dict with ``top1`` and ``top5`` (fractions in [0, 1] of the ``N`` items whose true class is
        ranked first / among the first 5), ``predictions`` (``[N]`` int64, predicted label of each
        item), ``k`` (neighbours used, after clamping), ``k_requested``, ``temperature``, ``n``
        (``N``) and ``classes`` (number of distinct labels).

    Raises:
        DataError: features not ``[N, D]``, labels not ``[N]`` integers, ``N < 2``, or non-finite features.
        OptionError: ``k`` not a positive int or ``temperature`` not a positive finite number.
    """
    x, y = _check_inputs(features, labels)
    k_req = _check_pos_int(k, "k")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not np.isfinite(temperature) or temperature <= 0:
        raise OptionError(f"temperature={temperature!r}: must be a positive number")
    n = x.shape[0]
    k_eff = min(k_req, n - 1)
    classes, inv = np.unique(y, return_inverse=True)
    n_cls = classes.shape[0]
    xn = _normalise(x)
    predictions = np.empty(n, dtype=np.int64)
    hit1 = np.zeros(n, dtype=bool)
    hit5 = np.zeros(n, dtype=bool)
    for start, sims, idx in _knn_neighbours(xn, inv, k_eff):
        c = sims.shape[0]
        # exp((s - s_max) / T): the same ranking as exp(s / T), without overflow for tiny T
        w = np.exp((sims - sims[:, :1]) / float(temperature))
        votes = np.zeros((c, n_cls), dtype=np.float64)
        np.add.at(votes, (np.repeat(np.arange(c), k_eff), inv[idx].ravel()), w.ravel())
        order = np.argsort(-votes, axis=1, kind="stable")  # stable: equal votes -> smaller class label first
        truth = inv[start : start + c]
        predictions[start : start + c] = classes[order[:, 0]]
        hit1[start : start + c] = order[:, 0] == truth
        top = order[:, : min(5, n_cls)]
        voted = votes[np.arange(c), truth] > 0
        hit5[start : start + c] = (top == truth[:, None]).any(axis=1) & voted
    return {
        "top1": float(hit1.mean()),
        "top5": float(hit5.mean()),
        "predictions": predictions,
        "k": int(k_eff),
        "k_requested": int(k_req),
        "temperature": float(temperature),
        "n": int(n),
        "classes": int(n_cls),
    }


# ----------------------------------------------------------------------------- retrieval


def image_retrieval(features, labels, ks: Sequence[int] = (1, 5)) -> dict[str, Any]:
    """Leave-one-out retrieval by cosine similarity: recall@k and mAP@R (Musgrave et al. 2020).

    Each item queries all other items (itself excluded), ranked by cosine similarity (faiss,
    exact). A retrieved item is relevant when it has the query's label.

    * ``recall@k``: fraction of all ``N`` queries with at least one relevant item in the top
      ``min(k, N - 1)``. A query whose class has no other member counts as a miss, so
      ``recall@1`` equals :func:`knn_classify`'s ``top1`` at ``k = 1`` (when no two classes tie for a
      query's nearest item: retrieval keeps faiss's order among ties, k-NN prefers the lower label).
    * ``mAP@R``: for a query with ``R`` = number of other items of its class,
      ``AP@R = (1/R) * sum_{i=1..R} P(i) * rel(i)`` over the top ``R`` results (``P(i)`` =
      relevant fraction of the top ``i``, ``rel(i)`` in {0, 1}), averaged over the queries with
      ``R >= 1``; queries with ``R = 0`` are skipped and counted in ``skipped_queries``.

    Args:
        features: ``[N, D]`` float features (numpy or torch), ``N >= 2``.
        labels: ``[N]`` integer class labels.
        ks: cut-offs for recall (positive ints; duplicates removed, sorted).

    Returns:
        dict with ``"recall@<k>"`` for each ``k`` (fraction in [0, 1]), ``map_at_r`` (in [0, 1], or
        ``None`` if every query was skipped), ``ks`` (list), ``queries`` (``N``),
        ``map_queries`` (queries with ``R >= 1``) and ``skipped_queries`` (queries with ``R = 0``).

    Raises:
        DataError: features not ``[N, D]``, labels not ``[N]`` integers, ``N < 2``, or non-finite features.
        OptionError: ``ks`` empty or holding a value that is not a positive int.
    """
    x, y = _check_inputs(features, labels)
    if isinstance(ks, numbers.Integral):
        ks = (ks,)
    ks = sorted({_check_pos_int(k, "ks entry") for k in ks})
    if not ks:
        raise OptionError("ks: empty; give at least one cut-off, e.g. (1, 5)")
    n = x.shape[0]
    _, inv, counts = np.unique(y, return_inverse=True, return_counts=True)
    r_all = counts[inv] - 1  # [N] other same-class items per query
    depth = int(min(n - 1, max(max(ks), int(r_all.max()))))
    xn = _normalise(x)
    hits = {k: 0 for k in ks}
    ap_sum, ap_count = 0.0, 0
    for start, _sims, idx in _neighbours(xn, depth):
        c = idx.shape[0]
        truth = inv[start : start + c]
        rel = inv[idx] == truth[:, None]  # [c, depth]
        for k in ks:
            hits[k] += int(rel[:, : min(k, depth)].any(axis=1).sum())
        r = r_all[start : start + c]
        mask = np.arange(depth)[None, :] < r[:, None]  # first R positions of each query
        rel_r = rel & mask
        prec = np.cumsum(rel_r, axis=1) / np.arange(1, depth + 1)[None, :]
        valid = r > 0
        ap = (prec * rel_r).sum(axis=1)[valid] / r[valid]
        ap_sum += float(ap.sum())
        ap_count += int(valid.sum())
    out: dict[str, Any] = {f"recall@{k}": hits[k] / n for k in ks}
    out.update({
        "map_at_r": (ap_sum / ap_count) if ap_count else None,
        "ks": list(ks),
        "queries": int(n),
        "map_queries": int(ap_count),
        "skipped_queries": int(n - ap_count),
    })
    return out


# ----------------------------------------------------------------------------- linear probe


def linear_probe(
    features, labels, folds: int = 5, seed: int = 0, C: float = 1.0, max_iter: int = 1000
) -> dict[str, Any]:
    """Cross-validated accuracy of a logistic-regression probe on frozen features.

    Pipeline per fold: ``StandardScaler`` (fitted on the training part) then scikit-learn
    ``LogisticRegression(C=C, max_iter=max_iter)`` (multinomial, L-BFGS, L2 penalty), trained on
    ``folds - 1`` folds and scored by accuracy on the held-out fold; folds come from
    ``StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)``.

    Small classes: a class with a single item cannot be split into train and test, so singleton
    classes are dropped (counted in ``dropped_classes`` / ``dropped_samples``). If the smallest
    remaining class has fewer than ``folds`` items, the number of folds is reduced to that size
    (``folds`` in the result; ``folds_requested`` keeps the argument).

    Args:
        features: ``[N, D]`` float features (numpy or torch).
        labels: ``[N]`` integer class labels.
        folds: requested number of folds (int >= 2).
        seed: seed of the fold shuffling (int).
        C: inverse L2 regularisation strength of ``LogisticRegression`` (positive).
        max_iter: L-BFGS iteration limit per fold (positive int).

    Returns:
        dict with ``mean`` and ``std`` (mean and population standard deviation of the per-fold
        accuracies, fractions in [0, 1]), ``fold_accuracies`` (list), ``folds``, ``folds_requested``,
        ``n`` (items used), ``classes`` (classes used), ``dropped_classes``, ``dropped_samples``,
        ``converged`` (False if any fold hit ``max_iter``), ``C`` and ``seed``.

    Raises:
        DataError: bad shapes or non-finite features (as in :func:`knn_classify`), or fewer than 2
            classes with at least 2 items each.
        OptionError: ``folds`` < 2, or ``C`` / ``max_iter`` not positive.
    """
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = _check_inputs(features, labels)
    if isinstance(folds, bool) or not isinstance(folds, numbers.Integral) or folds < 2:
        raise OptionError(f"folds={folds!r}: must be an int >= 2")
    if isinstance(C, bool) or not isinstance(C, numbers.Real) or not np.isfinite(C) or C <= 0:
        raise OptionError(f"C={C!r}: must be a positive number")
    max_iter = _check_pos_int(max_iter, "max_iter")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise OptionError(f"seed={seed!r}: must be an int")
    classes, counts = np.unique(y, return_counts=True)
    singletons = classes[counts < 2]
    keep = ~np.isin(y, singletons)
    x, y = x[keep], y[keep]
    kept_counts = counts[counts >= 2]
    if kept_counts.shape[0] < 2:
        raise DataError(
            f"linear probe needs at least 2 classes with at least 2 items each; got {kept_counts.shape[0]} "
            f"(after dropping {singletons.shape[0]} single-item classes)"
        )
    n_folds = int(min(folds, kept_counts.min()))
    skf = StratifiedKFold(n_splits=n_folds, shuffle=True, random_state=int(seed))
    accs: list[float] = []
    converged = True
    for train, test in skf.split(x, y):
        model = make_pipeline(StandardScaler(), LogisticRegression(C=float(C), max_iter=max_iter))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            model.fit(x[train], y[train])
        if any(issubclass(w.category, ConvergenceWarning) for w in caught):
            converged = False
        accs.append(float(model.score(x[test], y[test])))
    return {
        "mean": float(np.mean(accs)),
        "std": float(np.std(accs)),
        "fold_accuracies": accs,
        "folds": n_folds,
        "folds_requested": int(folds),
        "n": int(y.shape[0]),
        "classes": int(kept_counts.shape[0]),
        "dropped_classes": int(singletons.shape[0]),
        "dropped_samples": int((~keep).sum()),
        "converged": converged,
        "C": float(C),
        "seed": int(seed),
    }


# ----------------------------------------------------------------------------- agreement


def prediction_agreement(pred_a, pred_b) -> float:
    """Fraction of items on which two prediction vectors agree.

    Args:
        pred_a, pred_b: ``[N]`` predictions (e.g. ``knn_classify(...)["predictions"]`` of a dense
            and a patched model on the same images, in the same order).

    Returns:
        ``mean(pred_a == pred_b)`` in [0, 1].

    Raises:
        DataError: the inputs are not 1-D, differ in length, or are empty.
    """
    a = _to_numpy(pred_a, "pred_a")
    b = _to_numpy(pred_b, "pred_b")
    if a.ndim != 1 or b.ndim != 1:
        raise DataError(f"predictions must be 1-D [N]; got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[0] != b.shape[0]:
        raise DataError(f"predictions differ in length: {a.shape[0]} vs {b.shape[0]}")
    if a.shape[0] == 0:
        raise DataError("predictions are empty")
    return float(np.mean(a == b))
