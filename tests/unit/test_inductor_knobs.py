"""Inductor's knobs as config keys (issue 51): each reaches inductor's config during the compile of
the run's model and not another's; their refusals in one line; a bad Mega Cache file said and
compiled anew (the round trip in two processes: tests/integration/test_compile_cache.py)."""

import logging

import pytest
import torch
import torch._inductor.config as ic
from torch import nn

from vitscale.compiling import compile_args
from vitscale.config import OptimConfig, TrainConfig, load_config
from vitscale.errors import ConfigError
from vitscale.strategy import check_engine
from vitscale.strategy.inductor import inductor_options, knob_note
from vitscale.strategy.single import SingleDevice

KNOBS = dict(
    inductor_coordinate_descent=True, inductor_combo_kernels=True, inductor_mix_order="off"
)


def seen_during_compile(train: TrainConfig, model: nn.Module, x: torch.Tensor) -> dict:
    """inductor's config as a post-grad pass of the compile of `model` under SingleDevice reads it."""
    seen: dict = {}

    def spy(graph):
        seen.update(
            coordinate_descent_tuning=ic.coordinate_descent_tuning,
            combo_kernels=ic.combo_kernels,
            mix_order_reduction=ic.triton.mix_order_reduction,
        )

    s = SingleDevice(train, OptimConfig(), torch.device("cpu"))
    s.setup(model)
    torch._dynamo.reset()
    with ic.patch(post_grad_custom_post_pass=spy, fx_graph_cache=False):
        with torch._functorch.config.patch(enable_autograd_cache=False):
            s.model(x).sum().backward()
    return seen


def test_each_knob_reaches_inductor_during_the_compile_and_does_not_leak():
    before = (ic.coordinate_descent_tuning, ic.combo_kernels, ic.triton.mix_order_reduction)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(4, 8)
    seen = seen_during_compile(TrainConfig(compile=True, **KNOBS), model, x)
    assert seen == dict(
        coordinate_descent_tuning=True, combo_kernels=True, mix_order_reduction=False
    )
    # not left behind: the process-wide config, and another model compiled after it
    assert (ic.coordinate_descent_tuning, ic.combo_kernels, ic.triton.mix_order_reduction) == before
    other = seen_during_compile(TrainConfig(compile=True), nn.Linear(8, 4), x)
    assert other == dict(
        coordinate_descent_tuning=before[0],
        combo_kernels=before[1],
        mix_order_reduction=before[2],
    )


def test_compile_args_keep_the_mode_and_add_the_knobs():
    assert compile_args(TrainConfig(compile=True)) == {}
    mode = "max-autotune-no-cudagraphs"
    assert compile_args(TrainConfig(compile=True, compile_mode=mode)) == {"mode": mode}
    t = TrainConfig(compile=True, compile_mode=mode, inductor_gemm="cutlass", **KNOBS)
    opts = compile_args(t)["options"]
    # the mode's own options, with the knobs over them (torch.compile takes a mode or options)
    assert opts["max_autotune"] is True
    assert opts["max_autotune_gemm_backends"] == "ATEN,TRITON,CUTLASS"
    assert opts["triton.mix_order_reduction"] is False and opts["combo_kernels"] is True
    assert inductor_options(TrainConfig(inductor_gemm="cutedsl"))[
        "max_autotune_gemm_backends"
    ].endswith("CUTEDSL")
    assert inductor_options(TrainConfig(inductor_mix_order="on")) == {
        "triton.mix_order_reduction": True
    }
    # every key inductor_options sets exists in this torch's inductor config
    assert set(inductor_options(t)) <= set(ic.get_config_copy())


