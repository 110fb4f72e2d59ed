# %% [markdown]
# # Pre-train a small BERT
#
# BERT learns by filling in blanks: 15 % of the tokens of a text are hidden and the model predicts them
# from both sides (the masked-language-model objective, Devlin et al. 2019, section 3.1). This tutorial
# trains a BERT-tiny (2 blocks, 128 wide) **from nothing** on 22,703 English sentences for a couple of
# minutes, watches its loss fall, and asks it to fill masks -- then continues the pre-training of
# all-MiniLM-L6-v2, which has no masked-LM head, on the same text. The long runs are on
# [the pre-training results page](../../results/pretrain-epyc-zen4/).

# %%
import importlib.util
import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import minibert
from minibert import BertTokenizer
from minibert.analysis.lens import fill_mask
from minibert.runs.pretrain import run_pretraining
from minibert.runs.settings import PretrainRun
from minibert.training.pretrain_data import Examples, TokenStore

root = Path(minibert.__file__).resolve().parents[1]
folder = root / "weights" / "all-MiniLM-L6-v2"
spec = importlib.util.spec_from_file_location(
    "fetch_data", root / "data" / "fetch_data.py"
)
fetch_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch_data)
# VADER's sentences, from a sha256-checked PyPI archive
sentences = fetch_data.fetch_sentences()
work = Path(tempfile.mkdtemp())
# the vocabulary the new model will learn ids of
tokenizer = BertTokenizer.from_pretrained(folder)

# %% [markdown]
# ## From text to masked examples
#
# The corpus is tokenised once into a **token store** on disk (a memory-mapped array of ids); examples
# are windows of it, `[CLS]` + 62 tokens + `[SEP]`, packed across sentence boundaries as RoBERTa does.
# Each example's mask is drawn from a generator seeded by its number, so the same example always gets the
# same mask: of the 15 % chosen, 80 % become `[MASK]`, 10 % a random token, 10 % stay as they were.

# %%
store = TokenStore.build(
    [sentences / "train.txt"], tokenizer, work / "store", progress=False
)
print(store)
examples = Examples(store, tokenizer, max_length=64)
batch = examples.batch(range(2))
tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
targets = batch["labels"][0]
print(
    " ".join(
        f"[{tok}->{tokenizer.convert_ids_to_tokens([int(t)])[0]}]" if t != -100 else tok
        for tok, t in zip(tokens, targets)
    )
)
chosen = (batch["labels"] != -100).float().mean().item()
print(f"share of positions to predict: {chosen:.3f}")

# %% [markdown]
# ## Training from scratch
#
# `run_pretraining` is what `minibert pretrain` runs: BERT's N(0, 0.02) initialisation, AdamW with
# RoBERTa's settings, warmup then linear decay, a held-out evaluation with a fixed mask every 50 steps,
# and the model written where `minibert fill` and transformers can load it. The loss starts near
# ln(30,522) = 10.3: a uniform guess over the vocabulary.

# %%
run = run_pretraining(
    PretrainRun(
        corpus=[sentences / "train.txt"],
        out=work / "tiny",
        geometry="tiny",
        vocab=str(folder),
        max_length=64,
        eval_texts=sentences / "held.txt",
        steps=200,
        batch_size=32,
        lr=1e-3,
        eval_every=50,
        log_every=10,
        eval_examples=128,
        progress=False,
    )
)
log = [
    json.loads(line) for line in (work / "tiny" / "log.jsonl").read_text().splitlines()
]
evals = [r for r in log if "eval_loss" in r]
plt.figure(figsize=(6, 3))
plt.plot([r["step"] for r in log], [r["loss"] for r in log], label="training loss")
plt.plot(
    [r["step"] for r in evals],
    [r["eval_loss"] for r in evals],
    "o-",
    label="held-out loss",
)
plt.axhline(
    torch.log(torch.tensor(30522.0)).item(), color="grey", lw=0.8, label="uniform guess"
)
plt.xlabel("step")
plt.legend()
plt.show()
print(
    f"held-out: loss {evals[-1]['eval_loss']:.2f}, "
    f"perplexity {evals[-1]['perplexity']:.0f}, "
    f"masked-token accuracy {evals[-1]['masked_accuracy']:.3f}"
)
assert evals[-1]["eval_loss"] < log[0]["loss"] - 2

# %% [markdown]
# ## Filling masks
#
# Two minutes of training on half a million tokens teach a model the most frequent words and where
# punctuation goes, not meaning: expect "the", ",", "." and "and". The full hour on six million tokens
# ([results](../../results/pretrain-epyc-zen4/)) gets further; with a GPU, `--device cuda --bf16` trains the
# same BERT-mini on 89M tokens in about three minutes, enough to beat random init on TREC-6 by 8 points
# ([results](../../results/pretrain-gpu-h200/)).

# %%
from minibert import BertModel

tiny = BertModel.from_pretrained(work / "tiny")
for text, predictions in zip(
    ["The movie was [MASK] and I loved it.", "I went to the [MASK] to buy bread."],
    fill_mask(
        tiny,
        tokenizer,
        ["The movie was [MASK] and I loved it.", "I went to the [MASK] to buy bread."],
        top_k=5,
    ),
):
    print(text, "->", ", ".join(f"{tok} {p:.2f}" for tok, p in predictions[0]))

# %% [markdown]
# ## Continued pre-training
#
# all-MiniLM-L6-v2 was trained to embed sentences and ships without a masked-LM head, so it gets a fresh
# one (and says so). Continuing the masked-LM objective on text of a new domain -- "Don't Stop
# Pretraining" (Gururangan et al. 2020) -- adapts it; here a few steps on the same sentences only show the
# new head learning on top of an encoder that already knows English.

# %%
continued = run_pretraining(
    PretrainRun(
        corpus=[sentences / "train.txt"],
        out=work / "minilm",
        model=str(folder),
        max_length=64,
        steps=30,
        batch_size=16,
        lr=5e-4,
        log_every=10,
        progress=False,
    )
)
log = [
    json.loads(line)
    for line in (work / "minilm" / "log.jsonl").read_text().splitlines()
]
print([round(r["loss"], 2) for r in log])
assert log[-1]["loss"] < log[0]["loss"]
