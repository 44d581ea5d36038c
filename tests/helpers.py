"""Helpers shared by the test modules: recipes, launching torchrun, reading runs back, and
writers of small datasets in the official formats. Fixtures live in conftest.py."""

import gzip
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vitscale import checkpoint as ckpt
from vitscale.cli import main
from vitscale.strategy.dist import free_port

CLIP = "configs/tests/clip_tiny.toml"


TINY = "configs/tests/tiny.toml"


BASE = ["run.threads=1", "train.epochs=2", "optim.grad_clip=1.0"]


RED, BLUE = (220, 20, 20), (20, 20, 220)


def trainer_state(tr) -> dict:
    """A Trainer's weights, EMA weights and optimizer state, by name (what bit-equality tests compare)."""
    s = tr.strategy
    out = {f"model.{k}": v for k, v in s.module.state_dict().items()}
    out |= {f"ema.{k}": v for k, v in s.ema.state_dict().items()}
    for i, st in enumerate(s.optimizer.state.values()):
        out |= {f"opt{i}.{k}": v for k, v in st.items()}
    return out


def rel_diff(a, b):
    num = sum((a[k].double() - b[k].double()).square().sum() for k in a)
    den = sum(b[k].double().square().sum() for k in b)
    return float((num / den).sqrt())


def comm_per_step(run_dir) -> list[dict]:
    """Each train record's bytes per collective kind per step, in units of the fp32 parameter
    bytes (4P), e.g. {"allgather": 2.02, "reducescatter": 1.01}."""
    P = json.loads((Path(run_dir) / "summary.json").read_text())["params"]
    recs = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [
        {
            k[len("comm_") : -len("_bytes_per_step")]: v / (4 * P)
            for k, v in r.items()
            if k.startswith("comm_")
            and k.endswith("_bytes_per_step")
            and k != "comm_bytes_per_step"
        }
        for r in recs
        if r["kind"] == "train"
    ]


