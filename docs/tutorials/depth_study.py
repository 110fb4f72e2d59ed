# %% [markdown]
# # Does depth help? A depth study in minutes
#
# The BERT paper's answer to "why 12 layers?" is one table: at width 768, 3 -> 6 -> 12 blocks took the
# held-out masked-LM perplexity from 5.84 to 4.68 to 3.99 (Devlin et al. 2019, Table 6). This tutorial
# reruns that question with `minibert.runs.depth_study` at a size that fits a notebook: encoders of 1,
# 2 and 4 blocks, 64 wide, pre-trained from scratch for 60 steps on the same text, vocabulary, masks and
# seed -- then asks what each learnt, and whether the deepest one's lower blocks already are a shallower
# model. At this size the numbers say little about BERT (a few hundred thousand tokens, not 3.3
# billion); the point is the method. What a larger run found, and how it compares with the published
# shape, is on [Does depth help?](../../explanation/depth/).

# %%
import importlib.util
import shutil
import tempfile
from pathlib import Path

import minibert
from minibert.runs.depth_study import (
    QUICK,
    cut_vs_grown,
    plan,
    plot_study,
    run_study,
    summary_rows,
)

root = Path(minibert.__file__).resolve().parents[1]
# the vocabulary every model learns ids of
vocab = root / "weights" / "all-MiniLM-L6-v2"
spec = importlib.util.spec_from_file_location(
    "fetch_data", root / "data" / "fetch_data.py"
)
fetch_data = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch_data)
# VADER's sentences, from a sha256-checked PyPI archive
sentences = fetch_data.fetch_sentences()
# a small UPOS sample for the probes
pos = root / "tests" / "data" / "pos_sample.conllu"
work = Path(tempfile.mkdtemp())

# %% [markdown]
# ## Two budgets
#
# "Does depth help?" has two readings. At **equal steps** every depth sees the same tokens, as Table 6
# compares. At **equal compute** every depth spends the same training FLOPs (those 2 blocks spend in 60
# steps here, counted by `tools.accounting.pretraining_flops`), so a shallower model sees more tokens --
# the question Kaplan et al. 2020 asked of language models (the shape mattered little at fixed compute).
# The equal-steps runs are repeated with a second seed: the spread between seeds is what a difference
# between depths has to beat.

# %%
runs = plan(QUICK, vocab_size=30522)
for run in runs:
    print(f"{run.name:>18}  {run.steps:>4} steps  {run.flops / 1e9:7.1f} GFLOP")
compute = {r.depth: r.steps for r in runs if r.budget == "compute"}
assert compute[1] > compute[2] > compute[4]  # shallower: cheaper steps, so more of them

# %% [markdown]
# ## The study
#
# Every run is a normal `minibert pretrain` folder; all share one token store; `study.json` is rewritten
# after each run, so a stopped study picks up where it stopped. Each model is measured the same way: the
# held-out masked-LM loss on one fixed set of examples and masks, and a linear probe for parts of speech
# on every hidden state (with its control task). `minibert depth-study --quick` runs the same from the
# command line.

# %%
results = run_study(
    [sentences / "train.txt"],
    work / "study",
    vocab=vocab,
    eval_texts=sentences / "held.txt",
    config=QUICK,
    conllu=pos,
)
print(
    f"{'blocks':>6} {'budget':>8} {'seeds':>5} {'steps':>5} {'held-out loss':>14} "
    f"{'range':>14} {'best probe':>10}"
)
for row in summary_rows(results):
    low, high = row["eval_loss_range"]
    print(
        f"{row['depth']:>6} {row['budget']:>8} {row['seeds']:>5} {row['steps']:>5} "
        f"{row['eval_loss']:>14.3f} "
        f"{low:>6.3f}-{high:<7.3f} {row['probe_best']:>10.3f}"
    )
assert all(len(r["probe_accuracy"]) == r["depth"] + 1 for r in results["runs"].values())

# %% [markdown]
# Read the table with the seed range beside it: a difference between two depths smaller than the
# range between two seeds of one depth is not a finding. The figures below are what `plot_study` draws
# (loss against blocks for both budgets, every single run a gray dot; and the probe curve of each depth).

# %%
from IPython.display import Image, display  # noqa: E402

figures = plot_study(results, work)
for figure in figures:
    display(Image(filename=str(figure)))

# %% [markdown]
# ## Cut vs grown
#
# Is what the 4-block model learnt in its lower blocks already a 1- or 2-block model? `cut_vs_grown`
# compares, for each smaller depth k, the deepest model **cut** to its first k blocks (under its own
# masked-LM head, no further training), the k-block model **grown** from scratch on the same tokens (the
# study's own run), and k blocks **distilled** from the deepest model on the same tokens (its soft
# predictions at the masked tokens, as DistilBERT pre-trained). The cut model's hidden states are the
# deep model's first k + 1, so its probe curve is theirs; its masked-LM head, though, was trained to read
# the top block.

# %%
entry = cut_vs_grown(
    work / "study",
    [sentences / "train.txt"],
    vocab=vocab,
    eval_texts=sentences / "held.txt",
    conllu=pos,
)
print(
    f"teacher: {entry['teacher']} "
    f"(held-out loss {results['runs'][entry['teacher']]['eval_loss']:.3f})"
)
for k, arms in entry["depths"].items():
    print(
        f"k = {k}: "
        + ", ".join(f"{arm} {m['eval_loss']:.3f}" for arm, m in arms.items())
    )
