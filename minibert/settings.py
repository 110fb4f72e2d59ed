"""A run's settings, declared once: a dataclass whose fields carry their type, default, bounds and help.

    @dataclass
    class ExitsRun:
        epochs: int = setting(2, "passes over the training file", low=1)
        lr: float | None = setting(None, "learning rate", low=0.0, strict=True, default_text="1e-3")

From that one declaration come the checks (``check(run)``: every field's type, bounds and choices, the
error naming the field, its flag and the limit), the command line (``add_arguments(parser, ExitsRun)``:
``--epochs``, ``--lr``, ... with their help and defaults; argparse refuses a bad value with the same
words), the instance a command builds from its parsed arguments (``from_args``) and, through the parser,
the CLI reference page (``tools/gen_docs.py``). The Python API takes the same dataclass, so a setting is
spelt, bounded and documented in one place. Standard library only: ``minibert --help`` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from typing import Any

from .errors import InputError

_KEY = "minibert"  # the field metadata entry that holds a setting's description
PATH_KINDS = ("model", "read", "run", "file")


@dataclasses.dataclass(frozen=True)
class Setting:
    """What one field says about itself beyond its type and default."""

    help: str
    low: float | None = None  # the lowest value, inclusive unless ``strict`` ("> 0")
    high: float | None = None  # the highest value, inclusive; or
    below: float | None = None  # an upper bound the value stays under ("< 1")
    strict: bool = False
    choices: tuple | None = None
    flag: str | None = None  # the option's name when it is not --field-name
    required: bool = False  # the command line must give it (the Python API then has no default either)
    cli: bool = True  # False: Python only (e.g. a callable)
    default_text: str | None = None  # how the help states a default of None (e.g. "the recipe's")
    negate: bool = False  # a bool field whose flag turns it off (``progress`` <- ``--quiet``)
    nargs: str | None = None  # a tuple field given as several words ("+": one or more) instead of commas
    positional: bool = False  # the command line gives it by position (``minibert embed TEXTS``), not by a flag
    finite: bool = True  # a float must be finite (nan and inf are refused) unless infinity means something here
    #: what a path setting names, so that one rule (``outputs.check_paths``) keeps every written path off every
    #: read one: "model" (a model or run folder read -- the whole folder is protected), "read" (a data file or
    #: folder read), "run" (a run folder written: ``outputs.RunFolder``), "file" (a file written)
    path: str | None = None
    suffix: str | None = None  # "file": the suffix the writer adds (``.npy``)
    formats: tuple | None = None  # "file": the suffixes the writer takes (a plot's); ``suffix`` only when none
    companions: tuple = ()  # "file": files written beside it, the suffix replaced (a search index's ``.json``)


def setting(default: Any = dataclasses.MISSING, help: str = "", *, required: bool = False, **about):
    """A dataclass field that describes itself (see the module docstring): ``about`` takes ``Setting``'s
    fields (``low``, ``high``, ``below``, ``strict``, ``choices``, ``flag``, ``cli``,
    ``default_text``, ``negate``, ``nargs``). A list or dict default is given as a callable (``default=list``), as
    dataclasses want it."""
    if about.get("choices") is not None:
        about["choices"] = tuple(about["choices"])
    if about.get("path") not in (None, *PATH_KINDS):
        raise ValueError(f"path={about['path']!r}: use one of {PATH_KINDS}")
    meta = {_KEY: Setting(help, required=required, **about)}
    if required:
        return dataclasses.field(metadata=meta)
    if callable(default) and not isinstance(default, type) and default is not None:
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def described(cls) -> list[tuple[dataclasses.Field, Setting, Any]]:
    """(field, its Setting, its type) for every described field of ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata[_KEY], hints[f.name]) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def flag_of(field: dataclasses.Field, about: Setting) -> str:
    """How messages name the setting: its option (``--out``), or for a positional argument its name in
    capitals (``TEXTS``), as the usage line shows it."""
    if about.positional:
        return field.name.upper()
    return about.flag or "--" + field.name.replace("_", "-")


def _unwrap(kind) -> tuple[Any, bool]:
    """(the annotation without ``| None``, whether None is allowed)."""
    args = typing.get_args(kind)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else object), True
    return kind, False


def _base(kind) -> tuple[type, bool]:
    """(the plain type, whether None is allowed) of an annotation such as ``int | None`` or
    ``tuple[str, ...] | None`` (-> tuple)."""
    inner, optional = _unwrap(kind)
    return (typing.get_origin(inner) or inner), optional


