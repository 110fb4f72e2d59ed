"""Embedding more text than one machine holds, on Ray Data (optional extra: ``pip install -e ".[ray]"``).

    from minibert.compat.ray import RayEmbed, embed_dataset
    report = embed_dataset(["shards/part-000.txt", "shards/*.jsonl"], "vectors/",
                           RayEmbed(model="weights/all-MiniLM-L6-v2", workers=4, max_tokens=8192))
    # vectors/*.parquet: one row per text, columns id (string) and vector (fixed-size list of float32)

    minibert embed --engine ray "shards/*.txt" --out vectors/ --model weights/all-MiniLM-L6-v2 --workers 4

How it runs:

1. **Read.** Text (``.txt``: one text per line) and JSON Lines (``.jsonl``: an object per line with a
   ``text`` field and, optionally, an ``id`` field) shards are read whole by one Ray task per file, which
   numbers the lines: a row's id is the JSON ``id`` when there is one, else ``<shard>:<line number>``, the
   shard named by its path relative to the folder all shards share (``a/part.txt:3``, ``b/part.txt:3``).
   Parquet shards are read by Ray's reader and must have the id and text columns. Blank texts get no
   vector; their ids are reported.
2. **Embed.** ``map_batches`` with a callable class: an actor pool of ``workers`` actors, each loading
   the model once (``SentenceEncoder.from_pretrained``: a sentence-transformers folder's settings are
   followed) and embedding each block of rows with length-sorted, token-budget batches on the fast path.
   A batch that raises is retried row by row; a row that still fails gets no vector and its id and error
   are reported (``report.failed``); blank texts too (``report.blank``). An actor that dies is restarted
   by Ray Data and its task retried (Ray Data's defaults).
3. **Write.** Parquet files in ``out_dir`` with ``id`` and ``vector``; ``report`` counts rows in and out.

On a cluster: start Ray there (``ray start --head`` on one node, ``ray start --address=HEAD:6379`` on the
others), put the shards and the model folder where every node can read them (shared storage, or S3 / GCS
paths that pyarrow reads), and pass ``address="auto"`` (``--address auto``) from a node of the cluster, or
``address="ray://HEAD:10001"`` from outside. ``workers`` actors are spread over the cluster's CPUs;
``threads`` is the torch threads of each.

On GPUs: ``gpus_per_worker=G`` (``--gpus-per-worker G``) asks Ray for G GPUs per actor (``num_gpus`` of
``map_batches``; 0.5 puts two actors on a GPU). Ray gives each actor its own GPU(s) -- it sets the actor's
``CUDA_VISIBLE_DEVICES`` --, and the actor loads its model on ``cuda`` there (``dtype``: e.g. fp16), where
the fast path takes the GPU's attention route and ``encode`` its GPU layout (``tools.encode``). A cluster
with fewer GPUs than one actor asks for is refused before any work.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..errors import InputError, missing_extra
from ..settings import check, setting

TEXT_SUFFIXES = (".txt", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise missing_extra("the Ray engine", "Ray Data", "ray") from None
    return ray


def expand_inputs(inputs: str | Sequence[str]) -> list[str]:
    """Files from paths, directories (their shards, sorted) and glob patterns; each must be a known shard type."""
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    files = []
    for item in items:
        item = os.fspath(item)
        if "://" in item:  # s3://, gs://: read by pyarrow on the workers
            files.append(item)
            continue
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(str(p) for p in path.iterdir() if p.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)
        elif any(c in item for c in "*?["):
            found = sorted(glob.glob(str(path)))
        else:
            found = [str(path)] if path.exists() else []
        if not found:
            raise InputError(f"input {item!r}: no such file, or no .txt / .jsonl / .parquet shard in it")
        files += found
    for f in files:
        if not f.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES):
            raise InputError(f"input {f!r}: a shard must end in .txt, .jsonl or .parquet")
    kinds = {_kind(f) for f in files}
    if "parquet" in kinds and len(kinds) > 1:
        raise InputError("mix of Parquet and text/JSONL shards: embed them in two runs")
    if len(set(files)) != len(files):
        raise InputError("a shard is named twice in the inputs: its rows would be embedded twice")
    return files


def _kind(path: str) -> str:
    return "parquet" if path.endswith(PARQUET_SUFFIXES) else "jsonl" if path.endswith(JSONL_SUFFIXES) else "text"


def _local(path: str) -> str:
    return os.path.abspath(path[len("local://"):] if path.startswith("local://") else path)


def shard_names(files: Sequence[str]) -> dict[str, str]:
    """The name each shard's row ids start with: its path relative to the folder all the shards share
    (``a/part.txt`` and ``b/part.txt`` stay two names; one shard alone is its file name). Keyed by the
    absolute path (remote URIs: by and as themselves)."""
    local = [_local(f) for f in files if "://" not in f or f.startswith("local://")]
    names = {f: f for f in files if "://" in f and not f.startswith("local://")}
    if local:
        root = os.path.commonpath([os.path.dirname(f) for f in local])
        names.update({f: os.path.relpath(f, root).replace(os.sep, "/") for f in local})
    return names


def shard_rows(path: str, data: bytes, text_field: str = "text", id_field: str = "id",
               name: str | None = None) -> list[dict]:
    """The rows of one text or JSONL shard: ``{"id", "text"}`` per line (blank texts included, text "").
    A row's id is ``name:line`` (``name``: ``shard_names``'; default the file name), or a JSONL record's own
    ``id_field``."""
    name = os.path.basename(path) if name is None else name
    rows = []
    lines = data.decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file's final newline
    for number, line in enumerate(lines, start=1):
        line = line[:-1] if line.endswith("\r") else line
        if _kind(path) == "text":
            rows.append({"id": f"{name}:{number}", "text": line})
            continue
        if not line.strip():
            continue  # an empty JSONL line is no record
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise InputError(f"{path}:{number}: needs a string field {text_field!r}")
        rid = record.get(id_field)
        rows.append({"id": f"{name}:{number}" if rid is None else str(rid), "text": record[text_field]})
    return rows


class _Embedder:
    """The actor's callable: one model load per actor, then a block of rows at a time."""

    def __init__(self, model: str, threads: int | None, batch_size: int | None, max_tokens: int | None,
                 fail_on: Sequence[str] = (), device: str | None = None, dtype: str | None = None):
        import torch

        from .sentence import SentenceEncoder

        if threads:
            torch.set_num_threads(threads)
        # on a GPU actor Ray has set CUDA_VISIBLE_DEVICES to this actor's GPU(s): "cuda" is its own
        self.encoder = SentenceEncoder.from_pretrained(model, device=device, dtype=dtype)
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.fail_on = set(fail_on)  # tests: ids whose rows raise, to exercise the failure path

    def _encode(self, texts, ids):
        if self.fail_on.intersection(ids):
            raise RuntimeError(f"injected failure for {sorted(self.fail_on.intersection(ids))}")
        tokens = self.encoder.tokenize(texts)["input_ids"]
        return self.encoder.encode_ids(tokens, batch_size=self.batch_size, max_tokens=self.max_tokens).numpy()

    def __call__(self, batch):
        import numpy as np
        import pyarrow as pa

        ids, texts = [str(x) for x in batch["id"]], [str(x) for x in batch["text"]]
        dim = self.encoder.get_sentence_embedding_dimension()
        vectors = np.zeros((len(ids), dim), dtype=np.float32)
        status = ["blank" if not t.strip() else "" for t in texts]  # a blank text gets no vector
        todo = [i for i, s in enumerate(status) if not s]
        try:
            if todo:
                vectors[todo] = self._encode([texts[i] for i in todo], [ids[i] for i in todo])
        except Exception:  # one bad row must not cost the block: retry row by row, keep the errors
            for i in todo:
                try:
                    vectors[i] = self._encode([texts[i]], [ids[i]])[0]
                except Exception as e:
                    status[i] = f"{type(e).__name__}: {e}"
        flat = pa.array(vectors.reshape(-1), type=pa.float32())
        return pa.table({"id": pa.array(ids, type=pa.string()),
                         "vector": pa.FixedSizeListArray.from_arrays(flat, dim),
                         "status": pa.array(status, type=pa.string())})


