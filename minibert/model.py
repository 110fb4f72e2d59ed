"""The BERT encoder (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers"),
written to be read top to bottom.

    input_ids ──► Embeddings ──► Block 1 ──► Block 2 ──► ... ──► Block N ──► last_hidden_state
                      │             │           │                  │              │
               hidden_states[0] [1]          [2]                [N]           Pooler ──► pooler_output

Each Block is the Transformer encoder layer of Vaswani et al. 2017 with post-LayerNorm residuals:

    h   = LayerNorm(x + Dropout(MultiHeadSelfAttention(x)))
    out = LayerNorm(h + Dropout(FeedForward(h)))

Shapes: B = batch, T = tokens per sequence, H = hidden_size, h = heads, d = H / h, F = intermediate_size.
Numerics follow transformers' BertModel exactly: the same operation order, the erf GELU,
LayerNorm eps 1e-12, masked keys filled with the dtype's most negative number.

``self.hook_*`` are HookPoints: identities that let ``minibert.tools.hooks`` read or replace an
activation by name. Checkpoint names live in ``loading.py``, input checks in ``inputs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .activations import ACTIVATIONS
from .config import BertConfig
from .errors import InputError
from .hookpoints import HookPoint, KeyValueSlot
from .inputs import check_blocks, check_inputs
from .loading import load_model, save_model


@dataclass
class BertOutput:
    last_hidden_state: torch.Tensor  # (B, T, H): the output of the last block
    pooler_output: torch.Tensor | None  # (B, H): tanh(W h_[CLS] + b), or None without a pooler
    hidden_states: tuple[torch.Tensor, ...] | None  # N + 1 tensors (B, T, H): [0] embeddings, [i] block i
    attentions: tuple[torch.Tensor, ...] | None = None  # N tensors (B, h, T, T) when asked for

    def __getitem__(self, key: str):
        return getattr(self, key)


# ---------------------------------------------------------------------------------------- embeddings
def embedding(num: int, dim: int, padding_idx: int | None = None) -> nn.Embedding:
    """An embedding table without nn.Embedding's own random init: BertModel._init_weights or the
    checkpoint sets it. (On the meta device that init would import torch._dynamo: 1.5 s per process.)"""
    return nn.Embedding(num, dim, padding_idx=padding_idx, _weight=torch.empty(num, dim))


class Embeddings(nn.Module):
    """Input representation (paper, figure 2): the sum of a token's WordPiece embedding, its position
    embedding and its segment (token type) embedding, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word = embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position = embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.hook_word, self.hook_token_type, self.hook_position = HookPoint(), HookPoint(), HookPoint()
        self.hook_sum, self.hook_output = HookPoint(), HookPoint()

    def forward(self, input_ids, token_type_ids, position_ids):  # each (B, T) integer
        word = self.hook_word(self.word(input_ids))  # (B, T, H)
        token_type = self.hook_token_type(self.token_type(token_type_ids))  # (B, T, H)
        position = self.hook_position(self.position(position_ids))  # (B, T, H)
        x = self.hook_sum((word + token_type) + position)  # (B, T, H); this order, as transformers
        return self.hook_output(self.dropout(self.norm(x)))  # (B, T, H) == hidden_states[0]


