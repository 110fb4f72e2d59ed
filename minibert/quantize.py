"""int8 dynamic quantisation: the encoder's linear layers in 8-bit integers, everything else in fp32.

    model = BertModel.from_pretrained("weights/all-MiniLM-L6-v2", dtype="int8")

Each linear layer of each block (Q, K, V, attention output, both feed-forward layers) becomes an
``Int8Linear``:

    W_q = round(W / s_o)  per output channel o, s_o = max |W[o, :]| / 127        int8, once, at load time
    x_q = round(x / s_x) + z_x  per call (dynamic), per sequence                   uint8 (7 bits on x86)
    y   = s_x s_o (x_q - z_x) . W_q + b                                            int32 sums, fp32 result

computed by PyTorch's own quantised kernel (``torch.ops.quantized.linear_dynamic``: fbgemm / oneDNN on
x86, qnnpack on ARM); no kernel here is hand-written. Embeddings, LayerNorms, attention (softmax over
fp32 scores), GELU, the pooler and task heads stay fp32. On x86 the activations use 7 of the 8 bits
(``reduce_range``), as torch's own dynamic quantisation does there, so that AVX2's 16-bit intermediate
sums (vpmaddubsw) cannot saturate; the error is the same on every x86 CPU.

``model.py`` is unchanged: its ``nn.Linear`` modules are swapped for ``Int8Linear`` ones after loading,
and both the readable forward pass and the fast path (``tools.fast``) run them. An int8 model is for
inference: it does not train, and ``save_pretrained`` refuses it (save the fp32 model; quantise on load).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .errors import InputError

#: the linear layers of a block that int8 replaces: (attribute path in the block)
BLOCK_LINEARS = ("attn.query", "attn.key", "attn.value", "attn.output", "ffn.dense_in", "ffn.dense_out")


def _reduce_range() -> bool:
    return torch.backends.quantized.engine in ("x86", "fbgemm", "onednn")


def quantize_weight(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per output channel (rows): a quantised (out, in) tensor with one scale per row."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # (out,)
    with warnings.catch_warnings():  # torch 2.13 announces a future move of quantised tensors; they work today
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)


def concat_rows(qweights: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-channel int8 matrices along the output rows (the fused QKV of the fast path): exact, since
    each row keeps its own scale."""
    ints = torch.cat([q.int_repr() for q in qweights])
    scales = torch.cat([q.q_per_channel_scales() for q in qweights])
    zeros = torch.cat([q.q_per_channel_zero_points() for q in qweights])
    return torch._make_per_channel_quantized_tensor(ints, scales, zeros, 0)


class PackedInt8:
    """A quantised weight and fp32 bias prepacked for PyTorch's dynamic int8 linear kernel."""

    def __init__(self, qweight: torch.Tensor, bias: torch.Tensor | None):
        self.qweight, self.bias = qweight, None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack(qweight, self.bias)
        self.reduce_range = _reduce_range()
        self.out_features = qweight.shape[0]

    def __call__(self, x: torch.Tensor, splits=None) -> torch.Tensor:
        """x: (N, in) fp32 rows -> (N, out) fp32. ``splits`` (rows per sequence): each sequence's activations
        get their own scale, so a sequence's result never depends on the other rows it is batched with."""
        x = x.float().contiguous()
        if splits is None:
            return torch.ops.quantized.linear_dynamic(x, self.packed, self.reduce_range)
        return torch.cat([torch.ops.quantized.linear_dynamic(chunk.contiguous(), self.packed, self.reduce_range)
                          for chunk in x.split(list(splits))])


class Int8Linear(nn.Module):
    """An ``nn.Linear`` with int8 per-channel weights and dynamically quantised activations (see above)."""

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
        """x: (..., in). A 3-D input (B, T, in) is quantised one sequence at a time, so that a sequence's
        result does not depend on the others in the batch (the fast path does the same over real tokens)."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        splits = [shape[1]] * shape[0] if x.dim() == 3 else None  # one scale per sequence
        return self.kernel()(rows, splits).reshape(*shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.dequantize()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_kernel"] = None
        return state

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, dynamic"


def quantize_linears(model: nn.Module) -> nn.Module:
    """Swap every block's linear layers of ``model`` (a BertModel or a task model) for ``Int8Linear``, in
    place; returns the model, marked ``model.quantized = "int8"``."""
    encoder = getattr(model, "bert", model)
    if getattr(encoder, "quantized", None):
        return model
    if encoder.dtype != torch.float32:
        raise InputError(f"int8 quantisation starts from fp32 weights; this model is {encoder.dtype}")
    if encoder.device.type != "cpu":
        raise InputError(f"int8 dynamic quantisation runs on the CPU; this model is on {encoder.device}")
    for block in encoder.encoder.blocks:
        for path in BLOCK_LINEARS:
            parent_name, _, name = path.rpartition(".")
            parent = block.get_submodule(parent_name)
            linear = getattr(parent, name)
            if isinstance(linear, nn.Linear):
                setattr(parent, name, Int8Linear(linear))
    encoder.quantized = "int8"
    if encoder is not model:
        model.quantized = "int8"
    return model
