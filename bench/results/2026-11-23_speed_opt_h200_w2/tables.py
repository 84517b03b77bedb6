"""Markdown tables of this folder's runs: fraction of the cuDNN ideal (measured in each run's
"new" invocation) for the old and new code.  python tables.py"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULES = ("ring", "zigzag", "stripe", "llama3")


def load(run, name):
    path = os.path.join(HERE, run, f"speed_{name}.json")
    if not os.path.exists(path):
        return {}
    rows = json.load(open(path))["rows"]
    return {(r["tokens_per_gpu"], r["kv_heads"], r["causal"], r["method"]): r for r in rows
            if r.get("fwd_ms")}


def frac(ideal, row):
    if not row:
        return "-"
    return f"{ideal['fwd_ms'] / row['fwd_ms']:.2f} / {ideal['fwd_bwd_ms'] / row['fwd_bwd_ms']:.2f}"


def table(run, variants, causal=True, tokens=(8192, 16384, 32768), kv=(32, 8)):
    data = {v: load(run, v) for v in variants}
    new = data["new"]
    configs = [(t, h) for h in kv for t in tokens if (t, h, causal, "ideal_cudnn") in new]
    head = "| schedule | variant | " + " | ".join(f"{t // 1024}K, 32/{h}" for t, h in configs)
    lines = [head + " |", "|---|---|" + "---|" * len(configs)]
    for s in SCHEDULES:
        for v in variants:
            cells = [frac(new[(t, h, causal, "ideal_cudnn")], data[v].get((t, h, causal, f"{s}_fp32")))
                     for t, h in configs]
            if any(c != "-" for c in cells):
                lines.append(f"| {s} | {v} | " + " | ".join(cells) + " |")
    ideal = ["%.2f / %.2f" % (new[(t, h, causal, "ideal_cudnn")]["fwd_ms"],
                              new[(t, h, causal, "ideal_cudnn")]["fwd_bwd_ms"]) for t, h in configs]
    lines.append("| ideal ms (cuDNN, /W) | | " + " | ".join(ideal) + " |")
    return "\n".join(lines)


def times(run, variants, tokens=(8192, 16384, 32768), kv=(32, 8)):
    data = {v: load(run, v) for v in variants}
    lines = ["| schedule | variant | " + " | ".join(
        f"{t // 1024}K 32/{h}" for h in kv for t in tokens) + " |",
        "|---|---|" + "---|" * (len(kv) * len(tokens))]
    for s in SCHEDULES:
        for v in variants:
            cells = []
            for h in kv:
                for t in tokens:
                    r = data[v].get((t, h, True, f"{s}_fp32"))
                    cells.append(f"{r['fwd_ms']:.2f} / {r['fwd_bwd_ms']:.2f} / {r['mem_gib']:.2f}"
                                 if r else "-")
            lines.append(f"| {s} | {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("run2 causal\n" + table("run2", ("old", "new")))
    print("\nrun2 non-causal\n" + table("run2", ("old", "new"), causal=False, tokens=(8192,),
                                        kv=(32,)))
    print("\nrun1 causal\n" + table("run1", ("old", "new", "hp")))
    print("\nrun2 times ms fwd / fwd+bwd / mem GiB\n" + times("run2", ("old", "new")))
    print("\nrun1 times\n" + times("run1", ("old", "new", "hp")))
