"""The depth study (runs/depth_study.py, ``minibert depth-study``): the plan's budgets, a tiny study end
to end (runs, measures, figures, study.json), picking up where it stopped, and its errors."""

from __future__ import annotations

import csv
import dataclasses
import json
import warnings

import pytest

from conftest import POS_SAMPLE, cli_error
from minibert import InputError
from minibert.runs.depth_study import (DepthStudyConfig, bert_config, plan, plot_study, run_study, study_config,
                                      summary_rows)

TINY = DepthStudyConfig(depths=(1, 2), hidden=32, heads=2, intermediate=64, steps=4, reference_depth=2,
                        budgets=("steps",), seeds=(0, 1), batch_size=4, max_length=16, lr=2e-3, eval_examples=8, probe_sentences=6,
                        task_epochs=1)


@pytest.fixture(scope="module")
def files(tmp_path_factory, sentences_dir):
    folder = tmp_path_factory.mktemp("study-data")
    lines = [s for s in (sentences_dir / "train.txt").read_text(encoding="utf-8").split("\n") if s.strip()]
    (folder / "train.txt").write_text("\n".join(lines[:300]) + "\n", encoding="utf-8")
    held = [s for s in (sentences_dir / "held.txt").read_text(encoding="utf-8").split("\n") if s.strip()]
    (folder / "held.txt").write_text("\n".join(held[:40]) + "\n", encoding="utf-8")
    for name, part in (("task_train.csv", lines[300:360]), ("task_eval.csv", lines[360:390])):
        with open(folder / name, "w", newline="", encoding="utf-8") as f:  # a task: is there a "!" in it?
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows([text, "loud" if "!" in text else "calm"] for text in part)
    return folder


def test_the_plan_spends_equal_steps_or_equal_flops():
    from minibert.tools.accounting import pretraining_flops

    config = DepthStudyConfig()  # the full study: 1, 2, 4, 6, 8 blocks of 256
    runs = plan(config, 30522)
    steps = [r for r in runs if r.budget == "steps"]
    compute = [r for r in runs if r.budget == "compute"]
    assert [(r.depth, r.seed) for r in steps] == [(d, s) for s in (0, 1) for d in (1, 2, 4, 6, 8)]
    assert all(r.steps == 2000 for r in steps) and [r.depth for r in compute] == [1, 2, 4, 6, 8]
    budget = 2000 * pretraining_flops(bert_config(config, 4, 30522), 32, 128)
    for r in compute:  # the same FLOPs, within one step's worth; shallower models take more steps
        one = pretraining_flops(bert_config(config, r.depth, 30522), 32, 128)
        assert abs(r.flops - budget) <= one / 2 and r.flops == r.steps * one
    assert [r.steps for r in compute] == sorted((r.steps for r in compute), reverse=True)
    assert next(r for r in compute if r.depth == 4).steps == 2000
    # the masked-LM head at 15 % of the tokens: 3 x 0.15 x (2 H^2 + 2 H V) a token beside 3 x 2 x (block params)
    one_block = pretraining_flops(bert_config(config, 2, 30522), 1, 128) - pretraining_flops(bert_config(config, 1, 30522), 1, 128)
    assert one_block == 3 * 128 * (2 * (4 * (256 * 256 + 256) + 2 * 256 * 1024 + 1024 + 256 + 4 * 256) + 4 * 256 * 128)
    for bad, message in ((dict(depths=()), "depths"), (dict(depths=(2, 2)), "twice"), (dict(hidden=30), "divisible"),
                         (dict(budgets=("tokens",)), "budgets"), (dict(seeds=(1, 1)), "seeds")):
        with pytest.raises(InputError, match=message):
            plan(DepthStudyConfig(**bad), 30522)


def test_a_study_written_before_norms_and_warmups_reads_back_as_post_ln_at_its_warmup():
    config = DepthStudyConfig(depths=(1, 2), hidden=64, heads=2, intermediate=128, warmups=(0.1,))
    saved = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
    assert study_config({"config": saved}) == config
    del saved["norms"]
    saved["warmup"] = saved.pop("warmups")[0]  # the config of a study.json of 2026-12-04 and before
    assert study_config({"config": saved}) == config


