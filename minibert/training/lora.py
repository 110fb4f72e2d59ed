"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"), written out.

A frozen weight W (out, in) gets a trainable low-rank update:

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T        A: (r, in), B: (out, r)

A starts random (Kaiming-uniform, as the paper's reference code), B at zero, so training starts from the
pretrained model exactly. Only A and B train: for BERT-base with r = 8 on query and value that is 0.27 %
of the parameters. Any linear layer can be adapted (the attention projections, the feed-forward), chosen by
name or pattern (``apply_lora(model, targets=("query", "value", "dense_in"))``). ``merge`` folds B A (alpha / r) into W, giving plain nn.Linear layers again (no cost at
inference, and a checkpoint transformers reads); ``adapter_state`` is the small part worth saving alone.
"""

from __future__ import annotations

import fnmatch
import math
import re

import torch
from torch import nn

from ..checks import check_positive, encoder_of
from ..errors import InputError


class LoRAPair(nn.Module):
    """A (r, in) and B (out, r) of one adapted linear layer; the update is (alpha / r) B A dropout(x). A
    starts Kaiming-uniform (from ``generator``, or torch's global one), B at zero."""

    def __init__(self, in_features: int, out_features: int, r: int, alpha: float, dropout: float = 0.0, dtype=None,
                 device=None, generator: torch.Generator | None = None):
        super().__init__()
        self.r, self.scale = r, alpha / r
        self.lora_A = nn.Parameter(torch.empty(r, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, dtype=dtype, device=device))
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.dropout = nn.Dropout(dropout)

    def update(self, x):  # (..., in) -> (..., out)
        return (self.dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scale

    def forward(self, x):
        return self.update(x)


class LoRALinear(LoRAPair):
    """``base`` (an nn.Linear, frozen; with or without a bias) plus the low-rank update ``(alpha / r) B A``.

    It reads like the Linear it adapts: ``weight`` is the effective (out, in) matrix W + (alpha / r) B A
    (computed on access, with autograd through A and B), ``bias``, ``in_features`` and ``out_features``
    are the base layer's. So code that reads a Linear's weights -- the fast path's fused products, an
    analysis of W_Q -- sees what this layer computes (dropout on the LoRA branch acts in training only)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        for p in base.parameters():
            p.requires_grad_(False)
        super().__init__(base.in_features, base.out_features, r, alpha, dropout, dtype=base.weight.dtype,
                         device=base.weight.device)
        self.base = base

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:  # (out, in): the merged product
        return self.base.weight + (self.lora_B @ self.lora_A) * self.scale

    @property
    def bias(self) -> torch.Tensor | None:  # (out,) or None
        return self.base.bias

    def forward(self, x):  # (..., in)
        return self.base(x) + self.update(x)  # (..., out)

    def refuses(self, doing: str) -> str | None:  # checks.check_parts asks before a save or int8
        if doing == "save":
            return ("a LoRA layer, which a BERT checkpoint has no names for: fold them in with "
                    "minibert.training.lora.merge_lora(model) and save that, or save the adapters alone with "
                    "save_adapters")
        if doing == "int8":
            return ("a LoRA layer: int8 quantises plain linear layers (fold LoRA in first: "
                    "minibert.training.lora.merge_lora)")
        return None

    def merged(self) -> nn.Linear:
        """A plain nn.Linear computing the same function: W + (alpha / r) B A (no bias if the base has none)."""
        with torch.no_grad():
            weight = self.weight
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=weight.device,
                           dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        linear.train(self.training)
        return linear

    def extra_repr(self) -> str:
        return f"r={self.r}, scale={self.scale:g}"


#: the short target names: the attention projections and the feed-forward layers of every block
SHORT_TARGETS = ("query", "key", "value", "output", "dense_in", "dense_out")


#: our module paths -> transformers', so that targets written for peft (``intermediate.dense``,
#: ``attention.output.dense``, ``output.dense``) choose the same layers here
_TRANSFORMERS_PATHS = [(re.compile(r"encoder\.blocks\.(\d+)\.attn\.(query|key|value)$"), r"encoder.layer.\1.attention.self.\2"),
                       (re.compile(r"encoder\.blocks\.(\d+)\.attn\.output$"), r"encoder.layer.\1.attention.output.dense"),
                       (re.compile(r"encoder\.blocks\.(\d+)\.ffn\.dense_in$"), r"encoder.layer.\1.intermediate.dense"),
                       (re.compile(r"encoder\.blocks\.(\d+)\.ffn\.dense_out$"), r"encoder.layer.\1.output.dense"),
                       (re.compile(r"mlm_head\.transform$"), "cls.predictions.transform.dense")]


def transformers_path(name: str) -> str:
    """The path transformers gives the module we call ``name`` (``bert.encoder.blocks.0.ffn.dense_in`` ->
    ``bert.encoder.layer.0.intermediate.dense``); other names are the same in both."""
    for pattern, replacement in _TRANSFORMERS_PATHS:
        found = pattern.search(name)
        if found:
            return name[:found.start()] + found.expand(replacement)
    return name


def _matches(name: str, target: str) -> bool:
    """peft's rule, on a module path: the whole path, its last parts (``*.`` + target), or a shell pattern."""
    return fnmatch.fnmatchcase(name, target) or fnmatch.fnmatchcase(name, "*." + target)


def lora_targets(model: nn.Module, targets) -> list[str]:
    """The names (as ``named_modules()`` gives them) of the nn.Linear layers of ``model`` that ``targets``
    choose. A target is a short name, matched as the last part of a block's linear layer (``query``,
    ``key``, ``value``, ``output`` in attention; ``dense_in``, ``dense_out`` in the feed-forward), or a
    dotted name or shell-style pattern matched against the full names or their last parts (``*.ffn.*``,
    ``blocks.0.attn.query``, ``encoder.blocks.1[01].attn.*``) -- in minibert's names or in transformers'
    (``intermediate.dense``, ``attention.output.dense``; ``output.dense`` is, as in peft, both W_O and
    the feed-forward's output). Each target must choose at least one layer."""
    if isinstance(targets, str):
        targets = (targets,)
    targets = tuple(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise InputError(f"targets={targets!r}: give layer names or patterns, e.g. ('query', 'value') or '*.ffn.*'")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, LoRALinear))
               and "task_modules." not in f".{name}"}  # the base's layers, not those of adapters on it
    in_blocks = [n for n in linears if ".blocks." in f".{n}"]
    chosen: list[str] = []
    for target in targets:
        found = [n for n in linears if _matches(n, target) or _matches(transformers_path(n), target)
                 or (target in SHORT_TARGETS and n in in_blocks and n.rpartition(".")[2] == target)]
        if not found:
            raise InputError(f"LoRA targets: {target!r} matches no linear layer; short names: {SHORT_TARGETS}; "
                             f"full names look like {in_blocks[0] if in_blocks else next(iter(linears), '?')!r} "
                             "or transformers' (intermediate.dense); shell patterns allowed")
        chosen += [n for n in found if n not in chosen]
    nested = [n for n in chosen if ".base" in f".{n}" or n.endswith(".base")]
    adapted = [n for n in chosen if isinstance(linears[n], LoRALinear)]
    if adapted or nested:
        raise InputError(f"{(adapted or nested)[0]} already has LoRA")
    return chosen


def apply_lora(model: nn.Module, *, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               targets=("query", "value"), train: tuple[str, ...] = ("classifier", "qa_outputs")) -> nn.Module:
    """Freeze ``model`` and wrap the linear layers that ``targets`` choose in LoRA, in place (see
    ``lora_targets``: short names such as ``query`` or ``dense_in``, or patterns such as ``*.ffn.*``).
    Modules whose attribute name is in ``train`` (the task head) stay trainable. An int8 model is refused
    (LoRA trains fp32 weights: adapt, merge, then quantise)."""
    check_positive("r", r, "the rank")
    if getattr(encoder_of(model), "quantized", None):
        raise InputError("this model is int8-quantised (inference only): apply LoRA to the fp32 model, "
                         "merge_lora, then quantise")
    names = lora_targets(model, targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, LoRALinear(getattr(parent, attribute), r, alpha, dropout))
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

    from ..textfiles import atomic_file

    with atomic_file(path) as tmp:
        save_file({name: t.contiguous() for name, t in adapter_state(model).items()}, str(tmp))


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
