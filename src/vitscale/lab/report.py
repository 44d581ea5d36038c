"""Tables and PNG plots for sweeps (results.jsonl records) and scaling predictions (matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

from ..config import Config, apply_dict
from ..tasks import model_info

SPLIT = ("data", "forward", "backward", "comm_exposed", "optimizer")


def _plt():
    import matplotlib  # here: optional, and the plots alone need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)


def label(rec: dict, skip=()) -> str:
    parts = [f"{k.split('.')[-1]}={v}" for k, v in rec["overrides"].items() if k not in skip]
    return " ".join([f"n={rec['nproc']}", *parts])


def _group(rec: dict, study) -> str:
    skip = {"strategy.name"} | ({"data.batch_size"} if study == "weak" else set())
    return repr(sorted((k, str(v)) for k, v in rec["overrides"].items() if k not in skip))


def grad_bytes(bench: dict) -> float | None:
    """Gradient bytes all-reduced per optimizer step: bench's measured count when nproc > 1,
    else parameters x 4 bytes (fp32 gradients)."""
    for src in (bench, bench.get("comm") or {}):
        if src.get("comm_allreduce_bytes_per_step"):
            return float(src["comm_allreduce_bytes_per_step"])
    params = bench.get("params")
    if params is None and bench.get("config"):
        try:
            params = model_info(apply_dict(Config(), bench["config"], source="bench config"))[
                "params"
            ]
        except Exception:  # noqa: BLE001 - a table column, not worth failing the report for
            return None
    return 4.0 * params if params else None


def derive(records: list[dict], study=None) -> list[dict]:
    """Per record: speedup = img/s / img/s at nproc 1 of the same group, efficiency = speedup / nproc
    (strong: same global batch, so this is T(1)/T(K); weak: per-device batch fixed, so efficiency is
    T(1)/T(K)); accum: gradient bytes sent per sample = grad bytes / global batch, and what the same
    micro-batch without accumulation would send (x accum_steps)."""
    base = {}
    for r in records:
        if r["ok"] and r["nproc"] == 1:
            base.setdefault(_group(r, study), r["bench"]["images_per_s"])
    out = []
    for r in records:
        d = {}
        if r["ok"]:
            b = r["bench"]
            ref = base.get(_group(r, study))
            if ref:
                d["speedup"] = b["images_per_s"] / ref
                d["efficiency"] = d["speedup"] / r["nproc"]
            if study == "accum":
                g = grad_bytes(b)
                accum = int(r["overrides"].get("train.accum_steps", 1))
                if g:
                    d["bytes_per_sample"] = g / b["batch_size"]
                    d["bytes_per_sample_no_accum"] = g * accum / b["batch_size"]
        out.append(d)
    return out


def common_mfu(records: list[dict]) -> list[float | None]:
    """Each point's MFU against the best peak measured for its kind of peak (same `peak_source`)
    anywhere in the sweep: a CPU peak is measured on the spot, and one measured while the machine
    was busy would inflate that point's MFU; the peak is the best the machine does."""
    best: dict = {}
    for r in records:
        b = r.get("bench") or {}
        if r["ok"] and b.get("peak_flops") and b.get("peak_source"):
            best[b["peak_source"]] = max(best.get(b["peak_source"], 0.0), b["peak_flops"])
    out = []
    for r in records:
        b = r.get("bench") or {}
        if not r["ok"] or b.get("mfu") is None:
            out.append(None)
        elif b.get("peak_flops") and b.get("peak_source") in best:
            out.append(b["mfu"] * b["peak_flops"] / best[b["peak_source"]])
        else:
            out.append(b["mfu"])
    return out


