"""int8 dynamic quantisation: the encoder's linear layers in 8-bit integers, everything else in fp32.

    model = BertModel.from_pretrained("weights/all-MiniLM-L6-v2", dtype="int8")

Each linear layer of each block (Q, K, V, attention output, both feed-forward layers) becomes an
``Int8Linear``, y = x W^T + b computed as

    W_q[o] = clamp(round(W[o] / s_o), -64, 64)    int8 per output channel, once, at load time; s_o is the
                                                   step (of those with clip 72-100 % of max |W[o]|) with
                                                   the least squared error on that row
    per token t (dynamic, on every call):
      c_t = (max x_t + min x_t) / 2,  a_t = (max x_t - min x_t) / 2        the token's centre and half-range
      u_t = (x_t - c_t) / a_t                                              in [-1, 1]
      q_t = round(u_t / (2/255)) + 128,  clamped to [0, 255]               uint8, all 8 bits
    y_t = (a_t (q_t - 128) 2/255 + c_t) . (s W_q)^T + b                     int32 sums, fp32 result
        = a_t (q_t - 128) 2/255 . (s W_q)^T  +  c_t sum_i (s W_q)[:, i]  +  b

The centre goes through the same int8 weights as the rest of the token, so an entry near zero stays near
zero (rather than becoming -c_t times the weights' rounding error).

The integer products run in PyTorch's own int8 kernels; no kernel here is hand-written. fbgemm's (the
"x86" and "fbgemm" engines) is handed the grid above (``linear_with_input_q_dq_qweight_dq_output_fp32``);
oneDNN's dynamic kernel (``torch.ops.quantized.linear_dynamic``) quantises its input over the whole matrix's
min and max, so one extra row holding -1 and 1 goes with every call there: the grid is then exactly the
one above, whatever the other rows. Either way each token's result is independent of the batch by
construction (up to the kernel's fp32 rounding of the rescale, which may differ with the number of rows).
Which library runs the kernel is chosen per CPU (``int8_engine``): oneDNN where the CPU has VNNI or AMX
int8 instructions (2.6x fbgemm's speed at 1024 x 768 x 3072 on a Xeon with AMX); otherwise every engine
torch has (oneDNN, x86, fbgemm, qnnpack) is timed against fp32 once on this CPU and the fastest taken --
and when even that one is slower than fp32, quantising says so (``say_if_slower_than_fp32``): int8 then
saves memory, not time. Integer sums are exact in every engine, so the results agree up to fp32 rounding.

Embeddings, LayerNorms, attention (softmax over fp32 scores), GELU, the pooler and task heads stay fp32.

Why per token: a token's activations spread over very different ranges (LayerNorm outputs against GELU's
outliers), and one scale for a whole sequence spends most of its 8 bits on the widest token: on
all-MiniLM-L6-v2 the sentence vectors then agree with fp32 only to cosine 0.95. Each token centred and
scaled to its own range agrees to 0.99+.

Why |W_q| <= 64: AVX2 / AVX-512 int8 kernels without VNNI multiply uint8 by int8 in pairs summed into 16
bits (``vpmaddubsw``), which saturates above 32767. With activations on all 8 bits (<= 255) and weights
within 64, a pair is at most 2 * 255 * 64 = 32640: no CPU can saturate, so the error is the same on
every x86 CPU. (torch's own dynamic quantisation takes the bit from the activations instead --
``reduce_range`` -- which costs far more accuracy here.)

``model.py`` is unchanged: its ``nn.Linear`` modules are swapped for ``Int8Linear`` ones after loading,
and both the readable forward pass and the fast path (``tools.fast``) run them. An int8 model is for
inference: it does not train, and ``save_pretrained`` refuses it (save the fp32 model; quantise on load).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch
from torch import nn

from .checks import check_parts, encoder_of
from .errors import InputError

#: the linear layers of a block that int8 replaces: (attribute path in the block)
BLOCK_LINEARS = ("attn.query", "attn.key", "attn.value", "attn.output", "ffn.dense_in", "ffn.dense_out")
#: the largest weight magnitude: 2 * 255 * 64 = 32640 fits a 16-bit sum (see above)
WEIGHT_MAX = 64
#: the clips tried per weight row, as fractions of its largest magnitude (the least squared error wins)
CLIP_RATIOS = tuple(round(0.72 + 0.04 * i, 2) for i in range(8))
#: CPU flags with int8 dot-product instructions, where oneDNN's int8 kernels are the fast ones
INT8_DOT_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")


#: the product an engine is timed on: (rows, in, out) -- a BERT-base FFN-in on 256 tokens
ENGINE_PROBE = (256, 768, 3072)
#: torch's quantised engines that run int8 linear layers on x86 / Arm (the ones this torch has are tried)
ENGINES = ("onednn", "x86", "fbgemm", "qnnpack")


#: oneDNN's instruction-set caps below its int8 dot products (``$ONEDNN_MAX_CPU_ISA``, formerly ``$DNNL_MAX_CPU_ISA``):
#: under one, oneDNN's int8 kernels run as on a CPU without VNNI -- which also lets a VNNI machine measure that case
NO_DOT_ISAS = ("SSE41", "AVX", "AVX2", "AVX512_CORE")


def onednn_isa_cap() -> str:
    """The instruction-set cap oneDNN was given in the environment ("" when none)."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


