"""Issue 15, part 3: `minibert embed` on Ray Data (a local Ray, 2 CPUs): the vectors of the single-process
encoder, every id once, failures reported by id. Skipped where Ray is not installed (the test extra has it)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from conftest import cli_in_process  # noqa: E402
from minibert import InputError  # noqa: E402
from minibert.compat import SentenceEncoder  # noqa: E402
from minibert.compat.ray import RayEmbed, embed_dataset, expand_inputs, read_vectors, shard_rows  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def shards(tmp_path_factory, sentences_dir):
    directory = tmp_path_factory.mktemp("shards")
    lines = (sentences_dir / "held.txt").read_text(encoding="utf-8").split("\n")[:70]
    (directory / "a.txt").write_text("\n".join(lines[:30]) + "\n\n" + "word " * 300 + "\n", encoding="utf-8")
    (directory / "b.txt").write_text("\n".join(lines[30:55]) + "\n", encoding="utf-8")
    (directory / "c.jsonl").write_text("".join(json.dumps({"id": f"doc{i}", "text": t}) + "\n"
                                               for i, t in enumerate(lines[55:65])) +
                                       json.dumps({"text": lines[65]}) + "\n", encoding="utf-8")
    texts = {}
    for name in ("a.txt", "b.txt"):
        for number, line in enumerate((directory / name).read_text(encoding="utf-8").split("\n")[:-1], start=1):
            texts[f"{name}:{number}"] = line
    texts.update({f"doc{i}": t for i, t in enumerate(lines[55:65])})
    texts["c.jsonl:11"] = lines[65]
    return directory, texts


def test_shard_reading_and_inputs(tmp_path):
    rows = shard_rows("x/s.jsonl", b'{"id": 7, "text": "a"}\n\n{"text": "b"}\r\n')
    assert rows == [{"id": "7", "text": "a"}, {"id": "s.jsonl:3", "text": "b"}]
    assert shard_rows("s.txt", b"one\r\n\ntwo") == [{"id": "s.txt:1", "text": "one"}, {"id": "s.txt:2", "text": ""},
                                                   {"id": "s.txt:3", "text": "two"}]
    with pytest.raises(InputError, match=r"s.jsonl:1: needs a string field 'text'"):
        shard_rows("s.jsonl", b'{"body": "a"}\n')
    with pytest.raises(InputError, match="no such file"):
        expand_inputs([str(tmp_path / "missing.txt")])
    (tmp_path / "a.txt").write_text("x\n")
    with pytest.raises(InputError, match="named twice"):
        expand_inputs([str(tmp_path / "a.txt"), str(tmp_path / "*.txt")])


def test_ray_vectors_equal_the_single_process_encoder(local_ray, shards, minilm_dir, tmp_path):
    directory, texts = shards
    report = embed_dataset([str(directory)], tmp_path / "out",
                           RayEmbed(model=str(minilm_dir), workers=2, rows_per_block=16, max_tokens=2048),
                           _fail_on=["b.txt:3"])
    assert report.rows_in == len(texts) and report.blank == ["a.txt:31"]
    assert [rid for rid, _ in report.failed] == ["b.txt:3"] and "injected failure" in report.failed[0][1]
    ids, vectors = read_vectors(tmp_path / "out")
    expected = sorted(set(texts) - {"a.txt:31", "b.txt:3"})
    assert sorted(ids) == expected and len(ids) == len(set(ids)) == report.rows_out  # no row lost or duplicated
    want = SentenceEncoder.from_pretrained(minilm_dir).encode([texts[i] for i in ids])
    assert vectors.shape == want.shape and np.abs(vectors - want).max() <= 1e-6
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()}
    with pytest.raises(InputError, match=r"holds a `minibert embed` run \(finished\).*--overwrite"):
        embed_dataset([str(directory)], tmp_path / "out", RayEmbed(model=str(minilm_dir)))  # two runs' never mix
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()} == before


def test_embed_cli_ray_engine(local_ray, shards, minilm_dir, tmp_path, capsys):
    """The command in-process, on the Ray session the fixture started (a new process would start its own)."""
    directory, texts = shards
    r = cli_in_process(capsys, "embed", directory / "b.txt", directory / "c.jsonl", "--engine", "ray", "--workers", "1",
                       "--out", tmp_path / "v", "--model", minilm_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "wrote" in r.stdout and "36 vectors of 36 texts" in r.stdout
    ids, _ = read_vectors(tmp_path / "v")
    assert sorted(ids) == sorted(k for k in texts if k.startswith(("b.txt", "doc", "c.jsonl")))


def test_parquet_shards_with_their_own_ids(local_ray, minilm_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["a river bank", "the bank raised its rates", "", "money and interest"]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"doc": ["d1", "d2", "d3", "d4"], "body": texts, "other": [1, 2, 3, 4]}),
                   tmp_path / "in" / "part-0.parquet")
    report = embed_dataset([str(tmp_path / "in" / "part-0.parquet")], tmp_path / "out",
                           RayEmbed(model=str(minilm_dir), workers=1, text_field="body", id_field="doc"))
    assert report.rows_in == 4 and report.blank == ["d3"] and not report.failed
    ids, vectors = read_vectors(tmp_path / "out")
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    assert [ids[i] for i in order] == ["d1", "d2", "d4"]
    want = SentenceEncoder.from_pretrained(minilm_dir).encode([texts[0], texts[1], texts[3]])
    assert np.abs(vectors[order] - want).max() <= 1e-6


def test_a_parquet_shard_without_the_named_column_is_refused_before_any_work(minilm_dir, tmp_path):
    """Inside an actor a missing column was a bare KeyError: 'id'; it is refused up front, naming the shard,
    the column, the option and the columns the shard has, and the output folder is not created."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"key": ["k1"], "text": ["a river bank"]}), tmp_path / "p.parquet")
    with pytest.raises(InputError, match=r"p.parquet': no column 'id' \(--id-field\); its columns are 'key', 'text'"):
        embed_dataset([str(tmp_path / "p.parquet")], tmp_path / "out", RayEmbed(model=str(minilm_dir)))
    with pytest.raises(InputError, match=r"no column 'body' \(--text-field\)"):
        embed_dataset([str(tmp_path / "p.parquet")], tmp_path / "out",
                      RayEmbed(model=str(minilm_dir), text_field="body", id_field="key"))
    assert not (tmp_path / "out").exists()


