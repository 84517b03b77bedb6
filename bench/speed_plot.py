"""The speed benchmark's table and PNG again, from its JSON, on any machine (no GPU):

    python bench/speed_plot.py speed.json --out speed.png

The PNG (also written by ``bench/speed.py --plot``): fraction of the single-GPU cuDNN ideal vs
tokens per GPU, one line per method, forward and forward+backward panels, one row of panels per
kv-heads setting (causal configs; a non-causal config shows as hollow markers). matplotlib is
optional: ``plot`` returns False without it. ``bench/speed.py`` prints and draws with this
module's ``print_table`` and ``plot``."""
import argparse
import json

from dtensor_ring.tools.numerics import NAMES
from report import style_fraction_axes

_COLORS = {"ring": "C0", "zigzag": "C1", "stripe": "C2", "llama3": "C3",
           "torch_cp_allgather": "C4", "torch_cp_alltoall": "C9", "ideal_flash": "0.5",
           "ideal_cudnn": "k", "ideal_cpu": "k"}


def _style(method):
    if method.startswith("ideal"):
        return _COLORS.get(method, "k"), ":"
    if method.startswith("torch_cp"):
        return _COLORS.get(method, "C6"), "-."
    schedule, _, precision = method.rpartition("_")
    return _COLORS.get(schedule, "C7"), "--" if precision == "exact" else "-"


def plot(data, path) -> bool:
    try:
        import matplotlib  # noqa: PLC0415 - optional
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    meta, rows = data["meta"], [r for r in data["rows"] if r.get("frac_fwd") is not None]
    kvs = sorted({r["kv_heads"] for r in rows}, reverse=True)
    if not kvs:
        return False
    methods = list(dict.fromkeys(r["method"] for r in rows))
    panels = (("frac_fwd", "forward"), ("frac_fwd_bwd", "forward+backward"))
    fig, axes = plt.subplots(len(kvs), 2, figsize=(12, 4.2 * len(kvs)), squeeze=False)
    for i, kv in enumerate(kvs):
        for j, (key, title) in enumerate(panels):
            ax = axes[i][j]
            for method in methods:
                color, line = _style(method)
                pts = sorted((r["tokens_per_gpu"], r[key]) for r in rows
                             if r["method"] == method and r["kv_heads"] == kv and r["causal"])
                if pts:
                    ax.plot(*zip(*pts), line, marker="o", markersize=3, color=color,
                            label=method)
                nc = [(r["tokens_per_gpu"], r[key]) for r in rows
                      if r["method"] == method and r["kv_heads"] == kv and not r["causal"]]
                if nc:
                    ax.plot(*zip(*nc), "o", markersize=7, markerfacecolor="none", color=color,
                            label=f"{method} (non-causal)")
            style_fraction_axes(ax, sorted({r["tokens_per_gpu"] for r in rows}),
                                f"{title}, {meta['heads']}/{kv} heads", "fraction of cuDNN ideal")
        axes[i][1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"W={meta['world_size']} {meta.get('gpu', meta.get('device'))}, "
                 f"d={meta['head_dim']}, bf16; torch {meta['torch']}, cuDNN {meta.get('cudnn')}; "
                 "ideal = single-GPU cuDNN over the whole sequence / W", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _f(x, spec):
    return format(x, spec) if x is not None else "-"


def fmt_row(r):
    acc = r.get("acc_ratio")
    acc = "/".join(f"{acc[n]:.2f}" for n in NAMES) if acc else "-"
    head = (f"{r['tokens_per_gpu']:>6} {r['kv_heads']:>3} {'c' if r['causal'] else 'nc':>2} "
            f"{r['method']:20}")
    if r.get("error"):
        return f"{head} ERROR {r['error']}"
    return (f"{head} {_f(r.get('fwd_ms'), '9.3f')} {_f(r.get('frac_fwd'), '6.3f')} "
            f"{_f(r.get('fwd_bwd_ms'), '10.3f')} {_f(r.get('frac_fwd_bwd'), '6.3f')} "
            f"{_f(r.get('frac_steady_fwd'), '5.2f')} {_f(r.get('frac_steady_fwd_bwd'), '5.2f')} "
            f"{_f(r.get('mem_gib'), '7.2f')} {_f(r.get('sent_mib'), '8.1f')}  {acc}")


HEADER = (f"{'tok/GPU':>6} {'kv':>3} {'':>2} {'method':20} {'fwd ms':>9} {'frac':>6} "
          f"{'fwd+bwd ms':>10} {'frac':>6} {'st f':>5} {'st fb':>5} {'mem GiB':>7} "
          f"{'sent MiB':>8}  acc ratio out/dq/dk/dv")


def print_table(info, rows):
    print(f"W={info['world_size']} heads={info['heads']} d={info['head_dim']} bf16 "
          f"{info.get('gpu', info['device'])} torch {info['torch']} cudnn {info.get('cudnn')} "
          f"triton {info.get('triton')}")
    print("frac = single-GPU cuDNN time over the whole sequence / W (with --window: windowed "
          "flash), divided by the row's time, each run timed from an idle GPU; st f / st fb = the "
          "same in steady state (CUDA: runs back to back, the host ahead, as a model's layers); "
          "mem = peak the call adds on its inputs (ideal rows: one GPU, whole sequence); sent = "
          "bytes a rank sent per fwd+bwd (max over ranks)")
    print(HEADER)
    for r in rows:
        print(fmt_row(r))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", help="bench/speed.py's --out JSON")
    parser.add_argument("--out", help="PNG to write (default: only print the table)")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    print_table(data["meta"], data["rows"])
    if args.out:
        print("plot:", args.out if plot(data, args.out) else "matplotlib missing")


if __name__ == "__main__":
    main()