def test_a_tiny_study_end_to_end_and_picked_up_where_it_stopped(files, minilm_dir, tmp_path, capsys):
    out = tmp_path / "study"
    results = run_study([files / "train.txt"], out, vocab=minilm_dir, eval_texts=files / "held.txt", config=TINY,
                        conllu=POS_SAMPLE)
    names = {"L1-steps-seed0", "L2-steps-seed0", "L1-steps-seed1", "L2-steps-seed1"}
    assert set(results["runs"]) == names and json.loads((out / "study.json").read_text())["runs"].keys() == names
    for name, run in results["runs"].items():
        assert (out / "runs" / name / "model.safetensors").exists() and run["eval_loss"] > 0
        assert len(run["probe_accuracy"]) == run["depth"] + 1 and "task_accuracy" not in run
    assert results["runs"]["L1-steps-seed0"]["eval_loss"] != results["runs"]["L1-steps-seed1"]["eval_loss"]
    assert set(results["speed"]) == {"L1-steps-seed0", "L2-steps-seed0"}
    rows = summary_rows(results)
    assert [(r["depth"], r["budget"], r["seeds"]) for r in rows] == [(1, "steps", 2), (2, "steps", 2)]
    low, high = rows[0]["eval_loss_range"]
    assert low <= rows[0]["eval_loss"] <= high and low < high

    model = out / "runs" / "L1-steps-seed0" / "model.safetensors"
    stamp = model.stat().st_mtime_ns
    again = run_study([files / "train.txt"], out, vocab=minilm_dir, eval_texts=files / "held.txt", config=TINY,
                      conllu=POS_SAMPLE)
    assert model.stat().st_mtime_ns == stamp and again["runs"] == results["runs"]  # nothing trained again
    saved = json.loads((out / "study.json").read_text())
    del saved["runs"]["L2-steps-seed1"]  # stopped after its training, before its measures
    (out / "study.json").write_text(json.dumps(saved))
    trained = out / "runs" / "L2-steps-seed1" / "model.safetensors"
    stamp = trained.stat().st_mtime_ns
    measured = run_study([files / "train.txt"], out, vocab=minilm_dir, eval_texts=files / "held.txt", config=TINY,
                         conllu=POS_SAMPLE)
    assert trained.stat().st_mtime_ns == stamp and measured["runs"] == results["runs"]
    with pytest.raises(InputError, match="other settings"):
        run_study([files / "train.txt"], out, vocab=minilm_dir, eval_texts=files / "held.txt",
                  config=DepthStudyConfig(**{**TINY.__dict__, "steps": 5}))


