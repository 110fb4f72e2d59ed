"""A depth study: does a deeper encoder help, and where do the gains stop?

The BERT paper answers with one table (Devlin et al. 2019, Table 6: at H = 768, 3 -> 6 -> 12 layers take
the held-out masked-LM perplexity from 5.84 to 4.68 to 3.99); Turc et al. 2019 with 24 miniatures. This
module reruns that question on the text at hand, as one function (and ``minibert depth-study``):

    for each depth in ``depths`` (one width, heads and FFN; one corpus, vocabulary, mask rule, seed):
        pre-train from scratch under each budget --
            "steps":   the same number of steps, so the same tokens (as Table 6)
            "compute": the training FLOPs ``reference_depth`` spends in those steps
                       (``tools.accounting.pretraining_flops``), so shallower models see more tokens
        (the "steps" budget again with every extra seed in ``seeds``: the spread of a setting, as
        MultiBERTs measured it, to set the differences between depths against)
        then measure: held-out masked-LM loss, perplexity and masked-token accuracy (the same held-out
        examples and masks for every model), parameters, forward time of one batch (alternating, in one
        process), and -- when given -- a linear probe per layer (CoNLL-U, with its control task) and
        fine-tuning accuracy on a classification task (e.g. TREC-6; the classifier's pooler starts fresh,
        as a masked-LM checkpoint has none)

Every run lives in its own folder under ``out_dir/runs`` (a normal ``minibert pretrain`` output), all
share one token store, and ``study.json`` is rewritten after each run: a study that is stopped picks up
at the first run without a finished model. ``plot_study`` draws loss vs depth for both budgets,
downstream vs depth and the probe curves of all depths on one plot.

``cut_vs_grown`` then asks whether the deepest model's lower blocks already are a shallower model: for
each smaller depth k, the deepest model cut to k blocks, against the k-block model grown from scratch on
the same tokens and one distilled from the deepest (DistilBERT's pre-training objective).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import statistics
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from ..errors import InputError
from ..textfiles import write_text_atomic
from ..training.diagnostics import on_plateau, special_ids, unigram_rate
from .settings import BUDGETS, QUICK_STUDY, DepthStudyConfig, DepthStudyRun  # noqa: F401  (declared with the runs')

log = logging.getLogger(__name__)

#: --quick: minutes, not hours (a tutorial, a smoke test): small widths, few steps
QUICK = DepthStudyConfig(**QUICK_STUDY)


@dataclass(frozen=True)
class StudyRun:
    depth: int
    budget: str
    seed: int
    steps: int
    flops: int  # training FLOPs of the whole run
    norm: str = "post"  # where each block's LayerNorm sits (models/norms.py)
    warmup: float = 0.06  # the share of the steps spent warming up

    @property
    def name(self) -> str:  # BERT's post-LN with the default warmup keeps the name studies had before
        return (f"L{self.depth}-{self.budget}-seed{self.seed}" + ("" if self.norm == "post" else f"-{self.norm}")
                + ("" if self.warmup == 0.06 else f"-warmup{self.warmup:g}"))


def bert_config(config: DepthStudyConfig, depth: int, vocab_size: int):
    from ..config import BertConfig

    return BertConfig(vocab_size=vocab_size, hidden_size=config.hidden, num_hidden_layers=depth,
                      num_attention_heads=config.heads, intermediate_size=config.intermediate,
                      max_position_embeddings=max(512, config.max_length))


def plan(config: DepthStudyConfig, vocab_size: int) -> list[StudyRun]:
    """The runs of a study, cheapest budget first. Under "compute" a depth gets
    round(steps x FLOPs(reference) / FLOPs(depth)) steps (at least 1)."""
    from ..tools.accounting import pretraining_flops

    config.check()
    per_step = {d: pretraining_flops(bert_config(config, d, vocab_size), config.batch_size, config.max_length)
                for d in {*config.depths, config.reference_depth}}
    budget = config.steps * per_step[config.reference_depth]
    runs = []
    for norm in config.norms:  # (per-block FLOPs do not depend on where the LayerNorm sits)
        for warmup in config.warmups:
            if "steps" in config.budgets:
                runs += [StudyRun(d, "steps", seed, config.steps, config.steps * per_step[d], norm, warmup)
                         for seed in config.seeds for d in config.depths]
            if "compute" in config.budgets:
                for d in config.depths:
                    steps = max(1, round(budget / per_step[d]))
                    runs.append(StudyRun(d, "compute", config.seeds[0], steps, steps * per_step[d], norm, warmup))
    return runs


def study(run: DepthStudyRun) -> dict:
    """``minibert depth-study`` in Python, from one ``DepthStudyRun``: ``run_study`` on its files with its
    settings, then, with ``run.cut_vs_grown``, ``cut_vs_grown`` (its entry under "cut_vs_grown"). The
    command line's ``--quick`` fills what it was not given from the quick study (``run.with_preset(given)``);
    in Python, ``DepthStudyRun(quick=True, ...).with_preset({"hidden", ...})`` does the same."""
    run.check()
    results = run_study(run.corpus, run.out, vocab=run.vocab, eval_texts=run.eval_texts, config=run.config(),
                        conllu=run.conllu, task_train=run.task_train, task_eval=run.task_eval, device=run.device,
                        overwrite=run.overwrite)
    if run.cut_vs_grown:
        results["cut_vs_grown"] = cut_vs_grown(run.out, run.corpus, vocab=run.vocab, eval_texts=run.eval_texts,
                                               conllu=run.conllu, task_train=run.task_train,
                                               task_eval=run.task_eval, device=run.device)
    return results


def run_study(corpus: Sequence, out_dir, *, vocab, eval_texts, config: DepthStudyConfig = DepthStudyConfig(),
              conllu=None, task_train=None, task_eval=None, device=None, overwrite: bool = False) -> dict:
    """Pre-train and measure every run of ``plan(config)`` (see the module docstring); returns (and keeps
    in ``out_dir/study.json``) the config, the runs and their measures. ``conllu``: a CoNLL-U file for the
    probe; ``task_train`` / ``task_eval``: CSV files of a classification task (text, label). ``device``:
    where the models pre-train and fine-tune ("cpu", "cuda", "cuda:N"; the measures run on the CPU).

    ``out_dir`` follows the output-folder rule (``outputs.RunFolder``): a folder holding this study goes on
    where it stopped (the same settings, each one that differs named); a new probe or task file, or a
    changed one, is measured on every finished model; another corpus, vocabulary or held-out text is
    refused by name (every loss would change). ``overwrite`` replaces the folder instead."""
    from ..outputs import RunFolder
    from ..textfiles import read_conllu
    from ..tokenizer import BertTokenizer
    from ..training.pretrain_data import TokenStore

    files, eval_files = _checked_inputs(config, corpus, eval_texts, conllu, task_train, task_eval, device)
    folder = RunFolder(out_dir, command="depth-study", overwrite=overwrite, resumable=False, continues=_holds_study,
                       reads=_reads(vocab, files, eval_texts, conllu, task_train, task_eval))
    out_dir = folder.path
    tokenizer = BertTokenizer.from_pretrained(vocab)
    probe_data = read_conllu(conllu)[: config.probe_sentences] if conllu is not None else None
    inputs = study_inputs(files, vocab, eval_files, conllu, task_train, task_eval)
    path = out_dir / "study.json"
    results = {"config": json.loads(json.dumps(asdict(config))), "inputs": inputs, "runs": {}}  # as JSON keeps it
    remeasure: list[str] = []
    if path.exists() and not overwrite:  # the study there goes on: checked before any work
        saved = json.loads(path.read_text(encoding="utf-8"))
        remeasure = _compare_study(saved, results, path)
        results = {**saved, "inputs": {**saved.get("inputs", {}), **{k: v for k, v in inputs.items() if v is not None}}}
    with folder.claim({"config": results["config"]}) as run, _known_warnings():
        run.resume_hint = lambda: _study_hint(folder.shown, path, len(plan(config, len(tokenizer.vocab))))
        if remeasure:
            log.info(f"{', '.join(remeasure)} changed since the study measured its runs: measuring every finished run "
                     "again with the new file(s)")
        store = out_dir / "store"
        built = TokenStore.build(files, tokenizer, store, progress=log.isEnabledFor(logging.INFO))  # shared by every run
        results["unigram_rate"] = unigram_rate(built.stream, special_ids(tokenizer))[0]  # the plateau's accuracy
        runs = plan(config, len(tokenizer.vocab))
        (out_dir / "runs").mkdir(exist_ok=True)
        (out_dir / "tasks").mkdir(exist_ok=True)
        done = [r.name for r in runs if r.name in results["runs"]]
        if done:
            log.info(f"continuing the study in {folder.shown}: {len(done)} of {len(runs)} runs finished")
        given = {"--conllu": conllu is not None, "--task-train / --task-eval": task_train is not None}
        for k, run_ in enumerate(runs):  # new or changed probe / task files: measured on every finished model
            if run_.name not in results["runs"]:
                continue
            what = sorted(set(remeasure) | {option for option, key in MEASURE_KEYS
                                            if given[option] and key not in results["runs"][run_.name]})
            if not what:
                continue
            twin = _twin(runs, k)
            if twin is not None:
                results["runs"][run_.name] = {**results["runs"][twin.name], **asdict(run_)}
            else:
                results["runs"][run_.name].update(_measure(out_dir / "runs" / run_.name, config, tokenizer, probe_data,
                                                           task_train, task_eval, out_dir / "tasks", device,
                                                           what=what))
            write_text_atomic(path, json.dumps(results, indent=2) + "\n")
        for k, run_ in enumerate(runs):
            if run_.name in results["runs"]:
                continue
            twin = _twin(runs, k)
            if twin is not None:  # equal compute at the reference depth is equal steps: the same run, measured once
                results["runs"][run_.name] = {**results["runs"][twin.name], **asdict(run_)}
                write_text_atomic(path, json.dumps(results, indent=2) + "\n")
                continue
            log.info(f"[{k + 1}/{len(runs)}] {run_.name}: {run_.steps} steps ({run_.flops / 1e12:.2f} TFLOP)")
            run_folder = out_dir / "runs" / run_.name
            measures = _pretrain_one(run_, run_folder, files, store, vocab, eval_texts, config, device=device)
            measures["stuck"] = _stuck(run_.name, measures["masked_accuracy"], results["unigram_rate"])
            measures.update(_measure(run_folder, config, tokenizer, probe_data, task_train, task_eval,
                                     out_dir / "tasks", device, control=_is_control_run(run_, runs, config)))
            results["runs"][run_.name] = {**asdict(run_), **measures}
            write_text_atomic(path, json.dumps(results, indent=2) + "\n")
        results["speed"] = _forward_times([out_dir / "runs" / r.name for r in runs if r.budget == runs[0].budget
                                           and r.seed == config.seeds[0]], config)
        write_text_atomic(path, json.dumps(results, indent=2) + "\n")
    return results


def _stuck(name: str, accuracy: float, rate: float) -> bool:
    """Whether a run's held-out masked accuracy is still the unigram rate (``diagnostics.on_plateau``), said
    in the study's log."""
    stuck = on_plateau(accuracy, rate)
    if stuck:
        log.info(f"  {name} is stuck on the unigram plateau: held-out masked accuracy {accuracy:.3f}, unigram "
                 f"rate {rate:.3f}")
    return stuck


