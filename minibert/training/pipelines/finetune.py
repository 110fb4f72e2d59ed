"""Fine-tuning from files, as ``minibert finetune`` runs it: read the data, build the model with its new
head, apply the recipe, ``fit``, evaluate each epoch, write the checkpoint, its tokenizer and metrics.json.

    task      head                              data                         metric kept for the best epoch
    classify  BertForSequenceClassification     .csv / .tsv / .jsonl         accuracy (and macro-F1)
    regress   BertForSequenceClassification(1)  .csv / .tsv / .jsonl         Pearson (and Spearman)
    tag       BertForTokenClassification        .conllu or token<TAB>BIO     entity F1 (BIO / IOBES, seqeval's
                                                                              reading) or word accuracy (plain tags)

    layerdrop p: each block skipped with probability p on every training pass (prune the result later)

    recipe    full (everything trains) | gradual (head first, one block more per epoch) |
              llrd (layer-wise LR decay 0.9) | scalarmix (frozen encoder, trained ScalarMix over all layers +
              linear head; classify only) |
              task modules on a frozen base, saved alone (the module and the head: KB to a few MB, the base is
              named, not copied; ``training.adapters``): adapter (Houlsby's by default, or Pfeiffer's;
              bottleneck 64) | prefix (P = 16 keys and values per block) | lora (rank 8, alpha 16, on query and
              value by default; ``merge_lora=True`` writes the merged whole checkpoint instead)
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

from ...errors import InputError
from ...hardware import training_device
from ...loading import copy_tokenizer, load_model
from ...models import BertModel
from ...models.heads import BertForSequenceClassification, BertForTokenClassification
from ...tokenizer import BertTokenizer
from .. import ddp
from ..depth import LayerDrop
from ..adapters import add_adapter, save_adapter
from ..lora import apply_lora
from ..lora import merge_lora as merged_lora
from ..loop import FitConfig, History, fit
from ..recipes import ScalarMixClassifier, gradual_unfreezing
from ..loop import epoch_reporter
from .skeleton import TASK_METRIC, check_labels, check_length, check_out_dir, read_task_data

TASKS = tuple(TASK_METRIC)
RECIPES = ("full", "gradual", "llrd", "lora", "scalarmix", "adapter", "prefix")
TASK_MODULE_RECIPES = ("adapter", "prefix", "lora")


def finetune(train_path, eval_path, model_source, out_dir, *, task: str = "classify", text_column: str = "text",
             pair_column: str | None = None, label_column: str = "label", tag_column: str = "upos",
             recipe: str = "full", config: FitConfig = FitConfig(), batch_size: int = 16,
             max_length: int = 128, lora_rank: int = 8, lora_targets=("query", "value"), layerdrop: float = 0.0,
             merge_lora: bool = False, adapter_kind: str = "houlsby", adapter_size: int = 64,
             prefix_length: int = 16, device=None, log: Callable[[str], None] | None = print) -> History:
    """Fine-tune ``model_source`` on ``train_path``, evaluated on ``eval_path`` after each epoch; the best
    epoch's checkpoint goes to ``out_dir``. ``layerdrop=p`` skips each block with probability p while
    training (``depth.LayerDrop``), so the result can be pruned to fewer blocks afterwards. The adapter,
    prefix and lora recipes write the task module and its head only (``training.adapters.save_adapter``;
    ``merge_lora``: lora writes the merged whole checkpoint instead). ``adapter_kind``: houlsby or pfeiffer;
    ``adapter_size``: the bottleneck; ``prefix_length``: P. ``device``: where the model trains ("cpu", "cuda",
    "cuda:N"; None: the CPU); the checkpoint written is the same wherever it trained."""
    if task not in TASKS:
        raise InputError(f"task {task!r}: use one of {TASKS}")
    if recipe not in RECIPES:
        raise InputError(f"recipe {recipe!r}: use one of {RECIPES}")
    where = training_device(device)  # before any work
    out_dir = check_out_dir(out_dir)
    world = ddp.world_size()  # under torchrun: batch_size is each process's share of a batch_size x world batch
    if world > 1:
        ddp.check_recipe(recipe)  # before any data is read
    batch_size = batch_size * world
    if layerdrop and recipe == "scalarmix":
        raise InputError("layerdrop drops blocks of an encoder that trains; the scalarmix recipe freezes it")
    if recipe in TASK_MODULE_RECIPES and layerdrop:
        raise InputError(f"layerdrop trains the encoder's blocks to be skipped; the {recipe} recipe freezes them")
    if adapter_kind not in ("houlsby", "pfeiffer"):
        raise InputError(f"adapter_kind={adapter_kind!r}: use houlsby or pfeiffer")
    if merge_lora and recipe != "lora":
        raise InputError("merge_lora goes with the lora recipe")
    if task == "tag" and recipe == "scalarmix":
        raise InputError("the scalarmix recipe classifies texts; use another recipe for --task tag")
    tokenizer = BertTokenizer.from_pretrained(model_source)
    data = read_task_data(task, train_path, eval_path, text_column=text_column, pair_column=pair_column,
                          label_column=label_column, tag_column=tag_column)
    if task == "regress":
        names = ["score"]
    else:
        names = sorted(set(data.labels("train")), key=str)
        if task == "classify" and len(names) < 2:
            raise InputError(f"{train_path} has {len(names)} label(s) {names}: classification needs at least 2")
        check_labels(names, data.labels("held"), eval_path, "the training data never shows")
    if task == "tag":
        model = BertForTokenClassification.from_encoder(model_source, labels=names, seed=config.seed)
    elif recipe == "scalarmix":
        model = ScalarMixClassifier(load_model(BertModel, model_source, mlm_head=False), names, seed=config.seed,
                                    share_encoder=True)
    else:
        model = BertForSequenceClassification.from_encoder(model_source, labels=names, seed=config.seed)
    check_length(model, tokenizer, data, max_length)
    batches = data.batches(tokenizer, model.config.label2id, batch_size=batch_size, max_length=max_length,
                           seed=config.seed)
    evaluate = data.evaluator(tokenizer, max_length=max_length)

    on_epoch_start, save = None, None
    if recipe == "gradual":
        on_epoch_start = gradual_unfreezing()
    elif recipe == "llrd":
        config = dataclasses.replace(config, layer_decay=config.layer_decay or 0.9)
    elif recipe == "lora" and merge_lora:
        apply_lora(model, r=lora_rank, alpha=2 * lora_rank, targets=tuple(lora_targets))

        def save_merged(m, directory):
            merged_lora(copy.deepcopy(m)).save_pretrained(directory)
        save = save_merged
    elif recipe in TASK_MODULE_RECIPES:
        name = task_module_name(out_dir)
        options = {"lora": {"kind": "lora", "r": lora_rank, "alpha": 2.0 * lora_rank, "targets": tuple(lora_targets)},
                   "prefix": {"kind": "prefix", "prefix_length": prefix_length},
                   "adapter": {"kind": adapter_kind, "bottleneck": adapter_size}}[recipe]
        add_adapter(model, name, seed=config.seed, **options)

        def save_module(m, directory):
            save_adapter(m, name, directory)  # a prefix is saved flat (the MLP is for training only)
        save = save_module

    model.to(where)  # after the recipe added its modules
    report = epoch_reporter(log, config.epochs)
    drop = LayerDrop(model, layerdrop, seed=config.seed) if layerdrop else None
    trained, keep = model, out_dir
    if world > 1:  # torchrun: each process trains a replica on its slice; process 0 evaluates and saves
        trained, evaluate, save, keep, report = ddp.wrap_for_fit(model, evaluate=evaluate, save=save, out_dir=out_dir,
                                                                 log=report, recipe=recipe)
    try:
        history = fit(trained, batches, config=config, evaluate=evaluate, metric=data.metric, out_dir=keep,
                      on_epoch_start=on_epoch_start, on_epoch_end=report, save=save)
    finally:
        if drop is not None:
            drop.remove()
    if keep is not None:
        copy_tokenizer(model_source, out_dir)  # so that the checkpoint is usable on its own (`minibert predict DIR`)
    if world > 1:
        ddp.finish()
    return history


def task_module_name(out_dir) -> str:
    """A task module's name from its folder's: ``runs/trec-6`` -> ``trec_6`` (an identifier)."""
    import re

    name = re.sub(r"\W", "_", out_dir.name) or "task"
    return f"task_{name}" if name[0].isdigit() else name
