"""The scaling predictor's formulas against hand-computed numbers; the predict command end to end."""

import json
import math

import pytest

from vitscale.cli import main
from vitscale.config import load_config
from vitscale.lab import comm_model as cm
from vitscale.tasks import model_info

PCIE = cm.Link("test 25 GB/s", 25e9, 5e-6)


def test_ring_allreduce_k4_100mb():
    # 2 (K-1)/K x B / bw = 2 * 3/4 * 100e6 / 25e9 = 6.0 ms; latency 2 (K-1) a per bucket = 6 * 5 us = 30 us
    one_bucket = cm.collective_time(2, 100e6, 4, PCIE, PCIE, per_node=8, bucket_bytes=100e6)
    assert one_bucket == pytest.approx(6.0e-3 + 30e-6, rel=1e-12)
    four_buckets = cm.collective_time(2, 100e6, 4, PCIE, PCIE, per_node=8, bucket_bytes=25e6)
    assert four_buckets == pytest.approx(6.0e-3 + 4 * 30e-6, rel=1e-12)
    # reduce-scatter alone: half the volume and half the steps
    assert cm.collective_time(1, 100e6, 4, PCIE, PCIE, 8, 100e6) == pytest.approx(3.0e-3 + 15e-6)
    assert cm.collective_time(2, 100e6, 1, PCIE, PCIE, 8, 25e6) == 0.0


def test_hierarchical_split():
    intra, inter = cm.Link("i", 100e9, 1e-6), cm.Link("e", 10e9, 10e-6)
    # K = 16, G = 8, N = 2, B = 80 MB in one bucket:
    # intra 2 * 7/8 * 80e6 / 100e9 = 1.4 ms; inter 2 * 1/2 * (80e6 / 8) / 10e9 = 1.0 ms;
    # latency 2 * (7 * 1 us + 1 * 10 us) = 34 us
    t = cm.collective_time(2, 80e6, 16, intra, inter, per_node=8, bucket_bytes=80e6)
    assert t == pytest.approx(1.4e-3 + 1.0e-3 + 34e-6, rel=1e-12)
    # within one node only the intra-node link counts
    assert cm.collective_time(2, 80e6, 8, intra, inter, 8, 80e6) == pytest.approx(1.4e-3 + 14e-6)
    # one GPU per node: the flat ring over the inter-node link, 2 * 15/16 * 80e6 / 10e9 = 15 ms + 30 * 10 us
    assert cm.collective_time(2, 80e6, 16, intra, inter, 1, 80e6) == pytest.approx(15e-3 + 300e-6)


def test_strategy_volumes():
    free = cm.Link("no latency", 25e9, 0.0)
    b, k = 100e6, 4
    ring = 3 / 4 * b / 25e9
    ddp = cm.comm_times("ddp", b, k, free, free, 8, 25e6)
    z12 = cm.comm_times("zero12", b, k, free, free, 8, 25e6)
    z3 = cm.comm_times("zero3", b, k, free, free, 8, 25e6)
    assert sum(ddp.values()) == pytest.approx(2 * ring)  # all-reduce 2(K-1)/K B
    assert sum(z12.values()) == pytest.approx(2 * ring)  # reduce-scatter + all-gather: the same
    assert sum(z3.values()) == pytest.approx(3 * ring)  # 2 all-gathers + reduce-scatter: 3(K-1)/K B
    assert z12["after"] == pytest.approx(ring)  # the parameter all-gather after the step


def test_overlap_clamp():
    free = cm.Link("no latency", 10e9, 0.0)
    comm = 2 * 1 / 2 * 100e6 / 10e9  # K = 2: 10 ms
    slow_bwd = cm.StepCost(batch=32, forward=0.1, backward=0.2)
    s = cm.step_time(slow_bwd, "ddp", 100e6, 2, free, free, overlap=0.7)
    assert (
        s["comm_s"] == pytest.approx(comm) and s["exposed_s"] == 0.0
    )  # hidden: 10 ms < 0.7 x 200 ms
    fast_bwd = cm.StepCost(batch=32, forward=0.002, backward=0.004)
    s = cm.step_time(fast_bwd, "ddp", 100e6, 2, free, free, overlap=0.5)
    assert s["exposed_s"] == pytest.approx(comm - 0.5 * 0.004)
    assert s["step_s"] == pytest.approx(0.006 + comm - 0.002)
    # only the last micro-batch's backward hides the all-reduce
    acc = cm.StepCost(batch=32, forward=0.002, backward=0.004, accum=2)
    assert cm.step_time(acc, "ddp", 100e6, 2, free, free, overlap=0.5)[
        "exposed_s"
    ] == pytest.approx(comm - 0.001)
    # sharded optimizer: ZeRO updates 1/K of the parameters
    opt = cm.StepCost(batch=32, forward=0.1, backward=0.2, optimizer=0.04)
    assert cm.step_time(opt, "zero12", 1e3, 4, free, free)["optimizer_s"] == pytest.approx(0.01)
    assert cm.step_time(opt, "ddp", 1e3, 4, free, free)["optimizer_s"] == pytest.approx(0.04)


