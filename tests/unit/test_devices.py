"""The CUDA, NCCL and multi-node decisions, driven on a CPU: every device-dependent choice is a
function of plain inputs (strategy/devices.py), so these tests run the branches a GPU run takes.
What only a GPU can execute (kernels, NCCL itself) is in tests/unit/test_gpu.py and docs/gpu.md."""

import datetime

import pytest
import torch

from vitscale.config import OptimConfig, StrategyConfig, TrainConfig, load_config
from vitscale.data.loaders.device import pin_batches, to_device
from vitscale.errors import ConfigError
from vitscale.launch import Launch, first_host, launch_env
from vitscale.metrics import gpu_peak_flops, peak_flops, synchronizer
from vitscale.models import vit
from vitscale.strategy import SingleDevice, devices
from vitscale.strategy.deepspeed import build_ds_config
from vitscale.strategy.devices import backend_flags, backend_for, device_for, process_group_kwargs

TINY = "configs/tests/tiny.toml"


# -- launchers ------------------------------------------------------------------------------------
def slurm_task(procid: int, localid: int, nodes="gpu[07-08]", tasks=16, **extra) -> dict:
    """The environment srun gives task `procid` of a 2-node x 8-GPU step (no torchrun)."""
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(procid // 8),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_NTASKS": str(tasks),
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_JOB_ID": "4242",
        **extra,
    }


