"""vitscale bench: MFU arithmetic, the step-split bookkeeping (fake strategy with known phases),
the JSON on the tiny recipe, and one-line errors (the 2-process DDP run: integration/test_bench_dist.py).
No timing is asserted."""

import contextlib
import functools
import json
import os
import time
import types

import pytest
import torch
from helpers import check_bench_schema

from vitscale.cli import main
from vitscale.config import load_config
from vitscale.lab.timing import Bench
from vitscale.loop import Trainer
from vitscale.metrics import mfu
from vitscale.step import FiniteWatch, TrainStep

TINY = "configs/tests/tiny.toml"
FAST = [
    "--steps",
    "2",
    "--trials",
    "2",
    "--warmup",
    "1",
    "--split-steps",
    "1",
    "--set",
    "run.threads=1",
]


pytestmark = pytest.mark.usefixtures("fixed_peak_and_threads")


def test_mfu_arithmetic():
    # 75 MFLOP forward per image -> 225 MFLOP per training image; 200 img/s = 45 GFLOP/s
    assert mfu(75e6, 200.0, 400e9, 1) == pytest.approx(45e9 / 400e9)
    # two devices: the same total throughput is half the utilisation
    assert mfu(75e6, 200.0, 400e9, 2) == pytest.approx(45e9 / 800e9)


