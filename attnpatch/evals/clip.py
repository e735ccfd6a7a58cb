"""CLIP evals, dense vs patched image tower: zero-shot classification and image-text retrieval.

Metric functions (pure, on embeddings)
--------------------------------------
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

Ties in similarity are broken by the lower index (a stable descending sort), so the metrics are
deterministic; CLIP_benchmark uses ``torch.topk``, whose tie order is unspecified (identical only
without ties, e.g. duplicate captions give exactly tied text embeddings).

Class names and prompt templates
--------------------------------
ImageNet-1k class names are the curated CLIP names shipped by open_clip
(``open_clip.zero_shot_metadata.IMAGENET_CLASSNAMES``, index = ILSVRC-2012 / torchvision class
index) and the templates are ``OPENAI_IMAGENET_TEMPLATES`` (80) or its 7-template subset
``SIMPLE_IMAGENET_TEMPLATES``, from the same module (see :data:`TEMPLATE_SETS`).

Runners
-------
:func:`run_zeroshot_eval` and :func:`run_retrieval_eval` compute, in one pass over the images,
batch by batch and interleaved, the dense image embeddings and those of each patched setting
(forward calls timed: images/s; preprocessing not timed); text embeddings are computed once with
the text tower dense (again under the patch only for a setting that routes the text tower).
"""

from __future__ import annotations

import json
import numbers
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DataError, OptionError
from ..fetch import _stderr
from .report import EvalInterrupted
from .vision import count_sampled_at

__all__ = [
    "TEMPLATE_SETS", "CLASSNAME_SETS", "CaptionSet", "imagenet_classnames", "resolve_templates", "resolve_classnames",
    "zeroshot_classifier", "zeroshot_accuracy", "retrieval_recall", "retrieval_chance", "load_caption_set",
    "run_zeroshot_eval", "run_retrieval_eval",
]

Log = Callable[[str], None]

CLASSNAME_SETS = ("auto", "imagenet1k", "dataset")
CAPTION_COLUMNS = ("caption", "captions", "sentences", "txt", "text", "raw")


def _openai_templates() -> dict[str, tuple[str, ...]]:
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

    def fmt(ts):
        return tuple(t("{}") if callable(t) else str(t) for t in ts)

    return {"openai": fmt(OPENAI_IMAGENET_TEMPLATES), "openai-7": fmt(SIMPLE_IMAGENET_TEMPLATES), "photo": ("a photo of a {}.",)}


#: Named template sets: ``"openai"`` (CLIP's 80 ImageNet prompts), ``"openai-7"`` (the 7-prompt
#: subset of the CLIP notebook), ``"photo"`` (``"a photo of a {}."``). ``{}`` is the class name.
TEMPLATE_SETS = ("openai", "openai-7", "photo")


def imagenet_classnames() -> list[str]:
    """The 1000 curated CLIP ImageNet-1k class names, index = ILSVRC-2012 / torchvision class index.

    Source: ``open_clip.zero_shot_metadata.IMAGENET_CLASSNAMES`` (open_clip_torch), the names of
    OpenAI's CLIP zero-shot notebook.
    """
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    return list(IMAGENET_CLASSNAMES)


