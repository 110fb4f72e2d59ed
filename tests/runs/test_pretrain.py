"""minibert/runs/pretrain.py: `minibert pretrain` from scratch and continued, snapshots and `minibert probe-over-
time`, CUDA when there is one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import cli_error, usage_error
from minibert import BertForMaskedLM, BertModel, BertTokenizer, InputError


def test_cli_pretrains_from_scratch_and_fill_reads_the_result(corpus, minilm_dir, tmp_path, capsys):
    from minibert.cli import main

    assert main(["pretrain", "--corpus", str(corpus / "train.txt"), "--out", str(tmp_path / "run"), "--geometry",
                 "tiny", "--vocab", str(minilm_dir), "--max-length", "32", "--steps", "6", "--batch-size", "8",
                 "--eval-texts", str(corpus / "held.txt"), "--eval-every", "3", "--log-every", "3", "--save-every", "3",
                 "--device", "cpu", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "pre-trained 6 steps" in printed and "perplexity" in printed
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [3, 6] and all("masked_accuracy" in r for r in log)
    assert main(["fill", "The bank raised its [MASK] rates.", "--model", str(tmp_path / "run"), "--top-k", "3"]) == 0
    filled = capsys.readouterr().out
    assert "[MASK] #1:" in filled and filled.count(",") >= 2  # the top 3 candidates from the new head
    student = ["pretrain", "--corpus", str(corpus / "train.txt"), "--out", str(tmp_path / "student"), "--blocks", "1",
               "--hidden", "128", "--heads", "2", "--vocab", str(minilm_dir), "--max-length", "32", "--steps", "3",
               "--batch-size", "8", "--teacher", str(tmp_path / "run"), "--alpha", "0.7", "--quiet"]
    assert main(student) == 0 and "pre-trained 3 steps" in capsys.readouterr().out  # distilled from the tiny run
    saved = BertForMaskedLM.from_pretrained(tmp_path / "student")
    assert saved.config.num_hidden_layers == 1 and not any(k.startswith("teacher") for k in saved.state_dict())
    assert "leave out --nsp" in cli_error(capsys, *student[:4], str(tmp_path / "s2"), *student[5:], "--nsp")
    assert "--alpha: must be in [0, 1], got 1.5" in usage_error(capsys, *student[:4], str(tmp_path / "s2"),
                                                                *student[5:-3], "--alpha", "1.5", "--quiet")
    assert not (tmp_path / "s2").exists()  # refused before any work
    base = ["pretrain", "--corpus", str(corpus / "train.txt"), "--out", str(tmp_path / "bad"), "--steps", "2", "--quiet"]
    for extra, message in ((["--blocks", "2", "--hidden", "100", "--heads", "3", "--vocab", str(minilm_dir)],
                            "--hidden 100 is not divisible by --heads 3"),
                           (["--geometry", "tiny"], "give --vocab FOLDER"),
                           (["--model", str(minilm_dir), "--geometry", "tiny"], "leave out --geometry"),
                           (["--model", str(minilm_dir), "--untied"], "--untied makes a new decoder from scratch"),
                           (["--geometry", "tiny", "--vocab", str(minilm_dir), "--eval-every", "2"], "--eval-every needs --eval-texts"),
                           (["--geometry", "tiny", "--vocab", str(minilm_dir), "--fp16"], "--fp16 needs a CUDA device"),
                           (["--geometry", "tiny", "--vocab", str(minilm_dir), "--device", "gpu0"],
                            "--device 'gpu0' is not a device: use cpu, cuda or cuda:N"),
                           (["--geometry", "tiny", "--vocab", str(minilm_dir), "--device", "meta"],
                            "--device 'meta': minibert trains on cpu or cuda")):
        assert message in cli_error(capsys, *base, *extra)
    if not torch.cuda.is_available():
        assert "PyTorch sees no CUDA device" in cli_error(capsys, *base, "--geometry", "tiny", "--vocab", minilm_dir,
                                                          "--device", "cuda")
    assert not (tmp_path / "bad").exists()  # each refused before any work
    line = cli_error(capsys, "pretrain", "--corpus", str(corpus / "train.txt"), "--out", str(tmp_path / "run"),
                     "--blocks", "2", "--hidden", "64", "--vocab", str(minilm_dir), "--max-length", "32", "--steps", "6",
                     "--batch-size", "8", "--save-every", "3", "--resume", "--quiet")
    assert "--resume:" in line and "hidden=128 then, 64 now" in line  # the setting named; nothing trained or mixed


def test_continuing_an_untied_run_keeps_and_trains_its_own_decoder(corpus, minilm_dir, tmp_path):
    """--model on an --untied run's folder (bench_pretrain's ``longer`` part): the continued model is still
    untied, and the steps train its decoder apart from the word embeddings."""
    from safetensors.torch import load_file

    from minibert.cli import main

    common = ["--corpus", str(corpus / "train.txt"), "--max-length", "24", "--steps", "3", "--batch-size", "4",
              "--lr", "2e-3", "--quiet"]
    assert main(["pretrain", *common, "--out", str(tmp_path / "first"), "--blocks", "1", "--hidden", "32", "--heads",
                 "2", "--intermediate", "64", "--vocab", str(minilm_dir), "--untied"]) == 0
    assert main(["pretrain", *common, "--out", str(tmp_path / "more"), "--model", str(tmp_path / "first"),
                 "--seed", "1"]) == 0
    assert json.loads((tmp_path / "more" / "config.json").read_text())["tie_word_embeddings"] is False
    first, more = (load_file(tmp_path / name / "model.safetensors") for name in ("first", "more"))
    decoder, embeddings = "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"
    assert (more[decoder] - first[decoder]).abs().max() > 1e-4  # the continued steps trained it
    assert not torch.equal(more[decoder], more[embeddings])
    assert type(BertForMaskedLM.from_pretrained(tmp_path / "more").bert.mlm_head).__name__ == "UntiedMaskedLMHead"


def test_snapshots_at_log_spaced_steps_and_probing_across_time(corpus, minilm_dir, tmp_path, capsys):
    """--snapshots keeps step 0 (the initialisation, bit for bit) and log-spaced steps up to the last (the
    final model, bit for bit), each loadable alone; probe-over-time probes every layer of each and measures
    each layer's CKA against the next and the last snapshot."""
    from safetensors.torch import load_file

    from conftest import POS_SAMPLE
    from minibert.analysis.timeline import probe_over_time, snapshots
    from minibert.cli import main
    from minibert.textfiles import read_conllu
    from minibert.training.pretrain import snapshot_steps

    assert snapshot_steps(1000, 4) == [0, 1, 10, 100, 1000] and snapshot_steps(3, 8) == [0, 1, 2, 3]
    assert snapshot_steps(16, 4) == [0, 1, 3, 6, 16] and snapshot_steps(16, 0) == [] and snapshot_steps(7, 1) == [0, 7]
    run = tmp_path / "run"
    assert main(["pretrain", "--corpus", str(corpus / "train.txt"), "--out", str(run), "--blocks", "2", "--hidden", "64",
                 "--heads", "4", "--vocab", str(minilm_dir), "--max-length", "32", "--steps", "16", "--batch-size", "8",
                 "--lr", "2e-3", "--snapshots", "4", "--quiet"]) == 0
    found = snapshots(run)
    assert [step for step, _ in found] == [0, 1, 3, 6, 16]
    BertForMaskedLM.from_config(BertModel.from_pretrained(run).config, seed=0).save_pretrained(tmp_path / "init")
    for one, other in ((found[0][1], tmp_path / "init"), (found[-1][1], run)):
        a, b = load_file(one / "model.safetensors"), load_file(other / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert BertTokenizer.from_pretrained(found[2][1]).vocab == BertTokenizer.from_pretrained(minilm_dir).vocab

    sample = tmp_path / "pos.conllu"  # 40 sentences of the UPOS sample
    sample.write_text("\n\n".join(POS_SAMPLE.read_text(encoding="utf-8").strip().split("\n\n")[:40]) + "\n\n")
    assert main(["probe-over-time", str(run), str(sample), "--json", str(tmp_path / "t.json"), "--quiet"]) == 0
    assert "linear CKA with the next snapshot" in capsys.readouterr().out
    timeline = json.loads((tmp_path / "t.json").read_text())
    assert timeline["steps"] == [0, 1, 3, 6, 16] and len(timeline["accuracy"]) == 5 and len(timeline["accuracy"][0]) == 3
    assert len(timeline["cka_next"]) == 4 and all(abs(c - 1) < 1e-9 for c in timeline["cka_final"][-1])
    assert all(0 <= a <= 1 for row in timeline["accuracy"] for a in row) and 0 < timeline["majority_baseline"] < 1
    assert max(abs(c - 1) for c in timeline["cka_final"][0]) > 1e-3  # training moved the representations
    assert len(timeline["first_step_at_90_percent"]) == 3 and len(timeline["selectivity"]) == 5
    with pytest.raises(InputError, match="at least 2 snapshots"):
        probe_over_time([(0, found[0][1])], read_conllu(sample))
    line = cli_error(capsys, "probe-over-time", str(tmp_path / "init"), str(sample))
    assert "at least 2 snapshots" in line and "--snapshots" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on a GPU machine)")
