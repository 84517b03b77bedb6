"""The per-rank benchmark's PNG (bench/per_rank.py): fraction of the ideal vs tokens per GPU, one
line per method, forward and forward+backward panels, one row of panels per kv-heads setting;
CUDA-graph replays (--capture) as dotted lines with hollow markers. matplotlib is optional: ``plot``
returns False without it (``bench/per_rank.py --plot-only JSON --plot PNG`` draws it later)."""
from report import style_fraction_axes

_COLORS = {"ring": "C0", "zigzag": "C1", "stripe": "C2", "llama3": "C3", "ideal": "k",
           "ideal_flash": "0.55"}


def _lines(rows, kv):
    """{label: (color, style, marker fill, {tokens: (frac_fwd, frac_fwd_bwd)})}"""
    lines = {}
    for r in rows:
        if r["kv_heads"] != kv or r.get("error"):
            continue
        schedule, _, precision = r["method"].partition("_")
        color = _COLORS.get(r["method"], _COLORS.get(schedule, "C7"))
        style = "--" if precision == "exact" else ":" if schedule == "ideal" else "-"
        points = [(r["method"], style, "full", r.get("frac_fwd"), r.get("frac_fwd_bwd"))]
        graph = r.get("graph") or {}
        if graph.get("frac_fwd") or graph.get("frac_fwd_bwd"):
            points.append((f"{r['method']} (graph)", ":", "none", graph.get("frac_fwd"),
                           graph.get("frac_fwd_bwd")))
        for label, line, fill, fwd, fb in points:
            entry = lines.setdefault(label, (color, line, fill, {}))
            entry[3][r["tokens_per_gpu"]] = (fwd, fb)
    return lines


def plot(data, path) -> bool:
    try:
        import matplotlib  # noqa: PLC0415 - optional
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    meta, rows = data["meta"], data["rows"]
    kvs = sorted({r["kv_heads"] for r in rows if not r.get("error")}, reverse=True)
    if not kvs:
        return False
    ticks = sorted({r["tokens_per_gpu"] for r in rows})
    fig, axes = plt.subplots(len(kvs), 2, figsize=(12, 4.2 * len(kvs)), squeeze=False)
    for i, kv in enumerate(kvs):
        lines = _lines(rows, kv)
        for j, title in enumerate(("forward", "forward+backward")):
            ax = axes[i][j]
            for label, (color, line, fill, points) in lines.items():
                pts = sorted((t, f[j]) for t, f in points.items() if f[j] is not None)
                if pts:
                    ax.plot(*zip(*pts), line, marker="o", markersize=4, color=color,
                            markerfacecolor=fill if fill == "none" else color, label=label)
            style_fraction_axes(ax, ticks, f"{title}, {meta['heads']}/{kv} heads")
        axes[i][1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"one rank of W={meta['world']} (communication replaced by ready buffers), "
                 f"{meta.get('gpu', meta.get('device'))}, d={meta['head_dim']}, {meta['dtype']}, "
                 f"{'causal' if meta['causal'] else 'non-causal'}; torch {meta['torch']}, cuDNN "
                 f"{meta.get('cudnn')}\nideal = fastest single-GPU kernel over the whole sequence "
                 "/ W; max over ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
