"""Accounting: parameters per component, forward FLOPs per token, activation memory.

For BERT-base (12 blocks, H = 768, F = 3072, h = 12, vocab 30522, 512 positions, 2 token types):

    embeddings  23,837,184   (30522 + 512 + 2) x 768 + LayerNorm 2 x 768
    each block   7,087,872   q, k, v, W_O: 4 (768^2 + 768); FFN: 2 x 768 x 3072 + 3072 + 768; 2 LayerNorms
    pooler         590,592   768^2 + 768
    total      109,482,240

Forward FLOPs per token (a multiply-add = 2 FLOPs), the usual convention (Kaplan et al. 2020):
2 x (block parameters) for the dense layers, plus 4 x N x H x T for q k^T and probs @ v over T tokens;
the pooler adds 2 x (H^2 + H) once per sequence. LayerNorm, softmax and GELU are not counted.
``pretraining_flops``: a masked-LM training step (3 x forward, the head at the masked tokens only).
"""

from __future__ import annotations

import torch

from ..config import BertConfig
from ..inputs import check_index
from ..model import BertModel


#: a block's parts, named as its modules are (and as the hook points are)
BLOCK_PARTS = ("attn.query", "attn.key", "attn.value", "attn.output", "attn_norm", "ffn.dense_in",
               "ffn.dense_out", "ffn_norm")


def _model_for(model_or_config):
    if isinstance(model_or_config, BertConfig):
        with torch.device("meta"):  # shapes only, no memory
            return BertModel(model_or_config).eval()
    return model_or_config


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def parameter_counts(model_or_config) -> dict:
    """Parameters by component. Keys: embeddings.{word,position,token_type,norm}, embeddings,
    blocks.{i} (and, for block 0, its parts as the model names them: block.attn.{query,key,value,output},
    block.attn_norm, block.ffn.{dense_in,dense_out}, block.ffn_norm),
    blocks (the blocks alone), final_norm (pre-LN's last LayerNorm; 0 for BERT's post-LN), pooler, total,
    non_embedding (blocks + final_norm + pooler). A config is counted as BERT would build it."""
    model = _model_for(model_or_config)
    e = model.embeddings
    counts = {
        "embeddings.word": _numel(e.word), "embeddings.position": _numel(e.position),
        "embeddings.token_type": _numel(e.token_type), "embeddings.norm": _numel(e.norm),
        "embeddings": _numel(e),
    }
    for i, block in enumerate(model.encoder.blocks):
        counts[f"blocks.{i}"] = _numel(block)
    if len(model.encoder.blocks):
        block = model.encoder.blocks[0]
        counts.update({f"block.{name}": _numel(block.get_submodule(name)) for name in BLOCK_PARTS})
    final = getattr(model.encoder, "final_norm", None)
    counts["final_norm"] = _numel(final) if final is not None else 0
    counts["blocks"] = _numel(model.encoder) - counts["final_norm"]
    counts["pooler"] = _numel(model.pooler) if model.pooler is not None else 0
    if getattr(model, "mlm_head", None) is not None:  # tied: its decoder is the word embeddings; untied: counted here
        counts["mlm_head"] = _numel(model.mlm_head)
    counts["total"] = _numel(model)
    counts["non_embedding"] = counts["blocks"] + counts["final_norm"] + counts["pooler"]
    return counts


def flops_per_token(model_or_config, seq_len: int) -> dict:
    """Forward FLOPs per token at sequence length ``seq_len``: {"dense", "attention", "total",
    "pooler_per_sequence"}; total = dense + attention (the pooler runs once per sequence)."""
    model = _model_for(model_or_config)
    config = model.config
    check_index("seq_len", seq_len, 1, config.max_position_embeddings, "max_position_embeddings")
    dense = 2 * _numel(model.encoder)
    attention = 4 * len(model.encoder.blocks) * config.hidden_size * seq_len
    pooler = 2 * _numel(model.pooler) if model.pooler is not None else 0
    return {"dense": dense, "attention": attention, "total": dense + attention, "pooler_per_sequence": pooler}


def forward_flops(model_or_config, batch: int, seq_len: int) -> int:
    """FLOPs of one forward pass over a dense (batch, seq_len) input."""
    f = flops_per_token(model_or_config, seq_len)
    return batch * seq_len * f["total"] + batch * f["pooler_per_sequence"]


def pretraining_flops(config: BertConfig, batch: int, seq_len: int, mask: float = 0.15) -> int:
    """FLOPs of one masked-LM training step over a dense (batch, seq_len) input: 3 x forward (the backward
    pass costs about twice the forward; Kaplan et al. 2020) of the blocks, plus the masked-LM head at the
    masked tokens only (its transform, 2 H^2, and the tied decoder, 2 H V, per masked token -- the sparse
    prediction ``models.pretraining`` does). For small widths the head is a large share: at H = 256 the
    decoder costs as much per masked token as ~2 blocks per token."""
    check_index("seq_len", seq_len, 1, config.max_position_embeddings, "max_position_embeddings")
    tokens = batch * seq_len
    blocks = tokens * flops_per_token(config, seq_len)["total"]
    head = round(tokens * mask) * (2 * config.hidden_size ** 2 + 2 * config.hidden_size * config.vocab_size)
    return 3 * (blocks + head)


