"""The ``minibert`` command line.

    minibert encode "some text" ["another text" ...] [--model M] [--layer -1] [--pool cls|mean] [--json]

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
        out = model(**batch)
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
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError, ImportError) as e:
        parser.exit(2, f"minibert: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
