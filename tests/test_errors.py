"""Bad input gets a ValueError/TypeError naming the argument, its value and what would be valid."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dtensor_ring as dr


@pytest.fixture(scope="module")
def mesh():
    """A one-process gloo group: enough to reach every check."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _qkv(q_shape=(1, 4, 8, 16), kv_shape=(1, 2, 8, 16), dtype=torch.float32):
    return torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape), torch.randn(kv_shape)


def _ring(mesh, q, k, v, **kwargs):
    return dr.ring_attention(q, k, v, mesh=mesh, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="zagzig"), r"schedule='zagzig'.*valid schedules: \['auto', 'llama3', 'ring', 'stripe', 'zigzag'\]"),
    (dict(backend="cuda_magic"), r"backend='cuda_magic' is not known; valid backends with precision='fp32': \['auto'"),
    (dict(backend="cudnn"), r"backend='cudnn' cannot run on device=cpu.*usable here: \['cpu_flash', 'math'\]"),
    (dict(precision="fp16"), r"precision='fp16' is not supported; valid: \['fp32', 'exact'\]"),
    (dict(precision="exact", backend="cudnn"), r"backend='cudnn' is not known \(an fp32 kernel: it rounds each block\); valid backends with precision='exact': \['auto', 'cpu_flash_exact', 'efficient_exact', 'math_exact', 'triton_exact'\]"),
    (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), r"attn_mask is not supported"),
    (dict(dropout_p=0.1), r"dropout_p=0.1 is not supported.*valid: 0.0"),
    (dict(scale=-1.0), r"scale=-1.0 must be None or a positive number"),
])
def test_bad_options(mesh, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _ring(mesh, *_qkv(), **kwargs)


def test_is_causal_must_be_a_bool(mesh):
    with pytest.raises(TypeError, match="is_causal must be a bool; got 'yes'"):
        _ring(mesh, *_qkv(), is_causal="yes")


@pytest.mark.parametrize("make,match", [
    (lambda: (torch.randn(4, 8, 16), *_qkv()[1:]), r"query must be 4-D .*got shape \(4, 8, 16\)"),
    (lambda: _qkv(kv_shape=(1, 3, 8, 16)), r"key/value heads \(3\) must divide query heads \(4\)"),
    (lambda: _qkv(dtype=torch.bfloat16), r"key.dtype=torch.float32 differs from query.dtype=torch.bfloat16"),
    (lambda: _qkv(kv_shape=(2, 2, 8, 16)), r"key has batch 2 but query has batch 1"),
    (lambda: _qkv(kv_shape=(1, 2, 8, 32)), r"key has head_dim 32 but query has 16"),
    (lambda: _qkv(kv_shape=(1, 2, 6, 16)), r"key has local sequence length 6 but query has 8"),
    (lambda: (*_qkv()[:2], torch.randn(1, 2, 8, 8)), r"value has shape \(1, 2, 8, 8\) but key has"),
    (lambda: (torch.ones(1, 4, 8, 16, dtype=torch.int64), *_qkv()[1:]), r"query must be a floating-point tensor"),
])
def test_bad_tensors(mesh, make, match):
    with pytest.raises(ValueError, match=match):
        _ring(mesh, *make())


def test_not_a_tensor(mesh):
    with pytest.raises(TypeError, match="key must be a torch.Tensor; got list"):
        _ring(mesh, torch.randn(1, 1, 2, 4), [1.0], torch.randn(1, 1, 2, 4))


def test_device_mismatch_is_named(mesh):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"key.device=meta differs from query.device=cpu"):
        _ring(mesh, q, k.to("meta"), v.to("meta"))


def test_zigzag_needs_an_even_local_length(mesh):
    with pytest.raises(ValueError, match=r"query.shape\[2\] \(local sequence length\)=7 must be even"):
        _ring(mesh, *_qkv((1, 4, 7, 16), (1, 2, 7, 16)), schedule="zigzag")
    _ring(mesh, *_qkv((1, 4, 7, 16), (1, 2, 7, 16)), schedule="stripe")  # any length is fine