def test_slurm_two_nodes_of_eight_gpus_without_torchrun():
    seen = set()
    for procid in range(16):
        launch = launch_env(slurm_task(procid, procid % 8))
        assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (
            procid,
            16,
            procid % 8,
            "slurm",
        )
        assert launch.master_addr == "gpu07" and launch.master_port == 29500
        # one GPU per process on each node, chosen by the local rank (rank 9 is node 2's cuda:1)
        dev = device_for("cuda", launch.local_rank, visible=8)
        seen.add((procid // 8, dev.index))
        assert device_for("cuda", launch.local_rank, visible=1) == torch.device(
            "cuda", 0
        )  # --gpus-per-task=1
        kw = process_group_kwargs(launch, dev, "auto", datetime.timedelta(seconds=60))
        assert kw["backend"] == "nccl" and kw["device_id"] == dev and kw["rank"] == procid
        assert kw["world_size"] == 16 and kw["timeout"] == datetime.timedelta(seconds=60)
        assert launch.env() == {
            "RANK": str(procid),
            "WORLD_SIZE": "16",
            "LOCAL_RANK": str(procid % 8),
            "MASTER_ADDR": "gpu07",
            "MASTER_PORT": "29500",
        }
    assert len(seen) == 16  # no two processes on one GPU
    assert (
        launch_env(slurm_task(9, 1, MASTER_ADDR="head", MASTER_PORT="1234")).master_addr == "head"
    )


def test_torchrun_and_the_deepspeed_launcher_win_over_slurm():
    torchrun = {
        "RANK": "3",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "8",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "4242",
    }
    # `srun torchrun`: SLURM_PROCID is the node's task (0 or 1); the process is torchrun's rank 11
    launch = launch_env({**slurm_task(1, 0, tasks=2), **torchrun, "RANK": "11"})
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (
        11,
        16,
        3,
        "torchrun",
    )
    assert launch.master_port == 29400
    # the deepspeed launcher (pdsh / local): RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
    ds = launch_env(
        {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
            "CROSS_RANK": "1",
            "CROSS_SIZE": "2",
        }
    )
    assert (ds.rank, ds.world_size, ds.local_rank, ds.master_addr) == (5, 8, 1, "10.0.0.1")


def test_one_process_and_the_batch_script_itself():
    assert launch_env({}) == Launch(0, 1, 0, "none", None, 29500)
    # the sbatch script's own shell has SLURM_NTASKS but is no srun step: one process, not 16
    batch = {k: v for k, v in slurm_task(0, 0).items() if not k.startswith("SLURM_STEP")}
    assert launch_env(batch).launcher == "none"
    assert launch_env(slurm_task(0, 0, tasks=1)).world_size == 1  # srun -n 1


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node1", "node1"),
        ("gpu[07-08,12],login1", "gpu07"),
        ("a-b[001-004]", "a-b001"),
        ("n[3,5]", "n3"),
        ("x1,x2", "x1"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_bad_launcher_values_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"SLURM_PROCID='x' is not an integer"):
        launch_env(slurm_task(0, 0, SLURM_PROCID="x"))
    with pytest.raises(ConfigError, match="no node list"):
        launch_env({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})
    with pytest.raises(ConfigError, match="strategy.backend=nccl needs CUDA"):
        backend_for("cpu", "nccl")
    assert (
        backend_for("cpu") == "gloo"
        and backend_for("cuda") == "nccl"
        and backend_for("cuda", "gloo") == "gloo"
    )
    assert "device_id" not in process_group_kwargs(
        Launch(0, 2, 0, "torchrun", "h"), torch.device("cpu"), "auto", None
    )


# -- backend flags, peaks, timers -----------------------------------------------------------------
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
def restore_backend_flags():
    """The process-wide TF32 / cuDNN settings exactly as they were (both APIs' state: the legacy
    values first, then every per-backend fp32_precision, which the legacy setters overwrite)."""
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    new = {k: getter(*k) for k in FP32_PRECISION_SETTINGS} if getter else {}
    legacy = (torch._C._get_float32_matmul_precision(), torch._C._get_cudnn_allow_tf32())
    bench = torch.backends.cudnn.benchmark
    yield
    torch.set_float32_matmul_precision(legacy[0])
    torch._C._set_cudnn_allow_tf32(legacy[1])
    for k, v in new.items():
        torch._C._set_fp32_precision_setter(*k, v)
    torch.backends.cudnn.benchmark = bench


def test_tf32_and_cudnn_flags_only_on_cuda(restore_backend_flags):
    assert backend_flags("cpu", True, True) == {}
    assert backend_flags("cuda", True, False) == {
        "matmul_tf32": True,
        "conv_tf32": True,
        "cudnn_benchmark": False,
    }
    # a CPU run leaves every process-wide flag alone (its numerics never depend on them)
    before = (devices.backend_readers(), torch.backends.cudnn.benchmark)
    SingleDevice(TrainConfig(tf32=True, cudnn_benchmark=True), OptimConfig(), torch.device("cpu"))
    assert (devices.backend_readers(), torch.backends.cudnn.benchmark) == before
    # what a GPU run sets (the same torch.backends attributes; harmless on a CPU build), restored after
    devices.apply_backend_flags(backend_flags("cuda", True, True))
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "tf32" and torch.backends.cudnn.benchmark
    assert devices.current_backend_flags() == backend_flags("cuda", True, True)
    devices.apply_backend_flags(backend_flags("cuda", False, False))
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.backends.cudnn.conv.fp32_precision != "tf32" and not torch.backends.cudnn.benchmark
    assert devices.current_backend_flags() == backend_flags("cuda", False, False)


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_flags_readable_by_both_apis_as_torch_compile_reads_them(restore_backend_flags, tf32):
    """Issue 25, item 1: the flags were set through the per-backend fp32_precision API, after which
    torch 2.13's legacy readers raise "mix of the legacy and new APIs"; inductor's autotuning
    reads `torch.get_float32_matmul_precision()` and its conv templates `cudnn.allow_tf32`. After
    applying the flags every reader works, and they agree."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning either
        devices.apply_backend_flags(backend_flags("cuda", tf32, False))
    r = devices.backend_readers()
    assert not [v for v in r.values() if isinstance(v, str) and v.startswith("RuntimeError")], r
    assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
    assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    assert (torch.backends.cuda.matmul.fp32_precision == "tf32") is tf32
    assert (torch.backends.cudnn.conv.fp32_precision == "tf32") is tf32
    assert devices.readers_agree()
    # inductor's own reader: the key under which max-autotune caches its GEMM choices
    from torch._inductor.select_algorithm import create_precompile_key

    assert create_precompile_key("mm", "inputs", []).endswith("high" if tf32 else "highest")
    # the CPU's oneDNN matmuls stay as they were (set_float32_matmul_precision would make them TF32)
    assert torch._C._get_fp32_precision_getter("mkldnn", "matmul") != "tf32"


def test_tf32_flags_repair_a_mixed_state_and_compile_still_works(restore_backend_flags):
    """A process left in a mixed state (the new API set to TF32, the legacy one not: what the old
    apply_backend_flags did) is made consistent; a compiled matmul runs under the flags."""
    import time

    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    assert not devices.readers_agree()
    devices.apply_backend_flags(backend_flags("cuda", True, False))
    assert devices.readers_agree() and devices.current_backend_flags()["conv_tf32"]
    # re-applying what is in effect writes nothing: the flags the lab restores around each round
    with devices.backend_flags_applied(backend_flags("cuda", False, False)):
        assert (
            devices.current_backend_flags() == backend_flags("cuda", False, False)
            and devices.readers_agree()
        )
    assert (
        devices.current_backend_flags() == backend_flags("cuda", True, False)
        and devices.readers_agree()
    )
    with devices.backend_flags_applied({}):  # a CPU run's flags: nothing is touched
        assert devices.current_backend_flags() == backend_flags("cuda", True, False)
    t0 = time.perf_counter()
    f = torch.compile(lambda a, b: torch.relu(a @ b) + 1)
    a = torch.randn(8, 8)
    torch.testing.assert_close(f(a, a), torch.relu(a @ a) + 1)
    assert devices.readers_agree()
    assert time.perf_counter() - t0 < 120, "torch.compile of one matmul took over 2 minutes"


def test_gpu_peaks_by_device_name_and_tf32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda, "bf16") == (989e12, "table: NVIDIA H100 80GB HBM3 dense bf16")
    assert peak_flops(cuda, "pure_fp16")[0] == 989e12
    assert peak_flops(cuda, "fp32", tf32=False)[0] == 67e12
    assert peak_flops(cuda, "fp32", tf32=True) == (
        494e12,
        "table: NVIDIA H100 80GB HBM3 dense tf32",
    )
    assert peak_flops(cuda, "bf16", tf32=True)[0] == 989e12  # TF32 only changes fp32 matmuls
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(cuda, "bf16")[0] == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert peak_flops(cuda, "fp32", tf32=True)[0] == 8.1e12  # no TF32 before Ampere: the fp32 peak
    # a GPU the table lacks: measured
    assert gpu_peak_flops("Some New GPU", "bf16", lambda: 1.5e14) == (
        1.5e14,
        "measured bf16 matmul on Some New GPU",
    )


def test_timers_synchronize_the_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    synchronizer(torch.device("cuda", 1))()
    synchronizer(torch.device("cpu"))()
    assert calls == [torch.device("cuda", 1)]


# -- engines' configs for CUDA ----------------------------------------------------------------------
def test_ds_config_for_cuda_precisions_and_offload():
    s = StrategyConfig(name="deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True)
    bf16 = build_ds_config(TrainConfig(precision="bf16"), OptimConfig(), s, 64, 8, "cuda")
    assert bf16["bf16"] == {"enabled": True} and bf16["fp16"] == {"enabled": False}
    assert bf16["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert bf16["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert bf16["train_micro_batch_size_per_gpu"] == 8
    fp16 = build_ds_config(
        TrainConfig(precision="fp16", loss_scale=2.0**12),
        OptimConfig(),
        StrategyConfig(),
        64,
        8,
        "cuda",
    )
    assert fp16["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
    }  # dynamic scaling


def test_fsdp_mixed_precision_policy():
    """The mesh engine's precision part gives FSDP2 its MixedPrecisionPolicy (issue 49)."""
    from vitscale.config import TrainConfig
    from vitscale.strategy.amp import MeshPrecision

    def mp_policy(precision, reduce_dtype):
        part = MeshPrecision(TrainConfig(precision=precision), torch.device("cpu"), False)
        return part.policy(reduce_dtype)

    p = mp_policy("bf16", "fp32")
    assert p.param_dtype is torch.bfloat16 and p.reduce_dtype is torch.float32
    assert (
        mp_policy("fp32", "bf16").param_dtype is None
        and mp_policy("fp32", "bf16").reduce_dtype is torch.bfloat16
    )


# -- fp16 with loss scaling, on a CPU --------------------------------------------------------------
def test_fp16_grad_scaler_path_on_cpu(monkeypatch):
    """The fp16 branch of SingleDevice (GradScaler: scale, unscale, skip on overflow, cut the scale)
    run on a CPU: the refusal (at config time, strategy.check_engine) exists for speed, not
    correctness, and the strategy does not ask it again."""
    from vitscale.config import Config, RunConfig
    from vitscale.strategy import check_engine

    cfg = Config(run=RunConfig(device="cpu"), train=TrainConfig(precision="fp16"))
    with pytest.raises(ConfigError, match="refused on CPU"):
        check_engine(cfg)
    torch.manual_seed(0)
    s = SingleDevice(
        TrainConfig(precision="fp16", loss_scale=2.0**40), OptimConfig(), torch.device("cpu")
    )
    m = vit("vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, depth=1)
    s.setup(m)
    assert s.amp.scaler.is_enabled()
    before = [p.detach().clone() for p in m.parameters()]
    x = torch.randn(4, 1, 8, 8)
    with s.autocast():
        loss = s.model(x).float().square().mean() * 1e6
    s.backward(loss)
    info = s.step()
    assert (
        info["skipped"] and s.amp.scaler.get_scale() == 2.0**39
    )  # overflow: step skipped, scale halved
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    # a normal step at the lower scale updates the weights, and unscaled gradients drive it
    s.amp.scaler.update(2.0**8)
    with s.autocast():
        loss = torch.nn.functional.cross_entropy(s.model(x).float(), torch.tensor([0, 1, 2, 3]))
    s.backward(loss)
    info = s.step()
    assert not info["skipped"] and 0 < info["grad_norm"] < 1e3
    assert not all(torch.equal(a, p) for a, p in zip(before, m.parameters()))


# -- compile modes, channels-last, pinned memory ---------------------------------------------------
def test_cuda_graphs_mode_reaches_torch_compile_and_marks_steps(monkeypatch):
    seen, marks = [], []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    s = SingleDevice(
        TrainConfig(compile=True, compile_mode="reduce-overhead"),
        OptimConfig(),
        torch.device("cpu"),
    )
    s.setup(vit("vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, depth=1))
    assert seen == [{"mode": "reduce-overhead"}]
    with s.autocast():
        pass
    assert marks == [1]  # every forward starts a new CUDA-graph step
    s = SingleDevice(TrainConfig(compile=True), OptimConfig(), torch.device("cpu"))
    s.setup(vit("vit_pico", image_size=8, patch_size=4, in_chans=1, num_classes=4, depth=1))
    with s.autocast():
        pass
    assert seen[-1] == {} and marks == [1]


def test_compile_mode_checks():
    with pytest.raises(ConfigError, match="needs train.compile=true"):
        load_config(TINY, ["train.compile_mode=reduce-overhead"])
    with pytest.raises(ConfigError, match="accum_steps > 1 is refused"):
        load_config(
            TINY,
            ["train.compile=true", "train.compile_mode=reduce-overhead", "train.accum_steps=2"],
        )
    with pytest.raises(ConfigError, match="is for strategy.name=single"):
        load_config(
            TINY, ["train.compile=true", "train.compile_mode=max-autotune", "strategy.name=fsdp"]
        )
    load_config(
        TINY,
        [
            "train.compile=true",
            "train.compile_mode=max-autotune-no-cudagraphs",
            "strategy.name=fsdp",
        ],
    )


def test_channels_last_same_function():
    torch.manual_seed(0)
    ref = vit(
        "vit_pico", image_size=16, patch_size=4, in_chans=3, num_classes=4, depth=1, stem="conv"
    )
    m = vit(
        "vit_pico", image_size=16, patch_size=4, in_chans=3, num_classes=4, depth=1, stem="conv"
    )
    m.load_state_dict(ref.state_dict())
    s = SingleDevice(TrainConfig(channels_last=True), OptimConfig(), torch.device("cpu"))
    s.setup(m)
    convs = [p for p in m.parameters() if p.ndim == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    assert any(
        not p.is_contiguous() for p in convs
    )  # the 3x3 ones really changed layout (1x1: both)
    x = torch.randn(2, 3, 16, 16)
    xl = s.prepare(x)
    assert (
        xl.is_contiguous(memory_format=torch.channels_last)
        and s.prepare(torch.ones(3, 4)).is_contiguous()
    )
    torch.testing.assert_close(m(xl), ref(x), rtol=1e-5, atol=1e-5)


def test_pinned_host_batches(monkeypatch):
    assert pin_batches("cuda", True, on_device=False)
    assert not pin_batches("cuda", True, on_device=True)  # already on the GPU
    assert not pin_batches("cuda", False, on_device=False)  # data.pin_memory=false
    assert not pin_batches("cpu", True, on_device=False)
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.shape) or self)
    t = torch.arange(6).view(2, 3)
    assert torch.equal(to_device(t, torch.device("cpu"), pin=True), t) and pinned == [(2, 3)]
    to_device(t, torch.device("cpu"), pin=False)
    assert pinned == [(2, 3)]
    # the in-memory loaders decide it from where the data lives and where it goes
    from vitscale.data.loaders.memory import TensorEvalLoader, TensorTrainLoader
    from vitscale.data.sampler import EpochPlan
    from vitscale.data.transforms import BatchAugment

    cfg = load_config(TINY).data
    x, y = torch.zeros(8, 1, 4, 4, dtype=torch.uint8), torch.zeros(8, dtype=torch.int64)
    aug = BatchAugment(cfg, mean=(0.5,), std=(0.5,), num_classes=2)
    plan = EpochPlan(8, 4, seed=0, drop_last=True)
    assert TensorTrainLoader(x, y, plan, aug, seed=0, device="cuda").pin
    assert not TensorTrainLoader(x, y, plan, aug, seed=0, device="cuda", pin_memory=False).pin
    assert not TensorTrainLoader(x, y, plan, aug, seed=0, device="cpu").pin
    assert TensorEvalLoader(x, y, 4, aug.norm, device="cuda").pin


# -- what a GPU's limits trigger, driven here ------------------------------------------------------
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU"
)
def test_cuda_asked_for_without_a_gpu_is_one_line():
    from vitscale.strategy import resolve_device

    with pytest.raises(ConfigError, match="run.device=cuda but no CUDA GPU is visible"):
        resolve_device("cuda")


def test_side_by_side_drops_a_configuration_that_runs_out_of_gpu_memory():
    """A rung or candidate that hits CUDA OOM (in warm-up or in a round) is reported as such and
    the others go on (tune and ladder on a GPU)."""
    import contextlib

    from vitscale.lab.rounds import side_by_side
    from vitscale.strategy import SingleDevice

    class FakeBench:
        s = SingleDevice(TrainConfig(), OptimConfig(), torch.device("cpu"))

        def __init__(self, oom_at):
            self.calls, self.oom_at, self.closed = 0, oom_at, False

        def settings(self):
            return contextlib.nullcontext()

        def close(self):  # a bench that ran out of memory is closed before the cache is emptied
            self.closed = True

        def steps(self, n):
            self.calls += 1
            if self.calls == self.oom_at:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return (0.1 * n, 0.01 * n)

    benches = [FakeBench(0), FakeBench(1), FakeBench(3)]
    out = side_by_side(benches, steps=2, rounds=3, warmup=1)
    assert out[0] == [pytest.approx((0.2, 0.02))] * 3
    assert out[1] is None  # out of memory in its warm-up
    assert out[2] is None  # out of memory in the second round
    assert [b.closed for b in benches] == [False, True, True]


def test_bf16_on_a_cpu_without_bf16_instructions_is_announced_once(tmp_path, monkeypatch, caplog):
    """/proc/cpuinfo's flags say whether bf16 matmuls have instructions (AVX-512 BF16, AMX, ARM's
    BF16); without them torch emulates bf16, tens of times slower than fp32: one line says so."""
    from vitscale.strategy import devices

    for i, (text, has) in enumerate(
        [
            (
                "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n",
                False,
            ),
            ("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n", True),
            ("processor\t: 0\nFeatures\t: fp asimd bf16 sve\n", True),
        ]
    ):  # the last: aarch64
        info = tmp_path / f"cpuinfo{i}"
        info.write_text(text)
        assert devices.cpu_has_bf16(str(info)) is has, text
    assert devices.cpu_has_bf16(str(tmp_path / "absent")) is None
    monkeypatch.setattr(devices, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(devices, "_warned", [])
    for precision in ("bf16", "pure_bf16"):
        devices.warn_slow_bf16("cpu", precision)
    devices.warn_slow_bf16("cuda", "bf16")
    said = [r.getMessage() for r in caplog.records if "without bf16 instructions" in r.getMessage()]
    assert len(said) == 1 and "train.precision=fp32" in said[0]
    monkeypatch.setattr(devices, "_warned", [])
    devices.warn_slow_bf16("cpu", "fp32")
    assert len([r for r in caplog.records if "without bf16" in r.getMessage()]) == 1


def test_the_matmul_peak_measurement_shrinks_its_matrices_on_a_slow_path():
    """metrics.measure_matmul_peak ends every run (MFU): on a CPU without bf16 instructions a bf16
    1024^3 matmul takes about 1 s (1-2 GFLOP/s), so the measurement halves n until one matmul fits
    an eighth of its time; a fast path keeps n."""
    from vitscale.metrics import fitted_size, measure_matmul_peak

    tried = []

    def at(gflops):
        def seconds(n):
            tried.append(n)
            return 2 * n**3 / (gflops * 1e9)

        return seconds

    assert fitted_size(1024, 1 / 8, at(2)) == 256 and tried == [1024, 512, 256]  # emulated bf16
    tried.clear()
    assert fitted_size(1024, 1 / 8, at(90)) == 1024 and tried == [1024]  # fp32, AVX2 EPYC
    tried.clear()
    assert fitted_size(1024, 1 / 8, at(1e-3)) == 128 and tried[-1] == 128  # never below 128
    assert measure_matmul_peak(torch.device("cpu"), "fp32", n=256, seconds=0.01) > 0


def test_who_this_process_is_is_read_in_one_place(monkeypatch):
    """Issue 42, item 8: every module asks vitscale.launch (torchrun's variables, or srun's alone),
    none reads RANK / WORLD_SIZE / LOCAL_RANK itself: under `srun vitscale train` (no torchrun) rank 1
    is rank 1 for the CLI's one-line errors and for the checkpoint messages too."""
    import re
    from pathlib import Path

    import vitscale
    from vitscale.launch import is_main_process, this_process

    src = Path(vitscale.__file__).parent
    raw = re.compile(r"environ(\.get)?[\[(]\s*[\"'](RANK|WORLD_SIZE|LOCAL_RANK)[\"']")
    readers = sorted(
        str(p.relative_to(src)) for p in src.rglob("*.py") if raw.search(p.read_text())
    )
    assert readers == [], readers
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[07-08]")
    assert (this_process().rank, this_process().world_size, this_process().launcher) == (
        1,
        2,
        "slurm",
    )
    assert not is_main_process()
