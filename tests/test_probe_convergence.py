"""`eval linear-probe` records whether the logistic regression converged, per setting, and warns when it did not."""

from __future__ import annotations

import json
import warnings

import pytest

from attnpatch.cli import main
from conftest import write_image_folder


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("probe-imgs"), 12, shape=(40, 48, 3), classes=3)


def _run(model, data, out, *extra):
    return main([
        "eval", "linear-probe", "--model", str(model), "--data", str(data), "--method", "fna", "-o", "s=9",
        "--resolution", "70", "--batch-size", "6", "--json", str(out), *extra,
    ])


def test_unconverged_probe_is_marked_in_the_json_and_warned(tiny_vit_dir, images, tmp_path):
    out = tmp_path / "r.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _run(tiny_vit_dir, images, out, "--max-iter", "1") == 0
    res = json.loads(out.read_text())
    assert res["dense"]["linear_probe_converged"] is False and res["runs"][0]["linear_probe_converged"] is False
    ours = [str(w.message) for w in caught if str(w.message).startswith("attnpatch: linear probe")]
    assert len(ours) == 2, ours  # one line per setting: dense, then fna
    assert ours[0].startswith("attnpatch: linear probe of dense:") and ours[1].startswith("attnpatch: linear probe of fna (s=9):")
    for msg in ours:
        assert "\n" not in msg and "did not converge" in msg and "max_iter=1 " in msg and "--max-iter" in msg


def test_converged_probe_is_marked_true_without_a_warning(tiny_vit_dir, images, tmp_path):
    out = tmp_path / "r.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _run(tiny_vit_dir, images, out) == 0
    res = json.loads(out.read_text())
    assert res["dense"]["linear_probe_converged"] is True and res["runs"][0]["linear_probe_converged"] is True
    assert res["dense"]["linear_probe"] == 1.0
    assert not [w for w in caught if "linear probe" in str(w.message)]


def test_probe_without_two_classes_of_two_images_fails_before_any_image_is_encoded(tiny_vit_dir, tmp_path, capsys, monkeypatch):
    from attnpatch.evals.vision import runner

    # 3 images, 3 classes: every class a singleton, so no probe can be fitted
    data = write_image_folder(tmp_path / "imgs", 3, shape=(40, 48, 3), classes=3)
    encoded = []
    monkeypatch.setattr(runner, "run_image_pass", lambda *a, **k: encoded.append(1))
    assert _run(tiny_vit_dir, data, tmp_path / "r.json") == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("attnpatch:")]  # progress bars and logs aside
    assert encoded == [] and len(err) == 1
    assert err[0].startswith("attnpatch: error: linear probe needs at least 2 classes with at least 2 images each; these 3 images have 0")
    assert not (tmp_path / "r.json").exists()
