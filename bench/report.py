"""What the benchmarks' JSON shares: versions and hardware, an exception in one line, the file
rewritten atomically (so a run stopped midway leaves the rows it measured)."""
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]  # the checkout the benchmarks run from


def git_commit():
    """The tree's commit (``+dirty`` with changes to tracked files), or None outside a git
    checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def git_tree():
    """The git tree hash of the files that ran: the tracked and the not-ignored untracked files
    as they are on disk (``git write-tree`` through a scratch index, the repository's own index
    untouched). It names the contents, not a history: ``git rev-parse <commit>^{tree}`` gives
    the same hash for the commit that holds them, even where the checkout's ``.git`` is older
    than its files (a copy of a working tree on another machine), or None outside a checkout."""
    with tempfile.TemporaryDirectory() as scratch:
        env = dict(os.environ, GIT_INDEX_FILE=str(Path(scratch) / "index"))
        try:
            for args in (["add", "-A"], ["write-tree"]):
                done = subprocess.run(["git", *args], cwd=_ROOT, env=env, capture_output=True,
                                      text=True, timeout=60)
                if done.returncode:
                    return None
        except (OSError, subprocess.SubprocessError):
            return None
    return done.stdout.strip() or None


def versions(device):
    """The commit (``git_commit``), the files' tree (``git_tree``), torch, Triton and, on CUDA,
    the GPU, cuDNN, CUDA and NCCL versions."""
    info = {"git_commit": git_commit(), "git_tree": git_tree(), "torch": torch.__version__}
    try:
        import triton  # noqa: PLC0415 - optional
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.device(device).type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), cudnn=torch.backends.cudnn.version(),
                    cuda=torch.version.cuda)
        try:
            nccl = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception:  # noqa: BLE001 - a version string is not worth a failed run
            info["nccl"] = None
    return info


def describe(exc):
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}"


def write_json(path, info, rows):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": info, "rows": rows}, f, indent=1)
    os.replace(tmp, path)


def style_fraction_axes(ax, ticks, title, ylabel="fraction of the ideal"):
    """The look the speed plots share: tokens per GPU on a log2 x axis, a fraction of the ideal
    (0..1.25, a line at 1) on y."""
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [f"{t // 1024}K" if t >= 1024 else str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(0, 1.25)
    ax.set_xlabel("tokens per GPU")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
