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
   decides on the whole block (``tools/plan.py``: a product's speed alone need not hold in the forward pass).
   ``fp32_kernel="linear" | "blocked" | "onednn"`` (or ``$MINIBERT_FP32_KERNEL``) fixes the route;
   ``routes(model)`` says which ones a model runs. The fast path stays within 2x the fp32 noise floor of
   the readable path on the exact routes and within 4x on oneDNN's own order (tested).
   bf16/fp16 weights are prepacked once into oneDNN's blocked layout (AMX kernels), and the GELU runs
   inside the first FFN product wherever a weight is prepacked.
4. **inference_mode**, in-place residual adds and GELU, PyTorch's fused attention kernel, and the two
   big per-block buffers (QKV and FFN inner) reused by every block of a forward pass (``tools/blocks.py``:
   the fused block).

5. **One short input compiled** (``prepare(model, compile=True)``, ``tools/compiled.py``): one input of a few
   real tokens runs the readable model compiled ahead of time for this CPU (AOTInductor; one C++ call, no
   Python between operators) where that measured faster than the above, built once per machine and weights.

An int8 model (``dtype="int8"``, ``minibert.quantize``) runs its own quantised weights here, Q, K and V
fused by rows (activations are quantised per token, so packing does not change their quantisation).

The embeddings, LayerNorms, activation and pooler compute with the model's own parameters (torch's
LayerNorm and BERT's embeddings as plain operators on them, ``tools.blocks.embed``: the same numbers
without the module calls; any other such module is called as it is). The fused/packed weight
copies live in a cache beside the model, never inside it (copying, pickling and saving a model never see
them), keyed weakly (freed with the model), checked for staleness on each call against the parameters
they were made from (an in-place edit, a new tensor, ``.to()``: cheap, no walk over the module tree), and
freed on demand with ``release(model)``; ``cached_bytes(model)`` says what they hold (``tools/copies.py``).

``output_hidden_states`` (True, False or indices) keeps only the hidden states asked for; the rest are
freed block by block. ``tf32=True`` lets fp32 products on a GPU run in TensorFloat-32 (off by default);
``cuda_graphs=True`` replays a captured graph per shape (``tools/graphs.py``).

