"""minibert/training/pretrain.py: one step equal to transformers', a SIGKILLed run resumed bit for bit, torchrun
equal to one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch

from conftest import pretraining_batch as _batch, transformers
from minibert import BertForMaskedLM, BertForPreTraining, BertModel


def test_one_pretraining_step_equals_transformers(pretraining_dir):
    """MLM + NSP, the same weights, batch and masks, dropout off: loss, gradients and the weights after one
    AdamW step within 1e-5 of transformers' BertForPreTraining."""
    batch, labels, nsl = _batch(seed=5)
    ours = BertForPreTraining.from_pretrained(pretraining_dir).train()
    theirs = transformers.BertForPreTraining.from_pretrained(pretraining_dir).train()
    from minibert.training.loop import parameter_groups

    opt_a = torch.optim.AdamW(parameter_groups(ours, lr=1e-3), lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    decay = [p for n, p in theirs.named_parameters() if not n.endswith("bias") and "LayerNorm" not in n]
    rest = [p for n, p in theirs.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    opt_b = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                              lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    a = ours(**batch, labels=labels, next_sentence_label=nsl)
    b = theirs(**batch, labels=labels, next_sentence_label=nsl)
    assert abs(a.loss.item() - b.loss.item()) <= 1e-5
    a.loss.backward()
    b.loss.backward()
    grad_a = ours.bert.encoder.blocks[1].ffn.dense_in.weight.grad
    grad_b = theirs.bert.encoder.layer[1].intermediate.dense.weight.grad
    assert (grad_a - grad_b).abs().max() <= 1e-5
    assert (ours.bert.embeddings.word.weight.grad - theirs.bert.embeddings.word_embeddings.weight.grad).abs().max() <= 1e-5
    opt_a.step()
    opt_b.step()
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        ours.save_pretrained(folder)
        after = transformers.BertForPreTraining.from_pretrained(folder).state_dict()
    expected = theirs.state_dict()
    assert max(float((after[k] - expected[k]).abs().max()) for k in expected if k in after) <= 1e-5


RUN = """
import os, signal, sys, torch
from minibert import BertTokenizer
from minibert.runs.pretrain import run_pretraining
from minibert.runs.settings import PretrainRun
corpus, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "kill":
    import minibert.training.pretrain as P
    real = P._save_checkpoint
    def save_then_die(out_dir, state, *rest):
        folder = real(out_dir, state, *rest)
        if state.step == 6:
            os.kill(os.getpid(), signal.SIGKILL)  # after the second checkpoint, mid-run
        return folder
    P._save_checkpoint = save_then_die
run_pretraining(PretrainRun(corpus=[corpus], out=out, layers=2, hidden=32, heads=4, intermediate=64, vocab=sys.argv[4],
                            max_length=24, nsp=True, resume=mode == "resume", steps=10, batch_size=4, accumulate=2,
                            log_every=2, save_every=3, keep=2, lr=2e-3, progress=False))
"""


def test_a_killed_run_resumes_to_the_same_weights_bit_for_bit(corpus, minilm_dir, tmp_path):
    """From scratch with dropout on, NSP, accumulation and a schedule: killed by SIGKILL after step 6 and
    resumed from its newest checkpoint, the run ends with the uninterrupted run's weights, bit for bit."""
    from safetensors.torch import load_file

    env = dict(os.environ, OMP_NUM_THREADS="1")  # the same threads in every run: the same sums

    def start(mode, out):
        with open(tmp_path / f"{mode}.err", "w") as err:  # a file, not a pipe: nothing blocks on a full buffer
            return subprocess.Popen([sys.executable, "-c", RUN, str(corpus / "train.txt"), str(out), mode,
                                     str(minilm_dir)], stdout=subprocess.DEVNULL, stderr=err, env=env)

    def said(mode):
        return (tmp_path / f"{mode}.err").read_text()[-2000:]
    full, killed = start("full", tmp_path / "full"), start("kill", tmp_path / "cut")  # side by side: one core each
    assert full.wait(timeout=300) == 0, said("full")
    assert killed.wait(timeout=300) == -signal.SIGKILL, said("kill")
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-000003", "step-000006"]
    assert start("resume", tmp_path / "cut").wait(timeout=300) == 0, said("resume")
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(x)["loss"] for x in (tmp_path / d / "log.jsonl").read_text().splitlines()]
              for d in ("full", "cut")]
    assert losses[0] == losses[1] and len(losses[0]) == 5  # the log holds each step once, resumed or not
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-000009", "step-000010"]


def test_torchrun_two_processes_equal_one(corpus, minilm_dir, tmp_path):
    """gloo on CPU: 2 processes at the same global batch (each reading and masking its half) train the
    weights one process trains, within 1e-5 after 4 steps (dropout off)."""
    from safetensors.torch import load_file

    common = ["pretrain", "--corpus", str(corpus / "train.txt"), "--blocks", "2", "--hidden", "32", "--heads", "4",
              "--vocab", str(minilm_dir), "--max-length", "24", "--steps", "4", "--batch-size", "8", "--lr", "2e-3",
              "--dropout", "0", "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    from minibert.cli import main  # one process: this one (one thread, as the suite runs)

    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "minibert", *common, "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    BertForMaskedLM.from_config(BertModel.from_pretrained(tmp_path / "one").config, seed=0).save_pretrained(tmp_path / "init")
    start = load_file(tmp_path / "init" / "model.safetensors")  # the run's initialisation (seed 0)
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e-3  # the steps did train
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