# ------------------------------------------------------------------------------------------ attention
class MultiHeadSelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention (Vaswani et al. 2017, section 3.2):

        head_i = softmax(Q_i K_i^T / sqrt(d) + mask) V_i,   output = Concat(head_1..head_h) W_O

    Two paths compute it. The explicit one is the one to read and study, and the only one that yields
    the attention probabilities: it runs when they are asked for, or hooked. Otherwise PyTorch's fused
    ``scaled_dot_product_attention`` computes the same thing faster (a test holds them together)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        H = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.query = nn.Linear(H, H)
        self.key = nn.Linear(H, H)
        self.value = nn.Linear(H, H)
        self.output = nn.Linear(H, H)  # W_O: mixes the concatenated heads back into the residual stream
        self.dropout_p = config.attention_probs_dropout_prob
        self.dropout = nn.Dropout(self.dropout_p)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_scores, self.hook_probs = HookPoint(), HookPoint()
        self.hook_context, self.hook_output = HookPoint(), HookPoint()
        self.kv = KeyValueSlot()  # empty: prefix-tuning fills it with extra keys and values

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (B, h, T, d)
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_size).transpose(1, 2)

    def forward(self, x, mask=None, return_probs=False):
        """x: (B, T, H). mask: None (attend everywhere) or bool (B, 1, 1, T), True = key may be attended.
        Returns (output (B, T, H), probabilities (B, h, T, T) or None; (B, h, T, P + T) with a prefix)."""
        q = self.hook_q(self.split_heads(self.query(x)))  # (B, h, T, d)
        k = self.hook_k(self.split_heads(self.key(x)))  # (B, h, T, d)
        v = self.hook_v(self.split_heads(self.value(x)))  # (B, h, T, d)
        k, v, mask = self.kv(k, v, mask)  # unchanged, unless a prefix is set: (B, h, P + T, d), mask P wider

        if return_probs or self.hook_scores.active or self.hook_probs.active:
            context, probs = self.explicit_attention(q, k, v, mask)
        else:
            context, probs = self.fused_attention(q, k, v, mask), None
        context = self.hook_context(context)  # (B, h, T, d): each head's output

        B, h, T, d = context.shape
        context = context.transpose(1, 2).reshape(B, T, h * d)  # (B, T, H): heads concatenated
        return self.hook_output(self.output(context)), probs

    def explicit_attention(self, q, k, v, mask):
        """The readable path: the attention formula written out."""
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.head_size**-0.5  # (B, h, T, T)
        if mask is not None:
            # a masked key gets the most negative finite number, so it receives ~0 probability. A row
            # with every key masked (an all-zero attention_mask row) then attends uniformly, as
            # transformers' eager path does; only its valid rows are meaningful anyway.
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        scores = self.hook_scores(scores)
        probs = self.hook_probs(scores.softmax(dim=-1))  # (B, h, T, T): each query's distribution over keys
        return torch.matmul(self.dropout(probs), v), probs  # (B, h, T, d), (B, h, T, T)

    def fused_attention(self, q, k, v, mask):
        """The same computation in one fused PyTorch kernel."""
        if mask is not None:
            # an additive mask (0 or dtype-min) instead of a boolean one keeps fully masked rows uniform,
            # exactly like the explicit path (a boolean mask would give zeros there)
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~mask, torch.finfo(q.dtype).min)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.head_size**-0.5)  # (B, h, T, d)


# --------------------------------------------------------------------------------------- feed-forward
class FeedForward(nn.Module):
    """Position-wise feed-forward network: FFN(x) = W_2 act(W_1 x + b_1) + b_2, applied to each token."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense_in = nn.Linear(config.hidden_size, config.intermediate_size)  # W_1: H -> F
        self.act = ACTIVATIONS[config.hidden_act]
        self.dense_out = nn.Linear(config.intermediate_size, config.hidden_size)  # W_2: F -> H
        self.hook_pre, self.hook_post, self.hook_output = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x):  # (B, T, H)
        pre = self.hook_pre(self.dense_in(x))  # (B, T, F)
        post = self.hook_post(self.act(pre))  # (B, T, F)
        return self.hook_output(self.dense_out(post))  # (B, T, H)


# ------------------------------------------------------------------------------------------------ block
class Block(nn.Module):
    """One encoder layer: self-attention and feed-forward sub-layers, each wrapped as
    LayerNorm(x + Dropout(sublayer(x))) -- BERT normalises after the residual sum (post-LN)."""

    def __init__(self, config: BertConfig):
        super().__init__()  # (modules in the order the forward pass meets them: hook points are named so)
        self.hook_input = HookPoint()
        self.attn = MultiHeadSelfAttention(config)
        self.hook_resid_mid = HookPoint()
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.hook_attn_norm = HookPoint()
        self.ffn = FeedForward(config)
        self.hook_resid_post = HookPoint()
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.hook_output = HookPoint()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, mask=None, return_probs=False):  # x: (B, T, H)
        x = self.hook_input(x)
        attended, probs = self.attn(x, mask, return_probs)
        h = self.hook_attn_norm(self.attn_norm(self.hook_resid_mid(x + self.dropout(attended))))  # (B, T, H)
        out = self.ffn_norm(self.hook_resid_post(h + self.dropout(self.ffn(h))))  # (B, T, H)
        return self.hook_output(out), probs


# ---------------------------------------------------------------------------------------------- encoder
class Encoder(nn.Module):
    """The stack of N blocks. Returns every intermediate output: they are what layer analysis studies."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))

    def forward(self, x, mask=None, return_probs=False, num_blocks=None, skip_blocks=(), keep_all=True):
        """Run blocks 0..num_blocks-1 (all by default); a block in ``skip_blocks`` is the identity.
        ``keep_all=False`` keeps only the latest output (the earlier ones are freed as the stack runs)."""
        hidden_states, attentions = [x], []
        for i, block in enumerate(self.blocks[:num_blocks]):
            probs = None
            if i not in skip_blocks:
                x, probs = block(x, mask, return_probs)
            if not keep_all:
                hidden_states.clear()  # only the latest output is kept: the earlier ones can be freed
            hidden_states.append(x)
            attentions.append(probs)
        return hidden_states, attentions


