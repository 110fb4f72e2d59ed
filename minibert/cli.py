"""The ``minibert`` command line.

    minibert encode "some text" ["another text" ...] [--model M] [--layer -1] [--pool cls|mean] [--json]
    minibert layers "some text" [--model M] [--plot out.png]
    minibert probe data.conllu [--model M] [--column upos] [--plot out.png]
    minibert embed texts.txt --layers -4: --pool mean --out vectors.npy
    minibert inspect [--model M] [--batch 8] [--lengths 128,512]
    minibert parity --model M [--against B] [--dtype fp32|bf16|fp16] [--texts FILE] [--json out.json] [--atol X]
    minibert fill "The capital of France is [MASK]." [--model M] [--top-k 5] [--lens] [--plot lens.png]

``parity`` exits 1 when a layer differs by more than the tolerance (the table names the first one).

Errors about files, models or options are printed as one line (``minibert: error: ...``), exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_MODEL = "bert-base-uncased"


def _load(model_source: str, dtype=None):
    from .model import BertModel
    from .tokenizer import BertTokenizer

    return BertModel.from_pretrained(model_source, dtype=dtype), BertTokenizer.from_pretrained(model_source)


def cmd_encode(args) -> int:
    import torch

    model, tokenizer = _load(args.model)
    batch = tokenizer(args.texts, padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        out = model(**batch, fast=True)
    layers = len(out.hidden_states)
    if not -layers <= args.layer < layers:
        raise ValueError(f"--layer {args.layer} is out of range: the model has hidden states 0..{layers - 1}")
    hidden = out.hidden_states[args.layer]  # (B, T, H)
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    if args.pool == "cls":
        vectors = hidden[:, 0]
    else:  # mean over real tokens only
        vectors = (hidden * mask).sum(1) / mask.sum(1)
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

    from . import layers as L

    model, tokenizer = _load(args.model)
    batch = tokenizer([args.text], truncation=True, return_tensors="pt")
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
        from .plots import similarity_heatmap

        path = similarity_heatmap(cka, args.plot, title=f"Linear CKA between layers\n{args.text[:60]!r}")
        print(f"wrote {path}")
    return 0


def cmd_probe(args) -> int:
    from .probing import probe_model, read_conllu

    data = read_conllu(args.data, column=args.column)
    model, tokenizer = _load(args.model)
    result = probe_model(model, tokenizer, data, pool=args.pool, batch_size=args.batch_size, seed=args.seed,
                         progress=not args.quiet)
    print(f"probing {args.column} in {args.data} ({len(data)} sentences) with {args.model}, pool={args.pool}, "
          f"seed={args.seed}")
    print(result.table())
    if args.plot:
        from .plots import probe_curve

        print(f"wrote {probe_curve(result, args.plot, title=f'Linear probe for {args.column}, per layer')}")
    return 0


def cmd_embed(args) -> int:
    import numpy as np
    import torch

    from . import layers as L

    try:
        with open(args.texts, encoding="utf-8") as f:
            texts = f.read().splitlines()
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {args.texts}: {e}") from None
    if not texts:
        raise ValueError(f"{args.texts} has no lines")
    model, tokenizer = _load(args.model)
    chosen = L.parse_layers(args.layers, model.config.num_hidden_layers + 1)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # length-sorted: little padding
    result = [None] * len(texts)
    from .probing import progress_bar

    bar = progress_bar(len(texts), "embed", not args.quiet)
    with torch.inference_mode():
        for start in range(0, len(order), args.batch_size):
            ids = order[start:start + args.batch_size]
            batch = tokenizer([texts[i] for i in ids], padding=True, truncation=True, return_tensors="pt")
            out = model(**batch, fast=True)
            pooled = L.pool(L.select_layers(out.hidden_states, chosen), batch["attention_mask"], args.pool)  # (k, B, H)
            vectors = torch.cat(tuple(pooled), -1) if args.combine == "concat" else pooled.mean(0)
            for i, v in zip(ids, vectors.float().numpy()):
                result[i] = v
            bar.update(len(ids))
    bar.close()
    array = np.stack(result)
    np.save(args.out, array)
    print(f"wrote {args.out}: {array.shape[0]} texts x {array.shape[1]} dims (layers {chosen}, pool={args.pool}, "
          f"combine={args.combine})")
    return 0


def cmd_inspect(args) -> int:
    from pathlib import Path

    from .accounting import format_report
    from .config import PRESETS, BertConfig

    lengths = []
    for part in args.lengths.split(","):
        try:
            lengths.append(int(part))
        except ValueError:
            raise ValueError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if any(T < 1 for T in lengths) or args.batch < 1:
        raise ValueError("--lengths and --batch must be positive")
    key = args.model.split("/")[-1]
    if not Path(args.model).expanduser().exists() and key in PRESETS:
        # official geometry: no download needed to count
        target, name = BertConfig.from_preset(key), f"{args.model} (built-in geometry, no weights loaded)"
    else:
        from .model import BertModel

        target, name = BertModel.from_pretrained(args.model), args.model
    limit = (target if isinstance(target, BertConfig) else target.config).max_position_embeddings
    too_long = [T for T in lengths if T > limit]
    if too_long:
        raise ValueError(f"--lengths {too_long} exceed max_position_embeddings={limit}")
    print(format_report(target, name, lengths=lengths, batch=args.batch))
    return 0


def cmd_parity(args) -> int:
    from .parity import run_parity

    texts = None
    if args.texts:
        with open(args.texts, encoding="utf-8") as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
        if not texts:
            raise ValueError(f"{args.texts} has no non-empty lines")
    if args.atol is not None and not args.atol >= 0:
        raise ValueError(f"--atol must be >= 0, got {args.atol}")
    report = run_parity(args.model, against=args.against, dtype=args.dtype, texts=texts, atol=args.atol)
    print(report.table())
    if args.json:
        report.write_json(args.json)
    return 0 if report.ok else 1


def cmd_fill(args) -> int:
    from .lens import fill_mask, logit_lens

    model, tokenizer = _load(args.model)
    if args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    if model.mlm_head is None:
        model.mlm_logits(None)  # raises the explanation
    for text, masks in zip(args.texts, fill_mask(model, tokenizer, args.texts, top_k=args.top_k)):
        print(text)
        for k, predictions in enumerate(masks):
            print(f"  [MASK] #{k + 1}: " + ", ".join(f"{tok} {p:.3g}" for tok, p in predictions))
        if args.lens or args.plot:  # a plot is of the lens
            result = logit_lens(model, tokenizer, text)
            print(result.table())
            if args.plot:
                from .plots import logit_lens as plot

                print(f"wrote {plot(result, args.plot)}")
    return 0


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
    p.set_defaults(func=cmd_encode)

    model_help = f"checkpoint directory, .safetensors file or hub id (default {DEFAULT_MODEL})"
    p = sub.add_parser("layers", help="per-layer table (norms, similarity) and a CKA heatmap for one text")
    p.add_argument("text")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--plot", help="write the layer-similarity heatmap to this PNG")
    p.add_argument("--exclude-special", action="store_true", help="leave [CLS] and [SEP] out of the statistics")
    p.set_defaults(func=cmd_layers)

    p = sub.add_parser("probe", help="train a linear probe per layer on word labels from a CoNLL-U file")
    p.add_argument("data", help="a .conllu file")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--column", default="upos", help="label column (upos, xpos, deprel, ...; default upos)")
    p.add_argument("--pool", choices=["first", "mean"], default="first", help="sub-word pooling (default first)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="write the accuracy-per-layer curve to this PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("embed", help="embed a file of texts (one per line) into a .npy matrix")
    p.add_argument("texts", help="a text file, one text per line (row i of the output = line i)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--layers", default="-1", help="layers: -1, -4:, 0,6,-1 or all (default -1)")
    p.add_argument("--pool", choices=["cls", "mean", "max"], default="mean")
    p.add_argument("--combine", choices=["concat", "mean"], default="concat",
                   help="how to join several layers (default concat: k x hidden dims)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", required=True, help="output .npy file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("inspect", help="parameters per component, FLOPs per token, activation memory")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=model_help + "; official names (bert-base-uncased, ...) use built-in geometry")
    p.add_argument("--batch", type=int, default=8, help="batch size for the memory estimate (default 8)")
    p.add_argument("--lengths", default="128,512", help="sequence lengths, comma-separated (default 128,512)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("parity", help="per-layer differences: minibert vs transformers, or two checkpoints")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--against", help="a second checkpoint (run by minibert) instead of transformers")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--texts", help="a text file, one input per line (default: a built-in varied set)")
    p.add_argument("--json", help="also write the numbers to this JSON file")
    p.add_argument("--atol", type=float, help="tolerance (default 1e-5 fp32, 5e-3 fp16, 5e-2 bf16)")
    p.set_defaults(func=cmd_parity)

    p = sub.add_parser("fill", help="predict [MASK] tokens with the masked-LM head (and the logit lens)")
    p.add_argument("texts", nargs="+", help="texts with [MASK] in them")
    p.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--lens", action="store_true", help="also print the per-layer logit lens for the first mask")
    p.add_argument("--plot", help="write the logit-lens plot to this PNG (implies --lens)")
    p.set_defaults(func=cmd_fill)
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


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(sys.argv[1:] if argv is None else argv))
    if getattr(args, "batch_size", 1) < 1:
        parser.error("--batch-size must be >= 1")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError, ImportError) as e:
        parser.exit(2, f"minibert: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
