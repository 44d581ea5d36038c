"""CLIP training on 2 gloo ranks (torchrun): DDP, FSDP2 and DeepSpeed give the single-process
weights and per-sample state (the losses' distributed gradient is exact), and a corrupt image among
the pairs leaves every rank's batches full."""

import json

import pytest
from helpers import CLIP, assert_loss_state_close, rel_diff, sets, torchrun, weights

from vitscale.cli import main


@pytest.mark.parametrize(
    "loss,extra,tol",
    [
        ("openclip", ["strategy.name=ddp"], 1e-5),
        ("fastclip_v3", ["strategy.name=ddp"], 1e-5),
        ("fastclip_v2", ["strategy.name=fsdp"], 1e-5),
        (
            "fastclip_v2",
            ["strategy.name=ddp", "clip.shard_state=true"],
            1e-5,
        ),  # each rank half the table
        ("fastclip_v3", ["strategy.name=deepspeed", "strategy.zero_stage=2"], 1e-5),
        ("siglip", ["strategy.name=ddp"], 1e-5),  # the text blocks' exchange and its backward
        ("siglip", ["strategy.name=fsdp"], 1e-5),  # logit_bias [1] sharded beside logit_scale
    ],
)
def test_two_ranks_match_single_process(tmp_path, loss, extra, tol):
    pytest.importorskip("deepspeed") if "deepspeed" in extra[0] else None
    # SGD: weight differences follow gradient differences (Adam amplifies round-off of tiny gradients)
    base = [
        "run.threads=1",
        "optim.grad_clip=1.0",
        "optim.name=sgd",
        "optim.lr=0.05",
        f"clip.loss={loss}",
    ]
    one = tmp_path / "one"
    assert main(["train", CLIP, "--out", str(one), *sets(base)]) == 0
    out = tmp_path / "two"
    p = torchrun(out, extra, config=CLIP, base=base)
    assert p.returncode == 0, p.stderr[-3000:]
    d = rel_diff(weights(out), weights(one))
    print(f"{loss} {extra}: relative weight difference vs one process {d:.2e}")
    assert d <= tol, d
    assert_loss_state_close(out, one)  # the bound derived in helpers.py
    # the loss's collectives per step in the metrics: FastCLIP's formulas (SOURCES.md) at K=2, b=8, d=32
    # (SigLIP: (K-1) b d text features exchanged forward, as many gradients backward)
    k, b, d = 2, 8, 32
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    comm = {
        (r["loss_comm_features_per_step"], r["loss_comm_scalars_per_step"])
        for r in rows
        if r["kind"] == "train"
    }
    scalars = {"openclip": 0, "siglip": 0, "fastclip_v3": 4, "fastclip_v2": 7}[loss] * (k - 1) * b
    if "clip.shard_state=true" in extra:  # + the index gather and the rows' all_reduce (6 columns)
        scalars += (k - 1) * b + 2 * (k - 1) * b * 6
    assert comm == {((4 if loss == "openclip" else 2) * (k - 1) * b * d, scalars)}, comm
    s2 = json.loads((out / "summary.json").read_text())
    s1 = json.loads((one / "summary.json").read_text())
    shards = 2 if "clip.shard_state=true" in extra else 1  # the per-sample state's bytes per rank
    assert [r["loss_state"] for r in s2["state_bytes_per_rank"]] == [
        s1["state_bytes_per_rank"][0]["loss_state"] // shards
    ] * 2
    assert s2["test_pairs"] == s1["test_pairs"] == 32
    assert abs(s2["test_i2t_r1"] - s1["test_i2t_r1"]) <= 1 / 32


