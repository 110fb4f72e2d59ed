"""``minibert export``: a model in the forms teams deploy -- an ONNX graph (``onnx``) or a CTranslate2 folder
(``ct2``) -- each checked against the model as it is written (``minibert.compat.export``). What a deployed
model differs by, layer by layer, is ``minibert parity --against`` (``cli/analysis.py``)."""

from __future__ import annotations

from ..errors import InputError
from .common import add_command
from .settings import ExportCommand


def add_export(sub) -> None:
    add_command(sub, "export", ExportCommand, cmd_export,
                "a model as an ONNX graph or a CTranslate2 folder, checked against the model")


def cmd_export(args) -> int:
    from ..compat.export import to_ct2, to_onnx

    if args.format == "onnx":
        to_onnx(args.model, args.out, hidden_states=args.hidden_states, optimize=args.optimize, int8=args.int8,
                opset=args.opset, overwrite=args.overwrite)
        return 0
    unused = [flag for flag, on in (("--hidden-states", args.hidden_states), ("--optimize", args.optimize)) if on]
    if unused:
        raise InputError(f"{', '.join(unused)}: ONNX options; a CTranslate2 model has no graph to add outputs to or "
                         "optimise (it exposes the last hidden state and the pooler)")
    to_ct2(args.model, args.out, quantization="int8" if args.int8 else None, overwrite=args.overwrite)
    return 0


COMMANDS = [add_export]
