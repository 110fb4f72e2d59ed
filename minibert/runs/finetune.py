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
import logging

from ..checks import check_max_length
from ..errors import InputError
from ..hardware import training_device
from ..outputs import reads_of
from ..loading import copy_tokenizer, load_model
from ..models import BertModel
from ..models.heads import BertForSequenceClassification, BertForTokenClassification
from ..tokenizer import BertTokenizer
from ..training import ddp
from ..training.depth import LayerDrop
from ..training.adapters import add_adapter, save_adapter, size_limits
from ..training.lora import apply_lora
from ..training.lora import merge_lora as merged_lora
from ..settings import base_of
from ..training.loop import FitConfig, History, epoch_reporter, fit
from ..training.recipes import ScalarMixClassifier, gradual_unfreezing
from .settings import RECIPES, TASK_MODULE_RECIPES, FinetuneRun
from .skeleton import begin_fit, check_labels, check_length, finished_history, read_task_data, resolved, run_folder

log = logging.getLogger(__name__)


def finetune(run: FinetuneRun) -> History:
    """Fine-tune ``run.model`` on ``run.train``, evaluated on ``run.eval`` after each epoch; the best epoch's
    checkpoint goes to ``run.out`` (see ``FinetuneRun`` for every setting). ``lr`` and ``epochs`` left
    unset are the recipe's own (``settings.RECIPES``, measured), and the log says which were taken.
    ``layerdrop=p`` skips each block with probability p while training (``depth.LayerDrop``), so the
    result can be pruned afterwards. The adapter, prefix and lora recipes write the task module and its
    head only (``training.adapters.save_adapter``; ``merge_lora``: the merged whole checkpoint instead);
    a recipe's options are refused with another recipe and bounded by the model (a bottleneck up to its
    hidden size, P up to its positions, a rank up to the adapted layers' smaller side). ``device``: where
    the model trains; the checkpoint written is the same wherever it trained.

    ``run.out`` follows the output-folder rule (``outputs.RunFolder``): not the model folder it reads, empty
    or new unless ``resume`` (the unfinished run there goes on, same settings; a finished one is returned
    as it is) or ``overwrite``. Everything is checked before anything is created."""
    options, module, where, world, folder = _checked(run)
    out_dir = folder.path
    batch_size = run.batch_size * world  # under torchrun: each process's share of a batch_size x world batch
    tokenizer = BertTokenizer.from_pretrained(run.model)
    data = read_task_data(run.task, run.train, run.eval, text_column=run.text_column,
                          pair_column=run.text_pair_column, label_column=run.label_column, tag_column=run.tag_column)
    run, chosen = run.with_recipe_defaults(rows=data.rows, batch_size=batch_size)  # epochs follow the data's size
    model = _model(run, data)
    check_length(model, tokenizer, data, run.max_length)
    settings = {"task": run.task, "recipe": run.recipe, "model": resolved(run.model), "train": resolved(run.train),
                "eval": resolved(run.eval), "text_column": run.text_column, "pair_column": run.text_pair_column,
                "label_column": run.label_column, "tag_column": run.tag_column if run.task == "tag" else None,
                "batch_size": batch_size, "max_length": run.max_length, "layerdrop": run.layerdrop,
                "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}}
    config = base_of(run, FitConfig)
    with folder.claim(settings) as claimed:
        begin_fit(claimed, config)
        if claimed.finished:
            return finished_history(out_dir, folder.shown)
        if chosen and claimed.writer:
            measured = RECIPES[run.recipe].measured
            measured_on = (f"measured on TREC-6 classification: {measured}" if run.task == "classify" else
                           f"measured on TREC-6 classification ({measured}), not on --task {run.task}")
            log.info(f"recipe {run.recipe}: {', '.join(chosen)} (its defaults, {measured_on}); --lr / --epochs "
                     "choose others")
        batches = data.batches(tokenizer, model.config.label2id, batch_size=batch_size, max_length=run.max_length,
                               seed=run.seed)
        evaluate = data.evaluator(tokenizer, max_length=run.max_length)
        config, on_epoch_start, save = _apply_recipe(run, model, config, options, module, out_dir)
        model.to(where)  # after the recipe added its modules
        report = epoch_reporter(config.epochs)
        drop = LayerDrop(model, run.layerdrop, seed=run.seed) if run.layerdrop else None
        try:  # under torchrun each process trains on its slice of every batch; process 0 evaluates and saves
            history = fit(model, batches, config=config, evaluate=evaluate, metric=data.metric, out_dir=out_dir,
                          on_epoch_start=on_epoch_start, on_epoch_end=report, save=save)
        finally:
            if drop is not None:
                drop.remove()
        if claimed.writer:
            copy_tokenizer(run.model, out_dir)  # so that the checkpoint is usable on its own (`minibert predict DIR`)
            claimed.note(best_epoch=history.best_epoch, best_metric=history.best_metric, metric=history.metric)
    if world > 1:
        ddp.finish()
    return history


def _checked(run: FinetuneRun):
    """Every check that needs no data, before any work: the settings, the recipe's options, the device,
    torchrun, what goes together, and the task module's size against the model (read from its config
    alone), the output folder. Returns (the recipe's options, the task module as ``add_adapter`` takes it
    or None, the device, the number of processes, the output folder: ``outputs.RunFolder``)."""
    from ..loading import read_config
    from ..training.adapters import check_module_cost, check_sizes

    run.check()
    options = run.recipe_options()
    where = training_device(run.device)  # before any work
    world = ddp.world_size()
    if world > 1:
        ddp.check_recipe(run.recipe)  # before any data is read
    if run.layerdrop and run.recipe == "scalarmix":
        raise InputError("layerdrop drops blocks of an encoder that trains; the scalarmix recipe freezes it")
    if run.recipe in TASK_MODULE_RECIPES and run.layerdrop:
        raise InputError(f"layerdrop trains the encoder's blocks to be skipped; the {run.recipe} recipe freezes them")
    if run.task == "tag" and run.recipe == "scalarmix":
        raise InputError("the scalarmix recipe classifies texts; use another recipe for --task tag")
    folder = run_folder(run.out, "finetune", reads=reads_of(run), config=run, overwrite=run.overwrite)
    base_config = read_config(run.model)
    check_max_length("--max-length", run.max_length, base_config.max_position_embeddings)
    _fit_default_sizes(run, options, base_config)
    module = None  # a task module's options, as add_adapter takes them
    if run.recipe in TASK_MODULE_RECIPES:
        rank = options.get("lora_rank")
        module = {"lora": {"kind": "lora", "r": rank, "alpha": 2.0 * (rank or 0),
                           "targets": tuple(options.get("lora_targets") or ())},
                  "prefix": {"kind": "prefix", "prefix_length": options.get("prefix_length"), "pooler": True},
                  "adapter": {"kind": options.get("adapter_kind"), "bottleneck": options.get("adapter_size")}}[run.recipe]
        sizes = {k: v for k, v in module.items() if k in ("bottleneck", "prefix_length", "r")}
        check_sizes(base_config, **sizes,  # the merged LoRA's rank too; said in the options' names
                    names={key: "--" + option.replace("_", "-") for option, key in SIZE_OPTIONS.items()})
        check_module_cost(base_config, module["kind"], what=f"--recipe {run.recipe}", batch_size=run.batch_size * world,
                          max_length=run.max_length, targets=max(1, len(module.get("targets", ()))), **sizes)
        if options.get("merge_lora"):
            module = None  # apply_lora, merged at the end: no task module
    return options, module, where, world, folder


#: the recipes' size options and the task-module size each sets (``adapters.check_sizes``' keywords)
SIZE_OPTIONS = {"adapter_size": "bottleneck", "prefix_length": "prefix_length", "lora_rank": "r"}


def _fit_default_sizes(run: FinetuneRun, options: dict, config) -> None:
    """A recipe's default size the user did not give, cut to what this model takes (``adapters.size_limits``:
    the default bottleneck 64 on a 32-wide model: 32), and said; a size the user gave is checked as given
    (``check_sizes``)."""
    limits = size_limits(config)
    what = {"bottleneck": "hidden size", "prefix_length": "positions", "r": "hidden size"}
    for option, key in SIZE_OPTIONS.items():
        if option in options and getattr(run, option) is None and options[option] > limits[key]:
            log.info(f"--{option.replace('_', '-')}: the recipe's default {options[option]} is more than this "
                     f"model's {what[key]}; using {limits[key]}")
            options[option] = limits[key]


def _model(run: FinetuneRun, data):
    """The model with its new head, its labels read from the training file (checked against the held-out
    ones)."""
    if run.task == "regress":
        names = ["score"]
    else:
        names = sorted(set(data.labels("train")), key=str)
        if run.task == "classify" and len(names) < 2:
            raise InputError(f"{run.train} has {len(names)} label(s) {names}: classification needs at least 2")
        check_labels(names, data.labels("held"), run.eval, "the training data never shows")
    if run.task == "tag":
        return BertForTokenClassification.from_encoder(run.model, labels=names, seed=run.seed)
    if run.recipe == "scalarmix":
        return ScalarMixClassifier(load_model(BertModel, run.model, mlm_head=False), names, seed=run.seed,
                                   share_encoder=True)
    return BertForSequenceClassification.from_encoder(run.model, labels=names, seed=run.seed)


def _apply_recipe(run: FinetuneRun, model, config, options: dict, module, out_dir):
    """What the recipe changes: (the loop's settings, ``on_epoch_start``, ``save``) -- gradual unfreezing,
    layer-wise decay, LoRA to merge at the end, or a task module added to the model and saved alone."""
    on_epoch_start, save = None, None
    if run.recipe == "gradual":
        on_epoch_start = gradual_unfreezing()
    elif run.recipe == "llrd":
        config = dataclasses.replace(config, layer_decay=config.layer_decay or 0.9)
    elif run.recipe == "lora" and options["merge_lora"]:
        apply_lora(model, r=options["lora_rank"], alpha=2 * options["lora_rank"], targets=tuple(options["lora_targets"]))

        def save_merged(m, directory):
            merged_lora(copy.deepcopy(m)).save_pretrained(directory)
        save = save_merged
    elif module is not None:
        name = task_module_name(out_dir)
        if getattr(model, "fresh_pooler", False):  # the base has no pooler: the module carries the one it trains
            module = {**module, "pooler": True}
        add_adapter(model, name, seed=run.seed, **module)

        def save_module(m, directory):
            save_adapter(m, name, directory)  # a prefix is saved flat (the MLP is for training only)
        save = save_module
    return config, on_epoch_start, save


def task_module_name(out_dir) -> str:
    """A task module's name from its folder's: ``runs/trec-6`` -> ``trec_6`` (an identifier)."""
    import re

    name = re.sub(r"\W", "_", out_dir.name) or "task"
    return f"task_{name}" if name[0].isdigit() else name