@pytest.mark.parametrize(
    "sets, says",
    [
        (["train.inductor_combo_kernels=true"], "train.inductor_combo_kernels=true is an option"),
        (["train.inductor_mix_order=on"], "needs train.compile=true"),
        (["train.compile_cache=x.bin"], "train.compile_cache=x.bin is an option"),
        (
            ["train.compile=true", "train.inductor_gemm=cutlass"],
            "set train.compile_mode=max-autotune-no-cudagraphs (not default)",
        ),
    ],
)
def test_knob_refusals_in_one_line(sets, says):
    with pytest.raises(ConfigError, match="^config: .*") as e:
        load_config("configs/tests/tiny.toml", sets)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_cuda_gemm_backend_refused_on_a_cpu_and_triton_knobs_announced():
    cfg = load_config(
        "configs/tests/tiny.toml",
        [
            "train.compile=true",
            "train.compile_mode=max-autotune-no-cudagraphs",
            "train.inductor_gemm=cutedsl",
            "run.device=cpu",
        ],
    )
    with pytest.raises(ConfigError, match="inductor_gemm=cutedsl is a CUDA GEMM backend; on cpu"):
        check_engine(cfg)
    note = knob_note(TrainConfig(compile=True, **KNOBS), "cpu")
    assert note and note.startswith("train.inductor_coordinate_descent=true, ")
    assert "no effect on cpu" in note
    assert knob_note(TrainConfig(compile=True, **KNOBS), "cuda") is None
    assert knob_note(TrainConfig(compile=True), "cpu") is None


def test_the_note_is_logged_by_the_strategy(caplog):
    with caplog.at_level(logging.WARNING):
        SingleDevice(
            TrainConfig(compile=True, inductor_combo_kernels=True),
            OptimConfig(),
            torch.device("cpu"),
        )
    assert any("inductor_combo_kernels=true" in r.message for r in caplog.records)


def test_a_bad_cache_file_is_said_and_compiled_anew(tmp_path, caplog):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a cache")
    from vitscale.strategy.inductor import CompileCache

    with caplog.at_level(logging.WARNING):
        CompileCache(str(bad), main=False).load()
    assert any("not loaded" in r.message for r in caplog.records)


def test_an_option_this_torch_lacks_is_refused_in_one_line(monkeypatch):
    """An older torch (the GPU image's) without one of the options: refused before anything runs."""
    from vitscale.strategy import inductor

    known = inductor.known_options() - {"triton.mix_order_reduction"}
    monkeypatch.setattr(inductor, "known_options", lambda: known)
    knob_refusal = inductor.knob_refusal
    why = knob_refusal(TrainConfig(compile=True, inductor_mix_order="on"), "cuda")
    assert why and why.startswith("config: inductor's option triton.mix_order_reduction (set by ")
    assert "train.inductor_mix_order=on" in why and "\n" not in why
    assert knob_refusal(TrainConfig(compile=True, inductor_combo_kernels=True), "cuda") is None


def test_the_first_step_is_reported_apart_in_the_summary(tmp_path):
    """summary.json's first_step_s: each process's first step (the compile, with train.compile),
    what images_per_s leaves out."""
    from vitscale.loop import train

    cfg = load_config(
        "configs/tests/tiny.toml", ["run.max_steps=3", "run.threads=1", "run.progress=off"]
    )
    s = train(cfg, tmp_path / "run")
    assert 0 < s["first_step_s"] < s["train_time_s"]
    assert s["images_per_s"] == pytest.approx(
        2 * cfg.data.batch_size / (s["train_time_s"] - s["first_step_s"])
    )


def test_the_clip_step_compiles_with_the_same_knobs(monkeypatch):
    """CLIP's compiled step (tasks/clip_step.py: towers + loss as one fullgraph compile, which
    traces the plain model, not the engine's compiled one) takes the mode and knobs as well: a knob
    set for a CLIP run is never silently left out of its compile."""
    from vitscale.tasks import clip_step

    calls = []
    monkeypatch.setattr(clip_step.torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    train = TrainConfig(compile=True, **KNOBS)
    step = clip_step.ClipStep(loss=None, train_cfg=train)  # type: ignore[arg-type]
    assert step.compiled and calls == [{"fullgraph": True, **compile_args(train)}]
    assert calls[0]["options"]["coordinate_descent_tuning"] is True
