"""BERT's own objective (paper, section 3.1): the pre-training heads on the encoder.

    masked LM            logits = LayerNorm(GELU(W h_t + b)) E^T + bias   at the masked positions t
    next sentence (NSP)  logits = W_nsp pooler_output + b_nsp              (B, 2): 0 = B follows A, 1 = random

``BertForMaskedLM`` and ``BertForPreTraining`` compute what transformers' classes of those names compute --
the same logits, the same losses (cross-entropy over the tokens labelled, -100 elsewhere; MLM + NSP
summed) -- under the same checkpoint names (``bert.*``, ``cls.predictions.*`` with the decoder tied to the
word embeddings, ``cls.seq_relationship.*``), so checkpoints go both ways.

**Sparse prediction.** With labels, the vocabulary projection runs only at the labelled (masked) positions,
as Google's original BERT code gathered them: about 15 % of the tokens. transformers projects every
position and then ignores 85 % of the scores; for small geometries that projection costs more than all
the blocks together (H = 128: 7.8 MFLOP a token against 0.8 for two blocks). The loss and its gradients
are the dense computation's (tested); ``return_logits=True`` also returns every position's scores.

A checkpoint without a head (all-MiniLM-L6-v2 has neither) gets a fresh one -- N(0, 0.02) weights from an
explicit seed, zero biases, LayerNorm as the identity, the decoder tied -- and a warning says which.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import BertConfig
from ..errors import InputError
from ..loading import load_pretraining_model, save_model
from ..model import MaskedLMHead
from ..untied import UntiedMaskedLMHead
from .bert import BertModel
from .heads import fresh_pooler, init_head


@dataclass
class PreTrainingOutput:
    loss: torch.Tensor | None = None  # MLM (+ NSP) loss when labels were given
    mlm_loss: torch.Tensor | None = None
    nsp_loss: torch.Tensor | None = None
    prediction_logits: torch.Tensor | None = None  # (B, T, V): only without labels, or with return_logits
    seq_relationship_logits: torch.Tensor | None = None  # (B, 2), BertForPreTraining only
    masked_logits: torch.Tensor | None = None  # (N, V) at the labelled positions (sparse prediction)
    hidden_states: tuple[torch.Tensor, ...] | None = None

    @property
    def logits(self) -> torch.Tensor | None:  # transformers' BertForMaskedLM name
        return self.prediction_logits


def fresh_mlm_head(config: BertConfig, generator: torch.Generator) -> MaskedLMHead:
    """A new masked-LM head as BERT initialises one: transform N(0, 0.02), zero biases, LayerNorm = identity."""
    head = (MaskedLMHead if config.tie_word_embeddings else UntiedMaskedLMHead)(config)  # BERT's, or untied.py's
    init_head(head.transform, generator)
    with torch.no_grad():
        head.bias.zero_()
        head.norm.reset_parameters()
        if not config.tie_word_embeddings:  # an untied decoder (untied.py): N(0, 0.02) as well
            head.decoder.normal_(0.0, 0.02, generator=generator)
    return head


def masked_lm_loss(model: BertModel, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits at the labelled positions (N, V)): the head runs on the N labelled tokens only. The
    loss is the mean over them, as cross-entropy with ignore_index=-100 over every position gives."""
    chosen = labels != -100  # (B, T)
    logits = model.mlm_logits(hidden[chosen])  # (N, V)
    if logits.shape[0] == 0:  # nothing masked in this batch: a zero loss that still has a graph
        return logits.sum() * 0.0, logits
    return F.cross_entropy(logits.float(), labels[chosen]), logits


class _PreTrainingModel(nn.Module):
    """What both pre-training models share: how one is made from nothing."""

    @classmethod
    def from_config(cls, config: BertConfig, *, seed: int = 0):
        """A model trained from nothing: BERT's N(0, 0.02) initialisation from ``seed`` (encoder and heads)."""
        torch.manual_seed(seed)
        return cls(config, seed=seed).train()