Outputs at padded positions are zeros (the readable path leaves arbitrary, unused values there). When
attention maps, hooks (minibert's or torch's own module hooks), training mode or a norm placement other
than BERT's (``models/norms.py``) are involved the call goes to the readable model instead, since only it
computes those.
"""

from __future__ import annotations

import torch

from ..errors import InputError
from ..checks import check_index
from ..inputs import check_blocks, check_inputs
from ..model import BertModel, BertOutput
from . import compiled as compiling, kernels, varlen
from .blocks import PackedInt8Linear, Workspace, embed
from .copies import cached_bytes, copies_of, release
from .graphs import TF32, GraphCache
from .hooks import has_hooks

__all__ = ["prepare", "FastBert", "routes", "noise_factor", "release", "cached_bytes", "kept_states", "Stepper",
           "host_packing", "FP32_KERNELS", "NOISE_FACTOR", "summation_block"]

FP32_KERNELS = ("auto",) + kernels.ROUTES  # see the module docstring, point 3, and tools/kernels.py
summation_block = kernels.summation_block  # public here too: README and the benchmarks name it so


#: how far the fast path may be from the readable path, in fp32 noise floors (``minibert.testing.
#: fp32_noise_floor``), by route: the exact routes 2x (they sum every product as F.linear does; packing and
#: fused attention move the rest), oneDNN's own order 4x (measured up to ~2.2x)
NOISE_FACTOR = {"linear": 2, "blocked": 2, "onednn": 4}


def noise_factor(model: BertModel, fp32_kernel: str = "auto") -> int:
    """The bound (``NOISE_FACTOR``) of the routes ``model``'s fp32 fast path takes with ``fp32_kernel``, for
    any number of rows (the largest of every row bucket's plan)."""
    return max(NOISE_FACTOR[route] for rows in (1, None) for name, route in routes(model, fp32_kernel, rows=rows).items()
               if name != "attention")


def routes(model: BertModel, fp32_kernel: str = "auto", attention: str = "auto", rows: int | None = None
           ) -> dict[str, str]:
    """The route each of a block's products takes on the fast path with ``fp32_kernel`` (``"linear"``,
    ``"blocked"``, ``"onednn"``; int8 models: ``"int8"``), and the attention kernel (``"attention"``:
    ``tools.varlen.ROUTES``), as ``minibert inspect`` and the benchmarks report them, in a forward of
    ``rows`` real tokens (None: a batch's; ``tools.plan.bucket_of``). Builds the fast path's copies if they
    are not there yet (and measures what "auto" has not measured here yet)."""
    if fp32_kernel not in FP32_KERNELS:
        raise InputError(f"fp32_kernel={fp32_kernel!r}: use one of {FP32_KERNELS}")
    copies = copies_of(model, fp32_kernel)
    block = (copies.blocks if rows is None else copies.blocks_for(rows))[0]
    linears = {"qkv": block.qkv, "attention output": block.out, "ffn in": block.ffn_in, "ffn out": block.ffn_out}
    chosen = {name: "int8" if isinstance(linear, PackedInt8Linear) else linear.route for name, linear in linears.items()}
    return {**chosen, "attention": FastBert(model, attention=attention).attention_route()}



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
    shape on first sight (``tools.graphs.GraphCache``): one launch instead of hundreds, what a small batch's
    latency is made of; padded batches (an ``attention_mask`` given) run as usual. The 8 most recently used
    shapes are kept; traffic of many lengths declares the shapes worth a graph instead,
    ``cuda_graphs=[(1, 16), (1, 32)]``, and every other shape runs as usual.
    ``compile=True`` (an fp32 model on a CPU): one input of a few real tokens runs the model compiled ahead of
    time for this CPU where that measures faster (``tools.compiled``: built once per machine and weights,
    about a minute, kept under ``$MINIBERT_CACHE``; here, before the first query); ``compiled`` is it, or None
    where it could not be built or is nowhere faster (the log says why)."""

    def __init__(self, model: BertModel, *, fp32_kernel: str = "auto", attention: str = "auto", tf32: bool = False,
                 cuda_graphs=False, compile: bool = False):
        if not isinstance(model, BertModel):
            raise TypeError(f"fast.prepare takes a minibert BertModel, got {type(model).__name__}")
        if fp32_kernel not in FP32_KERNELS:
            raise InputError(f"fp32_kernel={fp32_kernel!r}: use one of {FP32_KERNELS}")
        if not isinstance(tf32, bool):
            raise InputError(f"tf32={tf32!r}: pass True or False")
        shapes = _graph_shapes(cuda_graphs)
        self.model = model
        self.fp32_kernel = fp32_kernel
        self.attention = varlen.check_route(attention)
        self.tf32 = tf32
        self.graphs = None if cuda_graphs is False else GraphCache(shapes=shapes)
        self.compiled = None
        if not isinstance(compile, bool):
            raise InputError(f"compile={compile!r}: pass True (compile one short input's forward) or False")
        if compile:
            if fp32_kernel in kernels.EXACT_ROUTES:
                raise InputError(f"compile=True sums the products in the compiled kernels' own order; "
                                 f"fp32_kernel={fp32_kernel!r} asks for F.linear's numbers: use fp32_kernel='auto' "
                                 "or 'onednn' with compile=True, or compile=False")
            self.compiled = compiling.compiled_for(model, copies_of(model, fp32_kernel), self._fast_forward)

    def _fast_forward(self, input_ids, token_type_ids, position_ids):
        """One input's hidden states on the fast path itself: what the compiled forward is timed against."""
        return self(input_ids, token_type_ids=token_type_ids, position_ids=position_ids, pooler=False).hidden_states

    def __repr__(self) -> str:
        return (f"FastBert({getattr(self.model, 'source', 'model')}, fp32_kernel={self.fp32_kernel!r}, "
                f"attention={self.attention!r}, tf32={self.tf32}, cuda_graphs={self.graphs is not None}, "
                f"compiled={self.compiled!r})")

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
                 skip_blocks=(), packing: varlen.Packing | None = None, pooler: bool = True) -> BertOutput:
        """As ``BertModel.forward``. ``output_hidden_states``: True (all of them, the default), False
        (``hidden_states`` is None) or the indices to keep (e.g. ``[-1]`` or ``[0, 6]``): ``hidden_states``
        then has its usual length with None in the places not kept. Only what is kept is scattered back to
        (B, T, H); the rest is freed block by block. ``packing``: the batch's ``varlen.Packing`` made on the
        host (``host_packing``), which also says its values were checked there: the forward then reads
        nothing back from the device. ``pooler=False``: ``pooler_output`` is None and the pooler is not
        run (a product whose weight one short input reads from memory: ~0.17 ms of MiniLM's 4.7 ms at
        1 x 16 on a Zen 4); encoders that pool tokens themselves (``encode``) pass it."""
        model = self.model
        if not isinstance(pooler, bool):
            raise InputError(f"pooler={pooler!r}: pass True (run the pooler) or False (pooler_output is None)")
        num_blocks, skip_blocks = check_blocks(model.config, num_blocks, skip_blocks)
        keep = kept_states(output_hidden_states, model.config, num_blocks)
        readable = (output_attentions or model.training or torch.compiler.is_compiling() or has_hooks(model)
                    or model.config.norm_placement != "post")  # the fused blocks are BERT's post-LN ones
        packed = None if readable else copies_of(model, self.fp32_kernel)  # its staleness checked once a call
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
            out.pooler_output = out.pooler_output if pooler else None
            return out
        input_ids, attention_mask, token_type_ids, position_ids = check_inputs(
            model.config, model.device, input_ids, attention_mask, token_type_ids, position_ids,
            check_values=packing is None)  # with a host packing the values were checked on the host
        if packing is not None:
            if (packing.B, packing.T) != tuple(input_ids.shape):
                raise InputError(f"packing is of a {packing.B} x {packing.T} batch; input_ids is "
                                 f"{tuple(input_ids.shape)} (make it with fast.host_packing of this batch)")
            attention_mask = None if packing.dense else attention_mask
        attention = self.attention_route()
        if (self.compiled is not None and attention_mask is None and input_ids.shape[0] == 1
                and num_blocks in (None, model.config.num_hidden_layers) and not skip_blocks
                and self.compiled.serves(input_ids.shape[1])):
            if not self.compiled.stale(packed):
                return self._run_compiled(input_ids, token_type_ids, position_ids, keep, pooler)
            compiling.say_once("fast path: the weights changed since they were compiled in; the compiled "
                               "forward is dropped (fast.prepare(model, compile=True) compiles them again)")
            self.compiled = None

        def forward(input_ids, token_type_ids, position_ids, attention_mask=attention_mask):
            return _forward(model, packed, attention, input_ids, attention_mask, token_type_ids,
                            position_ids, num_blocks, skip_blocks, keep, packing, pooler)
        with torch.inference_mode(), TF32(self.tf32 and model.device.type == "cuda"):
            if self.graphs is not None:
                self.graphs.check(model)
                # no padding: the shapes are static, the forward can be a graph (of a shape it wants)
                if attention_mask is None and self.graphs.wants(input_ids.shape):
                    key = (tuple(input_ids.shape), num_blocks, tuple(sorted(skip_blocks)), keep, attention, pooler)
                    return self.graphs.run(packed, key, forward, (input_ids, token_type_ids, position_ids),
                                           model.device)
            return forward(input_ids, token_type_ids, position_ids)

    def _run_compiled(self, input_ids, token_type_ids, position_ids, keep, pooler) -> BertOutput:
        """One input of real tokens through the compiled forward (``tools.compiled``), the pooler as the model's."""
        model = self.model
        with torch.inference_mode():
            states = self.compiled(input_ids, token_type_ids, position_ids)  # every hidden state, (1, T, H) each
            last_state = states[-1]
            pooled = model.pooler(last_state) if model.pooler is not None and pooler else None
        hidden_states = None if keep is None else tuple(t if i in keep else None for i, t in enumerate(states))
        return BertOutput(last_hidden_state=last_state, pooler_output=pooled, hidden_states=hidden_states)


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