@contextlib.contextmanager
def _known_warnings():
    """What a study says itself is not warned again for every run: its pre-LN and DeepNorm models are its own
    making (the "read back by minibert only" warning on each load), and a run left on the unigram plateau is
    its "stuck" measure and log line (the detector's warning at the run's end)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="a (pre|deepnorm) model")
        warnings.filterwarnings("ignore", message=".*unigram plateau")
        yield


def _checked_inputs(config: DepthStudyConfig, corpus, eval_texts, conllu, task_train, task_eval, device):
    """(corpus files, held-out files): the settings, the device and every file checked before any work."""
    from ..hardware import training_device
    from ..textfiles import input_file
    from ..training.pretrain_data import corpus_files

    config.check()
    if (task_train is None) != (task_eval is None):
        raise InputError("give both task_train and task_eval (a classification task's files), or neither")
    training_device(device)
    files = corpus_files(corpus)
    eval_files = corpus_files([eval_texts], "--eval-texts file")
    for path, what in ((conllu, "--conllu file"), (task_train, "--task-train file"), (task_eval, "--task-eval file")):
        if path is not None:
            input_file(path, what)  # exists and is readable, before any work
    return files, eval_files


def _reads(vocab, files, eval_texts, conllu, task_train, task_eval) -> dict:
    """What a study reads, for the output-folder rule: its folder may hold none of it."""
    from ..outputs import Read

    return {"--vocab": vocab, "--corpus": Read("read", tuple(files)), "--eval-texts": Read("read", eval_texts),
            "--conllu": Read("read", conllu), "--task-train": Read("read", task_train),
            "--task-eval": Read("read", task_eval)}


def _holds_study(folder: Path) -> bool:
    """Whether a folder holds a depth study (which a rerun goes on with), not another command's run."""
    from ..outputs import read_record

    record = read_record(folder)
    return (folder / "study.json").exists() and (record is None or record["command"] == "depth-study")


