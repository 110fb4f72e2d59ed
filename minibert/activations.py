"""The feed-forward activations a BERT config may name (``hidden_act``), as transformers names them.

The one table of them: the config validates against it, the model applies it, and the fast path asks
it which GELU variant (if any) a fused kernel can compute.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def gelu_tanh_written_out(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU as the original TF code wrote it ("gelu_new" in transformers).
    There is nothing scary in it: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: name -> function. "gelu" is the exact erf GELU, x * Phi(x): BERT's default. The tanh approximations
#: differ from it by up to ~5e-4, far above our parity bound, so the names must not be mixed up.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": gelu_tanh_written_out,
    "gelu_pytorch_tanh": gelu_tanh,
    "relu": F.relu,
}

#: the activations that are torch's GELU, by its ``approximate=`` argument (what a fused GELU kernel
#: computes); the others run as their own operation
GELU_APPROXIMATE = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}
