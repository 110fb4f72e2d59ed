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

from ..checks import check_max_length
from ..errors import InputError
from ..hardware import training_device
from ..loading import copy_tokenizer, load_model
from ..models import BertModel
from ..models.heads import BertForSequenceClassification, BertForTokenClassification
from ..tokenizer import BertTokenizer
from ..training import ddp
from ..training.depth import LayerDrop
from ..training.adapters import add_adapter, save_adapter
from ..training.lora import apply_lora
from ..training.lora import merge_lora as merged_lora
from ..training.loop import FitConfig, History, fit
from ..training.recipes import ScalarMixClassifier, gradual_unfreezing
from ..training.loop import epoch_reporter
from .skeleton import (TASK_METRIC, begin_fit, check_labels, check_length, finished_history, read_task_data,
                       resolved, run_folder)

TASKS = tuple(TASK_METRIC)
RECIPES = ("full", "gradual", "llrd", "lora", "scalarmix", "adapter", "prefix")
TASK_MODULE_RECIPES = ("adapter", "prefix", "lora")
#: the options of one recipe (their defaults; given with another recipe they are refused): (name, flag, default)
RECIPE_OPTIONS = {
    "lora": (("lora_rank", "--lora-rank", 8), ("lora_targets", "--lora-targets", ("query", "value")),
             ("merge_lora", "--merge-lora", False)),
    "adapter": (("adapter_kind", "--adapter-kind", "houlsby"), ("adapter_size", "--adapter-size", 64)),
    "prefix": (("prefix_length", "--prefix-length", 16),),
}


def recipe_options(recipe: str, given: dict) -> dict:
    """The recipe's own options: those ``given`` (None / False: not given) checked to belong to ``recipe``,
    the others at the recipe's defaults. An option of another recipe is refused by name, as it would
    otherwise be ignored."""
    for owner, options in RECIPE_OPTIONS.items():
        for name, flag, _ in options:
            if owner != recipe and given.get(name) not in (None, False):
                raise InputError(f"{name} ({flag}) belongs to the {owner} recipe; this run's recipe is {recipe}: "
                                 f"leave it out, or use --recipe {owner}")
    return {name: default if given.get(name) is None else given[name]
            for name, _, default in RECIPE_OPTIONS.get(recipe, ())}


