"""The compiled ring keeps eager's overlap: in the code inductor generates, every exchange is posted
before some attention kernel and waited on after it.

One process, a fake process group of 4 ranks as rank 1; ``torch.compile`` (inductor, CPU) of
zigzag and llama3 forward+backward. The fake group answers every exchange at once with garbage:
only the generated code is read. Inductor may move nodes (its fusion and memory-planning passes);
this checks the order it finally emits, which is what the GPU runs.
"""
import re

import pytest
import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import dtensor_ring as dr

_POST = re.compile(r"^(\w+) = torch\.ops\.dtensor_ring\.post_exchange\.default\(.*"
                   r"'(send_recv_next|send_recv|all_gather|reduce_scatter)', '[^']*'(, .*)?\)$")
_BEGIN = re.compile(r"^(\w+) = torch\.ops\.dtensor_ring\.begin_exchange\.default\(.*?"
                    r"(?:'(send_recv)'.*)?\)$")  # kind: send_recv_next unless named
_BEGUN = re.compile(r"^(\w+) = torch\.ops\.dtensor_ring\.post_begun_exchange\.default\((\w+)")
_POSTS = re.compile(r"(post|begin)_exchange\.default\(")  # one per exchange
_WAIT = re.compile(r"torch\.ops\.dtensor_ring\.wait_exchange\.default\((\w+),")
_ALIAS = re.compile(r"^(\w+) = (\w+)$")
_ATTENTION = re.compile(r"torch\.ops\.aten\._scaled_dot_product\w*attention")


def exchanges_without_overlap(code: str) -> list[str]:
    """The kinds of the exchanges of ``code`` (inductor's output) waited on with no attention
    kernel between their post and their wait, in the order of their waits. A shift posted in
    two halves (``begin_exchange``, ``post_begun_exchange``) counts from its begin, and is
    reported too ("... posted before its kernel") if no kernel comes between its halves."""
    posted, names, bad = {}, {}, []  # handle -> attention kernels seen before its post
    kernels = 0
    for line in (raw.strip() for raw in code.splitlines()):
        if (post := _POST.match(line)) is not None:
            posted[post.group(1)] = kernels
            names[post.group(1)] = post.group(2)
        elif (begin := _BEGIN.match(line)) is not None:
            posted[begin.group(1)] = kernels
            names[begin.group(1)] = begin.group(2) or "send_recv_next"
        elif (begun := _BEGUN.match(line)) is not None:
            if posted[begun.group(2)] == kernels:  # nothing launched between the halves
                bad.append(f"{names[begun.group(2)]} posted before its kernel")
            posted[begun.group(1)] = posted[begun.group(2)]
            names[begun.group(1)] = names[begun.group(2)]
        elif (alias := _ALIAS.match(line)) is not None and alias.group(2) in posted:
            posted[alias.group(1)] = posted[alias.group(2)]  # bufN = bufM: the same handle
            names[alias.group(1)] = names[alias.group(2)]
        elif (wait := _WAIT.search(line)) is not None:
            if posted[wait.group(1)] == kernels:
                bad.append(names[wait.group(1)])
        if _ATTENTION.search(line):
            kernels += 1
    return bad


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield init_device_mesh("cpu", (4,))
    dist.destroy_process_group()


def most_in_flight(code: str, kind: str) -> int:
    """The most exchanges of ``kind`` posted and not yet waited on at once in ``code``."""
    handles, flying, most = set(), 0, 0
    for line in (raw.strip() for raw in code.splitlines()):
        if (post := _POST.match(line)) is not None and post.group(2) == kind:
            handles.add(post.group(1))
            flying += 1
        elif (alias := _ALIAS.match(line)) is not None and alias.group(2) in handles:
            handles.add(alias.group(1))
        elif (wait := _WAIT.search(line)) is not None and wait.group(1) in handles:
            flying -= 1
        most = max(most, flying)
    return most


def compiled_code(mesh, schedule, dtype=torch.float32, window=None, heads=(4, 2)) -> str:
    """Inductor's code for ``schedule``'s causal forward+backward, rank 1 of the fake 4-rank
    ``mesh``, 64 tokens a rank, ``heads`` (q, kv) of 16."""
    def step(q, k, v):
        out = dr.ring_attention(q, k, v, mesh=mesh, schedule=schedule, is_causal=True,
                                window=window)
        out.float().sum().backward()

    q, k, v = (torch.randn(1, h, 64, 16, dtype=dtype, requires_grad=True)
               for h in (heads[0], heads[1], heads[1]))
    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(step), q, k, v)
    return "\n".join(codes)


@pytest.mark.parametrize("schedule", ["zigzag", "llama3"])
def test_every_exchange_overlaps_attention_in_the_compiled_code(mesh, schedule):
    code = compiled_code(mesh, schedule)
    posts = len(_POSTS.findall(code))
    # zigzag: 3 K/V shifts forward, 3 K/V + 3 dK/dV backward, each overlapping a step's blocks.
    # llama3: 2 head groups' gathers forward, 2 gathers + 2 reduce-scatters backward; as eagerly,
    # with a kernel that has the bottom-right mask (the CPU one) the first gather of each pass
    # has nothing to overlap (no block on the rank's own K/V alone: ``llama3._NaturalOrder``), nor
    # has the last reduce-scatter.
    assert posts == (9 if schedule == "zigzag" else 6), code
    unhidden = exchanges_without_overlap(code)
    assert unhidden == ([] if schedule == "zigzag" else
                        ["all_gather", "all_gather", "reduce_scatter"]), unhidden


