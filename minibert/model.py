"""The BERT encoder (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers"),
written to be read top to bottom.

    input_ids ──► Embeddings ──► Block 1 ──► Block 2 ──► ... ──► Block N ──► last_hidden_state
                      │             │           │                  │              │
               hidden_states[0] [1]          [2]                [N]           Pooler ──► pooler_output

Each Block is the Transformer encoder layer of Vaswani et al. 2017 with post-LayerNorm residuals:

    h   = LayerNorm(x + Dropout(MultiHeadSelfAttention(x)))
    out = LayerNorm(h + Dropout(FeedForward(h)))

Shapes: B = batch, T = tokens per sequence, H = hidden_size, h = heads, d = H / h, F = intermediate_size.
Numerics follow transformers' BertModel exactly (see shared notes): same operation order, the erf GELU,
LayerNorm eps 1e-12, masked keys filled with the dtype's most negative number.

Loading checkpoints lives in ``minibert/loading.py``; this file only defines the computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import BertConfig
from . import hooks
from .hooks import HookPoints
from .errors import InputError


# ----------------------------------------------------------------------------------------- activations
def gelu_tanh_written_out(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU as the original TF code wrote it ("gelu_new" in transformers).
    There is nothing scary in it: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATION_FUNCTIONS = {
    "gelu": F.gelu,  # exact: x * Phi(x) with the normal CDF via erf. BERT's default.
    "gelu_new": gelu_tanh_written_out,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


# ------------------------------------------------------------------------------------------- outputs
@dataclass
class BertOutput:
    last_hidden_state: torch.Tensor  # (B, T, H): the output of the last block
    pooler_output: torch.Tensor | None  # (B, H): tanh(W h_[CLS] + b), or None without a pooler
    hidden_states: tuple[torch.Tensor, ...]  # N + 1 tensors (B, T, H): [0] embeddings, [i] block i
    attentions: tuple[torch.Tensor, ...] | None = None  # N tensors (B, h, T, T) when asked for

    def __getitem__(self, key: str):
        return getattr(self, key)


# ---------------------------------------------------------------------------------------- embeddings
def embedding(num: int, dim: int, padding_idx: int | None = None) -> nn.Embedding:
    """An embedding table without nn.Embedding's own random init: BertModel._init_weights or the
    checkpoint sets it. (On the meta device that init would import torch._dynamo: 1.5 s per process.)"""
    return nn.Embedding(num, dim, padding_idx=padding_idx, _weight=torch.empty(num, dim))


class Embeddings(nn.Module, HookPoints):
    """Input representation (paper, figure 2): the sum of a token's WordPiece embedding, its position
    embedding and its segment (token type) embedding, then LayerNorm and dropout.

    ``self.tap(name, x)`` marks a named activation point (see minibert/hooks.py); it returns ``x`` itself
    unless a hook is registered there."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self._init_taps()
        self.word = embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position = embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids, position_ids):  # each (B, T) integer
        word = self.tap("word", self.word(input_ids))  # (B, T, H)
        token_type = self.tap("token_type", self.token_type(token_type_ids))  # (B, T, H)
        position = self.tap("position", self.position(position_ids))  # (B, T, H)
        x = self.tap("sum", (word + token_type) + position)  # (B, T, H); this order, as transformers
        return self.tap("output", self.dropout(self.norm(x)))  # (B, T, H) == hidden_states[0]


