"""What dtensor_ring changes for the whole process, and the way back: ``install`` / ``uninstall``.

``import dtensor_ring`` makes two changes, so that a model needs no more code than
``parallelize_module`` and ``torch.compile``:

* DTensor's table of custom op handlers (``DTensor._op_dispatcher._custom_op_handlers``) gets
  ``sdpa_handler`` for the SDPA aten ops (``dtensor/handler.py``): SDPA on sequence-sharded DTensors
  runs the ring;
* inductor's ``post_grad_custom_pre_pass`` gets ``RingExpandPass``, in front of a pass already set
  (``passes/install.py``): compiled ring attention is expanded into its steps.

Applying a ``ContextParallel`` makes a third (``dtensor/style.py``,
``_allow_routing_in_compiled_checkpoint``):

* ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True``.

``uninstall`` gives each back what it held before (another library's handler or pass, the flag's
earlier value); ``install`` makes them again. Not undone, because stock PyTorch never reaches them:
what is defined in dtensor_ring's own names (the custom ops ``torch.ops.dtensor_ring.*`` and their
``FlopCounterMode`` formulas; with ``dtensor_ring.hf``, the "dtensor_ring" entry of transformers'
``AttentionInterface``), and the hooks ``ContextParallel`` put on the modules it was applied to
(their SDPA on local tensors still calls ``ring_attention``).
"""
from . import passes
from .dtensor import handler, style

CHANGES = ("dtensor_sdpa_handler", "inductor_post_grad_pass", "dynamo_checkpoint_flag")


def install() -> dict:
    """Make dtensor_ring's process-wide changes (``import dtensor_ring`` does; after ``uninstall``,
    this puts them back). Idempotent.

    Args:
        none.

    Returns:
        dict: for each change in ``CHANGES`` ("dtensor_sdpa_handler": the DTensor SDPA rule,
        "inductor_post_grad_pass": the compile pass, "dynamo_checkpoint_flag": Dynamo's
        ``skip_fwd_side_effects_in_bwd_under_checkpoint``, set again only if a ``ContextParallel``
        has been applied in this process), whether this call made it (False: already in place,
        or not needed).
    """
    return {"dtensor_sdpa_handler": handler.install(),
            "inductor_post_grad_pass": passes.install(),
            "dynamo_checkpoint_flag": (style.checkpoint_flag_needed()
                                       and style.set_checkpoint_flag())}


def uninstall() -> dict:
    """Undo dtensor_ring's process-wide changes: the process then runs as stock PyTorch.

    Each gets back the value it held before dtensor_ring changed it, not a default: an SDPA op
    the handler of another library (PyTorch's own context parallel, say) or none, so that
    DTensor's own sharding rule runs SDPA; inductor's ``post_grad_custom_pre_pass`` the pass
    that was set, or None; Dynamo's flag its earlier value. A change someone else has overridden
    since (another handler, a pass set without ours, the flag set to False) is left as it is.
    Modules a ``ContextParallel`` was applied to keep their hooks (their SDPA on local tensors
    still calls ``ring_attention``). ``install()`` puts everything back.

    Args:
        none.

    Returns:
        dict: for each change in ``CHANGES`` (see ``install``), whether this call undid it
        (False: it was not in place).
    """
    return {"dtensor_sdpa_handler": handler.uninstall(),
            "inductor_post_grad_pass": passes.uninstall(),
            "dynamo_checkpoint_flag": style.restore_checkpoint_flag()}
