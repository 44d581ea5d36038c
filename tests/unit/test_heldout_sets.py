"""benchmarks/heldout_sets.py: the glyphs set at a tiny size is a class folder that vitscale's folder
loader scans; digits refuses in one line without scikit-learn and writes its split with it."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitscale.data.sources.folder import scan

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "heldout_sets.py"


@pytest.fixture(scope="module")
def heldout():
    spec = importlib.util.spec_from_file_location("heldout_sets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_layout(root: Path, classes: list[str], train: int, test: int):
    for split, n in (("train", train), ("test", test)):
        assert sorted(p.name for p in (root / split).iterdir()) == classes
        for c in classes:
            files = sorted((root / split / c).glob("*.png"))
            assert len(files) == n
            with Image.open(files[0]) as img:
                assert (img.mode, img.size) == ("L", (28, 28))
    found, (train_paths, train_labels), (test_paths, test_labels) = scan(root)
    assert found == classes
    assert len(train_paths) == train * len(classes) and len(test_paths) == test * len(classes)
    assert np.bincount(train_labels).tolist() == [train] * len(classes)
    assert json.loads((root / "manifest.json").read_text())["totals"] == {
        "train": train * len(classes),
        "test": test * len(classes),
    }
    assert (root / "README.md").is_file()


def test_glyphs_tiny(heldout, tmp_path, capsys):
    fonts = Path("/usr/share/fonts")
    if not any(fonts.rglob("*.ttf")):
        pytest.skip("no TrueType fonts under /usr/share/fonts")
    out = tmp_path / "glyphs"
    args = ["glyphs", "--out", str(out), "--train-per-class", "2", "--test-per-class", "1"]
    assert heldout.main(args) == 0
    check_layout(out, sorted(heldout.LETTERS), 2, 1)
    first = (out / "train" / "A" / "00000.png").read_bytes()
    # refused when not empty; --force writes the same images again (seeded)
    assert heldout.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not empty" in err
    assert heldout.main([*args, "--force"]) == 0
    assert (out / "train" / "A" / "00000.png").read_bytes() == first


def test_digits_refuses_without_sklearn(heldout, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn... raises ImportError
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert heldout.main(["digits", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "scikit-learn" in err
    assert not (tmp_path / "d").exists()


def test_digits(heldout, tmp_path):
    pytest.importorskip("sklearn")
    out = tmp_path / "digits"
    assert heldout.main(["digits", "--out", str(out)]) == 0
    found, (train_paths, _), (test_paths, _) = scan(out)
    assert found == [str(d) for d in range(10)]
    assert (len(train_paths), len(test_paths)) == (1438, 359)  # 20% of each class, rounded
    with Image.open(train_paths[0]) as img:
        assert (img.mode, img.size) == ("L", (28, 28))
