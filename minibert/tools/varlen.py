"""Attention on packed tokens: a batch's real tokens in one (N, ...) matrix, and the kernels that attend
within each sequence of it.

The fast path (``tools.fast``) drops padding once per forward pass: ``pack(attention_mask)`` computes,
once, where the real tokens are (``Packing``: their flat indices, tokens per row, the cumulative offsets
``cu_seqlens`` and the longest row), every block works on the (N, H) matrix of real tokens, and the
hidden states are scattered back to (B, T, H) once at the end. Attention is the one step that must know
where a sequence starts and ends; four kernels can do it, all computing softmax(Q K^T / sqrt(d)) V within
each sequence (``ROUTES``):

* ``"loop"``: one ``scaled_dot_product_attention`` call per sequence, on its own tokens. No wasted work,
  one kernel launch per sequence and block: right on a CPU (the default there), ruinous on a GPU.
* ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` -- FlashAttention's variable-length kernel, one
  launch for the whole batch, reading ``cu_seqlens``. CUDA, fp16/bf16, where this torch has it.
* ``"nested"``: ``scaled_dot_product_attention`` on nested (jagged) tensors: one call, the kernel is torch's.
* ``"padded"``: the packed Q, K, V laid back into (R, longest, ...) rows with a key mask, one padded
  ``scaled_dot_product_attention`` call (what transformers does), then packed again. Padding's work is done
  in attention only; every other product still runs on real tokens.

A batch without padding skips all of that: one dense ``scaled_dot_product_attention`` call.

Which kernel runs is chosen as ``tools.kernels`` chooses the fp32 products: ``attention_route(device,
dtype, head_size)`` returns ``$MINIBERT_ATTENTION`` when set (checked), ``"loop"`` on a CPU, and on a GPU
the fastest of the routes this device, dtype and torch can run, measured once on a mixed-length batch
(``calibrate``: 64 sequences of 8-256 tokens), kept per device name, dtype, head size and torch version in
the process and in ``attention.json`` beside ``fp32_kernels.json``.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import InputError
from .. import measured
from . import timing

ROUTES = ("loop", "varlen", "nested", "padded")
OVERRIDE_ENV = "MINIBERT_ATTENTION"



# ------------------------------------------------------------------------------------------- packing
@dataclass
class Packing:
    """Where a (B, T) batch's real tokens are, computed once per forward pass. Rows without any real
    token are left out of ``lengths`` / ``cu_seqlens`` (they have nothing to attend with)."""

    B: int
    T: int
    where: torch.Tensor | None  # (N,) flat indices into the (B * T) grid of the real tokens, row by row
    lengths: list[int]  # real tokens of each row that has any, in row order (sum = N)
    cu_seqlens: torch.Tensor  # (R + 1,) int32 on the batch's device: row r is packed rows cu[r]:cu[r + 1]
    max_len: int  # the longest row's real tokens
    dense: bool = False  # no padding at all: the (B * T) tokens in order, attended in one dense call
    _padded: tuple | None = field(default=None, repr=False)  # (slots, key mask) for the padded route, made once
    _offsets: torch.Tensor | None = field(default=None, repr=False)  # cu_seqlens in int64 (nested route), made once

    def offsets(self) -> torch.Tensor:
        """``cu_seqlens`` as int64, what nested tensors take: made on first use, kept for every block."""
        if self._offsets is None:
            self._offsets = self.cu_seqlens.long()
        return self._offsets

    @classmethod
    def of_rows(cls, lengths: list[int], T: int, device=None) -> "Packing":
        """The packing of rows already packed back to back (``tools.fast.Stepper``'s rows left): no grid
        to scatter into, attention within each row."""
        cu = torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        return cls(len(lengths), T, None, list(lengths), cu, max(lengths, default=0))

    def to(self, device) -> "Packing":
        """This packing with its index tensors on ``device``, copied without blocking the host (from pinned
        memory to a GPU): made on the host from a CPU mask, it costs the forward no read-back."""
        device = torch.device(device)

        def move(t):
            if t is None or t.device == device:
                return t
            return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)
        return Packing(self.B, self.T, move(self.where), list(self.lengths), move(self.cu_seqlens), self.max_len,
                       self.dense)

    def scatter(self, packed: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (B, T, H): each real token back in its place, zeros at padding."""
        H = packed.shape[-1]
        if self.dense:
            return packed.view(self.B, self.T, H)
        full = packed.new_zeros(self.B * self.T, H)
        full[self.where] = packed
        return full.view(self.B, self.T, H)

    def padded_slots(self):
        """For the padded route: (slots (N,) indices into an (R x max_len) grid, key mask (R, 1, 1, max_len)
        bool, True = a real key), computed on first use and kept."""
        if self._padded is None:
            # sizes from the host's lengths, never read back from the device (no sync on a GPU)
            N = sum(self.lengths)
            lengths = torch.tensor(self.lengths, device=self.cu_seqlens.device)
            rows = torch.repeat_interleave(torch.arange(len(self.lengths), device=lengths.device), lengths,
                                           output_size=N)
            rank = torch.arange(N, device=lengths.device) - self.cu_seqlens[:-1].long()[rows]
            keys = torch.arange(self.max_len, device=lengths.device)[None, :] < lengths[:, None]  # (R, max_len)
            self._padded = (rows * self.max_len + rank, keys[:, None, None, :])
        return self._padded


def pack(attention_mask: torch.Tensor | None, B: int, T: int, device=None) -> Packing:
    """The ``Packing`` of a (B, T) batch: ``attention_mask`` nonzero = real token (any layout: right or
    left padding, holes), None = every token is real."""
    if attention_mask is None:
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
        return Packing(B, T, None, [T] * B, cu, T, dense=True)
    real = attention_mask.bool()  # (B, T)
    where = real.reshape(-1).nonzero().squeeze(1)
    lengths = [n for n in real.sum(1).tolist() if n]  # one device-to-host copy per forward, not per block
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(real.device)
    return Packing(B, T, where, lengths, cu, max(lengths, default=0))


# ---------------------------------------------------------------------------------- the kernels
def attend(route: str, qkv: torch.Tensor, packing: Packing, heads: int, scale: float) -> torch.Tensor:
    """Self-attention within each sequence. qkv: (N, 3H) packed rows of [Q | K | V]; returns (N, H)."""
    N = qkv.shape[0]
    d = qkv.shape[1] // (3 * heads)
    if packing.dense:  # no padding: one call for the whole batch
        B, T = packing.B, packing.T
        q, k, v = qkv.view(B, T, 3, heads, d).permute(2, 0, 3, 1, 4)  # each (B, h, T, d)
        ctx = F.scaled_dot_product_attention(q, k, v, scale=scale)  # (B, h, T, d)
        return ctx.transpose(1, 2).reshape(N, heads * d)
    return _KERNELS[route](qkv.view(N, 3, heads, d), packing, scale).reshape(N, heads * d)


def _loop(qkv, packing, scale):
    parts = []
    for chunk in qkv.split(packing.lengths):  # (L, 3, h, d): one sequence
        q, k, v = chunk.permute(1, 2, 0, 3)[:, None]  # each (1, h, L, d)
        parts.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1))  # (L, h, d)
    return torch.cat(parts)  # (N, h, d)


