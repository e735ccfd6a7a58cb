"""CLIP-style dual encoders (open_clip and Hugging Face) behind one interface: :func:`load_clip` -> :class:`ClipBundle`.

Model names :func:`load_clip` accepts
--------------------------------------
* ``ARCH:TAG`` -- an open_clip architecture and pretrained tag, e.g. ``ViT-B-32:openai``,
  ``ViT-L-14:openai``, ``ViT-B-32:laion2b_s34b_b79k`` (``open_clip.list_pretrained()`` lists
  them). A tag whose weights were trained with QuickGELU (the OpenAI ones) builds the model with
  QuickGELU, as the weights need. Weights already in the local cache (Hugging Face hub cache, or
  ``~/.cache/clip`` for URL downloads) are loaded from there without touching the network;
  otherwise the download endpoint is probed first (TCP, 5 s), so an offline machine gets an
  error at once instead of a hang.
* ``ARCH:random`` -- the open_clip architecture with random weights (``torch.manual_seed(0)``
  inside a forked RNG, so it is the same model every time) and no download at all: what runs
  offline (tests, smoke runs, timing). Its numbers are chance level by construction.
* ``hf-hub:ORG/REPO`` -- an open_clip model published on the Hugging Face hub (config and
  weights from the repo; loaded from the local hub cache when both are there).
* ``ORG/NAME`` -- a Hugging Face ``transformers`` model id (``CLIPModel``, ``SiglipModel``, or any
  model with ``get_image_features`` / ``get_text_features``), e.g. ``openai/clip-vit-base-patch32``.
* a local directory -- either a saved ``transformers`` model with its processor
  (``config.json`` + weights + ``preprocessor_config.json`` + tokenizer files, as written by
  ``model.save_pretrained(d); processor.save_pretrained(d)``), or an open_clip directory
  (``open_clip_config.json`` + weights).

:func:`open_clip_to_hf` converts an open_clip ``CLIP`` into a Hugging Face ``CLIPModel`` with the
same weights (and a ``CLIPProcessor`` whose tokenizer is built from open_clip's own BPE vocabulary),
so the two implementations -- and the two adapters -- can be compared on one model. It lives in
:mod:`attnpatch.clip_convert` and is importable from here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from .clip_bundle import ClipBundle
from .clip_convert import hf_clip_tokenizer_from_open_clip, open_clip_to_hf
from .errors import ModelNotFoundError, OptionError, UnsupportedModelError
from .log import log_stderr
from .patchers.adapters import adapter_for
from .hub import cached_hub_file as _cached_hub_file
from .hub import host_reachable as _host_reachable
from .hub import hub_offline as _offline
from .hub import hub_reachable as _hub_reachable
from .log import Log

__all__ = ["ClipBundle", "load_clip", "open_clip_to_hf", "hf_clip_tokenizer_from_open_clip", "RANDOM_TAG"]


RANDOM_TAG = "random"
RANDOM_SEED = 0
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# --------------------------------------------------------------------------- loading


_OFFLINE_HINT = (
    "Offline alternatives: an open_clip architecture with random weights ('ViT-B-32:random', no download), "
    "or a local directory holding a saved model (transformers: config.json + weights + processor files; "
    "open_clip: open_clip_config.json + weights)"
)


@contextlib.contextmanager
def _quiet_open_clip():
    """Drop open_clip's root-logger warning about random init (we log it ourselves), without
    letting ``logging.warning`` configure the root logger as a side effect."""

    class _Drop(logging.Filter):
        def filter(self, record):
            return "No pretrained weights loaded" not in record.getMessage()

    root = logging.getLogger()
    f = _Drop()
    null = logging.NullHandler() if not root.handlers else None
    if null is not None:
        root.addHandler(null)
    root.addFilter(f)
    try:
        yield
    finally:
        root.removeFilter(f)
        if null is not None:
            root.removeHandler(null)


def _split_open_clip_name(name: str) -> tuple[str, str] | None:
    """``(arch, tag)`` if ``name`` is ``ARCH:TAG`` with ``ARCH`` an open_clip architecture, else ``None``."""
    if ":" not in name or name.startswith(("hf-hub:", "local-dir:")):
        return None
    arch, tag = name.rsplit(":", 1)
    import open_clip

    if arch not in open_clip.list_models():
        return None
    return arch, tag


def _open_clip_weights(arch: str, tag: str) -> tuple[str, dict]:
    """``(pretrained argument for open_clip, the tag's config)``: a cached file path, or the tag when downloadable.

    Raises:
        ModelNotFoundError: unknown tag (the message lists the architecture's tags), or weights
            neither cached nor downloadable (endpoint unreachable or offline mode).
    """
    from open_clip import pretrained as ocp

    cfg = ocp.get_pretrained_cfg(arch, tag)
    if not cfg:
        tags = ocp.list_pretrained_tags_by_model(arch)
        raise ModelNotFoundError(
            f"{arch}:{tag}: {tag!r} is not a pretrained tag of open_clip's {arch}; known tags: "
            f"{', '.join(tags) if tags else '(none)'}, or {RANDOM_TAG!r} for random weights"
        )
    hub = cfg.get("hf_hub", "")
    url = cfg.get("url", "")
    if hub:
        repo, filename = os.path.split(hub)  # "org/repo/" -> ("org/repo", ""): open_clip's default file names
        if filename:
            names = [*ocp._get_safe_alternatives(filename), filename]
        else:
            names = ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"]
        hit = _cached_hub_file(repo, names)
        if hit:
            return hit, cfg
        if not _offline() and _hub_reachable():
            return tag, cfg
        where = f"the Hugging Face hub repo {repo!r}"
    else:
        local = Path(os.path.expanduser("~/.cache/clip")) / os.path.basename(url)
        if local.is_file():
            return str(local), cfg
        if url and _host_reachable(url):
            return tag, cfg
        where = url or "(no download location)"
    why = "offline mode is on (HF_HUB_OFFLINE=1)" if _offline() else "the download endpoint cannot be reached"
    raise ModelNotFoundError(
        f"{arch}:{tag}: the weights are not in the local cache and {why} ({where}). {_OFFLINE_HINT}"
    )


def _wrap_open_clip_transform(tf, resolution: int, cfg: dict):
    from .evals.vision.preprocess import Preprocess

    def fn(images):
        return torch.stack([tf(im) for im in images])

    return Preprocess(
        kind="open_clip", resolution=resolution, resize={"shortest_edge": resolution, "mode": cfg.get("resize_mode", "shortest")},
        mean=tuple(float(v) for v in cfg.get("mean", ())), std=tuple(float(v) for v in cfg.get("std", ())), _fn=fn,
    )


def _load_open_clip(spec: str, pretrained: str | None, cfg: dict, *, device, dtype, resolution, random_init: bool, log: Log, name: str):
    import open_clip

    kw: dict[str, Any] = {}
    if cfg.get("quick_gelu"):
        kw["force_quick_gelu"] = True
    for key, arg in (("mean", "image_mean"), ("std", "image_std"), ("interpolation", "image_interpolation"), ("resize_mode", "image_resize_mode")):
        if key in cfg:
            kw[arg] = cfg[key]
    if resolution is not None:
        kw["force_image_size"] = resolution
    with _quiet_open_clip():
        if random_init:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(RANDOM_SEED)
                model, _, tf = open_clip.create_model_and_transforms(spec, pretrained=None, **kw)
        else:
            model, _, tf = open_clip.create_model_and_transforms(spec, pretrained=pretrained, **kw)
    model = model.to(device=device, dtype=dtype).eval()
    tokenizer = open_clip.get_tokenizer(spec)
    visual = model.visual
    size = getattr(visual, "image_size", None) or visual.preprocess_cfg.get("size")
    res = int(size[0] if isinstance(size, (tuple, list)) else size)
    pcfg = dict(getattr(visual, "preprocess_cfg", {}) or {})
    embed = int(getattr(visual, "output_dim", 0) or model.text_projection.shape[-1])
    return ClipBundle(
        model=model, preprocess=_wrap_open_clip_transform(tf, res, pcfg), tokenizer=tokenizer, kind="open_clip",
        name=name, resolution=res, embed_dim=embed, random_init=random_init,
    )


def _load_hf(source: str | Path, *, device, dtype, resolution, log: Log, name: str, local_files_only: bool):
    from transformers import AutoModel, AutoProcessor

    from .evals.vision.preprocess import make_preprocess

    try:
        processor = AutoProcessor.from_pretrained(source, local_files_only=local_files_only)
        model = AutoModel.from_pretrained(source, dtype=dtype, local_files_only=local_files_only)
    except Exception as err:  # noqa: BLE001 - transformers raises OSError, ValueError, SafetensorError ...
        if isinstance(source, Path):
            raise ModelNotFoundError(
                f"{source}: could not load a transformers model and its processor ({type(err).__name__}: "
                f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); expected config.json + weights + "
                f"preprocessor_config.json + tokenizer files (model.save_pretrained(d); processor.save_pretrained(d))"
            ) from err
        if not isinstance(err, OSError):
            raise
        raise ModelNotFoundError(
            f"could not load {name!r} from the Hugging Face hub ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}). {_OFFLINE_HINT}"
        ) from err
    if not (hasattr(model, "get_image_features") and hasattr(model, "get_text_features")):
        raise UnsupportedModelError(
            f"{name!r} loads as {type(model).__name__}, which has no get_image_features / get_text_features; "
            "expected a dual encoder such as CLIPModel or SiglipModel"
        )
    image_processor = getattr(processor, "image_processor", None)
    tok = getattr(processor, "tokenizer", None)
    if image_processor is None or tok is None:
        raise ModelNotFoundError(f"{name!r}: the processor ({type(processor).__name__}) lacks an image processor or a tokenizer")
    model = model.to(device).eval()
    vcfg = model.config.vision_config
    tcfg = model.config.text_config
    native = int(vcfg.image_size)
    preprocess = make_preprocess(image_processor, resolution)
    res = int(resolution or native)
    max_len = int(min(getattr(tok, "model_max_length", 10**9) or 10**9, getattr(tcfg, "max_position_embeddings", 77)))

    def tokenizer(texts):
        return tok(list(texts), padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")

    embed = int(getattr(model.config, "projection_dim", 0) or getattr(tcfg, "hidden_size"))
    return ClipBundle(
        model=model, preprocess=preprocess, tokenizer=tokenizer, kind="hf", name=name, resolution=res, embed_dim=embed,
    )


def load_clip(
    name: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    resolution: int | None = None, log: Log = log_stderr, resolution_flag: str = "resolution",
) -> ClipBundle:
    """Load a CLIP-style dual encoder, its image preprocessing and its tokenizer.

    Args:
        name: ``ARCH:TAG`` (open_clip pretrained), ``ARCH:random`` (open_clip architecture, random
            weights, seed 0, no download), ``hf-hub:ORG/REPO`` (open_clip on the hub), a Hugging
            Face model id ``ORG/NAME``, or a local directory (saved transformers model + processor,
            or an open_clip ``open_clip_config.json`` + weights); see the module docstring.
        device: where to put the model.
        dtype: weight dtype; ``None`` means ``torch.float32``.
        resolution: input side in pixels; ``None`` keeps the model's. open_clip builds the tower at
            that size (pretrained position embeddings are resampled by open_clip on load);
            Hugging Face models interpolate their position embeddings
            (``interpolate_pos_encoding=True``). The preprocessing follows. A side that is not a
            multiple of the image tower's patch size is rounded to the nearest multiple (``log``
            says so; see :func:`attnpatch.evals.vision.preprocess.fit_resolution`); one below it is refused.
        log: receives one line per step (defaults to stderr).
        resolution_flag: how messages name ``resolution`` (the CLI passes ``"--resolution"``).

    Returns:
        :class:`ClipBundle`.

    Raises:
        ModelNotFoundError: an unknown name; an open_clip tag the architecture does not have (the
            message lists its tags); weights that are neither cached nor reachable (hub or download
            host unreachable -- probed with a 5 s TCP connect, so this fails fast -- or offline
            mode); a directory without a loadable model; a file of a local directory that is corrupt
            or truncated (:class:`attnpatch.checkpoints.ModelFileError`, naming the file).
        UnsupportedModelError: a transformers model that is not a dual encoder (a causal LM or a ViT
            image encoder folder: the message says which loader takes it).
        OptionError: ``resolution`` not a positive int, or smaller than the image tower's patch size.
    """
    import time

    if resolution is not None and (isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1):
        raise OptionError(f"resolution={resolution!r}: must be a positive int (square side in pixels) or None")
    from .checkpoints import config_kind, wrong_kind_error, check_model_files
    from .evals.vision.preprocess import fit_resolution

    dtype = torch.float32 if dtype is None else dtype
    raw = os.fspath(name)
    t0 = time.perf_counter()
    path = Path(raw).expanduser()
    if path.is_dir() and ((path / "open_clip_config.json").is_file() or (path / "config.json").is_file()):
        check_model_files(path)  # a truncated weights file or a broken JSON fails here, named
        if not (path / "open_clip_config.json").is_file():
            got, arch = config_kind(path)
            if got is not None and got != "clip":
                raise wrong_kind_error(str(path.resolve()), got, arch, "clip")
    resolution = fit_resolution(resolution, _patch_size_hint(raw, path), log=log, what=resolution_flag)
    common = dict(device=device, dtype=dtype, resolution=resolution, log=log, name=raw)
    if path.is_dir():
        if (path / "open_clip_config.json").is_file():
            log(f"loading open_clip directory {path} ...")
            try:
                bundle = _load_open_clip(f"local-dir:{path}", None, {}, random_init=False, **common)
            except Exception as err:  # noqa: BLE001 - open_clip / torch raise many kinds on a bad folder
                raise ModelNotFoundError(
                    f"{path.resolve()}: could not load the open_clip model ({type(err).__name__}: "
                    f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); expected open_clip_config.json "
                    f"+ open_clip_model.safetensors or open_clip_pytorch_model.bin"
                ) from err
        elif (path / "config.json").is_file():
            log(f"loading transformers directory {path} ...")
            bundle = _load_hf(path, local_files_only=True, **common)
        else:
            raise ModelNotFoundError(
                f"{path.resolve()} holds neither config.json (a saved transformers model) nor open_clip_config.json "
                f"(an open_clip model directory)"
            )
    elif raw.startswith("hf-hub:"):
        repo = raw[len("hf-hub:"):]
        cfg_file = _cached_hub_file(repo, ["open_clip_config.json"])
        weights = _cached_hub_file(repo, ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"])
        if cfg_file and weights and Path(cfg_file).parent == Path(weights).parent:
            log(f"loading open_clip {raw} from the local hub cache ...")
            bundle = _load_open_clip(f"local-dir:{Path(cfg_file).parent}", None, {}, random_init=False, **common)
        elif not _offline() and _hub_reachable():
            log(f"loading open_clip {raw} ...")
            bundle = _load_open_clip(raw, None, {}, random_init=False, **common)
        else:
            why = "offline mode is on (HF_HUB_OFFLINE=1)" if _offline() else "the Hugging Face hub cannot be reached"
            raise ModelNotFoundError(f"{raw}: not in the local hub cache and {why}. {_OFFLINE_HINT}")
    elif (split := _split_open_clip_name(raw)) is not None:
        arch, tag = split
        if tag == RANDOM_TAG:
            log(f"building open_clip {arch} with random weights (seed {RANDOM_SEED}; no download) ...")
            bundle = _load_open_clip(arch, None, {}, random_init=True, **common)
        else:
            pretrained, cfg = _open_clip_weights(arch, tag)
            log(f"loading open_clip {arch} with weights {tag!r}" + (f" from {pretrained}" if pretrained != tag else "") + " ...")
            bundle = _load_open_clip(arch, pretrained, cfg, random_init=False, **common)
    elif _HF_ID.match(raw) and not raw.startswith((".", "~")):
        cached = _cached_hub_file(raw, ["config.json"]) is not None
        if not cached and (_offline() or not _hub_reachable()):
            why = "offline mode is on (HF_HUB_OFFLINE=1)" if _offline() else "the Hugging Face hub cannot be reached"
            raise ModelNotFoundError(
                f"{raw!r} is not a local directory or an open_clip name, and as a Hugging Face model id it is not in the "
                f"local cache while {why}. {_OFFLINE_HINT}"
            )
        log(f"loading transformers model {raw} ...")
        bundle = _load_hf(raw, local_files_only=cached and (_offline() or not _hub_reachable()), **common)
    else:
        import open_clip

        arch = raw.split(":", 1)[0]
        if arch in open_clip.list_models():
            tags = open_clip.list_pretrained_tags_by_model(arch)
            raise ModelNotFoundError(
                f"{raw!r}: name the weights as ARCH:TAG, e.g. {arch}:{tags[0] if tags else RANDOM_TAG}; tags of {arch}: "
                f"{', '.join(tags) if tags else '(none)'}, or {arch}:{RANDOM_TAG} for random weights"
            )
        raise ModelNotFoundError(
            f"{raw!r} is not a local directory, an open_clip name (ARCH:TAG, e.g. ViT-B-32:openai; ARCH:random; "
            f"hf-hub:ORG/REPO) or a Hugging Face model id (ORG/NAME)"
            + (f": {path.resolve()} does not exist" if raw.startswith((".", "/", "~")) else "")
        )
    patch = _bundle_patch(bundle)
    if patch and bundle.resolution < patch:  # the patch size was not known before building
        raise OptionError(f"{resolution_flag} {bundle.resolution}: smaller than the model's patch size ({patch} px)")
    log(f"loaded {type(bundle.model).__name__} ({bundle.kind}, {bundle.resolution} px) in {time.perf_counter() - t0:.2f} s")
    return bundle


def _bundle_patch(bundle: ClipBundle) -> int | None:
    """The image tower's patch side as its adapter tells it; ``None`` where it cannot (an open_clip timm trunk)."""
    try:
        return adapter_for(bundle.model).patch_size(bundle.model)
    except UnsupportedModelError:
        return None


def _patch_size_hint(raw: str, path: Path) -> int | None:
    """The image tower's patch side in pixels, read from a config before the model is built (``None``
    when it cannot be told cheaply, e.g. an uncached hub model, or a timm-tower open_clip model)."""
    import json

    def pick(vcfg) -> int | None:
        p = vcfg.get("patch_size") if isinstance(vcfg, dict) else None
        p = p[0] if isinstance(p, (tuple, list)) and p else p
        return int(p) if isinstance(p, (int, float)) and p > 0 else None

    try:
        if path.is_dir() and (path / "open_clip_config.json").is_file():
            cfg = json.loads((path / "open_clip_config.json").read_text())
            return pick(cfg.get("model_cfg", {}).get("vision_cfg", {}))
        cfg_file = path / "config.json" if path.is_dir() else None
        if cfg_file is None and _HF_ID.match(raw) and not raw.startswith((".", "~")) and ":" not in raw:
            cached = _cached_hub_file(raw, ["config.json"])
            cfg_file = Path(cached) if cached else None
        if cfg_file is not None and cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            return pick(cfg.get("vision_config") or cfg)
        split = _split_open_clip_name(raw) if not raw.startswith("hf-hub:") else None
        if split is not None:
            import open_clip

            return pick((open_clip.get_model_config(split[0]) or {}).get("vision_cfg", {}))
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return None
