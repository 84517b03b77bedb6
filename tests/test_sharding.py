"""shard_sequence / unshard_sequence / sequence_positions on real gloo groups, and the layouts' maps."""
import pytest
import torch

import dtensor_ring as dr
from dist_utils import run_on_ranks
from dtensor_ring.sharding import rank_major_positions


@pytest.mark.parametrize("layout", sorted(dr.LAYOUTS))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_every_global_position_is_held_by_exactly_one_rank(layout, world):
    seq = 2 * world * 3
    positions = rank_major_positions(dr.LAYOUTS[layout], seq, world)
    assert torch.equal(positions.sort().values, torch.arange(seq))


def test_layout_maps_are_the_documented_ones():
    assert dr.LAYOUTS["zigzag"].positions(4, 1, 2).tolist() == [2, 3, 4, 5]
    assert dr.LAYOUTS["zigzag"].positions(4, 0, 2).tolist() == [0, 1, 6, 7]
    assert dr.LAYOUTS["stripe"].positions(3, 1, 2).tolist() == [1, 3, 5]
    assert dr.LAYOUTS["contiguous"].positions(3, 1, 2).tolist() == [3, 4, 5]


def _round_trips(mesh):
    world, rank = mesh.size(), mesh.get_local_rank()
    seq = 2 * world * 5
    for layout in sorted(dr.LAYOUTS):
        x = torch.randn(2, 3, seq, 4, generator=torch.Generator().manual_seed(1))
        local = dr.shard_sequence(x, mesh, dim=2, layout=layout)
        assert local.shape == (2, 3, seq // world, 4)
        assert torch.equal(dr.unshard_sequence(local, mesh, dim=2, layout=layout), x), layout
        positions = dr.sequence_positions(seq, mesh, layout=layout)
        assert torch.equal(local, x[:, :, positions]), layout
        tokens = dr.shard_sequence(torch.arange(seq).expand(2, seq), mesh, dim=1, layout=layout)
        assert torch.equal(tokens[0], positions), layout
        # unshard is differentiable: the gradient of a sum reaches every local element once.
        local.requires_grad_()
        dr.unshard_sequence(local, mesh, dim=2, layout=layout).sum().backward()
        assert torch.equal(local.grad, torch.full_like(local, world)), (layout, rank)
        # A shard from the wrong layout does not round-trip (the check above can fail).
        if layout != "contiguous" and world > 1:
            wrong = dr.unshard_sequence(local.detach(), mesh, dim=2, layout="contiguous")
            assert not torch.equal(wrong, x), layout


@pytest.mark.parametrize("world", [2, 3])
def test_shard_unshard_positions_round_trip_on_every_rank(world):
    run_on_ranks(world, _round_trips)
