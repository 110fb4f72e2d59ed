"""The fast inference path: ``fast = prepare(model)``, then ``fast(**batch)``.

It computes what ``model.py`` computes -- tests hold the two together within 2x the fp32 noise floor
(``minibert.testing.fp32_noise_floor``) -- with four changes that only matter for speed:

1. **No padding.** The real tokens of the batch are packed into one (N, H) matrix (N = number of real
   tokens), so the dense layers, LayerNorms and GELU never touch padding. Attention runs per sequence on
   its own tokens, which is what the padding mask achieves the slow way. On a batch that is 38 % real
   tokens this does 38 % of the dense work. A row's result cannot depend on its neighbours.
2. **Fused projections.** Q, K and V come from one (3H x H) matrix product instead of three.
3. **The fastest matrix kernels on this CPU.** Each fp32 product takes one of three routes
   (``tools/kernels.py``): ``F.linear``; oneDNN's kernels summed in the blocks and order in which MKL's
   ``F.linear`` sums on this CPU (``"blocked"``: the same numbers as ``F.linear``, bit for bit, at oneDNN's
   speed on few rows); or oneDNN's own order on a prepacked weight (``"onednn"``: usually fastest, fp32
   rounding apart from ``F.linear``). Which is fastest depends on the CPU, so the default
   (``fp32_kernel="auto"``) measures the three for each weight shape the first time it meets it on this
   CPU model and thread count (about 0.1 s a shape; kept in a cache file, ``kernels.route_for``) and takes
   the fastest -- oneDNN's own order only when more than 5 % faster than the faster exact route.
   ``fp32_kernel="linear" | "blocked" | "onednn"`` (or ``$MINIBERT_FP32_KERNEL``) fixes the route;
   ``routes(model)`` says which ones a model runs. The fast path stays within 2x the fp32 noise floor of
   the readable path on the exact routes and within 4x on oneDNN's own order (tested).
   bf16/fp16 weights are prepacked once into oneDNN's blocked layout (AMX kernels), and the GELU runs
   inside the first FFN product wherever a weight is prepacked.
4. **inference_mode**, in-place residual adds and GELU, PyTorch's fused attention kernel, and the two
   big per-block buffers (QKV and FFN inner) reused by every block of a forward pass (``_Workspace``).

An int8 model (``dtype="int8"``, ``minibert.quantize``) runs its own quantised weights here, Q, K and V
fused by rows (activations are quantised per token, so packing does not change their quantisation).

The embeddings, LayerNorms, activation and pooler are the model's own modules. The fused/packed weight
copies live in a cache beside the model, never inside it (copying, pickling and saving a model never see
them), keyed weakly (freed with the model), checked for staleness on each call against the parameters
they were made from (an in-place edit, a new tensor, ``.to()``: cheap, no walk over the module tree), and
freed on demand with ``release(model)``; ``cached_bytes(model)`` says what they hold.

Outputs at padded positions are zeros (the readable path leaves arbitrary, unused values there). When
attention maps, hooks (minibert's or torch's own module hooks) or training mode are involved the call
goes to the readable model instead, since only it computes those.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..activations import GELU_APPROXIMATE
from ..errors import InputError
from ..hardware import warn_if_slow
from ..hookpoints import GLOBAL_FORWARD_HOOKS, GLOBAL_FORWARD_PRE_HOOKS
from ..inputs import check_blocks, check_inputs
from ..model import BertModel, BertOutput
from ..quantize import Int8Linear, PackedInt8, concat_rows
from . import kernels
from .hooks import has_hooks

FP32_KERNELS = ("auto",) + kernels.ROUTES  # see the module docstring, point 3, and tools/kernels.py
_MKLDNN = kernels.MKLDNN
summation_block = kernels.summation_block  # public here too: README and the benchmarks name it so


class _Linear:
    """y = x W^T + b (optionally followed by GELU) by one of ``tools.kernels``' fp32 routes (``route``:
    ``fp32_kernel``, or for ``"auto"`` the one measured fastest for this weight's shape on this CPU), or on
    a oneDNN-prepacked weight (half precision)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, gelu: str | None = None,
                 fp32_kernel: str = "auto"):
        self.weight, self.bias, self.gelu = weight.detach(), bias.detach(), gelu
        self.packed = self.blocks = None
        self.route = "linear"
        if not _MKLDNN or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16,
                                                                             torch.float16):
            return
        if weight.dtype != torch.float32:
            self.packed = kernels.pack(weight)
            self.route = "onednn" if self.packed is not None else "linear"
            return
        route = kernels.route_for(*weight.shape) if fp32_kernel == "auto" else fp32_kernel
        if route == "onednn":
            self.packed = kernels.pack(weight)
        elif route == "blocked":
            self.k = summation_block(*weight.shape)
            if self.k is not None:
                self.blocks = kernels.pack_blocks(weight, self.k)
        self.route = "onednn" if self.packed is not None else "blocked" if self.blocks is not None else "linear"

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: (N, in). ``out``: an (N, out) buffer to write into (F.linear only), see ``_Workspace``."""
        if self.packed is not None:
            if self.gelu is None:
                return kernels.ONEDNN_LINEAR(x, self.packed, self.bias, "none", [], "")
            return kernels.ONEDNN_LINEAR(x, self.packed, self.bias, "gelu", [], self.gelu)
        if self.blocks is not None:
            y = kernels.blocked_linear(x, self.blocks, self.bias, self.k, out)
        elif out is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = torch.addmm(self.bias, x, self.weight.t(), out=out)  # what F.linear runs, into our buffer
        return torch.ops.aten.gelu_(y, approximate=self.gelu) if self.gelu is not None else y

    def nbytes(self) -> int:
        """Memory of the prepacked copies."""
        size = self.weight.numel() * self.weight.element_size()
        return size if self.packed is not None or self.blocks is not None else 0


class _Workspace(dict):
    """Large buffers reused by every block of one forward pass. A fresh (N, 3H) or (N, F) tensor above
    glibc's 32 MB mmap limit is new memory each time: every page faults on first touch, which cost more
    than the GELU itself at 32 x 128 tokens. Reusing one buffer per kind faults once per forward."""

    def get(self, name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = dict.get(self, name)
        if buf is None or buf.shape != shape:
            buf = self[name] = like.new_empty(shape)
        return buf


class _Int8Linear:
    """An int8 model's linear layer (``minibert.quantize``) with _Linear's calling convention; ``out`` is
    not used (the quantised kernel allocates its result)."""

    def __init__(self, kernel: PackedInt8, gelu: str | None = None):
        self.kernel, self.gelu, self.packed = kernel, gelu, None
        self.weight = kernel.qweight  # (out, in): for shapes only

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = self.kernel(x)  # activations quantised per token
        return torch.ops.aten.gelu_(y, approximate=self.gelu) if self.gelu is not None else y


class _FastBlock:
    def __init__(self, block, hidden_act: str, fp32_kernel: str):
        a, f = block.attn, block.ffn
        self.heads, self.d = a.num_heads, a.head_size
        gelu = GELU_APPROXIMATE.get(hidden_act)
        if isinstance(a.query, Int8Linear):  # an int8 model: its own quantised weights, Q, K, V fused by rows
            self.qkv = _Int8Linear(PackedInt8(concat_rows([a.query.qweight, a.key.qweight, a.value.qweight]),
                                              torch.cat([a.query.bias, a.key.bias, a.value.bias])))
            self.out = _Int8Linear(a.output.kernel())
            self.ffn_in = _Int8Linear(f.dense_in.kernel(), gelu=gelu)
            self.ffn_out = _Int8Linear(f.dense_out.kernel())
        else:
            self.qkv = _Linear(torch.cat([a.query.weight, a.key.weight, a.value.weight]),
                               torch.cat([a.query.bias, a.key.bias, a.value.bias]), fp32_kernel=fp32_kernel)  # (3H, H)
            self.out = _Linear(a.output.weight, a.output.bias, fp32_kernel=fp32_kernel)
            self.ffn_in = _Linear(f.dense_in.weight, f.dense_in.bias, gelu=gelu, fp32_kernel=fp32_kernel)
            self.ffn_out = _Linear(f.dense_out.weight, f.dense_out.bias, fp32_kernel=fp32_kernel)
        self.attn_norm = block.attn_norm
        self.act = None if gelu is not None else f.act  # applied separately when not fusable
        self.ffn_norm = block.ffn_norm

    def __call__(self, x: torch.Tensor, lengths: list[int] | None, B: int, T: int, ws: "_Workspace") -> torch.Tensor:
        """x: (N, H) packed real tokens. lengths: tokens per sequence (None = dense (B, T))."""
        h, d = self.heads, self.d
        N = x.shape[0]
        qkv = self.qkv(x, out=ws.get("qkv", (N, 3 * h * d), x))  # (N, 3H)
        if lengths is None:  # dense batch: one attention call for all
            q, k, v = qkv.view(B, T, 3, h, d).permute(2, 0, 3, 1, 4)  # each (B, h, T, d)
            ctx = F.scaled_dot_product_attention(q, k, v, scale=d**-0.5)  # (B, h, T, d)
            ctx = ctx.transpose(1, 2).reshape(B * T, h * d)  # (N, H)
        else:  # one attention call per sequence, on its real tokens only
            parts = []
            for chunk in qkv.split(lengths):  # (L, 3H)
                q, k, v = chunk.view(1, -1, 3, h, d).permute(2, 0, 3, 1, 4)  # each (1, h, L, d)
                parts.append(F.scaled_dot_product_attention(q, k, v, scale=d**-0.5)[0].transpose(0, 1))
            ctx = torch.cat(parts).reshape(-1, h * d)  # (N, H)
        x = self.attn_norm(self.out(ctx).add_(x))  # residual, then LayerNorm
        inner = self.ffn_in(x, out=ws.get("inner", (N, self.ffn_in.weight.shape[0]), x))  # (N, F)
        if self.act is not None:
            inner = self.act(inner)
        return self.ffn_norm(self.ffn_out(inner).add_(x))


class _Packed:
    """The fused/packed blocks of one model, and what they were made from (to notice edits)."""

    def __init__(self, model: BertModel, fp32_kernel: str):
        self.parts, self.params = [], []  # (dict, key, object) of every submodule and parameter; tensors
        for module in model.encoder.modules():
            self.parts.append((module.__dict__, "_modules", module._modules, len(module._modules)))
            self.parts.append((module.__dict__, "_parameters", module._parameters, len(module._parameters)))
            self.parts += [(module._modules, k, v, None) for k, v in module._modules.items()]
            self.parts += [(module._parameters, k, v, None) for k, v in module._parameters.items()]
            self.params += [(p, p.data_ptr(), _version(p)) for p in module._parameters.values() if p is not None]
        self.encoder = model.encoder
        # torch's hook dicts of every module (filled and emptied in place): a torch hook anywhere sends a
        # call to the readable path, where it fires (captum's layer methods, say)
        self.hook_dicts = [d for module in model.modules()
                           for d in (module._forward_hooks, module._forward_pre_hooks)]
        # attention's key/value slots (prefix-tuning fills them): a filled one also sends a call there
        self.kv_slots = [b.attn.kv for b in model.encoder.blocks]
        self.threads = torch.get_num_threads()  # the summation blocks found hold for this thread count
        with torch.inference_mode():
            self.blocks = [_FastBlock(b, model.config.hidden_act, fp32_kernel) for b in model.encoder.blocks]

    def stale(self, model: BertModel) -> bool:
        """A module or parameter replaced or added, an in-place edit (version counter), ``.to()`` (data
        pointer), another torch thread count: each makes the copies stale. Checked against what was
        recorded, without walking the module tree (~60 us for BERT-base, against ~450 us for one walk)."""
        return (model.encoder is not self.encoder or torch.get_num_threads() != self.threads
                or any(d.get(k) is not v or (n is not None and len(v) != n) for d, k, v, n in self.parts)
                or any(p.data_ptr() != ptr or _version(p) != version for p, ptr, version in self.params))

    def torch_hooked(self) -> bool:
        """Whether a torch module hook is registered on any module of the model, or globally, or a key/value
        slot is filled (prefix-tuning): what the fused blocks would not run. (Adapters and LoRA task modules,
        ``training.adapters``, act through torch hooks.)"""
        return (any(self.hook_dicts) or bool(GLOBAL_FORWARD_HOOKS or GLOBAL_FORWARD_PRE_HOOKS)
                or any(slot.extend is not None for slot in self.kv_slots))

    def nbytes(self) -> int:
        total = 0
        for block in self.blocks:
            if isinstance(block.qkv, _Int8Linear):  # only the fused QKV is a copy (int8)
                total += block.qkv.weight.numel()
                continue
            for linear in (block.qkv, block.out, block.ffn_in, block.ffn_out):
                total += linear.nbytes()  # its oneDNN copy, if any
            total += block.qkv.weight.numel() * block.qkv.weight.element_size()  # the fused (3H, H) matrix
        return total


def _version(p: torch.Tensor):
    try:
        return p._version
    except RuntimeError:  # inference tensors have no version counter
        return None


#: model -> {fp32_kernel: _Packed}. Beside the model, not in it: an opaque prepacked oneDNN tensor cannot
#: be deep-copied or pickled. Weak keys: an entry goes when its model does (the blocks refer to the
#: model's LayerNorm modules, never to the model itself).
_CACHE: "weakref.WeakKeyDictionary[BertModel, dict[str, _Packed]]" = weakref.WeakKeyDictionary()


def _packed(model: BertModel, fp32_kernel: str) -> _Packed:
    entries = _CACHE.setdefault(model, {})
    packed = entries.get(fp32_kernel)
    if packed is None or packed.stale(model):
        warn_if_slow(model.dtype, model.device)  # once per process: bf16/fp16 without CPU support is slow
        entries.pop(fp32_kernel, None)  # free the old copy before building the new one
        packed = entries[fp32_kernel] = _Packed(model, fp32_kernel)
    return packed


#: how far the fast path may be from the readable path, in fp32 noise floors (``minibert.testing.
#: fp32_noise_floor``), by route: the exact routes 2x (they sum every product as F.linear does; packing and
#: fused attention move the rest), oneDNN's own order 4x (measured up to ~2.2x)
NOISE_FACTOR = {"linear": 2, "blocked": 2, "onednn": 4}


def noise_factor(model: BertModel, fp32_kernel: str = "auto") -> int:
    """The bound (``NOISE_FACTOR``) of the routes ``model``'s fp32 fast path takes with ``fp32_kernel``."""
    return max(NOISE_FACTOR[route] for route in routes(model, fp32_kernel).values())


