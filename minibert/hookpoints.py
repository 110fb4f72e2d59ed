"""HookPoint: a named place in the forward pass where an activation can be read or replaced.

The model passes every activation worth studying through an identity module, ``x = self.hook_q(x)``.
A point's name comes from where it sits in the module tree (``minibert.tools.hooks`` walks
``named_modules()``), so no module knows its own dotted name. With nothing registered a point is one
truth test of an empty list: no copies, no autograd nodes, no torch module hooks.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .errors import InputError

HookFn = Callable[[torch.Tensor, str], "torch.Tensor | None"]


class HookPoint(nn.Module):
    """Identity, unless functions are registered: then each ``fn(x, name)`` is called in turn and may
    return None (it only reads, or edited ``x`` in place) or a tensor of ``x``'s shape that replaces it."""

    #: functions registered at any point of any model (kept by minibert.tools.hooks): when 0, nothing
    #: anywhere is hooked, which the fast path can tell without walking a module tree
    registered = 0

    def __init__(self):
        super().__init__()
        self.fns: list[tuple[str, HookFn]] = []  # (point name, function), set by minibert.tools.hooks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # not nn.Module.__call__: ~100 ns when unused
        if not self.fns:
            return x
        for name, fn in self.fns:
            result = fn(x, name)
            if result is None or result is x:
                continue
            if not isinstance(result, torch.Tensor) or result.shape != x.shape:
                got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
                raise InputError(f"hook at {name!r} returned {got}; a replacement must be a tensor of the "
                                 f"activation's shape {tuple(x.shape)}")
            x = result
        return x

    forward = __call__

    def __getstate__(self):  # registered functions belong to a `with` block, never to a copy or a pickle
        state = self.__dict__.copy()
        state["fns"] = []
        return state

    def __deepcopy__(self, memo):
        new = HookPoint()
        new.training = self.training
        return new
