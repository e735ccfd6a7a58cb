"""Zero-shot prompts: class names and prompt templates for CLIP zero-shot classification.

ImageNet-1k class names are the curated CLIP names shipped by open_clip
(``open_clip.zero_shot_metadata.IMAGENET_CLASSNAMES``, index = ILSVRC-2012 / torchvision class
index) and the templates are ``OPENAI_IMAGENET_TEMPLATES`` (80) or its 7-template subset
``SIMPLE_IMAGENET_TEMPLATES``, from the same module (see :data:`TEMPLATE_SETS`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...errors import DataError, OptionError

__all__ = ["TEMPLATE_SETS", "CLASSNAME_SETS", "imagenet_classnames", "resolve_templates", "resolve_classnames",
           "zeroshot_prompts"]

CLASSNAME_SETS = ("auto", "imagenet1k", "dataset")


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


def zeroshot_prompts(classnames: Sequence[str], templates: str | Sequence[str], labels) -> tuple[list[str], list[str]]:
    """The zero-shot classifier's prompts: every template filled with every class name, class by class.

    Args:
        classnames: ``classnames[label]``; templates: as :func:`resolve_templates`; labels: the set's ``[N]`` labels.

    Returns:
        ``(templates, prompts)``: the resolved templates and ``len(classnames) * len(templates)`` prompts, those of
        class ``c`` at ``c * len(templates) ...``.

    Raises:
        DataError: fewer class names than labels; OptionError: bad templates (:func:`resolve_templates`).
    """
    temps = resolve_templates(templates if isinstance(templates, str) else list(templates))
    labels = np.asarray(labels)
    if len(classnames) < int(labels.max()) + 1:
        raise DataError(f"{len(classnames)} class names, but the set has labels up to {int(labels.max())}")
    return temps, [t.replace("{}", c) for c in classnames for t in temps]


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
        image_set: the labelled set (an :class:`attnpatch.evals.vision.images.ImageSet`).

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
