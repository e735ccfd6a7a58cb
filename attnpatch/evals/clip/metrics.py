"""Zero-shot and retrieval metrics on embeddings (pure functions).

* :func:`zeroshot_classifier` -- class embedding = mean of the L2-normalised embeddings of the
  class's prompts (class name x template), renormalised (Radford et al. 2021, "Learning Transferable
  Visual Models From Natural Language Supervision", Sec. 3.1.4 prompt ensembling; the same
  computation as ``open_clip.zero_shot_classifier.build_zero_shot_classifier``).
* :func:`zeroshot_accuracy` -- top-k accuracy of ``argmax_c <image, class_c>`` (cosine similarity),
  as CLIP_benchmark's ``zeroshot_classification`` (LAION-AI/CLIP_benchmark).
* :func:`retrieval_recall` -- recall@k in both directions with CLIP_benchmark's definition
  (``zeroshot_retrieval.py``): text->image ("image retrieval"): a text counts as found when its
  image is among the ``k`` images most similar to it; image->text ("text retrieval"): an image
  counts as found when *any* of its captions is among the ``k`` texts most similar to it; each
  recall is the found fraction of the queries.
* :func:`retrieval_chance` -- the recall@k of a random ranking.
* :func:`classification_metrics`, :func:`retrieval_metrics` -- the same scores under CLIP_benchmark's
  result keys (``acc1``, ``acc5``, ``mean_per_class_recall``; ``image_retrieval_recall@k``,
  ``text_retrieval_recall@k``), computed as its ``zeroshot_classification.evaluate`` /
  ``zeroshot_retrieval.evaluate`` compute them; :func:`retrieval_predictions` the per-query ranks
  behind the recalls.

Ties in similarity are broken by the lower index (a stable descending sort), so the metrics are
deterministic; CLIP_benchmark uses ``torch.topk``, whose tie order is unspecified (identical only
without ties, e.g. duplicate captions give exactly tied text embeddings).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...errors import DataError, OptionError

__all__ = [
    "zeroshot_classifier", "zeroshot_accuracy", "retrieval_recall", "retrieval_chance", "classification_metrics",
    "retrieval_metrics", "retrieval_predictions",
]


def _as_float(x, what: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(np.asarray(x))
        except Exception as err:  # noqa: BLE001
            raise DataError(f"{what}: cannot convert {type(x).__name__} to a tensor ({err})") from err
    if x.dim() != 2:
        raise DataError(f"{what}: expected a 2-D [N, D] array, got shape {tuple(x.shape)}")
    x = x.detach().float().cpu()
    if not torch.isfinite(x).all():
        raise DataError(f"{what}: {int((~torch.isfinite(x)).sum())} non-finite values")
    return torch.nn.functional.normalize(x, dim=-1)


def _as_index(x, n: int, what: str, upper: int) -> torch.Tensor:
    arr = np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise DataError(f"{what}: expected {n} entries, got shape {tuple(arr.shape)}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{what}: expected integer indices, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= upper):
        raise DataError(f"{what}: indices must be in 0..{upper - 1}, got {int(arr.min())}..{int(arr.max())}")
    return torch.from_numpy(arr.astype(np.int64))


def check_ks(ks) -> list[int]:
    if isinstance(ks, numbers.Integral):
        ks = (ks,)
    out = sorted({int(k) for k in ks if not isinstance(k, bool) and isinstance(k, numbers.Integral) and k >= 1})
    if not out or len(out) != len(set(ks)):
        raise OptionError(f"ks={ks!r}: expected positive ints, e.g. (1, 5, 10)")
    return out


def _best_rank(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """``[Q]`` 0-based rank of each row's best positive in a stable descending order of ``scores [Q, M]``.

    The best positive is the positive with the highest score (ties: lowest index); its rank is the
    number of items scoring strictly higher plus those scoring equal at a lower index.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=scores.dtype)
    best = torch.where(positive, scores, neg_inf).max(dim=1, keepdim=True).values
    idx = torch.arange(scores.shape[1])
    first = torch.where(positive & (scores == best), idx, torch.full_like(idx, scores.shape[1])).min(dim=1, keepdim=True).values
    return (scores > best).sum(1) + ((scores == best) & (idx < first)).sum(1)


