"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), written out.

A frozen weight W (out, in) gets a trainable low-rank update:

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T        A: (r, in), B: (out, r)

A starts random (Kaiming-uniform, as the paper's reference code), B at zero, so training starts from the
pretrained model exactly. Only A and B train: for BERT-base with r = 8 on query and value that is 0.27 %
of the parameters. ``merge`` folds B A (alpha / r) into W, giving plain nn.Linear layers again (no cost at
inference, and a checkpoint transformers reads); ``adapter_state`` is the small part worth saving alone.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import InputError


class LoRALinear(nn.Module):
    """``base`` (an nn.Linear, frozen) plus the low-rank update ``(alpha / r) B A``."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.r, self.scale = r, alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features, dtype=base.weight.dtype, device=base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=base.weight.dtype, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):  # (..., in)
        return self.base(x) + (self.dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scale  # (..., out)

    def merged(self) -> nn.Linear:
        """A plain nn.Linear computing the same function: W + (alpha / r) B A."""
        with torch.no_grad():
            weight = self.base.weight + (self.lora_B @ self.lora_A) * self.scale
        linear = nn.Linear(self.base.in_features, self.base.out_features, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            linear.bias.copy_(self.base.bias)
        return linear


def apply_lora(model: nn.Module, *, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               targets=("query", "value"), train: tuple[str, ...] = ("classifier", "qa_outputs")) -> nn.Module:
    """Freeze ``model`` and wrap every attention projection named in ``targets`` (of query, key, value,
    output) in LoRA. Modules whose attribute name is in ``train`` (the task head) stay trainable."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InputError(f"r={r!r} must be a positive int (the rank)")
    unknown = set(targets) - {"query", "key", "value", "output"}
    if unknown or not targets:
        raise InputError(f"targets {tuple(targets)}: choose among query, key, value, output")
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "MultiHeadSelfAttention":
            for target in targets:
                layer = getattr(module, target)
                if isinstance(layer, LoRALinear):
                    raise InputError(f"{name}.{target} already has LoRA")
                setattr(module, target, LoRALinear(layer, r, alpha, dropout))
                wrapped += 1
    if not wrapped:
        raise InputError("no attention layer found to adapt")
    for attribute in train:
        head = getattr(model, attribute, None)
        if head is not None:
            for p in head.parameters():
                p.requires_grad_(True)
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA update into its weight: plain nn.Linear layers again (save_pretrained works)."""
    for module in list(model.modules()):
        for attribute, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, attribute, child.merged())
    return model


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only what LoRA training changed: every lora_A / lora_B and the trainable head, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()
            if "lora_" in name or p.requires_grad}


def trainable_share(model: nn.Module) -> float:
    """Trainable parameters / all parameters."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad) / total


def save_adapters(model: nn.Module, path) -> None:
    """Write ``adapter_state(model)`` (LoRA A and B, and the trained head) to a .safetensors file: a few
    hundred KB instead of the whole model."""
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in adapter_state(model).items()}, str(path))


def load_adapters(model: nn.Module, path) -> nn.Module:
    """Put saved adapters into a model that ``apply_lora`` prepared the same way (same rank and targets);
    a name or shape that does not fit is an InputError."""
    from safetensors.torch import load_file

    saved = load_file(str(path))
    params = dict(model.named_parameters())
    wrong = [n for n, t in saved.items() if n not in params or params[n].shape != t.shape]
    if wrong:
        raise InputError(f"{path}: {len(wrong)} adapter tensor(s) do not fit this model (apply_lora with the same "
                         f"rank and targets first): {wrong[:4]}")
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    return model
