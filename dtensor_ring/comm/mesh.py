"""Turning the user's ``mesh`` argument into process groups.

A context-parallel mesh is 1-D (a ``DeviceMesh`` dimension such as ``mesh["cp"]``, or a
``ProcessGroup``): the ring runs over it; or 2-D, ``(outer, inner)``, e.g.
``init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("cp_ring", "cp_a2a"))``: the
ring runs over the first dimension and an all-to-all over heads over the second
(``dtensor_ring/hybrid/``). A 2-D mesh whose inner dimension has size 1 is the ring over its first
dimension, exactly as a 1-D mesh.
"""
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group, _world


def resolve_group(mesh, arg: str = "mesh") -> dist.ProcessGroup:
    """The process group of a 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]``), or a ``ProcessGroup`` as is."""
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"{arg} must be a 1-D DeviceMesh; got a {mesh.ndim}-D mesh with dimension names "
                f"{mesh.mesh_dim_names}: pass the sequence dimension, e.g. {arg}['cp']")
        return mesh.get_group()
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    raise TypeError(f"{arg} must be a 1-D DeviceMesh or a ProcessGroup; got {type(mesh).__name__}")


class SequenceMesh(NamedTuple):
    """The context-parallel ranks of a call. ``outer``: the ring's process group; ``inner``: the
    all-to-all's (None on a 1-D mesh); ``whole``: a group of all of them, for the ranks'
    agreement check before any exchange (``consistency.py``; the ring's group on a 1-D mesh)."""

    outer: dist.ProcessGroup
    inner: "dist.ProcessGroup | None" = None
    whole: "dist.ProcessGroup | None" = None

    @property
    def outer_size(self) -> int:
        return dist.get_world_size(self.outer)

    @property
    def inner_size(self) -> int:
        return 1 if self.inner is None else dist.get_world_size(self.inner)

    @property
    def shape(self) -> tuple[int, int]:
        return self.outer_size, self.inner_size

    @property
    def world_size(self) -> int:
        return self.outer_size * self.inner_size

    @property
    def rank(self) -> int:
        """This rank's place among all of them: outer rank i, inner rank j -> i * inner + j."""
        inner_rank = 0 if self.inner is None else dist.get_rank(self.inner)
        return dist.get_rank(self.outer) * self.inner_size + inner_rank

    @property
    def check_group(self) -> dist.ProcessGroup:
        return self.outer if self.whole is None else self.whole

    @property
    def group_names(self) -> tuple[str, ...]:
        """The groups by name, as the custom ops take them: the ring's, or on a 2-D mesh the
        ring's, the all-to-all's and the whole mesh's."""
        groups = (self.outer,) if self.inner is None else (self.outer, self.inner, self.whole)
        return tuple(group.group_name for group in groups)

    @classmethod
    def named(cls, *group_names: str) -> "SequenceMesh":
        """The mesh of ``group_names`` (``group_names`` read back)."""
        return cls(*map(_resolve_process_group, group_names))


def resolve_mesh(mesh, arg: str = "mesh") -> SequenceMesh:
    """A 1-D mesh or process group, or a 2-D ``DeviceMesh`` (ring, all-to-all), as a
    ``SequenceMesh``; a 2-D mesh with an inner dimension of size 1 is the ring alone."""
    if isinstance(mesh, SequenceMesh):
        return mesh
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 2:
        outer, inner = mesh.get_group(0), mesh.get_group(1)
        if dist.get_world_size(inner) == 1:
            return SequenceMesh(outer)
        return SequenceMesh(outer, inner, whole_group(mesh))
    if isinstance(mesh, DeviceMesh) and mesh.ndim != 1:
        raise ValueError(
            f"{arg} must be a 1-D DeviceMesh (the ring) or a 2-D one (ring x all-to-all); got a "
            f"{mesh.ndim}-D mesh with dimension names {mesh.mesh_dim_names}: pass the sequence "
            f"dimensions, e.g. {arg}['cp'] or {arg}['cp_ring', 'cp_a2a']")
    return SequenceMesh(resolve_group(mesh, arg))


# (ring group name, all-to-all group name) -> the group of all of that 2-D mesh's ranks: found
# once, outside torch.compile (whole_group), and read by compiled code.
_WHOLE: dict[tuple[str, str], dist.ProcessGroup] = {}


def whole_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """A process group of exactly the ranks of a 2-D ``mesh``, for the agreement check.

    The first group created with these ranks where there is one (the default group when the mesh
    spans the job), so that ranks passing meshes that disagree -- (2, 2) on some, (1, 4) on
    others -- meet in one all-gather and see it; else ``mesh._flatten()``'s, which creates one
    (a collective over the root mesh's ranks, as ``DeviceMesh._flatten`` is: the first call on a
    mesh must be made by every rank, as ``ContextParallel`` and ``shard_sequence`` are). Found
    once per mesh, eagerly: a compiled call needs the mesh seen before (by ``ContextParallel``,
    ``shard_sequence`` or an eager call), and raises a ValueError saying so otherwise.
    """
    key = (mesh.get_group(0).group_name, mesh.get_group(1).group_name)
    found = _WHOLE.get(key)
    if found is not None:
        return found
    if torch.compiler.is_compiling():
        raise ValueError(
            f"the 2-D mesh {mesh} is used under torch.compile before any eager use: shard the "
            "inputs with dr.shard_sequence (or apply dr.ContextParallel) with it first, outside "
            "the compiled code")
    members = set(mesh.mesh.flatten().tolist())
    found = next((group for group, ranks in _world.pg_group_ranks.items()
                  if set(ranks) == members), None)
    if found is None:
        if not mesh.mesh_dim_names:
            raise ValueError("a 2-D context-parallel mesh needs dimension names "
                             "(init_device_mesh(..., mesh_dim_names=('cp_ring', 'cp_a2a')))")
        found = mesh._flatten("_".join(mesh.mesh_dim_names)).get_group()
    _WHOLE[key] = found
    return found


def check_device(mesh, tensor: torch.Tensor, arg: str) -> None:
    """A DeviceMesh names its device type; the tensors must live there."""
    if isinstance(mesh, DeviceMesh) and tensor.device.type != mesh.device_type:
        raise ValueError(f"{arg} is on device {tensor.device} but the mesh is of device type "
                         f"{mesh.device_type!r}; move the tensor or build the mesh on its device")