@dataclass
class EmbedReport:
    out_dir: str
    rows_in: int  # texts read (blank ones included)
    rows_out: int  # vectors written
    blank: list[str] = field(default_factory=list)  # ids of blank texts (no vector)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (id, error) of rows that could not be embedded
    seconds: float = 0.0

    @property
    def texts_per_second(self) -> float:
        return self.rows_out / self.seconds if self.seconds else 0.0


@dataclass(kw_only=True)
class RayEmbed:
    """How ``embed_dataset`` embeds on Ray: the model, the actors and their batches, where the texts are."""

    model: str = setting(help="the model folder (or hub id) every actor loads (SentenceEncoder)", required=True)
    workers: int = setting(2, "actors (each loads the model once)", low=1)
    threads: int | None = setting(None, "torch threads of each actor (the CPUs it asks Ray for)", low=1)
    rows_per_block: int = setting(1024, "rows an actor embeds at a time", low=1)
    batch_size: int | None = setting(None, "texts a batch", low=1)
    max_tokens: int | None = setting(8192, "padded tokens a batch (length-sorted batches)", low=1)
    text_field: str = setting("text", "the text's field (JSON Lines) or column (Parquet)")
    id_field: str = setting("id", "the id's field (JSON Lines) or column (Parquet)")
    address: str | None = setting(None, "a running Ray cluster (\"auto\", \"ray://host:10001\"); None starts or "
                                  "joins a local Ray")
    gpus_per_worker: float | None = setting(None, "GPUs each actor asks Ray for (e.g. 1, or 0.5 for two actors a "
                                            "GPU); None: CPU actors", low=0.0, strict=True)
    dtype: str | None = setting(None, "the actors' model dtype", choices=("fp32", "bf16", "fp16", "int8"))

    def check(self) -> None:
        check(self)
        if self.gpus_per_worker is not None and self.dtype == "int8":
            raise InputError("--gpus-per-worker with --dtype int8: int8 dynamic quantisation runs on the CPU only; on "
                             "GPUs use fp16 or bf16")