def _read_text(path: Path, what: str) -> str:
    """A UTF-8 text file given as ``what``, or an :class:`OptionError` naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise OptionError(f"{what}={str(path)!r}: not a UTF-8 text file ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise OptionError(f"{what}={str(path)!r}: cannot be read ({err.strerror or err})") from None


def resolve_templates(spec: str | Sequence[str]) -> list[str]:
    """Prompt templates with a ``{}`` placeholder for the class name.

    Args:
        spec: a name in :data:`TEMPLATE_SETS`, a path to a text file (one template per line,
            blank lines and lines starting with ``#`` ignored), or a sequence of template strings.

    Returns:
        list of template strings, each containing ``{}`` (or ``{c}``, normalised to ``{}``).

    Raises:
        OptionError: unknown name (not a set name nor an existing file), an empty set, or a
            template without a ``{}`` placeholder.
    """
    if isinstance(spec, str):
        sets = _openai_templates()
        if spec in sets:
            out = list(sets[spec])
        elif Path(spec).expanduser().is_file():
            lines = _read_text(Path(spec).expanduser(), "templates").splitlines()
            out = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        else:
            raise OptionError(f"templates={spec!r}: allowed values are {', '.join(map(repr, TEMPLATE_SETS))} or a text file (one template per line)")
    else:
        out = [str(t) for t in spec]
    out = [t.replace("{c}", "{}") for t in out]
    if not out:
        raise OptionError(f"templates={spec!r}: no templates")
    bad = [t for t in out if "{}" not in t]
    if bad:
        raise OptionError(f"template {bad[0]!r} has no '{{}}' placeholder for the class name")
    return out


def _timm_info(name: str) -> list[str]:
    import timm.data

    path = Path(timm.data.__file__).parent / "_info" / name
    return path.read_text().splitlines()


def _is_imagenet1k(image_set) -> bool:
    """Whether ``image_set``'s classes are ImageNet-1k in ILSVRC-2012 / torchvision order: its
    ``classes.json`` wnids, or its class names (the ``ILSVRC/imagenet-1k`` hub set's WordNet
    lemmas), equal timm's ``imagenet_synsets.txt`` order (timm ships the list)."""
    names = list(getattr(image_set, "class_names", []) or [])
    if len(names) != 1000:
        return False
    wnids = _timm_info("imagenet_synsets.txt")
    src = Path(str(getattr(image_set, "source", "")))
    cj = src / "classes.json"
    if src.is_dir() and cj.is_file():
        try:
            entries = json.loads(cj.read_text())
            got = [e.get("wnid") for e in sorted(entries, key=lambda e: int(e["index"]))]
        except (ValueError, KeyError, TypeError, AttributeError):
            return False
        return got == wnids
    lemma = dict(line.split("\t", 1) for line in _timm_info("imagenet_synset_to_lemma.txt") if "\t" in line)
    return [lemma.get(w) for w in wnids] == names


def resolve_classnames(spec: str, image_set) -> tuple[list[str], str]:
    """Class names for zero-shot prompts, and where they came from.

    Args:
        spec: ``"auto"`` (ImageNet-1k names when the set's 1000 classes are ImageNet-1k in
            torchvision order -- checked through ``classes.json`` wnids or the hub set's WordNet
            lemmas -- else the set's own names), ``"imagenet1k"`` (:func:`imagenet_classnames`),
            ``"dataset"`` (the set's own ``class_names``: ``classes.json`` names or ``ClassLabel``
            names), or a path to a JSON list of names / a text file with one name per line.
        image_set: the labelled set (an :class:`attnpatch.evals.images.ImageSet`).

    Returns:
        ``(names, source)``: ``names[label]`` is the class name; ``source`` is ``"imagenet1k"``,
        ``"dataset"`` or the file path.

    Raises:
        OptionError: unknown ``spec``.
        DataError: fewer names than the set's largest label + 1.
    """
    if spec == "auto":
        spec = "imagenet1k" if _is_imagenet1k(image_set) else "dataset"
    if spec == "imagenet1k":
        names, source = imagenet_classnames(), "imagenet1k"
    elif spec == "dataset":
        names, source = list(image_set.class_names), "dataset"
    elif Path(spec).expanduser().is_file():
        text = _read_text(Path(spec).expanduser(), "classnames")
        try:
            loaded = json.loads(text)
            names = [str(n) for n in loaded] if isinstance(loaded, list) else None
        except ValueError:
            names = None
        if names is None:
            names = [ln.strip() for ln in text.splitlines() if ln.strip()]
        source = str(spec)
    else:
        raise OptionError(f"classnames={spec!r}: allowed values are {', '.join(map(repr, CLASSNAME_SETS))} or a file (JSON list or one name per line)")
    need = int(np.max(image_set.labels)) + 1
    if len(names) < need:
        raise DataError(f"classnames ({source}): {len(names)} names, but the set has labels up to {need - 1}")
    return names, source


# --------------------------------------------------------------------------- metrics


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


def _check_ks(ks) -> list[int]:
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
    ks = _check_ks(ks)
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
    ks = _check_ks(ks)
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
    for k in _check_ks(ks):
        out[f"t2i_recall@{k}"] = min(k, n_images) / n_images
    for k in _check_ks(ks):
        miss = np.ones_like(m)
        for i in range(min(k, nt)):
            miss *= np.clip((nt - m - i) / (nt - i), 0.0, 1.0)
        out[f"i2t_recall@{k}"] = float(np.mean(1.0 - miss))
    return out


# --------------------------------------------------------------------------- caption sets


@dataclass
class CaptionSet:
    """Images with one or more captions each, decoded lazily.

    Attributes:
        name: folder name or hub id.
        source: resolved directory or hub id.
        split: the split loaded.
        captions: ``captions[i]`` is the list of captions of image ``i``.
        rows: ``[N]`` int64 row of each image in the full split.
        dataset: the underlying ``datasets.Dataset`` (restricted to ``rows``).
        image_column: name of the image column.
        caption_column: name of the caption column.
        file_paths: ``[N]`` the image file of each image (``None`` where stored as bytes), to name it in errors.
    """

    name: str
    source: str
    split: str
    captions: list[list[str]]
    rows: np.ndarray
    dataset: Any = field(repr=False)
    image_column: str = "image"
    caption_column: str = "caption"
    file_paths: list | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, i: int):
        """Image ``i`` as an RGB PIL image (alpha composited onto white).

        Raises:
            IndexError: ``i`` out of range.
            DataError: the image cannot be decoded (e.g. a truncated JPEG); the message names its file.
        """
        from .images import decode_image

        n = len(self)
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"CaptionSet index must be an int, got {type(i).__name__}")
        j = int(i) + n if i < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"image index {i} out of range for {n} images")
        return decode_image(self, j)

    @property
    def texts(self) -> list[str]:
        """Every caption, image by image (``[Nt]``)."""
        return [c for cs in self.captions for c in cs]

    @property
    def text_to_image(self) -> np.ndarray:
        """``[Nt]`` int64: the image of each caption in :attr:`texts`."""
        return np.repeat(np.arange(len(self.captions), dtype=np.int64), [len(c) for c in self.captions])


