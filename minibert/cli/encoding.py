"""Commands that turn texts into vectors: ``encode`` (a few texts, printed), ``embed`` (a file, to .npy or,
on Ray, Parquet) and ``search`` (the nearest lines of a corpus). The vectors come from
``minibert.tools.encode``; these handlers read files, check options and print."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import InputError
from ..outputs import check_not_reading
from ..textfiles import atomic_file, write_text_atomic
from ..checks import check_max_length, model_limit
from .common import (MODEL_HELP, batch_size_option, blank_line_error, check_device, device_options, load,
                     max_length_option, model_option, output_file, positive_float, positive_int, quiet_option,
                     read_lines, report_truncation, tokenize)


# ------------------------------------------------------------------------------------------- encode
def add_encode(sub) -> None:
    p = sub.add_parser("encode", help="tokenise texts and print their vectors",
                       parents=[model_option(MODEL_HELP + "; offline: weights/all-MiniLM-L6-v2"), max_length_option(),
                                device_options()])
    p.add_argument("texts", nargs="+", help="one or more texts")
    p.add_argument("--layer", type=int, default=-1, help="which hidden state: 0 = embeddings, -1 = last")
    p.add_argument("--pool", choices=["cls", "mean"], default="mean", help="how to pool tokens (default mean)")
    p.add_argument("--json", action="store_true", help="print JSON with the full vectors")
    p.set_defaults(func=cmd_encode)


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
    if args.json:
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
    p = sub.add_parser("embed", help="embed a file of texts (one per line) into a .npy matrix (or, with --engine "
                                     "ray, shards into Parquet)", parents=[model_option(), max_length_option(),
                                                                           quiet_option(), batch_size_option(
                                                                               help="texts per batch (default 32 "
                                                                               "without --max-tokens on a CPU; a "
                                                                               "budget of 16384 tokens on a GPU)"),
                                                                           device_options()])
    p.add_argument("texts", nargs="+", help="a UTF-8 text file, one text per line, lines end at \\n only "
                                            "(row i of the output = line i); with --engine ray: shards (.txt, .jsonl, "
                                            ".parquet), directories or globs")
    p.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="local (default): this process, a .npy matrix; ray: Ray Data actors, Parquet (id, vector) "
                        "files in --out (a directory); see minibert.compat.ray")
    p.add_argument("--workers", type=positive_int, help="--engine ray: actors (model copies), default 2")
    p.add_argument("--threads", type=positive_int, help="--engine ray: torch threads per actor (default 1)")
    p.add_argument("--gpus-per-worker", type=positive_float,
                   help="--engine ray: GPUs per actor (e.g. 1, or 0.5 for two actors a GPU); each actor runs on the GPU "
                        "Ray gives it (default: none, CPU actors)")
    p.add_argument("--address", help="--engine ray: a running cluster (auto, ray://host:10001); default: local Ray")
    p.add_argument("--layers", help="pool these hidden states instead of following a sentence-transformers "
                                    "folder: -1, -4:, 0,6,-1 or all (default -1)")
    p.add_argument("--pool", choices=["cls", "mean", "max"], help="pooling of hidden states (default mean)")
    p.add_argument("--combine", choices=["concat", "mean"],
                   help="how to join several layers (default concat: k x hidden dims)")
    p.add_argument("--ignore-folder-settings", action="store_true",
                   help="a sentence-transformers folder (modules.json) is followed by default (its truncation, "
                        "pooling, normalisation); this pools hidden states with the options above instead")
    p.add_argument("--max-tokens", type=positive_int,
                   help="token budget per batch (rows x longest row, e.g. 8192) instead of a fixed count; with "
                        "--batch-size given too, both limits hold")
    p.add_argument("--out", required=True, help="output .npy file (.npy is added when missing; the directory "
                                                "must exist)")
    p.add_argument("--blank", choices=["error", "zeros"], default="error",
                   help="a blank line is an error (default), or gets a row of zeros")
    p.add_argument("--overwrite", action="store_true", help="--engine ray: replace what the --out folder holds "
                   "(without it a folder that holds anything is refused)")
    p.set_defaults(func=cmd_embed)


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
    if args.overwrite:
        raise InputError("--overwrite is for --engine ray (its --out is a folder); the local engine replaces its .npy "
                         "file, in one step")
    if len(args.texts) != 1:
        raise InputError(f"the local engine embeds one file ({len(args.texts)} given); --engine ray takes shards")
    args.texts = args.texts[0]
    texts = read_lines(args.texts)
    if not texts:
        raise InputError(f"{args.texts} has no lines")
    blank = [i for i, t in enumerate(texts) if not t.strip()]
    if blank and args.blank == "error":
        raise blank_line_error(args.texts, blank)
    out_path = output_file(args.out, ".npy", "--out")
    check_not_reading(out_path, {"--model": args.model})
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
    p = sub.add_parser("search", help="the lines of a corpus most similar to a query (cosine of sentence vectors)",
                       parents=[model_option(MODEL_HELP + " (a sentence-transformers folder's settings are followed)"),
                                max_length_option(), batch_size_option(), quiet_option(), device_options()])
    p.add_argument("corpus", help="a UTF-8 text file, one text per line (blank lines are never hits)")
    p.add_argument("queries", nargs="+", help="one or more query texts")
    p.add_argument("-k", type=positive_int, default=5, help="hits per query (default 5)")
    p.add_argument("--index", help="a .npy file for the corpus vectors, with a .json beside it recording what they "
                                   "were made from (the corpus' sha256, the model's weights, pooling, max length, "
                                   "normalisation): written on the first run, reused while all of these match, "
                                   "rebuilt (and said so) when one differs")
    p.add_argument("--json", action="store_true", help="print the hits as JSON")
    p.set_defaults(func=cmd_search)


#: bumped when what an index records changes; an index of another version is rebuilt
INDEX_FORMAT = 1


def index_record(corpus, lines: int, encoder) -> dict:
    """What a search index is made from: any difference means its vectors are not this corpus' under this
    model and settings."""
    from ..tools.fingerprint import file_sha256, weights_fingerprint

    settings = encoder.settings()
    return {"format": INDEX_FORMAT, "corpus_sha256": file_sha256(corpus), "lines": lines,
            "model": settings["source"], "weights_sha256": weights_fingerprint(encoder.model),
            "dtype": str(next(encoder.model.parameters()).dtype).replace("torch.", ""),
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
        index = output_file(args.index, ".npy", "--index")  # checked before any work
        check_not_reading(index, {"--model": args.model}, "--index")
        meta_file = index.with_name(index.name[:-len(".npy")] + ".json")
    encoder = SentenceEncoder.from_pretrained(args.model, dtype=args.dtype, device=device)
    if args.max_length is not None:
        encoder.max_seq_length = check_max_length("--max-length", args.max_length,
                                                  model_limit(encoder.model.config, encoder.tokenizer))
    record = index_record(args.corpus, len(lines), encoder)
    dims = encoder.get_sentence_embedding_dimension()
    matrix = None
    if index is not None and index.exists():
        matrix = np.load(index)
        why = _index_differences(meta_file, record, matrix.shape)
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
    hits = cosine_search(matrix[keep], queries, k=args.k)
    results = [{"query": q, "hits": [{"line": keep[j] + 1, "score": round(score, 6), "text": lines[keep[j]]}
                                     for j, score in found]} for q, found in zip(args.queries, hits)]
    if args.json:
        json.dump({"model": args.model, "corpus": args.corpus, "results": results}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    for result in results:
        print(f"{result['query']!r}:")
        for hit in result["hits"]:
            print(f"  {hit['score']:.4f}  line {hit['line']}: {hit['text'][:100]}")
    return 0


COMMANDS = [add_encode, add_embed, add_search]