def finetune(train_path, eval_path, model_source, out_dir, *, task: str = "classify", text_column: str = "text",
             pair_column: str | None = None, label_column: str = "label", tag_column: str = "upos",
             recipe: str = "full", config: FitConfig = FitConfig(), batch_size: int = 16,
             max_length: int = 128, lora_rank: int | None = None, lora_targets=None, layerdrop: float = 0.0,
             merge_lora: bool = False, adapter_kind: str | None = None, adapter_size: int | None = None,
             prefix_length: int | None = None, device=None, overwrite: bool = False,
             log: Callable[[str], None] | None = print) -> History:
    """Fine-tune ``model_source`` on ``train_path``, evaluated on ``eval_path`` after each epoch; the best
    epoch's checkpoint goes to ``out_dir``. ``layerdrop=p`` skips each block with probability p while
    training (``depth.LayerDrop``), so the result can be pruned to fewer blocks afterwards. The adapter,
    prefix and lora recipes write the task module and its head only (``training.adapters.save_adapter``;
    ``merge_lora``: lora writes the merged whole checkpoint instead). Each recipe's options --
    ``lora_rank`` (8), ``lora_targets`` (query, value), ``merge_lora``; ``adapter_kind`` (houlsby or
    pfeiffer), ``adapter_size`` (the bottleneck, 64); ``prefix_length`` (P, 16) -- are refused with another
    recipe and bounded by the model (a bottleneck up to its hidden size, P up to its positions, a rank up to
    the adapted layers' smaller side). ``device``: where the model trains ("cpu", "cuda", "cuda:N"; None: the
    CPU); the checkpoint written is the same wherever it trained.

    ``out_dir`` follows the output-folder rule (``outputs.RunFolder``): not the model folder it reads, empty
    or new unless ``config.resume`` (the unfinished run there goes on, same settings; a finished one is
    returned as it is) or ``overwrite``. Everything is checked before anything is created."""
    from ..checks import check_fraction
    from ..loading import read_config
    from ..training.adapters import check_module_cost, check_sizes

    if task not in TASKS:
        raise InputError(f"task {task!r}: use one of {TASKS}")
    if recipe not in RECIPES:
        raise InputError(f"recipe {recipe!r}: use one of {RECIPES}")
    options = recipe_options(recipe, dict(lora_rank=lora_rank, lora_targets=lora_targets, merge_lora=merge_lora,
                                          adapter_kind=adapter_kind, adapter_size=adapter_size,
                                          prefix_length=prefix_length))
    config.check()
    check_fraction("layerdrop (--layerdrop)", layerdrop)
    where = training_device(device)  # before any work
    world = ddp.world_size()  # under torchrun: batch_size is each process's share of a batch_size x world batch
    if world > 1:
        ddp.check_recipe(recipe)  # before any data is read
    if layerdrop and recipe == "scalarmix":
        raise InputError("layerdrop drops blocks of an encoder that trains; the scalarmix recipe freezes it")
    if recipe in TASK_MODULE_RECIPES and layerdrop:
        raise InputError(f"layerdrop trains the encoder's blocks to be skipped; the {recipe} recipe freezes them")
    if options.get("adapter_kind", "houlsby") not in ("houlsby", "pfeiffer"):
        raise InputError(f"adapter_kind={options['adapter_kind']!r}: use houlsby or pfeiffer")
    if task == "tag" and recipe == "scalarmix":
        raise InputError("the scalarmix recipe classifies texts; use another recipe for --task tag")
    folder = run_folder(out_dir, "finetune", reads={"--model": model_source}, config=config, overwrite=overwrite)
    out_dir = folder.path
    base_config = read_config(model_source)
    check_max_length("max_length (--max-length)", max_length, base_config.max_position_embeddings)
    module = None  # a task module's options, as add_adapter takes them
    if recipe in TASK_MODULE_RECIPES:
        rank = options.get("lora_rank")
        module = {"lora": {"kind": "lora", "r": rank, "alpha": 2.0 * (rank or 0),
                           "targets": tuple(options.get("lora_targets") or ())},
                  "prefix": {"kind": "prefix", "prefix_length": options.get("prefix_length")},
                  "adapter": {"kind": options.get("adapter_kind"), "bottleneck": options.get("adapter_size")}}[recipe]
        sizes = {k: v for k, v in module.items() if k in ("bottleneck", "prefix_length", "r")}
        check_sizes(base_config, **sizes)  # the merged LoRA's rank too
        check_module_cost(base_config, module["kind"], what=f"--recipe {recipe}", batch_size=batch_size * world,
                          max_length=max_length, targets=max(1, len(module.get("targets", ()))), **sizes)
        if options.get("merge_lora"):
            module = None  # apply_lora, merged at the end: no task module
    batch_size = batch_size * world
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
    settings = {"task": task, "recipe": recipe, "model": resolved(model_source), "train": resolved(train_path),
                "eval": resolved(eval_path), "text_column": text_column, "pair_column": pair_column,
                "label_column": label_column, "tag_column": tag_column if task == "tag" else None,
                "batch_size": batch_size, "max_length": max_length, "layerdrop": layerdrop,
                "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}}

    with folder.claim(settings) as run:
        begin_fit(run, config, log)
        if run.finished:
            return finished_history(out_dir, folder.shown)
        batches = data.batches(tokenizer, model.config.label2id, batch_size=batch_size, max_length=max_length,
                               seed=config.seed)
        evaluate = data.evaluator(tokenizer, max_length=max_length)

        on_epoch_start, save = None, None
        if recipe == "gradual":
            on_epoch_start = gradual_unfreezing()
        elif recipe == "llrd":
            config = dataclasses.replace(config, layer_decay=config.layer_decay or 0.9)
        elif recipe == "lora" and options["merge_lora"]:
            apply_lora(model, r=options["lora_rank"], alpha=2 * options["lora_rank"], targets=tuple(options["lora_targets"]))

            def save_merged(m, directory):
                merged_lora(copy.deepcopy(m)).save_pretrained(directory)
            save = save_merged
        elif module is not None:
            name = task_module_name(out_dir)
            add_adapter(model, name, seed=config.seed, **module)

            def save_module(m, directory):
                save_adapter(m, name, directory)  # a prefix is saved flat (the MLP is for training only)
            save = save_module

        model.to(where)  # after the recipe added its modules
        report = epoch_reporter(log, config.epochs)
        drop = LayerDrop(model, layerdrop, seed=config.seed) if layerdrop else None
        trained, keep = model, out_dir
        if world > 1:  # torchrun: each process trains a replica on its slice; process 0 evaluates and saves
            trained, evaluate, save, keep, report = ddp.wrap_for_fit(model, evaluate=evaluate, save=save,
                                                                     out_dir=out_dir, log=report, recipe=recipe)
        try:
            history = fit(trained, batches, config=config, evaluate=evaluate, metric=data.metric, out_dir=keep,
                          on_epoch_start=on_epoch_start, on_epoch_end=report, save=save)
        finally:
            if drop is not None:
                drop.remove()
        if keep is not None:
            copy_tokenizer(model_source, out_dir)  # so that the checkpoint is usable on its own (`minibert predict DIR`)
            run.note(best_epoch=history.best_epoch, best_metric=history.best_metric, metric=history.metric)
    if world > 1:
        ddp.finish()
    return history


def task_module_name(out_dir) -> str:
    """A task module's name from its folder's: ``runs/trec-6`` -> ``trec_6`` (an identifier)."""
    import re

    name = re.sub(r"\W", "_", out_dir.name) or "task"
    return f"task_{name}" if name[0].isdigit() else name
