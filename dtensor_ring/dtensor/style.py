"""``ContextParallel``: a ParallelStyle that runs a model's attention as ring attention over a mesh.

    model = parallelize_module(model, mesh["cp"], dr.ContextParallel(schedule="zigzag"))
    # or in a plan dict, next to tensor parallel on another mesh dimension:
    parallelize_module(model, mesh["tp"], tp_plan)
    parallelize_module(model, mesh["cp"], {"": dr.ContextParallel(schedule="llama3")})

Applied to a module, it

1. registers the schedule for the mesh dimension (``registry.py``), at apply time and before every
   forward;
2. before every forward, shards each sequence input -- every tensor argument, or the ones named
   in ``seq_inputs`` (token ids, position ids, labels, ...) -- along ``seq_dim`` in the schedule's
   layout (``dr.shard_sequence``); all must have the same length there, divisible as the layout
   needs; mask arguments (``attention_mask``, ``attn_mask``, ``mask`` tensors) are refused (not yet
   supported);
3. if the module's ``forward`` has a ``position_ids`` parameter and the caller gave none, passes the
   global positions of the rank's tokens (``dr.sequence_positions``), so RoPE is right with no user
   code. A model without such a parameter that derives positions from ``arange(seq_len)`` would see
   local positions: give it a ``position_ids`` parameter (a warning says so at apply time);
4. while the module runs, sends ``F.scaled_dot_product_attention`` on plain (local) tensors to
   ``ring_attention`` on the mesh (SDPA on sequence-sharded DTensors still goes through the SDPA
   rule); tensor-parallel heads stay local to the TP rank and pass through;
5. routes the SDPA of its submodules the same way when they run outside its forward -- activation
   checkpointing's recompute in the backward (``torch.utils.checkpoint``, reentrant or not,
   ``checkpoint_wrapper``, selective checkpointing) -- and inside checkpointed regions under
   ``torch.compile`` (``_route_submodule``, ``_checkpoint_routed``).

On a 2-D mesh (ring, all-to-all), e.g. ``mesh["cp_ring", "cp_a2a"]``, the schedule runs over the
first dimension on head groups gathered by an all-to-all over the second (``dtensor_ring/hybrid/``)
and the inputs are sharded in that hybrid layout.

Packed documents (``packed.py``): given ``cu_seqlens`` (a keyword the module's forward need not
have) or ``position_ids`` that do not count up by one from one token to the next at each
document's start (Hugging Face's rule), the style shards every sequence input in the layout's
per-document form, gives the module the positions within each document (unless it was given
``position_ids``), and its SDPA attends within documents. ``documents=False`` takes
``position_ids`` as they are and never looks for documents.

Outputs stay local (this rank's tokens, in the layout's order). The loss (``loss.py``): if the
module's forward takes ``num_items_in_batch`` and the call passes ``labels``, the style passes
(the count of ``labels`` that are not -100 over the whole batch, or the caller's
``num_items_in_batch``) / W, so a loss that divides its sum by it has the batch's mean as its mean
over the ranks whatever the -100 labels' spread; parameter gradients must be averaged over the
mesh dimension like a data-parallel one (``sync_gradients``, or FSDP/DDP over the combined data x
context mesh). Labels must already be aligned with the inputs (shifted by the caller), since a
shift inside the model would cross shard boundaries. A transformers model is refused: it shifts
its labels inside, and ``dtensor_ring.hf.apply`` handles it.
"""
import functools
import inspect
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._dynamo import config as dynamo_config
from torch._higher_order_ops.wrap import tag_activation_checkpoint, wrap_activation_checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.overrides import TorchFunctionMode

from ..attention import ring_attention
from ..comm.mesh import resolve_mesh
from ..hybrid.layout import placed_layout
from ..layouts import get_layout
from ..layouts.windows import check_window
from ..loss import items_per_rank
from ..schedules import get_schedule
from ..sharding import sequence_positions, shard_sequence
from ..validation import check_int
from .packed import find_documents
from .placements import SEQ
from .registry import set_sequence_schedule