class FakeStrategy:
    """Phases that sleep: forward 2 ms, backward 3 ms (+ 4 ms of communication when syncing),
    optimizer 1 ms; the counting hook says the all-reduce took 6 ms."""

    def __init__(self, world_size, name="ddp"):
        self.world_size, self.name, self.syncing, self.comm = world_size, name, True, 0.0
        self.optimizer = type("O", (), {"zero_grad": lambda self, set_to_none=True: None})()
        self.model, self.prepare, self.device = (lambda x: x), (lambda x: x), torch.device("cpu")
        # the capabilities the real strategies declare (strategy/base.py)
        self.no_sync_defers_comm, self.gathers_in_forward = name in ("ddp", "fsdp"), name == "fsdp"

    def autocast(self):
        return contextlib.nullcontext()

    def comm_window(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        yield
        self.syncing = True

    def backward(self, loss):
        time.sleep(0.003 + (0.004 if self.syncing and self.world_size > 1 else 0))
        if self.syncing and self.world_size > 1:
            self.comm += 0.006

    def step(self):
        time.sleep(0.001)
        return {"grad_norm": 0.0, "skipped": False}

    def all_reduce_sum(self, t):
        return t * self.world_size  # every rank holds the same loss

    def comm_stats(self, steps):
        out = {"comm_s_per_step": self.comm / steps} if self.world_size > 1 else {}
        self.comm = 0.0
        return out


def fake_bench(world_size, name="ddp", accum=1):
    """A Bench around the real step function (step.TrainStep), run on a fake trainer whose strategy
    sleeps."""
    task = type(
        "T",
        (),
        {
            "forward_loss": lambda self, m, micro, prep: (time.sleep(0.002), torch.ones(()))[1],
            "after_step": lambda self, step=None: None,
        },
    )()
    cfg = load_config(TINY, [f"train.accum_steps={accum}"])
    strategy = FakeStrategy(world_size, name)
    trainer = types.SimpleNamespace(cfg=cfg, task=task, step=0, strategy=strategy)
    trainer.step_fn = TrainStep(strategy, task, cfg.train.accum_steps)
    trainer.train_step = functools.partial(Trainer.train_step, trainer)
    trainer.run_step, trainer.watch = functools.partial(Trainer.run_step, trainer), FiniteWatch()
    return Bench.around(trainer, (torch.zeros(4, 1), torch.zeros(4)))


@pytest.mark.parametrize(
    "world,name,accum",
    [(1, "single", 1), (2, "ddp", 1), (2, "ddp", 2), (2, "fsdp", 1), (2, "deepspeed", 1)],
)
def test_split_bookkeeping(world, name, accum):
    sp = fake_bench(world, name, accum).split(2)
    for k in ("forward", "backward", "optimizer", "instrumented_step"):
        assert isinstance(sp[k], float) and sp[k] > 0
    known = [
        sp[k] for k in ("forward", "backward", "comm_exposed", "optimizer") if sp[k] is not None
    ]
    assert (
        sum(known) <= sp["instrumented_step"] + 1e-9
    )  # the phases are parts of the instrumented step
    assert sp["notes"]
    if world == 1:
        assert sp["comm_exposed"] == 0.0 and sp["comm_overlapped"] == 0.0
    elif name == "ddp":
        assert sp["comm_exposed"] >= 0 and sp["comm_overlapped"] >= 0
        assert sp["comm_total"] == pytest.approx(0.006)  # the hook's seconds, per step
    elif name == "fsdp":
        assert sp["comm_exposed"] >= 0 and sp["comm_overlapped"] is None
        assert sp["comm_total"] == pytest.approx(0.006)
    else:  # no no_sync pass to compare with: not measurable, said so; the counted total is there
        assert sp["comm_exposed"] is None and sp["comm_overlapped"] is None
        assert sp["comm_total"] == pytest.approx(0.006)
        assert any("deepspeed" in n for n in sp["notes"])


@pytest.mark.parametrize("synthetic", [False, True])
def test_bench_json_on_tiny(capsys, tmp_path, synthetic):
    out = tmp_path / "bench.json"
    rc = main(
        ["bench", TINY, "--json", "--out", str(out), *FAST, *(["--synthetic"] if synthetic else [])]
    )
    printed = capsys.readouterr().out
    assert rc == 0
    r = json.loads(printed)
    assert json.loads(out.read_text()) == r
    check_bench_schema(r)
    assert (
        r["world_size"] == 1 and r["batch_size"] == 16 and r["config"]["data"]["batch_size"] == 16
    )
    assert r["split"]["comm_exposed"] == 0.0 and r["hardware"]["device"] == "cpu"
    assert r["peak_flops"] == 1e11 and "measured" in r["peak_source"]
    assert r["synthetic"] is synthetic
    if synthetic:
        assert r["split"]["data"] < r["step_time_s"]["median"]
    # the first warm-up step apart (issue 51: the compile time, reported beside the step's)
    assert r["first_step_s"] > 0 and r["compile_s"] == max(
        0.0, r["first_step_s"] - r["step_time_s"]["median"]
    )


def test_bench_human_output(capsys):
    assert main(["bench", TINY, *FAST]) == 0
    out = capsys.readouterr().out
    for word in ("throughput", "step time", "MFU", "memory", "split/step", "instrumented"):
        assert word in out


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--trials", "0"], "--trials must be >= 1"),
        (["--set", "train.precison=bf16"], "did you mean 'train.precision'"),
        (["--set", "train.precision=fp16", "--set", "run.device=cpu"], "refused on CPU"),
    ],
)
def test_bench_bad_input_one_line(capsys, argv, expect):
    rc = main(["bench", TINY, *argv])
    err = capsys.readouterr().err
    assert rc == 2 and expect in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "name,dtype,peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),  # SXM
        ("NVIDIA H100 PCIe", "bf16", 756e12),  # not the SXM value
        ("NVIDIA H100 NVL", "bf16", 835e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),  # not "A10"
        ("NVIDIA A10", "bf16", 125e12),
        ("NVIDIA L40S", "bf16", 362e12),  # not "L4"
        ("NVIDIA L4", "fp32", 30.3e12),
        ("Tesla T4", "bf16", None),  # no bf16 tensor cores: measured instead
        ("Some Unknown GPU", "bf16", None),
    ],
)
def test_gpu_peak_table_picks_the_specific_variant(name, dtype, peak):
    from vitscale.metrics import gpu_peak

    assert gpu_peak(name, dtype) == peak


