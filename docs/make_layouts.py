"""Draw docs/img/layouts.png: the four schedules' layouts and causal work, from the package's code.

    python docs/make_layouts.py [OUT.png]        # default: docs/img/layouts.png

For W = 4 ranks and a 16-token sequence, one column per schedule:

1. which global tokens each rank holds (``Layout.positions``, the index ``dr.shard_sequence`` takes;
   tests/test_docs.py checks the two agree);
2. the causal attention matrix (q token x k token, natural order): colour = the rank that computes
   the pair, digit = the ring step at which it does (from the schedule's own block lists:
   ``RingSchedule._blocks`` for ring/zigzag/stripe, llama3's plan for llama3, which all-gathers
   K/V and has no steps);
3. the (q, k) pairs each rank computes at each step: the load balance.

Nothing is hand-coded: if a layout or a block list changes, the picture follows (and the checks in
``causal_work`` fail if the blocks stop covering the causal mask exactly once).
"""
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from dtensor_ring.kernels import BACKENDS
from dtensor_ring.kernels.base import CAUSAL, CAUSAL_BOTTOM_RIGHT, NONE
from dtensor_ring.schedules import SCHEDULES
from dtensor_ring.schedules import llama3

WORLD, SEQ = 4, 16
ORDER = ("ring", "zigzag", "stripe", "llama3")
DEFAULT_OUT = Path(__file__).parent / "img" / "layouts.png"