class BertForMaskedLM(_PreTrainingModel):
    """The encoder and its masked-LM head (transformers' ``BertForMaskedLM``: no pooler)."""

    def __init__(self, config: BertConfig, *, add_pooler: bool = False, seed: int = 0):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooler=add_pooler, add_mlm_head=False)
        self.bert.mlm_head = fresh_mlm_head(config, torch.Generator().manual_seed(seed))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                return_logits: bool = False) -> PreTrainingOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids)
        h = out.last_hidden_state  # (B, T, H)
        result = PreTrainingOutput(hidden_states=out.hidden_states)
        if labels is not None:
            result.loss, result.masked_logits = masked_lm_loss(self.bert, h, labels)
            result.mlm_loss = result.loss
        if labels is None or return_logits:
            result.prediction_logits = self.bert.mlm_logits(h)  # (B, T, V)
        return result

    @classmethod
    def from_pretrained(cls, source, *, revision=None, dtype=None, device=None, seed: int = 0):
        """A checkpoint with or without the head (a fresh one, seeded, and a warning, when it has none)."""
        encoder, _ = load_pretraining_model(BertModel, source, revision=revision, dtype=dtype, device=device)
        model = _wrap(cls, encoder)
        _add_fresh(model, [], seed, source)
        return model

    def save_pretrained(self, directory) -> None:
        """config.json + model.safetensors that transformers loads as ``BertForMaskedLM`` (and ``BertModel``)."""
        save_model(self.bert, directory)


class BertForPreTraining(_PreTrainingModel):
    """The encoder with both pre-training heads (transformers' ``BertForPreTraining``): loss = MLM + NSP."""

    checkpoint_head = "cls.seq_relationship"  # save_model writes the NSP head under these names
    head_attribute = "nsp"

    def __init__(self, config: BertConfig, *, seed: int = 0):
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        self.bert = BertModel(config, add_pooler=True, add_mlm_head=False)
        self.bert.mlm_head = fresh_mlm_head(config, generator)
        self.nsp = init_head(nn.Linear(config.hidden_size, 2), generator)

    def head_out_features(self) -> int:
        return 2

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                next_sentence_label=None, return_logits: bool = False) -> PreTrainingOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids)
        h = out.last_hidden_state
        result = PreTrainingOutput(seq_relationship_logits=self.nsp(out.pooler_output), hidden_states=out.hidden_states)
        if labels is not None:
            result.mlm_loss, result.masked_logits = masked_lm_loss(self.bert, h, labels)
            result.loss = result.mlm_loss
            if next_sentence_label is not None:
                result.nsp_loss = F.cross_entropy(result.seq_relationship_logits.float(), next_sentence_label.view(-1))
                result.loss = result.loss + result.nsp_loss
        elif next_sentence_label is not None:
            raise InputError("next_sentence_label without labels: BertForPreTraining's loss is MLM + NSP")
        if labels is None or return_logits:
            result.prediction_logits = self.bert.mlm_logits(h)
        return result

    @classmethod
    def from_pretrained(cls, source, *, revision=None, dtype=None, device=None, seed: int = 0):
        """A checkpoint with or without the heads (fresh ones, seeded, and a warning, for those it lacks)."""
        encoder, nsp = load_pretraining_model(BertModel, source, revision=revision, dtype=dtype, device=device)
        model = _wrap(cls, encoder)
        fresh = []
        if encoder.pooler is None:  # a BertForMaskedLM checkpoint: NSP reads the pooler
            fresh.append("pooler (N(0, 0.02))")
        if nsp is None:
            fresh.append("next-sentence head (cls.seq_relationship)")
            model.nsp = None
        else:
            model.nsp = nn.Linear(encoder.config.hidden_size, 2, device="meta")
            model.nsp.load_state_dict(nsp, assign=True)
        _add_fresh(model, fresh, seed, source)
        return model

    def save_pretrained(self, directory) -> None:
        """config.json + model.safetensors that transformers loads as ``BertForPreTraining``."""
        save_model(self, directory)


def _wrap(cls, encoder: BertModel):
    """A ``cls`` around a loaded encoder, nothing initialised (the heads are the caller's)."""
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.config = encoder.config
    model.bert = encoder
    model.source = getattr(encoder, "source", None)
    return model


def _add_fresh(model, fresh: list[str], seed: int, source) -> None:
    """Give ``model`` the parts its checkpoint lacked, seeded, and say which."""
    generator = torch.Generator().manual_seed(seed)
    device, dtype = model.bert.device, model.bert.dtype
    config = model.config
    if model.bert.mlm_head is None:
        model.bert.mlm_head = fresh_mlm_head(config, generator).to(device=device, dtype=dtype)
        decoder = "tied to the word embeddings" if config.tie_word_embeddings else "untied, N(0, 0.02)"
        fresh.insert(0, f"masked-LM head (cls.predictions: transform N(0, 0.02), decoder {decoder})")
    if isinstance(model, BertForPreTraining):
        if model.bert.pooler is None:
            model.bert.pooler = fresh_pooler(model.bert, generator)
        if model.nsp is None:
            model.nsp = init_head(nn.Linear(config.hidden_size, 2), generator).to(device=device, dtype=dtype)
    if fresh:
        warnings.warn(f"{source} has no {'; no '.join(fresh)}: starting from a fresh one, seed {seed}", stacklevel=3)
