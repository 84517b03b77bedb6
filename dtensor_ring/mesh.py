"""Turning the user's ``mesh`` argument into a process group."""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


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


def check_device(mesh, tensor: torch.Tensor, arg: str) -> None:
    """A DeviceMesh names its device type; the tensors must live there."""
    if isinstance(mesh, DeviceMesh) and tensor.device.type != mesh.device_type:
        raise ValueError(f"{arg} is on device {tensor.device} but the mesh is of device type "
                         f"{mesh.device_type!r}; move the tensor or build the mesh on its device")