def _captions_of(value, row: int, column: str, name: str) -> list[str]:
    if isinstance(value, str):
        caps = value.splitlines()  # CLIP_benchmark's webdataset retrieval sets: one caption per line
    elif isinstance(value, (list, tuple)):
        caps = []
        for v in value:
            if isinstance(v, dict):  # Karpathy-style {"raw": ...} sentences
                v = v.get("raw", v.get("caption", v.get("text")))
            if not isinstance(v, str):
                raise DataError(f"{name}: row {row}, column {column!r}: expected strings, got {type(v).__name__}")
            caps.append(v)
    else:
        raise DataError(f"{name}: row {row}, column {column!r}: expected a string or a list of strings, got {type(value).__name__}")
    caps = [c.strip() for c in caps if c and c.strip()]
    if not caps:
        raise DataError(f"{name}: row {row} has no caption in column {column!r}")
    return caps


def load_caption_set(
    data: str | os.PathLike, split: str | None = None, caption_column: str | None = None, limit: int | None = None,
    log: Log = _stderr,
) -> CaptionSet:
    """Load an image-caption set through ``datasets``.

    Args:
        data: an ``imagefolder`` directory whose ``metadata.jsonl`` has a caption column (e.g.
            ``shared/data/tuxpaint-captions``), a directory of webdataset shards (``<split>/*.tar``
            with ``.jpg`` + ``.txt`` members, CLIP_benchmark's layout), or a Hugging Face hub dataset id, e.g.
            ``clip-benchmark/wds_flickr30k`` / ``clip-benchmark/wds_mscoco_captions`` (Karpathy
            test splits, CLIP_benchmark's own copies: ``jpg`` images, ``txt`` captions one per
            line). The hub is probed first (TCP, 5 s) unless ``HF_HUB_OFFLINE`` /
            ``HF_DATASETS_OFFLINE`` is set, so an offline machine fails at once.
        split: split to load; ``None`` = ``"train"`` for an imagefolder directory (its split for a
            ``train/`` folder), ``"test"`` for webdataset shards and hub ids.
        caption_column: the caption column; ``None`` = the first of :data:`CAPTION_COLUMNS`
            present. A value may be one string (split into lines: one caption per line) or a list
            of strings (or of ``{"raw": ...}`` dicts).
        limit: keep the first ``limit`` images (dataset order), all their captions.
        log: one line per step.

    Returns:
        :class:`CaptionSet`.

    Raises:
        DataError: not a directory nor a loadable hub id (hub unreachable, unknown split), no image
            column, no caption column (the message lists the columns), an image without captions, an
            image file that is missing, not an image or truncated (the message names it).
        OptionError: ``limit`` not a positive int.
    """
    from .images import _HUB_ID, _check_limit, _env_true, _hub_reachable, _load_hf, check_image_files, image_files

    import datasets

    limit = _check_limit(limit)
    raw = os.fspath(data)
    path = Path(raw).expanduser()
    wds = False
    if path.is_dir():
        name, source, is_dir = path.resolve().name, str(path.resolve()), True
        wds = any(path.glob("*.tar")) or any(path.glob("*/*.tar"))  # a local copy of a webdataset set
    elif path.exists() or not _HUB_ID.match(raw) or raw.startswith((".", "~")):
        what = "is a file, not a directory" if path.exists() else f"does not exist ({path.resolve()})"
        raise DataError(f"data={raw!r} {what}: pass an imagefolder directory with a caption column, or a hub dataset id")
    else:
        name, source, is_dir = raw, raw, False
        if not (_env_true("HF_HUB_OFFLINE") or _env_true("HF_DATASETS_OFFLINE")) and not _hub_reachable():
            raise DataError(
                f"data={raw!r} is not a local directory, and the Hugging Face hub cannot be reached to load it as a "
                f"hub dataset id. Pass an imagefolder directory (images + metadata.jsonl with a caption column), or "
                f"set HF_HUB_OFFLINE=1 to use a copy in the local datasets cache."
            )
    split = split or ("train" if is_dir and not wds else "test")
    kind = "webdataset directory" if wds else "directory" if is_dir else "hub"
    log(f"loading caption set {name} ({kind} {source}, split {split}) ...")
    ds = _load_hf(source, split, is_dir and not wds)  # datasets detects the webdataset layout by itself
    image_cols = [c for c, f in ds.features.items() if isinstance(f, datasets.Image)]
    if not image_cols:
        raise DataError(f"{name}: no image column (features: {dict(ds.features)})")
    if caption_column is None:
        caption_column = next((c for c in CAPTION_COLUMNS if c in ds.column_names), None)
        if caption_column is None:
            raise DataError(f"{name}: no caption column among {list(CAPTION_COLUMNS)} (columns: {ds.column_names}); pass caption_column")
    elif caption_column not in ds.column_names:
        raise DataError(f"{name}: caption_column={caption_column!r} is not a column (columns: {ds.column_names})")
    n = ds.num_rows if limit is None else min(limit, ds.num_rows)
    if n == 0:
        raise DataError(f"{name}: split {split!r} holds no images")
    files = image_files(ds, image_cols[0])[:n]
    if n < ds.num_rows:
        ds = ds.select(range(n))
    values = ds.data.column(caption_column).to_pylist()[:n]
    captions = [_captions_of(v, i, caption_column, name) for i, v in enumerate(values)]
    check_image_files(files, name)  # a missing, unreadable or truncated file fails now, not mid-run
    log(f"{name}: {n} images, {sum(map(len, captions))} captions")
    return CaptionSet(
        name=name, source=source, split=split, captions=captions, rows=np.arange(n, dtype=np.int64), dataset=ds,
        image_column=image_cols[0], caption_column=caption_column, file_paths=files,
    )