def routes(model: BertModel, fp32_kernel: str = "auto") -> dict[str, str]:
    """The route each of a block's products takes on the fast path with ``fp32_kernel`` (``"linear"``,
    ``"blocked"``, ``"onednn"``; int8 models: ``"int8"``), as ``minibert inspect`` and the benchmarks
    report them. Builds the fast path's copies if they are not there yet."""
    if fp32_kernel not in FP32_KERNELS:
        raise InputError(f"fp32_kernel={fp32_kernel!r}: use one of {FP32_KERNELS}")
    block = _packed(model, fp32_kernel).blocks[0]
    linears = {"qkv": block.qkv, "attention output": block.out, "ffn in": block.ffn_in, "ffn out": block.ffn_out}
    return {name: "int8" if isinstance(linear, _Int8Linear) else linear.route for name, linear in linears.items()}


def release(model: BertModel) -> None:
    """Free the fused/packed weight copies kept for ``model`` (they are rebuilt on the next fast call)."""
    _CACHE.pop(model, None)


def cached_bytes(model: BertModel) -> int:
    """Memory held by the fast path's weight copies for ``model`` (0 when none): the fused QKV matrices,
    and the oneDNN copies of every block weight on the blocked and oneDNN routes (``routes``) and in half
    precision."""
    return sum(packed.nbytes() for packed in _CACHE.get(model, {}).values())


