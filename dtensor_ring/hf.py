"""Context parallelism for a Hugging Face transformers causal LM: ``dtensor_ring.hf.apply``.

    from transformers import LlamaConfig, LlamaForCausalLM
    import dtensor_ring as dr
    import dtensor_ring.hf

    model = LlamaForCausalLM(LlamaConfig(..., attn_implementation="sdpa"))
    model = dtensor_ring.hf.apply(model, mesh["cp"], schedule="auto")
    loss = model(input_ids=ids, labels=labels).loss    # the FULL batch, the same on every rank
    loss.backward()
    dr.dtensor.sync_gradients(model, mesh["cp"])        # gradients of the whole sequence
    # for logging: the whole sequence's loss is the mean of ``loss`` over the cp ranks

Every rank passes the whole (global) batch, as without context parallelism. ``apply`` puts a
``ContextParallel`` style (``dtensor/style.py``) on the model, which shards the sequence inputs
(``input_ids``, ``inputs_embeds``, ``labels``, ``position_ids``) in the schedule's layout and fills
each rank's global ``position_ids`` (RoPE right), and switches the model's attention to the
``"dtensor_ring"`` implementation of transformers' ``AttentionInterface``, which runs
``dr.ring_attention`` (causal, the module's scale, GQA without repeating K/V heads). transformers
builds no mask for an implementation it has no mask function for, so no dense causal mask exists.

Labels: transformers shifts ``labels`` inside the model (``labels[..., 1:]``), which would cross
shard boundaries. Before sharding, ``apply``'s hook shifts them over the whole sequence and passes
them as ``shift_labels``, and passes ``num_items_in_batch`` = (the global count of labels that are
not -100, or the caller's ``num_items_in_batch``) / mesh size. Each rank's ``loss`` is then the sum
of its tokens' losses / that number: the mean of ``loss`` over the ranks is the loss of the whole
batch exactly, however the ignored labels fall, and averaging gradients over the ranks
(``sync_gradients``, or DDP/FSDP over data x context) gives the unsharded model's gradients.
Outputs (``logits``) hold this rank's tokens in the layout's order (``dr.unshard_sequence`` with
``dim=1`` and ``layout=dr.SCHEDULE_LAYOUT[schedule]`` gives the natural order back).

Packed batches (``DataCollatorWithFlattening``: one row, ``position_ids`` restarting at 0 at each
document): the style finds the documents in the position ids, or in the collator's
``cu_seq_lens_q``/``cu_seq_lens_k`` (``return_flash_attn_kwargs=True``, so ``model(**batch)`` works
as is; ``max_length_q``/``_k`` are dropped), and attention stays within each
(``dtensor/packed.py``); each document's length must be a multiple of the layout's
(``dr.pad_documents`` pads them). ``parallelize_module`` with the plain ``ContextParallel`` refuses
a transformers model and names this module: it would shift the labels inside each shard. The labels
are shifted over the whole row, as the model does on one device: the collator's -100 at each
document's first token keeps a document's last token from predicting the next document.

Sliding windows: transformers hands each attention call its layer's window (``sliding_window``,
the keyword its flash-attention path reads: Mistral's ``config.sliding_window`` on every layer,
Qwen2's and Gemma 2/3's on the layers ``config.layer_types`` marks "sliding_attention", None on
the others), and the ring runs it as ``window=(sliding_window - 1, 0)``: a query sees itself and
the ``sliding_window - 1`` tokens before it, as transformers' own masks do
(``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``), within each
packed document. Only the ranks within reach exchange K/V (``schedules/windowed.py``).

Refused with a ``ValueError`` naming the argument: a model that is not a transformers causal LM
with SDPA attention through ``AttentionInterface`` (``config._attn_implementation`` must be
``"sdpa"``), a mesh that is not a 1-D ``DeviceMesh``, an unknown schedule or precision; at call time
an ``attention_mask`` with zeros (padding: pack or use equal lengths; an all-ones mask is dropped),
a KV cache (``past_key_values``, ``use_cache=True``), ``logits_to_keep``, attention dropout in
training, non-causal attention, attention sinks (``s_aux``, GPT-OSS) and logit soft-capping
(``softcap``), which the ring does not compute, and (from ``dr``'s layouts) a sequence length or
document length the layout cannot split. Needs a
transformers whose causal-LM loss takes ``shift_labels`` (``pip install 'dtensor_ring[hf]'``).
"""
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module
from transformers import AttentionInterface, PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss

from .attention import ring_attention
from .documents import IGNORE_INDEX
from .dtensor.style import ContextParallel
from .loss import items_per_rank

NAME = "dtensor_ring"  # the attention implementation's name in transformers' registry
SETTINGS = "dtensor_ring_settings"  # the keyword that carries them down to the attention calls


class _Settings(NamedTuple):
    mesh: DeviceMesh
    schedule: str
    precision: str
    backend: str
    cu_seqlens: torch.Tensor | None  # packed documents (``dtensor/packed.py``)
    max_seqlen: int | None


def apply(model, mesh, schedule: str = "auto", precision: str = "fp32", backend: str = "auto"):
    """Make the transformers causal LM ``model`` train with context parallelism over ``mesh``
    (1-D, e.g. ``mesh["cp"]``), running attention as ``schedule``; returns ``model``.

    What changes (the module docstring above): a ``ContextParallel`` style shards the sequence
    inputs and fills ``position_ids``, labels are shifted over the whole sequence and the loss
    divided by the whole batch's count, and the model's attention runs ``dr.ring_attention``
    (causal, with each layer's sliding window). Every rank then calls the model with the whole
    batch.

    Args:
        model (transformers.PreTrainedModel): a causal LM (``loss_type`` "ForCausalLM", e.g.
            ``LlamaForCausalLM``) whose attention goes through transformers'
            ``AttentionInterface``, loaded with ``attn_implementation="sdpa"``.
        mesh (DeviceMesh): the sequence ranks, a 1-D ``DeviceMesh`` (e.g. ``mesh["cp"]``).
        schedule (str): ``"auto"`` (default), ``"ring"``, ``"zigzag"``, ``"stripe"`` or
            ``"llama3"``, as in ``dr.ring_attention``.
        precision (str): ``"fp32"`` (default) or ``"exact"``.
        backend (str): ``"auto"`` (default) or a kernel name, as in ``dr.ring_attention``.

    Returns:
        transformers.PreTrainedModel: ``model`` itself, hooked, with its attention
        implementation set to ``"dtensor_ring"``. Its outputs (``logits``) hold this rank's
        tokens in the layout's order; its ``loss`` is this rank's share (their mean over the
        ranks is the whole batch's loss).

    Raises:
        ValueError: ``model`` not a transformers causal LM, or its attention implementation not
            ``"sdpa"`` through ``AttentionInterface``; ``mesh`` not a 1-D ``DeviceMesh``; an
            unknown ``schedule`` or ``precision``. At each forward: the call-time refusals of the
            module docstring (a padding ``attention_mask``, a KV cache, ``logits_to_keep``,
            attention dropout, non-causal attention, attention sinks, soft-capping) and the
            errors of ``ContextParallel`` and ``dr.ring_attention``.
        TypeError: ``backend`` not a str.
    """
    _check_model(model)
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"mesh={mesh!r} must be a 1-D DeviceMesh (e.g. mesh['cp'] of a larger "
                         "one)")
    style = _CausalLMContextParallel(schedule, precision=precision, backend=backend)
    model = parallelize_module(model, mesh, style)
    model.set_attn_implementation(NAME)
    return model


def _check_model(model) -> None:
    causal_lm = isinstance(model, PreTrainedModel) and getattr(model, "loss_type", None) == (
        "ForCausalLM") and model.loss_function is ForCausalLMLoss
    if not causal_lm:
        raise ValueError(f"model must be a transformers causal LM (e.g. LlamaForCausalLM); got "
                         f"{type(model).__name__}")
    config = model.config
    if not model._supports_attention_backend or config._attn_implementation != "sdpa":
        raise ValueError(
            f"model.config._attn_implementation={config._attn_implementation!r} "
            f"({type(model).__name__}): valid is 'sdpa' in a model whose attention goes through "
            "transformers' AttentionInterface (load it with attn_implementation='sdpa')")