# --------------------------------------------------------------------------- runners


def _settings(settings, bundle=None, towers: Any = None) -> tuple[list[tuple[str, dict]], list[dict]]:
    """Validated ``(method, full options)`` and the options as given; with ``bundle``, each
    setting is also patched onto the model once (and removed), so a method or tower that does not
    fit fails before any text or image is encoded."""
    from ..patchers.core import patched
    from ..patchers.registry import get_method, validate_options

    given = [dict(o) for _, o in settings]
    out = [(m, validate_options(get_method(m), dict(o))) for m, o in settings]
    if bundle is not None:
        for m, o in out:
            with patched(bundle.model, m, towers=towers, **o):
                pass
    return out, given


def _image_pass(bundle, images, settings, towers, batch_size: int, warmup: bool, progress) -> dict[str, Any]:
    """Dense and patched image embeddings of every image, interleaved batch by batch, with forward times."""
    from ..patchers.core import patch_info, patched, record_stats

    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise OptionError(f"batch_size={batch_size!r}: must be a positive int (images per forward call)")
    n = len(images)
    dense, dense_t = [], 0.0
    runs = [{"emb": [], "t": 0.0, "sampled_at": {}, "towers": None, "modes": set()} for _ in settings]
    tokens = resolution = None
    done = 0
    interrupted = False
    try:
        for start in range(0, n, batch_size):
            items = [images[i] for i in range(start, min(n, start + batch_size))]
            x = bundle.preprocess([it[0] if isinstance(it, tuple) else it for it in items])  # ImageSet items are (image, label)
            resolution = int(x.shape[-1])
            if warmup and start == 0:
                bundle.encode_image(x[:1])
                for m, o in settings:
                    with patched(bundle.model, m, towers=towers, **o):
                        bundle.encode_image(x[:1])
            # a batch is kept only once complete, so a Ctrl-C leaves whole batches
            t0 = time.perf_counter()
            dense_b = bundle.encode_image(x)
            dt = time.perf_counter() - t0
            per_run = []
            for m, o in settings:
                with patched(bundle.model, m, towers=towers, **o), record_stats(bundle.model) as rec:
                    tw = patch_info(bundle.model)["towers"]
                    t0 = time.perf_counter()
                    emb = bundle.encode_image(x)
                    t_run = time.perf_counter() - t0
                per_run.append((tw, emb, t_run, rec.forwards[0] if rec.forwards else {}))
            dense.append(dense_b)
            dense_t += dt
            for r, (tw, emb, t_run, lay) in zip(runs, per_run):
                r["towers"] = tw
                r["emb"].append(emb)
                r["t"] += t_run
                tokens = next((lr.queries for lr in lay.values()), tokens)
                count_sampled_at(lay, r["sampled_at"])
                r["modes"].update(lr.mode for lr in lay.values())
            done += x.shape[0]
            if progress:
                progress(done, n)
    except KeyboardInterrupt as exc:
        if isinstance(exc, EvalInterrupted) or done == 0:
            raise EvalInterrupted(None, f"0/{n} images") from None
        interrupted = True
    return {
        "n": done, "n_planned": n, "interrupted": interrupted, "resolution": resolution,
        "tokens": tokens if tokens is not None else bundle.vision_tokens(),
        "dense": torch.cat(dense), "dense_t": dense_t, "runs": runs,
    }