def zeroshot_classifier(text_embeddings, num_classes: int | None = None) -> torch.Tensor:
    """Zero-shot class weights: per class, the mean of its prompts' unit embeddings, renormalised.

    Args:
        text_embeddings: ``[C, T, D]`` (class x template) or ``[C * T, D]`` ordered class-major
            (all templates of class 0, then class 1, ...; give ``num_classes``); need not be normalised.
        num_classes: ``C`` for the 2-D form.

    Returns:
        ``[C, D]`` float32, unit L2 norm per row.

    Raises:
        DataError: a shape that does not split into ``C`` classes, or non-finite values.
    """
    e = torch.as_tensor(text_embeddings).detach().float().cpu()
    if e.dim() == 2:
        if not num_classes or e.shape[0] % num_classes:
            raise DataError(f"text_embeddings: {e.shape[0]} rows do not split into num_classes={num_classes!r} classes")
        e = e.reshape(num_classes, e.shape[0] // num_classes, e.shape[1])
    if e.dim() != 3:
        raise DataError(f"text_embeddings: expected [C, T, D] or [C*T, D], got shape {tuple(e.shape)}")
    if not torch.isfinite(e).all():
        raise DataError("text_embeddings: non-finite values")
    return torch.nn.functional.normalize(torch.nn.functional.normalize(e, dim=-1).mean(1), dim=-1)


def zeroshot_accuracy(image_embeddings, classifier, labels, ks: Sequence[int] = (1, 5)) -> dict[str, Any]:
    """Top-k zero-shot accuracy by cosine similarity (CLIP_benchmark's ``zeroshot_classification``).

    Args:
        image_embeddings: ``[N, D]`` (normalised here).
        classifier: ``[C, D]`` class embeddings (normalised here), e.g. :func:`zeroshot_classifier`.
        labels: ``[N]`` int class indices in ``0..C-1``.
        ks: cut-offs (positive ints).

    Returns:
        ``{"top<k>": fraction in [0, 1] for each k, "predictions": [N] int64 top-1 class,
        "n": N, "classes": C}``. A ``k`` above ``C`` counts every image as correct.

    Raises:
        DataError: shape mismatch, labels out of range, non-finite values.
        OptionError: bad ``ks``.
    """
    x = _as_float(image_embeddings, "image_embeddings")
    w = _as_float(classifier, "classifier")
    if x.shape[1] != w.shape[1]:
        raise DataError(f"image_embeddings are {x.shape[1]}-d but the classifier is {w.shape[1]}-d")
    y = _as_index(labels, x.shape[0], "labels", w.shape[0])
    ks = check_ks(ks)
    scores = x @ w.T  # [N, C]
    pos = torch.zeros_like(scores, dtype=torch.bool)
    pos[torch.arange(x.shape[0]), y] = True
    rank = _best_rank(scores, pos)
    out: dict[str, Any] = {f"top{k}": float((rank < k).float().mean()) if x.shape[0] else 0.0 for k in ks}
    idx = torch.arange(scores.shape[1])
    best = scores.max(1, keepdim=True).values
    pred = torch.where(scores == best, idx, torch.full_like(idx, scores.shape[1])).min(1).values
    out.update(predictions=pred.numpy().astype(np.int64), n=int(x.shape[0]), classes=int(w.shape[0]))
    return out


def retrieval_recall(image_embeddings, text_embeddings, text_to_image, ks: Sequence[int] = (1, 5, 10), chunk: int = 1024) -> dict[str, Any]:
    """Image<->text recall@k (CLIP_benchmark's ``zeroshot_retrieval`` definition), by cosine similarity.

    Args:
        image_embeddings: ``[Ni, D]`` (normalised here).
        text_embeddings: ``[Nt, D]`` (normalised here).
        text_to_image: ``[Nt]`` int, the image each text describes (every image needs at least one text).
        ks: cut-offs (positive ints).
        chunk: queries scored per step (memory ``chunk x max(Ni, Nt)`` floats).

    Returns:
        ``{"t2i_recall@<k>": ..., "i2t_recall@<k>": ..., "n_images": Ni, "n_texts": Nt, "ks": [...]}``:
        ``t2i`` (CLIP_benchmark's ``image_retrieval_recall@k``) is the fraction of texts whose
        image is among their ``k`` most similar images; ``i2t`` (``text_retrieval_recall@k``) the
        fraction of images with at least one of their captions among their ``k`` most similar texts.

    Raises:
        DataError: shape mismatch, an index out of range, an image without any text, non-finite values.
        OptionError: bad ``ks``.
    """
    im = _as_float(image_embeddings, "image_embeddings")
    tx = _as_float(text_embeddings, "text_embeddings")
    if im.shape[1] != tx.shape[1]:
        raise DataError(f"image embeddings are {im.shape[1]}-d but text embeddings {tx.shape[1]}-d")
    ni, nt = im.shape[0], tx.shape[0]
    t2i = _as_index(text_to_image, nt, "text_to_image", ni)
    ks = check_ks(ks)
    counts = torch.bincount(t2i, minlength=ni)
    if ni and int(counts.min()) == 0:
        missing = torch.nonzero(counts == 0).flatten()[:5].tolist()
        raise DataError(f"text_to_image: images {missing} have no text; every image needs at least one caption")
    t_rank = torch.empty(nt, dtype=torch.long)
    for s in range(0, nt, chunk):
        sc = tx[s : s + chunk] @ im.T
        pos = torch.zeros_like(sc, dtype=torch.bool)
        pos[torch.arange(sc.shape[0]), t2i[s : s + chunk]] = True
        t_rank[s : s + chunk] = _best_rank(sc, pos)
    i_rank = torch.empty(ni, dtype=torch.long)
    for s in range(0, ni, chunk):
        sc = im[s : s + chunk] @ tx.T
        pos = t2i[None, :] == torch.arange(s, min(ni, s + chunk))[:, None]
        i_rank[s : s + chunk] = _best_rank(sc, pos)
    out: dict[str, Any] = {}
    for k in ks:
        out[f"t2i_recall@{k}"] = float((t_rank < k).float().mean()) if nt else 0.0
    for k in ks:
        out[f"i2t_recall@{k}"] = float((i_rank < k).float().mean()) if ni else 0.0
    out.update(n_images=int(ni), n_texts=int(nt), ks=ks)
    return out


def retrieval_chance(text_to_image, n_images: int, ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """Expected recall@k of a random ranking (the chance level of :func:`retrieval_recall`).

    text->image: each text has one image among ``Ni``: ``min(k, Ni) / Ni``. image->text: an image
    with ``m`` captions among ``Nt`` texts is found with probability ``1 - C(Nt - m, k) / C(Nt, k)``
    (hypergeometric), averaged over images.

    Returns:
        ``{"t2i_recall@<k>": p, "i2t_recall@<k>": p}`` for each ``k``.
    """
    t2i = np.asarray(text_to_image, dtype=np.int64)
    nt = t2i.shape[0]
    m = np.bincount(t2i, minlength=n_images).astype(np.float64)
    out: dict[str, float] = {}
    for k in check_ks(ks):
        out[f"t2i_recall@{k}"] = min(k, n_images) / n_images
    for k in check_ks(ks):
        miss = np.ones_like(m)
        for i in range(min(k, nt)):
            miss *= np.clip((nt - m - i) / (nt - i), 0.0, 1.0)
        out[f"i2t_recall@{k}"] = float(np.mean(1.0 - miss))
    return out


def classification_metrics(labels, predictions, top5_accuracy: float, n_classes: int) -> dict[str, float]:
    """Zero-shot classification scores under CLIP_benchmark's keys, computed as its
    ``zeroshot_classification.evaluate`` computes them (LAION-AI/CLIP_benchmark 1.6.2).

    Args:
        labels: ``[N]`` int true classes.
        predictions: ``[N]`` int top-1 classes (e.g. ``zeroshot_accuracy(...)["predictions"]``).
        top5_accuracy: the top-5 accuracy, fraction in [0, 1] (e.g. ``zeroshot_accuracy(...)["top5"]``).
        n_classes: ``C``, the number of class names.

    Returns:
        ``{"acc1": fraction of predictions equal to the label, "acc5": top5_accuracy (NaN when
        ``C < 5``, as CLIP_benchmark writes it; the count of hits over ``N`` in float64), "mean_per_class_recall": the mean over the classes
        present in ``labels`` of the fraction of their images predicted right
        (``sklearn.metrics.balanced_accuracy_score``, what CLIP_benchmark calls)}``; fractions in [0, 1].

    Raises:
        DataError: ``labels`` and ``predictions`` differ in length, or are empty.
    """
    import warnings

    from sklearn.metrics import balanced_accuracy_score

    y, p = np.asarray(labels).reshape(-1), np.asarray(predictions).reshape(-1)
    if y.shape != p.shape or not y.size:
        raise DataError(f"labels ({y.size}) and predictions ({p.size}) must be non-empty and of one length")
    with warnings.catch_warnings():  # "y_pred contains classes not in y_true": the score is still CLIP_benchmark's
        warnings.simplefilter("ignore", UserWarning)
        recall = float(balanced_accuracy_score(y, p))
    n = y.size  # CLIP_benchmark divides a count by N in Python floats: the count back from a float32 fraction
    return {"acc1": int(np.sum(y == p)) / n, "acc5": round(float(top5_accuracy) * n) / n if n_classes >= 5 else float("nan"),
            "mean_per_class_recall": recall}


def retrieval_metrics(recall: dict[str, Any]) -> dict[str, float]:
    """:func:`retrieval_recall`'s result under CLIP_benchmark's keys (``zeroshot_retrieval.evaluate``):
    ``image_retrieval_recall@k`` = ``t2i_recall@k`` (a text finds its image), ``text_retrieval_recall@k`` =
    ``i2t_recall@k`` (an image finds one of its captions); fractions in [0, 1], in CLIP_benchmark's key order
    (both directions per ``k``)."""
    out: dict[str, float] = {}
    for k in recall["ks"]:
        out[f"image_retrieval_recall@{k}"] = recall[f"t2i_recall@{k}"]
        out[f"text_retrieval_recall@{k}"] = recall[f"i2t_recall@{k}"]
    return out


def retrieval_predictions(scores, text_to_image) -> dict[str, list[int]]:
    """Per-query ranks behind the retrieval recalls, from a text x image score matrix.

    Args:
        scores: ``[Nt, Ni]`` similarity of each text to each image (e.g. unit text embeddings @ unit image
            embeddings ``.T``).
        text_to_image: ``[Nt]`` int, the image of each text.

    Returns:
        ``{"t2i_rank": [Nt] 0-based rank of each text's image among all images, "i2t_rank": [Ni] 0-based
        rank of each image's best-ranked caption among all texts, "t2i_top1": [Nt] the top image of each
        text, "i2t_top1": [Ni] the top text of each image}``, ties broken by the lower index as in
        :func:`retrieval_recall` (a query is found at ``k`` when its rank is below ``k``).

    Raises:
        DataError: ``scores`` not 2-D or ``text_to_image`` of another length or out of range.
    """
    sc = torch.as_tensor(scores).detach().float().cpu()
    if sc.dim() != 2:
        raise DataError(f"scores: expected a 2-D [Nt, Ni] matrix, got shape {tuple(sc.shape)}")
    nt, ni = sc.shape
    t2i = _as_index(text_to_image, nt, "text_to_image", ni)
    pos = torch.zeros_like(sc, dtype=torch.bool)
    pos[torch.arange(nt), t2i] = True
    first = (lambda m: torch.where(m == m.max(1, keepdim=True).values, torch.arange(m.shape[1]), m.shape[1]).min(1).values)
    return {"t2i_rank": _best_rank(sc, pos).tolist(), "i2t_rank": _best_rank(sc.T.contiguous(), pos.T.contiguous()).tolist(),
            "t2i_top1": first(sc).tolist(), "i2t_top1": first(sc.T).tolist()}