def _ms(v) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def markdown_table(records: list[dict], study=None) -> str:
    derived, mfus = derive(records, study), common_mfu(records)
    head = [
        "point",
        "global batch",
        "img/s",
        "img/s/device",
        "step ms (min-max)",
        *(f"{s} ms" for s in SPLIT),
        "peak MB",
        "state MiB/process",
        "MFU",
        "speedup",
        "efficiency",
    ]
    if study == "accum":
        head += ["grad bytes/sample", "without accum"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, d, mfu in zip(records, derived, mfus):
        if not r["ok"]:
            lines.append(
                f"| {label(r)} | failed: {str(r['error']).replace('|', '/')} |"
                + " |" * (len(head) - 2)
            )
            continue
        b = r["bench"]
        st, split = b["step_time_s"], b.get("split") or {}
        mem = b.get("peak_memory_bytes")
        row = [
            label(r),
            str(b["batch_size"]),
            f"{b['images_per_s']:.1f}",
            f"{b['images_per_s_per_device']:.1f}",
            f"{_ms(st['median'])} ({_ms(st['min'])}-{_ms(st['max'])})",
            *(_ms(split.get(s)) for s in SPLIT),
            "-" if mem is None else f"{mem / 2**20:.0f}",
            "-" if b.get("state_bytes") is None else f"{b['state_bytes'] / 2**20:.1f}",
            "-" if mfu is None else f"{100 * mfu:.1f}%",
            f"{d['speedup']:.2f}" if "speedup" in d else "-",
            f"{100 * d['efficiency']:.0f}%" if "efficiency" in d else "-",
        ]
        if study == "accum":
            row += [
                f"{d['bytes_per_sample']:.0f}" if "bytes_per_sample" in d else "-",
                f"{d['bytes_per_sample_no_accum']:.0f}"
                if "bytes_per_sample_no_accum" in d
                else "-",
            ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot_split(records: list[dict], path: Path) -> None:
    plt = _plt()
    ok = [r for r in records if r["ok"]]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(ok) + 2), 4))
    bottom = [0.0] * len(ok)
    for s in SPLIT:
        vals = [1e3 * ((r["bench"].get("split") or {}).get(s) or 0.0) for r in ok]
        ax.bar(range(len(ok)), vals, bottom=bottom, label=s)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.plot(
        range(len(ok)),
        [1e3 * r["bench"]["step_time_s"]["median"] for r in ok],
        "k_",
        ms=20,
        label="step (median)",
    )
    ax.set_xticks(range(len(ok)), [label(r).replace(" ", "\n") for r in ok], fontsize=7)
    ax.set_ylabel("ms per step")
    ax.set_title("step split per point")
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_scaling(records: list[dict], derived: list[dict], path: Path, study) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    groups = {}
    for r, d in zip(records, derived):
        if "speedup" in d:
            groups.setdefault(_group(r, study), []).append(
                (r["nproc"], d["speedup"], d["efficiency"], r)
            )
    ns = sorted({r["nproc"] for r in records})
    a1.plot(ns, ns, "k--", label="ideal")
    a2.plot(ns, [1.0] * len(ns), "k--", label="ideal")
    for _g, pts in groups.items():
        pts.sort(key=lambda p: p[0])
        name = (
            label(pts[0][3], skip={"strategy.name", "data.batch_size"}).replace("n=1", "").strip()
            or "measured"
        )
        a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        a2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=name)
    a1.set(
        xlabel="processes",
        ylabel="speedup (img/s vs 1 process)",
        title=f"{study or 'scaling'}: speedup",
    )
    a2.set(
        xlabel="processes",
        ylabel="efficiency",
        title=f"{study or 'scaling'}: efficiency",
        ylim=(0, 1.2),
    )
    a1.legend(fontsize=7)
    _save(fig, path)


