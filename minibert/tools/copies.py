"""The fast path's weight copies (fused QKV, prepacked oneDNN weights), kept beside a model, never in it:
built on first use (``copies_of``), checked for staleness on every call against what they were made from,
freed with the model or on demand (``release``); ``cached_bytes`` says what they hold."""

from __future__ import annotations

import weakref
from operator import is_not

import torch

from ..hardware import warn_if_slow
from ..hookpoints import GLOBAL_FORWARD_HOOKS, GLOBAL_FORWARD_PRE_HOOKS
from ..model import BertModel
from ..quantize import Int8Linear
from . import kernels
from .blocks import FusedBlock, PackedInt8Linear
from .plan import BUCKETS, PRODUCTS, block_plans, bucket_of

_DATA_PTR = torch.Tensor.data_ptr


class Copies:
    """The fused/packed blocks of one model, and what they were made from (to notice edits)."""

    def __init__(self, model: BertModel, fp32_kernel: str):
        # what the copies were made from, kept as parallel lists that ``stale`` compares with C-level maps
        # (no Python loop per entry: ~45 us a call for MiniLM on the Zen 4, where a generator took ~73 us):
        # every module's and parameter's (dict, key) -> object, the sizes of those dicts, and each parameter's
        # data pointer and version counter. The encoder's weights are copied (fused, packed): an in-place edit
        # makes the copies stale too. The embeddings and pooler are read where they are, so only a replaced or
        # moved one counts there (what a CUDA graph of this forward, ``GraphCache``, also needs: it reads their
        # memory as it was captured)
        live = [m for m in (model.embeddings, model.pooler) if m is not None]
        parts = [(model._modules, k, v) for k, v in model._modules.items()]
        self.sized = []  # the dicts whose sizes count (a module or parameter added)
        for module in [*model.encoder.modules(), *(m for top in live for m in top.modules())]:
            parts += [(module.__dict__, "_modules", module._modules),
                      (module.__dict__, "_parameters", module._parameters)]
            parts += [(module._modules, k, v) for k, v in module._modules.items()]
            parts += [(module._parameters, k, v) for k, v in module._parameters.items()]
            self.sized += [module._modules, module._parameters]
        self.dicts, self.keys, self.values = (list(column) for column in zip(*parts))
        self.sizes = list(map(len, self.sized))
        params = [*model.encoder.parameters(), *(p for top in live for p in top.parameters())]
        self.params, self.pointers = params, [p.data_ptr() for p in params]
        self.versioned = [p for p in model.encoder.parameters() if version_of(p) is not None]  # live ones: none
        self.versions = [p._version for p in self.versioned]
        # torch's hook dicts of every module (filled and emptied in place): a torch hook anywhere sends a
        # call to the readable path, where it fires (captum's layer methods, say)
        self.hook_dicts = [d for module in model.modules()
                           for d in (module._forward_hooks, module._forward_pre_hooks)]
        # attention's key/value slots (prefix-tuning fills them): a filled one also sends a call there
        self.kv_slots = [b.attn.kv for b in model.encoder.blocks]
        self.threads = torch.get_num_threads()  # the summation blocks found hold for this thread count
        plans = dict.fromkeys(BUCKETS, dict.fromkeys(PRODUCTS, fp32_kernel))
        if (fp32_kernel == "auto" and kernels.MKLDNN and model.device.type == "cpu" and model.dtype == torch.float32
                and not isinstance(model.encoder.blocks[0].attn.query, Int8Linear)):
            plans = block_plans(model.config)  # decided on whole blocks, per row bucket, not product by product
        made: list[tuple[dict, list]] = []  # one set of fused blocks per distinct plan
        self.by_bucket = {}
        with torch.inference_mode():
            for bucket, plan in plans.items():
                blocks = next((b for p, b in made if p == plan), None)
                if blocks is None:
                    blocks = [FusedBlock(b, model.config.hidden_act, plan) for b in model.encoder.blocks]
                    made.append((plan, blocks))
                self.by_bucket[bucket] = blocks
        self.blocks = self.by_bucket["batch"]  # what a batch runs (Stepper, routes, the byte count)

    def blocks_for(self, rows: int) -> list:
        """The fused blocks a forward of ``rows`` real tokens runs: its row bucket's plan (``plan.bucket_of``)."""
        return self.by_bucket[bucket_of(rows)]

    def stale(self, model: BertModel) -> bool:
        """A module or parameter replaced or added, an in-place edit (version counter), ``.to()`` (data
        pointer), another torch thread count: each makes the copies stale. Checked against what was
        recorded, without walking the module tree (~45 us for MiniLM, against ~450 us for one BERT-base walk)."""
        return (torch.get_num_threads() != self.threads
                or any(map(is_not, map(dict.get, self.dicts, self.keys), self.values))
                or list(map(len, self.sized)) != self.sizes
                or list(map(_DATA_PTR, self.params)) != self.pointers
                or [p._version for p in self.versioned] != self.versions)

    def torch_hooked(self) -> bool:
        """Whether a torch module hook is registered on any module of the model, or globally, or a key/value
        slot is filled (prefix-tuning): what the fused blocks would not run. (Adapters and LoRA task modules,
        ``training.adapters``, act through torch hooks.)"""
        return (any(self.hook_dicts) or bool(GLOBAL_FORWARD_HOOKS or GLOBAL_FORWARD_PRE_HOOKS)
                or any(slot.extend is not None for slot in self.kv_slots))

    def nbytes(self) -> int:
        total = 0
        distinct = {id(blocks): blocks for blocks in self.by_bucket.values()}
        for block in (b for blocks in distinct.values() for b in blocks):
            if isinstance(block.qkv, PackedInt8Linear):  # only the fused QKV is a copy (int8)
                total += block.qkv.weight.numel()
                continue
            for linear in (block.qkv, block.out, block.ffn_in, block.ffn_out):
                total += linear.nbytes()  # its oneDNN copy, if any
            total += block.qkv.weight.numel() * block.qkv.weight.element_size()  # the fused (3H, H) matrix
        return total


def version_of(p: torch.Tensor):
    """``p``'s version counter (bumped by every in-place edit), or None for an inference tensor, which has none."""
    try:
        return p._version
    except RuntimeError:  # inference tensors have no version counter
        return None


#: model -> {fp32_kernel: Copies}. Beside the model, not in it: an opaque prepacked oneDNN tensor cannot
#: be deep-copied or pickled. Weak keys: an entry goes when its model does (the blocks refer to the
#: model's LayerNorm modules, never to the model itself).
_CACHE: "weakref.WeakKeyDictionary[BertModel, dict[str, Copies]]" = weakref.WeakKeyDictionary()


def copies_of(model: BertModel, fp32_kernel: str) -> Copies:
    entries = _CACHE.setdefault(model, {})
    packed = entries.get(fp32_kernel)
    if packed is None or packed.stale(model):
        warn_if_slow(model.dtype, model.device)  # once per process: bf16/fp16 without CPU support is slow
        entries.pop(fp32_kernel, None)  # free the old copy before building the new one
        packed = entries[fp32_kernel] = Copies(model, fp32_kernel)
    return packed


def release(model: BertModel) -> None:
    """Free the fused/packed weight copies kept for ``model`` (they are rebuilt on the next fast call)."""
    _CACHE.pop(model, None)


def cached_bytes(model: BertModel) -> int:
    """Memory held by the fast path's weight copies for ``model`` (0 when none): the fused QKV matrices,
    and the oneDNN copies of every block weight on the blocked and oneDNN routes (``routes``) and in half
    precision."""
    return sum(packed.nbytes() for packed in _CACHE.get(model, {}).values())

