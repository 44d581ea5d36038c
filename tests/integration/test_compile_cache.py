"""train.compile_cache, torch.compiler's Mega Cache (issue 51): one process compiles and saves it
after its first step, a second one whose own inductor cache is empty loads it: its compile is a
cache hit, and its numbers are the first's."""

import json
import os
import subprocess
import sys
import textwrap

CACHE_RUN = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    from torch._dynamo.utils import counters
    from vitscale.config import OptimConfig, TrainConfig
    from vitscale.strategy.single import SingleDevice
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    s = SingleDevice(TrainConfig(compile=True, compile_cache=sys.argv[1]), OptimConfig(lr=0.1),
                     torch.device("cpu"))
    s.setup(model)
    x = torch.randn(4, 8)
    losses = []
    for _ in range(2):
        loss = s.model(x).square().mean()
        s.backward(loss)
        s.step()
        losses.append(loss.item())
    print(json.dumps({"losses": losses, "hits": counters["inductor"]["fxgraph_cache_hit"]}))
    """
)


def test_the_mega_cache_round_trip_in_two_processes(tmp_path):
    cache = tmp_path / "cache" / "mega.bin"
    results = []
    for run in ("first", "second"):
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor_{run}"),  # empty in each
            "OMP_NUM_THREADS": "1",
        }
        p = subprocess.run(
            [sys.executable, "-c", CACHE_RUN, str(cache)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        results.append(json.loads(p.stdout.strip().splitlines()[-1]))
        if run == "first":
            assert cache.is_file() and cache.stat().st_size > 0
    first, second = results
    assert first["hits"] == 0 and second["hits"] > 0  # the second compiled from the loaded cache
    assert second["losses"] == first["losses"]
