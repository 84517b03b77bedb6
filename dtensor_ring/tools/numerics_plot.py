"""The numerics report's PNG: rel-RMS error ratio vs W, one line per schedule x precision, one panel
per (input kind, tensor). matplotlib is optional: ``plot`` returns False without it."""

from .numerics import NAMES

_STYLE = {"fp32": "--", "exact": "-"}

def plot(rows, config, path) -> bool:
    try:
        import matplotlib  # noqa: PLC0415 - optional
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    kinds = sorted({r["inputs"] for r in rows})
    lines = sorted({(r["schedule"], r["precision"]) for r in rows})
    fig, axes = plt.subplots(len(kinds), len(NAMES), figsize=(4 * len(NAMES), 3.4 * len(kinds)),
                             squeeze=False, sharex=True)
    colors = {s: f"C{i}" for i, s in enumerate(sorted({s for s, _ in lines}))}
    for i, kind in enumerate(kinds):
        for j, name in enumerate(NAMES):
            ax = axes[i][j]
            for schedule, precision in lines:
                pts = sorted((r["world"], r["ratio"]["rel_rms"][name]) for r in rows
                             if (r["inputs"], r["schedule"], r["precision"]) ==
                             (kind, schedule, precision))
                ax.plot(*zip(*pts), _STYLE.get(precision, ":"), marker="o", markersize=3,
                        color=colors[schedule], label=f"{schedule} {precision}")
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{name}, {kind} inputs", fontsize=10)
            ax.set_xlabel("W (simulated ranks)")
            if j == 0:
                ax.set_ylabel("rel-RMS / single-device kernel's")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"error ratio vs W: S={config['seq']}, H={config['heads']}/{config['kv_heads']}, "
                 f"d={config['head_dim']}, {config['dtype']}, causal={config['causal']}, "
                 f"{config['device_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