def _text_pass(bundle, texts: list[str], settings, towers, text_batch_size: int) -> tuple[torch.Tensor, float, list[torch.Tensor | None]]:
    """Dense text embeddings, and per setting the patched ones when that setting routes the text tower."""
    from ..patchers.core import patch_info, patched

    t0 = time.perf_counter()
    dense = bundle.encode_text(texts, batch_size=text_batch_size)
    secs = time.perf_counter() - t0
    per = []
    for m, o in settings:
        with patched(bundle.model, m, towers=towers, **o):
            routes_text = "text" in patch_info(bundle.model)["towers"]
            per.append(bundle.encode_text(texts, batch_size=text_batch_size) if routes_text else None)
    return dense, secs, per


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def _row_common(m, o, g, r, emb, dense_emb, dense_t, n) -> dict[str, Any]:
    cc = _cos(emb, dense_emb)
    row = {
        "method": m, "options": o, "shown_options": g, "towers": r["towers"],
        "seconds": r["t"], "images_per_s": n / r["t"] if r["t"] else None, "speedup": dense_t / r["t"] if r["t"] else None,
        "embed_cosine": float(cc.mean()), "embed_cosine_min": float(cc.min()),
        "sampled_at": {str(k): v for k, v in sorted(r["sampled_at"].items())},
    }
    if r.get("modes") == {"dense:s>=N"}:  # every patched layer ran exact attention (s >= N), as in the vision evals
        row["note"] = "exact attention: s >= N tokens"
    return row


def _finish(result: dict[str, Any], ip: dict[str, Any]) -> dict[str, Any]:
    """Return ``result``, or raise :class:`EvalInterrupted` carrying it when the image pass was interrupted."""
    if ip["interrupted"]:
        result.update(interrupted=True, n_images_planned=ip["n_planned"])
        raise EvalInterrupted(result, f"{ip['n']}/{ip['n_planned']} images")
    return result


def _text_or_interrupt(fn, *args):
    try:
        return fn(*args)
    except KeyboardInterrupt as exc:
        if isinstance(exc, EvalInterrupted):
            raise
        raise EvalInterrupted(None, "text embeddings") from None


