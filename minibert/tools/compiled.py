"""One short input in fewer, faster steps: the readable model compiled ahead of time for this CPU
(``fast.prepare(model, compile=True)``).

What the fast path spends on one 16-token input is not the arithmetic: it is two dozen small products at
16 rows, each a library call with its own fixed cost and threading, and the Python around them (on an AMD
EPYC Zen 3, 1 x 16 through all-MiniLM-L6-v2: 6.9 ms of products and 1.2 ms outside any operator, where ONNX
Runtime's whole forward takes 3.7 ms). Here the readable model (``model.py``, nothing of the fast path's) is
exported by ``torch.export`` for one sequence of 2..``MAX_ROWS`` real tokens (a dynamic length) and compiled
ahead of time by AOTInductor with its weights frozen in, its products tuned for this CPU at ``HINT_ROWS``
rows (Inductor's max-autotune chooses between its own generated GEMM kernels and ATen's, by timing them):
one C++ call a forward, no Python between operators, bias, residual and GELU fused into the products' loops.

Kept only where it measures faster: after compiling, the compiled forward and the fast path's own are timed
side by side on one input of each of ``TIMED_LENGTHS`` real tokens, and the compiled one serves the lengths
up to the longest where it was faster (by more than ``MARGIN``) at that length and every shorter one timed;
any other call runs the fast path as before (a batch, padding, a longer input, early exit, skipped blocks,
hooks, attention maps). It returns every hidden state; the pooler runs as the model's.

The artefact (a ``.pt2`` package) is built once per machine and weights and kept under ``$MINIBERT_CACHE``
(``compiled/``; ``measured.cache_dir``), written to a temporary name and renamed into place, with its record
in ``compiled.json``: the machine key (CPU model and flags, threads, torch version), the fingerprint of the
weights and configuration it froze (``weights_fingerprint``: a changed checkpoint has another key, so it is
never served by a stale artefact), the artefact's sha256 (a damaged file is built again), the compile time
and the times measured. Compiling takes about a minute for all-MiniLM-L6-v2 on 2 cores, said in the log
(INFO, ``minibert.logs``); ``prepare(model, compile=True)`` does it, or loads what is kept, before the
first query. The weights are frozen in: a weight edited in place, replaced or moved after preparing (or another torch thread count)
sends every call to the fast path (said once), until ``prepare(model, compile=True)`` is called again.

It sums in its own order (fp32 rounding apart from ``F.linear``), so it is held to the fast path's bound on
oneDNN's own order (``fast.NOISE_FACTOR["onednn"]``), and ``compile=True`` refuses the exact routes
(``fp32_kernel="linear"`` or ``"blocked"``). Where it cannot be built -- no C++ compiler, a model that is not
fp32 on a CPU, an int8 model, a norm placement other than BERT's -- the fast path runs as today and says why,
once a process (a ``RuntimeWarning``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
from pathlib import Path

import torch

from .. import measured
from ..model import BertModel
from ..errors import first_line
from ..quantize import Int8Linear
from ..textfiles import file_sha256
from . import timing
from .copies import version_of
from .fingerprint import weights_fingerprint
from .plan import SHORT_ROWS

log = logging.getLogger(__name__)

MIN_ROWS = 2  # torch.export's dynamic length starts at 2 (a length of 1 would be specialised away)
MAX_ROWS = SHORT_ROWS  # one short input: the row bucket the fast path's "short" plan serves
HINT_ROWS = 16  # the length the export is traced at and the products are tuned for
TIMED_LENGTHS = (8, 16, 32, 48, 64)  # the lengths it is timed against the fast path on, after compiling
MARGIN = 0.97  # taken at a length only where it takes less than 97 % of the fast path's time there
ROUNDS = 15  # alternating rounds of that timing
INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
FOLDER = "compiled"  # under $MINIBERT_CACHE
RECORD = "compiled.json"

_SAID: set[str] = set()


def say_once(message: str) -> None:
    """``message`` as a ``RuntimeWarning``, once a process (a call that cannot use the compiled forward says
    why, as the library says a slow dtype on this CPU: shown without any logging set up)."""
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def why_not(model: BertModel) -> str | None:
    """Why ``model`` cannot have a compiled forward here, or None where it can."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"it compiles fp32 models on a CPU; this one is {model.dtype} on {model.device}"
    if isinstance(model.encoder.blocks[0].attn.query, Int8Linear):
        return "it compiles fp32 models; this one is int8 (minibert.quantize)"
    if model.config.norm_placement != "post":
        return f"it compiles BERT's post-LN blocks; this model's norm placement is {model.config.norm_placement!r}"
    return compiler_missing()