class FastBert:
    """``model``'s forward pass without padding. Call it as the model: ``fast(**batch)`` returns a
    ``BertOutput`` (zeros at padded positions). Where only the readable path can answer -- attention maps,
    hooks, training mode, torch.compile tracing -- it calls the model itself."""

    def __init__(self, model: BertModel, *, fp32_kernel: str = "auto", prepack_fp32: bool = False):
        if not isinstance(model, BertModel):
            raise TypeError(f"fast.prepare takes a minibert BertModel, got {type(model).__name__}")
        if fp32_kernel not in FP32_KERNELS:
            raise InputError(f"fp32_kernel={fp32_kernel!r}: use one of {FP32_KERNELS}")
        if prepack_fp32 and fp32_kernel != "auto":
            raise InputError(f"prepack_fp32=True is fp32_kernel='onednn'; it cannot go with fp32_kernel={fp32_kernel!r}")
        if prepack_fp32:
            import warnings

            warnings.warn("prepack_fp32=True is fp32_kernel='onednn': say that (prepack_fp32 will go)",
                          DeprecationWarning, stacklevel=3)
        self.model = model
        self.fp32_kernel = "onednn" if prepack_fp32 else fp32_kernel

    def __repr__(self) -> str:
        return f"FastBert({getattr(self.model, 'source', 'model')}, fp32_kernel={self.fp32_kernel!r})"

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                 output_attentions=False, *, num_blocks=None, skip_blocks=()) -> BertOutput:
        model = self.model
        if (output_attentions or model.training or torch.compiler.is_compiling() or has_hooks(model)
                or _packed(model, self.fp32_kernel).torch_hooked()):
            # the readable path: model.py's own forward, whatever calling convention a subclass adds
            # (TransformersBertModel); torch hooks on the model's modules fire there
            return BertModel.forward(model, input_ids, attention_mask, token_type_ids, position_ids,
                                     output_attentions, num_blocks=num_blocks, skip_blocks=skip_blocks)
        packed = _packed(model, self.fp32_kernel)
        input_ids, attention_mask, token_type_ids, position_ids = check_inputs(
            model.config, model.device, input_ids, attention_mask, token_type_ids, position_ids)
        num_blocks, skip_blocks = check_blocks(model.config, num_blocks, skip_blocks)
        blocks = packed.blocks
        with torch.inference_mode():
            return _forward(model, blocks, input_ids, attention_mask, token_type_ids, position_ids, num_blocks,
                            skip_blocks)