MASK_ARGS = ("attention_mask", "attn_mask", "mask")
# Packed documents' boundaries, by the names callers give them: flash-attn's, and the keywords of
# Hugging Face's DataCollatorWithFlattening(return_flash_attn_kwargs=True) with the longest
# document's length (the style finds that itself). Given to the module only if it names them.
BOUNDARY_ARGS = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")
LENGTH_ARGS = ("max_length_q", "max_length_k")
# Tensor arguments that describe the batch rather than hold one value per token: never sharded.
NOT_SEQUENCES = (*BOUNDARY_ARGS, "num_items_in_batch")


class _SequenceSdpa(TorchFunctionMode):
    """Inside a context-parallel module: SDPA on local tensors (this rank's tokens) -> the ring.

    Local tensors go straight to ``ring_attention`` (one custom-op node under torch.compile, GQA
    without repeating heads on every backend); DTensors sharded on the sequence go through SDPA
    and so through the DTensor rule.
    """

    def __init__(self, mesh: DeviceMesh, style: "ContextParallel", packed=None, owner=None):
        super().__init__()
        self.mesh, self.style, self.packed = mesh, style, packed
        self.owner = owner  # the submodule whose hooks entered it (_route_submodule); None: root

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        if func in _CHECKPOINT_HOPS:
            return _checkpoint_routed(self, func, *args, **kwargs)
        return func(*args, **kwargs)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        if attn_mask is not None:
            raise ValueError(
                "attn_mask is not supported inside a ContextParallel module (got a "
                f"{type(attn_mask).__name__}); use is_causal=True or no mask")
        qkv = (query, key, value)
        if any(isinstance(x, DTensor) for x in qkv):
            if all(isinstance(x, DTensor) for x in qkv) and any(
                    isinstance(p, Shard) and p.dim % 4 == SEQ for p in query.placements):
                return F.scaled_dot_product_attention(*qkv, None, dropout_p, is_causal, scale,
                                                      enable_gqa=enable_gqa)
            raise ValueError(
                "inside a ContextParallel module, SDPA inputs must be local tensors (this "
                "rank's tokens) or DTensors sharded on the sequence (Shard(2)); got query "
                f"{type(query).__name__} with placements {getattr(query, 'placements', None)}")
        packed = self.packed
        return ring_attention(query, key, value, mesh=self.mesh, schedule=self.style.schedule,
                              is_causal=is_causal, scale=scale, precision=self.style.precision,
                              backend=self.style.backend, dropout_p=dropout_p,
                              cu_seqlens=None if packed is None else packed.cu_seqlens,
                              max_seqlen=None if packed is None else packed.max_seqlen,
                              window=self.style.window)


# torch.utils.checkpoint as Dynamo traces it: a higher-order op whose first argument is the body.
_CHECKPOINT_HOPS = (tag_activation_checkpoint, wrap_activation_checkpoint)


def _checkpoint_routed(mode: _SequenceSdpa, hop, body, *args, **kwargs):
    """A checkpointed region under ``torch.compile``, with the body's SDPA still routed.

    Dynamo turns ``torch.utils.checkpoint.checkpoint`` into a higher-order op, which reaches the
    mode like any function. A mode's handler runs with the mode popped, so calling the op from
    here traced its body without the routing: its SDPA ran locally, a silent wrong result (seen on
    torch 2.13: the loss of local attention, no ring node in the graph). The body re-enters the
    mode itself. Dynamo counts that enter/exit as a side effect in a checkpointed region and
    refuses it unless ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` is
    set, which ``ContextParallel`` sets when it is applied
    (``_allow_routing_in_compiled_checkpoint``).
    """
    return hop(functools.partial(_run_in_mode, mode, body), *args, **kwargs)


def _run_in_mode(mode, body, *args, **kwargs):
    with mode:
        return body(*args, **kwargs)


def _allow_routing_in_compiled_checkpoint() -> None:
    """Let ``_checkpoint_routed`` enter the routing inside a compiled checkpointed region.

    Dynamo refuses any side effect there -- the mode's enter and exit included -- unless
    ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` is set; the enter and
    exit cancel, so there is nothing to replay in the backward. The flag is read while Dynamo
    traces, and ``ContextParallel``'s hooks are traced too, so it is set here, when the style is
    applied, for the process (as torchtitan does whenever it compiles). Its documented trade-off
    then holds for the user's own code as well: a side effect inside a checkpointed, compiled
    region (appending to a list, say) runs in the forward and is not replayed in the backward's
    recompute, where without the flag Dynamo would refuse to compile it. On a torch without the
    flag, compiling a checkpointed region of a ``ContextParallel`` module fails with Dynamo's
    "HOP: Unsafe side effect" error instead of running its attention locally.
    """
    _CHECKPOINT_FLAG_STATE["applied"] = True
    set_checkpoint_flag()


