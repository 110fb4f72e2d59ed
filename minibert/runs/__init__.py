"""Runs: from files to a checkpoint on disk, the layer between the library (training, compat) and the
command line. Each module is one command's run: it reads the files, wires the library's methods to the
training loop and writes what the command promises.

    finetune.py     finetune(run)                            a task head (and recipe) on labelled files
    distill.py      distill_corpus(run)                      a shallower student of sentence embeddings
                    distill_task(run)                        ... or of a fine-tuned classifier / tagger
    exits.py        train_exits(run)                         early exits on a fine-tuned classifier
    pretrain.py     run_pretraining(corpus, out, ...)        masked-LM (and NSP) pre-training from text files
    depth_study.py  run_study(corpus, out, ...)              pre-train several depths, measure, plot
    settings.py     FinetuneRun, DistillRun, ExitsRun, ...   each command's settings, declared once; RECIPES
    skeleton.py     what every run does the same way: read the labelled files of a task and check their
                    labels against the model's, evaluate as finetune does, report each epoch, check the
                    output folder, leave the tokenizer beside the checkpoint

The methods themselves (heads, recipes, distillers, exits, the training loop) live in ``minibert.training``
(and sentence-transformers folders in ``minibert.compat``); a run only reads, wires and writes. Being above
both, a run may use both: training and compat never import each other.
"""

from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {"finetune": ".finetune", "distill_corpus": ".distill", "distill_task": ".distill", "CorpusRun": ".distill",
         "train_exits": ".exits", "run_pretraining": ".pretrain", "run_study": ".depth_study"}
__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY, globals())