def test_row_ids_are_unique_across_folders(tmp_path):
    """Rows were named by file name and line: a/part.txt and b/part.txt both gave part.txt:1. Ids are now
    paths relative to the folder the shards share (a lone shard: its file name), and the same ids come out
    whether the paths are given as they are or through local://."""
    from minibert.compat.ray import shard_names

    for folder in ("a", "b", "b/deeper"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "part.txt").write_text("one\ntwo\n")
    files = [str(tmp_path / f / "part.txt") for f in ("a", "b", "b/deeper")]
    names = shard_names(files)
    assert [names[f] for f in files] == ["a/part.txt", "b/part.txt", "b/deeper/part.txt"]
    ids = [row["id"] for f in files for row in shard_rows(f, (tmp_path / "a" / "part.txt").read_bytes(), name=names[f])]
    assert len(ids) == len(set(ids)) == 6 and ids[:2] == ["a/part.txt:1", "a/part.txt:2"]
    assert shard_names([files[1]]) == {files[1]: "part.txt"}
    assert shard_names(["local://" + f for f in files]) == names  # keyed by the absolute local path


def test_gpu_workers_ask_ray_for_gpus_and_load_on_cuda():
    """What reaches map_batches (tested without a GPU): num_gpus per actor, the model on "cuda" (the GPU Ray
    gives the actor) in the dtype asked; CPU actors ask for no GPU and load where the model is."""
    from minibert.compat.ray import map_batches_options

    common = dict(model="m", workers=2, threads=None, rows_per_block=64, batch_size=None, max_tokens=8192)
    gpu = map_batches_options(RayEmbed(**common, gpus_per_worker=0.5, dtype="fp16"))
    assert gpu["num_gpus"] == 0.5 and gpu["num_cpus"] == 1
    assert gpu["fn_constructor_kwargs"] == dict(model="m", threads=None, batch_size=None, max_tokens=8192,
                                                     fail_on=[], device="cuda", dtype="fp16")
    cpu = map_batches_options(RayEmbed(**{**common, "threads": 2}))
    assert "num_gpus" not in cpu and cpu["num_cpus"] == 2 and cpu["fn_constructor_kwargs"]["device"] is None
    for bad, said in ((0, "=0.0 is out of range: it must be > 0"), (-1, "=-1.0 is out of range: it must be > 0"),
                      ("1", "='1' must be a number"), (True, "=True must be a number")):
        with pytest.raises(InputError, match="^" + re.escape(f"--gpus-per-worker{said}") + "$"):
            embed_dataset(["x.txt"], "out", RayEmbed(model="m", gpus_per_worker=bad))
    with pytest.raises(InputError, match="int8 dynamic quantisation runs on the CPU only"):
        embed_dataset(["x.txt"], "out", RayEmbed(model="m", gpus_per_worker=1, dtype="int8"))
    with pytest.raises(InputError, match=r"^--workers=0 is out of range: it must be >= 1$"):
        embed_dataset(["x.txt"], "out", RayEmbed(model="m", workers=0))


def test_a_cluster_without_gpus_is_refused_before_any_work(local_ray, shards, minilm_dir, tmp_path, capsys):
    directory, _ = shards
    r = cli_in_process(capsys, "embed", directory / "b.txt", "--engine", "ray", "--gpus-per-worker", "1",
                       "--out", tmp_path / "v", "--model", minilm_dir)
    assert r.returncode == 2 and "--gpus-per-worker 1: the Ray cluster has 0 GPU(s)" in r.stderr
    assert not (tmp_path / "v").exists() or not any((tmp_path / "v").iterdir())
    r = cli_in_process(capsys, "embed", directory / "b.txt", "--gpus-per-worker", "1", "--out", tmp_path / "x.npy",
                       "--model", minilm_dir)
    assert r.returncode == 2 and "--gpus-per-worker is for --engine ray" in r.stderr
    r = cli_in_process(capsys, "embed", directory / "b.txt", "--engine", "ray", "--device", "cuda",
                       "--out", tmp_path / "v", "--model", minilm_dir)
    assert r.returncode == 2 and "--device is for the local engine" in r.stderr
