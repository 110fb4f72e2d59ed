"""Nothing a user wrote is ever lost (issue 46; ``minibert/outputs.py`` and the commands that write).

Each data-loss finding of the issue has a test here that failed before: the folder that was there is
byte-identical afterwards (``snapshot``). Then: one writer per folder (a live lock refused, a killed one's
taken over), non-finite training stopped before anything non-finite is saved, sizes bounded by the model,
task modules checked against the base's config and against what their weights were saved with, resumes
that say what they did, Ctrl-C that says where to go on from, and arguments checked before any file is
created.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, cli_error, usage_error
from minibert import InputError

DATA = ROOT / "tests" / "data" / "adapters"  # a 3-block, 32-wide BERT (4 heads, 64 positions, 120 words)
WORDS = ["the", "day", "was", "and", "hot", "cold", "good", "great", "fine", "nice", "bad", "awful", "poor", "sad"]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes): equal snapshots are byte-identical folders."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny base with a vocabulary of real words, a corpus and a labelled task in those words."""
    import random

    folder = tmp_path_factory.mktemp("outputs")
    base = folder / "base"
    shutil.copytree(DATA / "base", base)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, 120)]
    vocab[5:5 + len(WORDS)] = WORDS
    (base / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(10)) + "." for _ in range(300)]
    (folder / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "held.txt").write_text("\n".join(lines[:20]) + "\n", encoding="utf-8")
    for name, n, seed in (("train.csv", 16, 0), ("test.csv", 8, 1)):
        rng = random.Random(seed)
        rows = [("the day was " + rng.choice(["good", "great"] if i % 2 == 0 else ["bad", "awful"]),
                 "pos" if i % 2 == 0 else "neg") for i in range(n)]
        (folder / name).write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows), encoding="utf-8")
    return folder


def pretrain_args(work, out, *extra):
    return ["pretrain", "--corpus", str(work / "corpus.txt"), "--out", str(out), "--blocks", "1", "--hidden", "32",
            "--heads", "2", "--vocab", str(work / "base"), "--max-length", "16", "--batch-size", "4", "--quiet", *extra]


def finetune_args(work, out, *extra, model=None):
    return ["finetune", "--train", str(work / "train.csv"), "--eval", str(work / "test.csv"), "--model",
            str(model or work / "base"), "--out", str(out), "--epochs", "1", "--max-length", "16", "--quiet", *extra]


def run(*args):
    from minibert.cli import main

    return main([str(a) for a in args])