@pytest.fixture
def top_left_causal_only(monkeypatch):
    """The CPU kernel as cuDNN is on the GPU: causal only from the top left (no bottom-right
    mask), which sends causal llama3 to its ``_OwnThenOthers`` plan. The pass's output depends on
    it, so inductor's caches are off meanwhile."""
    from dtensor_ring.kernels import get_kernel  # noqa: PLC0415
    from dtensor_ring.kernels.base import CAUSAL, NONE  # noqa: PLC0415
    kernel = get_kernel("auto", torch.device("cpu"), torch.bfloat16, 16, "fp32", False, False)
    monkeypatch.setattr(kernel, "masks", (NONE, CAUSAL))
    with torch._inductor.config.patch(force_disable_caches=True):
        yield


def test_llama3_with_a_top_left_causal_kernel_overlaps_as_eagerly(mesh, top_left_causal_only):
    """llama3's plan on cuDNN (the own block first, all heads, while the first group is
    gathered): every gather and every reduce-scatter but the last overlaps attention, as in the
    eager schedule. Inductor once sank each group's dK/dV (and so its reduce-scatter's post)
    below the next group's blocks and waited on it at once."""
    code = compiled_code(mesh, "llama3", torch.bfloat16)
    assert len(_POSTS.findall(code)) == 6, code
    assert exchanges_without_overlap(code) == ["reduce_scatter"], code


def test_llama3_gathers_two_head_groups_at_most(mesh, top_left_causal_only):
    """The same plan with 4 head groups: each group's all-gather is posted after the blocks of
    the group before the last (``passes/ring_expand.py``, ``_order_exchanges``), so at most two
    are in flight, the schedule's memory bound. The gathers read only local K/V: on 4 H200s
    inductor posted all four at the start of the forward, and the forward took 1.4x eager's
    time."""
    code = compiled_code(mesh, "llama3", torch.bfloat16, heads=(8, 4))
    assert len(_POSTS.findall(code)) == 12, code
    assert most_in_flight(code, "all_gather") == 2, code
    assert exchanges_without_overlap(code) == ["reduce_scatter"], code


def test_windowed_zigzag_overlaps_every_exchange(mesh):
    """zigzag with a sliding window (``schedules/windowed.py``: one send_recv per offset within
    reach, K/V forward, K/V and dK/dV backward): every exchange overlaps attention. Before waits
    took their kernel as a dependency, inductor hoisted all six of the backward's."""
    code = compiled_code(mesh, "zigzag", torch.bfloat16, window=(47, 0))
    assert len(_POSTS.findall(code)) == 9, code
    assert exchanges_without_overlap(code) == [], code


def test_a_wait_before_the_compute_is_found():
    """The check itself: an exchange whose wait comes before the step's kernel is reported."""
    overlapped = """
buf0 = torch.ops.dtensor_ring.post_exchange.default([a, b], None, 'send_recv_next', '0')
buf1 = buf0
buf2 = torch.ops.aten._scaled_dot_product_cudnn_attention.default(q, a, b)
buf3 = torch.ops.dtensor_ring.wait_exchange.default(buf1, [a, b], 'send_recv_next', 4)"""
    assert exchanges_without_overlap(overlapped) == []
    lines = overlapped.strip().splitlines()
    serial = "\n".join([lines[0], lines[1], lines[3], lines[2]])
    assert exchanges_without_overlap(serial) == ["send_recv_next"]
    begun = """
buf0 = torch.ops.dtensor_ring.begin_exchange.default([a, b], None, '0')
buf1 = torch.ops.aten._scaled_dot_product_cudnn_attention.default(q, a, b)
buf2 = torch.ops.dtensor_ring.post_begun_exchange.default(buf0, buf1)
buf3 = torch.ops.dtensor_ring.wait_exchange.default(buf2, [a, b], 'send_recv_next', 4)"""
    assert exchanges_without_overlap(begun) == []
    lines = begun.strip().splitlines()
    assert exchanges_without_overlap("\n".join([lines[0], lines[2], lines[3], lines[1]])) == [
        "send_recv_next posted before its kernel", "send_recv_next"]
    # a sliding window's exchange begun the same way (its kind named in the begin)
    sizes = "[1, 2, 3, 8, 1, 2, 3, 8]"
    windowed = begun.replace("None, '0')", f"None, '0', 'send_recv', 1, {sizes}, 3)")
    windowed = windowed.replace("'send_recv_next', 4)", f"'send_recv', 4, {sizes})")
    assert exchanges_without_overlap(windowed) == []
    lines = windowed.strip().splitlines()
    assert exchanges_without_overlap("\n".join([lines[0], lines[2], lines[3], lines[1]])) == [
        "send_recv posted before its kernel", "send_recv"]
