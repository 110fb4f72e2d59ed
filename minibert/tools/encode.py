"""Texts to vectors: the one loop that tokenises, batches by length, runs the fast path and pools.

    from minibert.tools.encode import encode_texts
    vectors = encode_texts(model, tokenizer, texts, pooling="mean", normalize=True)   # (N, H) float32

``minibert embed``, ``SentenceEncoder.encode``, distillation's teacher vectors and ``search`` all call it
(or ``encode_ids`` on ids they already have), so batching, pooling and the output order are decided in one
place: batches follow ``tools.batching.plan_batches`` (longest first, by count or by a token budget), each
row's vector is written back to its own index, and a model of any kind the library makes runs on the fast
path (``tools.fast``: a task model's encoder, int8, LoRA, bf16; vectors come back as float32). The fast
path keeps only the hidden states that are pooled.

On a GPU (``device="cuda"``, or a model already there) the work is laid out for it: a background thread
tokenises and collates the next batches while the GPU runs this one (``overlap``; texts ordered by their
length in characters, batched by their true token counts within slabs of ``SLAB`` texts), batches go to
the GPU from pinned memory without blocking, batches default to a token budget (``GPU_MAX_TOKENS``), and
the vectors stay on the GPU until they reach ``FLUSH_BYTES``, then go back in one copy (a corpus of any
size holds at most that much there). Output order and values are the same (fp32: within 1e-6 of the
CPU's vectors).
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..checks import check_index, encoder_of
from ..errors import InputError
from ..hardware import inference_device
from .batching import collate, plan_batches, prefetch
from .fast import host_packing, prepare
from .pooling import pool
from .progress import progress_bar

#: the token budget of a batch on a GPU when neither batch_size nor max_tokens is given
GPU_MAX_TOKENS = 16384
#: texts tokenised at a time by the overlapping worker (then batched by their true lengths)
SLAB = 2048
#: the device types on which ``encode_texts`` tokenises in a background thread while the model runs (on a
#: CPU the thread would take a core from the model)
OVERLAP_DEVICES = ("cuda",)


def on_device(encoder, device):
    """``encoder`` where ``device`` says (None: where it is). A model elsewhere is copied there for this call,
    never moved: the caller's model stays as it was. int8 stays on the CPU (refused elsewhere)."""
    if device is None:
        return encoder
    target = inference_device(device, option="device", dtype=getattr(encoder, "quantized", None))
    if target == encoder.device:
        return encoder
    return copy.deepcopy(encoder).to(target)


class _Pooling:
    """The options of one encoding, checked once: pooling modes, layers and how they join."""

    def __init__(self, encoder, pooling, layer, combine, normalize):
        self.modes = [pooling] if isinstance(pooling, str) else list(pooling)
        if not self.modes:
            raise InputError("pooling: name at least one mode")
        L = encoder.config.num_hidden_layers
        self.layers = [layer] if isinstance(layer, int) else list(layer)
        for i in self.layers:
            check_index("layer", i, -(L + 1), L, f"the model has hidden states 0..{L}; -1 is the last")
        if not self.layers:
            raise InputError("layer: name at least one hidden state")
        if combine not in ("concat", "mean"):
            raise InputError(f"combine={combine!r}: use 'concat' or 'mean'")
        self.combine, self.normalize = combine, normalize
        self.width = encoder.config.hidden_size * len(self.modes) * (len(self.layers) if combine == "concat" else 1)

    def __call__(self, run, batch, packing=None) -> torch.Tensor:
        """(B, width) float32 vectors of one batch, on the model's device (``packing``: made on the host,
        ``fast.host_packing``)."""
        extra = {} if packing is None else {"packing": packing}
        # only the pooled states are kept; the pooler is not run (its vector is not one of the modes)
        result = run(**batch, output_hidden_states=self.layers, pooler=False, **extra)
        per_layer = [torch.cat([pool(result.hidden_states[i], batch["attention_mask"], m) for m in self.modes], -1)
                     for i in self.layers]  # each (B, H x modes)
        vectors = (torch.cat(per_layer, -1) if self.combine == "concat" else torch.stack(per_layer).mean(0)).float()
        return F.normalize(vectors, p=2, dim=-1) if self.normalize else vectors


