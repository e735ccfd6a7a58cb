"""GGUF -> transformers: a catalogue causal LM dequantized to a float32 checkpoint (see :func:`attnpatch.checkpoints.prepare`)."""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import time
from pathlib import Path

from ..errors import AttnpatchError
from ..fetch import cache_dir
from .entries import CatalogueEntry, Log, publish, remove_stale_partials
from .files import fetch_gguf, under_folder


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


def prepare_causal_lm(entry: CatalogueEntry, final: Path, log: Log) -> Path:
    """The causal-LM half of :func:`attnpatch.checkpoints.prepare`: fetch, assemble and verify the
    GGUF, dequantize it and save model and tokenizer atomically into ``final``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t0 = time.perf_counter()
    models = final.parent
    models.mkdir(parents=True, exist_ok=True)
    log(f"preparing {entry.name} (first use; converted once into {final})")
    remove_stale_partials(models, entry.name, log)
    gguf_path, cleanup = fetch_gguf(entry, log)
    facts = _gguf_tokenizer_facts(gguf_path)

    tmp = models / f".{entry.name}.partial-{os.getpid()}"
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
        _check_tokenizer(tok, facts, model.config, entry.name)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"saving {type(model).__name__} ({n_params / 1e6:.1f}M parameters) as safetensors ...")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model
        saved_tok = AutoTokenizer.from_pretrained(tmp)
        _check_tokenizer(saved_tok, facts, transformers.AutoConfig.from_pretrained(tmp), entry.name)
        source = {
            "name": entry.name,
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
        publish(tmp, final, source, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    for folder in cleanup:
        if under_folder(folder, cache_dir()):
            log(f"deleting intermediate files in {folder}")
            shutil.rmtree(folder, ignore_errors=True)
    log(f"prepared {entry.name} in {time.perf_counter() - t0:.1f} s: {final}")
    return final
