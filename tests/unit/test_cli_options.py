"""End-to-end CLI runs: real dataset formats (CIFAR pickles, image folders), every training
option on the tiny synthetic recipe, compile, progress output, stop conditions, resume with a
longer schedule, help text and download failures.

Every run uses `run.threads=1`: on a loaded 2-core machine torch's default of 2 intra-op threads
oversubscribes and a tiny run gets ~50x slower.
"""

import functools
import http.server
import json
import logging
import math
import threading

import pytest
import torch
from helpers import folder_args, make_tree, run, write_cifar

from vitscale import checkpoint as ckpt
from vitscale.cli import main
from vitscale.data.offline import fetch as dl
from vitscale.evaluate import evaluate_checkpoint
from vitscale.optim import lr_factor

TINY = "configs/tests/tiny.toml"
LR = 3e-3  # tiny.toml's optim.lr
DIM = 32  # tiny.toml's model.dim


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _no_peak_measurement(monkeypatch):
    """summary() measures the CPU matmul peak for ~1 s per run; the MFU value is not tested here."""
    from vitscale import metrics as hardware

    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda *a, **k: 1e11)


def sets(*items):
    return [a for e in items for a in ("--set", e)]


def train(capsys, out, *overrides, config=TINY):
    return run(capsys, "train", config, "--out", str(out), *sets("run.threads=1", *overrides))


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def records(run_dir, kind):
    return [
        r
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if (r := json.loads(line))["kind"] == kind
    ]


def last_state(run_dir):
    return torch.load(ckpt.list_checkpoints(run_dir)[-1], weights_only=False)


def weights(run_dir):
    return last_state(run_dir)["strategy"]["model"]


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def one_line(err):
    return len(err.strip().splitlines()) == 1 and "Traceback" not in err


# ---- real dataset formats ------------------------------------------------------------------------


def test_cifar10_and_cifar100_train_eval_info(tmp_path, capsys):
    params = {}
    for name, k in (("cifar10", 10), ("cifar100", 100)):
        write_cifar(tmp_path / name, name, per_batch=6, n_test=8)  # 30 train, 8 test images
        data = sets(
            f"data.name={name}",
            f"data.root={tmp_path / name}",
            "data.image_size=8",
            "data.batch_size=8",
            "data.eval_batch_size=8",
        )
        out = tmp_path / f"run_{name}"
        rc, stdout, err = run(
            capsys,
            "train",
            TINY,
            "--out",
            str(out),
            *data,
            *sets("run.threads=1", "train.epochs=1"),
        )
        assert rc == 0, err
        s = summary(out)
        assert s["steps"] == 3 and s["images_seen"] == 24  # 30 // 8 full batches
        state = last_state(out)
        assert state["spec"]["num_classes"] == k and state["spec"]["in_chans"] == 3
        assert state["strategy"]["model"]["head.weight"].shape == (k, DIM)
        params[name] = s["params"]

        rc, stdout, err = run(capsys, "eval", str(out), "--json")
        assert rc == 0, err
        ev = json.loads(stdout)
        assert ev["count"] == 8 and ev["step"] == 3
        assert ev["test_accuracy"] == pytest.approx(s["test_accuracy"])

        rc, stdout, err = run(capsys, "info", TINY, *data, "--json")
        assert rc == 0, err
        info = json.loads(stdout)
        assert info["num_classes"] == k and info["params"] == s["params"]
    assert params["cifar100"] - params["cifar10"] == 90 * (DIM + 1)  # head: Linear(32, K)