def token_owners(schedule: str, seq_len: int = SEQ, world: int = WORLD) -> list[list[int]]:
    """Global positions of each rank's tokens, in local order: rank r's ``shard_sequence`` of an
    arange under ``schedule``'s layout."""
    layout = SCHEDULES[schedule].layout
    layout.check_global_len(seq_len, world)
    return [layout.positions(seq_len // world, r, world).tolist() for r in range(world)]


def _allowed(mask: str, n_q: int, n_k: int) -> torch.Tensor:
    """[n_q, n_k] bool: which pairs of a block its mask keeps (kernels/base.py's definitions)."""
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    if mask == NONE:
        return torch.ones(n_q, n_k, dtype=torch.bool)
    if mask == CAUSAL:
        return j <= i
    if mask == CAUSAL_BOTTOM_RIGHT:
        return j <= i + (n_k - n_q)
    raise ValueError(f"mask={mask!r} is not known")


def _llama3_blocks(rank: int, seq_len: int, world: int, kernel: str):
    """llama3's blocks on ``kernel`` (its plan depends on the kernel's masks), each with the global
    positions of the K rows it indexes. The gathered K/V handed to the plan hold positions."""
    local = seq_len // world
    plan = llama3.plan_class(True, BACKENDS[kernel], None)(rank, world, local, True, None)
    if plan.local is None:  # K/V all-gathered into natural order: K row index = global position
        return [(0, block, list(range(seq_len))) for block, _ in plan.blocks]
    owners = token_owners("llama3", seq_len, world)
    # [W, S_local, 2, B, Hg, D] as the messages arrive, K and V both holding positions
    gathered = torch.tensor(owners).view(world, local, 1, 1, 1, 1).expand(-1, -1, 2, 1, 1, 1)
    out = [(0, plan.local, owners[rank])]
    return out + [(0, block, keys[:, 0].flatten().tolist())
                  for block, keys in plan.others(gathered)]


def _rank_blocks(schedule: str, rank: int, seq_len: int, world: int, kernel: str):
    """(step, block, global positions of the K rows the block indexes) for one rank, causal."""
    if schedule == "llama3":
        return _llama3_blocks(rank, seq_len, world, kernel)
    local = seq_len // world
    sched = SCHEDULES[schedule]
    comm = SimpleNamespace(rank=rank, world_size=world)
    out = []
    for step in range(world):
        src = (rank - step) % world  # ring.py: at step t rank r holds rank (r - t)'s K/V
        k_pos = sched.layout.positions(local, src, world).tolist()
        out += [(step, block, k_pos) for block in sched._blocks(comm, step, local, True, None)]
    return out


def causal_work(schedule: str, seq_len: int = SEQ, world: int = WORLD, kernel: str = "cpu_flash"):
    """(rank, step): two [seq_len, seq_len] int tensors over (q token, k token) in natural order,
    -1 where nothing is computed. Raises if the blocks do not cover the causal mask exactly once.
    ``kernel``: the block kernel llama3 plans for (the picture: CPU flash, which has the
    bottom-right mask; "cudnn" gives the plan for a kernel without it)."""
    rank_of = torch.full((seq_len, seq_len), -1)
    step_of = torch.full((seq_len, seq_len), -1)
    owners = token_owners(schedule, seq_len, world)
    for rank in range(world):
        for step, block, k_pos in _rank_blocks(schedule, rank, seq_len, world, kernel):
            q_glob = torch.tensor(owners[rank][block.q])
            k_glob = torch.tensor(k_pos[block.k])
            keep = _allowed(block.mask, len(q_glob), len(k_glob))
            qi, ki = (q_glob[:, None].expand_as(keep)[keep], k_glob[None, :].expand_as(keep)[keep])
            if (rank_of[qi, ki] >= 0).any():
                raise AssertionError(f"{schedule}: rank {rank} step {step} recomputes pairs")
            rank_of[qi, ki], step_of[qi, ki] = rank, step
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    if not torch.equal(rank_of >= 0, causal):
        raise AssertionError(f"{schedule}: the blocks do not cover the causal mask exactly")
    return rank_of, step_of


def work_per_step(schedule: str, seq_len: int = SEQ, world: int = WORLD) -> torch.Tensor:
    """[world, steps]: (q, k) pairs rank r computes at step t (llama3: one column, no steps)."""
    rank_of, step_of = causal_work(schedule, seq_len, world)
    steps = 1 if schedule == "llama3" else world
    work = torch.zeros(world, steps, dtype=torch.int64)
    for r in range(world):
        for t in range(steps):
            work[r, t] = ((rank_of == r) & (step_of == t)).sum()
    return work


def plot(out_path=DEFAULT_OUT, seq_len: int = SEQ, world: int = WORLD) -> Path:
    import matplotlib  # noqa: PLC0415 - optional: only the picture needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.colors import ListedColormap  # noqa: PLC0415

    colors = plt.get_cmap("Set2").colors[:world]
    rank_cmap = ListedColormap(["white", *colors])  # value rank + 1; 0 = nothing
    fig, axes = plt.subplots(3, len(ORDER), figsize=(3.4 * len(ORDER), 7.2),
                             gridspec_kw=dict(height_ratios=[world, seq_len, world]))
    for col, schedule in enumerate(ORDER):
        sched = SCHEDULES[schedule]
        owners, (rank_of, step_of) = token_owners(schedule, seq_len, world), causal_work(
            schedule, seq_len, world)
        # 1. tokens held: rank x global position
        ax = axes[0, col]
        held = torch.zeros(world, seq_len, dtype=torch.int64)
        for r, positions in enumerate(owners):
            held[r, positions] = r + 1
            for p in positions:
                ax.text(p, r, str(p), ha="center", va="center", fontsize=7)
        ax.imshow(held, cmap=rank_cmap, vmin=0, vmax=world, aspect="auto")
        ax.set_title(f"{schedule}\n{sched.layout.name} layout, "
                     f"{'all-gather' if schedule == 'llama3' else 'P2P ring'}", fontsize=10)
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)], fontsize=8)
        ax.set_xticks([])
        ax.set_xlabel("global token (tokens each rank holds)", fontsize=8)
        # 2. causal matrix: colour = computing rank, digit = ring step
        ax = axes[1, col]
        ax.imshow(rank_of + 1, cmap=rank_cmap, vmin=0, vmax=world)
        if schedule != "llama3":
            for qi, ki in (rank_of >= 0).nonzero().tolist():
                ax.text(ki, qi, str(step_of[qi, ki].item()), ha="center", va="center",
                        fontsize=6)
        ax.set_xticks(range(0, seq_len, 4))
        ax.set_yticks(range(0, seq_len, 4))
        ax.tick_params(labelsize=7)
        ax.set_xlabel("k token", fontsize=8)
        if col == 0:
            ax.set_ylabel("q token", fontsize=8)
        note = ("digit = ring step" if schedule != "llama3" else
                "one all-gather, no ring steps;\none kernel call per q chunk\n"
                "(bottom-right causal mask)")
        ax.text(seq_len - 1, 0, note, ha="right", va="top", fontsize=7)
        # 3. load balance
        ax = axes[2, col]
        work = work_per_step(schedule, seq_len, world)
        ax.imshow(work, cmap="Greys", vmin=0, vmax=2 * work.max().item(), aspect="auto")
        for r in range(world):
            for t in range(work.shape[1]):
                ax.text(t, r, str(work[r, t].item()), ha="center", va="center", fontsize=7)
            ax.text(work.shape[1] - 0.4, r, f"  total {work[r].sum().item()}", va="center",
                    fontsize=7)
        ax.set_xlim(-0.5, work.shape[1] + (1.3 if schedule != "llama3" else 0.8))
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)], fontsize=8)
        ax.set_xticks(range(work.shape[1]),
                      ["gather"] if schedule == "llama3" else [f"step {t}" for t in
                                                                range(work.shape[1])],
                      fontsize=7)
        ax.set_xlabel("(q, k) pairs computed", fontsize=8)
        for spine in ax.spines.values():
            spine.set_visible(False)
    fig.suptitle(f"W = {world} ranks, {seq_len} tokens, causal: the tokens each rank holds, and "
                 "which (q, k) pairs it computes at which step (colour = rank)", fontsize=11)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path


def main(argv=None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        raise SystemExit("usage: python docs/make_layouts.py [OUT.png]")
    out = plot(argv[0] if argv else DEFAULT_OUT)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