def _item_type(kind) -> type:
    """The items' type of a tuple annotation (``tuple[int, ...]`` -> int; str when not said)."""
    args = typing.get_args(_unwrap(kind)[0])
    return args[0] if args and isinstance(args[0], type) else str


def _number(x) -> str:
    if x == 2**32 - 1:
        return "2**32 - 1"  # the seed limit, as numpy states it
    return str(int(x)) if float(x).is_integer() and abs(x) >= 1e6 else f"{x:g}"


def _bounds_text(about: Setting) -> str:
    low, top = about.low, about.high if about.high is not None else about.below
    if low is not None and top is not None:
        return (f"in {'(' if about.strict else '['}{_number(low)}, {_number(top)}"
                f"{']' if about.below is None else ')'}")
    if low is not None:
        return f"{'>' if about.strict else '>='} {_number(low)}"
    if top is not None:
        return f"{'<=' if about.below is None else '<'} {_number(top)}"
    return ""


def _out_of_bounds(value, about: Setting) -> bool:
    """Whether a number lies outside a setting's bounds (for a tuple setting: each of its items)."""
    too_low = about.low is not None and (value <= about.low if about.strict else value < about.low)
    return too_low or (about.high is not None and value > about.high) or (about.below is not None
                                                                          and value >= about.below)


def check_value(name: str, value, kind, about: Setting):
    """``value`` for the field ``name`` (its type ``kind``, its ``Setting``), checked; returns it (an int
    given for a float, or a list for a tuple, converted). Raises InputError naming the field and the limit."""
    base, optional = _base(kind)
    if base in (object, Any):  # anything (a callable, a model): the field's user checks it
        return value
    if value is None:
        if optional:
            return None
        raise InputError(f"{name} is required")
    if base is bool:
        if not isinstance(value, bool):
            raise InputError(f"{name}={value!r}: pass True or False")
        return value
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise InputError(f"{name}={value!r} must be an int{' ' + _bounds_text(about) if _bounds_text(about) else ''}")
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InputError(f"{name}={value!r} must be a number")
        value = float(value)
        if about.finite and not math.isfinite(value):
            bounds = _bounds_text(about)
            raise InputError(f"{name}={value!r} must be a finite number{' ' + bounds if bounds else ''}")
    if base is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise InputError(f"{name}={value!r} must be a list or tuple")
        value = tuple(value)
        if any(isinstance(v, float) and about.finite and not math.isfinite(v) for v in value):
            raise InputError(f"{name}={value!r}: every value must be a finite number")
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) and _out_of_bounds(v, about) for v in value):
            raise InputError(f"{name}={value!r}: every value must be {_bounds_text(about)}")
    if base is str and isinstance(value, os.PathLike):
        value = os.fspath(value)  # a path given for a file or folder setting
    if base is str and not isinstance(value, str):
        raise InputError(f"{name}={value!r} must be a string")
    if about.choices is not None and value not in about.choices:
        raise InputError(f"{name}={value!r}: use one of {', '.join(map(str, about.choices))}")
    if base in (int, float):
        if _out_of_bounds(value, about):
            raise InputError(f"{name}={value!r} is out of range: it must be {_bounds_text(about)}")
    return value


def check(run) -> None:
    """Check every described field of the dataclass instance ``run`` (types, bounds, choices), normalising
    ints given for floats and lists for tuples in place; the message names the setting as the user gave it
    (its option, ``--out``; a Python-only setting by its field name)."""
    for field, about, kind in described(type(run)):
        name = flag_of(field, about) if about.cli else field.name
        object.__setattr__(run, field.name, check_value(name, getattr(run, field.name), kind, about))