def prepare(model: BertModel, *, fp32_kernel: str = "auto", prepack_fp32: bool = False) -> FastBert:
    """The fast path for ``model``: ``fast = prepare(model); out = fast(**batch)``. Cheap to call again:
    the weight copies are made on first use and shared by every FastBert of the same model and options.
    ``fp32_kernel``: ``"auto"`` (each product on the route measured fastest on this CPU, see
    ``tools/kernels.py``), ``"linear"`` (F.linear, no weight copies but the fused QKV), ``"blocked"``
    (oneDNN in F.linear's summation order where this CPU has one, else F.linear) or ``"onednn"``
    (oneDNN's own order; the deprecated ``prepack_fp32=True`` says the same) -- see the module docstring."""
    return FastBert(model, fp32_kernel=fp32_kernel, prepack_fp32=prepack_fp32)


def _forward(model, blocks, input_ids, attention_mask, token_type_ids, position_ids, num_blocks, skip_blocks):
    B, T = input_ids.shape
    H = model.config.hidden_size
    if attention_mask is None:  # check_inputs drops a mask that masks nothing
        where, lengths = None, None
        ids, tts, pos = input_ids.reshape(-1), token_type_ids.reshape(-1), position_ids.reshape(-1)
    else:
        real = attention_mask.bool()  # (B, T)
        where = real.reshape(-1).nonzero().squeeze(1)  # flat indices of the real tokens, row by row
        lengths = real.sum(1).tolist()
        ids, tts, pos = (t.reshape(-1)[where] for t in (input_ids, token_type_ids, position_ids))
    x = model.embeddings(ids[None], tts[None], pos[None])[0]  # (N, H): the model's own embeddings

    nonempty = [n for n in lengths if n] if lengths is not None else None
    packed_states = [x]
    workspace = _Workspace()
    for i, block in enumerate(blocks[:num_blocks]):
        if i not in skip_blocks and x.shape[0]:  # (an all-padding batch has no token to run)
            x = block(x, nonempty, B, T, workspace)
        packed_states.append(x)

    def unpack(t):  # (N, H) -> (B, T, H), zeros at padding
        if where is None:
            return t.view(B, T, H)
        full = t.new_zeros(B * T, H)
        full[where] = t
        return full.view(B, T, H)

    hidden_states = tuple(unpack(t) for t in packed_states)
    last = hidden_states[-1]
    pooled = model.pooler(last) if model.pooler is not None else None
    return BertOutput(last_hidden_state=last, pooler_output=pooled, hidden_states=hidden_states)


