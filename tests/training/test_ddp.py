"""torchrun data parallelism (minibert/training/ddp.py): N processes with batch b train the weights that one
process with batch N x b trains."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import hf_config, random_hf_model
from minibert import InputError


def test_torchrun_two_processes_equal_one_with_the_doubled_batch(tmp_path, minilm_dir):
    """gloo on CPU, 2 processes x batch 4 == 1 process x batch 8, to 1e-5 after 4 optimiser steps."""
    from safetensors.torch import load_file

    tiny = tmp_path / "tiny"
    config = hf_config(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    random_hf_model(config, seed=3).save_pretrained(tiny)
    shutil.copy(minilm_dir / "vocab.txt", tiny / "vocab.txt")
    rows = [(f"the day was {w} and {x}", "pos" if w in ("good", "nice") else "neg")
            for w in ("good", "bad", "nice", "awful") for x in ("hot", "cold", "long", "short", "odd")][:15]
    (tmp_path / "train.csv").write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows), encoding="utf-8")
    common = ["finetune", "--train", str(tmp_path / "train.csv"), "--eval", str(tmp_path / "train.csv"),
              "--model", str(tiny), "--epochs", "2", "--lr", "1e-3", "--seed", "0", "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    from minibert.cli import main  # one process: this one (one thread, as the suite runs), no interpreter to start

    assert main([*common, "--out", str(tmp_path / "one"), "--batch-size", "8"]) == 0
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "minibert", *common, "--out", str(tmp_path / "two"), "--batch-size", "4"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    start = load_file(tiny / "model.safetensors")
    moved = max(float((a["bert." + k] - start[k]).abs().max()) for k in start if "bert." + k in a)
    assert moved > 1e-3  # training did change the weights (15 rows, batches of 8: 2 steps an epoch, 7+8 rows)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    # a task module (issue 33): only the adapter and the head train, and they agree too
    runs = {}
    adapter = [*common, "--recipe", "adapter", "--adapter-size", "8"]
    assert main([*adapter, "--out", str(tmp_path / "one-adapter"), "--batch-size", "8"]) == 0
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "minibert", *adapter, "--out", str(tmp_path / "two-adapter"), "--batch-size", "4"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("one-adapter", "two-adapter"):
        runs[name] = load_file(tmp_path / name / "adapter.safetensors")
    a, b = runs["one-adapter"], runs["two-adapter"]
    assert a.keys() == b.keys() and any(k.startswith("task.") for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    with pytest.raises(InputError, match="gradual recipe"):
        from minibert.training import ddp

        ddp.check_recipe("gradual")