def run_zeroshot_eval(
    bundle,
    images,
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    settings: Sequence[tuple[str, dict[str, Any]]],
    towers: Any = None,
    batch_size: int = 32,
    text_batch_size: int = 256,
    ks: Sequence[int] = (1, 5),
    warmup: bool = True,
    progress: Callable[[int, int], None] | None = None,
    log: Log = _stderr,
) -> dict[str, Any]:
    """Zero-shot classification, dense vs patched image tower, on the same images in one run.

    Args:
        bundle: a :class:`attnpatch.clip_models.ClipBundle` (left unpatched).
        images: a labelled set (``len``, ``labels`` ``[N]``, ``[i] -> (PIL image, label)``), e.g.
            :func:`attnpatch.evals.images.load_image_set`.
        classnames: ``classnames[label]`` (e.g. :func:`resolve_classnames`).
        templates: prompt templates with ``{}`` (e.g. :func:`resolve_templates`).
        settings: ``[(method, options), ...]`` compared with dense.
        towers: towers each setting routes (``None``: the model's default, the image tower).
        batch_size: images per forward call; text_batch_size: prompts per forward call.
        ks: top-k cut-offs.
        warmup: one untimed forward per setting before timing.
        progress: ``progress(images_done, images_total)``.
        log: one line per step.

    Returns:
        ``{"eval": "zeroshot", "n_images", "n_classes", "n_templates", "templates", "resolution"
        (pixels), "tokens" (image-tower tokens N), "batch_size", "text_seconds", "chance"
        ({"top<k>": k / C}), "dense": {"top<k>", "seconds", "images_per_s"}, "runs": [{"method",
        "options", "towers", "top<k>", "agreement" (top-1 prediction equal to dense, fraction),
        "embed_cosine" / "embed_cosine_min" (image embedding vs dense, mean / min over images),
        "seconds", "images_per_s", "speedup", "sampled_at"}]}``. Seconds are model forward time.

    Raises:
        OptionError: bad templates, ks or batch sizes; UnknownMethodError / OptionError /
            UnsupportedModelError for a bad setting (checked before any image is encoded).
        DataError: fewer class names than labels.
        EvalInterrupted: Ctrl-C (a ``KeyboardInterrupt``); its ``partial`` is the result over the
            images of the finished batches (``"interrupted": True``, ``"n_images_planned"``), or
            ``None`` before the first batch finished.
    """
    settings, given = _settings(settings, bundle, towers)
    templates = resolve_templates(list(templates))
    labels = np.asarray(images.labels)
    names = list(classnames)
    if len(names) < int(labels.max()) + 1:
        raise DataError(f"{len(names)} class names, but the set has labels up to {int(labels.max())}")
    ks = _check_ks(ks)
    prompts = [t.replace("{}", c) for c in names for t in templates]
    log(f"zero-shot classifier: {len(names)} classes x {len(templates)} templates = {len(prompts)} prompts ...")
    text, text_s, per_text = _text_or_interrupt(_text_pass, bundle, prompts, settings, towers, text_batch_size)
    clf = zeroshot_classifier(text, len(names))
    log(f"text embeddings in {text_s:.1f} s")
    ip = _image_pass(bundle, images, settings, towers, batch_size, warmup, progress)
    n = ip["n"]
    dense = zeroshot_accuracy(ip["dense"], clf, labels[:n], ks)
    c = len(names)
    result: dict[str, Any] = {
        "eval": "zeroshot", "n_images": n, "n_classes": c, "n_templates": len(templates), "templates": templates,
        "resolution": ip["resolution"], "tokens": ip["tokens"], "batch_size": batch_size, "text_seconds": text_s,
        "chance": {f"top{k}": min(k, c) / c for k in ks},
        "dense": {**{f"top{k}": dense[f"top{k}"] for k in ks}, "seconds": ip["dense_t"],
                  "images_per_s": n / ip["dense_t"] if ip["dense_t"] else None},
        "runs": [],
    }
    for (m, o), g, r, pt in zip(settings, given, ip["runs"], per_text):
        emb = torch.cat(r["emb"])
        acc = zeroshot_accuracy(emb, clf if pt is None else zeroshot_classifier(pt, c), labels[:n], ks)
        row = _row_common(m, o, g, r, emb, ip["dense"], ip["dense_t"], n)
        row.update({f"top{k}": acc[f"top{k}"] for k in ks})
        row["agreement"] = float(np.mean(acc["predictions"] == dense["predictions"]))
        result["runs"].append(row)
    return _finish(result, ip)


