"""Class names and labels of an image set come from one source; where two sources disagree, the load is refused."""

import json

import pytest
from PIL import Image

from attnpatch.errors import DataError
from attnpatch.evals.vision.images import load_image_set


def quiet(_msg):
    pass


def class_folders(root, classes=("cat", "dog"), per_class=2):
    for c in classes:
        (root / "train" / c).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / "train" / c / f"{c}{i}.png")
    return root


def classes_json(root, names):
    (root / "classes.json").write_text(json.dumps([{"index": i, "name": n} for i, n in enumerate(names)]))


def test_classes_json_in_another_order_than_the_class_folders_is_refused(tmp_path):
    root = class_folders(tmp_path / "swapped")
    classes_json(root, ["dog", "cat"])  # the folders give cat = 0, dog = 1
    (root / "train" / "cat" / "broken.png").write_bytes(b"not a png")  # the name check comes before the image checks
    with pytest.raises(DataError) as err:
        load_image_set(root, log=quiet)
    msg = str(err.value)
    assert "\n" not in msg
    assert str(root / "classes.json") in msg and "class sub-folders" in msg
    assert "label 0 is sub-folder cat/ but classes.json names it 'dog'" in msg and "2 of 2 labels differ" in msg


def test_classes_json_with_other_names_or_more_classes_than_the_folders_is_refused(tmp_path):
    root = class_folders(tmp_path / "renamed")
    classes_json(root, ["cat", "puppy"])
    with pytest.raises(DataError, match=r"label 1 is sub-folder dog/ but classes.json names it 'puppy'"):
        load_image_set(root, log=quiet)
    root = class_folders(tmp_path / "extra")
    classes_json(root, ["cat", "dog", "bird"])
    with pytest.raises(DataError, match=r"lists indices \[2\] beyond the 2 class sub-folders"):
        load_image_set(root, log=quiet)


def test_classes_json_matching_the_class_folders_loads(tmp_path):
    root = class_folders(tmp_path / "same")
    classes_json(root, ["cat", "dog"])
    s = load_image_set(root, log=quiet)
    assert s.class_names == ["cat", "dog"] and s.labels.tolist() == [0, 0, 1, 1]
    assert [s.class_names[lab] for lab in s.labels] == [f.split("/")[-2] for f in s.file_paths]


def test_metadata_labels_with_classes_json_keep_working_beside_class_folders(tmp_path):
    # with a metadata.jsonl, the labels are its 'label' column (the folders give none): classes.json names them
    root = class_folders(tmp_path / "meta")
    rows = [{"file_name": f"{c}/{c}{i}.png", "label": j, "class_name": c} for j, c in [(1, "cat"), (0, "dog")] for i in range(2)]
    (root / "train" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    classes_json(root, ["dog", "cat"])
    s = load_image_set(root, log=quiet)
    assert s.class_names == ["dog", "cat"]
    assert [s.class_names[lab] for lab in s.labels] == s.column("class_name")


def test_class_name_column_disagreeing_with_classes_json_is_refused(tmp_path):
    root = tmp_path / "col"
    (root / "train").mkdir(parents=True)
    rows = []
    for i, (label, cname) in enumerate([(0, "cat"), (0, "cat"), (1, "cat"), (1, "dog")]):
        Image.new("RGB", (8, 8)).save(root / "train" / f"img{i}.png")
        rows.append({"file_name": f"img{i}.png", "label": label, "class_name": cname})
    (root / "train" / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    classes_json(root, ["cat", "dog"])
    with pytest.raises(DataError) as err:
        load_image_set(root, log=quiet)
    msg = str(err.value)
    assert "\n" not in msg and "metadata.jsonl" in msg and str(root / "classes.json") in msg
    assert "img2.png" in msg and "label 1" in msg and "'dog'" in msg and "'cat'" in msg and "1 of 4 images differ" in msg