def has_int8_dot() -> bool:
    """Whether this CPU has int8 dot-product instructions (VNNI, AMX-int8) that oneDNN may use: where int8 beats
    fp32 easily. A cap on oneDNN's instruction set below them (``NO_DOT_ISAS``) means it may not."""
    from .hardware import cpu_info

    if onednn_isa_cap() in NO_DOT_ISAS:
        return False
    _, flags = cpu_info()
    return any(f in flags for f in INT8_DOT_FLAGS)


@functools.lru_cache(maxsize=None)
def int8_engine() -> str:
    """The quantised engine whose kernels run int8 linear layers on this CPU: ``"onednn"`` where the CPU
    has int8 dot products (VNNI, AMX) and torch has oneDNN; otherwise the fastest of torch's engines on
    this CPU (``engine_choice``: measured once, kept)."""
    if has_int8_dot() and "onednn" in torch.backends.quantized.supported_engines:
        return "onednn"
    return engine_choice()["engine"]


def engine_choice() -> dict:
    """How int8 runs on this CPU: ``{"engine", "dot_instructions", "relative_to_fp32"}``. With VNNI / AMX
    oneDNN is taken unmeasured (``relative_to_fp32`` None); without them every engine this torch has is
    timed against fp32's F.linear on ``ENGINE_PROBE`` (``engine_times``) and the fastest taken -- kept per
    machine in ``int8_engines.json`` (``minibert.measured``)."""
    from . import measured

    if has_int8_dot() and "onednn" in torch.backends.quantized.supported_engines:
        return {"engine": "onednn", "dot_instructions": True, "relative_to_fp32": None}
    cap = onednn_isa_cap()  # a capped oneDNN is another machine as far as the timings go
    path, machine = measured.cache_dir() / "int8_engines.json", measured.machine_key()
    what = "x".join(map(str, ENGINE_PROBE)) + (f" isa {cap}" if cap else "")
    entry = measured.saved_entry(path, machine, what)
    times = entry.get("relative_to_fp32") if entry else None
    usable = [e for e in ENGINES if e in torch.backends.quantized.supported_engines]
    if not (isinstance(times, dict) and times and set(times) <= set(usable)):
        times = {e: round(t, 3) for e, t in engine_times(*ENGINE_PROBE).items()}
        if times:
            measured.write_json_entry(path, machine, what, {"relative_to_fp32": times})
    engine = min(times, key=times.get) if times else torch.backends.quantized.engine
    return {"engine": engine, "dot_instructions": False, "relative_to_fp32": times}


def engine_times(rows: int, in_features: int, out_features: int, rounds: int = 3) -> dict[str, float]:
    """Each engine's time for one int8 product of (rows, in) x (out, in)^T relative to fp32 F.linear's: the
    best of ``rounds`` alternating calls after a warm-up each. An engine that fails here is left out."""
    import time

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    q = quantize_weight(w)
    fns = {"fp32": lambda: torch.nn.functional.linear(x, w, b)}
    for engine in ENGINES:
        if engine not in torch.backends.quantized.supported_engines:
            continue
        try:
            kernel = PackedInt8(q, b, engine=engine)
            kernel(x)
        except RuntimeError:
            continue
        fns[engine] = lambda kernel=kernel: kernel(x)
    best = dict.fromkeys(fns, float("inf"))
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round warms up
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start) if _ else best[name]
    return {name: t / best["fp32"] for name, t in best.items() if name != "fp32"}


_said_slow: list = []


def say_if_slower_than_fp32(stacklevel: int = 3) -> None:
    """When int8 is asked for on a CPU where even its fastest engine is slower than fp32 (no VNNI / AMX int8
    instructions), say so once per process: the memory saving stays, the speed does not come."""
    choice = engine_choice()
    times = choice["relative_to_fp32"]
    if choice["dot_instructions"] or not times or _said_slow:
        return
    best = min(times.values())
    if best <= 1.0:
        return
    _said_slow.append(True)
    from .hardware import cpu_info

    tried = ", ".join(f"{e} {t:.2f}x" for e, t in sorted(times.items(), key=lambda x: x[1]))
    warnings.warn(f"int8 on this CPU ({cpu_info()[0] or 'unknown model'}: no VNNI or AMX int8 instructions) is slower "
                  f"than fp32: every engine torch has was tried on a {' x '.join(map(str, ENGINE_PROBE))} product "
                  f"({tried} fp32's time) and the fastest, {choice['engine']}, is used. int8 still makes the linear "
                  "weights 4x smaller; for speed, use fp32 on this CPU", RuntimeWarning, stacklevel=stacklevel)