# ------------------------------------------------------------------------------------------ attention
class MultiHeadSelfAttention(nn.Module, HookPoints):
    """Multi-head scaled dot-product self-attention (Vaswani et al. 2017, section 3.2):

        head_i = softmax(Q_i K_i^T / sqrt(d) + mask) V_i,   output = Concat(head_1..head_h) W_O

    Two paths compute it. The explicit one below is the one to read and study, and the one that can
    return the attention probabilities. When those are not asked for, PyTorch's fused
    ``scaled_dot_product_attention`` computes the same thing faster; a test proves they agree. A hook on
    the scores or probabilities also selects the explicit path, since only it computes them.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self._init_taps()
        H = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.query = nn.Linear(H, H)
        self.key = nn.Linear(H, H)
        self.value = nn.Linear(H, H)
        self.output = nn.Linear(H, H)  # W_O: mixes the concatenated heads back into the residual stream
        self.dropout_p = config.attention_probs_dropout_prob
        self.dropout = nn.Dropout(self.dropout_p)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (B, h, T, d)
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_size).transpose(1, 2)

    def forward(self, x, mask=None, return_probs=False):
        """x: (B, T, H). mask: None (attend everywhere) or bool (B, 1, 1, T), True = key may be attended.
        Returns (output (B, T, H), probabilities (B, h, T, T) or None)."""
        q = self.tap("q", self.split_heads(self.query(x)))  # (B, h, T, d)
        k = self.tap("k", self.split_heads(self.key(x)))  # (B, h, T, d)
        v = self.tap("v", self.split_heads(self.value(x)))  # (B, h, T, d)

        if return_probs:
            context, probs = self.explicit_attention(q, k, v, mask)
        elif "scores" in self.taps or "probs" in self.taps:
            context, probs = self.hooked_attention(q, k, v, mask)
        else:
            context, probs = self.fused_attention(q, k, v, mask), None
        context = self.tap("context", context)  # (B, h, T, d): each head's output

        B, h, T, d = context.shape
        context = context.transpose(1, 2).reshape(B, T, h * d)  # (B, T, H): heads concatenated
        return self.tap("output", self.output(context)), probs

    def explicit_attention(self, q, k, v, mask):
        """The readable path: the attention formula written out."""
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.head_size**-0.5  # (B, h, T, T)
        if mask is not None:
            # a masked key gets the most negative finite number, so it receives ~0 probability. A row
            # with every key masked (an all-zero attention_mask row) then attends uniformly, as
            # transformers' eager path does; only its valid rows are meaningful anyway.
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        scores = self.tap("scores", scores, watch=True)
        probs = scores.softmax(dim=-1)  # (B, h, T, T): each query's distribution over keys
        probs = self.tap("probs", probs, watch=True)
        return torch.matmul(self.dropout(probs), v), probs  # (B, h, T, d), (B, h, T, T)

    def hooked_attention(self, q, k, v, mask):
        """Hooks at the scores or probabilities: run the explicit path so they see them. If no hook
        replaced anything, return the fused path's result, so a read-only hook changes no bit."""
        self.edited = False
        context, _ = self.explicit_attention(q, k, v, mask)
        if self.edited:
            return context, None
        return self.fused_attention(q, k, v, mask), None

    def fused_attention(self, q, k, v, mask):
        """The fast path: the same computation in one fused PyTorch kernel."""
        if mask is not None:
            # an additive mask (0 or dtype-min) instead of a boolean one keeps fully masked rows uniform,
            # exactly like the explicit path (a boolean mask would give zeros there)
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~mask, torch.finfo(q.dtype).min)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.head_size**-0.5)  # (B, h, T, d)


# --------------------------------------------------------------------------------------- feed-forward
class FeedForward(nn.Module, HookPoints):
    """Position-wise feed-forward network: FFN(x) = W_2 act(W_1 x + b_1) + b_2, applied to each token."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self._init_taps()
        self.dense_in = nn.Linear(config.hidden_size, config.intermediate_size)  # W_1: H -> F
        self.act = ACTIVATION_FUNCTIONS[config.hidden_act]
        self.dense_out = nn.Linear(config.intermediate_size, config.hidden_size)  # W_2: F -> H

    def forward(self, x):  # (B, T, H)
        pre = self.tap("pre", self.dense_in(x))  # (B, T, F)
        post = self.tap("post", self.act(pre))  # (B, T, F)
        return self.tap("output", self.dense_out(post))  # (B, T, H)


# ------------------------------------------------------------------------------------------------ block
class Block(nn.Module, HookPoints):
    """One encoder layer: self-attention and feed-forward sub-layers, each wrapped as
    LayerNorm(x + Dropout(sublayer(x))) -- BERT normalises after the residual sum (post-LN)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self._init_taps()
        self.attention = MultiHeadSelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x, mask=None, return_probs=False):  # x: (B, T, H)
        x = self.tap("input", x)
        attended, probs = self.attention(x, mask, return_probs)
        h = self.tap("resid_mid", self.attention_norm(x + self.dropout(attended)))  # (B, T, H)
        out = self.output_norm(h + self.dropout(self.feed_forward(h)))  # (B, T, H)
        return self.tap("output", out), probs


