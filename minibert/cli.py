"""The ``minibert`` command line.

    minibert encode "some text" ["another text" ...] [--model M] [--layer -1] [--pool cls|mean] [--json]
    minibert layers "some text" [--model M] [--plot out.png]
    minibert probe data.conllu [--model M] [--column upos] [--plot out.png]
    minibert embed texts.txt --layers -4: --pool mean --out vectors.npy
    minibert inspect [--model M] [--batch 8] [--lengths 128,512]
    minibert parity --model M [--against B] [--dtype fp32|bf16|fp16|int8] [--texts FILE] [--json out.json] [--atol X]
    minibert fill "The capital of France is [MASK]." [--model M] [--top-k 5] [--lens] [--plot lens.png]
    minibert finetune --train train.csv --eval test.csv --model M --out DIR [--task classify|regress|tag] ...
    minibert predict DIR texts.txt
    minibert distill --teacher T --out DIR --texts corpus.txt [--student-blocks 0,2,4]      (sentence embeddings)
    minibert distill --teacher FINETUNED --out DIR --train train.csv --eval test.csv [--task classify|tag]
    minibert exits --model FINETUNED --train train.csv --eval test.csv --out DIR [--joint]        (early exit)
    minibert map data.conllu|data.csv|texts.txt --model M --out map.png [--layers all] [--method pca|tsne|umap]

``parity`` exits 1 when a layer differs by more than the tolerance (the table names the first one).

Errors about what the user gave -- files, models, checkpoints, options, inputs -- are printed as one line
(``minibert: error: ...``), exit code 2; anything else is a bug and keeps its traceback. Output cut short
by a closed pipe (``minibert encode ... | head``) ends quietly. Texts longer than ``--max-length`` tokens
(default: the model's limit, 512) are truncated, and the command says how many on stderr.

Only argparse is imported up front: ``--help`` and argument errors never wait for torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from .errors import InputError, MissingExtra

DEFAULT_MODEL = "bert-base-uncased"


def _load(model_source: str, dtype=None, max_length=None):
    """The model and its tokenizer; ``max_length`` (from --max-length) is checked against the model."""
    from .model import BertModel
    from .tokenizer import BertTokenizer

    model, tokenizer = BertModel.from_pretrained(model_source, dtype=dtype), BertTokenizer.from_pretrained(model_source)
    limit = min(model.config.max_position_embeddings, tokenizer.model_max_length)
    if max_length is not None and not 2 <= max_length <= limit:
        raise InputError(f"--max-length {max_length} is out of range: it must be in [2, {limit}] ([CLS] and [SEP] "
                         f"take 2 tokens; the model's limit is {limit})")
    return model, tokenizer


def _tokenize(tokenizer, texts, max_length, truncated):
    """A padded batch, truncated to ``max_length`` tokens (None: the tokenizer's limit). ``truncated``
    collects (1-based number, tokens cut) for the texts that were cut."""
    batch = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    truncated += [(k, n) for k, n in enumerate(batch.num_truncated_tokens, start=1) if n]
    return batch


def _report_truncation(truncated, total, limit, what="text"):
    """One line on stderr when texts were truncated: how many, by how much, which (first few)."""
    if not truncated:
        return
    which = ", ".join(str(i) for i, _ in truncated[:5]) + (", ..." if len(truncated) > 5 else "")
    print(f"minibert: note: {len(truncated)} of {total} {what}s had more than {limit} tokens and were truncated "
          f"(up to {max(n for _, n in truncated)} tokens cut; {what}s {which}); --max-length sets the limit",
          file=sys.stderr)


def _output_file(path: str, suffix: str, what: str) -> Path:
    """Check an output file before any work: its directory exists (never created), it is not a directory.
    ``suffix`` is added when missing, as the writer would add it, so the printed path is the real one."""
    out = Path(path).expanduser()
    if out.suffix != suffix:
        out = out.with_name(out.name + suffix)
    if out.is_dir():
        raise InputError(f"{what} {str(out)!r} is a directory")
    if not out.parent.is_dir():
        raise InputError(f"{what} {str(out)!r}: the directory {str(out.parent)!r} does not exist (create it first)")
    if not os.access(out.parent, os.W_OK):
        raise InputError(f"{what} {str(out)!r}: the directory {str(out.parent)!r} is not writable")
    return out


def _plot_file(path):
    """--plot's real path (``.png`` added when there is no suffix), checked before any work."""
    if path is None:
        return None
    from .analysis.plots import output_path

    return output_path(path)


def cmd_encode(args) -> int:
    import torch

    from .analysis import layers as L
    from .tools import fast

    model, tokenizer = _load(args.model, max_length=args.max_length)
    layers = model.config.num_hidden_layers + 1
    if not -layers <= args.layer < layers:
        raise InputError(f"--layer {args.layer} is out of range: the model has hidden states 0..{layers - 1}")
    truncated = []
    batch = _tokenize(tokenizer, args.texts, args.max_length, truncated)
    _report_truncation(truncated, len(args.texts), args.max_length or tokenizer.model_max_length)
    with torch.inference_mode():
        out = fast.prepare(model)(**batch)
    vectors = L.pool(out.hidden_states[args.layer], batch["attention_mask"], args.pool)  # (B, H)
    rows = []
    for text, ids, vector in zip(args.texts, batch["input_ids"], vectors):
        n = int((ids != tokenizer.vocab[tokenizer.pad_token]).sum())
        tokens = tokenizer.convert_ids_to_tokens(ids[:n].tolist())
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


def cmd_layers(args) -> int:
    import torch

    from .analysis import layers as L

    plot = _plot_file(args.plot)
    model, tokenizer = _load(args.model, max_length=args.max_length)
    truncated = []
    batch = _tokenize(tokenizer, [args.text], args.max_length, truncated)
    _report_truncation(truncated, 1, args.max_length or tokenizer.model_max_length)
    with torch.inference_mode():
        out = model(**batch)
    mask = batch["attention_mask"]
    exclude = [tokenizer.vocab[tokenizer.cls_token], tokenizer.vocab[tokenizer.sep_token]] if args.exclude_special else []
    stats = L.layer_statistics(out.hidden_states, L.token_mask(mask, batch["input_ids"], exclude))
    cka = L.cka_matrix(out.hidden_states, mask, batch["input_ids"], exclude)
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    print(f"{args.text!r} -> {len(tokens)} tokens: {' '.join(tokens)}")
    print(f"model {args.model}: hidden_states[0] = embeddings output, [1..{len(out.hidden_states) - 1}] = blocks"
          + ("; [CLS]/[SEP] excluded" if exclude else ""))
    print(f"{'layer':>5}  {'norm mean':>9}  {'norm std':>8}  {'cos prev':>8}  {'cos last':>8}  {'CKA last':>8}")
    for i in range(len(out.hidden_states)):
        prev = stats["cos_previous"][i]
        print(f"{i:>5}  {float(stats['norm_mean'][i]):>9.3f}  {float(stats['norm_std'][i]):>8.3f}  "
              f"{'-' if prev != prev else f'{float(prev):.3f}':>8}  {float(stats['cos_last'][i]):>8.3f}  "
              f"{float(cka[i, -1]):>8.3f}")
    if args.plot:
        from .analysis.plots import similarity_heatmap

        text = args.text if len(args.text) <= 60 else args.text[:57].rstrip() + "..."
        path = similarity_heatmap(cka, plot, title=f"Linear CKA between layers: {text!r}")
        print(f"wrote {path}")
    return 0


def cmd_probe(args) -> int:
    from .analysis.probing import probe_model, read_conllu

    plot = _plot_file(args.plot)
    data = read_conllu(args.data, column=args.column)
    model, tokenizer = _load(args.model)
    result = probe_model(model, tokenizer, data, pool=args.pool, batch_size=args.batch_size, seed=args.seed,
                         progress=not args.quiet)
    print(f"probing {args.column} in {args.data} ({len(data)} sentences) with {args.model}, pool={args.pool}, "
          f"seed={args.seed}")
    print(result.table())
    if args.plot:
        from .analysis.plots import probe_curve

        print(f"wrote {probe_curve(result, plot, title=f'Linear probe for {args.column}, per layer')}")
    return 0


def read_lines(path) -> list[str]:
    """The lines of a UTF-8 text file, split on "\\n" only (a "\\r\\n" ending counts as one): U+2028, form
    feeds and other characters that str.splitlines() would break on stay inside their line, so line i of
    the file is row i of the output. A final newline does not start another line."""
    try:
        with open(path, encoding="utf-8", newline="") as f:  # newline="": no translation of \r
            text = f.read()
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text: {e}") from None
    except IsADirectoryError:
        raise InputError(f"{path} is a directory, not a text file") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _blank_line_error(path, lines, what="is blank") -> InputError:
    lines = sorted(lines)
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    return InputError(f"{path}: line {lines[0] + 1} {what}{more}; row i of the output is line i, so it would get the "
                      "vector of an empty text ([CLS] [SEP]). Remove such lines, or pass --blank zeros to give "
                      "them a row of zeros")


def cmd_embed(args) -> int:
    import numpy as np
    import torch

    from .analysis import layers as L
    from .analysis.probing import progress_bar
    from .compat import sentence
    from .inputs import check_index
    from .tools import fast
    from .tools.batching import collate, plan_batches

    if args.engine == "ray":
        return _embed_on_ray(args)
    for name in ("workers", "threads", "address"):
        if getattr(args, name) is not None:
            raise InputError(f"--{name} is for --engine ray")
    if len(args.texts) != 1:
        raise InputError(f"the local engine embeds one file ({len(args.texts)} given); --engine ray takes shards")
    args.texts = args.texts[0]
    texts = read_lines(args.texts)
    if not texts:
        raise InputError(f"{args.texts} has no lines")
    blank = [i for i, t in enumerate(texts) if not t.strip()]
    if blank and args.blank == "error":
        raise _blank_line_error(args.texts, blank)
    out_path = _output_file(args.out, ".npy", "--out")
    raw = [name for name, value in (("--layers", args.layers), ("--pool", args.pool), ("--combine", args.combine))
           if value is not None]
    follow = not raw and not args.ignore_folder_settings and sentence.is_sentence_folder(args.model)
    if follow:  # a sentence-transformers folder: its truncation, pooling and normalisation
        encoder = sentence.SentenceEncoder.from_pretrained(args.model)
        if args.max_length is not None:
            encoder.max_seq_length = check_index("--max-length", args.max_length, 3,
                                                 encoder.model.config.max_position_embeddings, "the model's positions")
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
        model, tokenizer = _load(args.model, max_length=args.max_length)
        layers, pool_method, combine = args.layers or "-1", args.pool or "mean", args.combine or "concat"
        chosen = L.parse_layers(layers, model.config.num_hidden_layers + 1)
        limit = args.max_length or tokenizer.model_max_length
        described = f"layers {chosen}, pool={pool_method}, combine={combine}"
        encoding = tokenizer(texts, truncation=True, max_length=limit, return_token_type_ids=False,
                             return_attention_mask=False)
    blank_set = set(blank)
    empty = [i for i, ids in enumerate(encoding["input_ids"]) if len(ids) <= 2 and i not in blank_set]
    if empty and args.blank == "error":  # e.g. a line of control characters, which the tokenizer drops
        raise _blank_line_error(args.texts, empty, "has no token")
    skip = blank_set | set(empty)
    todo = [i for i in range(len(texts)) if i not in skip]
    ids = [encoding["input_ids"][i] for i in todo]
    truncated = [(i + 1, n) for i, n in enumerate(encoding.num_truncated_tokens) if n and i not in skip]
    batch_size = args.batch_size or (None if args.max_tokens else 32)
    if follow:
        vectors = encoder.encode_ids(ids, batch_size=batch_size, max_tokens=args.max_tokens, progress=not args.quiet)
    else:
        bar = progress_bar(len(todo), "embed", not args.quiet)
        width = model.config.hidden_size * (len(chosen) if combine == "concat" else 1)
        vectors = torch.zeros(len(todo), width)
        run = fast.prepare(model)
        with torch.inference_mode():
            for rows in plan_batches([len(x) for x in ids], batch_size=batch_size, max_tokens=args.max_tokens):
                batch = collate(ids, rows, tokenizer.pad_token_id)
                out = run(**batch)
                pooled = L.pool(L.select_layers(out.hidden_states, chosen), batch["attention_mask"], pool_method)  # (k, B, H)
                vectors[torch.as_tensor(rows)] = (torch.cat(tuple(pooled), -1) if combine == "concat"
                                                  else pooled.mean(0)).float()
                bar.update(len(rows))
        bar.close()
    array = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
    array[todo] = vectors.numpy()
    _report_truncation(truncated, len(texts), limit, what="line")
    np.save(out_path, array)
    skipped = sorted(skip)
    zeros = f"; {len(skipped)} blank line(s) are rows of zeros" if skipped else ""
    print(f"wrote {out_path}: {array.shape[0]} texts x {array.shape[1]} dims ({described}){zeros}")
    return 0


def _embed_on_ray(args) -> int:
    from .distributed import embed_dataset

    for name in ("layers", "pool", "combine", "max_length"):
        if getattr(args, name) is not None:
            raise InputError(f"--{name.replace('_', '-')}: the Ray engine follows the model folder's settings "
                             "(SentenceEncoder: its pooling and max_seq_length)")
    if args.ignore_folder_settings or args.blank != "error":
        raise InputError("--ignore-folder-settings / --blank are for the local engine (Ray reports blank texts by id)")
    workers = args.workers or 2
    report = embed_dataset(args.texts, args.out, model=args.model, workers=workers, threads=args.threads,
                           batch_size=args.batch_size, max_tokens=args.max_tokens or 8192, address=args.address)
    print(f"wrote {report.out_dir}: {report.rows_out} vectors of {report.rows_in} texts in {report.seconds:.1f} s "
          f"({report.texts_per_second:.1f} texts/s, {workers} worker(s))")
    if report.blank:
        print(f"minibert: note: {len(report.blank)} blank text(s) have no vector: {', '.join(report.blank[:5])}"
              + (" ..." if len(report.blank) > 5 else ""), file=sys.stderr)
    if report.failed:
        for rid, error in report.failed[:10]:
            print(f"minibert: error: {rid}: {error}", file=sys.stderr)
        print(f"minibert: error: {len(report.failed)} text(s) could not be embedded (ids above)", file=sys.stderr)
        return 1
    return 0


def cmd_search(args) -> int:
    import numpy as np

    from .compat.sentence import SentenceEncoder, cosine_search

    lines = read_lines(args.corpus)
    keep = [i for i, t in enumerate(lines) if t.strip()]
    if not keep:
        raise InputError(f"{args.corpus} has no non-blank line to search")
    index = Path(args.index).expanduser() if args.index else None
    if index is not None and index.suffix != ".npy":
        index = index.with_name(index.name + ".npy")  # as np.save names it
    if index is not None and not index.exists():
        index = _output_file(str(index), ".npy", "--index")  # checked before any work
    encoder = SentenceEncoder.from_pretrained(args.model)
    matrix = None
    if index is not None and index.exists():
        matrix = np.load(index)
        if matrix.shape != (len(lines), encoder.get_sentence_embedding_dimension()):
            raise InputError(f"--index {index} holds a {matrix.shape} matrix; {args.corpus} with {args.model} needs "
                             f"({len(lines)}, {encoder.get_sentence_embedding_dimension()}): delete it to rebuild it")
        print(f"minibert: using the saved index {index}", file=sys.stderr)
    if matrix is None:
        matrix = np.zeros((len(lines), encoder.get_sentence_embedding_dimension()), dtype=np.float32)
        matrix[keep] = encoder.encode([lines[i] for i in keep], show_progress_bar=not args.quiet)
        if index is not None:
            np.save(index, matrix)
            print(f"minibert: saved the index to {index} (reused while the corpus keeps {len(lines)} lines)",
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


def cmd_inspect(args) -> int:
    from pathlib import Path

    from .tools.accounting import format_report
    from .config import BertConfig
    from .names import preset_name

    lengths = []
    for part in args.lengths.split(","):
        try:
            lengths.append(int(part))
        except ValueError:
            raise InputError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if any(T < 1 for T in lengths) or args.batch < 1:
        raise InputError("--lengths and --batch must be positive")
    if not Path(args.model).expanduser().exists() and preset_name(args.model):
        # official geometry: no download needed to count
        target, name = BertConfig.from_preset(args.model), f"{args.model} (built-in geometry, no weights loaded)"
    else:
        from .model import BertModel

        target, name = BertModel.from_pretrained(args.model), args.model
    limit = (target if isinstance(target, BertConfig) else target.config).max_position_embeddings
    too_long = [T for T in lengths if T > limit]
    if too_long:
        raise InputError(f"--lengths {too_long} exceed max_position_embeddings={limit}")
    print(format_report(target, name, lengths=lengths, batch=args.batch))
    return 0


def cmd_parity(args) -> int:
    from .analysis.parity import run_parity

    texts = None
    if args.texts:
        texts = [line for line in read_lines(args.texts) if line.strip()]
        if not texts:
            raise InputError(f"{args.texts} has no non-empty lines")
    if args.atol is not None and not args.atol >= 0:
        raise InputError(f"--atol must be >= 0, got {args.atol}")
    json_path = _output_file(args.json, ".json", "--json") if args.json else None
    report = run_parity(args.model, against=args.against, dtype=args.dtype, texts=texts, atol=args.atol)
    print(report.table())
    if json_path:
        report.write_json(json_path)
        print(f"wrote {json_path}")
    return 0 if report.ok else 1


def cmd_fill(args) -> int:
    from .analysis.lens import fill_mask, logit_lens

    if args.top_k < 1:
        raise InputError(f"--top-k must be >= 1, got {args.top_k}")
    plot = _plot_file(args.plot)
    model, tokenizer = _load(args.model, max_length=args.max_length)
    if args.top_k > model.config.vocab_size:
        raise InputError(f"--top-k {args.top_k} is larger than the vocabulary ({model.config.vocab_size} tokens)")
    if model.mlm_head is None:
        model.mlm_logits(None)  # raises the explanation
    predictions = fill_mask(model, tokenizer, args.texts, top_k=args.top_k, max_length=args.max_length)
    for text, masks in zip(args.texts, predictions):
        print(text)
        for k, top in enumerate(masks):
            print(f"  [MASK] #{k + 1}: " + ", ".join(f"{tok} {p:.3g}" for tok, p in top))
        if args.lens or args.plot:  # a plot is of the lens
            result = logit_lens(model, tokenizer, text, max_length=args.max_length)
            print(result.table())
            if plot:
                from .analysis.plots import logit_lens as lens_plot

                print(f"wrote {lens_plot(result, plot)}")
    return 0


def cmd_finetune(args) -> int:
    from .training.loop import FitConfig
    from .training.tasks import finetune

    if args.lr <= 0:
        raise InputError(f"--lr must be > 0, got {args.lr}")
    config = FitConfig(epochs=args.epochs, lr=args.lr, seed=args.seed, bf16=args.bf16, progress=not args.quiet)
    history = finetune(args.train, args.eval, args.model, args.out, task=args.task, text_column=args.text_column,
                       pair_column=args.text_pair_column, label_column=args.label_column, tag_column=args.tag_column,
                       recipe=args.recipe, config=config, batch_size=args.batch_size, max_length=args.max_length,
                       lora_rank=args.lora_rank, lora_targets=[t.strip() for t in args.lora_targets.split(",")],
                       layerdrop=args.layerdrop)
    if history.best_epoch is None:  # a torchrun process other than 0: it trained; process 0 evaluates and writes
        return 0
    print(f"best epoch {history.best_epoch} ({history.best_metric:.4f}); wrote {args.out}: checkpoint, tokenizer, "
          "metrics.json")
    return 0


def _blocks_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--student-blocks {text!r}: give block numbers separated by commas, e.g. 0,2,4") from None


def cmd_distill(args) -> int:
    from .training import distill as D
    from .training.loop import FitConfig

    if args.texts is not None and args.train is not None:
        raise InputError("--texts (sentence-embedding distillation) and --train (task distillation) exclude each other")
    if args.texts is None and args.train is None:
        raise InputError("give --texts (sentence-embedding distillation on unlabelled text) or --train and --eval "
                         "(task distillation from a fine-tuned teacher)")
    if args.train is not None and args.eval is None:
        raise InputError("task distillation needs --eval (held-out data in the --train format)")
    if args.train is not None and args.group_by_length:
        raise InputError("--group-by-length is for embedding mode (--texts); task distillation batches as finetune")
    if args.train is not None and args.augment:
        raise InputError("--augment is for embedding mode (--texts): task distillation trains on labelled rows")
    if args.train is not None and args.freeze_embeddings:
        raise InputError("--freeze-embeddings is for embedding mode (--texts)")
    if args.train is not None and args.cache_teacher:
        raise InputError("--cache-teacher is for embedding mode (--texts): task distillation runs the teacher on "
                         "each batch")
    blocks = None if args.student_blocks is None else _blocks_list(args.student_blocks)
    lr = args.lr if args.lr is not None else (5e-4 if args.texts else 5e-5)
    if lr <= 0:
        raise InputError(f"--lr must be > 0, got {lr}")
    config = FitConfig(epochs=args.epochs, lr=lr, seed=args.seed, bf16=args.bf16, progress=not args.quiet)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file")
    log = None if args.quiet else (lambda line: print(line, file=sys.stderr))
    if args.train is not None:
        history, teacher_score = D.distill_task(
            args.train, args.eval, args.teacher, out, task=args.task, student_blocks=blocks,
            temperature=args.temperature, alpha=args.alpha, hidden_weight=args.hidden_weight,
            attention_weight=args.attention_weight, layer_map=args.layer_map, text_column=args.text_column,
            pair_column=args.text_pair_column, label_column=args.label_column, tag_column=args.tag_column,
            config=config, batch_size=args.batch_size, max_length=args.max_length,
            student_dropout=args.student_dropout, log=log)
        metric = "accuracy" if args.task == "classify" else "entity_f1"
        print(f"student best epoch {history.best_epoch}: {metric} {history.best_metric:.4f} (teacher "
              f"{teacher_score[metric]:.4f}, {history.best_metric / teacher_score[metric]:.1%} of it); wrote {out}")
        return 0
    texts = read_lines(args.texts)
    held = read_lines(args.eval_texts) if args.eval_texts else None
    if not args.eval_texts:
        print("minibert: note: holding out 5 % of the texts (at most 1000) to measure agreement (--eval-texts to "
              "choose)", file=sys.stderr)
    run = D.distill_corpus(args.teacher, texts, out, eval_texts=held, student_blocks=blocks, pooling=args.pool,
                           normalize=args.normalize, similarity_weight=args.similarity_weight,
                           hidden_weight=args.hidden_weight, attention_weight=args.attention_weight,
                           layer_map=args.layer_map, config=config, batch_size=args.batch_size,
                           max_length=args.max_length, group_by_length=args.group_by_length,
                           student_dropout=0.0 if args.student_dropout is None else args.student_dropout,
                           augment=args.augment, cache_teacher=args.cache_teacher,
                           freeze_embeddings=args.freeze_embeddings, log=log)
    best = run.history.epochs[run.history.best_epoch - 1]["eval"]
    print(f"student: blocks {run.blocks} of the teacher's; agreement with the teacher on {run.held_out} held-out "
          f"texts: Spearman {best['spearman']:.4f} (before training {run.before['spearman']:.4f}), top-{best['k']} "
          f"overlap {best['top_k_overlap']:.3f} (before {run.before['top_k_overlap']:.3f}); wrote {out}")
    return 0


def cmd_exits(args) -> int:
    from .training.depth import train_exits

    from .training.loop import FitConfig

    lr = args.lr if args.lr is not None else (5e-5 if args.joint else 1e-3)
    if lr <= 0:
        raise InputError(f"--lr must be > 0, got {lr}")
    config = FitConfig(epochs=args.epochs, lr=lr, seed=args.seed, progress=not args.quiet)
    table = train_exits(args.model, args.train, args.eval, args.out, joint=args.joint, config=config,
                        batch_size=args.batch_size, max_length=args.max_length, text_column=args.text_column,
                        label_column=args.label_column,
                        log=(lambda line: print(line, file=sys.stderr)) if not args.quiet else None)
    print(table)
    print(f"wrote {args.out}: the classifier, early_exits.safetensors, tokenizer, exits.json")
    return 0


def cmd_map(args) -> int:
    from .analysis import maps
    from .analysis.layers import parse_layers

    plot = _plot_file(args.out)
    json_path = _output_file(args.json, ".json", "--json") if args.json else None
    if args.method not in maps.METHODS:
        raise InputError(f"--method {args.method!r}: use one of {maps.METHODS}")
    if args.max_points is not None and args.max_points < 3:
        raise InputError(f"--max-points must be >= 3, got {args.max_points}")
    suffix = Path(args.data).suffix.lower()
    words = [w for w in (args.word or "").split(",") if w.strip()]
    if suffix == ".conllu":
        if words:
            raise InputError("--word picks occurrences in a text table or text file; a .conllu map shows every "
                             "word, coloured by --column")
        from .analysis.probing import read_conllu

        data = read_conllu(args.data, column=args.column)
    elif suffix in (".csv", ".tsv", ".jsonl"):
        from .training.datasets import read_table

        table = read_table(args.data, text_column=args.text_column, label_column=args.label_column)
    elif suffix == ".txt":
        if not words:
            raise InputError(f"{args.data} is plain text: give --word W[,W2] (points are the occurrences of each "
                             "word, coloured by which word), or a labelled .csv/.tsv/.jsonl or .conllu file")
        texts = [t for t in read_lines(args.data) if t.strip()]
    else:
        raise InputError(f"{args.data}: use a .conllu, .csv, .tsv, .jsonl or .txt file (got {suffix or 'no suffix'!r})")
    model, tokenizer = _load(args.model)
    parse_layers(args.layers, model.config.num_hidden_layers + 1)  # a bad --layers fails before any work
    progress = not args.quiet
    if suffix == ".conllu":
        points = maps.word_points(model, tokenizer, data, progress=progress)
    elif suffix == ".txt":
        points = maps.occurrence_points(model, tokenizer, texts, None, words=words, progress=progress)
    elif words:
        points = maps.occurrence_points(model, tokenizer, table.texts, table.labels, words=words, progress=progress)
    else:
        points = maps.sentence_points(model, tokenizer, table.texts, table.labels, method=args.pool, progress=progress)
    result = maps.stack_map(points, args.layers, method=args.method, seed=args.seed, max_points=args.max_points,
                            model=Path(str(args.model)).name or str(args.model))
    sampled = f" (a seeded sample of {len(result.labels)})" if len(result.labels) < len(points.labels) else ""
    print(f"{len(points.labels)} {points.what}{sampled}, {len(set(result.labels))} labels; {args.method} with seed "
          f"{args.seed}")
    print("layer  5-NN accuracy (leave-one-out, cosine, full space)")
    for layer, acc in zip(result.layers, result.knn_accuracy):
        print(f"{layer:>5}  {acc:.4f}")
    if json_path is not None:
        json_path.write_text(json.dumps({"layers": result.layers, "labels": result.labels, "method": result.method,
                                         "seed": result.seed, "knn_accuracy": result.knn_accuracy,
                                         "coords": result.coords.round(5).tolist()}) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    print(f"wrote {maps.plot_stack_map(result, plot)}")
    return 0


def cmd_predict(args) -> int:
    from .config import read_json_object
    from .heads import TASK_CLASSES
    from .tokenizer import BertTokenizer
    from .training.data import tag_words
    from .training.recipes import ScalarMixClassifier

    architectures = read_json_object(Path(args.checkpoint) / "config.json").get("architectures") or []
    kind = next((a for a in architectures if a in TASK_CLASSES), None)
    scalarmix = (Path(args.checkpoint) / ScalarMixClassifier.HEAD_FILE).exists()
    if not scalarmix and (kind is None or kind == "BertForQuestionAnswering"):
        raise InputError(f"{args.checkpoint} is not a fine-tuned classifier or tagger (architectures: "
                         f"{architectures}); `minibert predict` takes what `minibert finetune` writes")
    texts = [line for line in read_lines(args.texts) if line.strip()]
    if not texts:
        raise InputError(f"{args.texts} has no non-empty lines")
    if scalarmix:
        model, kind = ScalarMixClassifier.from_pretrained(args.checkpoint), "BertForSequenceClassification"
    else:
        model = TASK_CLASSES[kind].from_pretrained(args.checkpoint)
    tokenizer = BertTokenizer.from_pretrained(args.checkpoint)
    if kind == "BertForTokenClassification":
        for text, tags in zip(texts, tag_words(model, tokenizer, [t.split() for t in texts])):
            print(" ".join(f"{w}/{t}" for w, t in zip(text.split(), tags)))
        return 0
    for text, p in zip(texts, model.predict(texts, tokenizer=tokenizer)):
        print(f"{p['label']}\t{p['score']:.4f}\t{text}" if "label" in p else f"{p['score']:.4f}\t{text}")
    return 0


PLOT_FORMATS = ".png (150 dpi), .svg or .pdf; no suffix: .png"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _max_length_option(p) -> None:
    p.add_argument("--max-length", type=_positive_int, default=None,
                   help="truncate texts to this many tokens, [CLS] and [SEP] included (default: the model's "
                        "limit, 512); how many texts were truncated is said on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minibert", description="A readable, exact BERT encoder.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("encode", help="tokenise texts and print their vectors")
    p.add_argument("texts", nargs="+", help="one or more texts")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"checkpoint directory, .safetensors file or hub id (default {DEFAULT_MODEL}; "
                        "offline: weights/all-MiniLM-L6-v2)")
    p.add_argument("--layer", type=int, default=-1, help="which hidden state: 0 = embeddings, -1 = last")
    p.add_argument("--pool", choices=["cls", "mean"], default="mean", help="how to pool tokens (default mean)")
    p.add_argument("--json", action="store_true", help="print JSON with the full vectors")
    _max_length_option(p)
    p.set_defaults(func=cmd_encode)

    model_help = f"checkpoint directory, .safetensors file or hub id (default {DEFAULT_MODEL})"
    p = sub.add_parser("layers", help="per-layer table (norms, similarity) and a CKA heatmap for one text")
    p.add_argument("text")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--plot", help="write the layer-similarity heatmap to this file (" + PLOT_FORMATS + ")")
    p.add_argument("--exclude-special", action="store_true", help="leave [CLS] and [SEP] out of the statistics")
    _max_length_option(p)
    p.set_defaults(func=cmd_layers)

    p = sub.add_parser("probe", help="train a linear probe per layer on word labels from a CoNLL-U file")
    p.add_argument("data", help="a .conllu file")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--column", default="upos", help="label column (upos, xpos, deprel, ...; default upos)")
    p.add_argument("--pool", choices=["first", "mean"], default="first", help="sub-word pooling (default first)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="write the accuracy-per-layer curve to this file (" + PLOT_FORMATS + ")")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("embed", help="embed a file of texts (one per line) into a .npy matrix (or, with --engine "
                                     "ray, shards into Parquet)")
    p.add_argument("texts", nargs="+", help="a UTF-8 text file, one text per line, lines end at \\n only "
                                            "(row i of the output = line i); with --engine ray: shards (.txt, .jsonl, "
                                            ".parquet), directories or globs")
    p.add_argument("--engine", choices=["local", "ray"], default="local",
                   help="local (default): this process, a .npy matrix; ray: Ray Data actors, Parquet (id, vector) "
                        "files in --out (a directory); see minibert.distributed")
    p.add_argument("--workers", type=_positive_int, help="--engine ray: actors (model copies), default 2")
    p.add_argument("--threads", type=_positive_int, help="--engine ray: torch threads per actor (default 1)")
    p.add_argument("--address", help="--engine ray: a running cluster (auto, ray://host:10001); default: local Ray")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--layers", help="pool these hidden states instead of following a sentence-transformers "
                                    "folder: -1, -4:, 0,6,-1 or all (default -1)")
    p.add_argument("--pool", choices=["cls", "mean", "max"], help="pooling of hidden states (default mean)")
    p.add_argument("--combine", choices=["concat", "mean"],
                   help="how to join several layers (default concat: k x hidden dims)")
    p.add_argument("--ignore-folder-settings", action="store_true",
                   help="a sentence-transformers folder (modules.json) is followed by default (its truncation, "
                        "pooling, normalisation); this pools hidden states with the options above instead")
    p.add_argument("--batch-size", type=_positive_int, help="texts per batch (default 32 without --max-tokens)")
    p.add_argument("--max-tokens", type=_positive_int,
                   help="token budget per batch (rows x longest row, e.g. 8192) instead of a fixed count; with "
                        "--batch-size given too, both limits hold")
    p.add_argument("--out", required=True, help="output .npy file (.npy is added when missing; the directory "
                                                "must exist)")
    p.add_argument("--blank", choices=["error", "zeros"], default="error",
                   help="a blank line is an error (default), or gets a row of zeros")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _max_length_option(p)
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("search", help="the lines of a corpus most similar to a query (cosine of sentence vectors)")
    p.add_argument("corpus", help="a UTF-8 text file, one text per line (blank lines are never hits)")
    p.add_argument("queries", nargs="+", help="one or more query texts")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help + " (a sentence-transformers folder's "
                                                                       "settings are followed)")
    p.add_argument("-k", type=_positive_int, default=5, help="hits per query (default 5)")
    p.add_argument("--index", help="a .npy file for the corpus vectors: written on the first run, reused after")
    p.add_argument("--json", action="store_true", help="print the hits as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("inspect", help="parameters per component, FLOPs per token, activation memory")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=model_help + "; official names (bert-base-uncased, ...) use built-in geometry")
    p.add_argument("--batch", type=int, default=8, help="batch size for the memory estimate (default 8)")
    p.add_argument("--lengths", default="128,512", help="sequence lengths, comma-separated (default 128,512)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("parity", help="per-layer differences: minibert vs transformers, or two checkpoints")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--against", help="a second checkpoint (run by minibert) instead of transformers")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "int8"], default="fp32",
                   help="int8: the model quantised on load (dtype='int8') against its own fp32 weights, layer by "
                        "layer, and the cosine of their sentence vectors (needs >= 0.99)")
    p.add_argument("--texts", help="a text file, one input per line (default: a built-in varied set)")
    p.add_argument("--json", help="also write the numbers to this JSON file")
    p.add_argument("--atol", type=float, help="tolerance (default 1e-5 fp32, 5e-3 fp16, 5e-2 bf16)")
    p.set_defaults(func=cmd_parity)

    p = sub.add_parser("fill", help="predict [MASK] tokens with the masked-LM head (and the logit lens)")
    p.add_argument("texts", nargs="+", help="texts with [MASK] in them")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--lens", action="store_true", help="also print the per-layer logit lens for the first mask")
    p.add_argument("--plot", help="write the logit-lens plot to this file (" + PLOT_FORMATS + "; implies --lens)")
    _max_length_option(p)
    p.set_defaults(func=cmd_fill)

    p = sub.add_parser("finetune", help="fine-tune a task head (and the encoder) on a labelled file")
    p.add_argument("--train", required=True, help=".csv / .tsv / .jsonl (classify, regress) or .conllu / BIO file (tag)")
    p.add_argument("--eval", required=True, help="held-out data in the same format, evaluated after each epoch")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--out", required=True, help="directory for the best checkpoint, its tokenizer and metrics.json")
    p.add_argument("--task", choices=["classify", "regress", "tag"], default="classify")
    p.add_argument("--text-column", default="text")
    p.add_argument("--text-pair-column", help="a second text per row (sentence pairs)")
    p.add_argument("--label-column", default="label")
    p.add_argument("--tag-column", default="upos", help="CoNLL-U column with the tags (--task tag)")
    p.add_argument("--recipe", choices=["full", "gradual", "llrd", "lora", "scalarmix"], default="full")
    p.add_argument("--epochs", type=_positive_int, default=3)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=_positive_int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
    p.add_argument("--lora-rank", type=_positive_int, default=8, help="--recipe lora: the rank r (alpha = 2r)")
    p.add_argument("--lora-targets", default="query,value",
                   help="--recipe lora: attention projections to adapt, of query,key,value,output")
    p.add_argument("--layerdrop", type=float, default=0.0,
                   help="skip each block with this probability while training (LayerDrop; e.g. 0.2), to prune later")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("distill", help="distil a model into a shallower student (sentence embeddings or a task)")
    p.add_argument("--teacher", required=True, help="the model to imitate (a fine-tuned checkpoint for task mode)")
    p.add_argument("--out", required=True, help="directory for the student's best checkpoint, tokenizer, metrics.json")
    p.add_argument("--student-blocks", help="teacher blocks the student starts from (default every other: 0,2,4,...)")
    p.add_argument("--texts", help="embedding mode: unlabelled texts, one per line")
    p.add_argument("--eval-texts", help="embedding mode: held-out texts for the agreement (default: 5%% of --texts, "
                   "at most 1000)")
    p.add_argument("--pool", choices=["mean", "cls", "max"], default="mean", help="embedding mode: sentence vector")
    p.add_argument("--normalize", action="store_true", help="embedding mode: match unit vectors (cosine models)")
    p.add_argument("--similarity-weight", type=float, default=0.0,
                   help="embedding mode: weight of the MSE between in-batch cosine similarities (default 0)")
    p.add_argument("--group-by-length", action="store_true",
                   help="embedding mode: batches of texts of similar length (less padding, faster epochs)")
    p.add_argument("--augment", type=int, default=0, metavar="N",
                   help="embedding mode: add N texts made from --texts (crops, pairs, word dropout; default 0)")
    p.add_argument("--cache-teacher", action="store_true",
                   help="embedding mode: compute the teacher's vectors once, before the first epoch (faster epochs; "
                   "not with --hidden-weight / --attention-weight)")
    p.add_argument("--freeze-embeddings", action="store_true",
                   help="embedding mode: the student keeps the teacher's embeddings (a faster step)")
    p.add_argument("--train", help="task mode: labelled training data (the finetune formats)")
    p.add_argument("--eval", help="task mode: held-out data, evaluated after each epoch")
    p.add_argument("--task", choices=["classify", "tag"], default="classify")
    p.add_argument("--text-column", default="text")
    p.add_argument("--text-pair-column", help="a second text per row (sentence pairs)")
    p.add_argument("--label-column", default="label")
    p.add_argument("--tag-column", default="upos", help="CoNLL-U column with the tags (--task tag)")
    p.add_argument("--temperature", type=float, default=2.0, help="task mode: softmax temperature T (default 2)")
    p.add_argument("--alpha", type=float, default=0.5, help="task mode: weight of the soft targets (default 0.5)")
    p.add_argument("--hidden-weight", type=float, default=0.0, help="weight of the hidden-state MSE (default 0)")
    p.add_argument("--attention-weight", type=float, default=0.0, help="weight of the attention KL (default 0)")
    p.add_argument("--layer-map", help="student:teacher hidden states, e.g. 1:2,2:4,3:6 (default uniform)")
    p.add_argument("--student-dropout", type=float, help="the student's dropout while it trains (default: 0 in "
                   "embedding mode, its own in task mode); the saved student keeps its own")
    p.add_argument("--epochs", type=_positive_int, default=3)
    p.add_argument("--lr", type=float, help="learning rate (default 5e-4 embeddings, 5e-5 task)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=_positive_int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="the student trains under bf16 autocast (fp32 master "
                   "weights; the teacher stays fp32)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or epoch lines")
    p.set_defaults(func=cmd_distill)

    p = sub.add_parser("exits", help="train early exits on a fine-tuned classifier; print accuracy vs blocks run")
    p.add_argument("--model", required=True, help="a classifier written by `minibert finetune`")
    p.add_argument("--train", required=True, help="labelled training data (.csv / .tsv / .jsonl)")
    p.add_argument("--eval", required=True, help="held-out data: the accuracy / blocks / time table is measured on it")
    p.add_argument("--out", required=True, help="directory for the classifier with its exits")
    p.add_argument("--joint", action="store_true", help="train the whole model with the exits (default: frozen "
                   "model, only the exits learn)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--epochs", type=_positive_int, default=2)
    p.add_argument("--lr", type=float, help="learning rate (default 1e-3: only the exits train; --joint 5e-5)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=_positive_int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar or epoch lines")
    p.set_defaults(func=cmd_exits)

    p = sub.add_parser("map", help="2-D maps of word, sentence or word-occurrence vectors, one panel per layer")
    p.add_argument("data", help=".conllu (words by --column), .csv/.tsv/.jsonl (sentences by --label-column, or "
                   "occurrences of --word), .txt with --word")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--out", required=True, help="the figure (" + PLOT_FORMATS + ")")
    p.add_argument("--layers", default="all", help="hidden states to show: all, 0,3,6, -3: (default all)")
    p.add_argument("--method", default="pca", help="pca (default), tsne (scikit-learn) or umap (umap-learn)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--column", default="upos", help=".conllu: the label column (default upos)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--word", help="points are the occurrences of this word (or words, comma-separated)")
    p.add_argument("--pool", choices=["mean", "cls", "max"], default="mean", help="sentence vectors (default mean)")
    p.add_argument("--max-points", type=int, default=3000, help="a seeded sample when there are more (default 3000)")
    p.add_argument("--json", help="also write the coordinates and scores to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_map)

    p = sub.add_parser("predict", help="labels (or tags) for the lines of a text file, with a fine-tuned model")
    p.add_argument("checkpoint", help="a directory written by `minibert finetune`")
    p.add_argument("texts", help="a UTF-8 text file, one text per line")
    p.set_defaults(func=cmd_predict)
    return parser


def _join_negative_values(argv):
    """Let `--layers -4:` work: argparse would take '-4:' for an option."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in ("--layers", "--layer") and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


#: what a user can cause and fix: printed as one line. Anything else is a bug and keeps its traceback.
USER_ERRORS = (InputError, MissingExtra, FileNotFoundError, IsADirectoryError, NotADirectoryError,
               PermissionError)


def _warning_line(message, category, filename, lineno, file=None, line=None):
    """Warnings as one line on stderr, like errors (no source file and line of minibert's internals)."""
    print(f"minibert: warning: {message}", file=sys.stderr if file is None else file)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(sys.argv[1:] if argv is None else argv))
    if (getattr(args, "batch_size", 1) or 1) < 1:
        parser.error("--batch-size must be >= 1")
    try:
        with warnings.catch_warnings():  # restores showwarning afterwards (main may be called in-process)
            warnings.showwarning = _warning_line
            code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader went away (`minibert encode ... | head`): stop quietly, as Unix tools do. Point stdout
        # at /dev/null so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # killed by SIGPIPE, as a shell reports it
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as e:
        parser.exit(2, f"minibert: error: {e}\n")
    except OSError as e:  # the disk is full, a device failed, ...: about the machine, not minibert
        if e.filename is None:
            raise
        parser.exit(2, f"minibert: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