# ------------------------------------------------------------------------------------- the command line
def number_type(kind: type, *, low=None, high=None, below=None, strict: bool = False, finite: bool = True):
    """An argparse ``type`` for an int or float option with these bounds (as ``setting`` takes them): a
    value out of them is refused by argparse, "must be in [0, 1), got 1.5"; nan and inf too, unless
    ``finite=False``. Every described field's option uses it, so one bound reads the same everywhere."""
    about = Setting("", low=low, high=high, below=below, strict=strict)

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if kind is float and finite and not math.isfinite(value):
            bounds = _bounds_text(about)
            raise argparse.ArgumentTypeError(f"must be a finite number{' ' + bounds if bounds else ''}, got {text}")
        if _out_of_bounds(value, about):
            raise argparse.ArgumentTypeError(f"must be {_bounds_text(about)}, got {_number(value)}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _parser_type(about: Setting, kind):
    """The argparse ``type`` of a field: numbers by ``number_type``, a tuple from comma-separated items."""
    base, _ = _base(kind)
    if base is object:  # a path, or in Python something else too (a list of texts): the command line gives text
        return str
    if base in (int, float):
        return number_type(base, low=about.low, high=about.high, below=about.below, strict=about.strict,
                           finite=about.finite)
    if base is tuple:
        item = _item_type(kind)

        def items(text: str) -> tuple:
            try:
                values = tuple(item(t.strip()) for t in text.split(",") if t.strip())
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r}: every item must be a{'n' if item is int else ''} "
                                                 f"{item.__name__}") from None
            if item is float and about.finite and not all(math.isfinite(v) for v in values):
                raise argparse.ArgumentTypeError(f"{text!r}: every value must be a finite number")
            if item in (int, float) and any(_out_of_bounds(v, about) for v in values):
                raise argparse.ArgumentTypeError(f"{text!r}: every value must be {_bounds_text(about)}")
            return values
        items.__name__ = "list"
        return items
    return base


def help_text(field: dataclasses.Field, about: Setting) -> str:
    """The option's help: the description, then its default as the user meets it (argparse's ``%`` escaped)."""
    return _help_text(field, about).replace("%", "%%")


def _help_text(field: dataclasses.Field, about: Setting) -> str:
    if about.required:
        return about.help
    default = field.default if field.default is not dataclasses.MISSING else None
    if isinstance(default, bool):
        return about.help
    if default is None:
        shown = about.default_text
    elif isinstance(default, tuple):
        shown = ",".join(map(str, default))
    else:
        shown = f"{default:g}" if isinstance(default, float) else str(default)
    return f"{about.help} (default {shown})" if shown else about.help


class _Given:
    """An argparse action that also notes its option as given (``given(args)``): a preset (``--quick``) then
    changes only what the command line left at its default."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.__dict__.setdefault("_given", set()).add(self.dest)


class _Store(_Given, argparse._StoreAction):
    pass


class _StoreTrue(_Given, argparse._StoreTrueAction):
    pass


class _StoreFalse(_Given, argparse._StoreFalseAction):
    pass


def given(args: argparse.Namespace) -> set[str]:
    """The fields whose options the command line was given (not left at their defaults)."""
    return set(getattr(args, "_given", ()))


def add_arguments(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """An option on ``parser`` for every described field of ``cls`` that the
    command line takes (``cli=True``), except those named in ``skip``; returns the parser."""
    fields = described(cls)  # what a command must be given first, then declaration order (a base class's first)
    for field, about, kind in sorted(fields, key=lambda f: not f[1].required):
        if not about.cli or field.name in skip:
            continue
        base, _ = _base(kind)
        if about.positional:  # given by position: argparse takes its name as the destination
            options = {"help": help_text(field, about), "type": _parser_type(about, kind), "action": _Store,
                       "metavar": flag_of(field, about)}
            if about.nargs is not None:
                options |= {"nargs": about.nargs, "type": _item_type(kind) if base is tuple else options["type"]}
            if about.choices is not None:
                options["choices"] = about.choices
            parser.add_argument(field.name, **options)
            continue
        names = [flag_of(field, about)]
        if base is bool:
            parser.add_argument(*names, dest=field.name, action=_StoreFalse if about.negate else _StoreTrue,
                                default=field.default, help=help_text(field, about))
            continue
        options = {"dest": field.name, "help": help_text(field, about), "type": _parser_type(about, kind),
                   "action": _Store}
        if about.nargs is not None:  # several words, each an item
            options |= {"nargs": about.nargs, "type": _item_type(kind)}
        if about.choices is not None:
            options["choices"] = about.choices
        if about.required:
            options["required"] = True
        else:
            options["default"] = field.default if field.default is not dataclasses.MISSING else None
        parser.add_argument(*names, **options)
    return parser


def from_args(cls, args: argparse.Namespace, **more):
    """An instance of ``cls`` from parsed command-line arguments (the fields the parser has), plus ``more``
    (fields the command fills itself); checked."""
    values = {f.name: getattr(args, f.name) for f, about, _ in described(cls) if about.cli and hasattr(args, f.name)}
    run = cls(**{**values, **more})
    check(run)
    return run


def base_of(run, cls):
    """The ``cls`` part of ``run``, an instance of a subclass of ``cls`` (a run's dataclass extends the loop's
    settings: ``base_of(finetune_run, FitConfig)`` is what the loop takes)."""
    return cls(**{f.name: getattr(run, f.name) for f in dataclasses.fields(cls)})
