"""A BERT block fused for inference on packed real tokens (``tools/fast.py`` runs them): Q, K and V from one
(3H x H) product, each product on the fp32 route ``tools/kernels.py`` chose (or an int8 model's own kernels),
attention within each sequence (``tools/varlen.py``), residual + LayerNorm with the model's own LayerNorm
modules, and the two big buffers reused by every block of a forward pass (``Workspace``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..activations import GELU_APPROXIMATE
from ..model import Embeddings
from ..quantize import Int8Linear, PackedInt8, concat_rows
from . import kernels, varlen


def embed(embeddings, ids: torch.Tensor, token_types: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The embeddings of packed tokens (each argument (N,)) -> (N, H): ``model.Embeddings``' sum and
    LayerNorm as plain operators (its numbers bit for bit, without its six module calls: one short input
    spends ~0.1 ms on them on a Zen 4); any other embeddings module is called as it is."""
    if type(embeddings) is not Embeddings or type(embeddings.norm) is not torch.nn.LayerNorm:
        return embeddings(ids[None], token_types[None], positions[None])[0]
    x = (F.embedding(ids, embeddings.word.weight) + F.embedding(token_types, embeddings.token_type.weight)
         ) + F.embedding(positions, embeddings.position.weight)  # (N, H): the module's order
    return _layer_norm(embeddings.norm)(x)


def _layer_norm(module):
    """``module`` (a LayerNorm) as one call: torch's own LayerNorm as ``F.layer_norm`` on its parameters
    (one module call fewer, twelve a BERT block pair), any other norm module as it is."""
    if type(module) is not torch.nn.LayerNorm:
        return module
    shape, weight, bias, eps = module.normalized_shape, module.weight, module.bias, module.eps
    return lambda x: F.layer_norm(x, shape, weight, bias, eps)


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

    @property
    def takes_out(self) -> bool:
        """Whether ``out`` is used (F.linear and the blocked route write into it; oneDNN allocates its own)."""
        return self.packed is None

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
        self.takes_out = False

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
        # the model's own LayerNorm parameters (an edit reaches them; a replaced module makes these copies stale)
        self.attn_norm, self.ffn_norm = _layer_norm(block.attn_norm), _layer_norm(block.ffn_norm)
        self.act = None if gelu is not None else f.act  # applied separately when not fusable

    def __call__(self, x: torch.Tensor, packing: varlen.Packing, attention: str, ws: "Workspace") -> torch.Tensor:
        """x: (N, H) packed real tokens; ``packing``: where they sit in the batch (``tools.varlen``);
        ``attention``: the kernel that attends within each sequence (``varlen.ROUTES``)."""
        N = x.shape[0]
        qkv = self.qkv(x, out=ws.get("qkv", (N, 3 * self.heads * self.d), x) if self.qkv.takes_out else None)
        ctx = varlen.attend(attention, qkv, packing, self.heads, self.d**-0.5)  # (N, H); qkv (N, 3H)
        x = self.attn_norm(self.out(ctx).add_(x))  # residual, then LayerNorm
        buffer = ws.get("inner", (N, self.ffn_in.weight.shape[0]), x) if self.ffn_in.takes_out else None
        inner = self.ffn_in(x, out=buffer)  # (N, F)
        if self.act is not None:
            inner = self.act(inner)
        return self.ffn_norm(self.ffn_out(inner).add_(x))