def test_efficiency_definitions():
    inf = cm.Link("infinite", math.inf, 0.0)
    cost = cm.StepCost(batch=64, forward=0.1, backward=0.2, optimizer=0.1)
    rows = {r["gpus"]: r for r in cm.scaling_table(cost, "ddp", 1e8, [1, 2, 4], inf, inf)}
    # strong: T(K) = 0.3 / K + 0.1 (replicated optimizer), speedup = 0.4 / T(K), efficiency = speedup / K
    assert rows[4]["strong_speedup"] == pytest.approx(0.4 / (0.3 / 4 + 0.1))
    assert rows[4]["strong_efficiency"] == pytest.approx(rows[4]["strong_speedup"] / 4)
    assert rows[4]["strong_images_per_s"] == pytest.approx(64 / (0.3 / 4 + 0.1))
    # weak: no communication cost -> T(K) = T(1): efficiency 1, throughput speedup K
    assert rows[4]["weak_efficiency"] == pytest.approx(1.0)
    assert rows[4]["weak_speedup"] == pytest.approx(4.0)
    assert rows[4]["weak_images_per_s"] == pytest.approx(4 * 64 / 0.4)
    # a real link: weak efficiency = T(1) / (T(1) + exposed)
    link = cm.Link("l", 1e9, 0.0)
    r2 = cm.scaling_table(cost, "ddp", 1e8, [2], link, link, overlap=0.0)[-1]
    assert r2["weak_efficiency"] == pytest.approx(0.4 / (0.4 + 0.1))  # 2 * 1/2 * 1e8 / 1e9 = 0.1 s


def test_parse_links():
    (label, intra, inter), (l2, i2, e2) = cm.parse_links("nvlink+infiniband,3.5:40")
    assert (
        label == "nvlink+infiniband"
        and intra is cm.LINKS["nvlink"]
        and inter is cm.LINKS["infiniband"]
    )
    assert i2 == e2 and i2.bw == 3.5e9 and i2.latency == pytest.approx(40e-6)
    with pytest.raises(ValueError):
        cm.parse_links("carrier-pigeon")


