"""The datasets ``attnpatch eval clip-benchmark`` runs CLIP_benchmark on: its own dataset names (through
``clip_benchmark.datasets.builder.build_dataset``) or a local folder (our loaders), as ``torch`` datasets
yielding what its ``evaluate`` functions expect, with their data loader."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...errors import DataError, OptionError
from ...log import Log, log_stderr
from .encode import OneImage

__all__ = ["TASKS", "BenchData", "load_bench_data", "to_upstream_templates"]

#: The tasks this command runs (CLIP_benchmark's names), ``auto`` picks by dataset.
TASKS = ("auto", "zeroshot_classification", "zeroshot_retrieval")


@dataclass
class BenchData:
    """A dataset ready for CLIP_benchmark's ``evaluate``.

    Attributes:
        name: the dataset as given (a CLIP_benchmark name or a folder path).
        task: ``"zeroshot_classification"`` or ``"zeroshot_retrieval"``.
        dataset: the ``torch`` dataset (items ``(pixels [3, R, R], label)`` or ``(pixels, [captions])``);
            for classification it carries ``.classes`` and ``.templates`` as CLIP_benchmark's do.
        local: whether it is a local folder read by our loaders.
        split: the split loaded.
        classnames, templates: the class names and prompt templates (``{c}`` placeholders; a dict of
            per-class prompts for some CLIP_benchmark sets); ``None`` for retrieval.
        classnames_source: where the names came from (``"clip_benchmark"``, ``"dataset"``, ``"imagenet1k"``, a file).
    """

    name: str
    task: str
    dataset: Any = field(repr=False)
    local: bool
    split: str
    classnames: list[str] | None = None
    templates: Any = None
    classnames_source: str | None = None

    @property
    def iterable(self) -> bool:
        """Whether the dataset streams (a ``wds/`` set): no ``len``, batched by webdataset."""
        return isinstance(self.dataset, torch.utils.data.IterableDataset)

    def loader(self, batch_size: int) -> torch.utils.data.DataLoader:
        """The data loader CLIP_benchmark's ``eval`` builds: in order, one process; retrieval batches through
        ``clip_benchmark.datasets.builder.image_captions_collate_fn`` (captions kept as lists per image)."""
        from clip_benchmark.datasets.builder import image_captions_collate_fn
        from torch.utils.data import default_collate

        collate = image_captions_collate_fn if self.task == "zeroshot_retrieval" else default_collate
        if self.iterable:
            return torch.utils.data.DataLoader(self.dataset.batched(batch_size, collation_fn=collate), batch_size=None, shuffle=False)
        return torch.utils.data.DataLoader(self.dataset, batch_size=batch_size, shuffle=False, num_workers=0, collate_fn=collate)


class _Labelled(torch.utils.data.Dataset):
    def __init__(self, images, transform, classes, templates):
        self.images, self.transform, self.classes, self.templates = images, transform, classes, templates

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        image, label = self.images[i]
        return self.transform(image), label


class _Captioned(torch.utils.data.Dataset):
    def __init__(self, captions, transform):
        self.captions, self.transform = captions, transform

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, i: int):
        return self.transform(self.captions[i]), list(self.captions.captions[i])


class _First(torch.utils.data.Subset):
    """The first ``n`` items of a CLIP_benchmark dataset, keeping its ``classes`` and ``templates``."""

    def __init__(self, ds, n: int):
        super().__init__(ds, range(min(n, len(ds))))
        self.classes, self.templates = getattr(ds, "classes", None), getattr(ds, "templates", None)


def to_upstream_templates(templates: list[str]) -> list[str]:
    """Our ``{}`` templates in CLIP_benchmark's form (``template.format(c=classname)``): ``{}`` -> ``{c}``, other
    braces doubled, so each prompt is the same string ``template.replace("{}", classname)`` gives."""
    return [t.replace("{", "{{").replace("}", "}}").replace("{{}}", "{c}") for t in templates]


def _folder_task(path: Path) -> str:
    """``zeroshot_retrieval`` when the folder's ``metadata.jsonl`` (first row) or its webdataset shards hold captions."""
    from ..clip.captions import CAPTION_COLUMNS

    if any(path.glob("*.tar")) or any(path.glob("*/*.tar")):
        return "zeroshot_retrieval"
    for meta in (path / "train" / "metadata.jsonl", path / "metadata.jsonl", *sorted(path.glob("*/metadata.jsonl"))):
        if meta.is_file():
            with open(meta, encoding="utf-8") as f:
                try:
                    row = json.loads(f.readline() or "{}")
                except ValueError:
                    return "zeroshot_classification"  # the image-set loader names the broken file
            return "zeroshot_retrieval" if any(c in row for c in CAPTION_COLUMNS) else "zeroshot_classification"
    return "zeroshot_classification"


def _local(path: Path, name: str, task: str, *, split, preprocess, classnames, templates, caption_column, limit, log) -> BenchData:
    from ..clip import load_caption_set, resolve_classnames, resolve_templates

    transform = OneImage(preprocess)
    if task == "zeroshot_retrieval":
        cs = load_caption_set(path, split=split, caption_column=caption_column, limit=limit, log=log)
        return BenchData(name, task, _Captioned(cs, transform), True, cs.split)
    from ..vision.images import load_image_set

    images = load_image_set(path, split=split or "train", limit=limit, log=log)
    names, source = resolve_classnames(classnames, images)
    tmpl = resolve_templates(templates if templates != "auto" else ("openai" if source == "imagenet1k" else "photo"))
    tmpl = to_upstream_templates(tmpl)
    return BenchData(name, task, _Labelled(images, transform, names, tmpl), True, images.split, names, tmpl, source)