class _Collector:
    """Vectors made on a device, written to their rows of ``out`` (CPU): on the CPU at once; elsewhere kept
    on the device and copied back in one transfer each time they reach ``flush_bytes`` (and at the end), so
    a corpus of any size holds at most ``flush_bytes`` of vectors (plus one batch) on the GPU, and the GPU
    waits for the host once per flush, not per batch."""

    def __init__(self, out: torch.Tensor, on_device: bool, flush_bytes: int):
        self.out, self.on_device, self.flush_bytes = out, on_device, flush_bytes
        self.rows, self.vectors, self.held = [], [], 0
        self.flushes = self.most_held = 0

    def add(self, rows, vectors: torch.Tensor) -> None:
        if not self.on_device:
            self.out[torch.as_tensor(rows)] = vectors
            return
        self.rows.append(torch.as_tensor(rows))
        self.vectors.append(vectors)
        self.held += vectors.numel() * vectors.element_size()
        self.most_held = max(self.most_held, self.held)
        if self.held >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        if self.vectors:
            self.out[torch.cat(self.rows)] = torch.cat(self.vectors).cpu()  # one copy back
            self.flushes += 1
        self.rows, self.vectors, self.held = [], [], 0


#: vectors kept on a GPU before they are copied back to the host (``_Collector``)
FLUSH_BYTES = 64 * 2**20


def _run_batches(encoder, pooling: _Pooling, batches, count: int, progress: bool) -> torch.Tensor:
    """(count, width) float32 on the CPU from ``(rows, batch)`` pairs: each batch's vectors written to its
    rows. On a GPU the vectors go back to the host every ``FLUSH_BYTES`` (``_Collector``)."""
    out = torch.empty(count, pooling.width, dtype=torch.float32)
    if not count:
        return out
    device = encoder.device
    run = prepare(encoder)
    bar = progress_bar(count, "encode", progress)
    collect = _Collector(out, device.type != "cpu", FLUSH_BYTES)
    training = encoder.training
    encoder.eval()  # vectors are an inference result (no dropout); the mode comes back below
    try:
        with torch.inference_mode():
            for rows, batch in batches:
                # off the CPU, the batch is checked and packed on the host before its copy: the forward then
                # never waits for the device to say what the batch holds
                packing = None if device.type == "cpu" else host_packing(encoder, **batch)
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                collect.add(rows, pooling(run, batch, packing))
                bar.update(len(rows))
            collect.flush()
    finally:
        encoder.train(training)
        bar.close()
    return out


def _budget(device: torch.device, batch_size, max_tokens):
    """A GPU's default batches: a token budget, not a count."""
    if device.type != "cpu" and batch_size is None and max_tokens is None:
        return None, GPU_MAX_TOKENS
    if batch_size is None and max_tokens is None:
        return 32, None
    return batch_size, max_tokens


def encode_ids(model, ids: Sequence[Sequence[int]], pad_token_id: int, *, pooling: str | Sequence[str] = "mean",
               normalize: bool = False, batch_size: int | None = None, max_tokens: int | None = None,
               progress: bool = False, layer: int | Sequence[int] = -1, combine: str = "concat",
               device=None) -> torch.Tensor:
    """Vectors (N, D) float32 of already tokenised texts, in their order. ``pooling``: a mode of
    ``tools.pooling`` or several (their vectors concatenated, as sentence-transformers does); ``layer``:
    which hidden state to pool (-1 = the last block's output), or several, joined by ``combine``
    (``"concat"``, or ``"mean"`` of the layers' vectors); ``normalize``: unit vectors. ``device``: where
    to run (default: where the model is; a model elsewhere is copied there, not moved). Batches: at most
    ``batch_size`` texts and/or ``max_tokens`` padded tokens; neither given: 32 texts on a CPU, a budget of
    ``GPU_MAX_TOKENS`` tokens on a GPU."""
    encoder = on_device(encoder_of(model), device)
    pooling = _Pooling(encoder, pooling, layer, combine, normalize)
    batch_size, max_tokens = _budget(encoder.device, batch_size, max_tokens)
    pin = encoder.device.type == "cuda"
    batches = ((rows, _pinned(collate(ids, rows, pad_token_id), pin))
               for rows in plan_batches([len(x) for x in ids], batch_size=batch_size, max_tokens=max_tokens))
    return _run_batches(encoder, pooling, batches, len(ids), progress)