def host_packing(model: BertModel, input_ids, attention_mask=None, token_type_ids=None,
                 position_ids=None) -> varlen.Packing:
    """A batch's inputs checked, and its ``Packing`` made, on the host -- from CPU tensors, so nothing waits
    for the GPU -- then the packing's indices copied to the model's device without blocking. Passed as
    ``fast(**batch, packing=...)`` with the same batch on the device, the forward reads nothing back from
    the device: no range check, no mask test, no lengths (``encode`` on a GPU does this for every batch,
    from the pinned batch it is about to copy)."""
    ids, mask, _, _ = check_inputs(model.config, torch.device("cpu"), input_ids, attention_mask, token_type_ids,
                                   position_ids)
    B, T = ids.shape
    return varlen.pack(mask, B, T).to(model.device)


def _graph_shapes(cuda_graphs):
    """``cuda_graphs`` checked: False (none), True (any shape: None) or the (B, T) shapes to capture."""
    if isinstance(cuda_graphs, bool):
        return None
    try:
        shapes = [tuple(s) for s in cuda_graphs]
        ok = bool(shapes) and all(len(s) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                      for n in s) for s in shapes)
    except TypeError:
        ok = False
    if not ok:
        raise InputError(f"cuda_graphs={cuda_graphs!r}: pass True or False, or the (batch, length) shapes to "
                         "capture, e.g. [(1, 16), (1, 32)]")
    return shapes