def plot_batch(records: list[dict], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    by_n = {}
    for r in records:
        if r["ok"]:
            b = r["bench"]
            st = b.get("step_time_s", {})
            lo, hi = (
                (b["batch_size"] / st["max"], b["batch_size"] / st["min"])
                if "min" in st
                else (None, None)
            )
            by_n.setdefault(r["nproc"], []).append((b["batch_size"], b["images_per_s"], lo, hi))
    for n, pts in sorted(by_n.items()):
        pts.sort()
        x, y = [p[0] for p in pts], [p[1] for p in pts]
        if all(p[2] is not None for p in pts):  # the spread of the trials: slowest to fastest
            err = [
                [max(0.0, v - p[2]) for v, p in zip(y, pts)],
                [max(0.0, p[3] - v) for v, p in zip(y, pts)],
            ]
            ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3, label=f"{n} process(es)")
        else:
            ax.plot(x, y, "o-", label=f"{n} process(es)")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)  # a flat curve must look flat
    ax.set(
        xlabel="global batch",
        ylabel="images/s (bars: slowest to fastest trial)",
        title="throughput vs batch",
    )
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_memory(records: list[dict], path: Path) -> None:
    plt = _plt()
    ok = [r for r in records if r["ok"]]
    names = [
        label(r, skip={"nproc"}).replace("name=", "").replace("deepspeed zero_stage=", "ZeRO-")
        for r in ok
    ]
    fig, (a0, a1, a2) = plt.subplots(1, 3, figsize=(14, 3.8))
    # what each process holds (parameters, master copies, optimizer state): where sharding shows;
    # the peak also has activations and, on CPUs, the allocator's cached pages
    a0.bar(
        range(len(ok)),
        [(r["bench"].get("state_bytes") or 0) / 2**20 for r in ok],
        color="tab:green",
    )
    a1.bar(range(len(ok)), [(r["bench"].get("peak_memory_bytes") or 0) / 2**20 for r in ok])
    a2.bar(range(len(ok)), [r["bench"]["images_per_s"] for r in ok], color="tab:orange")
    for ax, title in (
        (a0, "state held per process (MiB)"),
        (a1, "peak memory per process (MiB)"),
        (a2, "images/s"),
    ):
        ax.set_xticks(range(len(ok)), [n.replace(" ", "\n") for n in names], fontsize=7)
        ax.set_title(title)
    _save(fig, path)


def write_report(records: list[dict], out: Path, study=None) -> list[Path]:
    """results.md and the plots that apply to these records; returns the files written."""
    out = Path(out)
    (out / "results.md").write_text(
        f"# sweep{' (' + study + ')' if study else ''}\n\n" + markdown_table(records, study)
    )
    written = [out / "results.md"]
    ok = [r for r in records if r["ok"]]
    if not ok:
        return written
    plot_split(records, out / "split.png")
    written.append(out / "split.png")
    derived = derive(records, study)
    if len({r["nproc"] for r in ok}) > 1 and any("speedup" in d for d in derived):
        plot_scaling(records, derived, out / "scaling.png", study)
        written.append(out / "scaling.png")
    if len({r["bench"]["batch_size"] for r in ok}) > 1 and study not in ("weak", "strong"):
        plot_batch(records, out / "batch.png")
        written.append(out / "batch.png")
    if study == "memory" or any("strategy.name" in r["overrides"] for r in ok):
        plot_memory(records, out / "memory.png")
        written.append(out / "memory.png")
    return written


def plot_predicted_speedup(result: dict, path: Path) -> None:
    """Strong- and weak-scaling speedup vs GPUs (log-log), one curve per link and strategy, with ideal."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, kind, what in (
        (axes[0], "strong", f"global batch {result['batch']:g}"),
        (axes[1], "weak", f"{result['batch']:g} images per GPU"),
    ):
        ks = []
        for c in result["curves"]:
            ks = [r["gpus"] for r in c["rows"]]
            ax.plot(
                ks,
                [r[f"{kind}_speedup"] for r in c["rows"]],
                "o-",
                ms=3,
                label=f"{c['strategy']} {c['link']}",
            )
        ax.plot(ks, ks, "k--", label="ideal")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set(
            xlabel="GPUs",
            ylabel="speedup (throughput vs 1 GPU)",
            title=f"predicted {kind} scaling, {what}",
        )
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{result['arch']}: {result['source'][:110]}", fontsize=8)
    _save(fig, path)