def activation_memory(model_or_config, batch: int, seq_len: int, dtype=torch.float32,
                      output_attentions: bool = False) -> dict:
    """Estimated activation bytes for a (batch, seq_len) input:

    - ``inference``: what a no-grad forward holds at its peak -- the returned hidden states ((N + 1) BTH),
      the attention maps if asked for (N B h T^2), plus the largest transient inside one block (the FFN's
      two (B, T, F) tensors, or q, k, v, context and the (B, h, T, T) scores and probabilities on the
      explicit path).
    - ``training``: what autograd saves for backward, per block: the inputs of the dense layers (x, context,
      h: 3 BTH; GELU input and output: 2 BTF), q, k, v (3 BTH), the two LayerNorm inputs (2 BTH), the
      probabilities (B h T^2) when the explicit path runs; in train mode with dropout also the dropout masks
      and the dropped probabilities (2 B h T^2 + 2 BTH); plus the embeddings' LayerNorm input (and its
      dropout mask). The model's own mode (``model.train()``/``eval()``) decides; a config counts as eval.
      Checked against the tensors torch's autograd saves, in the tests.
    """
    model = _model_for(model_or_config)
    c = model.config
    size = torch.empty((), dtype=dtype).element_size()
    B, T, H, F, h, N = batch, seq_len, c.hidden_size, c.intermediate_size, c.num_attention_heads, len(
        model.encoder.blocks)
    BTH, BTF, attn = B * T * H, B * T * F, B * h * T * T
    kept = (N + 1) * BTH + (N * attn if output_attentions else 0)
    explicit = output_attentions
    transient = max(2 * BTF + BTH, 4 * BTH + (2 * attn if explicit else 0))
    inference = (kept + transient) * size

    dropout = model.training and (c.hidden_dropout_prob > 0 or c.attention_probs_dropout_prob > 0)
    # the probabilities are saved when the explicit path runs (attentions asked for) or with dropout
    saved_probs = attn if (output_attentions or dropout) else 0
    per_block = 8 * BTH + 2 * BTF + saved_probs
    if dropout:
        per_block += 2 * attn + 2 * BTH  # attention-dropout mask and dropped probabilities, 2 dropout masks
    training = (N * per_block + BTH * (2 if dropout else 1)) * size  # + the embeddings' LayerNorm input
    return {"inference": inference, "training": training, "dtype": str(dtype).replace("torch.", "")}


def format_report(model_or_config, name: str = "model", lengths=(128, 512), batch: int = 8) -> str:
    """The ``minibert inspect`` table."""
    model = _model_for(model_or_config)
    c = model.config
    counts = parameter_counts(model)
    total = counts["total"]
    lines = [f"{name}: {c.num_hidden_layers} blocks, hidden {c.hidden_size}, {c.num_attention_heads} heads "
             f"(d = {c.head_size}), FFN {c.intermediate_size}, vocab {c.vocab_size}, "
             f"{c.max_position_embeddings} positions, {c.hidden_act}, "
             + ("BERT's post-LN blocks" if c.norm_placement == "post" else
                f"{c.norm_placement} norm placement (an ablation, models/norms.py"
                + (f"; residual scale {c.residual_scale:g})" if c.norm_placement == "deepnorm" else ")")),
             "", f"{'component':<28}{'parameters':>14}{'share':>9}"]

    def row(label, n):
        lines.append(f"{label:<28}{n:>14,}{100 * n / total:>8.2f}%")

    for key in ("embeddings.word", "embeddings.position", "embeddings.token_type", "embeddings.norm"):
        row("  " + key, counts[key])
    row("embeddings", counts["embeddings"])
    if c.num_hidden_layers:
        for key in BLOCK_PARTS:
            row("  block." + key, counts["block." + key])
        row("each block", counts["blocks.0"])
    row(f"blocks (x{c.num_hidden_layers})", counts["blocks"])
    if counts["final_norm"]:
        row("final LayerNorm (pre-LN)", counts["final_norm"])
    row("pooler", counts["pooler"])
    row("total", total)

    lines += ["", f"{'forward FLOPs per token':<28}{'dense':>14}{'attention':>14}{'total':>14}"]
    for T in lengths:
        if T <= c.max_position_embeddings:
            f = flops_per_token(model, T)
            lines.append(f"{'  T = ' + str(T):<28}{f['dense'] / 1e6:>13.1f}M{f['attention'] / 1e6:>13.2f}M"
                         f"{f['total'] / 1e6:>13.1f}M")
    lines.append(f"  (pooler: {flops_per_token(model, 1)['pooler_per_sequence'] / 1e6:.2f}M per sequence)")

    lines += ["", f"{'activation memory, fp32':<28}{'inference':>14}{'+attentions':>14}{'training':>14}"]
    for T in lengths:
        if T <= c.max_position_embeddings:
            m = activation_memory(model, batch, T)
            ma = activation_memory(model, batch, T, output_attentions=True)
            lines.append(f"{f'  batch {batch} x T = {T}':<28}{m['inference'] / 2**20:>11.1f}MiB"
                         f"{ma['inference'] / 2**20:>11.1f}MiB{m['training'] / 2**20:>11.1f}MiB")
    lines.append("  (training: saved for backward without dropout; bf16/fp16 halve every number)")
    return "\n".join(lines)