def test_mesh_must_be_one_or_two_dimensional_or_a_group(mesh):
    mesh_3d = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "cp_ring", "cp_a2a"))
    with pytest.raises(ValueError, match=r"mesh must be a 1-D DeviceMesh \(the ring\) or a 2-D one \(ring x all-to-all\); got a 3-D mesh .*\('dp', 'cp_ring', 'cp_a2a'\).*mesh\['cp_ring', 'cp_a2a'\]"):
        _ring(mesh_3d, *_qkv())
    with pytest.raises(TypeError, match="mesh must be a 1-D DeviceMesh or a ProcessGroup; got str"):
        _ring("cp", *_qkv())
    _ring(mesh_3d["cp_ring", "cp_a2a"], *_qkv())  # 2-D: ring x all-to-all (here 1 x 1)
    _ring(mesh_3d["cp_ring"], *_qkv())
    _ring(dist.group.WORLD, *_qkv())


def test_sharding_errors(mesh):
    x = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match=r"layout='diagonal' is not a known layout; valid layouts: \['contiguous', 'stripe', 'zigzag'\]"):
        dr.shard_sequence(x, mesh, layout="diagonal")
    with pytest.raises(ValueError, match=r"dim=4 is out of range for a tensor of shape \(1, 2, 6, 4\)"):
        dr.shard_sequence(x, mesh, dim=4)
    with pytest.raises(ValueError, match=r"x_local.shape\[2\]=5 must be even"):
        dr.unshard_sequence(torch.randn(1, 2, 5, 4), mesh, layout="zigzag")
    with pytest.raises(TypeError, match="seq_len must be an int; got 6.0"):
        dr.sequence_positions(6.0, mesh)
    with pytest.raises(ValueError, match=r"seq_len=5 is not divisible by 2 \* mesh size = 2"):
        dr.sequence_positions(5, mesh, layout="zigzag")


def test_simulate_ring_errors():
    q, k, v = _qkv((1, 4, 12, 16), (1, 2, 12, 16))
    with pytest.raises(ValueError, match="world_size=0 must be a positive int"):
        dr.simulate_ring(q, k, v, world_size=0)
    with pytest.raises(ValueError, match=r"query.shape\[2\] \(sequence length\)=12 is not divisible by 2 \* mesh size = 16"):
        dr.simulate_ring(q, k, v, world_size=8, schedule="llama3")
    with pytest.raises(ValueError, match=r"query.shape\[2\] \(sequence length\)=12 is not divisible by the mesh size 5"):
        dr.simulate_ring(q, k, v, world_size=5, schedule="stripe")


@pytest.mark.parametrize("value", ["false", "off", ""])
def test_bad_peer_copy_switch(monkeypatch, value):
    from dtensor_ring.comm import peer_copy  # noqa: PLC0415
    monkeypatch.setenv(peer_copy.ENV, value)
    with pytest.raises(ValueError, match=rf"DTENSOR_RING_PEER_COPY={value!r} is not valid; "
                                         r"valid: '0' \(NCCL's kernels\), '1' \(the copy "
                                         r"engines \(the default\)\)"):
        peer_copy.switched_on_by_env()
    for good, on in (("0", False), ("1", True)):
        monkeypatch.setenv(peer_copy.ENV, good)
        assert peer_copy.switched_on_by_env() is on


def test_bad_stream_flag_operation():
    from dtensor_ring.comm import stream_flags  # noqa: PLC0415
    with pytest.raises(ValueError, match=r"operation 'add' is not valid; valid: 'wait', 'set'"):
        stream_flags.Batch([(stream_flags.WAIT, 0, 1), ("add", 0, 1)])


def test_stream_flags_say_why_they_cannot_run():
    """Without the CUDA driver the copy-engine shift is refused with the reason (its groups then
    shift through NCCL or gloo); with a GPU, a flag set and awaited on a stream works."""
    from dtensor_ring.comm import stream_flags  # noqa: PLC0415
    reason = stream_flags.unusable_because()
    if torch.cuda.is_available():
        assert reason is None, reason
    else:
        assert isinstance(reason, str) and reason, reason