def test_synthetic_swaps_in_images_of_the_datasets_shape():
    from vitscale.lab.recipes import synthetic_data

    fm = synthetic_data(load_config(None, []))  # the default recipe: Fashion-MNIST resized to 32 px
    assert (fm.data.name, fm.data.image_size, fm.data.channels, fm.data.num_classes) == (
        "synthetic",
        32,
        1,
        10,
    )
    assert fm.data.train_size == fm.data.batch_size
    b16 = synthetic_data(
        load_config("configs/vit_b16_imagenet.toml", [])
    )  # /data/imagenet need not exist
    assert (b16.data.name, b16.data.image_size, b16.data.channels, b16.data.num_classes) == (
        "synthetic",
        224,
        3,
        1000,
    )
    for path in ("configs/tests/tiny.toml", "configs/tests/clip_tiny.toml"):  # synthetic already
        c = load_config(path, [])
        assert synthetic_data(c) is c
    clip = synthetic_data(
        load_config("configs/clip_openclipart.toml", [])
    )  # image-text: captioned images
    d = clip.data
    assert (d.name, d.captions, d.image_size, d.channels, d.train_size) == (
        "synthetic",
        True,
        64,
        3,
        d.batch_size,
    )


def test_bench_synthetic_runs_a_folder_recipe_without_its_folder(capsys, tmp_path):
    """The ViT-B/16 ImageNet recipe, shrunk, benched where /data/imagenet does not exist: the model
    keeps the recipe's 3 channels and 1000 classes."""
    assert not os.path.exists("/data/imagenet")
    small = [
        "--set",
        "model.arch=vit_pico_patch16",
        "--set",
        "model.depth=1",
        "--set",
        "data.image_size=32",
        "--set",
        "data.batch_size=4",
        "--set",
        "train.precision=fp32",
    ]
    rc = main(["bench", "configs/vit_b16_imagenet.toml", "--synthetic", "--json", *small, *FAST])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0 and r["config"]["data"]["name"] == "synthetic"
    from vitscale.models import count_params, vit

    want = count_params(
        vit("vit_pico_patch16", image_size=32, in_chans=3, num_classes=1000, depth=1, head="token")
    )
    assert (
        r["params"]
        == want
        != count_params(
            vit(
                "vit_pico_patch16", image_size=32, in_chans=1, num_classes=10, depth=1, head="token"
            )
        )
    )
    rc = main(
        [
            "bench",
            "configs/vit_b16_imagenet.toml",
            "--synthetic",
            "--set",
            "model.num_classes=0",
            *small,
            *FAST,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "needs model.num_classes" in err and len(err.strip().splitlines()) == 1


def test_lab_compiles_each_shape_statically():
    """static_compiles(): a new shape gets its own static graph (3 shapes -> 3 graphs), where torch's
    default would recompile the second as a dynamic graph and reuse it for the third (2 graphs)."""
    import torch._dynamo
    import torch._dynamo.config as dynamo
    from torch._dynamo.utils import counters

    from vitscale.lab.timing import static_compiles

    def graphs_for_three_shapes():
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(lambda x: (x * 2).sum(), backend="eager")
        for n in (3, 4, 5):
            f(torch.ones(n))
        return counters["stats"]["unique_graphs"]

    with dynamo.patch(
        automatic_dynamic_shapes=True, recompile_limit=8
    ):  # torch's defaults, restored after
        assert graphs_for_three_shapes() == 2  # the second shape turns dynamic
        static_compiles()
        assert graphs_for_three_shapes() == 3 and dynamo.recompile_limit >= 64
    torch._dynamo.reset()


# -- each configuration under its own process-wide settings (issue 25, item 2) ----------------------
FP32_PRECISION_SETTINGS = [
    ("cuda", "matmul"),
    ("cuda", "conv"),
    ("cuda", "rnn"),
    ("cuda", "all"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
    ("mkldnn", "all"),
    ("generic", "all"),
]


@pytest.fixture
def cuda_flags_on_cpu(monkeypatch):
    """Strategies built here set the TF32 / cuDNN flags a GPU run sets (they are Python-side
    settings, harmless on a CPU build); the process's flags exactly as before afterwards."""
    from vitscale.strategy import devices, single

    cuda_flags = functools.partial(devices.backend_flags, "cuda")
    monkeypatch.setattr(
        single, "backend_flags", lambda device_type, tf32, bench: cuda_flags(tf32, bench)
    )
    monkeypatch.setattr(
        devices, "backend_flags", lambda device_type, tf32, bench: cuda_flags(tf32, bench)
    )
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    new = {k: getter(*k) for k in FP32_PRECISION_SETTINGS} if getter else {}
    legacy = (
        torch._C._get_float32_matmul_precision(),
        torch._C._get_cudnn_allow_tf32(),
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.set_float32_matmul_precision(legacy[0])
    torch._C._set_cudnn_allow_tf32(legacy[1])
    for k, v in new.items():
        torch._C._set_fp32_precision_setter(*k, v)
    torch.backends.cudnn.benchmark = legacy[2]


def flags_seen_by_steps(monkeypatch) -> list:
    """(the config's train.tf32, cudnn_benchmark, whether the process ran TF32 matmuls / convs and
    cuDNN autotuning, torch threads) at every training step."""
    seen = []
    step = Trainer.train_step

    def recording(self, batch, *a, **k):
        seen.append(
            (
                (self.cfg.train.tf32, self.cfg.train.cudnn_benchmark, self.cfg.run.threads),
                (
                    torch.backends.cuda.matmul.fp32_precision == "tf32",
                    torch.backends.cudnn.conv.fp32_precision == "tf32",
                    torch.backends.cudnn.benchmark,
                    torch.get_num_threads(),
                ),
            )
        )
        return step(self, batch, *a, **k)

    monkeypatch.setattr(Trainer, "train_step", recording)
    return seen


def test_side_by_side_runs_each_configuration_under_its_own_flags(monkeypatch, cuda_flags_on_cpu):
    """Each strategy sets the process-wide TF32 / cuDNN flags (and Trainer the thread count) when
    built; the benches are built first and timed together, so every one used to run under the
    last one's settings: the ladder's fp32 IEEE baseline ran in TF32. Now each bench's warm-up
    and rounds run under its own, and the process's are back as they were afterwards."""
    from vitscale.lab.rounds import measure_configs
    from vitscale.strategy import devices

    seen = flags_seen_by_steps(monkeypatch)
    before = devices.current_backend_flags(), torch.get_num_threads()
    cfgs = [
        load_config(TINY, ["train.tf32=false", "train.cudnn_benchmark=false", "run.threads=1"]),
        load_config(TINY, ["train.tf32=true", "train.cudnn_benchmark=true", "run.threads=2"]),
        load_config(TINY, ["train.tf32=false", "train.cudnn_benchmark=true", "run.threads=1"]),
    ]
    results = measure_configs(cfgs, steps=1, rounds=2, warmup=1)
    assert all("images_per_s" in r for r in results)
    assert len(seen) == 3 * (1 + 2)  # every bench: 1 warm-up step + 2 rounds of 1 step
    for (tf32, bench, threads), (matmul, conv, autotune, n) in seen:
        assert (matmul, conv, autotune, n) == (tf32, tf32, bench, threads)
    assert (devices.current_backend_flags(), torch.get_num_threads()) == before
    assert devices.readers_agree()


# -- vitscale bench --peer timm (issue 32) ---------------------------------------------------------
def _timm_or_skip():
    from vitscale.errors import UserError
    from vitscale.lab.peer import import_timm

    try:
        return import_timm()
    except UserError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [
            "model.head=pool",
            "train.label_smoothing=0.1",
            "optim.grad_clip=0.05",
            "train.accum_steps=2",
            "model.attention=explicit",
        ],
    ],
)
def test_the_timm_peer_computes_the_recipes_function(extra):
    """The peer starts from vitscale's weights and trains the same way: the same weight decay per
    parameter; float32 losses equal over three steps (AdamW); in float64 with SGD, whose update is
    linear in the gradient, three steps make the same update to what vitscale's float32 LayerNorm
    leaves (float32 rounding, 1e-7, of each gradient; a wrong decay, clip or smoothing is 1e-2). Label smoothing,
    clipping (0.05: it clips), micro-batches and both heads and attentions alike."""
    _timm_or_skip()
    from vitscale.lab.peer import PeerBench

    base = ["run.threads=1", "optim.warmup_steps=0", "optim.schedule=constant", *extra]
    for dtype, opt in ((torch.float32, "adamw"), (torch.float64, "sgd")):
        b = Bench(load_config(TINY, [*base, f"optim.name={opt}"]), synthetic=True)
        try:
            b.s.module.to(dtype)  # the same Parameter objects: the optimizer keeps them
            b.fixed = (b.fixed[0].to(dtype), b.fixed[1])
            p = PeerBench(b)
            p.model.to(dtype).load_state_dict(
                b.s.module.state_dict()
            )  # to_timm gave float32 copies
            names = (
                {id(q): n for n, q in b.s.module.named_parameters()},
                {id(q): n for n, q in p.model.named_parameters()},
            )
            decay = [
                {names[i][id(q)]: g["weight_decay"] for g in o.param_groups for q in g["params"]}
                for i, o in enumerate((b.s.optimizer, p.opt))
            ]
            assert decay[0] == decay[1]
            start = {k: v.clone() for k, v in b.s.module.state_dict().items()}
            for _ in range(3):
                ours, _ = b.trainer.train_step(b.fixed)
                assert float(p.step()) == pytest.approx(
                    float(ours), rel=1e-6
                )  # both loops sum in float32
            if dtype is torch.float64:  # the two updates, apart by float32 rounding of each
                peer, mine = p.model.state_dict(), b.s.module.state_dict()
                rel = {
                    k: float((peer[k] - v).norm() / (v - start[k]).norm().clamp_min(1e-30))
                    for k, v in mine.items()
                }
                assert max(rel.values()) < 1e-5, max(rel.items(), key=lambda kv: kv[1])
        finally:
            b.close()


def test_bench_peer_timm_json(capsys):
    _timm_or_skip()
    assert main(["bench", TINY, "--peer", "timm", "--rounds", "3", "--json", *FAST]) == 0
    r = json.loads(capsys.readouterr().out)["peer"]
    assert r["name"] == "timm" and r["rounds"] == 3 and len(r["speedup_rounds"]) == 3
    assert r["speedup"] == pytest.approx(sorted(r["speedup_rounds"])[1])
    assert r["rounds_won"] == sum(x > 1 for x in r["speedup_rounds"])
    for side in ("vitscale", "peer"):
        assert r[side]["images_per_s"] > 0 and r[side]["mfu"] > 0
    assert r["model"].startswith(
        "timm.create_model('vit_base_patch16_224', img_size=8, patch_size=4, in_chans=1"
    )
    assert r["params"] == json.loads(json.dumps(r))["params"] > 0


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["--set", "model.stem=conv"], "no timm ViT counterpart"),
        (
            ["--set", "model.arch=clip_tiny", "--set", "data.captions=true"],
            "compares ViT classifiers",
        ),
    ],
)
def test_bench_peer_refusals_are_one_line(capsys, argv, expect):
    _timm_or_skip()
    assert main(["bench", TINY, "--peer", "timm", *FAST, *argv]) == 2
    err = capsys.readouterr().err
    assert expect in err and len(err.strip().splitlines()) == 1, err