def test_the_cli_runs_a_study_and_draws_it(files, minilm_dir, tmp_path, capsys):
    from minibert.cli import main

    out = tmp_path / "cli-study"
    assert main(["depth-study", "--corpus", str(files / "train.txt"), "--vocab", str(minilm_dir), "--eval-texts",
                 str(files / "held.txt"), "--out", str(out), "--quick", "--depths", "1,2", "--hidden", "32",
                 "--intermediate", "64", "--steps", "3", "--seeds", "0", "--budgets", "compute", "--batch-size", "4",
                 "--max-length", "16", "--task-train", str(files / "task_train.csv"), "--task-eval",
                 str(files / "task_eval.csv"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "held-out loss" in printed and "depth_loss.png" in printed
    for name in ("depth_loss.png", "depth_downstream.png", "study.json"):
        assert (out / name).stat().st_size > 0
    assert not (out / "depth_probes.png").exists()  # no --conllu, no probe curves
    runs = json.loads((out / "study.json").read_text())["runs"]
    assert set(runs) == {"L1-compute-seed0", "L2-compute-seed0"} and all(0 <= r["task_accuracy"] <= 1 for r in runs.values())
    assert runs["L1-compute-seed0"]["steps"] >= runs["L2-compute-seed0"]["steps"] == 3  # the reference (--quick: 2)
    line = cli_error(capsys, "depth-study", "--corpus", str(files / "train.txt"), "--vocab", str(minilm_dir),
                     "--eval-texts", str(files / "held.txt"), "--out", str(out), "--quick", "--depths", "1,2", "--hidden",
                     "32", "--intermediate", "64", "--steps", "3", "--seeds", "0", "--budgets", "compute",
                     "--batch-size", "4", "--max-length", "16", "--cut-vs-grown", "--quiet")
    assert "cut vs grown needs the equal-steps budget and two or more depths" in line
    with pytest.raises(SystemExit):  # argparse's own error, with the usage
        main(["depth-study", "--corpus", "x", "--vocab", "v", "--eval-texts", "h", "--out", "o", "--depths", "1,b"])
    assert "argument --depths: '1,b': every item must be an int" in capsys.readouterr().err
    line = cli_error(capsys, "depth-study", "--corpus", str(files / "train.txt"), "--vocab", str(minilm_dir),
                     "--eval-texts", str(files / "held.txt"), "--out", str(tmp_path / "o"), "--quick", "--hidden", "33")
    assert "hidden=33 is not divisible by heads=2" in line


def test_cut_vs_grown_compares_the_deepest_model_cut_with_grown_and_distilled_ones(files, minilm_dir, tmp_path):
    import torch

    from minibert.models.pretraining import BertForMaskedLM
    from minibert.tokenizer import BertTokenizer
    from minibert.runs.depth_study import cut_vs_grown, plot_study
    from minibert.runs.pretrain import held_examples
    from minibert.training.pretrain import evaluate

    out = tmp_path / "study"
    config = DepthStudyConfig(**{**TINY.__dict__, "depths": (1, 3)})
    with pytest.raises(InputError, match="run the depth study first"):
        cut_vs_grown(out, [files / "train.txt"], vocab=minilm_dir, eval_texts=files / "held.txt")
    results = run_study([files / "train.txt"], out, vocab=minilm_dir, eval_texts=files / "held.txt", config=config,
                        conllu=POS_SAMPLE)
    entry = cut_vs_grown(out, [files / "train.txt"], vocab=minilm_dir, eval_texts=files / "held.txt",
                         conllu=POS_SAMPLE, task_train=files / "task_train.csv", task_eval=files / "task_eval.csv")
    assert entry["teacher"] == "L3-steps-seed0" and set(entry["depths"]) == {"1"}
    arms = entry["depths"]["1"]
    assert set(arms) == {"cut", "grown", "distilled"}
    grown = results["runs"]["L1-steps-seed0"]
    assert arms["grown"]["eval_loss"] == grown["eval_loss"] and arms["grown"]["probe_accuracy"] == grown["probe_accuracy"]
    assert 0 <= arms["cut"]["task_accuracy"] <= 1 and 0 <= arms["distilled"]["task_accuracy"] <= 1

    # every model is measured on the same held-out examples and masks, whatever its seed
    tokenizer = BertTokenizer.from_pretrained(minilm_dir)
    held = held_examples(files / "held.txt", tokenizer, tmp_path / "eval-store", max_length=config.max_length)
    count = min(config.eval_examples, held.per_epoch)
    for name in ("L1-steps-seed0", "L1-steps-seed1"):
        again = evaluate(BertForMaskedLM.from_pretrained(out / "runs" / name), held, count)
        assert again["eval_loss"] == pytest.approx(results["runs"][name]["eval_loss"], rel=1e-6)
    # the cut model is the deepest one's first block under its head: its states are the deep model's first two
    deep = BertForMaskedLM.from_pretrained(out / "runs" / "L3-steps-seed0").eval()
    cut = BertForMaskedLM.from_pretrained(out / "cut" / "L1").eval()
    ids = held.batch(range(2))["input_ids"]
    with torch.no_grad():
        states, cut_states = deep.bert(ids).hidden_states, cut.bert(ids).hidden_states
    assert len(cut_states) == 2 and all(torch.equal(a, b) for a, b in zip(cut_states, states[:2]))
    assert arms["cut"]["eval_loss"] == pytest.approx(evaluate(cut, held, count)["eval_loss"], rel=1e-6)
    assert arms["cut"]["probe_accuracy"] == pytest.approx(results["runs"]["L3-steps-seed0"]["probe_accuracy"][:2])
    distilled = BertForMaskedLM.from_pretrained(out / "distilled" / "L1")
    grown_model = BertForMaskedLM.from_pretrained(out / "runs" / "L1-steps-seed0")
    assert not torch.equal(distilled.bert.embeddings.word.weight,
                           grown_model.bert.embeddings.word.weight)
    assert arms["distilled"]["eval_loss"] != grown["eval_loss"]

    stamp = (out / "distilled" / "L1" / "model.safetensors").stat().st_mtime_ns
    again = cut_vs_grown(out, [files / "train.txt"], vocab=minilm_dir, eval_texts=files / "held.txt",
                         conllu=POS_SAMPLE, task_train=files / "task_train.csv", task_eval=files / "task_eval.csv")
    assert again == entry and (out / "distilled" / "L1" / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(InputError, match="temperature 2.0"):
        cut_vs_grown(out, [files / "train.txt"], vocab=minilm_dir, eval_texts=files / "held.txt", temperature=3.0)
    assert (out / "study_cut.png") in plot_study(json.loads((out / "study.json").read_text()), out, name="study")


def test_the_reference_depths_equal_compute_run_is_its_equal_steps_run_measured_once(files, minilm_dir, tmp_path):
    out = tmp_path / "study"
    config = DepthStudyConfig(**{**TINY.__dict__, "budgets": ("steps", "compute"), "seeds": (0,)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stuck run is the study's "stuck" measure, not a warning per run
        results = run_study([files / "train.txt"], out, vocab=minilm_dir, eval_texts=files / "held.txt",
                            config=config)
    assert all(r["stuck"] for r in results["runs"].values())  # 4 steps: nothing has left the plateau
    figures = plot_study(results, out)  # neither probe nor task: no downstream figure, an empty one was drawn
    assert figures[0].name == "depth_loss.png" and not (out / "depth_downstream.png").exists()
    assert "depth_downstream.png" not in {f.name for f in figures}
    steps, compute = results["runs"]["L2-steps-seed0"], results["runs"]["L2-compute-seed0"]
    assert compute["steps"] == steps["steps"] == 4 and compute["budget"] == "compute"
    assert {k: v for k, v in compute.items() if k != "budget"} == {k: v for k, v in steps.items() if k != "budget"}
    assert not (out / "runs" / "L2-compute-seed0").exists()  # not trained a second time
    for depth in (1, 2):  # a compute run is trained when, and only when, its steps differ from the steps run's
        differs = results["runs"][f"L{depth}-compute-seed0"]["steps"] != results["runs"][f"L{depth}-steps-seed0"]["steps"]
        assert (out / "runs" / f"L{depth}-compute-seed0").exists() == differs


def test_a_rerun_measures_new_files_and_refuses_changed_inputs_by_name(files, minilm_dir, tmp_path):
    """A finished study rerun with a probe or a task file it was not measured with measures it on every
    model (was: the stale table, probe and task nan); another held-out text, or other settings, are refused
    naming each one that differs (was: "other settings", unnamed)."""
    config = DepthStudyConfig(**{**TINY.__dict__, "seeds": (0,)})
    out = tmp_path / "study"
    common = dict(vocab=minilm_dir, eval_texts=files / "held.txt")
    first = run_study([files / "train.txt"], out, config=config, **common)
    assert all("probe_accuracy" not in r and "task_accuracy" not in r for r in first["runs"].values())
    model = out / "runs" / "L2-steps-seed0" / "model.safetensors"
    stamp = model.stat().st_mtime_ns
    probed = run_study([files / "train.txt"], out, config=config, conllu=POS_SAMPLE, **common)
    assert all(len(r["probe_accuracy"]) == r["depth"] + 1 for r in probed["runs"].values())
    tasked = run_study([files / "train.txt"], out, config=config, task_train=files / "task_train.csv",
                       task_eval=files / "task_eval.csv", **common)
    assert all(0 <= r["task_accuracy"] <= 1 and "probe_accuracy" in r for r in tasked["runs"].values())
    assert model.stat().st_mtime_ns == stamp  # measured, not trained again
    assert json.loads((out / "study.json").read_text())["runs"] == tasked["runs"]
    other = tmp_path / "other-held.txt"
    other.write_text("\n".join(files.joinpath("held.txt").read_text().splitlines()[:30]) + "\n")
    with pytest.raises(InputError, match="--eval-texts is not the file the study was measured with"):
        run_study([files / "train.txt"], out, config=config, vocab=minilm_dir, eval_texts=other)
    with pytest.raises(InputError, match=r"steps=4 then, 5 now; seeds=\[0\] then, \[0, 1\] now"):
        run_study([files / "train.txt"], out, config=DepthStudyConfig(**{**config.__dict__, "steps": 5, "seeds": (0, 1)}),
                  **common)
    assert model.stat().st_mtime_ns == stamp


def test_overwrite_starts_the_study_again(files, minilm_dir, tmp_path):
    config = DepthStudyConfig(**{**TINY.__dict__, "seeds": (0,), "depths": (1,)})
    out = tmp_path / "study"
    common = dict(vocab=minilm_dir, eval_texts=files / "held.txt")
    run_study([files / "train.txt"], out, config=config, **common)
    other = DepthStudyConfig(**{**config.__dict__, "steps": 3})
    again = run_study([files / "train.txt"], out, config=other, overwrite=True, **common)
    assert again["runs"]["L1-steps-seed0"]["steps"] == 3 and json.loads((out / "study.json").read_text())["config"]["steps"] == 3
    assert json.loads((out / "runs" / "L1-steps-seed0" / "pretrain.json").read_text())["steps"] == 3  # trained anew


def test_a_stability_grid_plans_every_norm_and_warmup_and_summarises_the_stuck_share():
    """--norms and --warmups: each placement and warmup a run of every depth and seed (BERT's post-LN at the
    default warmup keeps the old names); the rows give the share of seeds stuck on the unigram plateau."""
    from minibert.runs.depth_study import plan, summary_rows
    from minibert.runs.settings import DepthStudyConfig

    config = DepthStudyConfig(depths=(1, 2), hidden=32, heads=2, intermediate=64, steps=10, reference_depth=1,
                              budgets=("steps",), seeds=(0, 1), norms=("post", "pre"), warmups=(0.06, 0.2))
    runs = plan(config, 100)
    assert len(runs) == 2 * 2 * 2 * 2 and len({r.name for r in runs}) == len(runs)
    assert {"L1-steps-seed0", "L2-steps-seed1-pre", "L2-steps-seed0-pre-warmup0.2"} <= {r.name for r in runs}
    results = {"runs": {r.name: {**r.__dict__, "eval_loss": 7.0, "masked_accuracy": 0.05, "tokens": 1,
                                 "parameters": 1, "stuck": r.seed == 0 and r.norm == "post"} for r in runs}}
    rows = summary_rows(results)
    assert len(rows) == 8 and {(r["norm"], r["warmup"], r["stuck_share"]) for r in rows} == {
        ("post", 0.06, 0.5), ("post", 0.2, 0.5), ("pre", 0.06, 0.0), ("pre", 0.2, 0.0)}
    with pytest.raises(InputError, match="--norms post,sandwich: give one or more different placements"):
        DepthStudyConfig(norms=("post", "sandwich")).check()


def test_the_random_init_control_of_a_deepnorm_geometry_is_its_own_model_fine_tuned_without_warnings(
        files, minilm_dir, tmp_path):
    """random_control builds the geometry and placement it is given (seed 0: twice the same model), saves and
    loads it without the "read back by minibert only" warning, and fine-tunes it as the study's models are."""
    from minibert.config import BertConfig
    from minibert.models import BertModel
    from minibert.models.norms import norm_config
    from minibert.runs.depth_study import random_control

    vocab_size = json.loads((minilm_dir / "config.json").read_text())["vocab_size"]
    bert = norm_config(bert_config(TINY, 2, vocab_size), "deepnorm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = random_control(bert, minilm_dir, TINY, files / "task_train.csv", files / "task_eval.csv",
                               tmp_path / "a")
        again = random_control(bert, minilm_dir, TINY, files / "task_train.csv", files / "task_eval.csv",
                               tmp_path / "b")
    assert 0.0 <= first <= 1.0 and first == again
    saved = BertConfig.from_json_file(tmp_path / "a" / "model" / "config.json")
    assert (saved.norm_placement, saved.num_hidden_layers, saved.hidden_size) == ("deepnorm", 2, 32)
    assert saved.residual_scale == pytest.approx((2 * 2) ** 0.25)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="a deepnorm model")
        a = BertModel.from_pretrained(tmp_path / "a" / "model")
        b = BertModel.from_pretrained(tmp_path / "b" / "model")
    assert all((p == q).all() for p, q in zip(a.state_dict().values(), b.state_dict().values()))