def embed_dataset(inputs, out_dir, settings: RayEmbed, *, overwrite: bool = False,
                  _fail_on: Sequence[str] = ()) -> EmbedReport:
    """Embed every text of ``inputs`` (shards: .txt, .jsonl, .parquet; paths, directories or globs) with
    ``settings.workers`` actors and write Parquet (id, vector) into ``out_dir``: a local folder follows the
    output-folder rule (``outputs.RunFolder``: empty or new, not the model's folder, one writer; ``overwrite``
    replaces what it holds), so the Parquet files of two runs never mix. ``settings``: a ``RayEmbed``
    (checked before any work)."""
    import contextlib

    from ..outputs import Read, RunFolder

    settings.check()
    files = expand_inputs(inputs)
    if _kind(files[0]) == "parquet":
        _check_columns(files, settings.text_field, settings.id_field)
    folder = None
    if "://" not in str(out_dir):  # before any work: the rule of every output folder
        folder = RunFolder(out_dir, command="embed", what="--out", reads={"--model": settings.model,
                                                                          "TEXTS": Read("read", tuple(files))},
                           overwrite=overwrite, resumable=False)
    claimed = {"inputs": [str(f) for f in files], "model": str(settings.model)}
    with folder.claim(claimed) if folder else contextlib.nullcontext():
        return _embed(files, out_dir, settings, fail_on=_fail_on)


def map_batches_options(settings: RayEmbed, fail_on: Sequence[str] = ()) -> dict:
    """The keyword arguments ``Dataset.map_batches`` gets (besides the class and the actor pool): one place,
    so what reaches Ray is tested without Ray. GPU actors (``gpus_per_worker``) ask for ``num_gpus`` and load
    their model on "cuda" (the GPU Ray gave them); CPU actors ask for ``threads`` CPUs."""
    gpus = settings.gpus_per_worker
    options = dict(fn_constructor_kwargs=dict(model=settings.model, threads=settings.threads,
                                              batch_size=settings.batch_size, max_tokens=settings.max_tokens,
                                              fail_on=list(fail_on), device="cuda" if gpus else None,
                                              dtype=settings.dtype),
                   batch_size=settings.rows_per_block, batch_format="pandas", num_cpus=settings.threads or 1)
    if gpus:
        options["num_gpus"] = gpus
    return options


