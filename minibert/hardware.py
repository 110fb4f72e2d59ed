"""What this CPU can do, for choices that depend on it (half precision).

Half precision on a CPU is only fast with matrix instructions for it: bf16 needs AVX-512-BF16 or AMX
(x86) or the BF16 extension (Arm); fp16 needs AVX-512-FP16 or AMX-FP16 (x86) or FP16 arithmetic (Arm).
Without them PyTorch converts every product to fp32 and back: measured 3.2x (Intel Xeon, AVX-512 without
bf16) to 8.3x (AMD EPYC, AVX2) slower than plain fp32 on a dense 8 x 128 BERT-base batch. minibert warns
once per process and dtype when a model is put in such a dtype on such a CPU.
"""

from __future__ import annotations

import functools
import os
import platform
import warnings

import torch

from .names import short_dtype_name

#: CPU flags (as /proc/cpuinfo spells them) that give native matrix arithmetic in each dtype
NATIVE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16", "fphp", "asimdhp"),
}
_warned: set = set()


@functools.lru_cache(maxsize=1)
def cpu_info() -> tuple[str, frozenset]:
    """(model name, feature flags) of this CPU from /proc/cpuinfo; ("", empty) where that is not there."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), frozenset(flags)


@functools.lru_cache(maxsize=1)
def cpu_description() -> str:
    """The CPU as a results page names it: the model name with its family / model / stepping numbers
    (two generations can share a name, e.g. "AMD EPYC" on cloud machines)."""
    name, _ = cpu_info()
    ids = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("cpu family", "model", "stepping") and key not in ids:
                    ids[key] = value.strip()
                if not line.strip():
                    break  # the first processor's block is enough
    except OSError:
        pass
    numbers = ", ".join(f"{k} {v}" for k, v in ids.items())
    return f"{name} ({numbers})" if numbers else name


def native_half(dtype: torch.dtype) -> bool | None:
    """True if this CPU has matrix instructions for ``dtype`` (bf16 / fp16), False if it lacks them, None
    when that cannot be told (no /proc/cpuinfo, e.g. macOS or Windows)."""
    _, flags = cpu_info()
    if not flags:
        return None
    return any(flag in flags for flag in NATIVE_FLAGS.get(dtype, ()))


def warn_if_slow(dtype: torch.dtype, device, stacklevel: int = 2) -> None:
    """Warn (once per process and dtype) when a model runs in bf16/fp16 on a CPU without instructions
    for it: it will be several times slower than fp32, not faster."""
    device = torch.device(device if device is not None else "cpu")
    if dtype not in NATIVE_FLAGS or device.type != "cpu" or dtype in _warned or native_half(dtype) is not False:
        return
    _warned.add(dtype)
    name, _ = cpu_info()
    wanted = " or ".join(f for f in NATIVE_FLAGS[dtype] if "_" in f)
    short = short_dtype_name(dtype)
    warnings.warn(f"{short} on this CPU ({name or 'unknown model'}) has no {short} matrix "
                  f"instructions (no {wanted} flag): PyTorch emulates them, which is about 3-8x slower than "
                  "fp32 (measured on BERT-base). Use fp32 here, or a CPU with those instructions",
                  RuntimeWarning, stacklevel=stacklevel + 1)


def training_device(device=None, option: str = "--device", doing: str = "trains") -> torch.device:
    """Where a training run puts its model: ``device`` as PyTorch spells it ("cpu", "cuda", "cuda:1"); None is
    the CPU. Under torchrun a bare "cuda" is this process's GPU (cuda:LOCAL_RANK). A device this machine does
    not have is refused with one line that names ``option``, before any work."""
    from .errors import InputError

    if device is None:
        return torch.device("cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"{option} {device!r} is not a device: use cpu, cuda or cuda:N") from None
    if chosen.type == "cpu":
        if chosen.index not in (None, 0):  # torch takes cpu:N and ignores N: one CPU device, cpu or cpu:0
            raise InputError(f"{option} {device!r}: this machine has one CPU device (cpu, or cpu:0); its threads are "
                             "set with torch.set_num_threads, not an index")
        return chosen
    if chosen.type != "cuda":
        raise InputError(f"{option} {device!r}: minibert {doing} on cpu or cuda")
    if not torch.cuda.is_available():
        raise InputError(f"{option} {device!r}: PyTorch sees no CUDA device on this machine (torch "
                         f"{torch.__version__}, torch.cuda.is_available() is False): use --device cpu")
    count = torch.cuda.device_count()
    index = chosen.index if chosen.index is not None else int(os.environ.get("LOCAL_RANK", "0"))
    if index >= count:
        raise InputError(f"{option} {device!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
                         + (f" (LOCAL_RANK is {index})" if chosen.index is None else ""))
    torch.cuda.set_device(index)  # NCCL and the autocast / GradScaler state follow the current device
    return torch.device("cuda", index)


def same_device(a, b) -> bool:
    """Whether two devices, as torch or a user spells them, are one: ``"cuda"`` is the current GPU
    (``torch.device("cuda") != torch.device("cuda", 0)`` in torch, though a model on cuda:0 runs there),
    ``"cpu"`` and ``"cpu:0"`` the one CPU device."""
    def index(device: torch.device):
        if device.type == "cuda" and device.index is None:
            return torch.cuda.current_device() if torch.cuda.is_available() else 0
        return device.index or 0
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and index(a) == index(b)


def inference_device(device=None, option: str = "--device", dtype=None) -> torch.device:
    """Where an inference command runs its model: as ``training_device`` (the same checks and one-line
    errors), and ``dtype`` "int8" refused on a GPU (its kernels are the CPU's)."""
    from .errors import InputError

    try:
        asked = torch.device(device) if device is not None else None
    except (RuntimeError, TypeError, ValueError):
        asked = None  # training_device says what is wrong with it
    if asked is not None and asked.type == "cuda" and str(dtype) == "int8":
        raise InputError(f"{option} {device!r} with int8: int8 dynamic quantisation runs on the CPU only (its kernels "
                         "are fbgemm's / oneDNN's); on a GPU use fp16 or bf16")
    return training_device(device, option, doing="runs")


@functools.lru_cache(maxsize=1)
def memory_bytes() -> int | None:
    """This machine's memory (MemTotal of /proc/meminfo, in bytes); None where that is not known."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(needed: int, described: str, *, note_above: int, advice: str = "") -> None:
    """A choice that will take ``needed`` bytes (``described`` says what, and how much): refused by an
    InputError when it is more than this machine's memory (``advice``: what to change), said as a warning
    when it is above ``note_above``."""
    from .errors import InputError

    available = memory_bytes()
    if available and needed > available:
        raise InputError(f"{described}: more than this machine's {available / 2**30:.1f} GiB{advice}")
    if needed > note_above:
        warnings.warn(described, stacklevel=3)
