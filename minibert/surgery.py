"""Layer surgery: shallower models made of chosen blocks, and freezing for layer-wise fine-tuning.

    student = model.keep_blocks(range(1, 12, 2))   # every other block of BERT-base: a 6-block model
    student.freeze(embeddings=True, blocks=2)      # train only blocks 2.. (and the pooler)
    student.save_pretrained("student")             # config.json says 6 layers; transformers loads it

Copies are real copies: training the new model never changes the old one.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from .errors import InputError


def keep_blocks(model, indices, what: str = "keep_blocks(indices)"):
    """A new model with copies of the embeddings, the blocks ``indices`` (in the given order) and the pooler."""
    N = model.config.num_hidden_layers
    if isinstance(indices, int):
        raise TypeError(f"{what}: indices must be a sequence of block indices, got the int {indices}")
    chosen = []
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int) or not -N <= i < N:
            raise InputError(f"{what}: block {i!r} does not exist; the model has blocks 0..{N - 1}")
        chosen.append(i % N)
    if not chosen:
        raise InputError(f"{what}: keep at least one block (the model has {N})")

    config = dataclasses.replace(model.config, num_hidden_layers=len(chosen))
    with torch.device("meta"):  # placeholders only; every module is replaced by a copy below
        new = type(model)(config, add_pooler=model.pooler is not None,
                          add_mlm_head=getattr(model, "mlm_head", None) is not None)
    new.embeddings = copy.deepcopy(model.embeddings)
    new.encoder.blocks = torch.nn.ModuleList(copy.deepcopy(model.encoder.blocks[i]) for i in chosen)
    if model.pooler is not None:
        new.pooler = copy.deepcopy(model.pooler)
    if new.mlm_head is not None:
        new.mlm_head = copy.deepcopy(model.mlm_head)
    for module in new.modules():  # hooks active on the original never leak into the copy
        if hasattr(module, "taps"):
            module.taps = {}
    new.train(model.training)
    new.source = f"{getattr(model, 'source', 'model')} (blocks {chosen})"
    return new


def freeze(model, embeddings: bool = True, blocks: int = 0, pooler: bool = False):
    """Set requires_grad=False on the embeddings (if asked), the bottom ``blocks`` blocks and (if asked)
    the pooler; everything else is made trainable. Returns the model."""
    N = model.config.num_hidden_layers
    if isinstance(blocks, bool) or not isinstance(blocks, int) or not 0 <= blocks <= N:
        raise InputError(f"freeze(blocks={blocks!r}): must be an int in [0, {N}] (the number of bottom blocks)")
    model.unfreeze()
    frozen = [model.embeddings] if embeddings else []
    frozen += list(model.encoder.blocks[:blocks])
    if pooler and model.pooler is not None:
        frozen.append(model.pooler)
    for module in frozen:
        for p in module.parameters():
            p.requires_grad_(False)
    return model
