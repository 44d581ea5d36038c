"""The device mesh (issue 49): strategy.name as the short form of a (dp_replicate, dp_shard, tp)
shape, the keys that set a dimension, and every refusal at config time, in one line, before
anything is written (`vitscale config` refuses what `vitscale train` refuses)."""

import pytest
from helpers import TINY, run, sets

from vitscale.config import load_config
from vitscale.errors import ConfigError
from vitscale.models.layers import tp_widths
from vitscale.models.vit import VisionTransformer, ViTSpec
from vitscale.strategy.mesh import MeshShape, mesh_shape, tp_refusal


def shape(world, local=None, **keys):
    cfg = load_config(TINY, [f"strategy.{k}={v}" for k, v in keys.items()])
    return mesh_shape(cfg.strategy, world, local)


@pytest.mark.parametrize(
    "world,keys,expected",
    [
        (1, {}, (1, 1, 1)),  # single
        (4, {"name": "ddp"}, (4, 1, 1)),
        (4, {"name": "fsdp"}, (1, 4, 1)),
        (4, {"name": "fsdp", "tp": 2}, (1, 2, 2)),
        (2, {"name": "fsdp", "tp": 2}, (1, 1, 2)),  # tensor parallel alone
        (4, {"name": "ddp", "tp": 2}, (2, 1, 2)),
        (4, {"name": "hsdp", "dp_shard": 2}, (2, 2, 1)),
        (4, {"name": "hsdp", "dp_replicate": 2}, (2, 2, 1)),
        (8, {"name": "hsdp", "dp_shard": 2, "tp": 2}, (2, 2, 2)),
        (4, {"name": "fsdp", "tp": -1, "dp_shard": 1}, (1, 1, 4)),
        (4, {"name": "deepspeed"}, (4, 1, 1)),
    ],
)
def test_the_short_forms_and_the_keys_give_one_mesh_of_the_world(world, keys, expected):
    s = shape(world, **keys)
    assert s.sizes == expected and s.world == world


def test_hsdp_shards_within_a_node_by_default():
    assert shape(8, local=4, name="hsdp").sizes == (2, 4, 1)  # 2 nodes of 4 processes


def test_data_parallel_and_tensor_parallel_indices_put_tp_innermost():
    s = MeshShape(2, 2, 2)
    assert [s.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s.tp_rank(r) for r in range(8)] == [0, 1] * 4 and s.dp == 4


@pytest.mark.parametrize(
    "world,keys,says",
    [
        (4, {"name": "fsdp", "dp_shard": 3}, "has 3 processes, the launch 4"),
        (4, {"name": "fsdp", "tp": 3}, "does not divide 4 processes"),
        (4, {"name": "hsdp", "dp_replicate": 2, "dp_shard": 4}, "has 8 processes, the launch 4"),
        (1, {"name": "hsdp"}, "strategy.name=hsdp on one process"),
        (2, {"name": "deepspeed", "tp": 2}, "strategy.tp=2 with strategy.name=deepspeed"),
        (2, {"name": "ddp", "dp_shard": 2}, "use strategy.name=fsdp or hsdp"),
        (2, {"name": "fsdp", "sequence_parallel": "true"}, "it needs strategy.tp > 1"),
    ],
)
def test_a_mesh_that_cannot_be_built_is_refused_in_one_line(world, keys, says):
    with pytest.raises(ConfigError) as e:
        shape(world, **keys)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_tp_must_divide_the_heads_and_the_widths():
    model = VisionTransformer(ViTSpec(image_size=8, patch_size=4, in_chans=1, dim=48, heads=3))
    assert tp_refusal(MeshShape(1, 1, 3), tp_widths(model)) is None
    why = tp_refusal(MeshShape(1, 1, 2), tp_widths(model))
    assert why and "strategy.tp=2 does not divide the model's heads" in why and "(3)" in why


@pytest.mark.parametrize(
    "world,overrides,says",
    [
        (2, ["strategy.name=fsdp", "strategy.tp=2", "model.heads=1"], "does not divide the model"),
        (4, ["strategy.name=fsdp", "strategy.tp=3"], "does not divide 4 processes"),
        (2, ["strategy.name=deepspeed", "strategy.tp=2"], "strategy.name=deepspeed"),
        (4, ["strategy.name=fsdp", "data.batch_size=6"], "multiple of processes (4)"),
        (
            4,
            ["strategy.name=fsdp", "strategy.tp=2", "data.batch_size=3"],
            "multiple of processes (2)",
        ),
        (1, ["strategy.name=hsdp"], "hsdp on one process"),
    ],
)
def test_vitscale_config_refuses_what_train_refuses_under_the_launch(
    tmp_path, capsys, monkeypatch, world, overrides, says
):
    monkeypatch.chdir(tmp_path)
    for k, v in {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    for command in ("config", "train"):
        args = [command, TINY, *sets(overrides)] + (["--out", "run"] if command == "train" else [])
        rc, _, err = run(capsys, *args)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and says in lines[0], (command, err)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_batch_splits_over_the_data_parallel_groups_not_the_processes():
    """Under tensor parallelism the processes of a group share their batch: 6 images split over
    2 data-parallel groups of 2 (refused over 4 plain FSDP2 processes, above)."""
    from vitscale.checks import check_run

    cfg = load_config(TINY, ["strategy.name=fsdp", "strategy.tp=2", "data.batch_size=6"])
    assert check_run(cfg, world_size=4) is cfg