def _varlen(qkv, packing, scale):
    q, k, v = qkv.unbind(1)  # each (N, h, d)
    return call_varlen(q, k, v, packing.cu_seqlens, packing.max_len, scale)  # (N, h, d)


def call_varlen(q, k, v, cu_seqlens, longest: int, scale: float | None):
    """``varlen_attn`` as the route calls it, on every torch that has it (the capability probe calls this
    too): ``scale`` passed where the kernel takes it (torch >= 2.12); torch 2.10 and 2.11 have no such
    keyword and scale by 1/sqrt(d), so another scale is folded into q there."""
    kernel = varlen_kernel()
    if _takes_scale(kernel):
        return kernel(q, k, v, cu_seqlens, cu_seqlens, longest, longest, scale=scale)
    d = q.shape[-1]
    if scale is not None and scale != d ** -0.5:
        q = q * (scale * d ** 0.5)
    return kernel(q, k, v, cu_seqlens, cu_seqlens, longest, longest)


def _takes_scale(kernel) -> bool:
    try:
        parameters = inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # a builtin without a signature: call it as the oldest one is called
        return False
    return "scale" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _nested(qkv, packing, scale):
    # the shortest and longest rows given from the host: left out, SDPA on jagged tensors reads each from
    # the device (.item(): a host sync, several per block)
    offsets, shortest, longest = packing.offsets(), min(packing.lengths), packing.max_len
    q, k, v = (torch.nested.nested_tensor_from_jagged(t.contiguous(), offsets, min_seqlen=shortest,
                                                      max_seqlen=longest).transpose(1, 2)
               for t in qkv.unbind(1))  # each (R, h, j, d)
    with warnings.catch_warnings():  # torch calls nested tensors a prototype, once per call on a CPU
        warnings.simplefilter("ignore", UserWarning)
        return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).values()  # (N, h, d)


