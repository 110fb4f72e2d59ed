# %% [markdown]
# # Hooks, caching and patching
#
# Every activation worth studying passes through a named **hook point** (`blocks.3.attn.probs`,
# `blocks.4.output`, ...; the [reference](../../reference/hooks/) lists them all). This tutorial reads
# them with a cache, finds the heads that attend to the previous token, knocks them out, and patches an
# activation from one sentence into another -- on the real all-MiniLM-L6-v2 weights.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minibert
from minibert import BertModel, BertTokenizer
from minibert.tools import hooks

folder = Path(minibert.__file__).resolve().parents[1] / "weights" / "all-MiniLM-L6-v2"
model = BertModel.from_pretrained(folder).eval()
tokenizer = BertTokenizer.from_pretrained(folder)

# %% [markdown]
# ## The activation cache
#
# `run_with_cache` runs the model once and keeps the activations named by the patterns. The attention
# probabilities it caches are the ones the model returns with `output_attentions=True`.

# %%
batch = tokenizer(
    ["The quick brown fox jumps over the lazy dog near the river bank today."],
    return_tensors="pt",
)
with torch.inference_mode():
    out, cache = hooks.run_with_cache(model, **batch, names="blocks.*.attn.probs")
    plain = model(**batch, output_attentions=True)
# (layers, heads, T, T) for the one sentence
probs = cache.stack("attn.probs")[:, 0]
print(probs.shape)
assert all(
    torch.equal(probs[i], plain.attentions[i][0]) for i in range(len(plain.attentions))
)

# %% [markdown]
# ## Previous-token heads
#
# A head that puts most of each query's weight on the token just before it shows up as a bright line
# below the diagonal. Score each head by that weight:

# %%
# (layers, heads, T-1): weight on token t-1
prev = probs.diagonal(offset=-1, dim1=-2, dim2=-1)
score = prev[..., 1:-1].mean(-1)                           # leave out [SEP]'s row
plt.figure(figsize=(6, 3))
plt.imshow(score, cmap="magma", vmin=0, vmax=1)
plt.colorbar(label="attention on the previous token")
plt.xlabel("head")
plt.ylabel("block")
plt.show()
found = (score > 0.3).nonzero().tolist()
for layer, head in found:
    print(f"block {layer} head {head}: {score[layer, head]:.2f}")
assert found, "MiniLM has previous-token heads"

# %%
layer, head = max(found, key=lambda lh: score[lh[0], lh[1]])
tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
plt.figure(figsize=(5, 5))
plt.imshow(probs[layer, head], cmap="viridis")
plt.xticks(range(len(tokens)), tokens, rotation=90)
plt.yticks(range(len(tokens)), tokens)
plt.title(f"block {layer}, head {head}")
plt.show()

# %% [markdown]
# ## Head ablation
#
# `ablate_heads` replaces chosen heads' outputs (their per-head context, before $W_O$) with zeros for the
# `with` block only. How much does knocking out every previous-token head move the sentence's last layer?

# %%
with torch.inference_mode():
    before = model(**batch)
    with hooks.ablate_heads(model, score > 0.3):
        ablated = model(**batch)
    # outside the block: the model as it was
    again = model(**batch)
moved = (ablated.last_hidden_state - before.last_hidden_state).norm(dim=-1)[0]
print(
    "change of each token's last-layer vector:", [round(v, 2) for v in moved.tolist()]
)
assert torch.equal(again.last_hidden_state, before.last_hidden_state)
assert moved.max() > 0

# %% [markdown]
# ## Activation patching
#
# Run a *clean* and a *corrupted* sentence of the same length, then rerun the corrupted one with one
# activation copied in from the clean run. If the output moves back towards the clean one, that
# activation carried the difference. Here we patch block 4's output at the position where the two
# sentences differ, and at one where they do not.

# %%
clean_batch = tokenizer(["The tower is in Paris, France."], return_tensors="pt")
corrupted_batch = tokenizer(["The tower is in Rome, France."], return_tensors="pt")
assert clean_batch["input_ids"].shape == corrupted_batch["input_ids"].shape
differ = (
    (clean_batch["input_ids"] != corrupted_batch["input_ids"]).nonzero()[:, 1].tolist()
)
with torch.inference_mode():
    _, clean = hooks.run_with_cache(model, **clean_batch)
    clean_out = model(**clean_batch).last_hidden_state
    corrupt_out = model(**corrupted_batch).last_hidden_state
    for position in (differ[0], 1):
        with hooks.patch(model, clean, "blocks.4.output", positions=[position]):
            patched = model(**corrupted_batch).last_hidden_state
        gap_before = (corrupt_out - clean_out).norm().item()
        gap_after = (patched - clean_out).norm().item()
        print(
            f"patch position {position}: distance to the clean run "
            f"{gap_before:.2f} -> {gap_after:.2f}"
        )
        if position == differ[0]:
            assert gap_after < gap_before

# %% [markdown]
# Hooks are visible only to the thread that opened the `with` block, so a server can ablate a head for
# one request while other threads run the same model untouched. More: [the internals how-to](../../how-to/internals/).
