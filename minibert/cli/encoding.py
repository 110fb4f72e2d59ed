"""Commands that turn texts into vectors: ``encode`` (a few texts, printed), ``embed`` (a file, to .npy or,
on Ray, Parquet) and ``search`` (the nearest lines of a corpus). The vectors come from
``minibert.tools.encode``; these handlers read files, check options and print."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import InputError
from ..textfiles import atomic_file, write_text_atomic
from ..checks import check_max_length, model_limit
from .common import (add_command, blank_line_error, check_device, load, output_file, read_lines, report_truncation,
                     tokenize)
from .settings import EmbedCommand, EncodeCommand, SearchCommand


# ------------------------------------------------------------------------------------------- encode
def add_encode(sub) -> None:
    add_command(sub, "encode", EncodeCommand, cmd_encode, "tokenise texts and print their vectors")


def cmd_encode(args) -> int:
    import torch

    from ..tools.encode import encode_ids

    model, tokenizer = load(args.model, dtype=args.dtype, max_length=args.max_length, device=args.device)
    layers = model.config.num_hidden_layers + 1
    if not -layers <= args.layer < layers:
        raise InputError(f"--layer {args.layer} is out of range: the model has hidden states 0..{layers - 1}")
    truncated = []
    batch = tokenize(tokenizer, args.texts, args.max_length, truncated)
    report_truncation(truncated, len(args.texts), args.max_length or tokenizer.model_max_length)
    ids = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    vectors = encode_ids(model, ids, tokenizer.pad_token_id, pooling=args.pool, layer=args.layer)  # (B, H)
    rows = []
    for text, row_ids, vector in zip(args.texts, ids, vectors):
        tokens = tokenizer.convert_ids_to_tokens(row_ids)
        rows.append({"text": text, "tokens": tokens, "vector": [round(float(v), 6) for v in vector]})
    if args.format == "json":
        json.dump({"model": args.model, "layer": args.layer, "pool": args.pool, "results": rows}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    cfg = model.config
    print(f"model {args.model}: {cfg.num_hidden_layers} blocks, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads; layer {args.layer} of hidden_states[0..{layers - 1}], pool={args.pool}")
    for row in rows:
        v = row["vector"]
        norm = sum(x * x for x in v) ** 0.5
        print(f"\n{row['text']!r}\n  tokens ({len(row['tokens'])}): {' '.join(row['tokens'])}")
        print(f"  vector ({len(v)} dims, norm {norm:.4f}): [{', '.join(f'{x:.4f}' for x in v[:6])}, ...]")
    if len(rows) > 1:
        vec = torch.nn.functional.normalize(vectors.float(), dim=-1)
        sims = vec @ vec.T
        print("\ncosine similarity:")
        for i, row in enumerate(rows):
            print(f"  [{i}] " + " ".join(f"{float(s):6.3f}" for s in sims[i]) + f"  {row['text'][:40]!r}")
    return 0


# -------------------------------------------------------------------------------------------- embed
def add_embed(sub) -> None:
    add_command(sub, "embed", EmbedCommand, cmd_embed, "embed a file of texts (one per line) into a .npy matrix (or, "
                "with --engine ray, shards into Parquet)")


def cmd_embed(args) -> int:
    import numpy as np

    from ..analysis.layers import parse_layers
    from ..compat import sentence
    from ..tools.encode import encode_ids

    if args.engine == "ray":
        return _embed_on_ray(args)
    for name in ("workers", "threads", "address", "gpus_per_worker"):
        if getattr(args, name) is not None:
            raise InputError(f"--{name.replace('_', '-')} is for --engine ray")
    check_device(args)  # before any file is read or written
    if len(args.texts) != 1:
        raise InputError(f"the local engine embeds one file ({len(args.texts)} given); --engine ray takes shards")
    args.texts = args.texts[0]
    texts = read_lines(args.texts)
    if not texts:
        raise InputError(f"{args.texts} has no lines")
    blank = [i for i, t in enumerate(texts) if not t.strip()]
    if blank and args.blank == "error":
        raise blank_line_error(args.texts, blank)
    out_path = output_file(args.out, ".npy", "--out")  # checked by the path rule (``outputs.check_paths``)
    raw = [name for name, value in (("--layers", args.layers), ("--pool", args.pool), ("--combine", args.combine))
           if value is not None]
    follow = not raw and not args.ignore_folder_settings and sentence.is_sentence_folder(args.model)
    if follow:  # a sentence-transformers folder: its truncation, pooling and normalisation
        encoder = sentence.SentenceEncoder.from_pretrained(args.model, dtype=args.dtype, device=check_device(args))
        if args.max_length is not None:
            encoder.max_seq_length = check_max_length("--max-length", args.max_length,
                                                      model_limit(encoder.model.config, encoder.tokenizer))
        model, tokenizer, limit = encoder.model, encoder.tokenizer, encoder.max_seq_length
        settings = encoder.settings()
        described = (f"sentence-transformers settings from modules.json: max_seq_length {limit}"
                     f"{' (--max-length)' if args.max_length is not None else ''}, pooling "
                     f"{'+'.join(settings['pooling'])}{', normalized' if settings['normalize'] else ''}"
                     f"{', lowercased' if settings['do_lower_case'] else ''}")
        print(f"minibert: embed follows {args.model}'s {described}; --layers/--pool/--combine or "
              "--ignore-folder-settings pool hidden states instead", file=sys.stderr)
        encoding = encoder.tokenize(texts)
    else:
        model, tokenizer = load(args.model, dtype=args.dtype, max_length=args.max_length, device=args.device)
        layers, pool_method, combine = args.layers or "-1", args.pool or "mean", args.combine or "concat"
        chosen = parse_layers(layers, model.config.num_hidden_layers + 1)
        limit = args.max_length or tokenizer.model_max_length
        described = f"layers {chosen}, pool={pool_method}, combine={combine}"
        encoding = tokenizer(texts, truncation=True, max_length=limit, return_token_type_ids=False,
                             return_attention_mask=False)
    blank_set = set(blank)
    empty = [i for i, ids in enumerate(encoding["input_ids"]) if len(ids) <= 2 and i not in blank_set]
    if empty and args.blank == "error":  # e.g. a line of control characters, which the tokenizer drops
        raise blank_line_error(args.texts, empty, "has no token")
    skip = blank_set | set(empty)
    todo = [i for i in range(len(texts)) if i not in skip]
    ids = [encoding["input_ids"][i] for i in todo]
    truncated = [(i + 1, n) for i, n in enumerate(encoding.num_truncated_tokens) if n and i not in skip]
    batch_size = args.batch_size  # neither: 32 texts a batch on a CPU, a token budget on a GPU (tools.encode)
    if follow:
        vectors = encoder.encode_ids(ids, batch_size=batch_size, max_tokens=args.max_tokens, progress=not args.quiet)
    else:
        vectors = encode_ids(model, ids, tokenizer.pad_token_id, pooling=pool_method, layer=chosen, combine=combine,
                             batch_size=batch_size, max_tokens=args.max_tokens, progress=not args.quiet)
    array = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
    array[todo] = vectors.numpy()
    report_truncation(truncated, len(texts), limit, what="line")
    with atomic_file(out_path) as tmp, open(tmp, "wb") as f:  # the old file or the new one, whatever kills us
        np.save(f, array)
    skipped = sorted(skip)
    zeros = f"; {len(skipped)} blank line(s) are rows of zeros" if skipped else ""
    print(f"wrote {out_path}: {array.shape[0]} texts x {array.shape[1]} dims ({described}){zeros}")
    return 0


def _embed_on_ray(args) -> int:
    from ..compat.ray import RayEmbed, embed_dataset

    for name in ("layers", "pool", "combine", "max_length"):
        if getattr(args, name) is not None:
            raise InputError(f"--{name.replace('_', '-')}: the Ray engine follows the model folder's settings "
                             "(SentenceEncoder: its pooling and max_seq_length)")
    if args.ignore_folder_settings or args.blank != "error":
        raise InputError("--ignore-folder-settings / --blank are for the local engine (Ray reports blank texts by id)")
    if args.device is not None:
        raise InputError("--device is for the local engine; Ray actors run where Ray puts them: --gpus-per-worker G "
                         "gives each actor G GPUs")
    workers = args.workers or 2
    settings = RayEmbed(model=args.model, workers=workers, threads=args.threads, batch_size=args.batch_size,
                        max_tokens=args.max_tokens or 8192, address=args.address,
                        gpus_per_worker=args.gpus_per_worker, dtype=args.dtype)
    report = embed_dataset(args.texts, args.out, settings, overwrite=args.overwrite)
    print(f"wrote {report.out_dir}: {report.rows_out} vectors of {report.rows_in} texts in {report.seconds:.1f} s "
          f"({report.texts_per_second:.1f} texts/s, {workers} worker(s)"
          f"{f', {args.gpus_per_worker:g} GPU(s) each' if args.gpus_per_worker else ''})")
    if report.blank:
        print(f"minibert: note: {len(report.blank)} blank text(s) have no vector: {', '.join(report.blank[:5])}"
              + (" ..." if len(report.blank) > 5 else ""), file=sys.stderr)
    if report.failed:
        for rid, error in report.failed[:10]:
            print(f"minibert: error: {rid}: {error}", file=sys.stderr)
        print(f"minibert: error: {len(report.failed)} text(s) could not be embedded (ids above)", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------- search
def add_search(sub) -> None:
    add_command(sub, "search", SearchCommand, cmd_search,
                "the lines of a corpus most similar to a query (cosine of sentence vectors)")


#: bumped when what an index records changes; an index of another version is rebuilt
INDEX_FORMAT = 1


def index_record(corpus, lines: int, encoder, dtype: str | None = None) -> dict:
    """What a search index is made from: any difference means its vectors are not this corpus' under this
    model and settings. ``dtype``: "int8" for a quantised model (it keeps float parameters beside its int8
    layers, so its parameters' dtype would say float32), else None: its parameters' dtype."""
    from ..textfiles import file_sha256
    from ..tools.fingerprint import weights_fingerprint

    settings = encoder.settings()
    return {"format": INDEX_FORMAT, "corpus_sha256": file_sha256(corpus), "lines": lines,
            "model": settings["source"], "weights_sha256": weights_fingerprint(encoder.model),
            "dtype": dtype or str(next(encoder.model.parameters()).dtype).replace("torch.", ""),
            "pooling": settings["pooling"], "max_seq_length": settings["max_seq_length"],
            "normalize": settings["normalize"], "do_lower_case": settings["do_lower_case"]}


def _index_differences(meta_file: Path, wanted: dict, matrix_shape) -> list[str]:
    """Why a saved index cannot be reused (empty: it can)."""
    from ..config import read_json_object

    if not meta_file.exists():
        return [f"{meta_file.name} (what the index was made from) is missing"]
    try:
        saved = read_json_object(meta_file)
    except InputError as e:
        return [str(e)]
    named = {"corpus_sha256": "the corpus changed", "weights_sha256": "the model's weights differ"}
    out = [named.get(key, f"{key} was {saved.get(key)!r}, now {value!r}") for key, value in wanted.items()
           if saved.get(key) != value]
    if not out and tuple(matrix_shape) != (wanted["lines"], saved.get("dims", -1)):
        out.append(f"the matrix is {tuple(matrix_shape)}")
    return out


def cmd_search(args) -> int:
    import numpy as np

    from ..compat.sentence import SentenceEncoder, cosine_search

    device = check_device(args)
    lines = read_lines(args.corpus)
    keep = [i for i, t in enumerate(lines) if t.strip()]
    if not keep:
        raise InputError(f"{args.corpus} has no non-blank line to search")
    index = meta_file = None
    if args.index:
        index = output_file(args.index, ".npy", "--index")  # checked before any work (``outputs.check_paths``)
        meta_file = index.with_name(index.name[:-len(".npy")] + ".json")
    encoder = SentenceEncoder.from_pretrained(args.model, dtype=args.dtype, device=device)
    if args.max_length is not None:
        encoder.max_seq_length = check_max_length("--max-length", args.max_length,
                                                  model_limit(encoder.model.config, encoder.tokenizer))
    record = index_record(args.corpus, len(lines), encoder, "int8" if args.dtype == "int8" else None)
    dims = encoder.get_sentence_embedding_dimension()
    matrix = None
    if index is not None and index.exists():
        try:
            matrix = np.load(index, allow_pickle=False)
            why = _index_differences(meta_file, record, matrix.shape)
        except (OSError, ValueError) as e:  # not a .npy matrix (a file minibert wrote, damaged since)
            matrix, why = None, [f"it is not a readable .npy matrix ({str(e).splitlines()[0]})"]
        if why:
            print(f"minibert: rebuilding the index {index}: {'; '.join(why)}", file=sys.stderr)
            matrix = None
        else:
            print(f"minibert: using the saved index {index} (same corpus, model and settings)", file=sys.stderr)
    if matrix is None:
        matrix = np.zeros((len(lines), dims), dtype=np.float32)
        found = encoder.tokenize([lines[i] for i in keep]).num_truncated_tokens
        report_truncation([(keep[j] + 1, n) for j, n in enumerate(found) if n], len(lines), encoder.max_seq_length,
                          what="line")
        matrix[keep] = encoder.encode([lines[i] for i in keep], batch_size=args.batch_size or 32,
                                      show_progress_bar=not args.quiet)
        if index is not None:  # old record gone, matrix, new record: a kill in between leaves no record (rebuilt)
            meta_file.unlink(missing_ok=True)
            with atomic_file(index) as tmp, open(tmp, "wb") as f:
                np.save(f, matrix)
            write_text_atomic(meta_file, json.dumps({**record, "dims": dims}, indent=2) + "\n")
            print(f"minibert: saved the index to {index} and what it was made from to {meta_file.name}",
                  file=sys.stderr)
    queries = encoder.encode(args.queries)
    hits = cosine_search(matrix[keep], queries, k=args.top_k)
    results = [{"query": q, "hits": [{"line": keep[j] + 1, "score": round(score, 6), "text": lines[keep[j]]}
                                     for j, score in found]} for q, found in zip(args.queries, hits)]
    if args.format == "json":
        json.dump({"model": args.model, "corpus": args.corpus, "results": results}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    for result in results:
        print(f"{result['query']!r}:")
        for hit in result["hits"]:
            print(f"  {hit['score']:.4f}  line {hit['line']}: {hit['text'][:100]}")
    return 0


COMMANDS = [add_encode, add_embed, add_search]
