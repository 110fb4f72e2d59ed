"""The fast inference path: ``fast = prepare(model)``, then ``fast(**batch)``.

It computes what ``model.py`` computes -- tests hold the two together within 2x the fp32 noise floor
(``minibert.testing.fp32_noise_floor``) -- with four changes that only matter for speed:

1. **No padding.** The real tokens of the batch are packed into one (N, H) matrix (N = number of real
   tokens) once per forward pass (``tools.varlen.pack``: indices, ``cu_seqlens``, the longest row), so the
   dense layers, LayerNorms and GELU never touch padding, and the hidden states asked for are scattered
   back to (B, T, H) once at the end. Attention runs within each sequence, which is what the padding mask
   achieves the slow way, by the kernel chosen for this device (``attention=``, ``tools.varlen``): one call
   per sequence on a CPU; one call for the batch on a GPU (FlashAttention's variable-length kernel, SDPA
   on nested tensors, or padded SDPA with the mask: measured once per GPU, dtype and head size). On a batch
   that is 38 % real tokens this does 38 % of the dense work. A row's result cannot depend on its neighbours.
2. **Fused projections.** Q, K and V come from one (3H x H) matrix product instead of three.
3. **The fastest matrix kernels on this CPU.** Each fp32 product takes one of three routes
   (``tools/kernels.py``): ``F.linear``; oneDNN's kernels summed in the blocks and order in which MKL's
   ``F.linear`` sums on this CPU (``"blocked"``: the same numbers as ``F.linear``, bit for bit, at oneDNN's
   speed on few rows); or oneDNN's own order on a prepacked weight (``"onednn"``: usually fastest, fp32
   rounding apart from ``F.linear``). Which is fastest depends on the CPU, so the default
   (``fp32_kernel="auto"``) measures the three for each weight shape the first time it meets it on this
   CPU model and thread count (about 0.1 s a shape; kept in a cache file, ``kernels.route_for``) and takes
   the fastest -- oneDNN's own order only when more than 5 % faster than the faster exact route --, then
   decides on the whole block (``block_plan``: a product's speed alone need not hold in the forward pass).
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

``output_hidden_states`` (True, False or indices) keeps only the hidden states asked for; the rest are
freed block by block. ``tf32=True`` lets fp32 products on a GPU run in TensorFloat-32 (off by default).

Outputs at padded positions are zeros (the readable path leaves arbitrary, unused values there). When
attention maps, hooks (minibert's or torch's own module hooks), training mode or a norm placement other
than BERT's (``models/norms.py``) are involved the call goes to the readable model instead, since only it
computes those.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F

from ..activations import GELU_APPROXIMATE
from .. import measured
from ..errors import InputError
from ..hardware import warn_if_slow
from ..hookpoints import GLOBAL_FORWARD_HOOKS, GLOBAL_FORWARD_PRE_HOOKS
from ..checks import check_index
from ..inputs import check_blocks, check_inputs
from ..model import BertModel, BertOutput
from ..quantize import Int8Linear, PackedInt8, concat_rows
from . import kernels, timing, varlen
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
    def __init__(self, block, hidden_act: str, plan: dict[str, str]):
        """``plan``: the fp32 route of each product (``PRODUCTS``: a route of ``kernels.ROUTES``, or "auto" for
        the one measured for its shape alone)."""
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
                               torch.cat([a.query.bias, a.key.bias, a.value.bias]), fp32_kernel=plan["qkv"])  # (3H, H)
            self.out = _Linear(a.output.weight, a.output.bias, fp32_kernel=plan["attention output"])
            self.ffn_in = _Linear(f.dense_in.weight, f.dense_in.bias, gelu=gelu, fp32_kernel=plan["ffn in"])
            self.ffn_out = _Linear(f.dense_out.weight, f.dense_out.bias, fp32_kernel=plan["ffn out"])
        self.attn_norm = block.attn_norm
        self.act = None if gelu is not None else f.act  # applied separately when not fusable
        self.ffn_norm = block.ffn_norm

    def __call__(self, x: torch.Tensor, packing: varlen.Packing, attention: str, ws: "_Workspace") -> torch.Tensor:
        """x: (N, H) packed real tokens; ``packing``: where they sit in the batch (``tools.varlen``);
        ``attention``: the kernel that attends within each sequence (``varlen.ROUTES``)."""
        N = x.shape[0]
        qkv = self.qkv(x, out=ws.get("qkv", (N, 3 * self.heads * self.d), x))  # (N, 3H)
        ctx = varlen.attend(attention, qkv, packing, self.heads, self.d**-0.5)  # (N, H)
        x = self.attn_norm(self.out(ctx).add_(x))  # residual, then LayerNorm
        inner = self.ffn_in(x, out=ws.get("inner", (N, self.ffn_in.weight.shape[0]), x))  # (N, F)
        if self.act is not None:
            inner = self.act(inner)
        return self.ffn_norm(self.ffn_out(inner).add_(x))


class _Packed:
    """The fused/packed blocks of one model, and what they were made from (to notice edits)."""

    def __init__(self, model: BertModel, fp32_kernel: str):
        self.parts, self.params = [], []  # (dict, key, object) of every submodule and parameter; tensors
        # the encoder's weights are copied (fused, packed): an in-place edit makes the copies stale too. The
        # embeddings and pooler are read where they are, so only a replaced or moved one counts there (what a
        # CUDA graph of this forward, ``GraphCache``, also needs: it reads their memory as it was captured)
        live = [m for m in (model.embeddings, model.pooler) if m is not None]
        self.parts += [(model._modules, k, v, None) for k, v in model._modules.items()]
        for module in [*model.encoder.modules(), *(m for top in live for m in top.modules())]:
            self.parts.append((module.__dict__, "_modules", module._modules, len(module._modules)))
            self.parts.append((module.__dict__, "_parameters", module._parameters, len(module._parameters)))
            self.parts += [(module._modules, k, v, None) for k, v in module._modules.items()]
            self.parts += [(module._parameters, k, v, None) for k, v in module._parameters.items()]
        self.params = [(p, p.data_ptr(), _version(p)) for p in model.encoder.parameters()]
        self.params += [(p, p.data_ptr(), None) for top in live for p in top.parameters()]  # no version: read live
        # torch's hook dicts of every module (filled and emptied in place): a torch hook anywhere sends a
        # call to the readable path, where it fires (captum's layer methods, say)
        self.hook_dicts = [d for module in model.modules()
                           for d in (module._forward_hooks, module._forward_pre_hooks)]
        # attention's key/value slots (prefix-tuning fills them): a filled one also sends a call there
        self.kv_slots = [b.attn.kv for b in model.encoder.blocks]
        self.threads = torch.get_num_threads()  # the summation blocks found hold for this thread count
        plan = dict.fromkeys(PRODUCTS, fp32_kernel)
        if (fp32_kernel == "auto" and _MKLDNN and model.device.type == "cpu" and model.dtype == torch.float32
                and not isinstance(model.encoder.blocks[0].attn.query, Int8Linear)):
            plan = block_plan(model.config)  # decided on the whole block, not product by product
        with torch.inference_mode():
            self.blocks = [_FastBlock(b, model.config.hidden_act, plan) for b in model.encoder.blocks]

    def stale(self, model: BertModel) -> bool:
        """A module or parameter replaced or added, an in-place edit (version counter), ``.to()`` (data
        pointer), another torch thread count: each makes the copies stale. Checked against what was
        recorded, without walking the module tree (~60 us for BERT-base, against ~450 us for one walk)."""
        return (torch.get_num_threads() != self.threads
                or any(d.get(k) is not v or (n is not None and len(v) != n) for d, k, v, n in self.parts)
                or any(p.data_ptr() != ptr or (version is not None and _version(p) != version)
                       for p, ptr, version in self.params))

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


# ------------------------------------------------------------------- "auto": routes chosen on the whole block
PRODUCTS = kernels.PRODUCTS  # a block's four products, as ``routes`` names them
#: the batches a block is timed on (B, T, real-token fraction): a dense batch and a padded one
PLAN_CONTEXTS = ((8, 128, 1.0), (16, 128, 0.38))
_PLANS: dict[tuple, dict[str, str]] = {}


def block_plan(config) -> dict[str, str]:
    """The fp32 routes ``fp32_kernel="auto"`` takes for a block of ``config``'s geometry on this CPU.

    Each product's route measured alone (``kernels.route_for``) need not hold in the forward pass: on an AMD
    EPYC Zen 3 oneDNN's own order won every BERT-base product alone (0.72-0.84 of F.linear's time) yet the
    whole forward ran slower than on F.linear (1.20-1.25x transformers' time against 0.95). So the choice is
    made on the whole block: the per-product choice and each route for every product are timed as one
    block on ``PLAN_CONTEXTS`` (``time_plans``), and the fastest is taken -- one with oneDNN's own order only
    when it beats the fastest exact one by more than ``kernels.BLOCK_MARGIN``. Kept, with the times, in the
    cache file beside the per-shape choices; ``$MINIBERT_FP32_KERNEL`` overrides it."""
    forced = kernels.forced_route()
    if forced is not None:
        return dict.fromkeys(PRODUCTS, forced)
    shapes = kernels.block_shapes(config.hidden_size, config.intermediate_size)
    machine, what = measured.machine_key(), plan_key(config)
    if (machine, what) in _PLANS:
        return _PLANS[(machine, what)]
    entry = measured.saved_entry(kernels.cache_file(), machine, what)
    plan = entry.get("plan") if entry else None
    if not (isinstance(plan, dict) and set(plan) == set(PRODUCTS)
            and all(r in kernels.ROUTES and kernels.runs_here(r, *shapes[p]) for p, r in plan.items())):
        per_product = kernels.routes_for_shapes(config.hidden_size, config.intermediate_size)
        candidates = {route: dict.fromkeys(PRODUCTS, route) for route in kernels.ROUTES
                      if all(kernels.runs_here(route, *shape) for shape in shapes.values())}
        if per_product not in candidates.values():
            candidates["per product"] = per_product
        relative = time_plans(config, candidates)
        chosen = decide_plan(relative, candidates)
        plan = candidates[chosen]
        measured.write_json_entry(kernels.cache_file(), machine, what, {
            "plan": plan, "chosen": chosen, "per_product": per_product,
            "relative_time": {name: round(t, 3) for name, t in relative.items()}})
    _PLANS[(machine, what)] = plan
    return plan


def plan_key(config) -> str:
    """The name a block geometry's plan is kept under in the cache file."""
    return (f"block H={config.hidden_size} F={config.intermediate_size} heads={config.num_attention_heads} "
            f"{config.hidden_act}")


def plan_record(config) -> dict | None:
    """What ``block_plan`` measured for this geometry on this CPU (plan, the candidate chosen, each product's
    choice alone, the relative times), from the cache file; None when nothing was measured."""
    return measured.saved_entry(kernels.cache_file(), measured.machine_key(), plan_key(config))


def decide_plan(relative: dict[str, float], candidates: dict[str, dict[str, str]]) -> str:
    """The candidate to take from ``time_plans``' relative times: the fastest whose products are all exact
    (F.linear's numbers), unless one with oneDNN's own order beats it by more than ``kernels.BLOCK_MARGIN``."""
    def exact(name):
        return all(route in kernels.EXACT_ROUTES for route in candidates[name].values())
    best_exact = min((n for n in relative if exact(n)), key=relative.get, default=None)
    best = min(relative, key=relative.get)
    if best_exact is None or relative[best] < kernels.BLOCK_MARGIN * relative[best_exact]:
        return best
    return best_exact


def time_plans(config, candidates: dict[str, dict[str, str]], rounds: int = 3) -> dict[str, float]:
    """Each candidate plan's time for one block of ``config``'s geometry (random weights), relative to
    F.linear's for every product (or the first candidate's): per context of ``PLAN_CONTEXTS``, the best of
    ``rounds`` alternating calls after a warm-up call each; the geometric mean over the contexts."""
    from ..model import Block

    g = torch.Generator().manual_seed(0)
    block = Block(config).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():  # BERT's init: N(0, 0.02) weights, zero biases, LayerNorm = identity
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1
                    else torch.ones(p.shape) if "norm.weight" in name else torch.zeros(p.shape))
    with torch.inference_mode():
        fast_blocks = {name: _FastBlock(block, config.hidden_act, plan) for name, plan in candidates.items()}
        logs = dict.fromkeys(candidates, 0.0)
        for B, T, real in PLAN_CONTEXTS:
            lengths = [max(1, round(T * real * (0.5 + (i % 4) / 3))) if real < 1 else T for i in range(B)]
            lengths = [min(T, n) for n in lengths]
            mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
            packing = varlen.pack(None if real == 1 else mask, B, T)
            x = torch.randn(sum(lengths), config.hidden_size, generator=g)
            ws = _Workspace()
            fns = {name: (lambda b=b: b(x, packing, "loop", ws)) for name, b in fast_blocks.items()}
            best = {name: min(t) for name, t in timing.alternate(fns, rounds, warmup=1, rotate=True).items()}
            base = best.get("linear", best[next(iter(candidates))])
            for name in candidates:
                logs[name] += math.log(best[name] / base) / len(PLAN_CONTEXTS)
    return {name: math.exp(v) for name, v in logs.items()}


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
    return max(NOISE_FACTOR[route] for name, route in routes(model, fp32_kernel).items() if name != "attention")