@pytest.mark.parametrize("workers", [0, 1])
def test_image_folder_with_odd_modes_and_broken_files(tmp_path, capsys, caplog, workers):
    root = make_tree(tmp_path / "tree")  # 14 train files (2 unreadable) in 2 classes, 3 val
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="vitscale.data"):
        rc, stdout, err = train(capsys, out, *folder_args(root, workers))
    assert rc == 0, err
    assert "Traceback" not in err and "error" not in err
    skipped = [r for r in caplog.records if "skipped unreadable image" in r.getMessage()]
    assert all(r.levelno == logging.WARNING for r in skipped)
    assert sorted(r.getMessage().split()[3].rsplit("/", 1)[1] for r in skipped) == [
        "d_not_an_image.png",
        "h_truncated.jpg",
    ]
    assert "empty class folder" in caplog.text
    s = summary(out)
    assert s["steps"] == 2 and s["images_seen"] == 14  # batches of 7, bad ones replaced
    assert last_state(out)["spec"]["num_classes"] == 2
    rc, stdout, err = run(capsys, "eval", str(out), "--json")
    assert rc == 0, err
    ev = json.loads(stdout)
    assert ev["count"] == 3 and ev["test_accuracy"] == pytest.approx(s["test_accuracy"])


def test_image_folder_batch_of_one_unreadable_image_gets_a_readable_substitute(tmp_path, capsys):
    root = make_tree(tmp_path / "tree")
    out = tmp_path / "run"
    rc, _, err = train(
        capsys, out, *folder_args(root, 0), "data.batch_size=1", "data.drop_last=true"
    )
    assert rc == 0, err
    assert summary(out)["images_seen"] == summary(out)["steps"] == 14  # every step a full batch


@pytest.mark.parametrize("layout", ["no_class_folders", "class_folder_without_images"])
def test_image_folder_with_empty_train_split(tmp_path, capsys, layout):
    (tmp_path / "train").mkdir()
    (tmp_path / "val/cat").mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (8, 8), (9, 9, 9)).save(tmp_path / "val/cat/1.png")
    if layout == "class_folder_without_images":
        (tmp_path / "train/cat").mkdir()
        (tmp_path / "train/cat/readme.txt").write_text("not an image")
    rc, stdout, err = train(
        capsys,
        tmp_path / "run",
        "data.name=folder",
        f"data.root={tmp_path}",
        "data.image_size=8",
        "data.num_workers=0",
    )
    assert rc == 2
    assert one_line(err) and err.startswith("vitscale: error: ")
    assert "no images" in err and str(tmp_path / "train") in err
    assert not (tmp_path / "run" / "summary.json").exists()


