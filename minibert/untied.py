"""The masked-LM head with a decoder of its own (``tie_word_embeddings = false``): not BERT, an ablation.

BERT ties the masked-LM decoder to the word embeddings (``model.MaskedLMHead``): one matrix E reads the
words in and scores them out. With an untied head the scores come from a matrix D of the same shape,

    logits = LayerNorm(GELU(W h + b)) D^T + bias          D: (vocab_size, hidden), its own weights

and E learns only from the words that are read. Why that can matter when pre-training on a small corpus:
every softmax step pushes each word that is *not* the answer away from the hidden state; a rare word is
almost never the answer, so through a tied E its input vector gets only that push -- the same one as every
other rare word -- and Adam, which normalises each coordinate's update, moves them all together at full
speed. Untied, that push lands on D, and E keeps the rare words apart (``bench_pretrain.py`` measures it).

transformers' ``BertForMaskedLM`` reads the same checkpoint (``cls.predictions.decoder.weight`` beside the
embeddings, ``"tie_word_embeddings": false`` in config.json).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .activations import ACTIVATIONS
from .config import BertConfig


class UntiedMaskedLMHead(nn.Module):
    """``model.MaskedLMHead`` with a decoder of its own: the same transform, LayerNorm and output bias under
    the same names, plus ``decoder`` (V, H). (Not a subclass: ``model`` imports ``loading``, which builds
    this head, so this module stays below ``model``.)"""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.decoder = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))  # (V, H)

    def forward(self, hidden, word_embeddings):  # (..., H); word_embeddings unused: the decoder is untied
        h = self.norm(self.act(self.transform(hidden)))  # (..., H)
        return F.linear(h, self.decoder, self.bias)  # (..., V)