_CHECKPOINT_FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"
# applied: a ContextParallel was applied in this process (its modules may need the flag);
# before: the flag's value before we set it, while it is set by us.
_CHECKPOINT_FLAG_STATE: dict = {"applied": False}


def set_checkpoint_flag() -> bool:
    """Set Dynamo's flag (``_allow_routing_in_compiled_checkpoint``), keeping the value it had for
    ``restore_checkpoint_flag``. Returns whether the flag changed (False on a torch without it)."""
    if not hasattr(dynamo_config, _CHECKPOINT_FLAG):
        return False
    was = getattr(dynamo_config, _CHECKPOINT_FLAG)
    _CHECKPOINT_FLAG_STATE.setdefault("before", was)
    setattr(dynamo_config, _CHECKPOINT_FLAG, True)
    return was is not True


def restore_checkpoint_flag() -> bool:
    """Give Dynamo's flag back the value it had before ``set_checkpoint_flag``, unless it has been
    set to something else since. Returns whether the flag changed."""
    if "before" not in _CHECKPOINT_FLAG_STATE:
        return False
    before = _CHECKPOINT_FLAG_STATE.pop("before")
    if getattr(dynamo_config, _CHECKPOINT_FLAG) is not True or before is True:
        return False
    setattr(dynamo_config, _CHECKPOINT_FLAG, before)
    return True


def checkpoint_flag_needed() -> bool:
    """Whether a ``ContextParallel`` has been applied in this process (so ``install`` sets the flag
    again)."""
    return _CHECKPOINT_FLAG_STATE["applied"]


def _routing_active() -> bool:
    at, depth = torch._C._get_function_stack_at, torch._C._len_torch_function_stack()
    return any(isinstance(at(i), _SequenceSdpa) for i in range(depth))


def _top_mode():
    depth = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(depth - 1) if depth else None


# torch.nn's own modules that can call SDPA (MultiheadAttention and the Transformer layers run
# it) or that run other modules (Sequential); its others (Linear, norms, embeddings, ...) never do.
_TORCH_MODULES_TO_ROUTE = (nn.Sequential, nn.MultiheadAttention, nn.TransformerEncoderLayer,
                           nn.TransformerDecoderLayer, nn.TransformerEncoder,
                           nn.TransformerDecoder, nn.Transformer)


def _may_run_sdpa(module: nn.Module) -> bool:
    """Whether ``module``'s forward can reach SDPA: any module of the user's (or a library's
    other than torch), and the few of torch's that can."""
    return (not type(module).__module__.startswith("torch.")
            or isinstance(module, _TORCH_MODULES_TO_ROUTE))