@pytest.fixture(scope="module")
def finished(work):
    """A finished pre-training run (with checkpoints), a fine-tuned classifier and an adapter module."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run(*pretrain_args(work, work / "p1", "--steps", "4", "--save-every", "2")) == 0
        assert run(*finetune_args(work, work / "clf")) == 0
        assert run(*finetune_args(work, work / "adapter", "--recipe", "adapter", "--adapter-size", "8")) == 0
    return work


# ------------------------------------------------------------------------------------ the data-loss rows
def test_a_run_never_writes_into_a_model_folder_it_reads(work, tmp_path, capsys):
    model = tmp_path / "X"
    shutil.copytree(work / "base", model)
    before = snapshot(model)
    lines = [cli_error(capsys, "pretrain", "--corpus", work / "corpus.txt", "--out", model, "--model", model,
                       "--steps", "2"),
             cli_error(capsys, "pretrain", "--corpus", work / "corpus.txt", "--out", model / "run", "--model", model,
                       "--steps", "2"),
             cli_error(capsys, *finetune_args(work, model, model=model)),
             cli_error(capsys, *finetune_args(work, tmp_path, model=model)),  # --out contains the model
             cli_error(capsys, "distill", "--teacher", model, "--out", model, "--texts", work / "corpus.txt"),
             cli_error(capsys, "embed", work / "corpus.txt", "--model", model, "--out", model / "vectors.npy"),
             cli_error(capsys, "search", work / "corpus.txt", "day", "--model", model, "--index", model / "i.npy")]
    for line in lines:
        assert "the model folder" in line and ("is the" in line or "sits inside" in line or "contains" in line), line
    assert "--out '" + str(model) + "' is the model folder --model reads" in lines[2]
    assert "contains the model folder --model reads" in lines[3]
    assert snapshot(model) == before and not (model / "run").exists()  # byte-identical, nothing created


def test_a_folder_holding_a_run_or_a_model_is_refused_and_left_as_it_was(finished, capsys):
    work = finished
    kept = {name: snapshot(work / name) for name in ("p1", "clf", "adapter")}
    line = cli_error(capsys, *pretrain_args(work, work / "p1", "--blocks", "1", "--steps", "2"))
    assert "holds a `minibert pretrain` run (finished)" in line and "--overwrite" in line and "--resume to" not in line
    line = cli_error(capsys, *pretrain_args(work, work / "clf", "--steps", "2"))
    assert "holds a `minibert finetune` run (finished)" in line
    line = cli_error(capsys, *finetune_args(work, work / "clf", "--seed", "3"))
    assert "holds a `minibert finetune` run (finished)" in line
    line = cli_error(capsys, *finetune_args(work, work / "adapter", "--recipe", "full"))  # was: module kept, predict stale
    assert "holds a `minibert finetune` run" in line
    line = cli_error(capsys, *finetune_args(work, work / "adapter", "--recipe", "full", "--resume"))
    assert "made with other settings" in line and "recipe='adapter' then, 'full' now" in line
    copy = work / "model-copy"  # a folder no minibert command wrote: said as files, never guessed from their names
    shutil.copytree(work / "base", copy)
    assert "file(s) no minibert run wrote (config.json" in cli_error(capsys, *finetune_args(work, copy))
    for name, files in kept.items():
        assert snapshot(work / name) == files, name


def test_overwrite_replaces_the_whole_folder_and_refuses_what_minibert_did_not_write(work, tmp_path, capsys):
    out = tmp_path / "p"
    assert run(*pretrain_args(work, out, "--steps", "4", "--save-every", "2")) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert run(*pretrain_args(work, out, "--steps", "2", "--overwrite", "--hidden", "16")) == 0
    assert not (out / "checkpoints").exists()  # nothing of the old run is mixed into the new one
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 16
    assert len(json.loads((out / "pretrain.json").read_text())["config"]) and \
        [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [2]
    module = tmp_path / "module"  # an adapter module replaced by a whole classifier: no stale module left to predict
    assert run(*finetune_args(work, module, "--recipe", "adapter", "--adapter-size", "4")) == 0
    assert run(*finetune_args(work, module, "--overwrite")) == 0
    assert not (module / "adapter.json").exists() and (module / "model.safetensors").exists()
    assert run("predict", module, work / "held.txt") == 0
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    line = cli_error(capsys, *pretrain_args(work, mine, "--steps", "2", "--overwrite"))
    assert "1 file(s) no minibert run wrote (thesis.tex)" in line and "nothing is deleted" in line
    assert (mine / "thesis.tex").read_text() == "years of work"
    # issue 61, row 3: a folder whose names look like a model's or a run's is not minibert's for that
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "thesis.txt").write_text("thesis")
    for name in ("config.json", "log.jsonl"):
        (proj / name).write_text("{}")
    (proj / "checkpoints").mkdir()
    before = snapshot(proj)
    line = cli_error(capsys, *finetune_args(work, proj, "--overwrite"))
    assert "no minibert run wrote" in line and "thesis.txt" in line and "nothing is deleted" in line
    assert "a model" not in cli_error(capsys, *finetune_args(work, proj))
    assert snapshot(proj) == before and (proj / "checkpoints").is_dir()
    # a run minibert wrote, with a file of the user's put in it afterwards: that file stops --overwrite
    (module / "notes.txt").write_text("mine")
    kept = snapshot(module)
    line = cli_error(capsys, *finetune_args(work, module, "--overwrite"))
    assert "1 file(s) its record does not account for (notes.txt)" in line and snapshot(module) == kept
    assert "--resume and --overwrite exclude each other" in cli_error(
        capsys, *pretrain_args(work, out, "--steps", "2", "--overwrite", "--resume"))


def test_resume_says_what_it_resumed_and_never_empties_a_finished_run(finished, tmp_path, capsys):
    work = finished
    before = snapshot(work / "p1")
    capsys.readouterr()
    assert run(*pretrain_args(work, work / "p1", "--steps", "4", "--save-every", "2", "--resume")) == 0
    said = capsys.readouterr()
    assert "minibert: warning: nothing to resume" in said.err and "nothing written" in said.out
    assert snapshot(work / "p1") == before  # pretrain.json's metrics kept, nothing written
    clf = snapshot(work / "clf")
    assert run(*finetune_args(work, work / "clf", "--resume")) == 0
    assert "nothing to resume" in capsys.readouterr().out
    assert snapshot(work / "clf") == clf
    new = tmp_path / "new"
    assert run(*pretrain_args(work, new, "--steps", "2", "--resume")) == 0
    said = capsys.readouterr()
    assert "holds no run (nothing to resume): starting from step 0" in said.err
    last = said.out.strip().splitlines()[-1]
    assert "wrote" in last and "checkpoints/" not in last  # none were written: none are named
    interrupted = tmp_path / "cut"
    assert run(*pretrain_args(work, interrupted, "--steps", "4", "--save-every", "2")) == 0
    record = json.loads((interrupted / ".minibert-run.json").read_text())
    record["status"] = "interrupted"  # as a run stopped by Ctrl-C after its checkpoint at step 2 leaves it
    (interrupted / ".minibert-run.json").write_text(json.dumps(record))
    shutil.rmtree(interrupted / "checkpoints" / "step-000004")
    assert run(*pretrain_args(work, interrupted, "--steps", "4", "--save-every", "2", "--resume")) == 0
    assert "(resumed from step 2)" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ one writer at a time
HOLDER = textwrap.dedent("""
    import sys, time
    from minibert.outputs import RunFolder
    with RunFolder(sys.argv[1], command="pretrain").claim({"steps": 1}):
        print("holding", flush=True)
        time.sleep(120)
