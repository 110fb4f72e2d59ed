"""From files to a checkpoint on disk: the pipelines behind ``minibert finetune``, ``distill`` and ``exits``.

    finetune.py   finetune(train, eval, model, out)       a task head (and recipe) on labelled files
    distill.py    distill_corpus(teacher, texts, out)     a shallower student of sentence embeddings
                  distill_task(train, eval, teacher, out) ... or of a fine-tuned classifier / tagger
    exits.py      train_exits(model, train, eval, out)    early exits on a fine-tuned classifier
    skeleton.py   what every pipeline does the same way: read the labelled files of a task and check
                  their labels against the model's, evaluate as finetune does, report each epoch,
                  check the output folder, leave the tokenizer beside the checkpoint

The methods themselves (heads, recipes, distillers, exits, the training loop) live in the library modules
one level up; a pipeline only reads, wires them to ``fit`` and writes. A new from-files command (the
coming pretrain) is a module here built on ``skeleton``.
"""

from __future__ import annotations

from ...lazy import lazy_exports

_LAZY = {"finetune": ".finetune", "distill_corpus": ".distill", "distill_task": ".distill", "CorpusRun": ".distill",
         "train_exits": ".exits"}
__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY, globals())