def _check_gpus(ray, gpus_per_worker) -> None:
    """A cluster without the GPUs one actor asks for would wait for them forever: refused instead."""
    if not gpus_per_worker:
        return
    have = ray.cluster_resources().get("GPU", 0)
    if have < gpus_per_worker:
        raise InputError(f"--gpus-per-worker {gpus_per_worker:g}: the Ray cluster has {have:g} GPU(s); an actor "
                         "asking for more would wait for ever. Start Ray where the GPUs are, or leave the option out "
                         "(CPU actors)")


def _check_columns(files: Sequence[str], text_field: str, id_field: str) -> None:
    """A local Parquet shard without the text or id column is refused before Ray starts (inside an actor it
    would end as a bare ``KeyError``), naming the shard, the missing column, the option and what it holds."""
    import pyarrow.parquet as pq

    for f in files:
        if "://" in f:  # remote shards: Ray reads their schema itself
            continue
        names = pq.read_schema(f).names
        for column, option in ((text_field, "--text-field"), (id_field, "--id-field")):
            if column not in names:
                raise InputError(f"input {f!r}: no column {column!r} ({option}); its columns are "
                                 f"{', '.join(map(repr, names))}")


def _embed(files, out_dir, settings: RayEmbed, fail_on: Sequence[str]) -> EmbedReport:
    import dataclasses
    import time

    model_path = Path(settings.model).expanduser()
    if model_path.exists():  # actors may start elsewhere
        settings = dataclasses.replace(settings, model=str(model_path.resolve()))
    text_field, id_field = settings.text_field, settings.id_field
    ray = _ray()
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # the report says what happened
    if not ray.is_initialized():
        ray.init(address=settings.address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    _check_gpus(ray, settings.gpus_per_worker)
    start = time.perf_counter()
    if _kind(files[0]) == "parquet":
        ds = ray.data.read_parquet(files).select_columns([id_field, text_field])
        ds = ds.rename_columns({id_field: "id", text_field: "text"}) if (id_field, text_field) != ("id", "text") else ds
    else:
        names = shard_names(files)  # ids unique across folders: paths relative to the shards' common folder
        ds = ray.data.read_binary_files(files, include_paths=True).flat_map(
            lambda row: shard_rows(row["path"], row["bytes"], text_field, id_field,
                                   names.get(row["path"]) or names.get(_local(row["path"]), row["path"])))
    ds = ds.materialize()  # read once, before the actors take the CPUs (nothing upstream of them is left to run)
    rows_in = ds.count()
    vectors = ds.map_batches(
        _Embedder, compute=ray.data.ActorPoolStrategy(size=settings.workers),
        **map_batches_options(settings, fail_on)).materialize()  # Ray Data restarts a dead actor and retries
    from ray.data.expressions import col

    status = vectors.select_columns(["id", "status"]).filter(expr=col("status") != "").take_all()
    blank = [r["id"] for r in status if r["status"] == "blank"]
    failed = [(r["id"], r["status"]) for r in status if r["status"] != "blank"]
    good = (vectors.filter(expr=col("status") == "") if status else vectors).drop_columns(["status"])
    good.write_parquet(str(out_dir))
    seconds = time.perf_counter() - start
    return EmbedReport(out_dir=str(out_dir), rows_in=rows_in, rows_out=rows_in - len(status), blank=blank,
                       failed=failed, seconds=seconds)


def read_vectors(out_dir) -> tuple[list[str], "object"]:
    """(ids, (N, D) float32 matrix) of a finished run's Parquet files, in file order."""
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(str(out_dir))
    ids = [str(x) for x in table.column("id").to_pylist()]
    vectors = table.column("vector").combine_chunks()  # list<float> (fixed-size when written so)
    flat = np.asarray(vectors.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
    return ids, flat.reshape(len(ids), -1) if ids else flat.reshape(0, 0)