def _upstream(name: str, task: str, *, root, split, preprocess, templates, language, limit, log) -> BenchData:
    from clip_benchmark.datasets.builder import build_dataset

    short = name.replace("wds/", "", 1)
    root = root.format(dataset=short, dataset_cleaned=short.replace("/", "-"))
    split = split or "test"
    log(f"building CLIP_benchmark dataset {name} (root {root}, split {split}) ...")
    try:
        ds = build_dataset(dataset_name=name, root=root, transform=OneImage(preprocess), split=split, download=True,
                           language=language, task=task)
    except Exception as err:  # noqa: BLE001 - torchvision / webdataset / CLIP_benchmark raise many kinds (asserts too)
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise DataError(f"--dataset {name}: CLIP_benchmark could not build it under --dataset-root {root} "
                        f"({type(err).__name__}: {first}); offline, give a local folder or a root holding the files") from None
    if limit is not None:
        if isinstance(ds, torch.utils.data.IterableDataset):
            raise OptionError(f"--limit with --dataset {name}: a streamed wds/ set has no length to cut; drop --limit")
        ds = _First(ds, limit)
    if task == "zeroshot_retrieval":
        return BenchData(name, task, ds, False, split)
    classes, tmpl = getattr(ds, "classes", None), getattr(ds, "templates", None)
    if templates != "auto":
        from ..clip import resolve_templates

        tmpl = ds.templates = to_upstream_templates(resolve_templates(templates))
    if not classes or not tmpl:
        raise DataError(f"--dataset {name}: CLIP_benchmark gives it no class names or templates; it does not support zeroshot_classification")
    return BenchData(name, task, ds, False, split, list(classes), tmpl, "clip_benchmark")


def load_bench_data(
    dataset: str, *, task: str = "auto", root: str = "root", split: str | None = None, preprocess, classnames: str = "auto",
    templates: str = "auto", language: str = "en", caption_column: str | None = None, limit: int | None = None,
    log: Log = log_stderr,
) -> BenchData:
    """A dataset for CLIP_benchmark's ``evaluate``, its images through ``preprocess``.

    Args:
        dataset: a CLIP_benchmark dataset name (``cifar10``, ``imagenet1k``, ``mscoco_captions``, ``flickr30k``,
            ``wds/...``, ...: ``clip_benchmark.datasets.builder.build_dataset``, files under ``root``) or a local
            folder: a labelled imagefolder (:func:`attnpatch.evals.vision.images.load_image_set`) or a captioned
            one (:func:`attnpatch.evals.clip.load_caption_set`).
        task: one of :data:`TASKS`; ``auto``: CLIP_benchmark's default task of the name
            (``get_dataset_default_task``); for a folder, retrieval when it has a caption column.
        root: CLIP_benchmark's dataset root (``{dataset}`` / ``{dataset_cleaned}`` filled in, as its ``--dataset_root``).
        split: the split (default: ``test`` for CLIP_benchmark names, ``train`` for a folder, as our evals).
        preprocess: ``list[PIL.Image] -> [B, 3, R, R]`` (the model's own).
        classnames: a folder's class names, as ``eval zeroshot --classnames`` (a CLIP_benchmark set brings its own).
        templates: as ``eval zeroshot --templates``; ``auto``: a CLIP_benchmark set's own, for a folder as ``eval zeroshot``.
        language: CLIP_benchmark's language of class names and templates.
        caption_column, limit: as ``eval clip-retrieval`` / our loaders (``limit``: the first images).

    Returns:
        :class:`BenchData`.

    Raises:
        OptionError: an unknown task, ``classnames`` other than ``auto`` for a CLIP_benchmark set, ``--limit`` on a
            ``wds/`` set, bad templates.
        DataError: the dataset cannot be built or read (one line naming it).
    """
    from ..vision.images import check_limit

    if task not in TASKS:
        raise OptionError(f"--task {task!r}: allowed values are {', '.join(TASKS)}")
    limit = check_limit(limit)
    path = Path(os.fspath(dataset)).expanduser()
    if path.is_dir():
        task = _folder_task(path) if task == "auto" else task
        return _local(path, str(dataset), task, split=split, preprocess=preprocess, classnames=classnames, templates=templates,
                      caption_column=caption_column, limit=limit, log=log)
    if str(dataset).startswith((".", "/", "~")):
        raise DataError(f"--dataset {dataset}: no such folder ({path.resolve()}); give a folder or a CLIP_benchmark dataset name")
    from clip_benchmark.datasets.builder import get_dataset_default_task

    if task == "auto":
        task = get_dataset_default_task(str(dataset).replace("wds/", "", 1))
        if task not in TASKS:
            raise OptionError(f"--dataset {dataset}: its task is {task}; this command runs zeroshot_classification and zeroshot_retrieval")
    if classnames != "auto":
        raise OptionError(f"--classnames {classnames}: only for a local folder; CLIP_benchmark's {dataset} brings its own names")
    return _upstream(str(dataset), task, root=root, split=split, preprocess=preprocess, templates=templates, language=language,
                     limit=limit, log=log)