# ---------------------------------------------------------------------------------------------- encoder
class Encoder(nn.Module):
    """The stack of N blocks. Returns every intermediate output: they are what layer analysis studies."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))

    def forward(self, x, mask=None, return_probs=False, num_blocks=None, skip_blocks=()):
        """Run blocks 0..num_blocks-1 (all by default); a block in ``skip_blocks`` is the identity."""
        hidden_states, attentions = [x], []
        for i, block in enumerate(self.blocks[:num_blocks]):
            if i in skip_blocks:
                probs = None
            else:
                x, probs = block(x, mask, return_probs)
            hidden_states.append(x)
            attentions.append(probs)
        return hidden_states, attentions


# ----------------------------------------------------------------------------------------------- pooler
class Pooler(nn.Module, HookPoints):
    """Sentence vector for next-sentence prediction: tanh(W h_[CLS] + b) on the first token's output."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self._init_taps()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, last_hidden_state):  # (B, T, H)
        return self.tap("output", torch.tanh(self.dense(last_hidden_state[:, 0])))  # (B, H)


# ------------------------------------------------------------------------------------- masked-LM head
class MaskedLMHead(nn.Module):
    """The pre-training head that predicts masked tokens (paper, section 3.1, task #1):

        logits = LayerNorm(act(W h + b)) E^T + bias      E = the word embedding matrix (tied weights)

    It owns the transform and the output bias; the decoder weight is the model's word embeddings, passed
    in. Official pre-training checkpoints ship it as ``cls.predictions.*``; sentence encoders do not."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATION_FUNCTIONS[config.hidden_act]
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
                output_attentions=False, *, num_blocks=None, skip_blocks=(), fast=False) -> BertOutput:
        """input_ids (B, T) token ids. attention_mask (B, T): nonzero = real token, 0 = padding (keys at
        padding are never attended to). token_type_ids (B, T): segment 0 or 1, default 0.
        position_ids (B, T): default 0..T-1 in every row. token_type_ids and position_ids may also be one
        row, (1, T) or (T,), for the whole batch. A 1-D input is taken as one sequence.

        Interventions: ``num_blocks=k`` exits early after the first k blocks (hidden_states then has k + 1
        entries and the pooler reads block k's output); ``skip_blocks=[i, ...]`` makes those blocks the
        identity (their hidden state repeats the previous one, their attention entry is None).

        ``fast=True`` runs the padding-free inference path of ``minibert/fast.py`` (same results on real
        tokens to 1e-5, zeros at padding); when attention maps, hooks or training mode are involved the
        readable path below runs instead, as only it computes those. Under torch.compile the readable path
        is traced too (packing depends on the mask's values, which a compiled graph cannot branch on)."""
        input_ids, attention_mask, token_type_ids, position_ids = check_inputs(
            self.config, self.device, input_ids, attention_mask, token_type_ids, position_ids)
        num_blocks, skip_blocks = self._check_blocks(num_blocks, skip_blocks)
        if fast and not (output_attentions or self.training or self.has_hooks() or torch.compiler.is_compiling()):
            from .fast import fast_forward

            return fast_forward(self, input_ids, attention_mask, token_type_ids, position_ids,
                                num_blocks, skip_blocks)

        x = self.embeddings(input_ids, token_type_ids, position_ids)  # (B, T, H)
        mask = None  # no padding at all: no mask (torch.compile cannot branch on values: it keeps the mask)
        if attention_mask is not None and (torch.compiler.is_compiling() or not bool(attention_mask.all())):
            mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T): broadcast over heads, queries
        hidden_states, attentions = self.encoder(x, mask, output_attentions, num_blocks, skip_blocks)

        last = hidden_states[-1]
        return BertOutput(
            last_hidden_state=last,
            pooler_output=self.pooler(last) if self.pooler is not None else None,
            hidden_states=tuple(hidden_states),
            attentions=tuple(attentions) if output_attentions else None,
        )

    def _check_blocks(self, num_blocks, skip_blocks):
        N = self.config.num_hidden_layers
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                       or not 0 <= num_blocks <= N):
            raise InputError(f"num_blocks={num_blocks!r} is out of range: it must be an int in [0, {N}]")
        skip = set()
        for i in skip_blocks or ():
            if isinstance(i, bool) or not isinstance(i, int) or not -N <= i < N:
                raise InputError(f"skip_blocks has {i!r}; block indices must be ints in [0, {N - 1}]")
            skip.add(i % N)
        return num_blocks, skip

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Masked-LM scores (..., vocab_size) for hidden states (..., H), e.g. ``out.last_hidden_state``
        or any ``out.hidden_states[i]`` (the logit lens)."""
        if self.mlm_head is None:
            raise InputError(
                f"{getattr(self, 'source', 'this model')} has no masked-LM head (no cls.predictions.* "
                "tensors in the checkpoint): it is an encoder only, e.g. a sentence-embedding model. Use a "
                "pre-training checkpoint such as bert-base-uncased for fill-mask and the logit lens")
        return self.mlm_head(hidden, self.embeddings.word.weight)

    # ----------------------------------------------------------------- internals: see minibert/hooks.py
    def hook_point_names(self) -> list[str]:
        """Every named activation point, in the order the forward pass meets them."""
        return [name for name, *_ in hooks.point_table(self.config.num_hidden_layers, self.pooler is not None)]

    def has_hooks(self) -> bool:
        return any(getattr(m, "taps", None) for m in self.modules())

    def hooks(self, fns):
        """``with model.hooks({"blocks.3.attn.probs": fn}): model(**batch)`` -- register ``fn(x, name)``
        (returns None to read, or a same-shape tensor to replace) at named points or patterns
        (``"blocks.*.attn.probs"``) for the ``with`` block; removed on exit, exceptions included."""
        return hooks.registered(self, fns)

    def run_with_cache(self, *args, names=None, detach=True, **kwargs):
        """``out, cache = model.run_with_cache(**batch, names=[...])``: the output and {name: activation}
        for the requested points (all when names is None; patterns allowed)."""
        return hooks.run_with_cache(self, *args, names=names, detach=detach, **kwargs)

    def ablate_heads(self, heads, mode="zero", reference=None):
        """Context manager: zero- or mean-ablate heads given as a (layers, heads) bool mask,
        {layer: [heads]} or [(layer, head), ...]. See ``minibert.hooks.ablate_heads``."""
        return hooks.ablate_heads(self, heads, mode=mode, reference=reference)

    def patch(self, cache, names=None, positions=None):
        """Context manager: activation patching from ``cache`` (see ``minibert.hooks.patch``)."""
        return hooks.patch(self, cache, names=names, positions=positions)

    # --------------------------------------------------------------- surgery: see minibert/surgery.py
    def keep_blocks(self, indices) -> "BertModel":
        """A new, shallower model (copied weights) with only the blocks ``indices``, in that order, e.g.
        ``model.keep_blocks(range(1, 12, 2))`` for a 6-block student initialisation."""
        from .surgery import keep_blocks

        return keep_blocks(self, indices)

    def truncate(self, k: int) -> "BertModel":
        """A new model with the first ``k`` blocks: its hidden states equal the first k + 1 of this one."""
        from .surgery import keep_blocks

        return keep_blocks(self, range(k), what="truncate(k)")

    def freeze(self, embeddings: bool = True, blocks: int = 0, pooler: bool = False) -> "BertModel":
        """Layer-wise fine-tuning: stop gradients for the embeddings and the bottom ``blocks`` blocks."""
        from .surgery import freeze

        return freeze(self, embeddings=embeddings, blocks=blocks, pooler=pooler)

    def unfreeze(self) -> "BertModel":
        for p in self.parameters():
            p.requires_grad_(True)
        return self

    def parameter_counts(self) -> dict:
        """Parameters per component and per block (see ``minibert.accounting``)."""
        from .accounting import parameter_counts

        return parameter_counts(self)

    # loading and saving live in minibert/loading.py; these are the public entry points
    @classmethod
    def from_pretrained(cls, source, *, revision=None, dtype=None, device=None, mlm_head=None) -> "BertModel":
        """Load a checkpoint: a directory, a ``.safetensors`` file with config.json beside it, or a hub
        repo id (``google-bert/bert-base-uncased`` or the alias ``bert-base-uncased``).
        ``mlm_head``: None = load ``cls.predictions.*`` when the checkpoint has it, True = require it,
        False = leave it out (reported in ``skipped_tensors``)."""
        from .loading import load_model

        return load_model(cls, source, revision=revision, dtype=dtype, device=device, mlm_head=mlm_head)

    def save_pretrained(self, directory) -> None:
        """Write config.json and model.safetensors with transformers' tensor names."""
        from .loading import save_model

        save_model(self, directory)