def routes(model: BertModel, fp32_kernel: str = "auto", attention: str = "auto") -> dict[str, str]:
    """The route each of a block's products takes on the fast path with ``fp32_kernel`` (``"linear"``,
    ``"blocked"``, ``"onednn"``; int8 models: ``"int8"``), and the attention kernel (``"attention"``:
    ``tools.varlen.ROUTES``), as ``minibert inspect`` and the benchmarks report them. Builds the fast
    path's copies if they are not there yet (and measures what "auto" has not measured here yet)."""
    if fp32_kernel not in FP32_KERNELS:
        raise InputError(f"fp32_kernel={fp32_kernel!r}: use one of {FP32_KERNELS}")
    block = _packed(model, fp32_kernel).blocks[0]
    linears = {"qkv": block.qkv, "attention output": block.out, "ffn in": block.ffn_in, "ffn out": block.ffn_out}
    chosen = {name: "int8" if isinstance(linear, _Int8Linear) else linear.route for name, linear in linears.items()}
    return {**chosen, "attention": FastBert(model, attention=attention).attention_route()}


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
    hooks, training mode, torch.compile tracing -- it calls the model itself.

    ``attention``: the kernel that attends within each sequence (``tools.varlen``): ``"auto"`` (the
    per-sequence loop on a CPU, the fastest measured on a GPU), or ``"loop"``, ``"varlen"``, ``"nested"``,
    ``"padded"``. ``tf32=True`` lets fp32 products on a GPU run in TensorFloat-32 (inputs rounded to 10
    mantissa bits: several times faster on tensor cores, about 1e-3 relative error instead of fp32's 1e-7,
    so no longer within the fp32 noise floor of the readable path); off by default, as in torch.
    ``cuda_graphs=True`` (a model on a GPU): a batch without padding runs as a CUDA graph captured for its
    shape on first sight (``GraphCache``): one launch instead of hundreds, what a small batch's latency is
    made of; padded batches run as usual."""

    def __init__(self, model: BertModel, *, fp32_kernel: str = "auto", attention: str = "auto", tf32: bool = False,
                 cuda_graphs: bool = False):
        if not isinstance(model, BertModel):
            raise TypeError(f"fast.prepare takes a minibert BertModel, got {type(model).__name__}")
        if fp32_kernel not in FP32_KERNELS:
            raise InputError(f"fp32_kernel={fp32_kernel!r}: use one of {FP32_KERNELS}")
        for name, value in (("tf32", tf32), ("cuda_graphs", cuda_graphs)):
            if not isinstance(value, bool):
                raise InputError(f"{name}={value!r}: pass True or False")
        self.model = model
        self.fp32_kernel = fp32_kernel
        self.attention = varlen.check_route(attention)
        self.tf32 = tf32
        self.graphs = GraphCache() if cuda_graphs else None

    def __repr__(self) -> str:
        return (f"FastBert({getattr(self.model, 'source', 'model')}, fp32_kernel={self.fp32_kernel!r}, "
                f"attention={self.attention!r}, tf32={self.tf32}, cuda_graphs={self.graphs is not None})")

    def attention_route(self) -> str:
        """The attention kernel this model's forward takes here (``varlen.attention_route`` for "auto")."""
        model = self.model
        if self.attention != "auto":
            if not varlen.runs_here(self.attention, model.device, model.dtype, model.config.head_size):
                raise InputError(f"attention={self.attention!r} cannot run here: {varlen.why_not(self.attention)} "
                                 f"(this model: {model.device}, {model.dtype}, head size {model.config.head_size}); "
                                 "use attention='auto'")
            return self.attention
        return varlen.attention_route(model.device, model.dtype, model.config.head_size)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                 output_attentions=False, output_hidden_states=True, *, num_blocks=None,
                 skip_blocks=()) -> BertOutput:
        """As ``BertModel.forward``. ``output_hidden_states``: True (all of them, the default), False
        (``hidden_states`` is None) or the indices to keep (e.g. ``[-1]`` or ``[0, 6]``): ``hidden_states``
        then has its usual length with None in the places not kept. Only what is kept is scattered back to
        (B, T, H); the rest is freed block by block."""
        model = self.model
        num_blocks, skip_blocks = check_blocks(model.config, num_blocks, skip_blocks)
        keep = kept_states(output_hidden_states, model.config, num_blocks)
        readable = (output_attentions or model.training or torch.compiler.is_compiling() or has_hooks(model)
                    or model.config.norm_placement != "post")  # the fused blocks are BERT's post-LN ones
        packed = None if readable else _packed(model, self.fp32_kernel)  # its staleness checked once a call
        if readable or packed.torch_hooked():
            # the readable path: model.py's own forward, whatever calling convention a subclass adds
            # (TransformersBertModel); torch hooks on the model's modules fire there. It keeps every
            # hidden state, or only the last one when no other is wanted.
            last = _num_states(model.config, num_blocks) - 1
            out = BertModel.forward(model, input_ids, attention_mask, token_type_ids, position_ids,
                                    output_attentions, bool(keep and keep - {last}),
                                    num_blocks=num_blocks, skip_blocks=skip_blocks)
            states = out.hidden_states or (None,) * last + (out.last_hidden_state,)
            out.hidden_states = None if keep is None else tuple(t if i in keep else None for i, t in enumerate(states))
            return out
        input_ids, attention_mask, token_type_ids, position_ids = check_inputs(
            model.config, model.device, input_ids, attention_mask, token_type_ids, position_ids)
        attention = self.attention_route()

        def forward(input_ids, token_type_ids, position_ids, attention_mask=attention_mask):
            return _forward(model, packed.blocks, attention, input_ids, attention_mask, token_type_ids,
                            position_ids, num_blocks, skip_blocks, keep)
        with torch.inference_mode(), _tf32(self.tf32 and model.device.type == "cuda"):
            if self.graphs is not None:
                self.graphs.check(model)
                if attention_mask is None:  # no padding: the shapes are static, the forward can be a graph
                    key = (tuple(input_ids.shape), num_blocks, tuple(sorted(skip_blocks)), keep, attention)
                    return self.graphs.run(packed, key, forward, (input_ids, token_type_ids, position_ids))
            return forward(input_ids, token_type_ids, position_ids)


