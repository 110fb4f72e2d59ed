"""What the commands share: the options written once (parent parsers), loading a model with its tokenizer,
tokenising with a truncation report, reading text files, checking output paths before any work.

Simple ranges (a positive int, a positive number) are argparse types, so a bad value is refused with the
usage line before any work; what depends on the model (a --max-length past its positions) is checked
once the model is loaded. Only argparse and the standard library are imported here: ``minibert --help``
never waits for torch.
"""

from __future__ import annotations

import argparse
import sys

from ..checks import check_max_length, model_limit
from ..errors import InputError
from ..checks import SEED_LIMIT
from ..runs.settings import DEFAULT_MODEL, MODEL_HELP
from ..settings import number_type
from ..textfiles import output_dir, output_file, read_lines  # noqa: F401  (the commands' file checks and reader)

PLOT_FORMATS = ".png (150 dpi), .svg or .pdf; no suffix: .png"


#: the argparse types of the shared options, from the one rule of ``settings.number_type`` (what the run
#: dataclasses' fields use too): a bound reads the same in every command
positive_int = number_type(int, low=1)
#: a truncation length: ``checks.check_max_length``'s lower bound (the upper one, the model's positions, is
#: checked once the model's config is read)
max_length_type = number_type(int, low=3)
positive_float = number_type(float, low=0, strict=True)
non_negative_float = number_type(float, low=0)
non_negative_int = number_type(int, low=0, high=SEED_LIMIT)  # a seed: what numpy takes
fraction = number_type(float, low=0, below=1)  # a probability (a dropout: 1 would drop everything)




# -------------------------------------------------------------------------------- parent parsers
def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


def model_option(help: str = MODEL_HELP, required: bool = False) -> argparse.ArgumentParser:
    """``--model``: the checkpoint a command runs."""
    p = _parent()
    if required:
        p.add_argument("--model", required=True, help=help)
    else:
        p.add_argument("--model", default=DEFAULT_MODEL, help=help)
    return p


def max_length_option(default: int | None = None) -> argparse.ArgumentParser:
    """``--max-length``: inference commands default to the model's limit; training ones to 128 tokens (the
    cost of a step grows with it)."""
    p = _parent()
    if default is None:
        p.add_argument("--max-length", type=max_length_type, default=None,
                       help="truncate texts to this many tokens, [CLS] and [SEP] included (default: the model's "
                            "limit, 512); how many texts were truncated is said on stderr")
    else:
        p.add_argument("--max-length", type=max_length_type, default=default,
                       help=f"truncate texts to this many tokens, [CLS] and [SEP] included (default {default})")
    return p


def batch_size_option(default: int | None = None, help: str | None = None) -> argparse.ArgumentParser:
    """``--batch-size``: texts (rows) per batch, a positive int in every command."""
    p = _parent()
    p.add_argument("--batch-size", type=positive_int, default=default,
                   help=help or f"texts per batch (default {default if default is not None else 32})")
    return p


DEVICE_HELP = "where the model runs: cpu (default), cuda or cuda:N"
DTYPE_HELP = ("the weights' dtype: fp32, bf16, fp16 (a GPU's, or a CPU with AVX-512-BF16 / AMX), int8 (quantised on "
              "load; CPU only); default: as the checkpoint stores them")


def device_options() -> argparse.ArgumentParser:
    """``--device`` and ``--dtype`` of the inference commands, checked before any work
    (``hardware.inference_device``)."""
    from ..names import QUANTISED_DTYPES, SHORT_DTYPES

    p = _parent()
    p.add_argument("--device", help=DEVICE_HELP)
    p.add_argument("--dtype", choices=[*SHORT_DTYPES, *QUANTISED_DTYPES], default=None, help=DTYPE_HELP)
    return p


def check_device(args):
    """--device and --dtype checked together (no CUDA here, an index past the GPUs, int8 on a GPU), before any
    model is loaded; the torch device (None: the CPU)."""
    from ..hardware import inference_device

    if getattr(args, "device", None) is None:
        return None
    return inference_device(args.device, dtype=getattr(args, "dtype", None))


def quiet_option(what: str = "no progress bar") -> argparse.ArgumentParser:
    p = _parent()
    p.add_argument("--quiet", action="store_true", help=what)
    return p


def seed_option() -> argparse.ArgumentParser:
    p = _parent()
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed, an integer >= 0 (default 0)")
    return p


def plot_option(what: str) -> argparse.ArgumentParser:
    p = _parent()
    p.add_argument("--plot", help=f"write {what} to this file ({PLOT_FORMATS})")
    return p


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