def _refuse_transformers(module: nn.Module) -> None:
    """A Hugging Face transformers model needs ``dtensor_ring.hf.apply``: plain ``ContextParallel``
    would let it shift its labels inside each rank's shard and average per-rank means. Such a
    model is an instance of transformers' ``PreTrainedModel``, so transformers' modeling module
    is loaded whenever one exists: it is looked up, never imported."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return
    found = next((m for m in module.modules() if isinstance(m, modeling.PreTrainedModel)), None)
    if found is not None:
        what = ("is a Hugging Face transformers model" if found is module else
                f"holds a Hugging Face transformers model ({type(found).__name__})")
        raise ValueError(
            f"{type(module).__name__} {what}, which plain "
            "ContextParallel would train wrongly (labels shifted inside each rank's shard, the "
            "ranks' losses weighted by their own label counts); use "
            "dtensor_ring.hf.apply(model, mesh, schedule=...) on the transformers causal LM "
            "instead of parallelize_module(model, mesh, ContextParallel(...))")


class ContextParallel(ParallelStyle):
    """Shard a module's sequence inputs in ``schedule``'s layout and run its SDPA as that schedule.

    ``schedule``: one of ``dr.SCHEDULES``; ``seq_dim``: the sequence dim of the module's inputs
    (1 for [batch, seq] token ids); ``precision``/``backend``: as in ``dr.ring_attention``;
    ``seq_inputs``: names of the arguments to shard (default: every tensor argument);
    ``position_ids``: the name of the forward parameter to fill with global positions (None: never);
    ``documents``: look for packed documents (``cu_seqlens`` or jumps in ``position_ids``);
    ``window``: a sliding window for every SDPA the module runs, as in ``dr.ring_attention``
    (``(w - 1, 0)`` for a Mistral-style window of w tokens; per-layer windows: ``dtensor_ring.hf``
    takes them from the model's config, or call ``dr.ring_attention`` with ``window=``).

    Use: ``parallelize_module(module, mesh, dr.ContextParallel(...))``, or as the style of a plan
    entry. What it does to the module, its inputs and outputs: the module docstring above. Every
    rank of the mesh calls the module with the whole (global) batch.

    Args:
        schedule (str): ``"zigzag"`` (default), ``"ring"``, ``"stripe"``, ``"llama3"`` (keys of
            ``dr.SCHEDULES``) or ``"auto"``; the inputs are sharded in
            ``dr.SCHEDULE_LAYOUT[schedule]``.
        seq_dim (int): keyword-only, as are all that follow: the sequence dim of the module's
            sequence inputs, >= 0. Default 1 ([batch, seq] token ids).
        precision (str): ``"fp32"`` (default) or ``"exact"``, as in ``dr.ring_attention``.
        backend (str): ``"auto"`` (default) or a kernel name, as in ``dr.ring_attention``.
        seq_inputs (Sequence[str] | None): the names of the forward's arguments to shard; each
            must be passed on every call. None (default): every tensor argument but the
            documents' boundaries and ``num_items_in_batch``.
        position_ids (str | None): the forward parameter to fill with this rank's positions
            when the call gives none. Default ``"position_ids"``; None: never fill (and do not
            look for documents in positions).
        documents (bool): look for packed documents, in ``cu_seqlens`` (or ``cu_seq_lens_q`` /
            ``cu_seq_lens_k``) and in ``position_ids`` that restart. Default True.
        window (tuple[int, int] | None): a sliding window ``(left, right)`` for every SDPA the
            module runs, two ints >= -1 (-1: unbounded), as in ``dr.ring_attention``; 1-D
            meshes only. None (default): no window.

    Returns:
        ContextParallel: the style. ``parallelize_module(module, mesh, style)`` returns
        ``module`` itself, hooked; the mesh must be a 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]``)
        or a 2-D one (ring ranks, all-to-all ranks). The module's outputs hold this rank's
        tokens in the layout's order (``dr.unshard_sequence`` gathers them).

    Raises:
        ValueError: here: an unknown ``schedule``; ``seq_dim`` not a non-negative int; a
            malformed ``window``. At ``parallelize_module``: a mesh that is not a 1-D or 2-D
            ``DeviceMesh``; a ``window`` with a 2-D mesh; an unknown ``precision``; a
            transformers model (use ``dtensor_ring.hf.apply``). At each forward: a mask
            argument (``attention_mask``, ``attn_mask``, ``mask``) given as a tensor; a name
            of ``seq_inputs`` the call did not pass; a sequence input without ``seq_dim`` or of
            another length than the others, or of a length the layout cannot split; boundaries
            given with ``documents=False``; and the errors of ``dr.ring_attention``.
        TypeError: here: ``seq_inputs`` not None or a sequence of names; ``documents`` not a
            bool. At ``parallelize_module``: ``backend`` not a str.
    """

    _takes_transformers = False  # dtensor_ring.hf.apply's subclass takes transformers models

    def __init__(self, schedule: str = "zigzag", *, seq_dim: int = 1, precision: str = "fp32",
                 backend: str = "auto", seq_inputs=None, position_ids: str | None = "position_ids",
                 documents: bool = True, window=None):
        super().__init__()
        self.window = check_window(window)
        self.layout = get_layout(get_schedule(schedule).layout.name)
        check_int(seq_dim, "seq_dim", 0, "a non-negative int (the sequence dim of the module's "
                  "inputs, e.g. 1 for [batch, seq])")
        if seq_inputs is not None and (isinstance(seq_inputs, str) or not all(
                isinstance(n, str) for n in seq_inputs)):
            raise TypeError(f"seq_inputs must be None or a sequence of argument names; got "
                            f"{seq_inputs!r}")
        self.schedule, self.seq_dim = schedule, seq_dim
        self.precision, self.backend = precision, backend
        self.seq_inputs = None if seq_inputs is None else tuple(seq_inputs)
        self.position_ids = position_ids
        if not isinstance(documents, bool):
            raise TypeError(f"documents must be a bool; got {documents!r}")
        self.documents = documents
        self._packed = None  # the packed documents of the last forward (packed.py)

    def _register(self, mesh):
        # On a 2-D mesh (ring, all-to-all) the schedule is the ring dimension's (hybrid/).
        if self.window is not None and mesh.ndim == 2:
            raise ValueError(f"window={tuple(self.window)} with a 2-D mesh of shape "
                             f"{tuple(mesh.shape)}: sliding windows run on a 1-D mesh (the "
                             "hybrid schedule takes none)")
        set_sequence_schedule(mesh, self.schedule, mesh_dim=0 if mesh.ndim == 2 else None,
                              precision=self.precision, backend=self.backend, window=self.window)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim not in (1, 2):
            raise ValueError(
                f"ContextParallel needs the 1-D sequence mesh (e.g. mesh['cp']) or a 2-D one "
                f"(ring, all-to-all: mesh['cp_ring', 'cp_a2a']); got {device_mesh!r}")
        if not self._takes_transformers:
            _refuse_transformers(module)
        self._register(device_mesh)
        resolve_mesh(device_mesh)  # a 2-D mesh's groups are found here, eagerly (comm/mesh.py)
        params = inspect.signature(module.forward).parameters
        fill = self.position_ids is not None and self.position_ids in params
        if self.position_ids is not None and not fill:
            warnings.warn(
                f"{type(module).__name__}.forward has no {self.position_ids!r} parameter, so "
                "ContextParallel cannot give it global positions; a model that derives positions "
                "from arange(seq_len) (RoPE) would be wrong", stacklevel=3)
        modes = []

        def enter(args, kwargs):
            self._register(device_mesh)
            args, kwargs, packed = self._shard_inputs(list(params), args, kwargs, device_mesh,
                                                      fill)
            self._packed = packed  # for the submodules' recompute (_route_submodule)
            mode = _SequenceSdpa(device_mesh, self, packed)
            mode.__enter__()
            modes.append(mode)
            return args, kwargs

        # Packed documents are found by reading the batch (packed.py): that part runs outside
        # torch.compile's graph, whole (one graph break before the forward, which is traced
        # under the mode as usual); a batch without them stays in the graph.
        enter_packed = torch.compiler.disable(enter)

        def pre_hook(mod, args, kwargs):
            if self._may_hold_documents(params, args, kwargs):
                return enter_packed(args, kwargs)
            return enter(args, kwargs)

        def post_hook(mod, args, kwargs, output):
            if modes:
                modes.pop().__exit__(None, None, None)
            return output

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook, with_kwargs=True, always_call=True)
        for submodule in module.modules():
            if submodule is not module and _may_run_sdpa(submodule):
                self._route_submodule(submodule, device_mesh)
        _allow_routing_in_compiled_checkpoint()
        return module

    def _may_hold_documents(self, params, args, kwargs) -> bool:
        """Whether this call passes what packed documents are found in (``packed.py``)."""
        if not self.documents:
            return False
        named = dict(zip(params, args))
        named.update(kwargs)
        return (any(named.get(n) is not None for n in BOUNDARY_ARGS)
                or isinstance(named.get(self.position_ids), torch.Tensor))

    def _route_submodule(self, module: nn.Module, mesh: DeviceMesh) -> None:
        """Route ``module``'s SDPA to the ring whenever it runs with no routing active.

        The routing is a function mode entered by the pre-hook of the module this style was
        applied to and left by its post-hook, so it covers that module's forward only. Activation
        checkpointing runs a checkpointed submodule's forward again during the backward, after the
        post-hook: without these hooks that recompute ran plain local SDPA, which saves tensors of
        other shapes (``torch.utils.checkpoint``'s "Recomputed values ... have different metadata"
        error) or, with ``use_reentrant=True``, silently gave the gradients of local attention.
        Hooking the submodules (rather than recording the routing in checkpoint's context) covers
        every form of checkpointing that calls a module: ``checkpoint(block, ...)``,
        ``checkpoint_wrapper``, reentrant or not, with any ``context_fn``, and a compiled block
        checkpointed eagerly (``checkpoint(torch.compile(block), ...)``: Dynamo traces the hooks
        and guards on the mode they enter). A checkpointed plain function that calls SDPA itself,
        outside any submodule, is not covered; nor are modules added after the style is applied.

        Inside the model's forward the routing is active and the hooks do nothing. A submodule
        called on its own (outside the model's forward) runs its SDPA as the ring too: its inputs
        are this rank's tokens, like the model's. Only modules that can reach SDPA are hooked
        (``_may_run_sdpa``: not torch.nn's Linear, norms, embeddings ...); the two hooks cost a
        little host time per call of a hooked module in eager mode (docs/design.md,
        "Measurements behind design choices") and nothing compiled. While the routing is active
        the hooks mutate nothing, so Dynamo traces them inside checkpointed regions; the mode
        they enter remembers its owner (which hook leaves it) and is kept in ``entered``
        (Dynamo, compiling a hook as a frame of its own, can only rebuild a mode left on the
        stack from a place that holds it).
        """
        entered = []

        def pre_hook(mod, args):
            if not _routing_active():  # the documents of the last forward (a recompute's)
                mode = _SequenceSdpa(mesh, self, packed=self._packed, owner=mod)
                mode.__enter__()
                entered.append(mode)

        def post_hook(mod, args, output):
            top = _top_mode()
            if isinstance(top, _SequenceSdpa) and top.owner is mod:
                top.__exit__(None, None, None)
                entered.pop()

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook, always_call=True)

    def _shard_inputs(self, names, args, kwargs, mesh, fill):
        named = dict(zip(names, args))
        named.update(kwargs)
        cu_arg, cu_seqlens = _boundaries(named, names)
        for name in MASK_ARGS:
            if isinstance(named.get(name), torch.Tensor):
                raise ValueError(f"{name} is not supported with ContextParallel yet (got a tensor "
                                 f"of shape {tuple(named[name].shape)}); pass None / omit it")
        chosen = [n for n, x in named.items() if isinstance(x, torch.Tensor)
                  and n not in NOT_SEQUENCES and (self.seq_inputs is None or n in self.seq_inputs)]
        if self.seq_inputs is not None:
            missing = [n for n in self.seq_inputs if n not in named]
            if missing:
                raise ValueError(f"seq_inputs names {missing}, which the call did not pass; "
                                 f"arguments passed: {sorted(named)}")
        seq_mesh = resolve_mesh(mesh)
        layout = placed_layout(self.layout, *seq_mesh.shape)  # itself on a 1-D mesh
        if "num_items_in_batch" in names and isinstance(named.get("labels"), torch.Tensor):
            # the whole batch's count, before sharding: each rank's loss sum / it is the
            # batch's mean once averaged over the ranks (loss.py)
            named["num_items_in_batch"] = items_per_rank(
                named["labels"], seq_mesh.world_size, named.get("num_items_in_batch"))
        seq_len = lead = None
        for n in chosen:
            x = named[n]
            if x.dim() <= self.seq_dim:
                raise ValueError(
                    f"input {n!r} of shape {tuple(x.shape)} has no dim seq_dim={self.seq_dim}; "
                    "name the sequence inputs with seq_inputs=(...)")
            if seq_len is None:
                seq_len, lead = x.shape[self.seq_dim], tuple(x.shape[:self.seq_dim])
                layout.check_global_len(seq_len, seq_mesh.world_size,
                                        f"{n}.shape[{self.seq_dim}]")
            elif x.shape[self.seq_dim] != seq_len:
                raise ValueError(
                    f"input {n!r} has length {x.shape[self.seq_dim]} on seq_dim={self.seq_dim} "
                    f"but {chosen[0]!r} has {seq_len}; all sequence inputs must match")
        packed = None
        if seq_len is not None and self.documents and (
                cu_seqlens is not None or named.get(self.position_ids) is not None):
            packed = find_documents(cu_seqlens, named.get(self.position_ids), self.seq_dim,
                                    seq_len, layout, seq_mesh.rank, seq_mesh.world_size,
                                    named[chosen[0]].device, cu_arg=cu_arg,
                                    positions_arg=self.position_ids)
        elif cu_seqlens is not None:
            raise ValueError(f"{cu_arg} was passed to a ContextParallel module built with "
                             "documents=False (or with no sequence inputs to shard)")
        for n in chosen:
            named[n] = (shard_sequence(named[n], mesh, dim=self.seq_dim, layout=self.layout.name)
                        if packed is None else named[n].index_select(self.seq_dim, packed.index))
        if fill and named.get(self.position_ids) is None and seq_len is not None:
            device = named[chosen[0]].device
            positions = (sequence_positions(seq_len, mesh, layout=self.layout.name, device=device)
                         if packed is None else packed.positions)
            named[self.position_ids] = positions.expand(*lead, positions.shape[0])
        positional = tuple(named.pop(n) for n in names[:len(args)])
        return positional, named, packed


def _boundaries(named, names):
    """(the argument that gives the documents' boundaries, its value), or (None, None). They
    describe the batch for the style; the module gets them only if its forward names them."""
    given = {}
    for n in (*BOUNDARY_ARGS, *LENGTH_ARGS):
        value = named.get(n) if n in names else named.pop(n, None)
        if value is not None:
            given[n] = value
    boundaries = [n for n in BOUNDARY_ARGS if n in given]
    if not boundaries:
        return None, None
    first = boundaries[0]
    for other in boundaries[1:]:
        if not torch.equal(torch.as_tensor(given[other]).cpu().long(),
                           torch.as_tensor(given[first]).cpu().long()):
            raise ValueError(
                f"{other} differs from {first} ({_listed(given[other])} vs "
                f"{_listed(given[first])}); context parallelism runs self-attention over one set "
                "of documents: pass the same boundaries, or only one of them")
    return first, given[first]


def _listed(x):
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


BUCKET_MB = 25  # sync_gradients' default bucket size (DDP's default too)


@torch.no_grad()
def sync_gradients(module: nn.Module, mesh: DeviceMesh, *, bucket_mb: float = BUCKET_MB) -> None:
    """Average every parameter gradient over ``mesh`` (the context-parallel dimension), in fp32.

    Each rank's gradient comes from its own tokens only; with equal token counts the full-sequence
    gradient is the mean over the ranks. DTensor parameters (e.g. tensor parallel on another mesh
    dimension) are averaged shard by shard. The gradients travel in fp32 buckets of about
    ``bucket_mb`` MiB, one all-reduce per bucket (a gradient larger than that is a bucket of its
    own), in parameter order.

    For training, prefer FSDP2 (``fully_shard``) or DDP over the data x context ranks, which
    average the gradients over both at once and overlap that with the backward (see the guide);
    this function is for a model with context parallelism only, or for checking. A 2-D context-
    parallel mesh (ring, all-to-all) is averaged over both dimensions, one after the other.
    """
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb!r} must be a positive number (MiB per bucket)")
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    world = mesh.size()
    limit = int(bucket_mb * 2 ** 20) // 4  # fp32 elements
    buckets, filling = [], {}  # filling: device -> (its open bucket, its element count)
    for param in module.parameters():
        if param.grad is None:
            continue
        grad = param.grad._local_tensor if isinstance(param.grad, DTensor) else param.grad
        bucket, size = filling.get(grad.device, (None, 0))
        if bucket is None or size + grad.numel() > limit:
            bucket, size = [], 0
            buckets.append(bucket)
        bucket.append(grad)
        filling[grad.device] = (bucket, size + grad.numel())
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1).float() for g in bucket])
        for group in groups:
            dist.all_reduce(flat, group=group)
        flat /= world
        for grad, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            grad.copy_(part.view_as(grad))