@contextlib.contextmanager
def _engine(name: str):
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per output channel (rows), |q| <= WEIGHT_MAX, each row's step chosen among the clips
    ``CLIP_RATIOS`` of its largest magnitude for the least squared error: a quantised (out, in) qint8
    tensor with one scale per row."""
    w = weight.detach().float()
    largest = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)  # (out, 1)
    best_error, best_scale = None, None
    for ratio in CLIP_RATIOS:
        scale = largest * ratio / WEIGHT_MAX
        error = ((w / scale).round_().clamp_(-WEIGHT_MAX, WEIGHT_MAX).mul_(scale).sub_(w)).square_().sum(1, keepdim=True)
        if best_error is None:
            best_error, best_scale = error, scale
        else:
            better = error < best_error
            best_error, best_scale = torch.where(better, error, best_error), torch.where(better, scale, best_scale)
    scales = best_scale.squeeze(1).double()  # (out,)
    ints = (w / best_scale).round_().clamp_(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8)
    with warnings.catch_warnings():  # torch 2.13 announces a future move of quantised tensors; they work today
        warnings.filterwarnings("ignore", message=".*quantized.*")
        return torch._make_per_channel_quantized_tensor(ints, scales, torch.zeros_like(scales, dtype=torch.long), 0)


def concat_rows(qweights: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-channel int8 matrices along the output rows (the fused QKV of the fast path): exact, since
    each row keeps its own scale."""
    ints = torch.cat([q.int_repr() for q in qweights])
    scales = torch.cat([q.q_per_channel_scales() for q in qweights])
    zeros = torch.cat([q.q_per_channel_zero_points() for q in qweights])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized.*")
        return torch._make_per_channel_quantized_tensor(ints, scales, zeros, 0)