class Stepper:
    """One batch run block by block on packed tokens, where rows may leave between blocks -- what early
    exit needs (``minibert.training.depth``): a finished row's tokens drop out of every later product.

        steps = Stepper(model, **batch)   # embeddings of the real tokens
        steps.run_block(0)                # block 0 on the rows still there
        steps.first_tokens()              # (rows left, H): each row's [CLS] vector after the last block run
        steps.mean_tokens()               # (rows left, H): the mean of each row's real tokens
        steps.keep(mask)                  # mask over the rows left: False = the row leaves
        steps.rows                        # original batch indices of the rows left

    A row's numbers are those of ``FastBert`` for that row: rows never see each other."""

    def __init__(self, model: BertModel, input_ids, attention_mask=None, token_type_ids=None, position_ids=None):
        if model.training or has_hooks(model):
            raise InputError("Stepper runs the inference fast path: put the model in eval mode, remove hooks")
        input_ids, attention_mask, token_type_ids, position_ids = check_inputs(
            model.config, model.device, input_ids, attention_mask, token_type_ids, position_ids)
        B, T = input_ids.shape
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        where = real.reshape(-1).nonzero().squeeze(1)
        self.lengths = real.sum(1).tolist()
        if min(self.lengths) == 0:
            raise InputError("every row needs at least one real token")
        ids, tts, pos = (t.reshape(-1)[where] for t in (input_ids, token_type_ids, position_ids))
        packed = _packed(model, "auto")
        if packed.torch_hooked():
            raise InputError("Stepper runs the inference fast path, where torch module hooks, task modules "
                             "(adapters, prefixes) and LoRA hooks do not act: remove them (or run the model itself)")
        self.blocks = packed.blocks
        self.T = T
        self.rows = torch.arange(B)
        self.workspace = _Workspace()
        with torch.inference_mode():
            self.x = model.embeddings(ids[None], tts[None], pos[None])[0]  # (N, H)

    def run_block(self, i: int) -> None:
        with torch.inference_mode():
            self.x = self.blocks[i](self.x, self.lengths, len(self.lengths), self.T, self.workspace)

    def first_tokens(self) -> torch.Tensor:
        starts = torch.tensor([0] + self.lengths[:-1]).cumsum(0)
        return self.x[starts]  # (rows left, H)

    def mean_tokens(self) -> torch.Tensor:
        return torch.stack([piece.mean(0) for piece in self.x.split(self.lengths)])  # (rows left, H)

    def keep(self, mask: torch.Tensor) -> None:
        mask = mask.tolist()
        pieces = self.x.split(self.lengths)
        self.x = torch.cat([p for p, m in zip(pieces, mask) if m]) if any(mask) else self.x[:0]
        self.lengths = [n for n, m in zip(self.lengths, mask) if m]
        self.rows = self.rows[torch.tensor(mask, dtype=torch.bool)]