def compiler_missing() -> str | None:
    """Why AOTInductor cannot compile on this machine (no C++ compiler, no Inductor), or None."""
    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
    except Exception as error:  # InvalidCxxCompiler, or an Inductor this torch lacks
        return (f"no C++ compiler for AOTInductor here ({first_line(error) or type(error).__name__}); install g++ "
                "or set $CXX")
    return None


def key_of(model: BertModel) -> str:
    """What an artefact froze: the weights' fingerprint and the configuration (epsilon, activation, ...)."""
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(f"{weights_fingerprint(model)}|{config}".encode()).hexdigest()[:24]


class _Encoder(torch.nn.Module):
    """The readable model as one sequence of real tokens to its hidden states: what is exported."""

    def __init__(self, model: BertModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids, token_type_ids, position_ids):  # each (1, T)
        return BertModel.forward(self.model, input_ids, None, token_type_ids, position_ids).hidden_states  # (1, T, H) each


def _example(model: BertModel, rows: int):
    ids = torch.full((1, rows), 1000 % model.config.vocab_size, dtype=torch.long)
    return ids, torch.zeros_like(ids), torch.arange(rows).unsqueeze(0)


def build(model: BertModel, path: Path) -> None:
    """Export ``model`` for one sequence of ``MIN_ROWS``..``MAX_ROWS`` tokens and compile it into ``path``."""
    longest = min(MAX_ROWS, model.config.max_position_embeddings)
    length = torch.export.Dim("T", min=MIN_ROWS, max=longest)
    with torch.no_grad():
        program = torch.export.export(_Encoder(model), _example(model, min(HINT_ROWS, longest)),
                                      dynamic_shapes=({1: length}, {1: length}, {1: length}), strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=dict(INDUCTOR))


def load(path: Path):
    """The compiled forward kept in ``path``: called as ``(input_ids, token_type_ids, position_ids)``, it returns
    every hidden state."""
    return torch._inductor.aoti_load_package(str(path))


def time_against_fast(model: BertModel, runner, fast_forward) -> dict[int, float]:
    """compiled / fast path time (median over ``ROUNDS`` alternating rounds) at each of ``TIMED_LENGTHS``."""
    ratios = {}
    with torch.inference_mode():
        for rows in TIMED_LENGTHS:
            if rows > min(MAX_ROWS, model.config.max_position_embeddings):
                continue
            inputs = _example(model, rows)
            times = timing.alternate({"compiled": lambda: runner(*inputs), "fast": lambda: fast_forward(*inputs)},
                                     ROUNDS, warmup=2)
            ratios[rows] = timing.paired_ratio(times, "compiled", "fast")
    return ratios


def serves_up_to(ratios: dict[int, float]) -> int:
    """The longest input the compiled forward serves: the longest timed length where it was faster, as at
    every shorter one (0: none)."""
    up_to = 0
    for rows in sorted(ratios):
        if ratios[rows] >= MARGIN:
            break
        up_to = rows
    return up_to


