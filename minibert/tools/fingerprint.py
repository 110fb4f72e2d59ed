"""What a saved result was computed from, as a short hash: ``weights_fingerprint(model)`` (every tensor of
the state dict: name, dtype, shape and bytes); a file's is ``textfiles.file_sha256(path)``. A cache written
beside its inputs (``minibert search --index``) records them and is rebuilt when one differs."""

from __future__ import annotations

import hashlib

import torch


def weights_fingerprint(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> str:
    """sha256 (hex) of the model's state dict in order: two models with the same names, dtypes, shapes and
    values have the same fingerprint; any other difference changes it. One pass over the weights
    (about 0.1 s for all-MiniLM-L6-v2's 90 MB). ``skip``: name prefixes left out (``task_modules.``: the
    base without what was added on it)."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if name.startswith(skip):
            continue
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()