def _pairs(root, n=40, bad=(), shards=0):
    """n image-caption pairs (12x14 JPEGs; the indices in `bad` truncated, unreadable) and 8 other
    readable ones for evaluation: root/pairs.csv and root/held.csv, or with `shards`, that many
    equal .tar shards in root/train (sample k is the k-th) and 2 in root/held."""
    import io
    import tarfile

    import numpy as np
    from PIL import Image

    (root / "img").mkdir(parents=True)
    rows = {"pairs.csv": ["filepath,title"], "held.csv": ["filepath,title"]}
    for i in range(n + 8):
        a = np.full((12, 14, 3), ((i * 37) % 256, (i * 91) % 256, (i * 13) % 256), np.uint8)
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "JPEG", quality=90)
        data = buf.getvalue()
        (root / "img" / f"{i}.jpg").write_bytes(data[:40] if i in bad else data)
        rows["pairs.csv" if i < n else "held.csv"].append(f"img/{i}.jpg,a picture number {i}")
    for name, lines in rows.items():
        (root / name).write_text("\n".join(lines) + "\n")
    if not shards:
        return root / "pairs.csv", root / "held.csv"
    for split, ks in (
        ("train", np.array_split(range(n), shards)),
        ("held", np.array_split(range(n, n + 8), 2)),
    ):
        (root / split).mkdir()
        for s, part in enumerate(ks):
            with tarfile.open(root / split / f"{s:05d}.tar", "w") as tf:
                for k in part.tolist():
                    for name, blob in (
                        (f"{k:05d}.jpg", (root / "img" / f"{k}.jpg").read_bytes()),
                        (f"{k:05d}.txt", f"a picture number {k}".encode()),
                    ):
                        ti = tarfile.TarInfo(name)
                        ti.size = len(blob)
                        tf.addfile(ti, io.BytesIO(blob))
    return root / "train", root / "held"


@pytest.mark.parametrize("source", ["csv", "stream"])
def test_two_ranks_get_full_batches_despite_a_corrupt_image(tmp_path, source):
    """Issue 25 item 8: a corrupt JPEG among image-caption pairs (a CSV, or streamed shards), 2 gloo
    ranks, FastCLIP (per-sample state by index). Each rank's local batch stays full (a substitute
    takes the bad sample's place before batching): the loss's feature gathers see equal sizes
    (gloo refuses unequal ones, as it did before the fix: "Received data size doesn't match
    expected size"), rank 0 counts full global batches, the run finishes, and the bad sample is
    skipped and counted once per epoch by the rank whose share holds it."""
    from vitscale.data.loaders.stream_plan import StreamPlan
    from vitscale.data.sampler import EpochPlan
    from vitscale.data.sources.shard_sets import ShardSet

    n, batch, epochs = 40, 8, 2
    if source == "csv":
        plan = [EpochPlan(n, batch, seed=0, drop_last=True, rank=r, world_size=2) for r in (0, 1)]
        bad = int(plan[1].indices(0)[0])  # in rank 1's slice of the first step
        holds = lambda r, e: bad in plan[r].indices(e).tolist()  # noqa: E731
        data = ["data.name=csv"]
    else:  # 4 shards of 10: every sample once an epoch
        shards = ShardSet([str(s) for s in range(4)], [10] * 4, "txt")
        plan = [StreamPlan(shards, batch, seed=0, rank=r, world_size=2, streams=1) for r in (0, 1)]
        bad = 10 * plan[1].stream_shards(0, 0)[0] + 3  # in a shard rank 1 reads in epoch 0
        holds = lambda r, e: bad // 10 in plan[r].stream_shards(e, 0)  # noqa: E731
        data = ["data.name=webdataset", "data.reader=stream", "data.shuffle_buffer=4"]
    train, held = _pairs(tmp_path / "data", n, bad=(bad,), shards=4 if source == "stream" else 0)
    base = [
        "run.threads=1",
        f"train.epochs={epochs}",
        "clip.loss=fastclip_v3",
        "strategy.name=ddp",
        *data,
        f"data.root={train}",
        f"data.test_root={held}",
        "data.image_size=8",
        f"data.batch_size={batch}",
        "data.eval_batch_size=8",
        "data.num_workers=0",
    ]
    out = tmp_path / "two"
    p = torchrun(out, [], config=CLIP, base=base, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    steps = epochs * (n // batch)
    assert s["steps"] == steps and s["images_seen"] == steps * batch and s["test_pairs"] == 8
    # the count each rank reports: its own loader's, once per epoch its share holds the bad sample
    ranks = [r for e in range(epochs) for r in (0, 1) if holds(r, e)]
    want = sorted(ranks[: k + 1].count(r) for k, r in enumerate(ranks))
    warned = [ln for ln in p.stderr.splitlines() if "skipped" in ln and "so far" in ln]
    name = f"img/{bad}.jpg" if source == "csv" else f"{bad:05d}"
    assert len(warned) == len(ranks) and all(name in ln for ln in warned), p.stderr[-3000:]
    assert sorted(int(ln.split("; ")[-1].split()[0]) for ln in warned) == want, warned
