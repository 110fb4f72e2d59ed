"""A BERT block fused for inference on packed real tokens (``tools/fast.py`` runs them): Q, K and V from one
(3H x H) product, each product on the fp32 route ``tools/kernels.py`` chose (or an int8 model's own kernels),
attention within each sequence (``tools/varlen.py``), residual + LayerNorm with the model's own LayerNorm
modules, and the two big buffers reused by every block of a forward pass (``Workspace``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..activations import GELU_APPROXIMATE
from ..quantize import Int8Linear, PackedInt8, concat_rows
from . import kernels, varlen


class PackedLinear:
    """y = x W^T + b (optionally followed by GELU) by one of ``tools.kernels``' fp32 routes (``route``:
    ``fp32_kernel``, or for ``"auto"`` the one measured fastest for this weight's shape on this CPU), or on
    a oneDNN-prepacked weight (half precision)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, gelu: str | None = None,
                 fp32_kernel: str = "auto"):
        self.weight, self.bias, self.gelu = weight.detach(), bias.detach(), gelu
        self.packed = self.blocks = None
        self.route = "linear"
        if not kernels.MKLDNN or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16,
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
            self.k = kernels.summation_block(*weight.shape)
            if self.k is not None:
                self.blocks = kernels.pack_blocks(weight, self.k)
        self.route = "onednn" if self.packed is not None else "blocked" if self.blocks is not None else "linear"

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: (N, in). ``out``: an (N, out) buffer to write into (F.linear only), see ``Workspace``."""
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


class Workspace(dict):
    """Large buffers reused by every block of one forward pass. A fresh (N, 3H) or (N, F) tensor above
    glibc's 32 MB mmap limit is new memory each time: every page faults on first touch, which cost more
    than the GELU itself at 32 x 128 tokens. Reusing one buffer per kind faults once per forward."""

    def get(self, name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        buf = dict.get(self, name)
        if buf is None or buf.shape != shape:
            buf = self[name] = like.new_empty(shape)
        return buf


class PackedInt8Linear:
    """An int8 model's linear layer (``minibert.quantize``) with PackedLinear's calling convention; ``out`` is
    not used (the quantised kernel allocates its result)."""

    def __init__(self, kernel: PackedInt8, gelu: str | None = None):
        self.kernel, self.gelu, self.packed = kernel, gelu, None
        self.weight = kernel.qweight  # (out, in): for shapes only

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = self.kernel(x)  # activations quantised per token
        return torch.ops.aten.gelu_(y, approximate=self.gelu) if self.gelu is not None else y


class FusedBlock:
    def __init__(self, block, hidden_act: str, plan: dict[str, str]):
        """``plan``: the fp32 route of each product (``PRODUCTS``: a route of ``kernels.ROUTES``, or "auto" for
        the one measured for its shape alone)."""
        a, f = block.attn, block.ffn
        self.heads, self.d = a.num_heads, a.head_size
        gelu = GELU_APPROXIMATE.get(hidden_act)
        if isinstance(a.query, Int8Linear):  # an int8 model: its own quantised weights, Q, K, V fused by rows
            self.qkv = PackedInt8Linear(PackedInt8(concat_rows([a.query.qweight, a.key.qweight, a.value.qweight]),
                                              torch.cat([a.query.bias, a.key.bias, a.value.bias])))
            self.out = PackedInt8Linear(a.output.kernel())
            self.ffn_in = PackedInt8Linear(f.dense_in.kernel(), gelu=gelu)
            self.ffn_out = PackedInt8Linear(f.dense_out.kernel())
        else:
            self.qkv = PackedLinear(torch.cat([a.query.weight, a.key.weight, a.value.weight]),
                               torch.cat([a.query.bias, a.key.bias, a.value.bias]), fp32_kernel=plan["qkv"])  # (3H, H)
            self.out = PackedLinear(a.output.weight, a.output.bias, fp32_kernel=plan["attention output"])
            self.ffn_in = PackedLinear(f.dense_in.weight, f.dense_in.bias, gelu=gelu, fp32_kernel=plan["ffn in"])
            self.ffn_out = PackedLinear(f.dense_out.weight, f.dense_out.bias, fp32_kernel=plan["ffn out"])
        self.attn_norm = block.attn_norm
        self.act = None if gelu is not None else f.act  # applied separately when not fusable
        self.ffn_norm = block.ffn_norm

    def __call__(self, x: torch.Tensor, packing: varlen.Packing, attention: str, ws: "Workspace") -> torch.Tensor:
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

