"""Bad files and bad arguments: one clear line naming the file or value, a non-zero exit, checked before
the long work, nothing half-written; Ctrl-C writes what is finished and exits 130.

Every model is tiny and random, saved to tmp_path (no hub, no real checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from attnpatch.cli import main
from attnpatch.errors import DataError
from conftest import tiny_causal_lm

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
ANCHOR_SMALL = ["-o", "theta=2", "-o", "min_len=0", "-o", "block_size=32", "-o", "local_window=32", "-o", "init_block=16"]


def error_line(err: str) -> str:
    """The one ``attnpatch: error:`` line of a failed command (and no traceback)."""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("attnpatch: error:")]
    assert len(lines) == 1, err
    return lines[0]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def llm_dir(tiny_lm_dir):
    return tiny_lm_dir


@pytest.fixture(scope="module")
def clip_dirs(tmp_path_factory):
    """A tiny CLIP as a transformers folder (CLIPModel, no processor needed for these tests) and as an open_clip folder."""
    from tiny_models import open_clip_cfg, tiny_hf_clip, tiny_open_clip

    hf = tmp_path_factory.mktemp("tiny-clip-hf")
    tiny_hf_clip(text=dict(num_hidden_layers=1, num_attention_heads=2, vocab_size=49408, max_position_embeddings=77),
                 vision=dict(num_hidden_layers=1, num_attention_heads=2)).save_pretrained(hf)
    oc = tmp_path_factory.mktemp("tiny-clip-open_clip")
    vision, text = dict(layers=2), dict(layers=1)
    model = tiny_open_clip(seed=None, vision=vision, text=text)
    (oc / "open_clip_config.json").write_text(json.dumps({"model_cfg": open_clip_cfg(vision, text), "preprocess_cfg": {}}))
    torch.save(model.state_dict(), oc / "open_clip_pytorch_model.bin")
    return hf, oc


def _folder(root: Path, n: int = 12, classes: int = 3) -> Path:
    (root / "train").mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        label = i % classes
        arr = (rng.random((80, 96, 3)) * 60 + 60 * label).astype(np.uint8)
        Image.fromarray(arr).save(root / "train" / f"img{i:02d}.jpg")
        rows.append({"file_name": f"img{i:02d}.jpg", "label": label})
    (root / "train" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return _folder(tmp_path_factory.mktemp("imgs") / "set")


# --------------------------------------------------------------------------- corrupt weights


@pytest.mark.parametrize("which", ["llm", "vit"])
def test_corrupt_safetensors_is_one_line_naming_the_file(which, llm_dir, tiny_vit_dir, tmp_path, capsys, images):
    import shutil

    bad = tmp_path / "model"
    shutil.copytree(llm_dir if which == "llm" else tiny_vit_dir, bad)
    weights = bad / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    out = tmp_path / "r.json"
    if which == "llm":
        argv = ["eval", "ruler", "--model", str(bad), "--lengths", "300", "--samples", "1", "--json", str(out)]
    else:
        argv = ["eval", "fidelity", "--model", str(bad), "--data", str(images), "--json", str(out)]
    assert main(argv) == 2
    line = error_line(capsys.readouterr().err)
    assert str(weights) in line and "not a readable safetensors file" in line and "truncated or corrupt" in line
    assert not out.exists()


def test_broken_json_config_is_named(llm_dir, tmp_path, capsys):
    import shutil

    bad = tmp_path / "model"
    shutil.copytree(llm_dir, bad)
    (bad / "tokenizer_config.json").write_text('{"model_max_length": ')
    assert main(["eval", "ruler", "--model", str(bad), "--lengths", "300", "--samples", "1"]) == 2
    line = error_line(capsys.readouterr().err)
    assert str(bad / "tokenizer_config.json") in line and "not valid JSON" in line


# --------------------------------------------------------------------------- causal LM without tokenizer


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_causal_lm_without_tokenizer_files_is_refused(kind, tmp_path, capsys):
    """Qwen2: AutoTokenizer builds an empty tokenizer (encodes everything to []), and the RULER length search
    grew the prompt without bound (21 GB, killed). Llama: a ValueError traceback. Both: one line now."""
    d = tmp_path / kind
    tiny_causal_lm(kind).save_pretrained(d)
    out = tmp_path / "r.json"
    assert main(["eval", "ruler", "--model", str(d), "--lengths", "300", "--samples", "1", "--json", str(out)]) == 2
    line = error_line(capsys.readouterr().err)
    assert str(d) in line and "holds no tokenizer files" in line and "tokenizer.save_pretrained" in line
    assert not out.exists()


def test_causal_lm_with_an_empty_tokenizer_is_refused(tmp_path, capsys):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    d = tmp_path / "emptytok"
    tiny_causal_lm("llama").save_pretrained(d)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE())).save_pretrained(d)  # tokenizer.json with no vocabulary
    assert main(["eval", "ruler", "--model", str(d), "--lengths", "300", "--samples", "1"]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{d}: the tokenizer" in line and "encodes text to no tokens" in line


def test_empty_tokenizer_cannot_loop_the_length_search():
    """Defence in depth in the task builder: a tokenizer that encodes text to nothing is refused at once."""
    from attnpatch.evals.ruler import tasks as rt
    from attnpatch.evals.ruler import text

    class Empty:
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": []}

        def __len__(self):
            return 1

    with pytest.raises(DataError, match="encodes text to no tokens"):
        rt.make_samples("niah_single", Empty(), 300, 1)
    with pytest.raises(DataError, match="adding filler does not add tokens"):
        text.fit_length(lambda n: 5, 1, None, 100, "task 'x'")


def test_ruler_checks_every_cell_before_the_first_generation(llm_dir, tmp_path, capsys):
    """A length too short for the task used to fail after the earlier cells ran (and wrote a partial JSON)."""
    out = tmp_path / "r.json"
    assert main(["eval", "ruler", "--model", str(llm_dir), "--method", "dense", "--lengths", "300", "20", "--samples", "1",
                 "--no-recall", "--json", str(out)]) == 2
    line = error_line(capsys.readouterr().err)
    assert "length=20 tokens is too small" in line
    assert not out.exists()


@pytest.fixture()
def no_loading(monkeypatch):
    import attnpatch.checkpoints as ck

    def fail(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(ck, "load_causal_lm", fail)


@pytest.mark.parametrize("argv,flag", [
    (["eval", "ruler", "--lengths", "512", "10000000"], "--lengths 10000000"),
    (["compare", "--eval", "ruler", "--method", "a_shape", "--lengths", "10000000"], "--lengths 10000000"),
    (["tune", "--kind", "causal_lm", "--length", "10000000"], "--length 10000000"),
])
def test_a_length_beyond_the_models_context_is_refused_before_loading(argv, flag, llm_dir, tmp_path, capsys, no_loading):
    """The tiny Llama's max_position_embeddings is 1024: ten million tokens ran RULER's haystack generation for more
    than 10 minutes with no word."""
    outs = ["--out", str(tmp_path / "t.json")] if argv[0] == "tune" else []
    assert main([*argv, "--model", str(llm_dir), "--json", str(tmp_path / "r.json"), *outs]) == 2
    assert error_line(capsys.readouterr().err) == (
        f"attnpatch: error: {flag}: beyond the model's context of 1024 tokens (max_position_embeddings in "
        f"{llm_dir / 'config.json'}); give lengths up to 1024")
    assert not (tmp_path / "r.json").exists()


def test_rope_scaling_stretches_the_context(tmp_path, capsys, monkeypatch):
    """A YaRN-scaled config (factor 4 x original 1024) takes 4096 tokens, and names its rope parameters past that."""
    from transformers import LlamaConfig

    import attnpatch.checkpoints as ck

    folder = tmp_path / "yarn"
    LlamaConfig(max_position_embeddings=1024, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 1024}).save_pretrained(folder)
    assert ck.model_context(folder) == ck.ModelContext(
        4096, f"rope_parameters yarn: factor 4.0 x original_max_position_embeddings 1024, in {folder / 'config.json'}")

    class Loaded(Exception):
        pass

    def loaded(*a, **k):
        raise Loaded

    monkeypatch.setattr(ck, "load_causal_lm", loaded)
    with pytest.raises(Loaded):  # 4096 passes the check: the model loads next
        main(["eval", "ruler", "--model", str(folder), "--lengths", "4096", "--json", str(tmp_path / "r.json")])
    assert main(["eval", "ruler", "--model", str(folder), "--lengths", "4097", "--json", str(tmp_path / "r.json")]) == 2
    assert "--lengths 4097: beyond the model's context of 4096 tokens (rope_parameters yarn: factor 4.0" in error_line(capsys.readouterr().err)


@pytest.mark.parametrize("config,tokens,source", [
    ({"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}, 8192,
     "max_position_embeddings in c.json"),
    ({"n_positions": 1024}, 1024, "n_positions in c.json"),
    # Qwen2.5's long-context recipe: a hub config.json of transformers 4 names it rope_scaling, with "type"
    ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     131072, "rope_scaling yarn: factor 4.0 x original_max_position_embeddings 32768, in c.json"),
    # Llama 3.1: max_position_embeddings already holds the scaled length
    ({"max_position_embeddings": 131072, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}},
     131072, "max_position_embeddings in c.json"),
    # linear scaling without an original length stretches max_position_embeddings; one dict per layer type
    ({"max_position_embeddings": 4096, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                                                           "sliding_attention": {"rope_type": "default"}}},
     32768, "rope_parameters['full_attention'] linear: factor 8.0 x original_max_position_embeddings 4096, in c.json"),
    # Phi-3's longrope keeps the pre-training length beside the rope dict
    ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
      "rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}}, 131072, "max_position_embeddings in c.json"),
    ({"text_config": {"max_position_embeddings": 2048}}, 2048, "max_position_embeddings in c.json (text_config)"),
])
def test_the_context_a_config_declares(config, tokens, source):
    from attnpatch.checkpoints import ModelContext, config_context

    assert config_context(config, "c.json") == ModelContext(tokens, source)
    assert config_context({"model_type": "x"}, "c.json") is None


# --------------------------------------------------------------------------- images


def test_truncated_jpeg_is_refused_before_the_run_naming_the_file(tiny_vit_dir, tmp_path, capsys):
    data = _folder(tmp_path / "set")
    bad = data / "train" / "img03.jpg"
    src = next(iter(sorted((SHARED / "imagenet-1k-samples" / "train").glob("*.jpg"))), None)
    raw = src.read_bytes() if src else bad.read_bytes()
    bad.write_bytes(raw[: len(raw) // 3])
    out = tmp_path / "r.json"
    assert main(["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(data), "--resolution", "70", "--json", str(out)]) == 2
    line = error_line(capsys.readouterr().err)
    assert str(bad) in line and "truncated or corrupt JPEG" in line and "remove it and its row in metadata.jsonl" in line
    assert not out.exists()


def test_undecodable_image_at_load_time_names_the_file(tmp_path):
    """Damage that the up-front check cannot see (here: the file changes after loading) is reported when decoded."""
    from attnpatch.evals.vision.images import load_image_set

    data = _folder(tmp_path / "set")
    s = load_image_set(data, log=lambda m: None)
    bad = data / "train" / "img05.jpg"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(DataError, match=r"img05\.jpg: cannot decode the image .*remove it from the set"):
        s[5]
    assert s[4][0].size == (96, 80)


def test_empty_and_non_image_files_are_named(tmp_path):
    from attnpatch.evals.vision.images import load_image_set

    data = _folder(tmp_path / "set")
    (data / "train" / "img02.jpg").write_bytes(b"")
    (data / "train" / "img07.jpg").write_text("hello")
    with pytest.raises(DataError, match=r"img02\.jpg: an empty file \(0 bytes\).*1 more bad image file\(s\): img07\.jpg"):
        load_image_set(data, log=lambda m: None)


def test_broken_metadata_line_is_named(tmp_path):
    from attnpatch.evals.vision.images import load_image_set

    data = _folder(tmp_path / "set")
    with open(data / "train" / "metadata.jsonl", "a") as f:
        f.write('{"file_name": "img00.jpg", "label": \n')
    with pytest.raises(DataError, match=r"train/metadata\.jsonl: line 13 is not valid JSON"):
        load_image_set(data, log=lambda m: None)


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I"])
def test_16_bit_grayscale_is_scaled_not_clipped(mode, tmp_path):
    from attnpatch.evals.vision.images import load_image_set

    data = _folder(tmp_path / "set")
    wide = np.linspace(0, 65535, 80 * 96).reshape(80, 96).astype(np.uint16)
    img = Image.fromarray(wide)  # mode I;16
    if mode == "I;16B":
        img = Image.frombytes("I;16B", img.size, wide.astype(">u2").tobytes())
    elif mode == "I":
        img = Image.fromarray(wide.astype(np.int32), mode="I")
    assert img.mode == mode
    path = data / "train" / "img00.png"
    Image.fromarray(wide).save(path)  # a 16-bit grayscale PNG (Pillow reads it back as I;16)
    (data / "train" / "img00.jpg").unlink()
    meta = data / "train" / "metadata.jsonl"
    meta.write_text(meta.read_text().replace('"img00.jpg"', '"img00.png"'))
    s = load_image_set(data, log=lambda m: None)
    rgb = np.asarray(s[0][0])
    want = np.rint(wide / 257.0).astype(np.uint8)
    assert s[0][0].mode == "RGB" and rgb.shape == (80, 96, 3)
    assert np.array_equal(rgb[..., 0], want) and np.array_equal(rgb[..., 1], want) and np.array_equal(rgb[..., 2], want)
    assert (rgb == 255).mean() < 0.01  # PIL's convert("RGB") made 99.6 % of these pixels 255
    from attnpatch.evals.vision.image_io import to_rgb

    assert np.array_equal(np.asarray(to_rgb(img))[..., 0], want)  # every 16-bit mode, straight from memory


# --------------------------------------------------------------------------- --resolution


def test_resolution_below_the_patch_is_refused(tiny_vit_dir, images, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(images), "--resolution", "13", "--json", str(out)]) == 2
    line = error_line(capsys.readouterr().err)
    assert line == "attnpatch: error: --resolution 13: smaller than the model's patch size (14 px); use a multiple of 14 (e.g. 224)"
    assert not out.exists()


def test_resolution_not_a_multiple_of_the_patch_is_rounded_and_said_once(tiny_vit_dir, images, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(images), "--resolution", "75", "--k", "3", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    note = "--resolution 75 is not a multiple of the model's patch size 14: rounded to 70 (5 x 5 patches)"
    assert err.count(note) == 1
    res = json.loads(out.read_text())
    assert res["resolution"] == 70 and res["tokens"] == 26


def test_clip_resolution_is_fitted_to_the_patch(clip_dirs, capsys):
    from attnpatch.clip_models import load_clip
    from attnpatch.errors import OptionError

    _, oc = clip_dirs
    lines = []
    b = load_clip(oc, resolution=70, log=lines.append)
    assert b.resolution == 72 and any("resolution 70 is not a multiple of the model's patch size 8: rounded to 72" in ln for ln in lines)
    with pytest.raises(OptionError, match="resolution 5: smaller than the model's patch size"):
        load_clip(oc, resolution=5, log=lambda m: None)


# --------------------------------------------------------------------------- output paths


def _argv(cmd: str, llm_dir, tiny_vit_dir, images, clip_dirs) -> list[str]:
    return {
        "ruler": ["eval", "ruler", "--model", str(llm_dir), "--lengths", "300", "--samples", "1"],  # within its 1024 positions
        "knn": ["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(images)],
        "zeroshot": ["eval", "zeroshot", "--model", str(clip_dirs[1]), "--data", str(images)],
        "clip-retrieval": ["eval", "clip-retrieval", "--model", str(clip_dirs[1]), "--data", str(images)],
        "sinks": ["sinks", "--model", str(tiny_vit_dir), "--data", str(images)],
    }[cmd]


@pytest.mark.parametrize("cmd,flag", [
    ("ruler", "--json"), ("ruler", "--markdown"), ("knn", "--json"), ("knn", "--markdown"),
    ("zeroshot", "--json"), ("clip-retrieval", "--markdown"), ("sinks", "--json"),
])
def test_output_path_that_is_a_directory_is_refused_up_front(cmd, flag, llm_dir, tiny_vit_dir, images, clip_dirs, tmp_path, capsys, monkeypatch):
    import attnpatch.checkpoints as ck
    import attnpatch.clip_models as cm
    import attnpatch.evals.vision.images as im

    def boom(*a, **k):
        raise AssertionError("loaded something before checking the output path")

    for mod, fn in ((ck, "load_causal_lm"), (ck, "load_vision_model"), (cm, "load_clip"), (im, "load_image_set")):
        monkeypatch.setattr(mod, fn, boom)
    d = tmp_path / "out"
    d.mkdir()
    assert main(_argv(cmd, llm_dir, tiny_vit_dir, images, clip_dirs) + [flag, str(d)]) == 2
    assert error_line(capsys.readouterr().err) == f"attnpatch: error: {flag} {d}: is a directory; give a file path"


def test_other_unusable_output_paths(tiny_vit_dir, images, tmp_path, capsys):
    base = ["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(images)]
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    assert main(base + ["--markdown", str(afile / "r.md")]) == 2
    assert error_line(capsys.readouterr().err).endswith(f"{afile} is a file, not a folder")
    same = str(tmp_path / "r.json")
    assert main(base + ["--json", same, "--markdown", same]) == 2
    assert "the same file as --json" in error_line(capsys.readouterr().err)
    if Path("/proc/self").is_dir():  # a place nobody can create files in, not even root
        assert main(base + ["--json", "/proc/attnpatch-test.json"]) == 2
        assert "--json /proc/attnpatch-test.json: cannot create a file in /proc" in error_line(capsys.readouterr().err)
    assert not list(tmp_path.glob(".attnpatch-write-test-*"))


def test_missing_parent_folders_are_created(tiny_vit_dir, images, tmp_path):
    md = tmp_path / "new" / "deeper" / "r.md"
    js = tmp_path / "other" / "r.json"
    assert main(["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(images), "--resolution", "70", "--k", "3",
                 "--json", str(js), "--markdown", str(md)]) == 0
    assert json.loads(js.read_text())["n_images"] == 12 and md.read_text().startswith("### knn")


# --------------------------------------------------------------------------- wrong kind of model folder


def test_clip_folder_given_to_a_vision_eval(clip_dirs, images, capsys):
    hf, oc = clip_dirs
    assert main(["eval", "fidelity", "--model", str(hf), "--data", str(images)]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"{hf} is a CLIP-style dual encoder (CLIPModel), not a ViT image encoder" in line
    assert "eval zeroshot|clip-retrieval" in line and "dinov2_image_processor" not in line
    assert main(["eval", "knn", "--model", str(oc), "--data", str(images)]) == 2
    assert "(an open_clip folder) is a CLIP-style dual encoder" in error_line(capsys.readouterr().err)


def test_vision_and_lm_folders_given_to_the_wrong_eval(llm_dir, tiny_vit_dir, images, capsys):
    assert main(["eval", "ruler", "--model", str(tiny_vit_dir), "--samples", "1"]) == 2
    assert "is a ViT image encoder (Dinov2Model), not a causal LM" in error_line(capsys.readouterr().err)
    assert main(["eval", "knn", "--model", str(llm_dir), "--data", str(images)]) == 2
    assert "is a causal LM (LlamaForCausalLM), not a ViT image encoder" in error_line(capsys.readouterr().err)
    assert main(["eval", "zeroshot", "--model", str(tiny_vit_dir), "--data", str(images)]) == 2
    assert "is a ViT image encoder (Dinov2Model), not a CLIP-style dual encoder" in error_line(capsys.readouterr().err)


# --------------------------------------------------------------------------- one-class folder


def test_one_class_folder_says_at_least_two_classes(tiny_vit_dir, tmp_path, capsys):
    root = tmp_path / "one"
    (root / "cat").mkdir(parents=True)
    for i in range(4):
        Image.fromarray(np.full((40, 40, 3), 30 * i, np.uint8)).save(root / "cat" / f"{i}.jpg")
    assert main(["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(root)]) == 2
    line = error_line(capsys.readouterr().err)
    assert "only one class: all 4 images sit in one class sub-folder (cat/)" in line and "at least two classes" in line


# --------------------------------------------------------------------------- Ctrl-C


def _metrics(row: dict) -> dict:
    """A result row without its timings (seconds, images/s, speedup): the values a run computes."""
    return {k: v for k, v in row.items() if k not in ("seconds", "images_per_s", "speedup")}


def _interrupt_at(monkeypatch, cls, index: int):
    """Make ``cls.__getitem__`` raise KeyboardInterrupt at image ``index`` (as Ctrl-C would, mid-run)."""
    orig = cls.__getitem__

    def getitem(self, i):
        if i == index:
            raise KeyboardInterrupt
        return orig(self, i)

    monkeypatch.setattr(cls, "__getitem__", getitem)


def test_ctrl_c_in_ruler_writes_the_finished_cells_and_exits_130(llm_dir, tmp_path, capsys, monkeypatch):
    import attnpatch.evals.ruler.runner as ruler

    calls = {"n": 0}
    orig = ruler.generate_greedy

    def gen(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:  # cell 1: 2 samples x (dense + patched) = 4 calls; the 5th is in cell 2
            raise KeyboardInterrupt
        return orig(*a, **k)

    monkeypatch.setattr(ruler, "generate_greedy", gen)
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    rc = main(["eval", "ruler", "--model", str(llm_dir), *ANCHOR_SMALL, "--lengths", "300", "400", "--samples", "2",
               "--no-recall", "--json", str(out), "--markdown", str(md)])
    assert rc == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f'attnpatch: interrupted (Ctrl-C) after 1/2 cells; wrote the finished part to {out} and {out.with_suffix(".png")} and {md} '
        '(marked "interrupted": true)'
    )
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and res["complete"] is False and res["cells_done"] == 1 and res["cells_planned"] == 2
    assert [(c["task"], c["length"], c["n"]) for c in res["cells"]] == [("niah_single", 300, 2)]
    text = md.read_text()
    assert "(interrupted: 1/2 cells)" in text and text.count("| niah_single |") == 1


def test_ctrl_c_in_a_vision_eval_writes_the_finished_images(tiny_vit_dir, images, tmp_path, capsys, monkeypatch):
    from attnpatch.evals.vision.images import ImageSet

    _interrupt_at(monkeypatch, ImageSet, 10)  # batches of 5: two finished
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    args = ["eval", "fidelity", "--model", str(tiny_vit_dir), "--resolution", "70", "--batch-size", "5", "--k", "3",
            "--method", "fna", "-o", "s=9"]  # approximate (26 tokens): cosines and errors that depend on the very images
    rc = main([*args, "--data", str(images), "--json", str(out), "--markdown", str(md)])
    assert rc == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("attnpatch: interrupted (Ctrl-C) after 10/12 images; wrote")
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and res["n_images"] == 10 and res["n_images_planned"] == 12
    assert "(interrupted: 10/12 images)" in md.read_text()
    # the finished part is the result of a whole run on those 10 images (the first 10 of the folder, same bytes)
    ten = tmp_path / "ten.json"
    assert main([*args, "--data", str(_folder(tmp_path / "ten", n=10)), "--json", str(ten)]) == 0
    full = json.loads(ten.read_text())
    assert full["n_images"] == 10 and len(res["runs"]) == len(full["runs"]) == 1
    assert _metrics(res["dense"]) == _metrics(full["dense"]) and _metrics(res["runs"][0]) == _metrics(full["runs"][0])
    assert res["dense"]["knn_top1"] == 1.0  # brightness classes are trivially separable
    run = res["runs"][0]  # measured on these 10 images: cls cosine 1 - 3e-7, mean layer error 7e-4 (not exact, yet close)
    assert run["knn_top1"] == 1.0 and run["knn_agreement"] == 1.0 and run["cls_cosine"] > 0.99999
    assert 0 < run["mean_layer_error_teacher"] < 3e-3


def test_ctrl_c_before_anything_is_finished_writes_nothing(tiny_vit_dir, images, tmp_path, capsys, monkeypatch):
    from attnpatch.evals.vision.images import ImageSet

    _interrupt_at(monkeypatch, ImageSet, 0)
    out = tmp_path / "r.json"
    assert main(["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(images), "--resolution", "70", "--json", str(out)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "before any result was finished" in err.strip().splitlines()[-1]
    assert not out.exists()


def test_ctrl_c_while_loading_exits_130_quietly(tiny_vit_dir, images, tmp_path, capsys, monkeypatch):
    import attnpatch.checkpoints as ck

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "load_vision_model", interrupted)
    out = tmp_path / "r.json"
    assert main(["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(images), "--json", str(out)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "attnpatch: interrupted (Ctrl-C); nothing more written"
    assert not out.exists()


@pytest.mark.parametrize("evalname", ["zeroshot", "clip-retrieval"])
def test_ctrl_c_in_a_clip_eval_writes_the_finished_images(evalname, clip_dirs, tmp_path, capsys, monkeypatch):
    from attnpatch.evals.clip import CaptionSet
    from attnpatch.evals.vision.images import ImageSet

    data = _folder(tmp_path / "set")
    meta = data / "train" / "metadata.jsonl"
    rows = [{**json.loads(ln), "caption": f"a picture number {i}"} for i, ln in enumerate(meta.read_text().splitlines())]
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _interrupt_at(monkeypatch, ImageSet if evalname == "zeroshot" else CaptionSet, 8)  # batches of 4: two finished
    out = tmp_path / "r.json"
    approx = ["--method", "fna", "-o", "s=16"]  # 65 tokens: an approximation whose embedding cosines depend on the very images
    rc = main(["eval", evalname, "--model", str(clip_dirs[1]), "--data", str(data), "--batch-size", "4", *approx, "--json", str(out)])
    assert rc == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "after 8/12 images" in err.strip().splitlines()[-1]
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and res["n_images"] == 8 and res["n_images_planned"] == 12
    if evalname == "clip-retrieval":
        assert res["n_texts"] == 8
    # the finished part is the result of a whole run on those 8 images (and their captions)
    eight = _folder(tmp_path / "eight", n=8)
    (eight / "train" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    whole = tmp_path / "w.json"
    assert main(["eval", evalname, "--model", str(clip_dirs[1]), "--data", str(eight), "--batch-size", "4", *approx, "--json", str(whole)]) == 0
    full = json.loads(whole.read_text())
    assert full["n_images"] == 8 and not full.get("interrupted")
    assert _metrics(res["dense"]) == _metrics(full["dense"])
    assert [_metrics(r) for r in res["runs"]] == [_metrics(r) for r in full["runs"]]
    for row in (res["dense"], *res["runs"]):  # values known without the model: 3 classes, 8 images
        if evalname == "clip-retrieval":
            assert row["t2i_recall@10"] == row["i2t_recall@10"] == 1.0 and row["t2i_recall@1"] in {i / 8 for i in range(9)}
        else:
            assert row["top5"] == 1.0 and row["top1"] in {i / 8 for i in range(9)}


# --------------------------------------------------------------------------- rich markup in labels


def test_exact_attention_label_is_printed_in_the_terminal_table(tiny_vit_dir, images, tmp_path, capsys):
    out = tmp_path / "r.json"
    with pytest.warns(UserWarning, match="s=26 >= N=26"):
        assert main(["eval", "knn", "--model", str(tiny_vit_dir), "--data", str(images), "--resolution", "70", "--k", "3",
                     "--method", "fna:s=26", "--json", str(out)]) == 0
    assert "fna (s=26) [exact attention: s >= N tokens]" in capsys.readouterr().out


def test_zeroshot_shows_the_exact_attention_label(clip_dirs, images, tmp_path, capsys):
    out, md = tmp_path / "z.json", tmp_path / "z.md"
    with pytest.warns(UserWarning, match=">= N=65"):
        assert main(["eval", "zeroshot", "--model", str(clip_dirs[1]), "--data", str(images), "--method", "fna", "-o", "s=100",
                     "--json", str(out), "--markdown", str(md)]) == 0
    assert "fna (s=100) [exact attention: s >= N tokens]" in capsys.readouterr().out
    assert json.loads(out.read_text())["runs"][0]["note"] == "exact attention: s >= N tokens"
    assert "| fna (s=100) [exact attention: s >= N tokens] |" in md.read_text()


def test_print_table_prints_markup_literally(capsys):
    from attnpatch.evals.run.report import Column, print_table

    print_table([{"setting": "[bold]x[/bold] [red]", "v": 1}], [Column("setting", "setting"), Column("v", "[v]", "int")], title="t [dim]u[/dim]")
    out = capsys.readouterr().out
    assert "[bold]x[/bold] [red]" in out and "t [dim]u[/dim]" in out and "[v]" in out


def test_json_writes_are_atomic(tmp_path, monkeypatch):
    """A write interrupted half way (Ctrl-C while writing) leaves the earlier file whole and no temporary file."""
    import pathlib

    from attnpatch.evals.run import report

    p = tmp_path / "r.json"
    report.write_json(p, {"a": 1})
    orig = pathlib.Path.write_text

    def half_then_ctrl_c(self, text, *a, **k):
        orig(self, text[: len(text) // 2], *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(pathlib.Path, "write_text", half_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        report.write_json(p, {"a": 2, "b": list(range(100))})
    monkeypatch.undo()
    assert json.loads(p.read_text()) == {"a": 1} and [x.name for x in tmp_path.iterdir()] == ["r.json"]
