"""Commands that train: ``finetune`` (a task head, with a recipe), ``predict`` (with what finetune wrote),
``distill`` (a shallower student: sentence embeddings or a task), ``exits`` (early exits on a
classifier), ``pretrain`` (masked LM) and ``depth-study`` (pre-train several depths and compare). Each hands its options to one library pipeline in ``minibert.training``."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import InputError, MissingExtra, not_found
from ..logs import lines_to
from ..checks import check_max_length, model_limit
from ..runs.settings import DepthStudyRun, DistillRun, ExitsRun, FinetuneRun, PretrainRun
from .common import add_command, check_device, read_lines, report_truncation
from .settings import PredictCommand


# ----------------------------------------------------------------------------------------- finetune
def add_finetune(sub) -> None:
    add_command(sub, "finetune", FinetuneRun, cmd_finetune,
                "fine-tune a task head (and the encoder) on a labelled file")


def cmd_finetune(args) -> int:
    from ..runs.finetune import finetune
    from ..runs.settings import TASK_MODULE_RECIPES

    with lines_to(sys.stdout):  # the epoch lines (--quiet: no progress bar)
        history = finetune(args)
    if getattr(history, "nothing_to_resume", False):
        print(f"nothing to resume: {args.out} holds a finished run (best epoch {history.best_epoch}, "
              f"{history.metric} {history.best_metric:.4f}); nothing written")
        return 0
    if history.best_epoch is None:  # a torchrun process other than 0: it trained; process 0 evaluates and writes
        return 0
    what = ("the task module and its head (on the base it names)"
            if args.recipe in TASK_MODULE_RECIPES and not args.merge_lora else "checkpoint")
    print(f"best epoch {history.best_epoch} ({history.best_metric:.4f}); wrote {args.out}: {what}, tokenizer, "
          "metrics.json")
    return 0


# ------------------------------------------------------------------------------------------ predict
def add_predict(sub) -> None:
    add_command(sub, "predict", PredictCommand, cmd_predict,
                "labels (or tags) for the lines of a text file, with a fine-tuned model")


def cmd_predict(args) -> int:
    from ..config import read_json_object
    from ..models.heads import TASK_CLASSES
    from ..tokenizer import BertTokenizer
    from ..training.adapters import CONFIG_FILE
    from ..parts import has_part
    from ..training.recipes import ScalarMixClassifier

    for folder in args.checkpoint:
        if not Path(folder).is_dir():
            raise not_found(folder, "checkpoint folder")
    args.device = check_device(args)  # --device / --dtype: before any model is loaded
    lines = read_lines(args.texts)  # checked before any model is loaded
    if not any(line.strip() for line in lines):
        raise InputError(f"{args.texts} has no non-empty lines")
    modules = [Path(f) for f in args.checkpoint if (Path(f) / CONFIG_FILE).is_file()]
    if modules:
        if len(modules) != len(args.checkpoint):
            raise InputError("give either one fine-tuned checkpoint or task modules (folders with "
                             f"{CONFIG_FILE}), not both")
        return _predict_with_task_modules(args, modules, lines)
    if len(args.checkpoint) > 1 or args.model or args.skip_base_check:
        raise InputError("several checkpoints, --model or --skip-base-check go with task modules only (--recipe "
                         "adapter, prefix, lora); a whole fine-tuned checkpoint is predicted with alone")
    args.checkpoint = args.checkpoint[0]
    folder = Path(args.checkpoint)
    architectures = read_json_object(folder / "config.json").get("architectures") or []
    kind = next((a for a in architectures if a in TASK_CLASSES), None)
    scalarmix = has_part(folder, ScalarMixClassifier.PART)
    if not scalarmix and (kind is None or kind == "BertForQuestionAnswering"):
        raise InputError(f"{args.checkpoint} is not a fine-tuned classifier or tagger (architectures: "
                         f"{architectures}); `minibert predict` takes what `minibert finetune` writes")
    if scalarmix:
        model = ScalarMixClassifier.from_pretrained(args.checkpoint, dtype=args.dtype, device=args.device)
        kind = "BertForSequenceClassification"
    else:
        model = TASK_CLASSES[kind].from_pretrained(args.checkpoint, dtype=args.dtype, device=args.device)
    tokenizer = BertTokenizer.from_pretrained(args.checkpoint)
    tokenizer.check_fits(model.config, args.checkpoint)
    for line in _predicted_lines(args, lines, model, kind, tokenizer):
        print(line)
    return 0


def _predicted_lines(args, lines, model, kind, tokenizer, prefix: str = "") -> list[str]:
    """One output line per input line (blank for a blank line): label, score, text; a tagger's word/tag
    pairs. ``prefix`` goes before each non-empty line (the task's name with several tasks)."""
    from ..training.data import tag_words

    todo = [i for i, line in enumerate(lines) if line.strip()]  # a blank line gets an empty output line
    limit = model_limit(model.config, tokenizer)
    max_length = limit if args.max_length is None else check_max_length("--max-length", args.max_length, limit)
    texts = [lines[i] for i in todo]
    tagger = kind == "BertForTokenClassification"
    words = [t.split() for t in texts]
    counted = tokenizer([" ".join(w) for w in words] if tagger else texts, truncation=True, max_length=max_length)
    report_truncation([(todo[j] + 1, n) for j, n in enumerate(counted.num_truncated_tokens) if n], len(lines),
                      max_length, what="line")
    batch_size = args.batch_size or 32
    if tagger:
        found = [" ".join(f"{w}/{t}" for w, t in zip(ws, tags))
                 for ws, tags in zip(words, tag_words(model, tokenizer, words, batch_size=batch_size,
                                                      max_length=max_length))]
    else:
        found = [f"{p['label']}\t{p['score']:.4f}\t{text}" if "label" in p else f"{p['score']:.4f}\t{text}"
                 for text, p in zip(texts, model.predict(texts, tokenizer=tokenizer, batch_size=batch_size,
                                                         max_length=max_length))]
    out = [""] * len(lines)
    for i, line in zip(todo, found):
        out[i] = prefix + line
    return out


def _predict_with_task_modules(args, folders, lines) -> int:
    """Task modules on one base: the base loaded once, a head per module sharing it, each file labelled
    with each (one task: the plain format; several: the lines of each task in turn, ``name<TAB>`` first)."""
    from ..loading import load_model
    from ..models import BertModel
    from ..tokenizer import BertTokenizer
    from ..training.adapters import read_adapter_config, set_active, task_head

    records = [read_adapter_config(f) for f in folders]
    for folder, record in zip(folders, records):  # before the base is loaded: what predict can run
        kind = (record.get("head") or {}).get("class")
        if kind not in ("BertForSequenceClassification", "BertForTokenClassification"):
            raise InputError(f"{folder}: a task module with {'a ' + kind + ' head' if kind else 'no head'}; predict "
                             "labels texts (BertForSequenceClassification) and tags words (BertForTokenClassification)")
    saved_names = [r["name"] for r in records]
    collide = len(set(saved_names)) != len(saved_names)
    # the first column: each module's saved name; when two share one (runA/trec, runB/trec), the folders as given
    shown = [str(f) for f in args.checkpoint] if collide else saved_names
    names = [f"task_{i}" for i in range(len(records))] if collide else saved_names
    source = args.model or records[0].get("base_source")
    if not source:
        raise InputError(f"{folders[0]}: records no base; give it with --model")
    base = load_model(BertModel, source, mlm_head=False, dtype=args.dtype, device=args.device)
    base.eval()
    tokenizer = BertTokenizer.from_pretrained(folders[0] if (folders[0] / "vocab.txt").exists() else source)
    heads = [task_head(base, f, name=name, check_base=not args.skip_base_check) for f, name in zip(folders, names)]
    for head, name, label in zip(heads, names, shown):
        set_active(base, name)
        kind = type(head).__name__
        for line in _predicted_lines(args, lines, head, kind, tokenizer, prefix=f"{label}\t" if len(heads) > 1 else ""):
            print(line)
    return 0


# ------------------------------------------------------------------------------------------ distill
def add_distill(sub) -> None:
    add_command(sub, "distill", DistillRun, cmd_distill,
                "distil a model into a shallower student (sentence embeddings or a task)")


def cmd_distill(args) -> int:
    from ..runs import distill as D

    run = args
    run.check()  # which mode, and what goes with it, before any work
    out = args.out
    if run.mode == "task":
        with lines_to(sys.stderr, enabled=run.progress):
            history, teacher_score = D.distill_task(run)
        if getattr(history, "nothing_to_resume", False):
            print(f"nothing to resume: {out} holds a finished student (best epoch {history.best_epoch}); nothing written")
            return 0
        metric = history.metric
        print(f"student best epoch {history.best_epoch}: {metric} {history.best_metric:.4f} (teacher "
              f"{teacher_score[metric]:.4f}, {history.best_metric / teacher_score[metric]:.1%} of it); wrote {out}")
        return 0
    with lines_to(sys.stderr, enabled=run.progress):
        run = D.distill_corpus(run)
    if getattr(run.history, "nothing_to_resume", False):
        print(f"nothing to resume: {out} holds a finished student (best epoch {run.history.best_epoch}); nothing "
              "written")
        return 0
    best = run.history.epochs[run.history.best_epoch - 1]["eval"]
    print(f"student: blocks {run.blocks} of the teacher's, trained on {run.trained_on} texts; agreement with the "
          f"teacher on {run.held_out} held-out texts ({run.pooling} pooling"
          f"{', normalized' if run.normalize else ''}): Spearman {best['spearman']:.4f} (before training {run.before['spearman']:.4f}), top-{best['k']} "
          f"overlap {best['top_k_overlap']:.3f} (before {run.before['top_k_overlap']:.3f}); wrote {out}")
    return 0


# -------------------------------------------------------------------------------------------- exits
def add_exits(sub) -> None:
    add_command(sub, "exits", ExitsRun, cmd_exits,
                "train early exits on a fine-tuned classifier; print accuracy vs blocks run")


def cmd_exits(args) -> int:
    from ..runs.exits import train_exits

    run = args
    with lines_to(sys.stderr, enabled=run.progress):
        table = train_exits(run)
    print(table)
    if getattr(table, "nothing_to_resume", False):
        print(f"nothing to resume: {args.out} holds a finished run (its table above); nothing written")
        return 0
    print(f"wrote {args.out}: the classifier, early_exits.json and .safetensors, tokenizer, exits.json")
    return 0


# ----------------------------------------------------------------------------------------- pretrain
def add_pretrain(sub) -> None:
    add_command(sub, "pretrain", PretrainRun, cmd_pretrain,
                "pre-train a BERT with its own objective (masked LM, optionally next "
                                        "sentence): from scratch or continued")


def cmd_pretrain(args) -> int:
    from ..runs.pretrain import run_pretraining

    run = args
    with lines_to(sys.stderr, enabled=run.progress):
        summary = run_pretraining(run)
    if summary.get("nothing_to_resume"):
        print(f"nothing to resume: {args.out} holds a finished run of {summary.get('steps', '?')} steps; nothing written")
        return 0
    resumed = summary.pop("resumed_from", None)
    described = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()
                          if not isinstance(v, (list, dict)))  # per-block lists and the plateau: in log.jsonl
    out = Path(args.out)
    written = ["the model", "its tokenizer", "log.jsonl"] + (["gradients.png"] if (out / "gradients.png").exists() else [])
    written += [f"{name}/" for name in ("checkpoints", "snapshots") if (out / name).is_dir() and any((out / name).iterdir())]
    print(f"pre-trained {summary['steps']} steps{f' (resumed from step {resumed})' if resumed else ''} ({described}); "
          f"wrote {args.out}: {', '.join(written)}")
    return 0


