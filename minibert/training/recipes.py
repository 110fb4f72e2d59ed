"""Fine-tuning recipes that change *what* trains, used through ``fit(..., on_epoch_start=...)``.

* gradual unfreezing (Howard and Ruder 2018, ULMFiT): the head alone first, then one more block from the
  top each ``every`` epochs, the embeddings last;
* layer-wise learning-rate decay is a learning-rate matter: ``FitConfig(layer_decay=0.9)``;
* LoRA: ``minibert.training.lora.apply_lora(model)`` before ``fit``;
* a frozen encoder with a trained ScalarMix head: ``ScalarMixClassifier``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch
from torch import nn

from ..analysis.layers import ScalarMix
from ..tools.pooling import pool
from ..checks import check_positive
from ..errors import InputError
from ..models.heads import BertForSequenceClassification, ClassifierOutput, init_head, sequence_loss
from ..models import BertModel


def gradual_unfreezing(every: int = 1) -> Callable[[nn.Module, int], None]:
    """``on_epoch_start`` for ``fit``: at epoch e (from 0) the head and pooler train, plus the top
    ``e // every`` blocks; one stage after every block trains, the embeddings do too."""
    check_positive("every", every, "epochs per newly unfrozen block")

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


class ScalarMixClassifier(nn.Module):
    """The probing view as a classifier: a frozen encoder, a trained ``ScalarMix`` over every hidden
    state (embedding output included), mean-pooled over real tokens, then a linear layer.

        logits = W mean_t(gamma * sum_k softmax(w)_k h_k,t) + b

    Only the mix (L + 2 numbers) and W, b train; ``mix.weights`` then says which layers the task reads.
    Saved as the encoder's checkpoint plus the ``scalarmix_head`` part (``parts``: .json and .safetensors). The encoder given is left as it
    was: the classifier freezes a copy of it, or -- ``share_encoder=True``, when the caller hands it over
    (the finetune pipeline, ``from_pretrained``) -- the encoder itself, with no copy."""

    PART = "scalarmix_head"  # the mix and the classifier beside the encoder's checkpoint (``parts``)

    def __init__(self, encoder, labels, *, problem_type=None, seed: int = 0, share_encoder: bool = False):
        super().__init__()
        names = [f"LABEL_{i}" for i in range(labels)] if isinstance(labels, int) else [str(n) for n in labels]
        if not names or len(set(names)) != len(names):
            raise InputError(f"labels must be distinct class names (or a positive int), got {labels!r}")
        self.bert = encoder if share_encoder else copy.deepcopy(encoder)
        for p in self.bert.parameters():
            p.requires_grad_(False)
        # a config of its own: the encoder's stays as it was (no labels written into it)
        self.config = dataclasses.replace(encoder.config, id2label=dict(enumerate(names)), problem_type=problem_type)
        self.mix = ScalarMix(self.config.num_hidden_layers + 1)
        self.classifier = nn.Linear(self.config.hidden_size, len(names))
        init_head(self.classifier, torch.Generator().manual_seed(seed))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_hidden_states=True):
        """As a sequence classifier's; the mix reads every hidden state, which ``output_hidden_states=False``
        only leaves out of the output."""
        self.bert.eval()  # frozen: no dropout, no gradients
        with torch.no_grad():
            out = self.bert(input_ids, attention_mask, token_type_ids, position_ids)
        mixed = self.mix(out.hidden_states, attention_mask)  # (B, T, H)
        logits = self.classifier(pool(mixed, attention_mask, "mean"))  # (B, num_labels)
        loss = None if labels is None else sequence_loss(logits, labels, self.config)
        return ClassifierOutput(logits, loss, out.hidden_states if output_hidden_states else None)

    # predictions as a sequence classifier's (same output, same config): its methods serve this class too
    predict = BertForSequenceClassification.predict
    _batches = BertForSequenceClassification._batches
    _predicting = BertForSequenceClassification._predicting

    def save_pretrained(self, directory) -> None:
        """The encoder's checkpoint, its config with id2label, and the mix and head beside it, written
        together (``textfiles.atomic_dir``: a kill leaves the old checkpoint whole)."""
        from ..loading import CHECKPOINT_FILES
        from ..textfiles import atomic_dir

        from ..parts import files, write_part

        with atomic_dir(directory, replaced=CHECKPOINT_FILES + files(self.PART)) as tmp:
            self.bert.save_pretrained(tmp)
            self.config.to_json_file(tmp / "config.json")  # the encoder's config, with id2label
            write_part(tmp, self.PART, {"layers": len(self.mix.scalar_parameters)}, self._head().state_dict())

    def _head(self) -> nn.Module:
        """What trains here, as one module: the mix and the classifier (the encoder is frozen and saved apart)."""
        return nn.ModuleDict({"mix": self.mix, "classifier": self.classifier})

    @classmethod
    def from_pretrained(cls, directory, *, dtype=None, device=None):
        """The classifier ``save_pretrained`` wrote; ``dtype`` / ``device`` as ``BertModel.from_pretrained``
        (the mix and the classifier follow the encoder; they stay fp32 beside an int8 encoder)."""
        from ..parts import check_fits, read_part

        _, state = read_part(directory, cls.PART, what="a ScalarMix classifier")
        encoder = BertModel.from_pretrained(directory, dtype=dtype, device=device)
        model = cls(encoder, [encoder.config.id2label[i] for i in range(len(encoder.config.id2label))],
                    problem_type=encoder.config.problem_type, share_encoder=True)
        head = model._head()
        check_fits(directory, head, state, "its mix and classifier")
        head.load_state_dict(state)
        head.to(device=encoder.device, dtype=encoder.dtype)
        return model.eval()
