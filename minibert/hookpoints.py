"""HookPoint: a named place in the forward pass where an activation can be read or replaced.

The model passes every activation worth studying through an identity module, ``x = self.hook_q(x)``.
A point's name comes from where it sits in the module tree (``minibert.tools.hooks`` walks
``named_modules()``), so no module knows its own dotted name. With nothing registered a point is one
truth test of an empty list: no copies, no autograd nodes. torch's own module hooks registered on a point
(``register_forward_hook`` and friends, which tools such as captum use) are honoured: registering one puts
an entry in that list, and the point then goes through ``nn.Module.__call__``, which runs them around
``forward``.

Functions registered through ``registered`` (what ``minibert.tools.hooks.hooks`` does) belong to the thread
-- more exactly, the ``contextvars`` context -- that opened the ``with`` block: a point runs them only there
(``ACTIVE``). A server that ablates a head for one request leaves the forward passes other threads run at
the same time untouched. (torch's own module hooks are torch's: they fire in every thread.)
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
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


#: the entry a torch module hook puts in ``HookPoint.fns``, so that an unhooked point stays one truth test
TORCH_HOOKS = ("<torch module hooks>", None)

#: the ``with`` blocks open in this thread (or asyncio task): a function registered by another is not run here
ACTIVE: contextvars.ContextVar[frozenset] = contextvars.ContextVar("minibert_hook_blocks", default=frozenset())


class Scoped:
    """A registered function and the ``with`` block (``owner``) it belongs to."""

    __slots__ = ("fn", "owner")

    def __init__(self, fn: HookFn, owner: object):
        self.fn, self.owner = fn, owner

    def __call__(self, x: torch.Tensor, name: str):
        return self.fn(x, name)


def visible(fn) -> bool:
    """Whether a registered function runs in this thread / context (a torch-hooks entry never does: torch
    runs those)."""
    return fn is not None and (not isinstance(fn, Scoped) or fn.owner in ACTIVE.get())


class HookPoint(nn.Module):
    """Identity, unless functions are registered: then each ``fn(x, name)`` is called in turn and may
    return None (it only reads, or edited ``x`` in place) or a tensor of ``x``'s shape that replaces it.

    torch's own hooks registered on the point (``register_forward_hook`` and the other three) fire too: the
    point then runs through ``nn.Module.__call__``. (Global module hooks, ``register_module_forward_hook``,
    fire on every other module but not at hook points.)"""

    #: functions registered at any point of any model (kept by minibert.tools.hooks): when 0, no function is
    #: registered anywhere, which the fast path can tell without a tree walk (torch hooks it finds itself)
    registered = 0

    def __init__(self):
        super().__init__()
        self.fns: list[tuple[str, HookFn]] = []  # (point name, function), set by minibert.tools.hooks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fns:
            return x  # nothing registered: one truth test, no copy, no autograd node
        if TORCH_HOOKS in self.fns and self.torch_hooked:
            return nn.Module.__call__(self, x)  # torch's hooks around forward (our functions inside it)
        return self.forward(x) if self.fns else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each registered ``fn(x, name)`` in turn (see the class docstring)."""
        for name, fn in tuple(self.fns):  # a copy: other threads may add or remove theirs meanwhile
            if not visible(fn):  # TORCH_HOOKS (torch runs those itself), or another thread's block
                continue
            result = fn(x, name)
            if result is None or result is x:
                continue
            if not isinstance(result, torch.Tensor) or result.shape != x.shape:
                got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
                raise InputError(f"hook at {name!r} returned {got}; a replacement must be a tensor of the "
                                 f"activation's shape {tuple(x.shape)}")
            x = result
        return x

    # ----------------------------------------------------------------------------- torch's own hooks
    @property
    def torch_hooked(self) -> bool:
        """Whether a torch module hook is registered on this point. (A removed one is noticed here: its
        handle empties torch's dict, and the point's entry goes.)"""
        if TORCH_HOOKS not in self.fns:
            return False
        if self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks:
            return True
        self.fns.remove(TORCH_HOOKS)
        return False

    @property
    def active(self) -> bool:
        """Whether anything will see this point's activation: a registered function or a torch hook."""
        return bool(self.fns) and (self.torch_hooked or any(visible(fn) for _, fn in tuple(self.fns)))

    def _torch_hook_added(self) -> None:  # called by torch's register_*_hook methods (see _noting, below)
        if TORCH_HOOKS not in self.fns:
            self.fns.append(TORCH_HOOKS)

    # ------------------------------------------------------------------------------ copies, pickles
    def __getstate__(self):  # registered functions belong to a `with` block, never to a copy or a pickle
        state = self.__dict__.copy()
        state["fns"] = []
        for key in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            state[key] = type(state[key])()  # ... and so do torch hooks registered on it
        return state

    def __deepcopy__(self, memo):
        new = HookPoint()
        new.training = self.training
        return new


def _noting(register):
    """torch's ``register`` method, which also puts ``TORCH_HOOKS`` in the point's function list."""
    def method(self, *args, **kwargs):
        handle = register(self, *args, **kwargs)
        self._torch_hook_added()
        return handle
    method.__name__, method.__doc__ = register.__name__, register.__doc__
    return method


for _name in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
              "register_full_backward_pre_hook", "register_backward_hook"):
    setattr(HookPoint, _name, _noting(getattr(nn.Module, _name)))


@contextmanager
def registered(entries):
    """Register ``fn`` at each ``(point, name, fn)`` for the ``with`` block, visible to this thread (context)
    only; removed on exit, also when the block raises."""
    owner = object()
    added = []
    token = ACTIVE.set(ACTIVE.get() | {owner})
    try:
        for point, name, fn in entries:
            entry = (name, Scoped(fn, owner))
            point.fns.append(entry)
            added.append((point, entry))
            HookPoint.registered += 1
        yield
    finally:
        for point, entry in reversed(added):
            HookPoint.registered -= 1
            if entry in point.fns:
                point.fns.remove(entry)
        ACTIVE.reset(token)


class KeyValueSlot(nn.Module):
    """Where self-attention may be given keys and values beyond its own tokens': prefix-tuning (Li and
    Liang 2021) puts P learnt pairs before them, attended by every query and never hidden by the padding
    mask. Empty (``extend is None``), it returns its inputs: one test, nothing computed.

    ``extend``: a callable set from outside the model (``minibert.training.adapters``) that takes the
    tokens' keys (B, h, T, d) and returns the extra ``(keys, values)``, each (B, h, P, d), or None (none
    this call). The slot puts them first and widens the mask with P columns that are always True."""

    def __init__(self):
        super().__init__()
        self.extend = None

    def forward(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
        if self.extend is None:
            return k, v, mask
        extra = self.extend(k)
        if extra is None:
            return k, v, mask
        k_extra, v_extra = extra  # (B, h, P, d) each
        k, v = torch.cat([k_extra, k], dim=2), torch.cat([v_extra, v], dim=2)  # (B, h, P + T, d)
        if mask is not None:  # (B, 1, 1, T) -> (B, 1, 1, P + T): the extra keys are never masked
            mask = torch.cat([mask.new_ones(mask.shape[:-1] + (k_extra.shape[2],)), mask], dim=-1)
        return k, v, mask

    def __call__(self, k, v, mask):  # skips nn.Module's call machinery: the slot carries no torch hooks
        return self.forward(k, v, mask)
