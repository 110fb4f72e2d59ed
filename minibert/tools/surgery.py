"""Layer surgery: shallower models made of chosen blocks, and freezing for layer-wise fine-tuning.

    from minibert.tools.surgery import keep_blocks, truncate, freeze, unfreeze

    student = keep_blocks(model, range(1, 12, 2))  # every other block of BERT-base: a 6-block model
    freeze(student, embeddings=True, blocks=2)     # train only blocks 2.. (and the pooler)
    student.save_pretrained("student")             # config.json says 6 layers; transformers loads it
    with dropout(student, 0.0):                    # every dropout off while training, its own p after
        ...

Copies are real copies: training the new model never changes the old one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch

from ..errors import InputError
from ..checks import check_fraction, check_index
from ..model import BertModel, MultiHeadSelfAttention


def keep_blocks(model, indices, what: str = "keep_blocks(indices)"):
    """A new, shallower model (copied weights) with the embeddings, the blocks ``indices`` (in the given
    order) and the pooler, e.g. ``keep_blocks(model, range(1, 12, 2))`` for a 6-block student. A task
    model (a BertModel in ``model.bert`` and a head) is copied whole, its encoder cut the same way."""
    if not isinstance(model, BertModel) and isinstance(getattr(model, "bert", None), BertModel):
        new = copy.deepcopy(model, {id(model.bert): model.bert})  # all but the encoder (shared for a moment)
        new.bert = keep_blocks(model.bert, indices, what)
        new.config = new.bert.config
        return new
    N = model.config.num_hidden_layers
    if isinstance(indices, int):
        raise TypeError(f"{what}: indices must be a sequence of block indices, got the int {indices}")
    chosen = [check_index(f"{what}: block", i, -N, N - 1, f"the model has blocks 0..{N - 1}") % N for i in indices]
    if not chosen:
        raise InputError(f"{what}: keep at least one block (the model has {N})")

    config = dataclasses.replace(model.config, num_hidden_layers=len(chosen))
    with torch.device("meta"):  # placeholders only; every module is replaced by a copy below
        new = type(model)(config, add_pooler=model.pooler is not None,
                          add_mlm_head=getattr(model, "mlm_head", None) is not None)
    new.embeddings = copy.deepcopy(model.embeddings)
    new.encoder.blocks = torch.nn.ModuleList(copy.deepcopy(model.encoder.blocks[i]) for i in chosen)
    if hasattr(model.encoder, "final_norm"):  # a pre-LN stack's last LayerNorm (models/norms.py)
        new.encoder.final_norm = copy.deepcopy(model.encoder.final_norm)
    if model.pooler is not None:
        new.pooler = copy.deepcopy(model.pooler)
    if new.mlm_head is not None:
        new.mlm_head = copy.deepcopy(model.mlm_head)
    new.train(model.training)
    new.source = f"{getattr(model, 'source', 'model')} (blocks {chosen})"
    return new


def truncate(model: BertModel, k: int) -> BertModel:
    """A new model with the first ``k`` blocks: its hidden states equal the first k + 1 of ``model``'s."""
    check_index("truncate(k)", k, 1, model.config.num_hidden_layers, "blocks to keep")
    return keep_blocks(model, range(k), what="truncate(k)")


def freeze(model: BertModel, embeddings: bool = True, blocks: int = 0, pooler: bool = False) -> BertModel:
    """Layer-wise fine-tuning: requires_grad=False on the embeddings (if asked), the bottom ``blocks``
    blocks and (if asked) the pooler; everything else is made trainable. Returns the model."""
    check_index("freeze(blocks)", blocks, 0, model.config.num_hidden_layers, "the number of bottom blocks")
    unfreeze(model)
    frozen = [model.embeddings] if embeddings else []
    frozen += list(model.encoder.blocks[:blocks])
    if pooler and model.pooler is not None:
        frozen.append(model.pooler)
    for module in frozen:
        for p in module.parameters():
            p.requires_grad_(False)
    return model


def unfreeze(model: BertModel) -> BertModel:
    """Make every parameter trainable again."""
    for p in model.parameters():
        p.requires_grad_(True)
    return model


@contextlib.contextmanager
def dropout(model: torch.nn.Module, p: float):
    """Every dropout of ``model`` -- after the embeddings, on the attention probabilities, on each
    residual branch, in a task head -- at probability ``p`` inside the ``with`` block, and the model's own
    probabilities back after it. The config is not touched, so a model saved inside keeps its own."""
    check_dropout(p)
    saved = []
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            saved.append((module, "p", module.p))
            module.p = float(p)
        if isinstance(module, MultiHeadSelfAttention):  # its fused kernel reads dropout_p
            saved.append((module, "dropout_p", module.dropout_p))
            module.dropout_p = float(p)
    try:
        yield model
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def check_dropout(p) -> float:
    """``p`` as a dropout probability, or an InputError naming it: a number in [0, 1)."""
    return check_fraction("dropout p", p)
