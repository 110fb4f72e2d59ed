"""Fine-tuning recipes that change *what* trains, used through ``fit(..., on_epoch_start=...)``.

* gradual unfreezing (Howard and Ruder 2018, ULMFiT): the head alone first, then one more block from the
  top each ``every`` epochs, the embeddings last;
* layer-wise learning-rate decay is a learning-rate matter: ``FitConfig(layer_decay=0.9)``;
* LoRA: ``minibert.training.lora.apply_lora(model)`` before ``fit``.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..errors import InputError


def gradual_unfreezing(every: int = 1) -> Callable[[nn.Module, int], None]:
    """``on_epoch_start`` for ``fit``: at epoch e (from 0) the head and pooler train, plus the top
    ``e // every`` blocks; one stage after every block trains, the embeddings do too."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InputError(f"every={every!r} must be a positive int (epochs per newly unfrozen block)")

    def on_epoch_start(model: nn.Module, epoch: int) -> None:
        blocks = list(model.bert.encoder.blocks)
        stage = epoch // every  # 0: head only; k: head + top k blocks; len(blocks) + 1: everything
        for p in model.parameters():
            p.requires_grad_(True)
        for block in blocks[:len(blocks) - min(len(blocks), stage)]:
            for p in block.parameters():
                p.requires_grad_(False)
        if stage <= len(blocks):
            for p in model.bert.embeddings.parameters():
                p.requires_grad_(False)

    return on_epoch_start