# --------------------------------------------------------------------------------------- input checks
def _as_long_tensor(name: str, value, device) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(f"{name} must be a tensor of integer ids, could not convert it: {e}") from None
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise InputError(f"{name} must hold integers, got a tensor of dtype {value.dtype}")
    return value.to(device=device, dtype=torch.long)


def _check_range(name: str, ids: torch.Tensor, limit: int, what: str, hint: str = "") -> None:
    if torch.compiler.is_compiling():  # a value check would break the compiled graph; shapes are checked
        return
    bad = (ids < 0) | (ids >= limit)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise InputError(f"{name} has value {int(ids[where])} at position {where}; it must be in "
                         f"[0, {limit}) ({what}={limit}){hint}")


def check_inputs(config: BertConfig, device, input_ids, attention_mask, token_type_ids, position_ids):
    """Validate and normalise the forward arguments. Every error is a ValueError that names the
    argument, the offending value and the limit, instead of an index error deep inside an embedding."""
    input_ids = _as_long_tensor("input_ids", input_ids, device)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
        unsqueeze = True
    else:
        unsqueeze = False
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must have shape (batch, tokens), got {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if B == 0 or T == 0:
        raise InputError(f"input_ids is empty: shape {tuple(input_ids.shape)}")
    if T > config.max_position_embeddings:
        raise InputError(
            f"input_ids has {T} tokens per sequence, more than max_position_embeddings="
            f"{config.max_position_embeddings}; truncate the input (e.g. tokenizer(..., truncation=True))")
    _check_range("input_ids", input_ids, config.vocab_size, "vocab_size")

    def same_shape(name, value, integer=True, broadcast=False):
        """``broadcast``: one row, (1, T) or (T,), stands for every row of the batch (as in transformers)."""
        if value is None:
            return None
        if integer:
            value = _as_long_tensor(name, value, device)
        elif not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value, device=device)
        else:
            value = value.to(device)
        if (unsqueeze or broadcast) and value.dim() == 1:
            value = value[None]
        if broadcast and tuple(value.shape) == (1, T):
            value = value.expand(B, T)
        if tuple(value.shape) != (B, T):
            also = f" or {(1, T)}" if broadcast else ""
            raise InputError(f"{name} has shape {tuple(value.shape)} but input_ids has shape {(B, T)}; "
                             f"it must be {(B, T)}{also}")
        return value

    attention_mask = same_shape("attention_mask", attention_mask, integer=False)
    token_type_ids = same_shape("token_type_ids", token_type_ids, broadcast=True)
    position_ids = same_shape("position_ids", position_ids, broadcast=True)
    if token_type_ids is None:
        token_type_ids = torch.zeros_like(input_ids)
    else:
        _check_range("token_type_ids", token_type_ids, config.type_vocab_size, "type_vocab_size")
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
    else:
        _check_range("position_ids", position_ids, config.max_position_embeddings, "max_position_embeddings")
    return input_ids, attention_mask, token_type_ids, position_ids