def test_pretraining_and_finetuning_on_cuda(corpus, minilm_dir, tmp_path):
    """--device cuda: the same run as on the CPU (same init, data and masks) reaches the same losses within
    fp32 reduction-order noise; fp16 with loss scaling and bf16 train; the checkpoints load on the CPU; a
    classifier fine-tunes there too."""
    from minibert.cli import main
    from minibert.models.heads import BertForSequenceClassification

    common = ["pretrain", "--corpus", str(corpus / "train.txt"), "--vocab", str(minilm_dir), "--blocks", "2",
              "--hidden", "64", "--heads", "2", "--max-length", "32", "--steps", "8", "--batch-size", "8",
              "--log-every", "2", "--dropout", "0", "--quiet"]
    for name, extra in (("cpu", ["--device", "cpu"]), ("cuda", ["--device", "cuda"]),
                        ("fp16", ["--device", "cuda", "--fp16"]), ("bf16", ["--device", "cuda:0", "--bf16"])):
        assert main([*common, "--out", str(tmp_path / name), *extra]) == 0
    losses = {name: [r["loss"] for r in map(json.loads, (tmp_path / name / "log.jsonl").read_text().splitlines())]
              for name in ("cpu", "cuda", "fp16", "bf16")}
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3)
    for half in ("fp16", "bf16"):
        assert all(math.isfinite(x) for x in losses[half])
        assert losses[half] == pytest.approx(losses["cpu"], rel=0.05)
    model = BertForMaskedLM.from_pretrained(tmp_path / "fp16")
    assert next(model.parameters()).device.type == "cpu"
    labelled = tmp_path / "labelled.csv"
    rows = [f"{t},{'yes' if i % 2 else 'no'}" for i, t in enumerate(["a good day", "a bad day", "fine work", "poor work"] * 4)]
    labelled.write_text("text,label\n" + "\n".join(rows) + "\n", encoding="utf-8")
    assert main(["finetune", "--model", str(tmp_path / "cuda"), "--train", str(labelled), "--eval", str(labelled),
                 "--out", str(tmp_path / "classifier"), "--epochs", "1", "--device", "cuda", "--quiet"]) == 0
    classifier = BertForSequenceClassification.from_pretrained(tmp_path / "classifier")
    assert next(classifier.parameters()).device.type == "cpu" and classifier.config.num_labels == 2
