"""The ``minibert`` command line: one module per group of commands; each command's options are declared by a
settings dataclass (``cli/settings.py`` for the commands that do not train, ``runs/settings.py`` for those
that do), from which its parser, checks, reference page and path rule come.

    minibert encode "some text" ["another text" ...] [--model M] [--layer -1] [--pool cls|mean|max] [--format json]
    minibert embed texts.txt --layers -4: --pool mean --out vectors.npy
    minibert search corpus.txt "a query" [--top-k 5] [--index idx.npy]
    minibert layers "some text" [--model M] [--plot out.png]
    minibert probe data.conllu [--model M] [--column upos] [--plot out.png]
    minibert map data.conllu|data.csv|texts.txt --model M --out map.png [--layers all] [--method pca|tsne|umap]
    minibert fill "The capital of France is [MASK]." [--model M] [--top-k 5] [--lens] [--plot lens.png]
    minibert parity --model M [--against B|model.onnx|model.xml|CT2_DIR] [--dtype fp32|bf16|fp16|int8] [--texts FILE]
                    [--json out.json] [--atol X]
    minibert export onnx|ct2 --model M --out DIR [--hidden-states] [--optimize] [--int8]
    minibert inspect [--model M] [--batch-size 8] [--lengths 128,512]
    minibert finetune --train train.csv --eval test.csv --model M --out DIR [--task classify|regress|tag] ...
    minibert predict DIR texts.txt
    minibert distill --teacher T --out DIR --texts corpus.txt [--student-blocks 0,2,4]      (sentence embeddings)
    minibert distill --teacher FINETUNED --out DIR --train train.csv --eval test.csv [--task classify|tag]
    minibert exits --model FINETUNED --train train.csv --eval test.csv --out DIR [--joint]        (early exit)
    minibert pretrain --corpus FILE... --out DIR (--model M | --geometry mini --vocab FOLDER) --steps N   (MLM)
    minibert probe-over-time RUN data.conllu [--plot out.png] [--json out.json]   (a run's --snapshots)
    minibert depth-study --corpus FILE... --vocab V --eval-texts F --out DIR [--quick] [--conllu F] [--depths 1,2,4]

    cli/settings.py   the inference commands' settings, declared once (and RENAMED: old spellings refused)
    cli/common.py     a command's parser from its dataclass, loading, truncation reports, file checks
    cli/encoding.py   encode, embed, search
    cli/analysis.py   layers, probe, probe-over-time, map, fill, parity, inspect
    cli/training.py   finetune, predict, distill, exits, pretrain, depth-study
    cli/deploy.py     export

A new command: its settings dataclass (every path field saying what it is: ``path="model"``, ``"read"``,
``"run"`` or ``"file"``), an ``add_<name>(sub)`` calling ``common.add_command`` and ``cmd_<name>(run)`` right
below it, taking the checked dataclass and calling library functions; list ``add_<name>`` in its module's
``COMMANDS``. ``main`` checks every declared path before the handler runs (``outputs.check_paths``) and
records the files it wrote (``outputs.note_written``). ``parity`` exits 1 when a layer differs by more than
the tolerance.

Errors about what the user gave -- files, models, checkpoints, options, inputs -- are printed as one line
(``minibert: error: ...``), exit code 2; anything else is a bug and keeps its traceback. Output cut short
by a closed pipe (``minibert encode ... | head``) ends quietly. Texts longer than ``--max-length`` tokens
(default: the model's limit, 512) are truncated, and the command says how many on stderr.

Only argparse is imported up front: ``--help`` and argument errors never wait for torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from ..errors import InputError, MissingExtra
from . import analysis, deploy, encoding, training
from .common import DEFAULT_MODEL, read_lines  # noqa: F401  (public: minibert.cli.read_lines)

#: the order ``minibert --help`` lists them in
COMMANDS = [encoding.add_encode, analysis.add_layers, analysis.add_probe, encoding.add_embed, encoding.add_search,
            analysis.add_inspect, analysis.add_parity, analysis.add_fill, training.add_finetune,
            training.add_distill, training.add_exits, analysis.add_map, training.add_predict, training.add_pretrain,
            analysis.add_probe_over_time, training.add_depth_study, deploy.add_export]
assert set(COMMANDS) == set(encoding.COMMANDS + analysis.COMMANDS + training.COMMANDS + deploy.COMMANDS), \
    "a command left unlisted"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minibert", description="A readable, exact BERT encoder.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
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


def _refuse_renamed(parser, argv) -> None:
    """A spelling that means something else in this command (``settings.RENAMED``): one line naming the new
    one, exit 2 -- never taken as an alias."""
    from .settings import RENAMED

    if not argv or argv[0] not in RENAMED:
        return
    for token in argv[1:]:
        for old, new in RENAMED[argv[0]].items():
            if token == old or token.startswith(old + "="):
                parser.exit(2, f"minibert {argv[0]}: error: {old} is now {new}\n")


def _stamp(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def main(argv=None) -> int:
    parser = build_parser()
    argv = _join_negative_values(sys.argv[1:] if argv is None else argv)
    _refuse_renamed(parser, argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser: its usage line and its name
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        from ..outputs import check_paths, note_written
        from ..settings import from_args

        run = from_args(args.settings, args)
        if hasattr(run, "with_preset"):  # a preset changes only what the command line left at its default
            from ..settings import given

            run = run.with_preset(given(args))
        written = check_paths(run)  # every written path against every read one, before any work
        before = {path: _stamp(path) for path in written}
        with warnings.catch_warnings():  # restores showwarning afterwards (main may be called in-process)
            warnings.showwarning = _warning_line
            try:
                code = args.func(run)
            finally:  # what the command wrote is recorded as minibert's (a later run may replace it)
                for path in written:
                    if _stamp(path) not in (None, before[path]):
                        note_written(path, args.command)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader went away (`minibert encode ... | head`): stop quietly, as Unix tools do. Point stdout
        # at /dev/null so the interpreter's final flush cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # killed by SIGPIPE, as a shell reports it
    except KeyboardInterrupt as e:  # Ctrl-C: a run that holds an output folder says where it can go on from
        if e.args:
            print(f"minibert: interrupted: {e.args[0]}", file=sys.stderr)
        return 130
    except FileNotFoundError as e:  # one form: what was not found, and where it was looked for
        if e.filename is not None:
            e = f"{e.filename!r} not found (looked for {os.path.abspath(os.fsdecode(e.filename))})"
        parser.exit(2, f"minibert: error: {e}\n")
    except USER_ERRORS as e:
        parser.exit(2, f"minibert: error: {e.for_shell() if isinstance(e, InputError) else e}\n")
    except OSError as e:  # the disk is full, a device failed, ...: about the machine, not minibert
        if e.filename is None:
            raise
        parser.exit(2, f"minibert: error: {e}\n")
