"""HookPoint: a named place in the forward pass where an activation can be read or replaced.

The model passes every activation worth studying through an identity module, ``x = self.hook_q(x)``.
A point's name comes from where it sits in the module tree (``minibert.tools.hooks`` walks
``named_modules()``), so no module knows its own dotted name. With nothing registered a point costs a few
truth tests of empty containers: no copies, no autograd nodes. torch's own module hooks
(``register_forward_hook`` and friends, which tools such as captum use) are honoured: a point with any of
them, or with a global module hook, goes through ``nn.Module.__call__``, which runs them around
``forward``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from .errors import InputError

HookFn = Callable[[torch.Tensor, str], "torch.Tensor | None"]

# torch's global module hooks (torch.nn.modules.module.register_module_forward_hook): dicts that torch
# fills and empties in place
GLOBAL_FORWARD_HOOKS = _torch_module._global_forward_hooks
GLOBAL_FORWARD_PRE_HOOKS = _torch_module._global_forward_pre_hooks


class HookPoint(nn.Module):
    """Identity, unless functions are registered: then each ``fn(x, name)`` is called in turn and may
    return None (it only reads, or edited ``x`` in place) or a tensor of ``x``'s shape that replaces it."""

    #: functions registered at any point of any model (kept by minibert.tools.hooks): when 0, nothing
    #: anywhere is hooked, which the fast path can tell without walking a module tree
    registered = 0

    def __init__(self):
        super().__init__()
        self.fns: list[tuple[str, HookFn]] = []  # (point name, function), set by minibert.tools.hooks

    _torch_hooks = False  # set when a torch module hook is registered here (see register_forward_hook)

    @property
    def torch_hooked(self) -> bool:
        """Whether a torch module hook applies here (this point's own, or a global one)."""
        if self._torch_hooks and not (self._forward_hooks or self._forward_pre_hooks or self._backward_hooks
                                      or self._backward_pre_hooks):
            self._torch_hooks = False  # all removed again (a handle removes itself from torch's dict)
        return self._torch_hooks or bool(GLOBAL_FORWARD_HOOKS or GLOBAL_FORWARD_PRE_HOOKS)

    @property
    def active(self) -> bool:
        """Whether anything will see this point's activation: a registered function or a torch hook."""
        return bool(self.fns) or self.torch_hooked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._torch_hooks or GLOBAL_FORWARD_HOOKS or GLOBAL_FORWARD_PRE_HOOKS:
            if self.torch_hooked:
                return nn.Module.__call__(self, x)  # torch's hooks around forward (our functions inside it)
        if not self.fns:
            return x  # nothing registered: ~100 ns, no copy, no autograd node
        return self.forward(x)

    # torch's registration methods, noted so that an unhooked point stays a few truth tests
    def register_forward_hook(self, *args, **kwargs):
        self._torch_hooks = True
        return super().register_forward_hook(*args, **kwargs)

    def register_forward_pre_hook(self, *args, **kwargs):
        self._torch_hooks = True
        return super().register_forward_pre_hook(*args, **kwargs)

    def register_full_backward_hook(self, *args, **kwargs):
        self._torch_hooks = True
        return super().register_full_backward_hook(*args, **kwargs)

    def register_full_backward_pre_hook(self, *args, **kwargs):
        self._torch_hooks = True
        return super().register_full_backward_pre_hook(*args, **kwargs)

    def register_backward_hook(self, *args, **kwargs):
        self._torch_hooks = True
        return super().register_backward_hook(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each registered ``fn(x, name)`` in turn (see the class docstring)."""
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

    def __getstate__(self):  # registered functions belong to a `with` block, never to a copy or a pickle
        state = self.__dict__.copy()
        state["fns"] = []
        return state

    def __deepcopy__(self, memo):
        new = HookPoint()
        new.training = self.training
        return new
