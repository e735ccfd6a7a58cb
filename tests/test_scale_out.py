"""Scale-out: data-parallel evals under ``accelerate launch`` (2 CPU processes, gloo), ``--resume`` after a run that
stopped, and ``--device-map`` loading split over CPU memory and disk.

A data-parallel run must give the one-process JSON in every prediction and metric (timings and the record of how it
ran aside); a resumed run the JSON of an uninterrupted run.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from attnpatch.cli import main
from attnpatch.evals.run.distributed import shard
from conftest import write_image_folder

# what may differ between two runs of the same eval: times, how the run was spread, the machine
HOW_IT_RAN = {
    "seconds", "images_per_s", "speedup", "wall_s", "machine", "ranks", "world_size", "resumed_batches", "torch_threads",
    "prefill_dense_s", "prefill_patched_s", "prefill_speedup", "text_seconds", "complete", "dense_s_median", "seconds_median",
    "speedup_spread", "speedup_within_noise", "timing",
}
METHODS = ["fna:s=8,sample_layer=1", "sink_mask"]


def _fidelity(methods=METHODS, batch_size: int = 4) -> list[str]:
    return ["eval", "fidelity", "--resolution", "56", "--batch-size", str(batch_size), "--method", *methods, "--k", "3"]


FIDELITY = _fidelity()
RULER = ["eval", "ruler", "--method", "anchor_attention", "-o", "theta=2", "-o", "min_len=0", "-o", "pool_stride=2",
         "-o", "block_size=32", "-o", "local_window=32", "-o", "init_block=16", "--tasks", "niah_single", "--lengths", "400", "900",
         "--samples", "3"]


def _what(x):
    """``x`` without the fields in :data:`HOW_IT_RAN`."""
    if isinstance(x, dict):
        return {k: _what(v) for k, v in x.items() if k not in HOW_IT_RAN}
    if isinstance(x, list):
        return [_what(v) for v in x]
    return x


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory):
    """11 images in 3 classes: 3 batches of 4 (the last one of 3), 2 batches for process 0 and 1 for process 1."""
    return write_image_folder(tmp_path_factory.mktemp("so-imgs"), 11)


def _interrupt(monkeypatch, module, name: str, when) -> None:
    """Make ``module.name`` raise ``KeyboardInterrupt`` (a Ctrl-C) on the call where ``when(call_number, args, kwargs)``
    is true (undo with ``monkeypatch.undo()``)."""
    real, calls = getattr(module, name), []

    def wrapped(*a, **k):
        calls.append(1)
        if when(len(calls), a, k):
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapped)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(argv, cwd, processes: int = 2) -> subprocess.CompletedProcess:
    """``accelerate launch --multi_gpu --num_processes N -m attnpatch ARGV`` on CPU (torch.distributed.run underneath, gloo)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()), "-m", "attnpatch", *map(str, argv)]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_shards_are_contiguous_cover_everything_and_differ_by_at_most_one():
    for n in range(0, 12):
        for w in range(1, 5):
            parts = [shard(n, r, w) for r in range(w)]
            assert [i for p in parts for i in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.mark.slow
def test_two_processes_give_the_one_process_json_of_an_image_eval(tiny_vit_dir, images_dir, tmp_path):
    args = [*FIDELITY, "--model", str(tiny_vit_dir), "--data", str(images_dir)]
    assert main([*args, "--json", str(tmp_path / "one.json"), "--threads", "1"]) == 0
    out = _launch([*args, "--json", str(tmp_path / "two.json")], cwd=tmp_path)
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert one["world_size"] == 1 and two["world_size"] == 2
    # 11 images in batches of 4: process 0 took the first two batches, process 1 the last (3 images)
    assert [(r["rank"], r["batches"], r["images"]) for r in two["ranks"]] == [(0, [0, 4], 8), (1, [8], 3)]
    assert all(r["wall_s"] > 0 and r["dense_s_median"] > 0 for r in two["ranks"]) and two["wall_s"] > 0
    assert _what(two) == _what(one)
    assert len(one["dense"]["knn_predictions"]) == 11 and len(one["runs"]) == 2
    run = two["runs"][0]
    assert 0 < run["cls_cosine"] < 1 and run["layer_error_teacher"][1] > 0  # approximated: a comparison that can fail
    assert "2 processes" in out.stdout and not (tmp_path / "two.json.parts").exists()


@pytest.mark.slow
def test_two_processes_give_the_one_process_json_of_ruler(tiny_lm_dir, tmp_path):
    args = [*RULER, "--model", str(tiny_lm_dir)]
    assert main([*args, "--json", str(tmp_path / "one.json"), "--threads", "1"]) == 0
    _launch([*args, "--json", str(tmp_path / "two.json")], cwd=tmp_path)
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert two["world_size"] == 2
    # 3 samples per cell over 2 processes: 2 and 1
    assert [[r["samples"] for r in c["ranks"]] for c in two["cells"]] == [[[0, 1], [2]], [[0, 1], [2]]]
    assert _what(two) == _what(one)
    assert two["cells"][1]["sparsity"] > 0  # the patched prefill skipped keys at 900 tokens


def test_resume_an_image_eval_after_ctrl_c_gives_the_uninterrupted_json(tiny_vit_dir, images_dir, tmp_path, monkeypatch):
    import attnpatch.evals.vision.image_pass as ip

    args = [*FIDELITY, "--model", str(tiny_vit_dir), "--data", str(images_dir), "--json", str(tmp_path / "r.json")]
    assert main([*args[:-1], str(tmp_path / "full.json")]) == 0
    _interrupt(monkeypatch, ip, "_batch", lambda n, a, k: n == 3)
    assert main(args) == 130
    parts = tmp_path / "r.json.parts"
    assert sorted(p.name for p in parts.glob("batch-*.pt")) == ["batch-0000000000.pt", "batch-0000000004.pt"]
    assert json.loads((tmp_path / "r.json").read_text())["interrupted"] is True
    monkeypatch.undo()
    assert main([*args, "--resume"]) == 0
    res, full = (json.loads((tmp_path / f).read_text()) for f in ("r.json", "full.json"))
    assert res["resumed_batches"] == 2 and [r["batches"] for r in res["ranks"]] == [[8]]
    assert _what(res) == _what(full) and not parts.exists()


@pytest.mark.slow
def test_resume_under_two_processes_of_a_one_process_run(tiny_vit_dir, images_dir, tmp_path, monkeypatch):
    import attnpatch.evals.vision.image_pass as ip

    args = [*FIDELITY, "--model", str(tiny_vit_dir), "--data", str(images_dir), "--json", str(tmp_path / "r.json")]
    assert main([*args[:-1], str(tmp_path / "full.json")]) == 0
    _interrupt(monkeypatch, ip, "_batch", lambda n, a, k: n == 2)
    assert main(args) == 130  # the first batch done, stopped in the second
    _launch([*args, "--resume"], cwd=tmp_path)
    res, full = (json.loads((tmp_path / f).read_text()) for f in ("r.json", "full.json"))
    assert res["resumed_batches"] == 1 and [r["batches"] for r in res["ranks"]] == [[4], [8]]
    assert _what(res) == _what(full)


def test_resume_ruler_after_a_stop_gives_the_uninterrupted_json(tiny_lm_dir, tmp_path, monkeypatch):
    import attnpatch.evals.ruler.runner as ruler

    args = [*RULER, "--model", str(tiny_lm_dir), "--no-recall", "--json", str(tmp_path / "r.json")]
    assert main([*args[:-1], str(tmp_path / "full.json")]) == 0
    _interrupt(monkeypatch, ruler, "_sample", lambda n, a, k: n == 5)  # the second sample of the second cell
    assert main(args) == 130
    assert [c["length"] for c in json.loads((tmp_path / "r.json").read_text())["cells"]] == [400]
    monkeypatch.undo()
    assert main([*args, "--resume"]) == 0
    res, full = (json.loads((tmp_path / f).read_text()) for f in ("r.json", "full.json"))
    assert _what(res) == _what(full) and "interrupted" not in res


def test_resume_refuses_another_run_and_names_the_difference(tiny_lm_dir, tiny_vit_dir, images_dir, tmp_path, capsys, monkeypatch):
    import attnpatch.evals.vision.image_pass as ip

    args = [*RULER, "--model", str(tiny_lm_dir), "--no-recall", "--json", str(tmp_path / "r.json")]
    assert main(args) == 0
    assert main([*args, "--seed", "1", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "was written by a run with settings.seed=0, this run has settings.seed=1" in err and "without --resume" in err
    where = ["--model", str(tiny_vit_dir), "--data", str(images_dir), "--json", str(tmp_path / "v.json")]
    _interrupt(monkeypatch, ip, "_batch", lambda n, a, k: n == 2)
    assert main([*_fidelity(batch_size=8), *where]) == 130  # one batch of 8 kept
    monkeypatch.undo()
    assert main([*FIDELITY, *where, "--resume"]) == 2  # batches of 4 now
    assert "batch_size=8, this run has batch_size=4" in capsys.readouterr().err
    # an option written otherwise but meaning the same (sink_mask's default) is the same run; another value is not
    assert main([*_fidelity([METHODS[0], "sink_mask:keep_cls=false"], batch_size=8), *where, "--resume"]) == 0
    assert "--resume: 1 finished batch(es) read back" in capsys.readouterr().err
    _interrupt(monkeypatch, ip, "_batch", lambda n, a, k: n == 2)
    assert main([*_fidelity(batch_size=8), *where]) == 130
    monkeypatch.undo()
    assert main([*_fidelity(["fna:s=9,sample_layer=1", "sink_mask"], batch_size=8), *where, "--resume"]) == 2
    assert "settings[0][1].s=8, this run has settings[0][1].s=9" in capsys.readouterr().err


def _cpu_limit(tiny_lm_dir) -> tuple:
    """The tiny Llama, its tokenizer and a CPU memory limit (80 % of its weights) under which accelerate puts its first
    decoder layer in CPU memory and the second on disk (measured)."""
    from attnpatch.checkpoints import load_causal_lm

    plain, tok = load_causal_lm(str(tiny_lm_dir), log=lambda s: None)
    return plain, tok, f"{int(0.8 * sum(p.numel() * p.element_size() for p in plain.parameters())) // 1000}KB"


def _split_lm(tiny_lm_dir):
    """The tiny Llama loaded plainly and with the limit of :func:`_cpu_limit` (part in CPU memory, the rest on disk)."""
    from attnpatch.checkpoints import load_causal_lm

    plain, tok, limit = _cpu_limit(tiny_lm_dir)
    split, _ = load_causal_lm(str(tiny_lm_dir), device_map="auto", max_memory={"cpu": limit}, log=lambda s: None)
    return plain, split, tok


def test_device_map_over_cpu_and_disk_matches_unpatched_at_the_exact_limit(tiny_lm_dir):
    from attnpatch import patch, unpatch

    plain, split, tok = _split_lm(tiny_lm_dir)
    assert split.hf_device_map["model.layers.0"] == "cpu" and split.hf_device_map["model.layers.1"] == "disk"
    ids = torch.randint(0, len(tok), (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = plain(ids).logits
        patch(split, "anchor_attention", theta=1e9, min_len=64, block_size=32, init_block=32, local_window=32, dense_last=32)
        try:
            got = split(ids).logits
        finally:
            unpatch(split)
        patch(plain, "anchor_attention", theta=1e9, min_len=64, block_size=32, init_block=32, local_window=32, dense_last=32)
        try:
            same = plain(ids).logits
        finally:
            unpatch(plain)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
    assert torch.equal(got, same)  # where the weights lived changes nothing


def test_eval_ruler_with_a_device_map_equals_the_plain_run(tiny_lm_dir, tmp_path):
    args = [*RULER, "--model", str(tiny_lm_dir), "--no-recall", "--samples", "2"]
    assert main([*args, "--json", str(tmp_path / "plain.json")]) == 0
    limit = _cpu_limit(tiny_lm_dir)[2]
    assert main([*args, "--json", str(tmp_path / "split.json"), "--device-map", "auto", "--max-memory", f"cpu={limit}"]) == 0
    plain, split = (json.loads((tmp_path / f).read_text()) for f in ("plain.json", "split.json"))
    assert _what(split) == _what(plain) and split["cells"][1]["sparsity"] > 0


def test_vit_eval_with_weights_offloaded_to_disk_equals_the_plain_run(tiny_vit_dir, images_dir, tmp_path):
    args = [*FIDELITY, "--model", str(tiny_vit_dir), "--data", str(images_dir)]
    assert main([*args, "--json", str(tmp_path / "plain.json")]) == 0
    # 20 KB of CPU memory: the whole model is offloaded to disk (on meta; accelerate's hooks bring each module in)
    assert main([*args, "--json", str(tmp_path / "disk.json"), "--device-map", "auto", "--max-memory", "cpu=20KB"]) == 0
    plain, disk = (json.loads((tmp_path / f).read_text()) for f in ("plain.json", "disk.json"))
    assert _what(disk) == _what(plain) and disk["runs"][0]["cls_cosine"] < 1


@pytest.mark.parametrize("extra, message", [
    (["--max-memory", "cpu=1GB"], "--max-memory applies with --device-map only"),
    (["--device-map", "auto", "--max-memory", "cpu"], "expected DEVICE=SIZE"),
    (["--device-map", "auto", "--max-memory", "gpu0=1GB"], "'gpu0' is not a GPU index, cpu or disk"),
    (["--device-map", "auto", "--max-memory", "cpu=abc"], "size 'abc' of cpu is not a positive size"),
    (["--device-map", "auto", "--max-memory", "cpu=-5GiB"], "size '-5GiB' of cpu is not a positive size"),
    (["--device-map", "auto", "--max-memory", "cpu=1GB,cpu=2GB"], "device cpu is given twice"),
    (["--device-map", "auto", "--max-memory", f"{torch.cuda.device_count()}=1GB"], "does not exist on this machine"),
])
def test_bad_big_model_options_fail_before_loading(tiny_lm_dir, tmp_path, capsys, extra, message):
    assert main([*RULER, "--model", str(tiny_lm_dir / "missing"), "--json", str(tmp_path / "x.json"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_compare_ruler_resume_key_names_the_tasks_the_run_records():
    """`--tasks all` is recorded as every task's name: the key a resumed `compare --eval ruler` checks must say the same."""
    from attnpatch.cli import build_parser
    from attnpatch.cli.compare import _ruler_key
    from attnpatch.evals.ruler.tasks import TASKS

    args = build_parser().parse_args(["compare", "--eval", "ruler", "--method", "a_shape", "--tasks", "all", "--lengths", "400"])
    assert _ruler_key(args, [("a_shape", {})], None)["result"]["settings"]["tasks"] == list(TASKS)