# ---- every option end to end on the tiny recipe ---------------------------------------------------


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The tiny recipe for 1 epoch (4 steps), default options."""
    out = tmp_path_factory.mktemp("baseline") / "run"
    assert main(["train", TINY, "--out", str(out), *sets("run.threads=1", "train.epochs=1")]) == 0
    return out


def _group(run_dir):
    return last_state(run_dir)["strategy"]["optimizer"]["param_groups"][0]


def _close_to_baseline(out, base):
    a, b = weights(out), weights(base)
    for k in a:  # the key part of qkv.bias has a zero true gradient: Adam amplifies rounding
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4, msg=k)


def _differs_from_baseline(out, base):
    assert not same_weights(weights(out), weights(base))


def _lrs(expected):
    def check(out, base):
        assert [r["lr"] for r in records(out, "train")] == pytest.approx([LR * f for f in expected])

    return check


def _check_sgd(out, base):
    g = _group(out)
    assert g["momentum"] == 0.9 and "nesterov" in g and "betas" not in g
    _differs_from_baseline(out, base)


def _check_lamb(out, base):
    g = _group(out)
    assert "betas" in g and "amsgrad" not in g and "momentum" not in g  # ours, not AdamW
    _differs_from_baseline(out, base)


def _check_impl(flag):
    def check(out, base):
        assert _group(out)[flag] is True
        _close_to_baseline(out, base)

    return check


def _check_same_weights(out, base):
    assert same_weights(weights(out), weights(base))


def _check_pool_head(out, base):
    w = weights(out)
    assert "cls_token" not in w and w["pos_embed"].shape == (
        1,
        4,
        DIM,
    )  # (8/4)^2 patches, no class token


def _check_conv_stem(out, base):
    w, spec = weights(out), last_state(out)["spec"]
    assert spec["stem"] == "conv" and spec["patch_size"] == 2
    assert w["patch_embed.proj.0.weight"].shape == (16, 1, 3, 3)  # one 3x3 stride-2 stage (patch 2)
    assert w["patch_embed.proj.3.weight"].shape == (
        DIM,
        16,
        1,
        1,
    )  # conv, norm, ReLU, then 1x1 to dim
    assert w["pos_embed"].shape == (1, 17, DIM)  # (8/2)^2 + class token


def _check_tta(out, base):
    assert same_weights(weights(out), weights(base))  # eval-only option
    s, sb = summary(out), summary(base)
    assert s["test_loss"] != sb["test_loss"]
    ev = evaluate_checkpoint(out)  # `vitscale eval` applies TTA too
    assert (
        ev["test_loss"] == pytest.approx(s["test_loss"])
        and ev["test_accuracy"] == s["test_accuracy"]
    )


OPTIONS = [
    (["optim.name=sgd"], _check_sgd),
    (["optim.name=lamb"], _check_lamb),
    (["optim.impl=foreach"], _check_impl("foreach")),
    (["optim.impl=fused"], _check_impl("fused")),
    (["optim.schedule=linear", "train.epochs=2"], _lrs([1, 2 / 3, 1 / 3, 0])),
    (["optim.schedule=constant", "train.epochs=2"], _lrs([1, 1, 1, 1])),
    (["optim.schedule=cosine", "train.epochs=2"], _lrs([1, 0.75, 0.25, 0])),
    (["train.activation_checkpointing=true"], _check_same_weights),
    (["model.head=pool"], _check_pool_head),
    (["model.stem=conv", "model.patch_size=2"], _check_conv_stem),
    (["data.randaugment_ops=2"], _differs_from_baseline),
    (["data.cutmix_alpha=1.0"], _differs_from_baseline),
    (["train.label_smoothing=0.1"], _differs_from_baseline),
    (["train.eval_hflip_tta=true"], _check_tta),
]


@pytest.mark.parametrize("extra,check", OPTIONS, ids=[" ".join(o) for o, _ in OPTIONS])
def test_option_trains_end_to_end(tmp_path, capsys, baseline, extra, check):
    out = tmp_path / "run"
    rc, stdout, err = train(capsys, out, "train.epochs=1", *extra)
    assert rc == 0, err
    s = summary(out)
    epochs = 2 if "train.epochs=2" in extra else 1
    assert s["steps"] == 4 * epochs and s["stop_reason"] == "done"
    train_recs = records(out, "train")
    assert train_recs[-1]["step"] == s["steps"] and math.isfinite(train_recs[-1]["loss"])
    assert 0.0 <= s["test_accuracy"] <= 1.0 and math.isfinite(s["test_loss"])
    check(out, baseline)
    capsys.readouterr()


def test_compile_matches_eager(tmp_path, capsys, baseline):
    out = tmp_path / "compiled"
    rc, _, err = train(capsys, out, "train.epochs=1", "train.compile=true")
    assert rc == 0, err
    assert summary(out)["steps"] == 4
    a = weights(out)
    assert not any(k.startswith("_orig_mod") for k in a)  # plain module in checkpoints
    _close_to_baseline(out, baseline)
    assert summary(out)["test_accuracy"] == pytest.approx(
        summary(baseline)["test_accuracy"], abs=1 / 32
    )


# ---- console output, stop conditions, resume ------------------------------------------------------


def test_progress_plain_and_off(tmp_path, capsys):
    rc, stdout, err = train(capsys, tmp_path / "plain", "train.epochs=1", "run.progress=plain")
    assert rc == 0, err
    steps = [ln for ln in err.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["2/4", "4/4"]  # every run.log_every=2 steps
    assert any(ln.startswith("run ") for ln in err.splitlines())
    assert "test accuracy" in stdout
    rc, stdout, err = train(capsys, tmp_path / "off", "train.epochs=1", "run.progress=off")
    assert rc == 0, err
    assert err == "" and "test accuracy" in stdout


def test_max_steps_and_time_limit_stop_early(tmp_path, capsys):
    out = tmp_path / "max"
    rc, _, err = train(capsys, out, "run.max_steps=3")
    assert rc == 0, err
    s = summary(out)
    assert s["steps"] == 3 and s["epochs"] == 0.75 and s["stop_reason"] == "done"
    assert ckpt.list_checkpoints(out)[-1].name == "step_00000003.pt"
    assert [r["step"] for r in records(out, "train")] == [2, 3]

    out = tmp_path / "time"
    rc, _, err = train(capsys, out, "train.time_limit_s=1e-9")
    assert rc == 0, err
    s = summary(out)
    assert s["steps"] == 1 and s["stop_reason"] == "time limit"
    assert ckpt.list_checkpoints(out)[-1].name == "step_00000001.pt"
    assert [r["step"] for r in records(out, "eval")] == [1]


def test_resume_with_more_epochs_continues_to_the_new_total(tmp_path, capsys):
    out = tmp_path / "run"
    rc, _, err = train(capsys, out)  # 2 epochs = 8 steps
    assert rc == 0, err
    assert summary(out)["steps"] == 8
    rc, stdout, err = run(capsys, "train", "--resume", str(out), *sets("train.epochs=3"))
    assert rc == 0, err
    s = summary(out)
    assert s["steps"] == 12 and s["epochs"] == 3.0 and s["stop_reason"] == "done"
    assert [r["step"] for r in records(out, "eval")] == [4, 8, 12]
    assert [r["step"] for r in records(out, "train")] == [2, 4, 6, 8, 10, 12]
    lr10 = records(out, "train")[4]["lr"]  # the new 12-step schedule
    assert lr10 == pytest.approx(LR * lr_factor(10, 12, 2, "cosine", 0.0))
    assert "epochs = 3.0" in (out / "config.toml").read_text()
    assert last_state(out)["config"]["train"]["epochs"] == 3.0


def test_first_step_after_resume_with_more_epochs_uses_the_new_schedule(tmp_path, capsys):
    out = tmp_path / "run"
    rc, _, err = train(capsys, out, "run.checkpoint_every=1", "run.keep_last=100")
    assert rc == 0, err
    rc, _, err = run(capsys, "train", "--resume", str(out), *sets("train.epochs=3"))
    assert rc == 0, err
    by_step = {int(p.stem.split("_")[1]): p for p in ckpt.list_checkpoints(out)}
    w8, w9 = (torch.load(by_step[s], weights_only=False)["strategy"]["model"] for s in (8, 9))
    assert not same_weights(w8, w9)  # step 9 must update the weights


# ---- help, bad commands, downloads ------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_shows_examples(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, _ = capsys.readouterr()
    assert e.value.code == 0
    assert "examples:" in out and "vitscale train --resume runs/fp32" in out
    assert "--set" in out


@pytest.mark.parametrize("argv", [["frobnicate"], []])
def test_unknown_or_missing_subcommand_exits_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    _, err = capsys.readouterr()
    assert e.value.code == 2 and "usage: vitscale" in err
    assert ("invalid choice: 'frobnicate'" in err) if argv else ("required" in err)


def test_download_from_unreachable_host_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(
        dl.SOURCES,
        "cifar10",
        ("cifar-10-batches-py", [("http://127.0.0.1:9/cifar-10-python.tar.gz", "0" * 32)], True),
    )
    root = tmp_path / "d"
    rc, stdout, err = run(capsys, "data", "download", "cifar10", "--root", str(root))
    assert rc == 2 and stdout == ""
    assert one_line(err) and err.startswith("vitscale: error: download of http://127.0.0.1:9/")
    assert "failed" in err
    assert list(root.iterdir()) == []  # no partial file left


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # the server's access log would land in the captured stderr
        pass


def test_download_http_404_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "www").mkdir()
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(tmp_path / "www"))
    )
    threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    monkeypatch.setitem(
        dl.SOURCES, "cifar100", ("cifar-100-python", [(url + "missing.tar.gz", "0" * 32)], True)
    )
    try:
        rc, _, err = run(capsys, "data", "download", "cifar100", "--root", str(tmp_path / "d"))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert rc == 2 and one_line(err) and "missing.tar.gz failed: File not found" in err
    assert list((tmp_path / "d").iterdir()) == []
