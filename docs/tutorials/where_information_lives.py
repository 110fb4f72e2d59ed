# %% [markdown]
# # Where information lives
#
# A BERT encoder hands you N + 1 hidden states. Which one should a task read, and what does each hold?
# This tutorial compares the layers of all-MiniLM-L6-v2 four ways: **similarity between layers** (CKA),
# a **learnt mix of layers** (ScalarMix), **linear probes** for parts of speech with a **control task**
# (Hewitt and Liang 2019: accuracy a probe reaches on random labels is memorisation, not knowledge), and a
# **map** of the same words at every layer.

# %%
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minibert
from minibert import BertModel, BertTokenizer
from minibert.analysis import layers as L
from minibert.analysis.probing import probe_model
from minibert.textfiles import read_conllu

root = Path(minibert.__file__).resolve().parents[1]
folder = root / "weights" / "all-MiniLM-L6-v2"
model = BertModel.from_pretrained(folder).eval()
tokenizer = BertTokenizer.from_pretrained(folder)
# a small UPOS sample (Universal Dependencies)
data = read_conllu(root / "tests" / "data" / "pos_sample.conllu")
print(
    len(data),
    "sentences;",
    sum(len(w) for w, _ in data),
    "words; first:",
    " ".join(data[0][0]),
)

# %% [markdown]
# ## How similar are the layers to each other?
#
# Linear CKA (Kornblith et al. 2019) compares two layers' token vectors up to rotation and scale: 1 means
# the same geometry. Consecutive layers are similar; the embeddings and the last block are not.

# %%
texts = [" ".join(words) for words, _ in data[:32]]
batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
with torch.inference_mode():
    out = model(**batch)
cka = L.cka_matrix(out.hidden_states, batch["attention_mask"])     # (L + 1, L + 1)
plt.figure(figsize=(4, 3.4))
plt.imshow(cka, vmin=0, vmax=1, cmap="viridis")
plt.colorbar(label="linear CKA")
plt.xlabel("hidden state")
plt.ylabel("hidden state")
plt.show()
assert torch.allclose(
    torch.diagonal(torch.as_tensor(cka)),
    torch.ones(len(out.hidden_states), dtype=torch.float64),
    atol=1e-6,
)

# %% [markdown]
# ## Probing every layer, with a control task
#
# A linear probe per hidden state predicts each word's part of speech from its vector (first word piece).
# The control task gives every word *type* a random label; a probe that does well on it is memorising
# words. **Selectivity** = accuracy - control accuracy: high where the layer encodes the property.

# %%
result = probe_model(model, tokenizer, data, progress=False)
print(result.table())
plt.figure(figsize=(6, 3))
plt.plot(result.layers, result.accuracy, "o-", label="UPOS accuracy")
plt.plot(result.layers, result.control_accuracy, "s--", label="control task")
plt.axhline(result.majority_baseline, color="grey", lw=0.8, label="majority label")
plt.xlabel("hidden state (0 = embeddings)")
plt.legend()
plt.show()
# context helps: not the embeddings
assert max(result.selectivity) > 0.1 and result.best_layer > 0

# %% [markdown]
# Accuracy alone peaks early (this sample's sentences are short and regular), but selectivity says where
# the layers *encode* parts of speech rather than let a probe memorise word types:

# %%
peak = result.layers[
    max(range(len(result.layers)), key=lambda i: result.selectivity[i])
]
print(
    "selectivity peaks at hidden state",
    peak,
    "- best raw accuracy at",
    result.best_layer,
)

# %% [markdown]
# ## A learnt mix of layers
#
# ELMo's ScalarMix learns one weight per layer (softmax-normalised) and a scale, and reads their weighted
# sum; its centre of gravity says which depth a task draws on. Fitting a mix needs a task: the
# [fine-tuning tutorial](../finetune_classifier/) trains one on TREC-6 questions. Untrained, it weighs
# every layer alike:

# %%
mix = L.ScalarMix(model.config.num_hidden_layers + 1)
mixed = mix(out.hidden_states, batch["attention_mask"])             # (B, T, H)
print(mixed.shape, "centre of gravity of an untrained mix:", L.centre_of_gravity(mix))

# %% [markdown]
# ## A map of the stack
#
# The same words, coloured by part of speech, projected to 2-D at each layer (PCA here). The number over
# each panel is the leave-one-out 5-nearest-neighbour accuracy of the labels in the full space -- the
# quantity to compare across panels; the picture is only a projection.

# %%
from minibert.analysis import maps

points = maps.word_points(model, tokenizer, data[:60])
result_map = maps.stack_map(points, "0,2,4,6", method="pca", max_points=800)
fig, axes = plt.subplots(1, len(result_map.layers), figsize=(14, 3.4))
kinds = sorted(set(result_map.labels))
for ax, layer, coords, knn in zip(
    axes, result_map.layers, result_map.coords, result_map.knn_accuracy
):
    for kind in kinds:
        chosen = [i for i, label in enumerate(result_map.labels) if label == kind]
        ax.scatter(coords[chosen, 0], coords[chosen, 1], s=4, label=kind)
    ax.set_title(f"hidden state {layer}: 5-NN {knn:.2f}")
    ax.set_xticks([])
    ax.set_yticks([])
axes[-1].legend(markerscale=3, fontsize=6, loc="center left", bbox_to_anchor=(1, 0.5))
plt.show()
assert result_map.knn_accuracy[-1] > result_map.knn_accuracy[0] - 0.2
