"""Where a block's LayerNorm sits: BERT's post-LN and two ablations, pre-LN and DeepNorm (not BERT).

BERT normalises after each residual sum (``model.Block``, post-LN):

    post:      h = LN(x + Attn(x))                 out = LN(h + FFN(h))

Xiong et al. 2020 ("On Layer Normalization in the Transformer Architecture") show that at initialisation
post-LN's gradients are largest for the blocks near the output, which is why it needs a learning-rate
warmup; moving the LayerNorm inside the residual branch removes that, and the stack then needs one
LayerNorm at its end (GPT-2, Cramming, ModernBERT and NeoBERT all place it so):

    pre:       h = x + Attn(LN(x))                 out = h + FFN(LN(h))       last block: LN_final(out)

Wang et al. 2022 ("DeepNet: Scaling Transformers to 1,000 Layers") keep post-LN but up-weight the
residual by alpha and shrink the initialisation of the branches by beta; for an encoder-only model of N
blocks (their Figure 2's table, "Encoder-only (e.g., BERT)"): alpha = (2N)^(1/4), beta = (8N)^(-1/4):

    deepnorm:  h = LN(alpha x + Attn(x))           out = LN(alpha h + FFN(h))

with the value and output projections of attention and both feed-forward matrices initialised at beta
times BERT's N(0, 0.02) (the query and key projections are left alone, as in the paper; scaling the
existing initialisation by beta is what the authors' torchscale does).

The blocks keep BERT's modules and names (``attn``, ``attn_norm``, ``ffn``, ``ffn_norm``), so a checkpoint
holds the same tensors (plus ``encoder.final_norm.*`` for pre-LN) and hook points keep their names; what a
hook point holds follows the placement (in pre-LN ``attn_norm`` is what attention reads). ``config.json``
records ``norm_placement`` (and DeepNorm's alpha as ``residual_scale``, fixed when the model is made, so a
model cut to fewer blocks keeps the alpha it was trained with). transformers' BertModel knows only post-LN:
it would read such a checkpoint as BERT and compute something else, so saving and loading one says so.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import BertConfig
from ..model import Block, Encoder


def deepnorm_constants(num_blocks: int) -> tuple[float, float]:
    """(alpha, beta) of DeepNorm for an encoder-only stack of ``num_blocks`` blocks (Wang et al. 2022)."""
    return (2 * num_blocks) ** 0.25, (8 * num_blocks) ** -0.25


class PreLNBlock(Block):
    """A block with its LayerNorms at the start of each residual branch: x + Dropout(sublayer(LN(x)))."""

    def forward(self, x, mask=None, return_probs=False):  # x: (B, T, H)
        x = self.hook_input(x)
        attended, probs = self.attn(self.hook_attn_norm(self.attn_norm(x)), mask, return_probs)
        h = self.hook_resid_mid(x + self.dropout(attended))  # (B, T, H)
        out = self.hook_resid_post(h + self.dropout(self.ffn(self.ffn_norm(h))))  # (B, T, H)
        return self.hook_output(out), probs


class DeepNormBlock(Block):
    """BERT's post-LN block with the residual up-weighted: LN(alpha x + Dropout(sublayer(x)))."""

    alpha: float = 1.0  # set per model from config.residual_scale

    def forward(self, x, mask=None, return_probs=False):  # x: (B, T, H)
        x = self.hook_input(x)
        attended, probs = self.attn(x, mask, return_probs)
        h = self.hook_attn_norm(self.attn_norm(self.hook_resid_mid(self.alpha * x + self.dropout(attended))))
        out = self.ffn_norm(self.hook_resid_post(self.alpha * h + self.dropout(self.ffn(h))))  # (B, T, H)
        return self.hook_output(out), probs


class PreLNEncoder(Encoder):
    """The stack of pre-LN blocks and the final LayerNorm on the last block's output (the residual stream
    is never normalised inside the blocks, so the stack normalises it once at the end)."""

    final_norm: nn.LayerNorm

    def forward(self, x, mask=None, return_probs=False, num_blocks=None, skip_blocks=(), keep_all=True):
        hidden_states, attentions = super().forward(x, mask, return_probs, num_blocks, skip_blocks, keep_all)
        hidden_states[-1] = self.final_norm(hidden_states[-1])  # what the pooler, heads and users read
        return hidden_states, attentions


def place_norms(model: nn.Module, config: BertConfig) -> None:
    """Give ``model`` (a freshly built ``model.BertModel``: BERT's post-LN blocks, BERT's initialisation)
    the norm placement ``config.norm_placement`` says: the blocks become ``PreLNBlock`` or ``DeepNormBlock``
    (the same modules and parameters; only the forward pass differs), pre-LN adds the final LayerNorm and
    DeepNorm scales its branches' initialisation by beta. Nothing happens for "post"."""
    placement = config.norm_placement
    model.norm_placement = placement  # what loading and saving check the config against
    if placement == "post":
        return
    blocks = model.encoder.blocks
    if placement == "pre":
        model.encoder.__class__ = PreLNEncoder  # the same module, with the final LayerNorm's forward
        model.encoder.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps,
                                                device=blocks[0].attn_norm.weight.device)
        for block in blocks:
            block.__class__ = PreLNBlock
        return
    _, beta = deepnorm_constants(config.num_hidden_layers)
    for block in blocks:
        block.__class__ = DeepNormBlock
        block.alpha = config.residual_scale
        with torch.no_grad():  # a loaded model's weights are replaced right after; a new one keeps these
            for linear in (block.attn.value, block.attn.output, block.ffn.dense_in, block.ffn.dense_out):
                linear.weight.mul_(beta)


def norm_config(config: BertConfig, placement: str) -> BertConfig:
    """``config`` with ``placement`` (and, for DeepNorm, alpha for its number of blocks): what
    ``pretrain --norm`` builds from scratch."""
    import dataclasses

    alpha = deepnorm_constants(config.num_hidden_layers)[0] if placement == "deepnorm" else 1.0
    return dataclasses.replace(config, norm_placement=placement, residual_scale=alpha)