def test_bench_peer_without_timm_says_so_in_one_line(capsys, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_timm(name, *a, **k):
        if name == "timm" or name.startswith("timm."):
            raise ModuleNotFoundError("No module named 'timm'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_timm)
    assert main(["bench", TINY, "--peer", "timm", *FAST]) == 2
    err = capsys.readouterr().err
    assert (
        "timm does not import here (ModuleNotFoundError" in err
        and len(err.strip().splitlines()) == 1
    )


def test_bench_synthetic_runs_an_image_text_recipe_without_its_shards(capsys):
    """--synthetic for CLIP (issue 32): the recipe's shards (data.root unset) are replaced by random
    images of its geometry captioned from their labels, tokens of its context length; the loss is
    the recipe's own."""
    small = [
        "--set",
        "model.arch=clip_tiny",
        "--set",
        "data.image_size=16",
        "--set",
        "model.patch_size=8",
        "--set",
        "data.batch_size=8",
        "--set",
        "data.eval_batch_size=8",
        "--set",
        "strategy.name=single",
        "--set",
        "train.precision=fp32",
        "--set",
        "model.context_length=16",
    ]
    assert main(["bench", "configs/clip_cc3m.toml", "--synthetic", "--json", *FAST, *small]) == 0
    r = json.loads(capsys.readouterr().out)
    d = r["config"]["data"]
    assert (d["name"], d["captions"], d["image_size"], d["channels"], d["train_size"]) == (
        "synthetic",
        True,
        16,
        3,
        8,
    )
    assert r["config"]["clip"]["loss"] == load_config("configs/clip_cc3m.toml").clip.loss
    assert r["images_per_s"] > 0 and r["flops_per_image"] > 0
    # without --synthetic the same recipe needs its shards: one line
    assert main(["bench", "configs/clip_cc3m.toml", *FAST, *small]) == 2
    assert "data.root must name the webdataset shards" in capsys.readouterr().err


def test_bench_beside_times_the_recipe_and_a_candidate_override_in_paired_rounds(capsys):
    """`--beside train.capture=step`: both sides in one process, round by round; the speedup is
    the median of the per-round ratios; kernel time needs a GPU (None here)."""
    import statistics

    rc = main(
        [
            "bench",
            TINY,
            "--synthetic",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--trials",
            "1",
            "--rounds",
            "3",
            "--beside",
            "train.capture=step",
            "--json",
        ]
    )
    assert rc == 0
    b = json.loads(capsys.readouterr().out)["beside"]
    assert b["overrides"] == {"train.capture": "step"} and len(b["speedup_rounds"]) == 3
    assert b["recipe"]["images_per_s"] > 0 and b["candidate"]["images_per_s"] > 0
    assert b["speedup"] == statistics.median(b["speedup_rounds"]) and 0 <= b["rounds_won"] <= 3
    assert b["candidate"]["kernel_s_per_step"] is None


def test_bench_beside_gives_each_side_the_mfu_of_its_own_flops(capsys):
    """A candidate that changes the model's FLOPs (a narrower MLP) is rated by its own: MFU
    over images/s is each side's FLOPs per image over the same peak."""
    argv = ["bench", TINY, "--synthetic", "--steps", "1", "--warmup", "1", "--trials", "1"]
    rc = main([*argv, "--rounds", "1", "--beside", "model.mlp_ratio=1.0", "--json"])
    assert rc == 0
    b = json.loads(capsys.readouterr().out)["beside"]
    recipe, cand = b["recipe"], b["candidate"]
    assert cand["flops_per_image"] < recipe["flops_per_image"]
    per_flop = [s["mfu"] / (s["images_per_s"] * s["flops_per_image"]) for s in (recipe, cand)]
    assert per_flop[0] == pytest.approx(per_flop[1], rel=1e-9)


def test_bench_beside_refuses_a_candidate_that_does_not_validate_in_one_line(capsys):
    rc = main(
        [
            "bench",
            TINY,
            "--synthetic",
            "--steps",
            "1",
            "--trials",
            "1",
            "--set",
            "optim.name=sgd",
            "--beside",
            "train.capture=step",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "train.capture=step is refused" in err and len(err.strip().splitlines()) == 1