class _CausalLMContextParallel(ContextParallel):
    """``ContextParallel`` for a transformers causal LM: before sharding, check the call, shift the
    labels over the whole sequence and count them; after, add the attention settings."""

    _takes_transformers = True

    def _shard_inputs(self, names, args, kwargs, mesh, fill):
        named = dict(zip(names, args))
        named.update(kwargs)
        _check_call(named)
        named.pop("attention_mask", None)  # all ones: the same as none
        named["use_cache"] = False
        world = dist.get_world_size(mesh.get_group())
        num_items = _global_labels(named, world)
        _, named, packed = super()._shard_inputs(names, (), named, mesh, fill)
        if num_items is not None:
            named["num_items_in_batch"] = num_items
        named[SETTINGS] = _Settings(mesh, self.schedule, self.precision, self.backend,
                                    None if packed is None else packed.cu_seqlens,
                                    None if packed is None else packed.max_seqlen)
        return (), named, packed


def _check_call(named) -> None:
    mask = named.get("attention_mask")
    if mask is not None and (mask.dim() != 2 or not bool(mask.all())):
        raise ValueError(
            f"attention_mask of shape {tuple(mask.shape)} is not an all-ones 2-D mask (padding "
            "or a custom mask), which context parallelism does not support; valid: None or all "
            "ones (pack the sequences or use equal lengths)")
    if named.get("past_key_values") is not None or named.get("use_cache"):
        raise ValueError("past_key_values / use_cache=True (a KV cache for decoding) is not "
                         "supported with context parallelism; valid: None / False")
    if not isinstance(named.get("logits_to_keep", 0), int) or named.get("logits_to_keep", 0):
        raise ValueError(f"logits_to_keep={named['logits_to_keep']!r} is not supported with "
                         "context parallelism (each rank holds scattered tokens); valid: 0")


def _global_labels(named, world):
    """Shift ``labels`` over the whole sequence into ``shift_labels`` (unless the caller gave
    them) and return ``num_items_in_batch`` / ``world`` (None without labels)."""
    ignore = named.get("ignore_index", IGNORE_INDEX)
    labels = named.get("labels")
    if labels is not None and named.get("shift_labels") is None:
        named["shift_labels"] = F.pad(labels[..., 1:], (0, 1), value=ignore)
    shifted = named.get("shift_labels")
    if shifted is None:
        return None
    return items_per_rank(shifted, world, named.pop("num_items_in_batch", None), ignore)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               sliding_window=None, is_causal=None, **kwargs):
    """transformers' attention interface -> ``dr.ring_attention`` on this rank's tokens;
    returns (output [batch, seq, heads, head_dim], None)."""
    settings = kwargs.get(SETTINGS)
    if settings is None:
        raise ValueError(f"attention implementation {NAME!r} runs only in a model prepared by "
                         "dtensor_ring.hf.apply(model, mesh)")
    if attention_mask is not None:
        raise ValueError(f"attention_mask ({type(attention_mask).__name__}) reached the "
                         f"{NAME!r} attention; valid: None (causal attention only)")
    if dropout:
        raise ValueError(f"attention dropout={dropout} (config.attention_dropout, in training) "
                         "is not supported with context parallelism; valid: 0.0")
    for name in ("s_aux", "softcap"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} ({type(module).__name__}: attention sinks / logit "
                             "soft-capping) is not supported with context parallelism; "
                             "valid: None")
    window = _window(sliding_window)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if not causal:
        raise ValueError(f"is_causal={causal!r} ({type(module).__name__}): only causal "
                         "attention is supported; valid: True")
    out = ring_attention(query, key, value, mesh=settings.mesh, schedule=settings.schedule,
                         is_causal=True, scale=scaling, precision=settings.precision,
                         backend=settings.backend, cu_seqlens=settings.cu_seqlens,
                         max_seqlen=settings.max_seqlen, window=window)
    return out.transpose(1, 2).contiguous(), None


def _window(sliding_window):
    """transformers' ``sliding_window`` (tokens a query sees, itself included) as ``window``."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or (
            sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} (the model's config) must be None "
                         "or a positive int (the tokens a query sees, itself included)")
    return (sliding_window - 1, 0)


AttentionInterface.register(NAME, _attention)
