#!/usr/bin/env python3
"""Convert a pickled PyTorch checkpoint (pytorch_model.bin, sharded or not) to model.safetensors.

minibert never unpickles checkpoints while loading, because unpickling can run arbitrary code. This
tool reads the pickle with ``torch.load(weights_only=True)``, which only rebuilds tensors and refuses
anything else, and writes safetensors that ``BertModel.from_pretrained`` reads.

    python weights/convert_to_safetensors.py path/to/dir_or_pytorch_model.bin [--out DIR]

Tensors that share memory (the MLM decoder tied to the word embeddings) are written as separate copies,
because safetensors stores no aliases. config.json and tokenizer files are copied when --out differs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

COMPANIONS = ["config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def pickle_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    index = source / "pytorch_model.bin.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [source / name for name in sorted(set(weight_map.values()))]
    if (source / "pytorch_model.bin").exists():
        return [source / "pytorch_model.bin"]
    raise SystemExit(f"no pytorch_model.bin or pytorch_model.bin.index.json in {source}")


def convert(source: Path, out: Path | None = None) -> Path:
    source = Path(source)
    in_dir = source if source.is_dir() else source.parent
    out = Path(out) if out is not None else in_dir
    state = {}
    for file in pickle_files(source):
        loaded = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(loaded, dict):
            raise SystemExit(f"{file} holds a {type(loaded).__name__}, not a dict of tensors")
        for name, tensor in loaded.items():
            if not isinstance(tensor, torch.Tensor):
                raise SystemExit(f"{file}: entry {name!r} is a {type(tensor).__name__}, not a tensor")
            state[name] = tensor
    seen = set()
    for name, tensor in state.items():  # un-alias tied tensors
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        state[name] = tensor.clone().contiguous() if key in seen else tensor.contiguous()
        seen.add(key)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    if out.resolve() != in_dir.resolve():
        for name in COMPANIONS:
            if (in_dir / name).exists():
                shutil.copy(in_dir / name, out / name)
    return out / "model.safetensors"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="pytorch_model.bin or a directory holding it")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: beside the input)")
    args = parser.parse_args(argv)
    print(convert(args.source, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