class GraphCache:
    """CUDA graphs of the fast forward pass, one per key (the packed weights, the input shape and the
    options), captured on first sight: inputs are copied into the graph's own tensors, the graph replays
    every kernel in one launch, and the outputs are copied out (the graph's own are overwritten by the next
    replay). At most ``limit`` graphs are kept (the least recently used goes). A graph reads the memory of
    the weights it was captured with, so when they change -- the packed blocks rebuilt after an edit, a
    parameter replaced -- every graph is dropped and captured again. ``check``, ``make_graph`` and
    ``capture`` are seams for tests of this bookkeeping on a CPU."""

    def __init__(self, limit: int = 8):
        self.limit = limit
        self.weights = None  # what the graphs were captured with
        self.entries: dict = {}  # key -> (graph, static inputs, static output), in order of use

    @staticmethod
    def check(model) -> None:
        if model.device.type != "cuda":
            raise InputError(f"cuda_graphs=True: the model is on {model.device}; CUDA graphs need a model on a GPU "
                             "(move it there, or leave cuda_graphs out)")

    @staticmethod
    def make_graph():
        return torch.cuda.CUDAGraph()

    @staticmethod
    def capture(graph, fn, inputs):
        """Warm up on a side stream (torch's rule before a capture), then record ``fn(*inputs)``."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            return fn(*inputs)

    def run(self, weights, key, fn, inputs: tuple) -> BertOutput:
        """``weights``: the model's ``_Packed`` record, rebuilt whenever what a graph reads changed."""
        if self.weights is not weights:
            self.entries.clear()  # captured with other weights: never replayed
            self.weights = weights
        entry = self.entries.pop(key, None)
        if entry is None:
            static = tuple(t.clone() for t in inputs)
            graph = self.make_graph()
            entry = (graph, static, self.capture(graph, fn, static))
            if len(self.entries) >= self.limit:
                self.entries.pop(next(iter(self.entries)))  # the least recently used
        self.entries[key] = entry  # most recent last
        graph, static, out = entry
        for mine, given in zip(static, inputs):
            mine.copy_(given)
        graph.replay()
        copy = (lambda t: None if t is None else t.clone())
        return BertOutput(last_hidden_state=copy(out.last_hidden_state), pooler_output=copy(out.pooler_output),
                          hidden_states=None if out.hidden_states is None else tuple(map(copy, out.hidden_states)))


