"""What the commands share: a command's parser made from its settings dataclass (``add_command``; the
options each command shares are declared once in ``cli/settings.py`` and ``runs/settings.py``), loading a
model with its tokenizer, tokenising with a truncation report, reading text files.

Simple ranges (a positive int, a positive number) are argparse types made from the declared bounds, so a
bad value is refused with the usage line before any work; what depends on the model (a --max-length past
its positions) is checked once the model is loaded. Only argparse and the standard library are imported
here: ``minibert --help`` never waits for torch.
"""

from __future__ import annotations

import argparse
import sys

from ..checks import check_max_length, model_limit
from ..errors import InputError
from ..runs.settings import DEFAULT_MODEL  # noqa: F401  (public: minibert.cli.DEFAULT_MODEL)
from ..textfiles import output_dir, output_file, read_lines  # noqa: F401  (the commands' file checks and reader)


# ------------------------------------------------------------------------------------- a command
def add_command(sub, name: str, settings, func, help: str) -> argparse.ArgumentParser:
    """The sub-parser of one command, every option from its settings dataclass (``settings.add_arguments``);
    ``main`` builds the dataclass from the parsed options, checks its paths and calls ``func(run)``."""
    from ..settings import add_arguments

    p = sub.add_parser(name, help=help, description=help)
    add_arguments(p, settings)
    p.set_defaults(func=func, settings=settings, parser=p)
    return p


def check_device(args):
    """--device and --dtype checked together (no CUDA here, an index past the GPUs, int8 on a GPU), before any
    model is loaded; the torch device (None: the CPU)."""
    from ..hardware import inference_device

    if getattr(args, "device", None) is None:
        return None
    return inference_device(args.device, dtype=getattr(args, "dtype", None))


# ------------------------------------------------------------------------------- shared helpers
def load(model_source: str, dtype=None, max_length=None, device=None):
    """The model (in ``dtype``, on ``device``: --dtype and --device, checked first) and its tokenizer;
    ``max_length`` (from --max-length) is checked against the model."""
    from ..hardware import inference_device
    from ..models import BertModel
    from ..tokenizer import BertTokenizer

    device = inference_device(device, dtype=dtype) if device is not None else None
    model = BertModel.from_pretrained(model_source, dtype=dtype, device=device)
    tokenizer = BertTokenizer.from_pretrained(model_source)
    tokenizer.check_fits(model.config, model_source)
    if max_length is not None:
        check_max_length("--max-length", max_length, model_limit(model.config, tokenizer))
    return model, tokenizer


def tokenize(tokenizer, texts, max_length, truncated):
    """A padded batch, truncated to ``max_length`` tokens (None: the tokenizer's limit). ``truncated``
    collects (1-based number, tokens cut) for the texts that were cut."""
    batch = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    truncated += [(k, n) for k, n in enumerate(batch.num_truncated_tokens, start=1) if n]
    return batch


def report_truncation(truncated, total, limit, what="text"):
    """One line on stderr when texts were truncated: how many, by how much, which (first few)."""
    if not truncated:
        return
    which = ", ".join(str(i) for i, _ in truncated[:5]) + (", ..." if len(truncated) > 5 else "")
    print(f"minibert: note: {len(truncated)} of {total} {what}s had more than {limit} tokens and were truncated "
          f"(up to {max(n for _, n in truncated)} tokens cut; {what}s {which}); --max-length sets the limit",
          file=sys.stderr)


def plot_file(path):
    """--plot's real path (``.png`` added when there is no suffix), checked before any work."""
    if path is None:
        return None
    from ..analysis.plots import output_path

    return output_path(path)


def blank_line_error(path, lines, what="is blank") -> InputError:
    lines = sorted(lines)
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    return InputError(f"{path}: line {lines[0] + 1} {what}{more}; row i of the output is line i, so it would get the "
                      "vector of an empty text ([CLS] [SEP]). Remove such lines, or pass --blank zeros to give "
                      "them a row of zeros")