def _pinned(batch: dict, pin: bool) -> dict:
    return {k: v.pin_memory() for k, v in batch.items()} if pin else batch


def streamed_batches(tokenize: Callable[[list[str]], list], texts: Sequence[str], pad_token_id: int, *,
                     batch_size: int | None, max_tokens: int | None, pin: bool = False, slab: int = SLAB):
    """``(rows, batch)`` pairs of ``texts``, tokenised as they are needed: texts ordered longest first by
    characters, tokenised ``slab`` at a time (``tokenize``: a list of texts -> their ids), each slab
    batched by its true token counts (``plan_batches``), collated (pinned for a GPU with ``pin``). What
    ``encode_texts`` runs in a background thread (``overlap``)."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # stable: ties keep input order
    for start in range(0, len(order), slab):
        chunk = order[start:start + slab]
        ids = tokenize([texts[i] for i in chunk])
        for rows in plan_batches([len(x) for x in ids], batch_size=batch_size, max_tokens=max_tokens):
            yield [chunk[r] for r in rows], _pinned(collate(ids, rows, pad_token_id), pin)


def encode_texts(model, tokenizer, texts: Sequence[str], *, pooling: str | Sequence[str] = "mean",
                 normalize: bool = False, batch_size: int | None = None, max_tokens: int | None = None,
                 max_length: int | None = None, progress: bool = False, layer: int | Sequence[int] = -1,
                 combine: str = "concat", device=None) -> torch.Tensor:
    """Vectors (len(texts), D) float32 of ``texts``, in their order: tokenised with truncation to
    ``max_length`` (default: the tokenizer's limit), then pooled as ``encode_ids`` does. ``device``: where
    to run (see ``encode_ids``). ``tokenizer``: a ``BertTokenizer``, or any callable that takes a list of
    texts with the tokenizer's keywords and has its ``pad_token_id`` (``SentenceEncoder`` lower-cases
    first). On a device in ``OVERLAP_DEVICES`` (a GPU) the texts are tokenised in a background thread
    while the model runs."""
    if isinstance(texts, str):
        raise InputError("texts must be a list of strings; wrap a single text in a list")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InputError(f"texts[{i}] is a {type(t).__name__}, not a string")

    def tokenize(chunk):
        return tokenizer(chunk, truncation=True, max_length=max_length, return_token_type_ids=False,
                         return_attention_mask=False)["input_ids"] if chunk else []

    encoder = on_device(encoder_of(model), device)
    if encoder.device.type not in OVERLAP_DEVICES:
        return encode_ids(encoder, tokenize(texts), tokenizer.pad_token_id, pooling=pooling, normalize=normalize,
                          batch_size=batch_size, max_tokens=max_tokens, progress=progress, layer=layer,
                          combine=combine)
    pooling = _Pooling(encoder, pooling, layer, combine, normalize)
    batch_size, max_tokens = _budget(encoder.device, batch_size, max_tokens)
    batches = prefetch(streamed_batches(tokenize, texts, tokenizer.pad_token_id, batch_size=batch_size,
                                        max_tokens=max_tokens, pin=encoder.device.type == "cuda"))
    return _run_batches(encoder, pooling, batches, len(texts), progress)