def _num_states(config, num_blocks) -> int:
    return (config.num_hidden_layers if num_blocks is None else num_blocks) + 1


def kept_states(output_hidden_states, config, num_blocks=None) -> frozenset | None:
    """``output_hidden_states`` (True, False or indices of hidden states) as the set of indices to keep
    (0..num_blocks; negative ones counted from the end), or None for False."""
    n = _num_states(config, num_blocks)
    if output_hidden_states is True:
        return frozenset(range(n))
    if output_hidden_states is False or output_hidden_states is None:
        return None
    if isinstance(output_hidden_states, (int, str)) or not hasattr(output_hidden_states, "__iter__"):
        raise InputError(f"output_hidden_states={output_hidden_states!r}: pass True, False or a list of "
                         f"hidden-state indices (0..{n - 1}, or -{n}..-1)")
    keep = set()
    for i in output_hidden_states:
        check_index("output_hidden_states entry", i, -n, n - 1, f"this forward has hidden states 0..{n - 1}")
        keep.add(i % n)
    return frozenset(keep)


class _tf32:
    """Within this block, fp32 matrix products on CUDA may run in TensorFloat-32 (``FastBert(tf32=True)``);
    torch's setting comes back after."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            self.before = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        if self.on:
            torch.backends.cuda.matmul.allow_tf32 = self.before


def prepare(model: BertModel, *, fp32_kernel: str = "auto", attention: str = "auto", tf32: bool = False,
            cuda_graphs: bool = False) -> FastBert:
    """The fast path for ``model``: ``fast = prepare(model); out = fast(**batch)``. Cheap to call again:
    the weight copies are made on first use and shared by every FastBert of the same model and options.
    ``fp32_kernel``: ``"auto"`` (each product on the route measured fastest on this CPU, see
    ``tools/kernels.py``), ``"linear"`` (F.linear, no weight copies but the fused QKV), ``"blocked"``
    (oneDNN in F.linear's summation order where this CPU has one, else F.linear) or ``"onednn"``
    (oneDNN's own order) -- see the module docstring.
    ``attention``, ``tf32`` and ``cuda_graphs``: see ``FastBert``."""
    return FastBert(model, fp32_kernel=fp32_kernel, attention=attention, tf32=tf32, cuda_graphs=cuda_graphs)


def _forward(model, blocks, attention, input_ids, attention_mask, token_type_ids, position_ids, num_blocks,
             skip_blocks, keep):
    B, T = input_ids.shape
    packing = varlen.pack(attention_mask, B, T, device=input_ids.device)  # once for every block
    if packing.dense:
        ids, tts, pos = input_ids.reshape(-1), token_type_ids.reshape(-1), position_ids.reshape(-1)
    else:
        ids, tts, pos = (t.reshape(-1)[packing.where] for t in (input_ids, token_type_ids, position_ids))
    x = model.embeddings(ids[None], tts[None], pos[None])[0]  # (N, H): the model's own embeddings

    last = _num_states(model.config, num_blocks) - 1
    kept = {0: x} if keep and 0 in keep else {}  # the packed (N, H) states asked for, by index
    workspace = _Workspace()
    for i, block in enumerate(blocks[:num_blocks]):
        if i not in skip_blocks and x.shape[0]:  # (an all-padding batch has no token to run)
            x = block(x, packing, attention, workspace)
        if keep and i + 1 in keep:
            kept[i + 1] = x
    # back to (B, T, H) once, at the end: the states asked for, and the last one
    full = {i: packing.scatter(t) for i, t in kept.items()}
    last_state = full[last] if last in full else packing.scatter(x)
    pooled = model.pooler(last_state) if model.pooler is not None else None
    hidden_states = None if keep is None else tuple(full.get(i) for i in range(last + 1))
    return BertOutput(last_hidden_state=last_state, pooler_output=pooled, hidden_states=hidden_states)


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
        if model.config.norm_placement != "post":
            raise InputError(f"Stepper runs the fused blocks of BERT's post-LN; this model's norm placement is "
                             f"{model.config.norm_placement!r} (models/norms.py): run the model itself")
        input_ids, attention_mask, token_type_ids, position_ids = check_inputs(
            model.config, model.device, input_ids, attention_mask, token_type_ids, position_ids)
        B, T = input_ids.shape
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if not bool(real.any(1).all()):
            raise InputError("every row needs at least one real token")
        packing = varlen.pack(real, B, T)
        self.lengths = packing.lengths
        ids, tts, pos = (t.reshape(-1)[packing.where] for t in (input_ids, token_type_ids, position_ids))
        packed = _packed(model, "auto")
        if packed.torch_hooked():
            raise InputError("Stepper runs the inference fast path, where torch module hooks, task modules "
                             "(adapters, prefixes) and LoRA hooks do not act: remove them (or run the model itself)")
        self.blocks = packed.blocks
        self.T = T
        self.attention = FastBert(model).attention_route()
        self.rows = torch.arange(B)
        self.workspace = _Workspace()
        with torch.inference_mode():
            self.x = model.embeddings(ids[None], tts[None], pos[None])[0]  # (N, H)

    def run_block(self, i: int) -> None:
        with torch.inference_mode():
            self.x = self.blocks[i](self.x, varlen.Packing.of_rows(self.lengths, self.T, self.x.device), self.attention,
                                    self.workspace)

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