""")


def test_one_writer_per_folder_and_a_killed_writers_lock_is_taken_over(work, tmp_path, capsys):
    out = tmp_path / "busy"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "holding"
        line = cli_error(capsys, *pretrain_args(work, out, "--steps", "2"))
        assert f"is being written by `minibert pretrain` (pid {holder.pid} on" in line and "one run writes" in line
        assert f"(pid {holder.pid}" in cli_error(capsys, *pretrain_args(work, out, "--steps", "2", "--overwrite"))
    finally:
        holder.kill()  # SIGKILL: its lock file stays behind, with its pid
        holder.wait()
    assert (out / ".minibert.lock").exists()
    line = cli_error(capsys, *pretrain_args(work, out, "--steps", "2"))
    assert "unfinished: its process is gone (killed?)" in line and "--resume" in line
    assert run(*pretrain_args(work, out, "--steps", "2", "--overwrite")) == 0  # the stale lock is taken over
    assert not (out / ".minibert.lock").exists() and (out / "model.safetensors").exists()
    far = tmp_path / "far"  # a lock from another host: only that host can tell whether its run still runs
    far.mkdir()
    (far / ".minibert.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "command": "finetune"}))
    line = cli_error(capsys, *pretrain_args(work, far, "--steps", "2"))
    assert "pid 1 on elsewhere" in line and "delete" in line and ".minibert.lock" in line


def test_two_runs_started_together_write_one_folder_one_after_the_other(work, tmp_path):
    """The issue's race: two `pretrain` runs with one --out, started at once. One writes; the other is
    refused in one line (by the lock, or -- if it comes after the first finished -- by the finished run)."""
    out = tmp_path / "race"
    args = [sys.executable, "-m", "minibert", *pretrain_args(work, out, "--steps", "6", "--save-every", "2")]
    runs = [subprocess.Popen(args + ["--seed", str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT) for seed in (1, 2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in runs]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert refused.count("\n") == 1 and ("is being written by" in refused or "holds a `minibert pretrain` run" in refused)
    seeds = {json.loads((out / ".minibert-run.json").read_text())["settings"]["seed"]}
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and len(steps) == len(set(steps)) and len(seeds) == 1  # one run's log, not two


# -------------------------------------------------------------------------------------- non-finite training
def test_a_run_whose_loss_is_nan_stops_and_saves_nothing_non_finite(work, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "nan"
    line = cli_error(capsys, *pretrain_args(work, out, "--steps", "20", "--save-every", "1", "--lr", "1e6",
                                            "--warmup", "0"))
    assert line.startswith("minibert: error: step ") and "is stopped before this step is taken" in line
    assert "learning rate too high for this model (now 1e+06)" in line
    assert not (out / "model.safetensors").exists()  # no NaN model
    kept = sorted((out / "checkpoints").iterdir()) if (out / "checkpoints").exists() else []
    assert kept and f"the last good checkpoint is {kept[-1]}" in line
    for folder in kept:
        assert all(bool(torch.isfinite(t).all()) for t in load_file(folder / "model.safetensors").values())
    assert json.loads((out / ".minibert-run.json").read_text())["status"].startswith("stopped: step ")


class _Exploding(torch.nn.Module):
    """A model whose loss is finite until call ``at``, then NaN (``grad``: the loss stays finite and its
    gradient is infinite instead: sqrt at 0)."""

    def __init__(self, at: int, grad: bool = False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.at, self.grad, self.calls = at, grad, 0

    def forward(self, input_ids, labels):
        self.calls += 1
        loss = ((self.w * input_ids.float()).sum() - labels.float().sum()) ** 2
        if self.calls >= self.at:
            loss = torch.sqrt(self.w[0] - self.w[0].detach()) if self.grad else loss * float("nan")
        return type("Out", (), {"loss": loss})()

    def save_pretrained(self, directory):
        Path(directory).mkdir(exist_ok=True)
        torch.save({"w": self.w.detach().clone()}, Path(directory) / "w.pt")


@pytest.mark.parametrize("grad", [False, True], ids=["nan-loss", "infinite-gradient"])
def test_fit_stops_on_a_non_finite_step_and_keeps_the_best_epoch(tmp_path, grad):
    from minibert.errors import TrainingStopped
    from minibert.training.loop import FitConfig, fit

    model = _Exploding(at=6, grad=grad)  # 4 batches an epoch: epoch 1 is finite, epoch 2 is not

    def batches(epoch):
        return [{"input_ids": torch.ones(1, 3), "labels": torch.ones(1)} for _ in range(4)]

    with pytest.raises(TrainingStopped) as stopped:
        fit(model, batches, config=FitConfig(epochs=3, lr=1e-3, progress=False), evaluate=lambda m: {"score": 1.0},
            metric="score", out_dir=tmp_path)
    what = "the gradient norm is inf (first non-finite gradient: w)" if grad else "the training loss is nan"
    assert f"step 6: {what}" in str(stopped.value) and "the best epoch so far, 1, is in" in str(stopped.value)
    saved = torch.load(tmp_path / "w.pt")["w"]
    assert torch.isfinite(saved).all() and torch.isfinite(model.w).all()  # the step was never taken


# ----------------------------------------------------------------------------------------- bounded sizes
def test_sizes_are_bounded_by_the_model_and_options_of_another_recipe_refused(work, tmp_path, capsys):
    out = tmp_path / "refused"
    for extra, message in (
            (["--recipe", "prefix", "--prefix-length", "100000"], "--prefix-length=100000 is out of "
             "range: it must be an int in [1, 64]"),
            (["--recipe", "adapter", "--adapter-size", "100000"], "--adapter-size=100000 is out of range: "
             "it must be an int in [1, 32]"),
            (["--recipe", "lora", "--lora-rank", "33"], "--lora-rank=33 is out of range"),
            (["--recipe", "lora", "--adapter-kind", "pfeiffer"], "--adapter-kind belongs to the adapter "
             "recipe; this run's recipe is lora"),
            (["--recipe", "adapter", "--lora-rank", "4"], "--lora-rank belongs to the lora recipe"),
            (["--prefix-length", "4"], "--prefix-length belongs to the prefix recipe; this run's "
             "recipe is full"),
            (["--recipe", "adapter", "--merge-lora"], "--merge-lora belongs to the lora recipe"),
            (["--max-length", "65"], "--max-length=65 is out of range: it must be an int in [3, 64]")):
        assert message in cli_error(capsys, *finetune_args(work, out, *extra)), extra
    assert "--layerdrop: must be in [0, 1)" in usage_error(capsys, *finetune_args(work, out, "--layerdrop", "1"))
    # a recipe's default the user never gave is cut to the model (the bottleneck 64 on this 32-wide base), and said
    assert run(*finetune_args(work, tmp_path / "a32", "--recipe", "adapter")) == 0
    assert "--adapter-size: the recipe's default 64 is more than this model's hidden size; using 32" in \
        capsys.readouterr().out
    assert json.loads((tmp_path / "a32" / "adapter.json").read_text())["options"]["bottleneck"] == 32
    assert not out.exists()  # each refused before any work


def test_module_cost_counts_what_add_adapter_builds_and_big_choices_are_said(monkeypatch):
    from minibert import hardware
    from minibert.config import BertConfig
    from minibert.models import BertModel
    from minibert.training.adapters import add_adapter, check_module_cost, module_cost

    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    for kind, options, sizes in (("houlsby", {"bottleneck": 8}, {"bottleneck": 8}),
                                 ("pfeiffer", {"bottleneck": 5}, {"bottleneck": 5}),
                                 ("prefix", {"prefix_length": 7, "prefix_bottleneck": 16},
                                  {"prefix_length": 7, "prefix_bottleneck": 16})):
        model = BertModel(config)
        add_adapter(model, "t", kind, **options)
        built = sum(p.numel() for p in model.task_modules.tasks["t"].parameters())
        assert module_cost(config, kind, **sizes)[0] == built, kind
    model = BertModel(config)
    add_adapter(model, "t", "lora", r=4, targets=("query", "value"))
    assert module_cost(config, "lora", r=4, targets=2)[0] >= sum(p.numel() for p in model.task_modules.parameters())
    base = BertConfig()  # BERT-base: a prefix of 512 keys on a batch of 32 x 512 is tens of GiB of scores
    with pytest.warns(UserWarning, match=r"--recipe prefix: a prefix module of [\d,]+ parameters .* takes about"):
        check_module_cost(base, "prefix", what="--recipe prefix", prefix_length=64, batch_size=32, max_length=512)
    monkeypatch.setattr(hardware, "memory_bytes", lambda: 2**30)
    with pytest.raises(InputError, match=r"more than this machine's 1.0 GiB"):
        check_module_cost(base, "prefix", what="--recipe prefix", prefix_length=512, batch_size=32, max_length=512)


def test_a_model_from_scratch_that_cannot_fit_is_refused_before_any_work(work, tmp_path, capsys, monkeypatch):
    from minibert import hardware

    monkeypatch.setattr(hardware, "memory_bytes", lambda: 2**30)
    out = tmp_path / "huge"
    line = cli_error(capsys, "pretrain", "--corpus", work / "corpus.txt", "--out", out, "--geometry", "base",
                     "--vocab", work / "base", "--steps", "1")
    assert "a 12 x 768 model from scratch has" in line and "more than this machine's 1.0 GiB" in line
    assert not out.exists()


# ---------------------------------------------------------------------------- task modules and their base
def _module(work, tmp_path, kind="prefix"):
    from minibert.models.heads import BertForSequenceClassification
    from minibert.training.adapters import add_adapter, save_adapter

    model = BertForSequenceClassification.from_encoder(work / "base", labels=["neg", "pos"], seed=0)
    options = {"prefix": {"prefix_length": 3}, "houlsby": {"bottleneck": 6}}[kind]
    add_adapter(model, "trec", kind, **options)
    save_adapter(model, "trec", tmp_path / kind)
    return tmp_path / kind


def test_a_module_is_checked_against_the_bases_config_and_its_own_weights_file(work, tmp_path):
    from minibert.models import BertModel
    from minibert.training.adapters import CONFIG_FILE, load_adapter, task_head

    folder = _module(work, tmp_path)
    heads4 = BertModel.from_pretrained(work / "base")
    fewer = tmp_path / "base-2-heads"  # the same tensors, a config that splits them into 2 heads
    shutil.copytree(work / "base", fewer)
    config = json.loads((fewer / "config.json").read_text())
    (fewer / "config.json").write_text(json.dumps({**config, "num_attention_heads": 2}))
    with pytest.raises(InputError, match=r"another config \(num_attention_heads 4 then, 2 now\)") as refused:
        load_adapter(BertModel.from_pretrained(fewer), folder)
    assert "load it on the base it was trained on" in str(refused.value)
    assert "--model the base" in refused.value.for_shell() and "load it on" not in refused.value.for_shell()
    record = json.loads((folder / CONFIG_FILE).read_text())
    for key, value, said in ((("hidden_size",), 48, "hidden_size 32 then, 48 now"),
                             (("head", "class"), "BertForTokenClassification",
                              "head.class is 'BertForTokenClassification' there, 'BertForSequenceClassification' in"),
                             (("options", "prefix_length"), 5, "options.prefix_length is 5 there, 3 in")):
        edited = json.loads(json.dumps(record))
        target = edited
        for k in key[:-1]:
            target = target[k]
        target[key[-1]] = value
        if key == ("hidden_size",):
            edited["base_config"]["hidden_size"] = value
        (folder / CONFIG_FILE).write_text(json.dumps(edited))
        with pytest.raises(InputError) as refused:
            task_head(heads4, folder)
        assert said in str(refused.value) or "edited after saving" in str(refused.value), (key, str(refused.value))
    (folder / CONFIG_FILE).write_text(json.dumps(record))
    assert task_head(heads4, folder).config.id2label == {0: "neg", 1: "pos"}  # as saved: loads


def test_a_module_whose_shapes_do_not_fit_names_the_tensor_and_both_shapes(work, tmp_path):
    from safetensors.torch import load_file, save_file

    from minibert.models import BertModel
    from minibert.training.adapters import CONFIG_FILE, WEIGHTS_FILE, load_adapter

    folder = _module(work, tmp_path, "houlsby")
    tensors = load_file(folder / WEIGHTS_FILE)
    save_file(tensors, str(folder / WEIGHTS_FILE))  # as a module saved before the metadata: no seal to compare
    record = json.loads((folder / CONFIG_FILE).read_text())
    record["options"]["bottleneck"] = 5
    (folder / CONFIG_FILE).write_text(json.dumps(record))
    base = BertModel.from_pretrained(work / "base")
    with pytest.raises(InputError, match=r"the houlsby module does not fit \(attn\.0\.down\.bias: saved \(6,\), this "
                                         r"model needs \(5,\); attn\.0\.down\.weight: saved \(6, 32\), this model needs "
                                         r"\(5, 32\)"):
        load_adapter(base, folder)
    assert not hasattr(base, "task_modules") or not list(base.task_modules.tasks)  # nothing added half-way


def test_predict_speaks_in_flags_and_names_modules_by_folder_when_their_names_collide(finished, tmp_path, capsys):
    work = finished
    (tmp_path / "texts.txt").write_text("the day was good\nthe day was bad\n")
    twin = tmp_path / "runB"  # another run's module saved under the same name (runA/adapter, runB/adapter)
    (twin).mkdir()
    shutil.copytree(work / "adapter", twin / "adapter")
    capsys.readouterr()
    assert run("predict", work / "adapter", twin / "adapter", tmp_path / "texts.txt") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines] == [str(work / "adapter")] * 2 + [str(twin / "adapter")] * 2
    other = tmp_path / "other-base"
    shutil.copytree(work / "base", other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(other / "model.safetensors")
    tensors = {k: v + 1e-3 if k.endswith("dense.weight") else v for k, v in tensors.items()}
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    line = cli_error(capsys, "predict", work / "adapter", tmp_path / "texts.txt", "--model", other)
    assert "trained on another base" in line and "--skip-base-check" in line and "check_base" not in line
    assert run("predict", work / "adapter", tmp_path / "texts.txt", "--model", other, "--skip-base-check") == 0


# ------------------------------------------------------------------------------ Ctrl-C, and checks up front
def test_ctrl_c_says_where_the_run_can_resume_from(work, tmp_path):
    out = tmp_path / "long"
    args = [sys.executable, "-m", "minibert", *pretrain_args(work, out, "--steps", "100000", "--save-every", "1")]
    # Ctrl-C as a terminal sends it: a shell that starts the tests in the background (`cmd &`) ignores SIGINT,
    # and a child inherits that (the run would train on, orphaned), so the child gets the default back
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not list((out / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # never left running
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    assert "minibert: interrupted: " in err and "can be resumed from step" in err and "with --resume" in err
    assert json.loads((out / ".minibert-run.json").read_text())["status"] == "interrupted"
    assert not (out / ".minibert.lock").exists()


def test_arguments_and_files_are_checked_before_anything_is_created(work, tmp_path, capsys):
    out = tmp_path / "early"
    assert "--seed: must be in [0, 2**32 - 1], got -5" in usage_error(capsys, *pretrain_args(work, out, "--seed", "-5"))
    assert "--dropout: must be in [0, 1), got 1.5" in usage_error(capsys, *pretrain_args(work, out, "--dropout", "1.5"))
    assert "--max-length: must be >= 3" in usage_error(capsys, *pretrain_args(work, out, "--max-length", "2"))
    assert "must be an int in [5, " in cli_error(capsys, *pretrain_args(work, out, "--steps", "2", "--nsp",
                                                                         "--max-length", "4"))
    missing = cli_error(capsys, "pretrain", "--corpus", work / "corpus.txt", tmp_path / "second.txt", "--out", out,
                        "--blocks", "1", "--hidden", "32", "--vocab", work / "base", "--steps", "2")
    assert "corpus file" in missing and "second.txt' not found" in missing
    assert "--temperature and --alpha go with --teacher" in cli_error(
        capsys, *pretrain_args(work, out, "--steps", "2", "--alpha", "0.3"))
    assert "not found" in cli_error(capsys, *pretrain_args(work, out, "--steps", "2", "--eval-every", "1", "--eval-texts",
                                                            tmp_path / "held.txt"))
    study = ["depth-study", "--corpus", work / "corpus.txt", "--vocab", work / "base", "--eval-texts", work / "held.txt",
             "--out", out, "--quick"]
    assert "--device 'gpu0' is not a device" in cli_error(capsys, *study, "--device", "gpu0")
    assert "--seeds: '0,-1': every value must be >= 0" in usage_error(capsys, *study, "--seeds", "0,-1")
    assert "--conllu file" in cli_error(capsys, *study, "--conllu", tmp_path / "missing.conllu")
    assert not out.exists()


def test_the_output_rule_unit(tmp_path, monkeypatch):
    from minibert.outputs import LOCK_FILE, RunFolder, check_not_reading, describe

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    check_not_reading(tmp_path / "elsewhere", {"--model": model / "model.safetensors", "--teacher": "bert-base-uncased"})
    with pytest.raises(InputError, match="sits inside the model folder --model reads"):
        check_not_reading(model / "sub" / "x.npy", {"--model": model / "model.safetensors"})
    assert describe(model) == ("2 file(s) no minibert run wrote (config.json, model.safetensors)", False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="is the working directory, an ancestor of it"):
        RunFolder(tmp_path, command="pretrain", overwrite=True)
    folder = RunFolder(tmp_path / "new", command="pretrain")
    assert not (tmp_path / "new").exists()  # checking creates nothing
    with pytest.raises(RuntimeError):
        with folder.claim({"a": 1}):
            raise RuntimeError("failed before writing anything")
    assert not (tmp_path / "new").exists()  # a run that wrote nothing leaves nothing
    with folder.claim({"a": 1}):
        assert (tmp_path / "new" / LOCK_FILE).exists()
        (tmp_path / "new" / "out.txt").write_text("x")
    assert not (tmp_path / "new" / LOCK_FILE).exists()
    assert json.loads((tmp_path / "new" / ".minibert-run.json").read_text())["status"] == "finished"


# ------------------------------------------------------------------------------ issue 61: items 3 and 4
def test_resume_refuses_a_changed_input_naming_the_file(tmp_path):
    from minibert.outputs import Read, RunFolder

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one line\n", encoding="utf-8")
    reads = {"--corpus": Read("read", (str(corpus),))}
    with pytest.raises(KeyboardInterrupt):
        with RunFolder(tmp_path / "run", command="pretrain", reads=reads).claim({"a": 1}) as run:
            (run.real / "step.txt").write_text("1")
            raise KeyboardInterrupt
    record = json.loads((tmp_path / "run" / ".minibert-run.json").read_text())
    assert record["status"] == "interrupted" and str(corpus.resolve()) in record["inputs"]
    with RunFolder(tmp_path / "run", command="pretrain", reads=reads, resume=True).claim({"a": 1}) as run:
        assert run.state == "resume"  # unchanged: it goes on
    record["status"] = "interrupted"  # again unfinished, then the corpus edited by one line
    (tmp_path / "run" / ".minibert-run.json").write_text(json.dumps(record))
    corpus.write_text("one line, edited\n", encoding="utf-8")
    kept = snapshot(tmp_path / "run")
    with pytest.raises(InputError, match=r"--resume: .*has changed since it started \(.*corpus.txt changed \(size 9 -> "
                                         r"17 bytes"):
        with RunFolder(tmp_path / "run", command="pretrain", reads=reads, resume=True).claim({"a": 1}):
            pass
    assert snapshot(tmp_path / "run") == kept


@pytest.mark.parametrize("lr", ["inf", "nan", "1e38", "-1", "0"])
def test_a_learning_rate_must_be_finite_positive_and_bounded(work, tmp_path, capsys, lr):
    for argv in (pretrain_args(work, tmp_path / "p", "--steps", "2", "--lr", lr),
                 finetune_args(work, tmp_path / "f", "--lr", lr)):
        line = usage_error(capsys, *argv)
        assert "--lr" in line and ("finite" in line or "in (0, 1e+06]" in line or "(0, 1000000]" in line), line
    assert not (tmp_path / "p").exists() and not (tmp_path / "f").exists()
    from minibert.runs.settings import FinetuneRun

    with pytest.raises(InputError, match="--lr"):
        FinetuneRun(train="t", eval="e", out="o", lr=float(lr)).check()


def test_a_checkpoint_holding_nan_is_never_written(work, tmp_path):
    from minibert import BertModel, CheckpointError

    model = BertModel.from_pretrained(work / "base")
    model.save_pretrained(tmp_path / "good")
    kept = snapshot(tmp_path / "good")
    with torch.no_grad():
        model.embeddings.word.weight[3, 0] = float("nan")
    for where in (tmp_path / "good", tmp_path / "new"):
        with pytest.raises(CheckpointError, match="not saved: 1 tensor.*1 of .* values.*Nothing was written"):
            model.save_pretrained(where)
    assert snapshot(tmp_path / "good") == kept and not (tmp_path / "new").exists()


@pytest.mark.parametrize("recipe", ["lora", "adapter", "prefix"])
def test_task_modules_on_a_base_without_a_pooler_save_it_and_predict(finished, tmp_path, capsys, recipe):
    """Every pretrain output is a masked LM with no pooler: a task module trained on it carries the pooler it
    trained, its fingerprint is the base's (byte-identical on disk), and predict runs on that base."""
    from safetensors.torch import load_file

    from minibert import BertModel
    from minibert.training.adapters import task_head

    base = finished / "p1"
    assert BertModel.from_pretrained(base).pooler is None
    out = tmp_path / recipe
    assert run(*finetune_args(finished, out, "--recipe", recipe, model=base)) == 0
    assert "has no pooler" in capsys.readouterr().err
    assert {"task.pooler.weight", "task.pooler.bias"} <= set(load_file(out / "adapter.safetensors"))
    assert json.loads((out / "adapter.json").read_text())["options"]["pooler"] is True
    capsys.readouterr()
    assert run("predict", out, finished / "held.txt") == 0  # no "trained on another base", no TypeError
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 20 and all(line.split("\t")[0] in ("pos", "neg") for line in lines)
    head = task_head(BertModel.from_pretrained(base), out).eval()  # the Python route: the same pooler used
    trained = load_file(out / "adapter.safetensors")["task.pooler.weight"]
    assert torch.equal(head.bert.task_modules.tasks[head.task_name].pooler.weight.detach(), trained)