def run_retrieval_eval(
    bundle,
    captions: CaptionSet,
    *,
    settings: Sequence[tuple[str, dict[str, Any]]],
    towers: Any = None,
    batch_size: int = 32,
    text_batch_size: int = 256,
    ks: Sequence[int] = (1, 5, 10),
    warmup: bool = True,
    progress: Callable[[int, int], None] | None = None,
    log: Log = _stderr,
) -> dict[str, Any]:
    """Image<->text retrieval recall@k, dense vs patched image tower, on the same images in one run.

    Args:
        bundle: a :class:`attnpatch.clip_models.ClipBundle` (left unpatched).
        captions: a :class:`CaptionSet` (e.g. :func:`load_caption_set`).
        settings: ``[(method, options), ...]`` compared with dense.
        towers: towers each setting routes (``None``: the model's default, the image tower).
        batch_size: images per forward call; text_batch_size: captions per forward call.
        ks: recall cut-offs.
        warmup: one untimed forward per setting before timing.
        progress: ``progress(images_done, images_total)``.
        log: one line per step.

    Returns:
        ``{"eval": "retrieval", "n_images", "n_texts", "ks", "resolution", "tokens",
        "batch_size", "text_seconds", "chance" (:func:`retrieval_chance`), "dense":
        {"t2i_recall@<k>", "i2t_recall@<k>", "seconds", "images_per_s"}, "runs": [{"method",
        "options", "towers", the recalls, "t2i_top1_agreement" (each text's top-1 image equals
        dense's, fraction), "embed_cosine", "embed_cosine_min", "seconds", "images_per_s",
        "speedup", "sampled_at"}]}``; recall definitions in :func:`retrieval_recall`.

    Raises:
        OptionError: bad ks or batch sizes; UnknownMethodError / OptionError /
            UnsupportedModelError for a bad setting.
        EvalInterrupted: Ctrl-C (a ``KeyboardInterrupt``); its ``partial`` is the result over the
            images of the finished batches and their captions (``"interrupted": True``,
            ``"n_images_planned"``), or ``None`` before the first batch finished.
    """
    settings, given = _settings(settings, bundle, towers)
    ks = _check_ks(ks)
    texts, t2i = captions.texts, captions.text_to_image
    log(f"text embeddings of {len(texts)} captions ...")
    text, text_s, per_text = _text_or_interrupt(_text_pass, bundle, texts, settings, towers, text_batch_size)
    log(f"text embeddings in {text_s:.1f} s")
    ip = _image_pass(bundle, captions, settings, towers, batch_size, warmup, progress)
    n = ip["n"]
    if n < len(captions):  # interrupted: the captions of the finished images only
        keep = torch.from_numpy(t2i < n)
        texts, t2i, text = [t for t, k in zip(texts, keep.tolist()) if k], t2i[t2i < n], text[keep]
        per_text = [None if pt is None else pt[keep] for pt in per_text]
    metric_keys = [f"t2i_recall@{k}" for k in ks] + [f"i2t_recall@{k}" for k in ks]
    dense = retrieval_recall(ip["dense"], text, t2i, ks)
    dense_top1 = (text @ ip["dense"].T).argmax(1)
    result: dict[str, Any] = {
        "eval": "retrieval", "n_images": n, "n_texts": len(texts), "ks": ks, "resolution": ip["resolution"],
        "tokens": ip["tokens"], "batch_size": batch_size, "text_seconds": text_s, "chance": retrieval_chance(t2i, n, ks),
        "dense": {**{k: dense[k] for k in metric_keys}, "seconds": ip["dense_t"],
                  "images_per_s": n / ip["dense_t"] if ip["dense_t"] else None},
        "runs": [],
    }
    for (m, o), g, r, pt in zip(settings, given, ip["runs"], per_text):
        emb = torch.cat(r["emb"])
        tx = text if pt is None else pt
        rec = retrieval_recall(emb, tx, t2i, ks)
        row = _row_common(m, o, g, r, emb, ip["dense"], ip["dense_t"], n)
        row.update({k: rec[k] for k in metric_keys})
        row["t2i_top1_agreement"] = float(((tx @ emb.T).argmax(1) == dense_top1).float().mean())
        result["runs"].append(row)
    return _finish(result, ip)