#: torch's int8 kernel that quantises its fp32 input on a grid it is given (scale, zero point) rather than on
#: the input's own min and max, returning fp32: fbgemm's (the "x86" and "fbgemm" engines); None where absent
FIXED_GRID = getattr(getattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", None), "default", None)
GRID_STEP, GRID_ZERO = 1 / 255, 128  # [-1/2, 1/2] on the 255 steps of uint8: q = round(255 u) + 128


class PackedInt8:
    """A quantised weight prepacked for PyTorch's int8 linear kernel (of ``int8_engine()``), with the fp32
    bias and the row sums of the quantised weight (what the tokens' centres are multiplied by)."""

    def __init__(self, qweight: torch.Tensor, bias: torch.Tensor | None, engine: str | None = None):
        self.qweight = qweight
        self.bias = None if bias is None else bias.detach().float()
        self.row_sums = qweight.dequantize().sum(1)  # (out,): sum_i (s W_q)[o, i]
        with warnings.catch_warnings(), _engine(engine or int8_engine()):
            warnings.filterwarnings("ignore", message=".*quantized.*")
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.out_features = qweight.shape[0]
        self.ends = torch.full((1, qweight.shape[1]), 0.5)
        self.ends[0, 0] = -0.5
        self.fixed_grid = _takes_a_grid(self.packed, qweight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, in) fp32 rows (tokens) -> (N, out) fp32; each row quantised on its own range. (The range
        used is [-1/2, 1/2] after dividing by the full span: the same 255 levels as [-1, 1] by the half-span,
        a few small operations fewer, which is what one short input spends its time on.)

        Where the engine's kernel takes the grid (``FIXED_GRID``: fbgemm's), it is handed the grid and
        quantises on it; elsewhere (oneDNN's) the kernel quantises on its input's own min and max, so one
        extra row holding -1/2 and 1/2 makes that range exactly [-1/2, 1/2]. The same grid and integer sums
        (a value on a half step, as each row's minimum is, may round either way: a step on an entry, tested),
        with no extra row to write and no min and max for the kernel to find (on an AMD EPYC Zen 3 at 16
        rows: 0.77 of the extra row's time for all-MiniLM-L6-v2's 24 products, 0.93 of its whole forward)."""
        N = x.shape[0]
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)  # (N, 1) each (aminmax is slower here)
        span = (hi - lo).clamp_(min=1e-30)  # a constant row: zeros below, only its centre goes through
        centre = lo.add_(span, alpha=0.5)  # (N, 1)
        if self.fixed_grid:
            u = torch.sub(x, centre).div_(span)  # (x - c) / span, in [-1/2, 1/2] (the kernel clamps to the grid)
            y = FIXED_GRID(u, GRID_STEP, GRID_ZERO, self.packed)  # (N, out)
        else:
            u = x.new_empty(N + 1, x.shape[1])  # (N + 1, in)
            torch.sub(x, centre, out=u[:N]).div_(span).clamp_(-0.5, 0.5)  # (x - c) / span
            u[N:] = self.ends  # the extra row: the kernel's range is exactly [-1/2, 1/2] in every call
            y = torch.ops.quantized.linear_dynamic(u, self.packed, False)[:N]  # (N, out)
        y = y.mul_(span).addr_(centre.view(-1), self.row_sums)  # span_t products + c_t sum_i (s W_q)[o, i]
        return y if self.bias is None else y.add_(self.bias)


def _takes_a_grid(packed, in_features: int) -> bool:
    """Whether ``FIXED_GRID`` runs on ``packed`` (an engine without it raises)."""
    if FIXED_GRID is None:
        return False
    try:
        FIXED_GRID(torch.zeros(1, in_features), GRID_STEP, GRID_ZERO, packed)
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Int8Linear(nn.Module):
    """An ``nn.Linear`` with int8 per-channel weights and activations quantised per token (see above)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", quantize_weight(linear.weight))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self._kernel = None

    def kernel(self) -> PackedInt8:
        if self._kernel is None:  # made on first use, and again after a copy (prepacked weights do not copy)
            self._kernel = PackedInt8(self.qweight, self.bias)
        return self._kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in) -> (..., out); every token (row) is quantised on its own, so a padded batch gives
        each real token what it gets alone."""
        if x.requires_grad and torch.is_grad_enabled():
            raise InputError("int8 layers have no gradient (dynamic quantisation is for inference): run under "
                             "torch.no_grad(), or use the fp32 model for gradients")
        shape = x.shape
        return self.kernel()(x.reshape(-1, shape[-1])).reshape(*shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.dequantize()

    def refuses(self, doing: str) -> str | None:  # checks.check_parts asks
        if doing == "save":
            return ("this model is int8-quantised, which is for inference only: save the fp32 model and load it "
                    "with dtype='int8'")
        if doing == "export":
            return ("this model is int8-quantised with torch's operators, which an ONNX graph cannot hold: export "
                    "the fp32 model (int8=True / --int8 quantises the exported graph with ONNX Runtime)")
        return None

    @property
    def weight(self) -> torch.Tensor:  # (out, in) fp32: what the int8 weights stand for, for reading
        return self.dequantized_weight()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_kernel"] = None
        return state

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 weights per channel "
                f"(|q| <= {WEIGHT_MAX}), activations per token")


def quantize_linears(model: nn.Module) -> nn.Module:
    """Swap every block's linear layers of ``model`` (a BertModel or a task model) for ``Int8Linear``, in
    place, and freeze what stays fp32 (int8 is for inference); returns the model, marked
    ``model.quantized = "int8"``. A part that refuses (``checks.check_parts``: a LoRA layer, a LoRA task
    module), a layer that is not a plain nn.Linear or one with torch forward hooks is refused before any swap."""
    encoder = encoder_of(model)
    if getattr(encoder, "quantized", None):
        return model
    check_parts(model, "int8")  # a LoRA layer or task module that cannot be quantised says so itself
    if encoder.dtype != torch.float32:
        raise InputError(f"int8 quantisation starts from fp32 weights; this model is {encoder.dtype}")
    if encoder.device.type != "cpu":
        raise InputError(f"int8 dynamic quantisation runs on the CPU; this model is on {encoder.device}")
    places = []
    for i, block in enumerate(encoder.encoder.blocks):
        for path in BLOCK_LINEARS:
            parent_name, _, name = path.rpartition(".")
            parent = block.get_submodule(parent_name)
            linear = getattr(parent, name)
            if not isinstance(linear, nn.Linear):  # checked for every layer before any is swapped
                raise InputError(f"blocks.{i}.{path} is a {type(linear).__name__}, not an nn.Linear: int8 "
                                 "quantises plain linear layers")
            if linear._forward_hooks or linear._forward_pre_hooks:
                raise InputError(f"blocks.{i}.{path} carries torch forward hooks, which the int8 layer would "
                                 "drop: remove them first")
            places.append((parent, name, linear))
    say_if_slower_than_fp32(stacklevel=4)
    for parent, name, linear in places:
        setattr(parent, name, Int8Linear(linear))
    for p in model.parameters():  # inference only: what is left in fp32 (embeddings, LayerNorms) is frozen too
        p.requires_grad_(False)
    encoder.quantized = "int8"
    if encoder is not model:
        model.quantized = "int8"
    return model
