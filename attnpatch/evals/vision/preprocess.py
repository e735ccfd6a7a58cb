"""Model preprocessing: a model's own image pipeline as ``list[PIL.Image] -> [B, 3, R, R]``, at any square resolution.

:func:`make_preprocess` wraps a Hugging Face image processor or a timm data config into a
:class:`Preprocess` and can rescale it to another side ``R`` (resize and crop scale together);
:func:`fit_resolution` rounds a side to a multiple of a ViT's patch size. The pipelines themselves are the adapters' (:func:`attnpatch.patchers.adapters.image_pipeline`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import OptionError
from ...log import Log, log_stderr
from ...patchers.adapters import image_pipeline
from .image_io import to_rgb

__all__ = ["Preprocess", "fit_resolution", "make_preprocess"]


def _check_resolution(resolution) -> int | None:
    if resolution is None:
        return None
    if isinstance(resolution, bool) or not isinstance(resolution, numbers.Integral) or resolution < 1:
        raise OptionError(f"resolution={resolution!r}: must be a positive int (square side in pixels) or None")
    return int(resolution)


def fit_resolution(resolution: int | None, patch: int | None, log: Log = log_stderr, what: str = "resolution") -> int | None:
    """Fit an input side to a ViT's patch size.

    A ViT cuts its input into ``patch x patch`` pixel squares and drops what is left over at the
    right and bottom edges, so a side that is not a multiple of the patch is rounded here to the
    nearest multiple (at least one patch), and ``log`` says so once. A side smaller than one patch
    is refused (the patch embedding's convolution cannot run on it).

    Args:
        resolution: the requested side in pixels (``None``: the model's own; returned as is).
        patch: the model's patch side in pixels (``None`` or 0 when unknown: returned as is).
        log: receives the one line saying what the side was rounded to.
        what: how the message names the value (e.g. ``"--resolution"``).

    Returns:
        The side to use: ``resolution`` if a multiple of ``patch``, else ``patch * round(resolution / patch)``.

    Raises:
        OptionError: ``resolution < patch``.
    """
    if resolution is None or not patch:
        return resolution
    if resolution < patch:
        example = patch * max(1, int(224 / patch + 0.5))
        raise OptionError(
            f"{what} {resolution}: smaller than the model's patch size ({patch} px); use a multiple of {patch} "
            f"(e.g. {example})"
        )
    if resolution % patch:
        fitted = max(patch, patch * int(resolution / patch + 0.5))
        log(
            f"{what} {resolution} is not a multiple of the model's patch size {patch}: rounded to {fitted} "
            f"({fitted // patch} x {fitted // patch} patches)"
        )
        return fitted
    return resolution


@dataclass
class Preprocess:
    """``list[PIL.Image] -> torch.Tensor [B, 3, R, R]`` float32, built by :func:`make_preprocess`.

    Attributes:
        kind: ``"hf"`` (a Hugging Face image processor) or ``"timm"`` (a timm data config).
        resolution: output side ``R`` in pixels (``None`` when left to the processor).
        resize: what the resize step targets before the crop (e.g. ``{"shortest_edge": 512}``),
            for the record.
        mean, std: per-channel normalisation the pipeline applies (in units of [0, 1] pixel values).
    """

    kind: str
    resolution: int | None
    resize: dict
    mean: tuple[float, ...]
    std: tuple[float, ...]
    _fn: Callable = field(repr=False)

    def __call__(self, images):
        """Preprocess a list of PIL images (a single image is accepted too) into ``[B, 3, R, R]`` float32.

        Raises:
            OptionError: an empty list, or an element that is not a PIL image.
        """
        from PIL import Image

        if isinstance(images, Image.Image):
            images = [images]
        images = list(images)
        if not images:
            raise OptionError("images: empty list; pass at least one PIL image")
        bad = [type(im).__name__ for im in images if not isinstance(im, Image.Image)]
        if bad:
            raise OptionError(f"images: expected PIL images, got {bad[0]}")
        out = self._fn([to_rgb(im) for im in images])
        return out.float().contiguous()


def make_preprocess(image_processor, resolution: int | None = None) -> Preprocess:
    """Batch preprocessing of PIL images with a model's own pipeline, optionally at another resolution.

    Args:
        image_processor: a Hugging Face image processor (e.g. the ``BitImageProcessor`` of DINOv2:
            resize the shortest edge to 256 px (bicubic), center-crop 224 x 224, rescale by 1/255,
            normalise with the ImageNet mean/std), or a timm data config dict as returned by
            ``timm.data.resolve_data_config`` (``input_size``, ``interpolation``, ``mean``, ``std``,
            ``crop_pct``, ``crop_mode``).
        resolution: ``None`` runs the pipeline unchanged. An int ``R`` makes the output ``R x R``
            with the same crop fraction: the resize target becomes ``round(R * resize / crop)``
            (for DINOv2 ``round(R * 256 / 224)``: 256 for 224, 512 for 448, 1024 for 896) and the
            center crop ``R``. For a Hugging Face processor this applies to ``size`` of kind
            ``shortest_edge`` or ``height``/``width`` with ``do_center_crop``; a processor that
            resizes straight to ``height``/``width`` without a crop gets ``R x R``. For a timm config
            ``resize / crop = 1 / crop_pct`` (timm's own pipeline is used, including its
            interpolation and ``crop_mode``; only its scale size is set to ``round(R / crop_pct)``).
            The model must accept that input size (ViTs such as DINOv2 interpolate their position
            embeddings).

    Returns:
        a :class:`Preprocess`: callable ``list[PIL.Image] -> torch.Tensor [B, 3, R, R]`` float32
        (normalised pixel values: ``(x / 255 - mean) / std``; about [-2.1, 2.6] for ImageNet stats).

    Raises:
        OptionError: ``resolution`` is not a positive int (the message names the value); the
            processor is neither a Hugging Face image processor nor a timm config dict; or its
            ``size`` has a form whose resolution cannot be changed.
    """
    resolution = _check_resolution(resolution)
    kind, fn, resize, mean, std = image_pipeline(image_processor, resolution)
    return Preprocess(kind=kind, resolution=resolution, resize=resize, mean=mean, std=std, _fn=fn)