deep = results["runs"][entry["teacher"]]["probe_accuracy"]
assert all(
    arms["cut"]["probe_accuracy"] == deep[: int(k) + 1]
    for k, arms in entry["depths"].items()
)

# %% [markdown]
# The full-size versions run from `benchmarks/bench_depth.py` (`--scale reduced`: about an hour on 2
# cores; `--scale full`: the study of the issue, many hours), and
# [Does depth help?](../../explanation/depth/) reads their figures against Table 6 and Turc et al. 2019.

# %% [markdown]
# ## Where the LayerNorm sits: gradients at initialisation
#
# Xiong et al. 2020 explain post-LN's need for warmup by its gradients at initialisation: largest for
# the blocks near the output. `pretrain --norm pre|deepnorm` builds the two usual fixes
# (`minibert/models/norms.py`), and `--grad-every K` writes each block's gradient norm and
# update-to-weight ratio to `log.jsonl` (and `OUT/gradients.png`). Here: one batch of real sentences
# through three 12-block models of width 256 at BERT's initialisation, one gradient norm per block.

# %%
import warnings  # noqa: E402

import torch  # noqa: E402

from minibert import BertConfig, BertTokenizer  # noqa: E402
from minibert.analysis.plots import gradients_at_init  # noqa: E402
from minibert.models.norms import norm_config  # noqa: E402
from minibert.models.pretraining import BertForMaskedLM  # noqa: E402
from minibert.training.diagnostics import block_groups  # noqa: E402

tokenizer = BertTokenizer.from_pretrained(vocab)
texts = (sentences / "train.txt").read_text(encoding="utf-8").split("\n")[:16]
batch = tokenizer(
    texts, padding=True, truncation=True, max_length=64, return_tensors="pt"
)
ids = batch["input_ids"]
chosen = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0)) < 0.15
chosen &= batch["attention_mask"].bool() & (ids > 103)  # real words only
labels = torch.where(chosen, ids, torch.full_like(ids, -100))
norms = {}
for placement in ("post", "pre", "deepnorm"):
    geometry = BertConfig(
        vocab_size=len(tokenizer.vocab),
        hidden_size=256,
        num_hidden_layers=12,
        num_attention_heads=4,
        intermediate_size=1024,
    )
    model = BertForMaskedLM.from_config(norm_config(geometry, placement), seed=0)
    model(ids, attention_mask=batch["attention_mask"], labels=labels).loss.backward()
    groups = block_groups(model)
    norms[placement] = [
        sum(float(p.grad.pow(2).sum()) for _, p in groups[f"block {i}"]) ** 0.5
        for i in range(12)
    ]
    growth = norms[placement][-1] / norms[placement][0]
    print(f"{placement:>8}: block 11 / block 0 = {growth:.2f}")
figure = gradients_at_init(norms, work / "grad_init.png")
display(Image(filename=str(figure)))

# %% [markdown]
# At BERT's N(0, 0.02) initialisation and this width the post-LN stack's per-block gradients are flat
# (the residual branches are small beside the embeddings, so every block starts close to the identity),
# pre-LN's shrink slightly towards the output (more at BERT-base's width) and DeepNorm's are flat (its
# branches start at beta times BERT's weights): the growth towards the output that Xiong et al. measured
# does not show at step 0 here. What separates the placements shows during training instead.

# %% [markdown]
# ## A reduced stability grid
#
# The stability study (`depth-study --norms post,pre,deepnorm --warmups 0,0.01,0.06,0.2`) runs every
# depth with every placement and warmup share and counts the runs left on the **unigram plateau**: a
# held-out masked accuracy no better than always answering the corpus' most frequent token (its share,
# the unigram rate, is computed from the token store). Here a grid that runs in a minute: 1 and 4
# blocks of width 64, post- and pre-LN, no warmup and 20 % warmup, one seed, 60 steps each -- too few
# for any of them to leave the plateau, so read the method, not the numbers. Each run writes its
# per-block gradient norms every 3 steps (`--grad-every`) to `log.jsonl` and draws `gradients.png`.

# %%
import dataclasses  # noqa: E402

grid = dataclasses.replace(
    QUICK,
    depths=(1, 4),
    norms=("post", "pre"),
    warmups=(0.0, 0.2),
    seeds=(0,),
    budgets=("steps",),
)
stability = run_study(
    [sentences / "train.txt"],
    work / "stability",
    vocab=vocab,
    eval_texts=sentences / "held.txt",
    config=grid,
)
print(f"unigram rate: {stability['unigram_rate']:.3f}")
print("norm  warmup  blocks  held-out loss  accuracy  stuck")
for row in summary_rows(stability):
    print(
        f"{row['norm']:<5} {row['warmup']:>6g} {row['depth']:>7} "
        f"{row['eval_loss']:>14.3f} {row['masked_accuracy']:>9.3f} "
        f"{row['stuck_share']:>6.0%}"
    )
assert len(stability["runs"]) == 8

# %% [markdown]
# The gradient figure of one run over its training: the 4-block post-LN model without warmup, one
# line per block (log scale), drawn from its `log.jsonl`. In the stability study's 12-block post-LN
# runs that stayed on the plateau these lines fan out as training goes on, the lowest blocks'
# gradients falling far below the top block's
# ([the results page](../../results/depth-stability-epyc-zen5/)).

# %%
name = next(
    r.name
    for r in plan(grid, vocab_size=30522)
    if (r.depth, r.norm, r.warmup) == (4, "post", 0.0)
)
display(Image(filename=str(work / "stability" / "runs" / name / "gradients.png")))

# %%
shutil.rmtree(work)