# -------------------------------------------------------------------------------------- depth-study
def add_depth_study(sub) -> None:
    add_command(sub, "depth-study", DepthStudyRun, cmd_depth_study,
                "pre-train encoders of several depths on one corpus (equal steps and "
                       "equal compute, seeds for the spread), then measure and plot what depth buys")


def cmd_depth_study(args) -> int:
    from ..runs.depth_study import ARMS, best_probe, plot_study, study, summary_rows

    run = args  # the --quick preset applied by ``main`` to what the command line left at its default
    with lines_to(sys.stderr, enabled=run.progress):
        results = study(run)
    print(f"{'blocks':>6}  {'budget':>7}  {'norm':>8}  {'warmup':>6}  {'seeds':>5}  {'steps':>6}  "
          f"{'held-out loss':>13}  {'accuracy':>8}  {'stuck':>5}  {'probe':>6}  {'task':>6}  {'random':>6}")
    nan = float("nan")
    for r in summary_rows(results):
        print(f"{r['depth']:>6}  {r['budget']:>7}  {r['norm']:>8}  {r['warmup']:>6g}  {r['seeds']:>5}  {r['steps']:>6}  "
              f"{r['eval_loss']:>13.3f}  {r['masked_accuracy']:>8.3f}  {r.get('stuck_share', nan):>5.2f}  "
              f"{r.get('probe_best', nan):>6.3f}  {r.get('task_accuracy', nan):>6.3f}  "
              f"{r.get('task_accuracy_random', nan):>6.3f}")
    print(f"(stuck: the share of seeds whose held-out masked accuracy is still the unigram rate, "
          f"{results.get('unigram_rate', nan):.3f}; random: the same task fine-tuned from random initialisation)")
    if run.cut_vs_grown:
        entry = results["cut_vs_grown"]
        print(f"\ncut from {entry['teacher']}, grown from scratch, distilled from it (same tokens):")
        print(f"{'blocks':>6}  {'model':>9}  {'held-out loss':>13}  {'accuracy':>8}  {'probe':>6}  {'task':>6}")
        for k, arms in sorted(entry["depths"].items(), key=lambda kv: int(kv[0])):
            for arm in ARMS:
                m = arms[arm]
                print(f"{k:>6}  {arm:>9}  {m['eval_loss']:>13.3f}  {m['masked_accuracy']:>8.3f}  {best_probe(m):>6.3f}  "
                      f"{m.get('task_accuracy', float('nan')):>6.3f}")
    try:
        figures = plot_study(results, run.out)
    except MissingExtra as e:
        print(f"no figures: {e}")
    else:
        print("wrote " + ", ".join(str(f) for f in figures) + f" and {Path(run.out) / 'study.json'}")
    return 0


COMMANDS = [add_finetune, add_distill, add_exits, add_predict, add_pretrain, add_depth_study]
