# %% [markdown]
# # The Annotated BERT
#
# `minibert/model.py` read top to bottom, on one real sentence and the real all-MiniLM-L6-v2 weights
# (6 blocks, 384 wide, 12 heads). Each step computes one line of the model by hand, shows the tensor,
# and checks it against what transformers' `BertModel` computes at the same point -- equal to the bit
# where the operations are the same, within fp32 rounding where they are not.
#
# Shapes: B = batch, T = tokens, H = hidden size, h = heads, d = H / h, F = feed-forward width.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
import transformers

import minibert
from minibert import BertModel, BertTokenizer

torch.set_printoptions(precision=4, sci_mode=False, linewidth=88)
transformers.logging.disable_progress_bar()  # no "Loading weights" bar in the page


def minibert_weights(name: str = "all-MiniLM-L6-v2") -> Path:
    return Path(minibert.__file__).resolve().parents[1] / "weights" / name


folder = minibert_weights()
model = BertModel.from_pretrained(folder).eval()                 # ours
reference = transformers.BertModel.from_pretrained(     # theirs
    folder, attn_implementation="eager").eval()
tokenizer = BertTokenizer.from_pretrained(folder)
print(model.config)

# %% [markdown]
# ## 1. Tokens
#
# WordPiece splits the sentence into pieces of the 30,522-entry vocabulary and wraps it in `[CLS]` ...
# `[SEP]`. Our tokenizer is written from scratch; the ids are transformers' fast tokenizer's ids.

# %%
sentence = "The bank raised its interest rates."
batch = tokenizer([sentence], return_tensors="pt")
ids = batch["input_ids"]                                          # (B, T) = (1, T)
print(tokenizer.convert_ids_to_tokens(ids[0].tolist()))
hf_tokenizer = transformers.BertTokenizerFast.from_pretrained(folder)
assert ids.tolist() == hf_tokenizer([sentence])["input_ids"]
B, T = ids.shape
H, h = model.config.hidden_size, model.config.num_attention_heads
d = H // h

# %% [markdown]
# ## 2. The input representation
#
# Each token's vector is the sum of three learnt embeddings -- its word piece, its position and its
# segment -- normalised by LayerNorm (the paper's figure 2):
#
# $$x_t = \mathrm{LayerNorm}\big(E_{\text{word}}[w_t] + E_{\text{type}}[s_t] + E_{\text{pos}}[t]\big)$$

# %%
emb = model.embeddings
positions = torch.arange(T)[None]                                  # (1, T): 0..T-1
# (1, T): one sentence, segment 0
segments = torch.zeros_like(ids)
with torch.no_grad():
    # (B, T, H)
    summed = (emb.word(ids) + emb.token_type(segments)) + emb.position(positions)
    # (B, T, H) = hidden_states[0]
    x = emb.norm(summed)
    theirs = reference.embeddings(input_ids=ids)
print(x.shape, x[0, :3, :6])
# bit for bit: the same three lookups, summed in the same order
assert torch.equal(x, theirs)

# %% [markdown]
# The sum mixes three scales; LayerNorm brings every token to mean 0 and variance 1 (then scales and
# shifts each feature by its learnt gain and bias):

# %%
fig, ax = plt.subplots(figsize=(7, 2.6))
ax.plot(summed[0].norm(dim=-1).tolist(), "o-", label="|word + type + position|")
ax.plot(x[0].norm(dim=-1).tolist(), "s-", label="|LayerNorm(sum)|")
ax.set_xticks(range(T), tokenizer.convert_ids_to_tokens(ids[0].tolist()), rotation=45)
ax.set_ylabel("vector norm")
ax.legend()
plt.show()

# %% [markdown]
# ## 3. One head of self-attention
#
# Block 0 projects every token three ways. Split into h = 12 heads of d = 32 features, each head attends
# with its own queries, keys and values (Vaswani et al. 2017, section 3.2):
#
# $$\mathrm{head}_i = \mathrm{softmax}\Big(\frac{Q_i K_i^\top}{\sqrt{d}} + M\Big) V_i$$

# %%
attn = model.encoder.blocks[0].attn
layer = reference.encoder.layer[0].attention.self
with torch.no_grad():
    q = attn.query(x).view(B, T, h, d).transpose(1, 2)             # (B, h, T, d)
    k = attn.key(x).view(B, T, h, d).transpose(1, 2)               # (B, h, T, d)
    v = attn.value(x).view(B, T, h, d).transpose(1, 2)             # (B, h, T, d)
    assert torch.equal(attn.query(x), layer.query(x)) and torch.equal(
        attn.value(x), layer.value(x)
    )
    # (B, h, T, T); times 1/sqrt(d), as the model
    scores = q @ k.transpose(-2, -1) * d**-0.5
print("head 3's scores, first 5 queries x keys:\n", scores[0, 3, :5, :5])

# %% [markdown]
# The mask $M$ is 0 where a key is a real token and the most negative float where it is padding; this
# sentence has no padding, so it changes nothing here (the [parity how-to](../../how-to/parity-ci/) shows
# padded batches). The softmax turns each query's row of scores into a distribution over the keys:

