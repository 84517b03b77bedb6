"""The docs: every relative link resolves, docs/make_layouts.py's picture is the package's own, and
every public name documents its arguments and result.

Every relative link (and image) in README.md and docs/*.md must name a file of the repository,
and an anchor a heading of that file (GitHub's slugs).

The layouts it draws must be what ``dr.shard_sequence`` / ``dr.sequence_positions`` give each rank
(checked through a fake process group: one process plays every rank, no communication), and its
causal grid must say what the ring does: rank r computes its own q rows, at the step when it holds
the K/V of the k token's owner (step = (r - owner) mod W). Drawing needs matplotlib (skipped
without it); the data checks do not.
"""
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dtensor_ring as dr

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "make_layouts.py"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces as -."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or ROOT not in linked.parents:
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120


PUBLIC_FUNCTIONS = [name for name in dr.__all__ if callable(getattr(dr, name))]


def _section(doc: str, header: str) -> str:
    """The text of a Google-style section (``Args:``, ``Returns:``) up to the next header."""
    match = re.search(rf"^ *{header}:\n(.*?)(?=^ *[A-Z][a-z]+:\n|\Z)", doc,
                      flags=re.MULTILINE | re.DOTALL)
    return match.group(1) if match else ""


def _public(name):
    if name == "hf.apply":
        pytest.importorskip("transformers")
        import dtensor_ring.hf  # noqa: PLC0415 - needs transformers

        return dtensor_ring.hf.apply
    return getattr(dr, name)


@pytest.mark.parametrize("name", [*PUBLIC_FUNCTIONS, "hf.apply"])
def test_public_functions_document_every_argument_and_the_result(name):
    """Each public function or class has a docstring with an Args section naming every parameter
    of its signature (a class: its constructor's) and a Returns section."""
    obj = _public(name)
    doc = inspect.getdoc(obj) or ""
    args, returns = _section(doc, "Args"), _section(doc, "Returns")
    assert args.strip() and returns.strip(), f"{name}: no Args: or no Returns: section"
    params = [p for p in inspect.signature(obj).parameters if p != "self"]
    missing = [p for p in params if not re.search(rf"\b{p}\b", args)]
    assert not missing, f"{name}: Args: does not name {missing}"


def test_public_registries_are_described_in_the_package_docstring():
    registries = [name for name in dr.__all__ if name not in PUBLIC_FUNCTIONS]
    assert registries  # BACKENDS, LAYOUTS, SCHEDULES, SCHEDULE_LAYOUT
    missing = [name for name in registries if f"``{name}``:" not in dr.__doc__]
    assert not missing, f"dtensor_ring's docstring does not describe {missing}"


def test_the_docstring_check_fails_on_a_missing_argument():
    """The check above can fail: a function whose Args: leave out one parameter is caught."""
    def documented(a, b):
        """Args:
            a (int): one.

        Returns:
            int: a + b.
        """
    args = _section(inspect.getdoc(documented), "Args")
    assert re.search(r"\ba\b", args) and not re.search(r"\bb\b", args)
    assert _section("Nothing here.", "Args") == ""


@pytest.fixture(scope="module")
def layouts():
    spec = importlib.util.spec_from_file_location("make_layouts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _as_rank(rank, world):
    """A default process group in which this process is ``rank`` of ``world`` (fake backend)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=rank, world_size=world, store=fake_pg.FakeStore())


@pytest.mark.parametrize("schedule", ["ring", "zigzag", "stripe", "llama3"])
def test_drawn_layouts_are_shard_sequence(layouts, schedule):
    world, seq = layouts.WORLD, layouts.SEQ
    drawn = layouts.token_owners(schedule)
    layout = dr.SCHEDULE_LAYOUT[schedule]
    for rank in range(world):
        _as_rank(rank, world)
        try:
            group = dist.group.WORLD
            shard = dr.shard_sequence(torch.arange(seq), group, dim=0, layout=layout)
            positions = dr.sequence_positions(seq, group, layout=layout)
        finally:
            dist.destroy_process_group()
        assert drawn[rank] == shard.tolist() == positions.tolist(), (schedule, rank)
    assert sorted(sum(drawn, [])) == list(range(seq))


@pytest.mark.parametrize("schedule", ["ring", "zigzag", "stripe", "llama3"])
def test_drawn_causal_grid_is_the_ring(layouts, schedule):
    world, seq = layouts.WORLD, layouts.SEQ
    rank_of, step_of = layouts.causal_work(schedule)
    owner = torch.empty(seq, dtype=torch.int64)
    for rank, positions in enumerate(layouts.token_owners(schedule)):
        owner[positions] = rank
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    assert torch.equal(rank_of >= 0, causal)
    q_owner = owner[:, None].expand(seq, seq)
    assert torch.equal(rank_of[causal], q_owner[causal])  # each rank computes its own q rows
    if schedule == "llama3":
        assert (step_of[causal] == 0).all()
    else:
        k_owner = owner[None, :].expand(seq, seq)
        assert torch.equal(step_of[causal], ((q_owner - k_owner) % world)[causal])
    work = layouts.work_per_step(schedule)
    assert work.sum() == seq * (seq + 1) // 2
    if schedule in ("zigzag", "llama3"):
        assert len(set(work.sum(1).tolist())) == 1  # balanced


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_llama3_plan_for_cudnn_covers_the_causal_mask_once(layouts, world):
    """llama3 on a kernel without the bottom-right mask (cuDNN: own block, X, Y on the gathered
    K/V as they arrive) computes every causal pair exactly once (``causal_work`` raises
    otherwise), each rank its own q rows, as the natural-order plan does."""
    seq = 4 * world
    natural, _ = layouts.causal_work("llama3", seq, world)
    own_then_others, _ = layouts.causal_work("llama3", seq, world, kernel="cudnn")
    assert torch.equal(own_then_others, natural)


def test_script_writes_the_png(layouts, tmp_path):
    pytest.importorskip("matplotlib")
    out = layouts.main([str(tmp_path / "sub" / "layouts.png")])
    assert out == tmp_path / "sub" / "layouts.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