def test_a_killed_run_is_replaced_whole_by_overwrite_and_a_file_added_later_stops_it(tmp_path):
    """The record lists what the run wrote at each checkpoint (``account_for``): a run killed after one is
    replaced by --overwrite; a file put there afterwards is the user's and stops it."""
    from minibert.outputs import RunFolder

    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from minibert.outputs import RunFolder, account_for
        with RunFolder({str(tmp_path / "run")!r}, command="pretrain").claim({{"a": 1}}) as run:
            (run.real / "checkpoints").mkdir()
            (run.real / "checkpoints" / "state.pt").write_bytes(b"x" * 10)
            account_for(run.real / "checkpoints" / "state.pt")
            os._exit(9)  # killed: nothing after this runs
    """)
    assert subprocess.run([sys.executable, "-c", script], timeout=120).returncode == 9
    record = json.loads((tmp_path / "run" / ".minibert-run.json").read_text())
    assert record["status"] == "running" and record["files"] == ["checkpoints/state.pt"]
    (tmp_path / "run" / "mine.txt").write_text("notes")
    with pytest.raises(InputError, match=r"1 file\(s\) its record does not account for \(mine.txt\)"):
        RunFolder(tmp_path / "run", command="pretrain", overwrite=True)
    (tmp_path / "run" / "mine.txt").unlink()
    with RunFolder(tmp_path / "run", command="pretrain", overwrite=True).claim({"a": 2}) as run:
        assert run.state == "overwrite" and not (run.real / "checkpoints").exists()