# %%
# (B, h, T, T), rows sum to 1
probs = scores.softmax(dim=-1)
with torch.no_grad():
    out = model(**batch, output_attentions=True)
    ref = reference(**batch, output_attentions=True, output_hidden_states=True)
assert torch.allclose(probs.sum(-1), torch.ones(B, h, T))
# our explicit path, by hand
assert torch.equal(probs, out.attentions[0])
print(
    "largest difference to transformers' attention:",
    (probs - ref.attentions[0]).abs().max().item(),
)
assert torch.equal(out.attentions[0], ref.attentions[0])

tokens = tokenizer.convert_ids_to_tokens(ids[0].tolist())
fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
for ax, head in zip(axes, (0, 3, 7)):
    ax.imshow(probs[0, head], cmap="viridis")
    ax.set_title(f"block 0, head {head}")
    ax.set_xticks(range(T), tokens, rotation=90)
    ax.set_yticks(range(T), tokens)
plt.tight_layout()
plt.show()

# %% [markdown]
# Each head's output is its probability-weighted average of the values; the heads are concatenated back to
# H features and mixed by the output projection $W_O$:

# %%
with torch.no_grad():
    # (B, T, H): heads side by side
    context = (probs @ v).transpose(1, 2).reshape(B, T, H)
    attended = attn.output(context)                                # (B, T, H)
    theirs = reference.encoder.layer[0].attention.output.dense(context)
assert torch.equal(attended, theirs)
print(attended.shape)

# %% [markdown]
# ## 4. Residual and LayerNorm
#
# BERT normalises *after* adding the sub-layer to its input (post-LN):
#
# $$h = \mathrm{LayerNorm}(x + \mathrm{Attention}(x))$$

# %%
block = model.encoder.blocks[0]
with torch.no_grad():
    h_mid = block.attn_norm(x + attended)                          # (B, T, H)
    theirs = reference.encoder.layer[0].attention(x)[0]
print("attention sub-layer, largest difference:", (h_mid - theirs).abs().max().item())
# eager attention vs our hand-written steps: rounding only
assert (h_mid - theirs).abs().max() < 1e-5

# %% [markdown]
# ## 5. The feed-forward network
#
# Each token alone goes through a two-layer network, four times wider inside (F = 1,536), with the exact
# erf GELU:
#
# $$\mathrm{FFN}(h) = W_2\,\mathrm{GELU}(W_1 h + b_1) + b_2, \qquad \mathrm{out} = \mathrm{LayerNorm}(h + \mathrm{FFN}(h))$$

# %%
ffn = block.ffn
with torch.no_grad():
    inner = F.gelu(ffn.dense_in(h_mid))                            # (B, T, F)
    # (B, T, H) = hidden_states[1]
    block_out = block.ffn_norm(h_mid + ffn.dense_out(inner))
print(
    inner.shape,
    "share of GELU outputs that are negative:",
    (inner < 0).float().mean().item(),
)
print(
    "block 0 by hand vs transformers' hidden_states[1]:",
    (block_out - ref.hidden_states[1]).abs().max().item(),
)
assert (block_out - ref.hidden_states[1]).abs().max() < 1e-5

# %% [markdown]
# ## 6. The stack of hidden states
#
# The same block, with its own weights, runs N = 6 times. `hidden_states` keeps every step: the input
# representation and each block's output -- what layer analysis studies.

# %%
for i, (ours, theirs) in enumerate(zip(out.hidden_states, ref.hidden_states)):
    print(
        f"hidden_states[{i}]: norm {ours[0].norm(dim=-1).mean():7.3f}   "
        f"largest difference to transformers {(ours - theirs).abs().max().item():.1e}"
    )
    # the model itself runs transformers' operations in their order
    assert torch.equal(ours, theirs)
similarity = [
    F.cosine_similarity(out.hidden_states[i][0], out.hidden_states[i + 1][0])
    .mean()
    .item()
    for i in range(len(out.hidden_states) - 1)
]
plt.figure(figsize=(6, 2.6))
plt.plot(range(1, 7), similarity, "o-")
plt.xlabel("block")
plt.ylabel("cos(input, output)")
plt.title("how much each block changes the tokens")
plt.show()

# %% [markdown]
# ## 7. The pooler
#
# For next-sentence prediction BERT reads one vector for the whole input: the last block's output at
# `[CLS]`, through a dense layer and tanh:
#
# $$\mathrm{pooled} = \tanh(W_p\, h^{(N)}_{[\mathrm{CLS}]} + b_p)$$

# %%
with torch.no_grad():
    pooled = torch.tanh(model.pooler.dense(out.last_hidden_state[:, 0]))   # (B, H)
assert torch.equal(pooled, out.pooler_output) and torch.equal(
    out.pooler_output, ref.pooler_output
)
print(pooled.shape, pooled[0, :6])

# %% [markdown]
# That is the whole model. Everything else in minibert -- the [fast path](../../how-to/fast-path/),
# [hooks](../hooks_and_patching/), [fine-tuning](../finetune_classifier/) -- plugs in from its own module
# and leaves `model.py` as you just read it.