def check_eval_and_export(run_dir, tmp_path, capsys, saved: dict) -> dict:
    """`vitscale eval` of a run gives its last logged test accuracy and loss; `vitscale export`
    writes exactly `saved` (its consolidated weights). Returns eval's result."""
    from safetensors.torch import load_file

    capsys.readouterr()
    assert main(["eval", str(run_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    last = [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in x
    ][-1]
    assert result["test_accuracy"] == last["test_accuracy"]
    assert abs(result["test_loss"] - last["test_loss"]) <= 1e-5
    assert main(["export", str(run_dir), "--out", str(tmp_path / "m.safetensors")]) == 0
    exported = load_file(str(tmp_path / "m.safetensors"))
    assert exported.keys() == saved.keys() and all(
        torch.equal(exported[k], saved[k]) for k in saved
    )
    return result


def last_state(run_dir):
    """The run's last checkpoint, whole (step, strategy, task, spec...)."""
    return torch.load(ckpt.list_checkpoints(run_dir)[-1], weights_only=False)


def weights(run_dir):
    return last_state(run_dir)["strategy"]["model"]


def torchrun(out, extra, nproc=2, timeout=240, resume=None, config=TINY, base=BASE):
    what = (
        ["--resume", str(resume), *sets(extra)]
        if resume
        else [config, "--out", str(out), *sets(base + extra)]
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "vitscale",
        "train",
        *what,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode and "address already in use" in p.stderr.lower():  # free_port() lost a race
        return torchrun(out, extra, nproc, timeout, resume, config, base)
    return p


def poison_loss(monkeypatch, call: int, factor: float) -> None:
    """The classification loss of the `call`-th forward multiplied by `factor` (nan, inf)."""
    from vitscale.tasks import ClassificationTask

    calls = {"n": 0}
    real = ClassificationTask.loss

    def poisoned(self, logits, y):
        calls["n"] += 1
        loss = real(self, logits, y)
        return loss * factor if calls["n"] == call else loss

    monkeypatch.setattr(ClassificationTask, "loss", poisoned)


def run(capsys, *argv):
    """`vitscale ARGV` in this process: (exit status, stdout, stderr); paths may be Path objects."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def sets(items):
    return [a for item in items for a in ("--set", item)]


# `vitscale bench --json`: the keys every result has, and their types
BENCH_KEYS = {
    "images_per_s": float,
    "images_per_s_per_device": float,
    "mfu": float,
    "peak_flops": float,
    "peak_source": str,
    "step_time_s": dict,
    "split": dict,
    "peak_memory_bytes": int,
    "memory_source": str,
    "world_size": int,
    "batch_size": int,
    "config": dict,
    "versions": dict,
    "hardware": dict,
    "state_bytes": int,
    "state_bytes_per_rank": list,
}


def check_bench_schema(r):
    """A `vitscale bench --json` result (one process or several) is complete and self-consistent."""
    for k, t in BENCH_KEYS.items():
        assert isinstance(r[k], t), (k, r[k])
    assert set(r["step_time_s"]) == {"min", "median", "max"}
    assert r["step_time_s"]["min"] <= r["step_time_s"]["median"] <= r["step_time_s"]["max"]
    assert {"data", "forward", "backward", "comm_exposed", "comm_overlapped", "optimizer"} <= set(
        r["split"]
    )
    assert r["images_per_s"] > 0 and 0 < r["mfu"]
    assert r["images_per_s_per_device"] == pytest.approx(r["images_per_s"] / r["world_size"])
    assert {"python", "torch", "vitscale"} <= set(r["versions"])
    assert {"device", "name", "threads", "cores"} <= set(r["hardware"])
    assert len(r["state_bytes_per_rank"]) == r["world_size"]
    assert r["state_bytes"] == max(sum(x.values()) for x in r["state_bytes_per_rank"]) > 0


def folder_args(root, workers):
    """--set overrides training the tiny recipe on `make_tree(root)` (batches of 7, one epoch)."""
    return (
        "data.name=folder",
        f"data.root={root}",
        "data.image_size=8",
        f"data.num_workers={workers}",
        "data.batch_size=7",
        "data.drop_last=false",
        "data.eval_batch_size=2",
        "train.epochs=1",
    )


def interrupted_copy(full, part, step: int):
    """A copy of the finished run `full` as if it had stopped after the checkpoint at `step`."""
    shutil.copytree(full, part)
    for p in ckpt.list_checkpoints(part):
        if p.name != f"step_{step:08d}.pt":
            p.unlink()
    (part / "summary.json").unlink()
    return part


def make_tree(root, rng=None):
    """train/cat: 7 images in assorted modes + a truncated JPEG; train/dog: 5 + a fake PNG."""
    rng = rng or np.random.default_rng(0)
    for d in ("train/cat", "train/dog", "train/empty", "val/cat", "val/dog"):
        (root / d).mkdir(parents=True)
    cat, dog = root / "train/cat", root / "train/dog"
    Image.new("RGB", (24, 20), RED).save(cat / "a_rgb.png")
    Image.fromarray(_noise(rng)[..., 0], "L").save(cat / "b_grey.jpg")
    Image.fromarray(np.dstack([_noise(rng), _noise(rng)[..., :1]]), "RGBA").save(cat / "c_rgba.png")
    Image.fromarray(_noise(rng)).convert("CMYK").save(cat / "d_cmyk.jpg")
    Image.fromarray((rng.integers(0, 65536, (20, 24))).astype(np.uint16)).save(cat / "e_16bit.png")
    Image.fromarray(_noise(rng)).convert("P").save(cat / "f_palette.png")
    Image.fromarray(_noise(rng)[..., 0] > 128).save(cat / "g_bilevel.bmp")
    big = Image.fromarray(np.random.default_rng(1).integers(0, 256, (200, 200, 3), dtype=np.uint8))
    big.save(cat / "h_truncated.jpg", quality=95)
    data = (cat / "h_truncated.jpg").read_bytes()
    (cat / "h_truncated.jpg").write_bytes(data[: len(data) // 2])
    Image.new("RGB", (30, 18), BLUE).save(dog / "a_blue.webp")
    for i in range(3):
        Image.fromarray(np.dstack([_noise(rng)[..., :2].max(-1)] * 2), "LA").save(
            dog / f"b_la{i}.png"
        )
    Image.fromarray(_noise(rng, 40, 33)).save(dog / "c_rgb.jpeg")
    (dog / "d_not_an_image.png").write_bytes(b"this is not a png")
    (dog / "notes.txt").write_text("ignored: not an image extension")
    Image.new("RGB", (40, 30), RED).save(root / "val/cat/red.png")
    Image.new("RGB", (30, 40), BLUE).save(root / "val/dog/blue.png")
    Image.fromarray(_noise(rng)).save(root / "val/dog/x.jpg")
    return root


def _noise(rng, w=24, h=20):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def write_cifar(root: Path, name="cifar10", per_batch=3, n_test=4, seed=0):
    rng = np.random.default_rng(seed)
    if name == "cifar10":
        base, k = root / "cifar-10-batches-py", 10
        base.mkdir(parents=True)
        _dump(
            base / "batches.meta",
            {
                b"num_cases_per_batch": per_batch,
                b"num_vis": 3072,
                b"label_names": [
                    b"airplane",
                    b"automobile",
                    b"bird",
                    b"cat",
                    b"deer",
                    b"dog",
                    b"frog",
                    b"horse",
                    b"ship",
                    b"truck",
                ],
            },
        )
        files, label_key = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], b"labels"
    else:
        base, k = root / "cifar-100-python", 100
        base.mkdir(parents=True)
        _dump(
            base / "meta",
            {
                b"fine_label_names": [f"c{i}".encode() for i in range(100)],
                b"coarse_label_names": [f"s{i}".encode() for i in range(20)],
            },
        )
        files, label_key = ["train", "test"], b"fine_labels"
    out = {}
    for f in files:
        n = n_test if "test" in f else (per_batch if name == "cifar10" else 5 * per_batch)
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, k, n).tolist()
        d = {
            b"batch_label": f.encode(),
            label_key: labels,
            b"data": data,
            b"filenames": [f"{i}.png".encode() for i in range(n)],
        }
        if name == "cifar100":
            d[b"coarse_labels"] = [x // 5 for x in labels]
        _dump(base / f, d)
        out[f] = (data, labels)
    return base, out


def _dump(path: Path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_fmnist(root: Path, n_train=12, n_test=5, seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    data = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x, y = rng.integers(0, 256, (n, 28, 28)), np.arange(n) % 10
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", x)
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", y)
        data[prefix] = (x, y)
    return data


def write_idx(path: Path, arr: np.ndarray, magic: int | None = None, gz: bool = True):
    arr = np.asarray(arr, np.uint8)
    head = struct.pack(">I", magic if magic is not None else 0x800 | arr.ndim)
    head += b"".join(struct.pack(">I", d) for d in arr.shape)
    raw = head + arr.tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def shard_jpeg(k: int) -> bytes:
    """A 24x24 JPEG of 8x8 blocks, seeded by k (the webdataset shards' images)."""
    rng = np.random.default_rng(k)
    a = (rng.integers(0, 255, (3, 3, 3)).repeat(8, 0).repeat(8, 1)).astype(np.uint8)  # 24x24 blocks
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def tar_add(tf, name, data):
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    tf.addfile(ti, io.BytesIO(data))


def write_shards(
    folder, n_shards=4, per=6, *, gz=False, gz_members=False, bad_jpeg=(), no_caption=(), start=0
):
    """n_shards x per samples s0000...: KEY.jpg, KEY.txt 'sample k', KEY.cls k % 3."""
    folder.mkdir(parents=True, exist_ok=True)
    k = start
    for s in range(n_shards):
        with tarfile.open(
            folder / f"{s:05d}.tar{'.gz' if gz else ''}", "w:gz" if gz else "w"
        ) as tf:
            for _ in range(per):
                key = f"s{k:04d}"
                tar_add(tf, f"{key}.jpg", b"not a jpeg" if k in bad_jpeg else shard_jpeg(k))
                if k not in no_caption:
                    cap = f"sample {k}".encode()
                    tar_add(
                        tf,
                        f"{key}.txt.gz" if gz_members else f"{key}.txt",
                        gzip.compress(cap) if gz_members else cap,
                    )
                tar_add(tf, f"{key}.cls", str(k % 3).encode())
                k += 1
    return folder


# -- kill -9 and stop signals, then resume (tests/integration/test_failures.py, test_preemption.py) --
KILL_RUN = [
    "run.checkpoint_every=4",
    "run.keep_last=100",
    "train.epochs=10",
    "strategy.timeout_s=30",
]
ENGINES = {
    "single": ["strategy.name=single"],
    "ddp": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    "zero2": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
    "tp": ["strategy.name=fsdp", "strategy.tp=2"],  # tensor parallel alone, 2 processes
    "hsdp": ["strategy.name=hsdp", "strategy.dp_shard=2"],  # 2 replicas of 2 shards
}
NPROC = {"single": 1, "hsdp": 4}  # processes of an engine's case (2 where not named)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def engine_case(uninterrupted, engine: str) -> tuple[int, list, Path]:
    """A kill -9 or stop-signal test's engine: (processes, its overrides, the uninterrupted run to
    compare with); skipped where DeepSpeed is not installed."""
    if engine == "zero2":
        pytest.importorskip("deepspeed")
    nproc = NPROC.get(engine, 2)
    return nproc, ENGINES[engine] + KILL_RUN, uninterrupted(engine, nproc)


def default_signals() -> None:
    """In a child before it runs: the stop signals as a terminal's command gets them (not ignored),
    whatever this test process inherited (a CI job in the background ignores SIGINT)."""
    import signal

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_DFL)


def launch(out, extra, nproc, entry=("-m", "vitscale"), env=None):
    """torchrun of `vitscale train TINY --out OUT` in the background, its stderr piped, in a
    session of its own (`entry`: another script that takes vitscale's arguments; `env`: more
    variables)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *entry,
        "train",
        TINY,
        "--out",
        str(out),
        *sets(BASE + extra),
    ]
    return subprocess.Popen(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_signals,
    )


def wait_for_checkpoint(out, procs, limit=90):
    deadline = time.time() + limit
    while not ckpt.list_checkpoints(out):
        assert time.time() < deadline and all(p.poll() is None for p in procs), (
            "no checkpoint appeared"
        )
        time.sleep(0.2)


def assert_loss_state_close(run, reference) -> None:
    """The per-sample loss state (FastCLIP's) of `run`'s last checkpoint against `reference`'s.

    The state log u (lu1, lu2) is the log of a moving average of means of exp(z), and the bounds
    are z themselves, z = (s_ij - s_ii) / tau with similarities |s| <= 1 and tau >= TAU_MIN (the
    losses' clamp): float32 round-off of the features, computed on several ranks in other
    groupings, moves z by eps (2 / tau + 1), and log u by no more (a log-sum-exp moves by at most its
    largest term's move; the moving average keeps that); 4x for the sums' own rounding. An absolute
    bound: log u crosses 0. (A 1e-6 failed on an AVX2 CPU: lu1 2.0e-6 apart where it is near 0.)"""
    import torch

    from vitscale.losses.fastclip_temperature import TAU_MIN

    state_atol = 4 * torch.finfo(torch.float32).eps * (2 / TAU_MIN + 1)  # 9.6e-5
    mine, single = last_state(run)["task"], last_state(reference)["task"]
    for k, v in single.items():
        if torch.is_tensor(v) and v.is_floating_point():
            atol = state_atol if k.startswith(("lu", "bound")) else 1e-6
            torch.testing.assert_close(mine[k], v, rtol=1e-4, atol=atol, msg=k)


class FakeTrial:
    """An Optuna trial's surface that search's Pruning uses: its reports, its user attributes, and
    a prune once `prune_after` reports were made (None: never)."""

    def __init__(self, prune_after: int | None = None):
        self.reports, self.attrs, self.prune_after = [], {}, prune_after

    def report(self, value, step):
        self.reports.append((step, value))

    def should_prune(self):
        return self.prune_after is not None and len(self.reports) >= self.prune_after

    def set_user_attr(self, k, v):
        self.attrs[k] = v


# -- the capture stand-in: a CUDA graph's contract on a CPU (tests/unit/test_capture.py, and
# test_clip_capture.py). Capture records every aten operation the step runs (below autograd and
# autocast: what a CUDA graph records as kernels) and a replay runs them again on the same tensors
# without running any Python of the step, writing each result into the tensor the capture produced
# (a graph's static memory). A value the step took from the host during the capture stays frozen
# in every replay, as on a GPU.


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an aten operation writes in place (its schema's `Tensor(a!)` arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(a.name)
        if a.alias_info is not None and a.alias_info.is_write and value is not None:
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


class _Recorder(TorchDispatchMode):
    """Runs and records each aten operation; the storages it writes that the capture did not
    create are saved first, so that the capture can be undone (a CUDA graph capture runs nothing)."""

    def __init__(self, ops: list):
        super().__init__()
        self.ops, self.born, self.saved = ops, set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _written(func, args, kwargs):
            st = t.untyped_storage()
            if st.data_ptr() not in self.born and st.data_ptr() not in self.saved:
                self.saved[st.data_ptr()] = (st, st.clone())
        out = func(*args, **kwargs)
        if not any(r.alias_info is not None for r in func._schema.returns):  # new memory
            self.born |= {
                t.untyped_storage().data_ptr()
                for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor)
            }
        self.ops.append((func, args, kwargs, out))
        return out


class ReplayGraph:
    """A CUDA graph's contract on a CPU: warm-up runs eagerly; capture records the step's
    operations and leaves every pre-existing tensor and the RNG as they were (a capture runs
    nothing); replay re-runs the recorded operations (no Python of the step) into the captured
    tensors, as a graph's kernels write its static memory."""

    def __init__(self):
        self.ops: list = []
        self.captures = self.replays = self.warmups = 0
        self.host_reads = 0  # .item() and kin inside the captured step (a GPU would sync there)

    def warmup(self, fn):
        self.warmups += 1
        return fn()

    def capture(self, fn):
        self.captures += 1
        rng = torch.get_rng_state()
        rec = _Recorder(self.ops)
        with rec:
            out = fn()
        for st, before in rec.saved.values():
            st.copy_(before)
        torch.set_rng_state(rng)
        self.host_reads = sum(f is torch.ops.aten._local_scalar_dense.default for f, *_ in self.ops)
        return out

    @torch.no_grad()
    def replay(self):
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for old_t, new_t in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                if (
                    isinstance(old_t, torch.Tensor)
                    and new_t is not old_t
                    and new_t.untyped_storage().data_ptr() != old_t.untyped_storage().data_ptr()
                ):
                    old_t.copy_(new_t)


def fit_with_graphs(cfg, run_dir, graph=None, monkeypatch=None, resume=None):
    """Train `cfg` into `run_dir`; with `monkeypatch`, every graph a captured step asks for
    (capture.graph_for) is a `graph()` (ReplayGraph: the capture stand-in). Returns (trainer,
    summary, the graphs made)."""
    import vitscale.capture
    from vitscale.loop import Trainer

    graphs = []
    if monkeypatch is not None:

        def make(device):
            graphs.append(graph())
            return graphs[-1]

        monkeypatch.setattr(vitscale.capture, "graph_for", make)
    tr = Trainer(cfg, run_dir, resume=resume)
    try:
        summary = tr.fit()
    finally:
        tr.close()
    return tr, summary, graphs


def assert_equal_states(a: dict, b: dict):
    """The same keys and every value bit for bit."""
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))]
    assert not diff, f"differ: {diff[:5]}"


def search_args(out, config=TINY, **kw):
    """The arguments of `vitscale search` as its command parses them, for the functions a search
    runs (budget 1 s, one worker, no pruning), `kw` over them."""
    import types

    base = dict(
        config=config,
        overrides=[],
        budget_s=1.0,
        val_fraction=0.1,
        heartbeat_s=1,
        storage=None,
        study="search",
        sampler_seed=0,
        pruner="none",
        out=str(out),
        space=None,
    )
    return types.SimpleNamespace(**{**base, **kw})