# ----------------------------------------------------------------------------------------------- pooler
class Pooler(nn.Module):
    """Sentence vector for next-sentence prediction: tanh(W h_[CLS] + b) on the first token's output."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.hook_output = HookPoint()

    def forward(self, last_hidden_state):  # (B, T, H)
        return self.hook_output(torch.tanh(self.dense(last_hidden_state[:, 0])))  # (B, H)


# ------------------------------------------------------------------------------------- masked-LM head
class MaskedLMHead(nn.Module):
    """The pre-training head that predicts masked tokens (paper, section 3.1, task #1):

        logits = LayerNorm(act(W h + b)) E^T + bias      E = the word embedding matrix (tied weights)

    It owns the transform and the output bias; the decoder weight is the model's word embeddings, passed
    in. Official pre-training checkpoints ship it as ``cls.predictions.*``; sentence encoders do not."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden, word_embeddings):  # (..., H), (V, H)
        h = self.norm(self.act(self.transform(hidden)))  # (..., H)
        return F.linear(h, word_embeddings, self.bias)  # (..., V): one score per vocabulary entry


# ------------------------------------------------------------------------------------------------ model
class BertModel(nn.Module):
    """Embeddings, N encoder blocks and (when the checkpoint has one) the pooler and the masked-LM head.

    ``BertModel(config)`` makes a randomly initialised model for training from scratch;
    ``BertModel.from_pretrained(source)`` loads a checkpoint and never initialises anything at random.
    """

    def __init__(self, config: BertConfig, *, add_pooler: bool = True, add_mlm_head: bool = False):
        super().__init__()
        config.validate()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.pooler = Pooler(config) if add_pooler else None
        self.mlm_head = MaskedLMHead(config) if add_mlm_head else None  # not run by forward()
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """BERT's initialisation (truncation aside): N(0, 0.02) weights, zero biases, LayerNorm = identity."""
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.device.type != "meta":
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)
            elif module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()

    @property
    def device(self) -> torch.device:
        return self.embeddings.word.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.word.weight.dtype

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                output_attentions=False, output_hidden_states=True, *, num_blocks=None, skip_blocks=()) -> BertOutput:
        """input_ids (B, T) token ids. attention_mask (B, T): nonzero = real token, 0 = padding (keys at
        padding are never attended to). token_type_ids (B, T): segment 0 or 1, default 0.
        position_ids (B, T): default 0..T-1 in every row. token_type_ids and position_ids may also be one
        row, (1, T) or (T,), for the whole batch. A 1-D input is taken as one sequence.

        ``num_blocks=k`` exits early after the first k blocks (hidden_states then has k + 1 entries and the
        pooler reads block k's output); ``skip_blocks=[i, ...]`` makes those blocks the identity.
        ``output_hidden_states=False`` returns ``hidden_states=None`` and keeps only the last block's output
        while the stack runs (less memory; the default keeps them all, as layer analysis needs)."""
        input_ids, attention_mask, token_type_ids, position_ids = check_inputs(
            self.config, self.device, input_ids, attention_mask, token_type_ids, position_ids)
        num_blocks, skip_blocks = check_blocks(self.config, num_blocks, skip_blocks)

        x = self.embeddings(input_ids, token_type_ids, position_ids)  # (B, T, H)
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
        hidden_states, attentions = self.encoder(x, mask, output_attentions, num_blocks, skip_blocks,
                                                 keep_all=output_hidden_states)

        last = hidden_states[-1]
        return BertOutput(
            last_hidden_state=last,
            pooler_output=self.pooler(last) if self.pooler is not None else None,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Masked-LM scores (..., vocab_size) for hidden states (..., H), e.g. ``out.last_hidden_state``
        or any ``out.hidden_states[i]`` (the logit lens)."""
        if self.mlm_head is None:
            raise InputError(
                f"{getattr(self, 'source', 'this model')} has no masked-LM head (no cls.predictions.* "
                "tensors in the checkpoint): it is an encoder only, e.g. a sentence-embedding model. Use a "
                "pre-training checkpoint such as bert-base-uncased for fill-mask and the logit lens")
        return self.mlm_head(hidden, self.embeddings.word.weight)

    @classmethod
    def from_pretrained(cls, source, *, revision=None, dtype=None, device=None, mlm_head=None) -> "BertModel":
        """Load a checkpoint: a directory, a ``.safetensors`` file with config.json beside it, or a hub
        repo id (``google-bert/bert-base-uncased`` or the alias ``bert-base-uncased``).
        ``mlm_head``: None = load ``cls.predictions.*`` when the checkpoint has it, True = require it,
        False = leave it out (reported in ``skipped_tensors``)."""
        return load_model(cls, source, revision=revision, dtype=dtype, device=device, mlm_head=mlm_head)

    def save_pretrained(self, directory) -> None:
        """Write config.json and model.safetensors with transformers' tensor names."""
        save_model(self, directory)
