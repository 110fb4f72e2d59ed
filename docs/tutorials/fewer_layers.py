# %% [markdown]
# # Fewer layers on purpose
#
# Three ways to run fewer than all six blocks of all-MiniLM-L6-v2, each on a small slice so the whole
# notebook takes about three minutes on 2 cores (the full runs and their numbers are on
# [the results page](../../results/fewer-blocks/)):
#
# 1. **distil** a 3-block student that embeds sentences like its 6-block teacher;
# 2. **LayerDrop**: fine-tune with blocks randomly skipped, so the model still works with some removed;
# 3. **early exit**: let each input leave after the first block whose classifier is confident.

# %%
import importlib.util
import random
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minibert
from minibert import BertForSequenceClassification, BertModel, BertTokenizer
from minibert.tools.surgery import keep_blocks
from minibert.tools.encode import encode_texts
from minibert.training import depth, distill
from minibert.training.data import classification_batches
from minibert.training.datasets import read_table
from minibert.training.loop import FitConfig, fit
from minibert.training.settings import EmbeddingDistillConfig

root = Path(minibert.__file__).resolve().parents[1]
folder = root / "weights" / "all-MiniLM-L6-v2"
spec = importlib.util.spec_from_file_location(
    "fetch_data", root / "data" / "fetch_data.py"
)
fetch_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch_data)
tokenizer = BertTokenizer.from_pretrained(folder)

# %% [markdown]
# ## 1. Distillation: 6 -> 3 blocks
#
# The student starts as blocks 0, 2 and 5 of the teacher (the top one kept: it shapes the output space)
# and learns to give the same mean-pooled, unit-length vectors. Agreement is what a user of the vectors
# sees: the Spearman correlation of all pairwise cosines between the two models, on held-out sentences.

# %%
sentences = (
    (fetch_data.fetch_sentences() / "train.txt").read_text(encoding="utf-8").split("\n")
)
sentences = [s for s in sentences if s.strip()]
rng = random.Random(0)
rng.shuffle(sentences)
train_texts, held_texts = sentences[:3000], sentences[3000:3200]
teacher = BertModel.from_pretrained(folder, mlm_head=False).eval()
student = distill.init_student(teacher, [0, 2, 5])
reference = encode_texts(teacher, tokenizer, held_texts, normalize=True)
before = distill.embedding_agreement(
    reference, encode_texts(student, tokenizer, held_texts, normalize=True)
)
history = distill.distill_embeddings(
    teacher,
    student,
    tokenizer,
    train_texts,
    eval_texts=held_texts,
    config=EmbeddingDistillConfig(
        epochs=1, lr=5e-4, progress=False, normalize=True, cache_teacher=True
    ),
)
after = history.epochs[-1]["eval"]
print(
    f"Spearman agreement with the teacher: {before['spearman']:.3f} before, "
    f"{after['spearman']:.3f} after one epoch on {len(train_texts)} sentences; "
    f"top-10 overlap {after['top_k_overlap']:.3f}"
)
assert after["spearman"] > before["spearman"]

# %% [markdown]
# ## 2. LayerDrop, then pruning
#
# Fine-tune a TREC-6 classifier twice on the same 600 questions: once plainly, once with each block
# skipped with probability 0.2 on every training pass (Fan et al. 2019). Then keep 3 of the 6 blocks
# (1, 3, 5) of each and compare: the model that trained with blocks missing pays a little at full depth
# and loses much less when pruned.

# %%
trec = fetch_data.fetch_trec()
train, test = read_table(trec / "train.csv"), read_table(trec / "test.csv")
chosen = random.Random(0).sample(range(len(train.texts)), 600)
names = sorted(set(train.labels))
batches = classification_batches(
    tokenizer,
    [train.texts[i] for i in chosen],
    [names.index(train.labels[i]) for i in chosen],
    batch_size=16,
    max_length=48,
)


def accuracy(model) -> float:
    predicted = model.predict(test.texts, tokenizer=tokenizer, max_length=48)
    return sum(p["label"] == y for p, y in zip(predicted, test.labels)) / len(
        test.labels
    )


models = {}
for name, p in (("plain", 0.0), ("LayerDrop 0.2", 0.2)):
    model = BertForSequenceClassification.from_encoder(folder, labels=names, seed=0)
    drop = depth.LayerDrop(model, p=p, seed=0) if p else None
    fit(model, batches, config=FitConfig(epochs=3, lr=2e-4, progress=False))
    if drop is not None:
        drop.remove()
    models[name] = model
kept = depth.spread_blocks(6, 3)
pruned = {}
for name, model in models.items():
    pruned[name] = accuracy(keep_blocks(model, kept))
    print(
        f"{name:>14}: 6 blocks {accuracy(model):.3f}   "
        f"blocks {kept} only {pruned[name]:.3f}"
    )
assert pruned["LayerDrop 0.2"] > pruned["plain"]

# %% [markdown]
# ## 3. Early exit
#
# An exit after every block (a small classifier reading the block's mean token), trained on the plain
# classifier's frozen encoder. At inference a question leaves at the first exit whose prediction has
# entropy below a threshold: easy questions use fewer blocks.

# %%
ee = depth.EarlyExit(models["plain"], seed=0)
fit(ee, batches, config=FitConfig(epochs=2, lr=2e-3, progress=False))
per_exit = depth.exit_accuracies(ee, tokenizer, test.texts, test.labels, max_length=48)
print("accuracy of each exit:", [round(a, 3) for a in per_exit])
curve = []
for threshold in (0.0, 0.2, 0.5, 1.0):
    predicted, exits = ee.predict(
        test.texts, tokenizer=tokenizer, entropy=threshold, max_length=48
    )
    acc = sum(p == y for p, y in zip(predicted, test.labels)) / len(test.labels)
    curve.append((sum(exits) / len(exits) + 1, acc))
    print(
        f"entropy < {threshold}: {curve[-1][0]:.2f} blocks on average, "
        f"accuracy {acc:.3f}"
    )
plt.figure(figsize=(5, 3))
plt.plot([b for b, _ in curve], [a for _, a in curve], "o-")
plt.xlabel("blocks run (average)")
plt.ylabel("accuracy")
plt.show()
assert curve[0][0] == 6  # a threshold of 0 never exits early