def _twin(runs: list, k: int):
    """An earlier run of the plan that is the same run as ``runs[k]`` (equal compute at the reference depth
    is equal steps): measured once, its measures copied."""
    run = runs[k]
    same = (run.depth, run.steps, run.seed, run.norm, run.warmup)
    return next((r for r in runs[:k] if (r.depth, r.steps, r.seed, r.norm, r.warmup) == same), None)


def study_inputs(files, vocab, eval_files, conllu, task_train, task_eval) -> dict:
    """What a study was measured on: each file's path and sha256 (``textfiles.file_sha256``), the
    vocabulary's hash; None for a measure not asked for."""
    from ..tokenizer import BertTokenizer
    from ..textfiles import file_sha256
    from ..training.pretrain_data import vocabulary_hash

    def entry(path):
        return None if path is None else {"path": str(Path(path).resolve()), "sha256": file_sha256(path)}

    return {"corpus": [entry(f)["sha256"] for f in files], "vocab": vocabulary_hash(BertTokenizer.from_pretrained(vocab)),
            "eval_texts": [entry(f)["sha256"] for f in eval_files], "conllu": entry(conllu),
            "task": None if task_train is None else [entry(task_train), entry(task_eval)]}


#: the inputs a study cannot take another of without every loss changing: (key, the option that gives it)
FIXED_INPUTS = (("corpus", "--corpus"), ("vocab", "--vocab"), ("eval_texts", "--eval-texts"))
#: the inputs of a measure, measured again on every finished model when they change: (key, option)
MEASURE_INPUTS = (("conllu", "--conllu"), ("task", "--task-train / --task-eval"))
#: the option of each measure and the key it leaves in a run's measures (a run without it is measured)
MEASURE_KEYS = (("--conllu", "probe_accuracy"), ("--task-train / --task-eval", "task_accuracy"))