def test_predict_command_estimate_and_bench(tmp_path, capsys):
    assert (
        main(
            [
                "predict",
                "configs/tests/tiny.toml",
                "--gpu",
                "T4",
                "--mfu",
                "0.5",
                "--gpus",
                "2,4,16",
                "--link",
                "pcie+ethernet",
                "--out",
                str(tmp_path / "est"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "estimated" in text and "| 16 |" in text
    res = json.loads((tmp_path / "est" / "predict.json").read_text())
    info = model_info(load_config("configs/tests/tiny.toml"))
    # compute = train FLOPs per image x batch / (peak x MFU), forward one third of it
    assert res["cost"]["forward"] == pytest.approx(
        info["train_flops_per_image"] * 16 / (8.1e12 * 0.5) / 3
    )
    assert (tmp_path / "est" / "predict_speedup.png").stat().st_size > 1000
    bench = {
        "world_size": 1,
        "batch_size": 16,
        "step_time_s": {"min": 0.09, "median": 0.1, "max": 0.2},
        "split": {
            "data": 0.0,
            "forward": 0.03,
            "backward": 0.05,
            "optimizer": 0.01,
            "comm_exposed": None,
        },
    }
    (tmp_path / "b.json").write_text(json.dumps(bench))
    assert (
        main(
            [
                "predict",
                "configs/tests/tiny.toml",
                "--bench",
                str(tmp_path / "b.json"),
                "--gpus",
                "2",
                "--link",
                "pcie",
                "--strategy",
                "ddp,zero3",
                "--out",
                str(tmp_path / "m"),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "m" / "predict.json").read_text())
    # the untimed remainder (0.1 - 0.09) is counted as backward
    assert res["cost"]["backward"] == pytest.approx(0.06) and res["step_1gpu_s"] == pytest.approx(
        0.1
    )
    assert [c["strategy"] for c in res["curves"]] == ["ddp", "zero3"]
    bench["split"].update(
        forward=0.06, backward=0.1, optimizer=0.04
    )  # instrumented pass: 0.2 s > 0.1 s step
    (tmp_path / "b.json").write_text(json.dumps(bench))
    assert (
        main(
            [
                "predict",
                "configs/tests/tiny.toml",
                "--bench",
                str(tmp_path / "b.json"),
                "--gpus",
                "2",
                "--out",
                str(tmp_path / "s"),
            ]
        )
        == 0
    )
    res = json.loads((tmp_path / "s" / "predict.json").read_text())
    assert res["step_1gpu_s"] == pytest.approx(0.1) and res["cost"]["forward"] == pytest.approx(
        0.03
    )
    assert main(["predict", "configs/tests/tiny.toml", "--link", "pigeon"]) == 2


def test_link_fit_recovers_the_ring_model():
    from vitscale.lab.linkbench import fit

    bw, lat, k = 3e9, 20e-6, 2
    rows = [(b, 2 * (k - 1) * lat + 2 * (k - 1) / k * b / bw) for b in (1e3, 1e6, 1e7, 6e7)]
    got_bw, got_lat = fit(rows, k)
    assert got_bw == pytest.approx(bw) and got_lat == pytest.approx(lat)


def test_measure_gloo_runs_two_processes():
    from vitscale.lab.linkbench import measure_gloo

    m = measure_gloo(2, sizes=(2**12, 2**18), iters=2)
    assert [b for b, _ in m["rows"]] == [2**12, 2**18] and all(t > 0 for _, t in m["rows"])


def test_hsdp_volumes_are_fsdp_in_the_node_and_an_all_reduce_of_the_shard_across():
    intra, inter = cm.Link("i", 100e9, 0.0), cm.Link("e", 10e9, 0.0)
    b = 80e6  # K = 16 GPUs, 8 per node: 2 nodes
    t = cm.comm_times("hsdp", b, 16, intra, inter, 8, 25e6)
    node = 7 / 8 * b / 100e9  # an all-gather or a reduce-scatter inside the node (c = 1)
    across = 2 * 1 / 2 * (b / 8) / 10e9  # the 1/8 shard all-reduced over 2 nodes
    assert t["forward"] == pytest.approx(node)
    assert t["backward"] == pytest.approx(2 * node + across) and t["after"] == 0.0
    # inside one node HSDP is FSDP2: zero3's volumes
    assert sum(cm.comm_times("hsdp", b, 8, intra, inter, 8, 25e6).values()) == pytest.approx(
        sum(cm.comm_times("zero3", b, 8, intra, inter, 8, 25e6).values())
    )


def test_tensor_parallel_adds_four_all_reduces_per_block_and_splits_the_compute():
    link = cm.Link("free", 10e9, 0.0)
    tp = cm.TensorParallel(tp=2, depth=3, act_bytes=1000.0)
    # micro-batch 4: payload 4000 bytes; all-reduce over 2: 2 x 1/2 x 4000 / 10e9 = 0.4 us
    assert tp.comm_s(4, 1, link) == pytest.approx(4 * 3 * 0.4e-6)
    assert tp.comm_s(2, 2, link) == pytest.approx(2 * 4 * 3 * 0.2e-6)  # 2 micro-batches of 2
    cost = cm.StepCost(batch=4, forward=0.3, backward=0.6, optimizer=0.1)
    one_group = cm.mesh_step_time(cost, "ddp", 1e6, 2, link, link, tp)
    assert one_group["compute_s"] == pytest.approx(0.45)  # half the forward and backward each
    assert one_group["optimizer_s"] == pytest.approx(0.05)
    assert one_group["step_s"] == pytest.approx(0.45 + 0.05 + tp.comm_s(4, 1, link))
    rows = cm.scaling_table(cost, "ddp", 1e6, [1, 2, 3, 4], link, link, tp=tp)
    assert [r["gpus"] for r in rows] == [1, 2, 4]  # 3 GPUs make no group of 2


def test_predict_tp_is_refused_in_one_line_where_it_does_not_fit(capsys):
    rc = main(["predict", "configs/tests/tiny.toml", "--tp", "4", "--gpus", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        "vitscale: error: --tp 4 does not divide the model's heads (2) or width"
    ]
    rc = main(["predict", "configs/tests/clip_tiny.toml", "--tp", "2", "--gpus", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        "vitscale: error: --tp: modelled for ViT classifiers, not clip models yet"
    ]
    assert main(["predict", "configs/tests/tiny.toml", "--tp", "2", "--gpus", "2,4"]) == 0
    assert "x tensor parallel 2" in capsys.readouterr().out
