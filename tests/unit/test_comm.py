"""The collective counter (strategy/comm.py) on its own: what it counts, when, and per step.
Real collectives under DDP, FSDP2 and ZeRO are checked against each engine's expected bytes in
test_distributed.py and test_deepspeed.py."""

import torch

from vitscale.strategy.comm import Counter, nbytes


def test_counts_payload_inside_the_window_once_per_outer_call():
    c = Counter()
    calls = []

    def inner(output_tensor, input_tensor, group=None, async_op=False):
        calls.append("inner")

    counted_inner = c.wrap(inner, "allgather", 0, "output_tensor")

    def outer(output_tensor, input_tensor, group=None, async_op=False):  # e.g. a deprecated alias
        calls.append("outer")
        counted_inner(output_tensor, input_tensor)

    counted_outer = c.wrap(outer, "allgather", 0, "output_tensor")
    out, inp = torch.zeros(8, 3), torch.zeros(4, 3)
    counted_outer(out, inp)  # outside the step: not counted
    assert c.take(1) == {}
    with c.window():
        counted_outer(out, inp)  # nested: counted once, output bytes
        counted_inner(output_tensor=out, input_tensor=inp)  # keyword arguments too
        with c.paused():
            counted_inner(out, inp)  # bookkeeping: not counted
    assert calls == ["outer", "inner"] * 2 + ["inner", "inner"]
    r = c.take(2)
    assert r["comm_allgather_bytes_per_step"] == 2 * 96 / 2
    assert r["comm_allgather_calls_per_step"] == 1.0
    assert r["comm_bytes_per_step"] == 96 and r["comm_calls_per_step"] == 1.0
    assert r["comm_allgather_s_per_step"] >= 0 and "comm_allreduce_bytes_per_step" not in r
    assert c.take(1) == {}  # take() resets


def test_payload_of_lists_and_dtypes():
    assert nbytes(torch.zeros(10, dtype=torch.bfloat16)) == 20
    assert nbytes([torch.zeros(3), torch.zeros(2, dtype=torch.float64)]) == 12 + 16
    assert nbytes(None) == 0
    c = Counter()
    rs = c.wrap(
        lambda output, input_list, op=None, group=None, async_op=False: None,
        "reducescatter",
        1,
        "input_list",
    )
    with c.window():
        rs(torch.zeros(2), [torch.zeros(2), torch.zeros(2)])
    assert c.take(1)["comm_reducescatter_bytes_per_step"] == 16