def _compare_study(saved: dict, now: dict, path: Path) -> list[str]:
    """What a rerun into a study folder changed: an error naming every setting or fixed input that
    differs; the measure inputs that are new or changed (their options' names), to be measured again."""
    differs = [f"{k}={saved['config'].get(k)!r} then, {v!r} now" for k, v in now["config"].items()
               if saved["config"].get(k) != v]
    before = saved.get("inputs") or {}
    differs += [f"{option} is not the file the study was measured with" for key, option in FIXED_INPUTS
                if key in before and before[key] != now["inputs"][key]]
    if differs:
        raise InputError(f"{path} was written by a study with other settings ({'; '.join(differs)}): give the same, "
                         "--overwrite to start it again, or another --out")
    return _changed_measures(before, now["inputs"]) if saved.get("runs") else []


def _changed_measures(before: dict, now: dict) -> list[str]:
    """The options of the measure inputs given ``now`` that are new or other files than ``before``'s."""
    def sha(value):
        return None if value is None else (value["sha256"] if isinstance(value, dict) else [v["sha256"] for v in value])
    return [option for key, option in MEASURE_INPUTS if now[key] is not None and sha(before.get(key)) != sha(now[key])]


def _study_hint(shown: str, path: Path, total: int) -> str:
    done = len(json.loads(path.read_text(encoding="utf-8")).get("runs", {})) if path.exists() else 0
    return (f"the study in {shown} has {done} of {total} runs measured: the same command again picks up where it "
            "stopped")