class Compiled:
    """A compiled forward and what it was built from: ``serves(rows)``; ``(ids, tts, pos)`` -> every hidden
    state, (1, T, H) each (the last is the last hidden state)."""

    def __init__(self, model: BertModel, runner, entry: dict, path: Path, copies):
        self.runner, self.entry, self.path = runner, entry, path
        self.up_to = int(entry["up_to"])
        # what it froze, as it was: the fast path's copies (``tools.copies``: the encoder's weights edited in
        # place, any module or parameter replaced or moved, another thread count make them stale) and the
        # embeddings' version counters (the copies read those where they are and do not count their edits)
        self.copies = copies
        self.embeddings = list(model.embeddings.parameters())
        self.versions = [version_of(p) for p in self.embeddings]

    def __repr__(self) -> str:
        return f"Compiled({self.path.name}, serves {MIN_ROWS}..{self.up_to} real tokens)"

    def serves(self, rows: int) -> bool:
        return MIN_ROWS <= rows <= self.up_to

    def stale(self, copies) -> bool:
        """Whether the weights it froze have changed since: ``copies`` is the fast path's current set."""
        return copies is not self.copies or [version_of(p) for p in self.embeddings] != self.versions

    def __call__(self, input_ids, token_type_ids, position_ids) -> list[torch.Tensor]:
        return self.runner(input_ids, token_type_ids, position_ids)


def compiled_for(model: BertModel, copies, fast_forward) -> Compiled | None:
    """The compiled forward of ``model`` on this machine: loaded from the cache where one was built for these
    weights here, else built, timed against ``fast_forward`` (the fast path's forward of ``(ids, tts, pos)``)
    and kept; ``copies``: the fast path's weight copies now (``Compiled.stale``). None -- said once, with the
    reason -- where it cannot be built or is nowhere faster."""
    reason = why_not(model)
    if reason is not None:
        say_once(f"fast path: no compiled forward, {reason}; the fast path runs as it is")
        return None
    folder = measured.cache_dir() / FOLDER
    record, machine, key = measured.cache_dir() / RECORD, measured.machine_key(), key_of(model)
    name = f"{key}-{hashlib.sha256(machine.encode()).hexdigest()[:8]}.pt2"
    made = {}

    def usable(entry) -> bool:
        kept = folder / str(entry.get("file", ""))
        return kept.is_file() and entry.get("sha256") == file_sha256(kept) and isinstance(entry.get("up_to"), int)

    def measure() -> dict:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.{os.getpid()}.tmp.pt2"
        log.info("fast path: compiling %s for one input of %d..%d tokens on this CPU (AOTInductor, "
                 "about a minute for all-MiniLM-L6-v2 on 2 cores)", getattr(model, "source", "the model"),
                 MIN_ROWS, MAX_ROWS)
        start = time.perf_counter()
        try:
            build(model, tmp)
            os.replace(tmp, folder / name)
        finally:
            tmp.unlink(missing_ok=True)
        seconds = time.perf_counter() - start
        made["runner"] = runner = load(folder / name)
        ratios = time_against_fast(model, runner, fast_forward)
        return {"file": name, "sha256": file_sha256(folder / name), "compile_s": round(seconds, 1),
                "ratio_to_fast": {str(rows): round(r, 3) for rows, r in ratios.items()},
                "up_to": serves_up_to(ratios), "torch": torch.__version__}

    try:
        entry = measured.measure_once(record, machine, key, usable, measure)
        ratios = ", ".join(f"{r} at {rows}" for rows, r in entry["ratio_to_fast"].items())
        if entry["up_to"] == 0:
            say_once(f"fast path: the compiled forward is nowhere faster than the fast path here (time ratio "
                     f"{ratios}); the fast path runs as it is")
            return None
        runner = made.get("runner") or load(folder / entry["file"])
    except Exception as error:  # export or compilation failed: the fast path as it is
        say_once(f"fast path: the compiled forward could not be built ({type(error).__name__}: "
                 f"{first_line(error)}); the fast path runs as it is")
        return None
    compiled = Compiled(model, runner, entry, folder / entry["file"], copies)
    log.info("fast path: compiled forward %s (compiled in %s s; time / the fast path's: %s): it serves one input "
             "of %d..%d real tokens", compiled.path, entry["compile_s"], ratios, MIN_ROWS, compiled.up_to)
    return compiled
