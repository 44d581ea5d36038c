"""Errors from data-loading workers reach the user as one line, and the CLIP vocabulary is looked up
before a run starts (issue 24's small items)."""

import pytest
import torch

from vitscale.cli import main, one_line
from vitscale.errors import DataError


class _Bad(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise DataError(f"sample {i}: broken on purpose")


def test_an_error_raised_in_a_worker_is_one_line():
    loader = torch.utils.data.DataLoader(_Bad(), batch_size=2, num_workers=1)
    with pytest.raises(DataError) as e:
        next(iter(loader))
    assert "Original Traceback" in str(e.value)  # what torch hands back
    assert one_line(e.value) == "sample 0: broken on purpose (in a data-loading worker)"
    assert one_line(DataError("plain")) == "plain"


def test_missing_clip_vocabulary_is_one_line_before_the_run_starts(tmp_path, capsys, monkeypatch):
    """A CSV of pairs decoded by 2 workers: the vocabulary used to be read only inside the workers
    (a whole traceback, after the run had started)."""
    from PIL import Image

    rows = ["filepath,title"]
    for i in range(16):
        Image.new("RGB", (12, 12), (16 * i, 0, 0)).save(tmp_path / f"{i}.png")
        rows.append(f"{tmp_path / f'{i}.png'},a red square {i}")
    (tmp_path / "pairs.csv").write_text("\n".join(rows) + "\n")
    monkeypatch.setenv("VITSCALE_BPE_VOCAB", str(tmp_path / "missing.txt.gz"))
    import vitscale.data.tokenizer as tok

    tok.get_tokenizer.cache_clear()  # read the (missing) vocabulary again
    try:
        rc = main(
            [
                "train",
                "configs/tests/clip_tiny.toml",
                "--out",
                str(tmp_path / "run"),
                "--set",
                "data.name=csv",
                "--set",
                f"data.root={tmp_path / 'pairs.csv'}",
                "--set",
                "data.num_workers=2",
                "--set",
                "data.batch_size=8",
                "--set",
                "data.image_size=16",
            ]
        )
    finally:
        tok.get_tokenizer.cache_clear()
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "missing.txt.gz: no such file" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