def prepare(model: BertModel, *, fp32_kernel: str = "auto", attention: str = "auto", tf32: bool = False,
            cuda_graphs=False, compile: bool = False) -> FastBert:
    """The fast path for ``model``: ``fast = prepare(model); out = fast(**batch)``. Cheap to call again:
    the weight copies are made on first use and shared by every FastBert of the same model and options.
    ``fp32_kernel``: ``"auto"`` (each product on the route measured fastest on this CPU, see
    ``tools/kernels.py``), ``"linear"`` (F.linear, no weight copies but the fused QKV), ``"blocked"``
    (oneDNN in F.linear's summation order where this CPU has one, else F.linear) or ``"onednn"``
    (oneDNN's own order) -- see the module docstring.
    ``attention``, ``tf32``, ``cuda_graphs`` and ``compile``: see ``FastBert`` (``compile=True`` loads or builds
    the compiled forward on every call: keep the FastBert it returns)."""
    return FastBert(model, fp32_kernel=fp32_kernel, attention=attention, tf32=tf32, cuda_graphs=cuda_graphs,
                    compile=compile)


def _forward(model, copies, attention, input_ids, attention_mask, token_type_ids, position_ids, num_blocks,
             skip_blocks, keep, packing=None, pooler=True):
    B, T = input_ids.shape
    if packing is None:
        packing = varlen.pack(attention_mask, B, T, device=input_ids.device)  # once for every block
    if packing.dense:
        ids, tts, pos = input_ids.reshape(-1), token_type_ids.reshape(-1), position_ids.reshape(-1)
    else:
        ids, tts, pos = (t.reshape(-1)[packing.where] for t in (input_ids, token_type_ids, position_ids))
    x = embed(model.embeddings, ids, tts, pos)  # (N, H): the model's own embeddings
    blocks = copies.blocks_for(x.shape[0])  # the plan of this many rows (a short input's, or the batches')

    last = _num_states(model.config, num_blocks) - 1
    kept = {0: x} if keep and 0 in keep else {}  # the packed (N, H) states asked for, by index
    workspace = Workspace()
    for i, block in enumerate(blocks[:num_blocks]):
        if i not in skip_blocks and x.shape[0]:  # (an all-padding batch has no token to run)
            x = block(x, packing, attention, workspace)
        if keep and i + 1 in keep:
            kept[i + 1] = x
    # back to (B, T, H) once, at the end: the states asked for, and the last one
    full = {i: packing.scatter(t) for i, t in kept.items()}
    last_state = full[last] if last in full else packing.scatter(x)
    pooled = model.pooler(last_state) if model.pooler is not None and pooler else None
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
        packed = copies_of(model, "auto")
        if packed.torch_hooked():
            raise InputError("Stepper runs the inference fast path, where torch module hooks, task modules "
                             "(adapters, prefixes) and LoRA hooks do not act: remove them (or run the model itself)")
        self.blocks = packed.blocks
        self.T = T
        self.attention = FastBert(model).attention_route()
        self.rows = torch.arange(B)
        self.workspace = Workspace()
        with torch.inference_mode():
            self.x = embed(model.embeddings, ids, tts, pos)  # (N, H)

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