def _padded(qkv, packing, scale):
    slots, keys = packing.padded_slots()
    N, _, h, d = qkv.shape
    R, L = len(packing.lengths), packing.max_len
    grid = qkv.new_zeros(R * L, 3, h, d)
    grid[slots] = qkv
    q, k, v = grid.view(R, L, 3, h, d).permute(2, 0, 3, 1, 4)  # each (R, h, L, d)
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keys, scale=scale)  # (R, h, L, d)
    return ctx.transpose(1, 2).reshape(R * L, h, d)[slots]  # (N, h, d)


_KERNELS = {"loop": _loop, "varlen": _varlen, "nested": _nested, "padded": _padded}


def varlen_kernel():
    """The variable-length kernel the ``"varlen"`` route calls (torch's ``varlen_attn``; None where this torch
    has none). Imported on first use: its module imports torch's compiler (about 1 s), which no CPU run
    needs. Tests swap in ``varlen_reference`` to run the route's bookkeeping on a CPU."""
    try:  # torch >= 2.10; the kernel itself runs on CUDA only
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - older torch
        return None
    return varlen_attn


def varlen_reference(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
    """``varlen_attn``'s contract in plain torch (any device, any dtype): q, k, v (N, h, d), sequence i
    is rows cu[i]:cu[i + 1]; returns (N, h, d). A stand-in to test the packing against, not a fast path."""
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    assert cu_seq_q.dtype == torch.int32 and int(cu_seq_q[-1]) == q.shape[0]
    assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    out = torch.empty_like(q)
    bounds = cu_seq_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (h, L, d)
        scores = (qi @ ki.transpose(-1, -2)).float() * (scale if scale is not None else q.shape[-1] ** -0.5)
        out[start:end] = (scores.softmax(-1).to(v.dtype) @ vi).transpose(0, 1)
    return out


# --------------------------------------------------------------------------------- choosing a route
def runs_here(route: str, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
    """Whether ``route`` can run for this device, dtype and head size: loop, nested and padded anywhere
    torch's SDPA runs; varlen on CUDA in fp16/bf16 where this torch has ``varlen_attn`` and a tiny call of it
    succeeds (FlashAttention's head sizes and GPU generations)."""
    if route not in ROUTES:
        return False
    if route != "varlen":
        return True
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or varlen_kernel() is None:
        return False
    key = (str(device), dtype, head_size)
    if key not in _RUNS:
        try:
            probe(device, dtype, head_size)
            _RUNS[key] = True
        except Exception:  # noqa: BLE001 - no CUDA build (AssertionError), no kernel for this GPU / head size
            _RUNS[key] = False
    return _RUNS[key]


def probe(device, dtype, head_size: int) -> None:
    """A tiny call of the varlen kernel, made exactly as the route makes it (``call_varlen``): raises where
    the kernel cannot run."""
    x = torch.zeros(4, 1, head_size, device=device, dtype=dtype)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32, device=device)
    call_varlen(x, x, x, cu, 3, head_size ** -0.5)


def why_not(route: str) -> str:
    """What ``route`` needs, said when it was asked for where it cannot run."""
    if route == "varlen":
        has = "has" if varlen_kernel() is not None else "lacks"
        return (f"varlen_attn (FlashAttention) needs a CUDA device, fp16 or bf16, a head size and GPU it supports, "
                f"and torch.nn.attention.varlen (torch {torch.__version__} {has} it)")
    return f"use one of {ROUTES}"


_RUNS: dict[tuple, bool] = {}
_CHOICES: dict[tuple, str] = {}


def forced_route() -> str | None:
    """``$MINIBERT_ATTENTION`` when set (checked), else None."""
    return measured.forced_choice(OVERRIDE_ENV, ROUTES)


def check_route(route: str) -> str:
    if route != "auto" and route not in ROUTES:
        raise InputError(f"attention={route!r}: use 'auto' or one of {ROUTES}")
    return route


def calibration_batch(device, dtype, head_size: int, rows: int = 64, low: int = 8, high: int = 256, seed: int = 0):
    """A mixed-length batch to time the routes on: ``rows`` sequences of ``low``..``high`` tokens (fixed
    lengths from ``seed``), 12 heads of ``head_size``: (qkv (N, 3H), Packing)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (rows,), generator=g)
    mask = torch.arange(high)[None, :] < lengths[:, None]  # (rows, high), right padding
    packing = pack(mask.to(device), rows, high)
    qkv = torch.randn(int(lengths.sum()), 3 * 12 * head_size, generator=g).to(device=device, dtype=dtype)
    return qkv, packing


def calibrate(device, dtype, head_size: int, rounds: int = 5, **batch) -> dict[str, float]:
    """Each route's time on ``calibration_batch`` (``batch``: its options) relative to the padded route's
    (1.0; the fastest's where padded fails): the best of ``rounds`` alternating calls after a warm-up call
    of each, ``device`` itself synchronised after each call (not the current device: a model on cuda:1).
    A route that raises on this batch is left out and named in a warning (a kernel this GPU or dtype does
    not have), never chosen; the forward is not the place to find out."""
    device = torch.device(device)
    qkv, packing = calibration_batch(device, dtype, head_size, **batch)
    scale = head_size ** -0.5
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(route):
        def run():
            attend(route, qkv, packing, 12, scale)
            sync()
        return run

    available, failed = [], {}
    with torch.inference_mode():
        for route in ROUTES:
            if not runs_here(route, device, dtype, head_size):
                continue
            try:
                timed(route)()
                available.append(route)
            except Exception as e:  # noqa: BLE001 - whatever the kernel raises, the route is not taken
                failed[route] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if failed:
            warnings.warn(f"attention routes that failed on {device} ({dtype}, head size {head_size}) and are "
                          f"not used: " + "; ".join(f"{r} ({why})" for r, why in failed.items()), RuntimeWarning,
                          stacklevel=2)
        if not available:
            raise RuntimeError(f"no attention route runs on {device} in {dtype}: " + "; ".join(failed.values()))
        times = timing.alternate({r: timed(r) for r in available}, rounds, warmup=1, rotate=True)
    best = {r: min(t) for r, t in times.items()}
    base = best.get("padded", min(best.values()))
    return {r: best[r] / base for r in available}


def device_key(device: torch.device) -> str:
    """What a measured choice holds for: the device's name (a GPU's model) and torch's version."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else measured.machine_key()
    return f"{name} | torch {torch.__version__}"


def cache_file():
    """Where measured attention choices are kept: ``attention.json`` under ``$MINIBERT_CACHE``."""
    return measured.cache_dir() / "attention.json"


def attention_route(device, dtype: torch.dtype, head_size: int) -> str:
    """The route ``attention="auto"`` takes here (see the module docstring): ``$MINIBERT_ATTENTION``, else
    ``"loop"`` on a CPU, else the one measured fastest on this GPU for this dtype and head size (measured
    once, then kept in this process and in ``attention.json``)."""
    device = torch.device(device)
    forced = forced_route()
    if forced is not None:
        return forced if runs_here(forced, device, dtype, head_size) else "padded"
    if device.type != "cuda":
        return "loop"
    machine, what = device_key(device), f"{str(dtype).replace('torch.', '')} d={head_size}"
    key = (machine, what)
    if key not in _CHOICES:
        def measure():
            relative = calibrate(device, dtype, head_size)
            return {"route": min(relative, key=relative.get),
                    "relative_time": {r: round(t, 3) for r, t in relative.items() if math.isfinite(t)}}

        # measured once per machine, one process at a time (Ray actors sharing a GPU take the first one's
        # choice instead of each measuring under the others' load)
        entry = measured.measure_once(cache_file(), machine, what, measure=measure, usable=lambda e: e.get(
            "route") in ROUTES and runs_here(e["route"], device, dtype, head_size))
        _CHOICES[key] = entry["route"]
    return _CHOICES[key]