def _pretrain_one(run: StudyRun, folder: Path, files, store, vocab, eval_texts, config: DepthStudyConfig,
                  teacher=None, device=None) -> dict:
    from ..training.pretrain import PretrainConfig
    from .pretrain import run_pretraining
    from .settings import PretrainRun

    pconfig = PretrainConfig(steps=run.steps, batch_size=config.batch_size, lr=config.lr, warmup=run.warmup,
                             bf16=config.bf16, eval_every=run.steps, eval_examples=config.eval_examples,
                             save_every=max(1, run.steps // 4), keep=1, log_every=max(1, run.steps // 20),
                             grad_every=max(1, run.steps // 20), plateau_step=run.steps,
                             snapshots=config.snapshots, seed=run.seed, progress=log.isEnabledFor(logging.INFO))
    finished = folder / "pretrain.json"
    if finished.exists():  # trained before the study stopped, not yet measured: its summary is on disk
        saved = json.loads(finished.read_text(encoding="utf-8"))
        if saved.get("steps") == run.steps and "eval_loss" in saved.get("last", {}):
            return _pretrain_measures(saved["last"], run, config, folder)
    with warnings.catch_warnings():  # a run is resumed when it was started before, begun when not: both are normal
        warnings.filterwarnings("ignore", message="(resume|nothing to resume)")
        summary = run_pretraining(PretrainRun(**dataclasses.asdict(pconfig), corpus=files, out=folder,
                                              layers=run.depth, hidden=config.hidden, heads=config.heads,
                                              intermediate=config.intermediate, vocab=str(vocab),
                                              max_length=config.max_length, eval_texts=eval_texts,
                                              dropout=config.dropout, resume=True, store=store, teacher=teacher,
                                              device=device, norm=run.norm))
    return _pretrain_measures(summary, run, config, folder)


def _pretrain_measures(summary: dict, run: StudyRun, config: DepthStudyConfig, folder: Path) -> dict:
    """The held-out measures and, from the run's log.jsonl, the per-block gradient norms of its first step
    (at initialisation) and of its last record (``training.diagnostics``)."""
    out = _loss_measures(summary, tokens=run.steps * config.batch_size * config.max_length)
    log_path = folder / "log.jsonl"
    if log_path.exists():
        records = [json.loads(line) for line in log_path.read_text(encoding="utf-8").splitlines() if line.strip()]
        measured = [r for r in records if r.get("grad_norm")]
        if measured:
            out.update(grad_init=measured[0]["grad_norm"], grad_last=measured[-1]["grad_norm"],
                       update_ratio_last=measured[-1]["update_ratio"])
    return out


def _loss_measures(evaluated: dict, tokens: int) -> dict:
    """The held-out masked-LM measures of a model (``pretrain.evaluate``'s or a run summary's) and the tokens
    it was trained on."""
    return {"eval_loss": evaluated["eval_loss"], "perplexity": evaluated["perplexity"],
            "masked_accuracy": evaluated["masked_accuracy"], "tokens": tokens}


def best_probe(measures: dict) -> float:
    """The best layer's probe accuracy of a measured model; nan when it was not probed (no CoNLL-U file)."""
    return max(measures["probe_accuracy"]) if "probe_accuracy" in measures else float("nan")


def _measure(folder: Path, config: DepthStudyConfig, tokenizer, probe_data, task_train, task_eval, work: Path,
             device=None, what=None, control: bool = False) -> dict:
    """A trained model's measures: its parameters, the probe per layer (``probe_data``), fine-tuning
    accuracy on the task (on ``device``), and with ``control`` the same task from random initialisation.
    ``what``: only the measures of these options ("--conllu", "--task-train / --task-eval"; None: all)."""
    from ..models import BertModel

    model = BertModel.from_pretrained(folder)
    counts = model.parameter_counts()
    out = {"parameters": counts["total"], "non_embedding_parameters": counts["non_embedding"]}
    if what is not None:
        probe_data = probe_data if "--conllu" in what else None
        task_train = task_train if any(w.startswith("--task") for w in what) else None
    if probe_data is not None:
        from ..analysis.probing import probe_model

        probe = probe_model(model, tokenizer, probe_data, progress=False)
        out.update(probe_accuracy=probe.accuracy, probe_control=probe.control_accuracy,
                   probe_selectivity=probe.selectivity, probe_best_layer=probe.best_layer)
    if task_train is not None:
        out["task_accuracy"] = _task_accuracy(folder, config, task_train, task_eval, work / folder.name, device)
        if control:  # once a depth and norm placement
            out["task_accuracy_random"] = _random_control(folder, config, task_train, task_eval, work, device)
    log.info("  " + ", ".join(f"{k} {v:.4g}" for k, v in out.items() if isinstance(v, float)))
    return out


def _is_control_run(run: StudyRun, runs: list[StudyRun], config: DepthStudyConfig) -> bool:
    """Whether the random-init control of ``run``'s depth and norm placement is measured with it: the first
    seed's run of the first budget and warmup."""
    return (run.seed, run.budget, run.warmup) == (config.seeds[0], runs[0].budget, config.warmups[0])


def _task_accuracy(folder: Path, config: DepthStudyConfig, task_train, task_eval, out: Path, device) -> float:
    """The best held-out accuracy of the model in ``folder`` fine-tuned on the task (every model alike)."""
    from .finetune import finetune
    from .settings import FinetuneRun

    with warnings.catch_warnings():  # a masked-LM checkpoint has no pooler: the classifier starts a fresh one
        warnings.filterwarnings("ignore", message=".*has no pooler")
        history = finetune(FinetuneRun(train=task_train, eval=task_eval, model=str(folder), out=out,
                                       epochs=config.task_epochs, lr=config.task_lr, seed=0, progress=False,
                                       batch_size=32, max_length=64, device=device, overwrite=True))
    return history.best_metric


def _random_control(folder: Path, config: DepthStudyConfig, task_train, task_eval, work: Path, device) -> float:
    """The control of a pre-trained model in ``folder``: its geometry and norm placement, randomly initialised."""
    from ..config import BertConfig

    return random_control(BertConfig.from_json_file(folder / "config.json"), folder, config, task_train, task_eval,
                          work / f"random-{folder.name}", device)


def random_control(bert, tokenizer_folder, config: DepthStudyConfig, task_train, task_eval, work: Path,
                   device=None) -> float:
    """The random-init control: a model of ``bert``'s geometry and norm placement (a ``BertConfig``), randomly
    initialised (seed 0), with the tokenizer of ``tokenizer_folder``, fine-tuned on the task exactly as a study's
    pre-trained models are (``config.task_epochs``, ``config.task_lr``) -- what the task alone teaches that
    depth. ``work``: a new folder for the model and its fine-tuning."""
    from ..loading import copy_tokenizer
    from ..models import BertModel

    import torch

    torch.manual_seed(0)
    work.mkdir(exist_ok=True)
    random_dir = work / "model"
    with _known_warnings():  # a pre-LN or DeepNorm model is saved and loaded knowingly
        BertModel(bert).save_pretrained(random_dir)
        copy_tokenizer(tokenizer_folder, random_dir)
        return _task_accuracy(random_dir, config, task_train, task_eval, work / "task", device)


def _forward_times(folders: list[Path], config: DepthStudyConfig, rounds: int = 7) -> dict:
    """Milliseconds of one forward pass (8 x max_length, fp32, no gradients) of each depth, alternating in
    one process (median and quartiles)."""
    import torch

    from ..models import BertModel
    from ..tools.timing import alternate, spread

    models = {f.name: BertModel.from_pretrained(f).eval() for f in folders}
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 2000, (8, config.max_length), generator=generator)

    def call(model):
        def run():
            with torch.inference_mode():
                model(ids)
        return run
    times = alternate({name: call(m) for name, m in models.items()}, rounds, warmup=1, rotate=True)
    return {name: {"ms": statistics.median(t) * 1e3, "quartiles_ms": [x * 1e3 for x in spread(t)]}
            for name, t in times.items()}


# ----------------------------------------------------------------------------------------- cut vs grown
ARMS = ("cut", "grown", "distilled")


def study_config(saved: dict) -> DepthStudyConfig:
    """The ``DepthStudyConfig`` a ``study.json`` was written with (one written before the norm placements and
    warmups were study settings: BERT's post-LN at its one ``warmup``)."""
    fields = dict(saved["config"])
    if "warmup" in fields:
        fields["warmups"] = [fields.pop("warmup")]
    return DepthStudyConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def cut_vs_grown(out_dir, corpus: Sequence, *, vocab, eval_texts, conllu=None, task_train=None, task_eval=None,
                 temperature: float = 2.0, alpha: float = 0.5, device=None) -> dict:
    """Is the depth a deep model learnt reusable in fewer blocks? For each smaller depth k of the finished
    study in ``out_dir`` (``run_study``; its equal-steps runs of the first seed), three k-block models:

        cut        ``tools.surgery.truncate(deepest, k)``: the deepest model's first k blocks under its own
                   masked-LM head, not trained further (its hidden states are the deepest model's first
                   k + 1, so its probe curve is theirs)
        grown      the study's k-block model, pre-trained from scratch on the same tokens (measured already)
        distilled  k blocks from scratch (the grown model's initialisation), pre-trained on the same tokens
                   and masks for the same steps against the deepest model's soft predictions at the masked
                   tokens (``distill.MaskedLMDistiller``, ``temperature``, ``alpha``)

    each measured as the study measures a run: held-out masked-LM loss and accuracy on the same examples
    and masks, parameters, probe per layer (``conllu``), task accuracy (``task_train`` / ``task_eval``).
    Kept in ``study.json`` under "cut_vs_grown" (a stopped comparison picks up at the first depth not
    finished; a new or changed probe or task file is measured on the finished arms); returns that entry:
    {"teacher": run name, "depths": {"k": {arm: measures}}}. ``device``: where the distilled arm pre-trains
    and the task fine-tunes."""
    from ..outputs import RunFolder
    from ..training.pretrain_data import corpus_files

    out_dir = Path(out_dir)
    path = out_dir / "study.json"
    if not path.exists():
        raise InputError(f"{path} does not exist: run the depth study first (run_study / minibert depth-study)")
    if (task_train is None) != (task_eval is None):
        raise InputError("give both task_train and task_eval (a classification task's files), or neither")
    files = corpus_files(corpus)
    eval_files = corpus_files([eval_texts], "--eval-texts file")
    results = json.loads(path.read_text(encoding="utf-8"))
    config = study_config(results)
    inputs = study_inputs(files, vocab, eval_files, conllu, task_train, task_eval)
    _compare_study(results, {"config": results["config"], "inputs": inputs}, path)  # the same corpus, vocab, held-out
    reads = _reads(vocab, files, eval_texts, conllu, task_train, task_eval)
    folder = RunFolder(out_dir, command="depth-study", reads=reads,
                       resumable=False, continues=_holds_study)
    study = _OpenStudy(out_dir, path, results, config, inputs, files, vocab, eval_texts)
    with folder.claim({"config": results["config"]}), _known_warnings():
        return _cut_vs_grown(study, conllu, task_train, task_eval, temperature, alpha, device)


@dataclass
class _OpenStudy:
    """A finished study, opened for the comparison: its folder, its study.json (read and where it lives),
    its settings and the inputs it was run on."""

    out_dir: Path
    path: Path
    results: dict
    config: DepthStudyConfig
    inputs: dict
    files: list
    vocab: object
    eval_texts: object


def _cut_vs_grown(study: _OpenStudy, conllu, task_train, task_eval, temperature, alpha, device) -> dict:
    from ..loading import copy_tokenizer
    from ..models.pretraining import BertForMaskedLM
    from ..textfiles import read_conllu
    from ..tokenizer import BertTokenizer
    from ..tools.surgery import truncate
    from .pretrain import held_examples
    from ..training.pretrain import evaluate

    out_dir, path, results, config, inputs = study.out_dir, study.path, study.results, study.config, study.inputs
    files, vocab, eval_texts = study.files, study.vocab, study.eval_texts
    if "steps" not in config.budgets or len(config.depths) < 2:
        raise InputError(f"{path}: cut vs grown needs the equal-steps budget and two or more depths (the study has "
                         f"budgets {config.budgets}, depths {config.depths})")
    seed, deepest = config.seeds[0], max(config.depths)
    runs = {d: StudyRun(d, "steps", seed, config.steps, 0) for d in config.depths}
    missing = [r.name for r in runs.values() if r.name not in results["runs"]]
    if missing:
        raise InputError(f"{path}: the study has not finished {', '.join(missing)}: run it to the end first")
    tokenizer = BertTokenizer.from_pretrained(vocab)
    probe_data = read_conllu(conllu)[: config.probe_sentences] if conllu is not None else None
    held = held_examples(eval_texts, tokenizer, out_dir / "eval-store", max_length=config.max_length)
    count = min(config.eval_examples, held.per_epoch)
    teacher_folder = out_dir / "runs" / runs[deepest].name
    teacher = BertForMaskedLM.from_pretrained(teacher_folder)
    entry = results.setdefault("cut_vs_grown", {"teacher": runs[deepest].name, "temperature": temperature,
                                                "alpha": alpha, "depths": {}})
    if (entry["temperature"], entry["alpha"]) != (temperature, alpha):
        raise InputError(f"{path} holds a comparison distilled at temperature {entry['temperature']}, alpha "
                         f"{entry['alpha']}: give the same, or another study folder")
    changed = _changed_measures(entry.get("inputs") or {}, inputs) if entry["depths"] else []
    entry["inputs"] = {**(entry.get("inputs") or {}), **{k: inputs[k] for k, _ in MEASURE_INPUTS if inputs[k] is not None}}
    for sub in ("cut", "distilled", "tasks-cut", "tasks-distilled"):
        (out_dir / sub).mkdir(exist_ok=True)
    for k in sorted(d for d in config.depths if d < deepest):
        if str(k) in entry["depths"]:
            if changed:  # a new or changed probe / task file: the finished arms measured with it
                arms = entry["depths"][str(k)]
                grown = results["runs"][runs[k].name]
                arms["grown"] = {key: grown[key] for key in grown if key not in asdict(runs[k])}
                for arm in ("cut", "distilled"):
                    arms[arm].update(_measure(out_dir / arm / f"L{k}", config, tokenizer, probe_data, task_train,
                                              task_eval, out_dir / f"tasks-{arm}", None, device, what=changed))
                write_text_atomic(path, json.dumps(results, indent=2) + "\n")
            continue
        grown = results["runs"][runs[k].name]
        arms = {"grown": {key: grown[key] for key in grown if key not in asdict(runs[k])}}
        folder = out_dir / "cut" / f"L{k}"
        cut = truncate(teacher, k)
        cut.save_pretrained(folder)
        copy_tokenizer(vocab, folder)
        arms["cut"] = _loss_measures(evaluate(cut, held, count), tokens=0)
        arms["cut"].update(_measure(folder, config, tokenizer, probe_data, task_train, task_eval, out_dir / "tasks-cut",
                                    None, device))
        log.info(f"cut L{deepest} -> {k}: held-out loss {arms['cut']['eval_loss']:.3f} (grown {grown['eval_loss']:.3f}); "
                 f"distilling {config.steps} steps")
        folder = out_dir / "distilled" / f"L{k}"
        arms["distilled"] = _pretrain_one(runs[k], folder, files, out_dir / "store", vocab, eval_texts, config,
                                          teacher=teacher, device=device)
        arms["distilled"].update(_measure(folder, config, tokenizer, probe_data, task_train, task_eval,
                                          out_dir / "tasks-distilled", device))
        entry["depths"][str(k)] = {arm: arms[arm] for arm in ARMS}
        write_text_atomic(path, json.dumps(results, indent=2) + "\n")
    return entry


# ---------------------------------------------------------------------------------------------- figures
def summary_rows(results: dict) -> list[dict]:
    """One row per (depth, budget, norm placement, warmup): the mean over seeds of each measure, with the
    seeds' spread and the share of runs stuck on the unigram plateau."""
    groups: dict[tuple, list[dict]] = {}
    for run in results["runs"].values():
        groups.setdefault((run["depth"], run["budget"], run.get("norm", "post"), run.get("warmup", 0.06)), []).append(run)
    rows = []
    for (depth, budget, norm, warmup), runs in sorted(groups.items(), key=lambda kv: (BUDGETS.index(kv[0][1]),
                                                                                      kv[0][2], kv[0][3], kv[0][0])):
        losses = [r["eval_loss"] for r in runs]
        row = {"depth": depth, "budget": budget, "norm": norm, "warmup": warmup, "seeds": len(runs),
               "steps": runs[0]["steps"], "tokens": runs[0]["tokens"], "flops": runs[0]["flops"],
               "parameters": runs[0]["parameters"], "eval_loss": statistics.mean(losses),
               "eval_loss_range": [min(losses), max(losses)],
               "masked_accuracy": statistics.mean(r["masked_accuracy"] for r in runs)}
        if all("stuck" in r for r in runs):
            row["stuck_share"] = sum(bool(r["stuck"]) for r in runs) / len(runs)
        if "task_accuracy" in runs[0]:
            row["task_accuracy"] = statistics.mean(r["task_accuracy"] for r in runs)
        controls = [r["task_accuracy_random"] for r in runs if "task_accuracy_random" in r]
        if controls:
            row["task_accuracy_random"] = statistics.mean(controls)
        if "probe_accuracy" in runs[0]:
            row["probe_best"] = statistics.mean(best_probe(r) for r in runs)
        rows.append(row)
    return rows


def plot_study(results: dict, folder, name: str = "depth") -> list[Path]:
    """The study's figures in ``folder`` (``analysis.plots.depth_study_figures``): loss vs depth for both
    budgets, downstream vs depth, every depth's probe curve -- for the first norm placement and warmup --;
    with several placements or warmups, the stability figures (``analysis.plots.stability_figures``); and
    ``{name}_cut.png`` when the study has a cut-vs-grown comparison (``cut_vs_grown``). Returns the files."""
    from ..analysis.plots import depth_study_figures, stability_figures

    config = results["config"]
    first = (config.get("norms", ["post"])[0], config.get("warmups", [0.06])[0])
    rows = summary_rows(results)
    runs = list(results["runs"].values())
    written = depth_study_figures([r for r in rows if (r["norm"], r["warmup"]) == first],
                                  [r for r in runs if (r.get("norm", "post"), r.get("warmup", 0.06)) == first],
                                  folder, name)
    if len({(r["norm"], r["warmup"]) for r in rows}) > 1 or any("grad_init" in r for r in runs):
        written += stability_figures(rows, runs, folder, name)
    entry = results.get("cut_vs_grown")
    if entry and entry["depths"]:
        from ..analysis.plots import cut_vs_grown_figure

        written.append(cut_vs_grown_figure(entry, results["runs"][entry["teacher"]], Path(folder) / f"{name}_cut.png"))
    return written
