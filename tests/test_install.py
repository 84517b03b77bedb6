"""``dr.uninstall()`` gives the process back to stock PyTorch; ``dr.install()`` makes ours again.

The changes (``dtensor_ring/installation.py``): ``import dtensor_ring`` puts our handler in
DTensor's table for the SDPA ops and ``RingExpandPass`` in inductor's ``post_grad_custom_pre_pass``;
``ContextParallel`` sets ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``.

The body runs in a fresh process (one gloo rank, ``run_on_ranks``) that has not imported
dtensor_ring: this module imports it only inside the body, after recording what stock PyTorch does
and planting what another library and the user had set first (a handler for one SDPA op, a
post-grad pass of their own). After ``uninstall`` every one of those holds the very object it held
before the import, SDPA on sequence-sharded DTensors ends as it did before the import, and the
Dynamo flag has its earlier value (False, then True when the user had set it: not a default).
``_leftovers`` is what the checks compare; it is shown to name each change when that change alone
is left in place.
"""
import sys

import torch
import torch.nn.functional as F
from torch._dynamo import config as dynamo_config
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from dist_utils import run_on_ranks

FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"
aten = torch.ops.aten
CUDA_FLASH = aten._scaled_dot_product_flash_attention.default  # not what CPU SDPA calls


class _UsersPass(CustomGraphPass):
    def __call__(self, graph):
        pass

    def uuid(self):
        return "users-pass"


def _theirs(op, args, kwargs):
    """Another library's handler for one SDPA op (PyTorch's own context parallel installs such)."""
    raise AssertionError("not reached on CPU")


def _sdpa_ops():
    from dtensor_ring.dtensor.sdpa_ops import SDPA_OPS  # noqa: PLC0415 - imports dtensor_ring

    return list(SDPA_OPS)


def _state(ops) -> dict:
    handlers = DTensor._op_dispatcher._custom_op_handlers
    return {**{str(op): handlers.get(op) for op in ops},
            "post_grad_custom_pre_pass": inductor_config.post_grad_custom_pre_pass,
            FLAG: getattr(dynamo_config, FLAG)}


def _leftovers(before: dict, ops) -> list:
    """The entries of the global state that no longer hold the very object they held."""
    now = _state(ops)
    return sorted(name for name in before if now[name] is not before[name])


def _sdpa_outcome(mesh) -> str:
    """What SDPA on sequence-sharded (Shard(2)) DTensors does here: "ok" or the error."""
    q, k, v = (DTensor.from_local(torch.randn(1, 2, 8, 16), mesh, [Shard(2)], run_check=False)
               for _ in range(3))
    try:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as error:  # noqa: BLE001 - the outcome is what is compared
        return f"{type(error).__name__}: {error}"
    assert tuple(out.placements) == (Shard(2),)
    return "ok"


class _Attention(torch.nn.Module):
    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)


def _uninstall_restores_stock(mesh):
    assert "dtensor_ring" not in sys.modules, "the body needs a process without dtensor_ring"
    stock = _sdpa_outcome(mesh)
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers[CUDA_FLASH] = _theirs
    inductor_config.post_grad_custom_pre_pass = users_pass = _UsersPass()
    handlers_before, flag_before = dict(handlers), getattr(dynamo_config, FLAG)
    assert flag_before is False

    import dtensor_ring as dr  # noqa: PLC0415 - the point: after the state above was recorded
    from dtensor_ring import passes  # noqa: PLC0415
    from dtensor_ring.dtensor import handler, style  # noqa: PLC0415

    ops = _sdpa_ops()
    before = {**{str(op): handlers_before.get(op) for op in ops},
              "post_grad_custom_pre_pass": users_pass, FLAG: flag_before}
    assert before[str(CUDA_FLASH)] is _theirs

    def ours():
        assert handler.installed()
        slot = inductor_config.post_grad_custom_pre_pass
        assert isinstance(slot, passes.ComposedPass)
        assert isinstance(slot.passes[0], passes.RingExpandPass) and slot.passes[1] is users_pass
        assert _sdpa_outcome(mesh) == "ok"

    ours()
    parallelize_module(_Attention(), mesh, dr.ContextParallel(schedule="zigzag"))
    assert getattr(dynamo_config, FLAG) is True
    assert _leftovers(before, ops) == sorted([*map(str, ops), "post_grad_custom_pre_pass", FLAG])

    everything = dict.fromkeys(dr.installation.CHANGES, True)
    assert dr.uninstall() == everything
    assert _leftovers(before, ops) == []
    assert _sdpa_outcome(mesh) == stock  # DTensor's own rule (torch 2.13 has none for CPU SDPA)
    assert dr.uninstall() == dict.fromkeys(everything, False)

    assert dr.install() == everything  # the flag too: a ContextParallel was applied
    ours()
    assert getattr(dynamo_config, FLAG) is True

    # Each change alone left in place is named: the checks above would fail.
    for redo, names in ((handler.install, list(map(str, ops))),
                        (passes.install, ["post_grad_custom_pre_pass"]),
                        (style.set_checkpoint_flag, [FLAG])):
        dr.uninstall()
        assert redo()
        assert _leftovers(before, ops) == sorted(names), redo
    dr.uninstall()
    assert _leftovers(before, ops) == []

    # The flag's earlier value, not its default: set by the user before ContextParallel.
    setattr(dynamo_config, FLAG, True)
    dr.install()
    parallelize_module(_Attention(), mesh, dr.ContextParallel(schedule="zigzag"))
    dr.uninstall()
    assert getattr(dynamo_config, FLAG) is True

    # An empty slot stays empty.
    inductor_config.post_grad_custom_pre_pass = None
    dr.install()
    assert isinstance(inductor_config.post_grad_custom_pre_pass, passes.RingExpandPass)
    dr.uninstall()
    assert inductor_config.post_grad_custom_pre_pass is None


def test_uninstall_restores_stock_pytorch_and_install_restores_ours():
    run_on_ranks(1, _uninstall_restores_stock)
