"""sentence-transformers model folders on minibert: the same vectors as ``SentenceTransformer.encode``.

    from minibert.compat import SentenceEncoder
    encoder = SentenceEncoder.from_pretrained("weights/all-MiniLM-L6-v2")   # a sentence-transformers folder
    vectors = encoder.encode(["a sentence", "another"], batch_size=32)     # (2, 384) numpy, unit vectors
    encoder.settings()   # {"max_seq_length": 256, "do_lower_case": False, "pooling": ["mean"], "normalize": True}

A sentence-transformers folder is a pipeline written down in ``modules.json``: a Transformer module (a
BERT checkpoint, with ``sentence_bert_config.json``: ``max_seq_length`` truncates every text, and
``do_lower_case`` lowercases it first), a Pooling module (``1_Pooling/config.json``) and, often, a
Normalize module (unit vectors). minibert reads the same files and does the same steps:

    tokens -> BERT (the fast path) -> pool over real tokens -> (normalize)

Pooling modes, as sentence-transformers defines them (``m`` = attention mask, ``h_t`` = last hidden state):

    cls                   h of the first real token
    max                   max over real tokens of h_t (per feature)
    mean                  sum_t m_t h_t / sum_t m_t
    mean_sqrt_len_tokens  sum_t m_t h_t / sqrt(sum_t m_t)
    weightedmean          sum_t m_t t h_t / sum_t m_t t          (t = 1, 2, ... from the first real token)
    lasttoken             h of the last real token

several modes are concatenated in the order the config lists them. A folder without ``modules.json``
(a plain BERT checkpoint) is taken as mean pooling, no normalisation, the tokenizer's length limit;
``settings()`` says which was used. Modules other than these three (Dense, ...) are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..errors import CheckpointError, InputError
from ..hardware import same_device
from ..inputs import check_index
from ..loading import MODEL_FILES, TOKENIZER_FILES, resolve_source
from ..models import BertModel
from ..tokenizer import BertTokenizer
from ..tools.encode import encode_ids, encode_texts
from ..textfiles import atomic_dir, field, inside, read_json
from ..tools.pooling import POOLING_MODES, pool  # noqa: F401  (pool: sentence-transformers' modes, re-exported)
# pooling config.json's older spelling: one boolean per mode, in this order
_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
MODULE_FILES = ["modules.json", "sentence_bert_config.json", "1_Pooling/config.json",
                "config_sentence_transformers.json"]
_FOLDER_FILES = MODULE_FILES + [f for f in (*MODEL_FILES, *TOKENIZER_FILES) if f not in MODULE_FILES]


def is_sentence_folder(source) -> bool:
    """Whether ``source`` (a directory, a file in one, or a hub id in the local cache) has a modules.json."""
    try:
        path = resolve_source(source, files=MODULE_FILES)
    except Exception:  # not found: the caller's own loading reports it
        return False
    return ((path if path.is_dir() else path.parent) / "modules.json").exists()


def _lowercase_first(tokenizer_json: Path) -> bool:
    """Whether a tokenizer.json normaliser is a Sequence with a Lowercase step (sentence-transformers'
    do_lower_case), which BertTokenizer's own settings do not express."""
    if not tokenizer_json.exists():
        return False
    normalizer = read_json(tokenizer_json).get("normalizer") or {}
    steps = normalizer.get("normalizers") if isinstance(normalizer, dict) else None
    return normalizer.get("type") == "Sequence" and isinstance(steps, list) and any(
        isinstance(n, dict) and n.get("type") == "Lowercase" for n in steps)


def read_pooling_config(path: Path) -> list[str]:
    """The modes of a ``1_Pooling/config.json``: ``pooling_mode`` (a name or a list; sentence-transformers
    >= 5) or the older booleans ``pooling_mode_*_tokens`` (mean when none is set)."""
    config = read_json(path)
    if "pooling_mode" in config:
        modes = field(config, "pooling_mode", (str, list), path)
        modes = [modes] if isinstance(modes, str) else list(modes)
    else:
        modes = [mode for key, mode in _LEGACY_KEYS.items() if field(config, key, (bool, None), path, False)] or ["mean"]
    for mode in modes:
        if not isinstance(mode, str) or mode not in POOLING_MODES:
            raise CheckpointError(f"{path}: pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}")
    if not modes:
        raise CheckpointError(f"{path}: pooling_mode names no mode")
    if field(config, "include_prompt", (bool, None), path, None) is False:
        raise CheckpointError(f"{path}: include_prompt=false (prompt tokens left out of pooling) is not supported")
    return modes


class _LowerCasing:
    """A tokenizer that lower-cases the texts first (a sentence-transformers folder's ``do_lower_case``)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.pad_token_id = tokenizer, tokenizer.pad_token_id

    def __call__(self, texts, **options):
        return self.tokenizer([t.lower() for t in texts], **options)


class SentenceEncoder:
    """A BERT checkpoint with a sentence-transformers folder's pooling, normalisation and truncation."""

    def __init__(self, model: BertModel, tokenizer: BertTokenizer, *, pooling: Sequence[str] = ("mean",),
                 normalize: bool = False, max_seq_length: int | None = None, do_lower_case: bool = False,
                 source: str = "model", from_folder: bool = False):
        pooling = [pooling] if isinstance(pooling, str) else list(pooling)
        if not pooling:
            raise InputError("pooling: give at least one mode")
        for mode in pooling:
            if mode not in POOLING_MODES:
                raise InputError(f"pooling mode {mode!r}; use one of {', '.join(POOLING_MODES)}")
        if max_seq_length is None:
            max_seq_length = min(tokenizer.model_max_length, model.config.max_position_embeddings)
        check_index("max_seq_length", max_seq_length, 3, model.config.max_position_embeddings, "the model's positions")
        tokenizer.check_fits(model.config, source)
        self.model, self.tokenizer = model, tokenizer
        self.pooling, self.normalize = pooling, bool(normalize)
        self.max_seq_length, self.do_lower_case = max_seq_length, bool(do_lower_case)
        self.source, self.from_folder = source, from_folder

    @classmethod
    def from_pretrained(cls, source, *, revision=None, dtype=None, device=None) -> "SentenceEncoder":
        """A sentence-transformers folder (or hub id); a plain BERT checkpoint gets mean pooling."""
        path = resolve_source(source, revision=revision, files=_FOLDER_FILES)
        folder = path if path.is_dir() else path.parent
        modules_file = folder / "modules.json"
        if not modules_file.exists():
            model = BertModel.from_pretrained(path, dtype=dtype, device=device, mlm_head=False)
            return cls(model, BertTokenizer.from_pretrained(folder), source=str(folder))
        modules = read_json(modules_file, list)
        for i, module in enumerate(modules):
            if not isinstance(module, dict):
                raise CheckpointError(f"{modules_file}: entry {i} must be an object (idx, name, path, type), got {module!r}")
            field(module, "type", str, f"{modules_file} (entry {i})")
            field(module, "path", str, f"{modules_file} (entry {i})", default="")
        kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
        if not kinds or kinds[0] != "Transformer" or any(k not in ("Transformer", "Pooling", "Normalize") for k in kinds) \
                or kinds.count("Transformer") != 1 or kinds.count("Pooling") > 1:
            raise CheckpointError(f"{modules_file}: modules {kinds}; minibert reads Transformer, then Pooling and "
                                  "Normalize (unsupported: " + ", ".join(sorted({m.get('type', '?') for m, k in zip(modules, kinds)
                                                                                 if k not in ('Transformer', 'Pooling', 'Normalize')}) or ["the order"]) + ")")
        # module paths are folders of this one: ../elsewhere, absolute paths and links out are refused
        base = inside(folder, modules[0].get("path", ""), str(modules_file))
        settings = {}
        if (base / "sentence_bert_config.json").exists():
            where = base / "sentence_bert_config.json"
            settings = read_json(where)
            field(settings, "max_seq_length", (int, None), where, None)
            field(settings, "do_lower_case", (bool, None), where, None)
        pooling = ["mean"]
        if "Pooling" in kinds:
            pooling_dir = inside(folder, modules[kinds.index("Pooling")].get("path", ""), str(modules_file))
            if not (pooling_dir / "config.json").exists():
                raise CheckpointError(f"{pooling_dir / 'config.json'} is missing (modules.json names a Pooling module)")
            pooling = read_pooling_config(pooling_dir / "config.json")
        # a .safetensors file named inside the folder is the weights read (the folder's other files beside it)
        weights = path if path.is_file() else base
        model = BertModel.from_pretrained(weights, dtype=dtype, device=device, mlm_head=False)
        tokenizer = BertTokenizer.from_pretrained(base)
        # sentence-transformers >= 5 writes max_seq_length as the tokenizer's model_max_length and
        # do_lower_case as a Lowercase step in front of tokenizer.json's normaliser; older versions write both
        # into sentence_bert_config.json
        lower = settings.get("do_lower_case", False) or _lowercase_first(base / "tokenizer.json")
        return cls(model, tokenizer, pooling=pooling, normalize="Normalize" in kinds,
                   max_seq_length=settings.get("max_seq_length"), do_lower_case=lower,
                   source=str(folder), from_folder=True)

    def settings(self) -> dict:
        """What ``encode`` does, and where it came from."""
        return {"source": self.source, "from": "modules.json" if self.from_folder else "defaults (no modules.json)",
                "max_seq_length": self.max_seq_length, "do_lower_case": self.do_lower_case,
                "pooling": list(self.pooling), "normalize": self.normalize}

    def save_settings(self, directory) -> list[str]:
        """Write this encoder's settings as a sentence-transformers folder's module files into ``directory``
        (where its BERT checkpoint is, or will be, saved): ``modules.json`` (Transformer at the folder's
        root, Pooling, and Normalize when it normalises), ``sentence_bert_config.json`` (max_seq_length,
        do_lower_case) and ``1_Pooling/config.json`` (in the boolean spelling every sentence-transformers
        version reads). ``SentenceEncoder.from_pretrained`` and ``SentenceTransformer`` then pool, truncate
        and normalise as this encoder does. Returns the files written."""
        directory = Path(directory)
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if self.normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        legacy = {mode: key for key, mode in _LEGACY_KEYS.items()}
        unordered = [m for m in self.pooling if m not in legacy]
        if unordered or list(self.pooling) != [m for m in _LEGACY_KEYS.values() if m in self.pooling]:
            pooling = {"pooling_mode": list(self.pooling)}  # an order the booleans cannot say
        else:
            pooling = {key: mode in self.pooling for key, mode in _LEGACY_KEYS.items()}
        files = {"modules.json": modules,
                 "sentence_bert_config.json": {"max_seq_length": self.max_seq_length, "do_lower_case": self.do_lower_case},
                 "1_Pooling/config.json": {"word_embedding_dimension": self.model.config.hidden_size, **pooling,
                                           "include_prompt": True}}
        with atomic_dir(directory) as tmp:  # all of them, or the folder as it was
            (tmp / "1_Pooling").mkdir()
            for name, content in files.items():
                (tmp / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        return list(files)

    def as_backend(self, library: str = "keybert"):
        """This encoder as KeyBERT's or BERTopic's embedding backend (see ``as_backend``)."""
        return as_backend(self, library)

    def get_sentence_embedding_dimension(self) -> int:
        return self.model.config.hidden_size * len(self.pooling)

    def tokenize(self, texts: Sequence[str]):
        """Token ids of each text (``["input_ids"]``, lists), truncated to ``max_seq_length``, lowercased first
        with ``do_lower_case``; ``.num_truncated_tokens`` says how many tokens each text lost."""
        return self._tokenizer()(list(texts), truncation=True, max_length=self.max_seq_length,
                                 return_token_type_ids=False, return_attention_mask=False)

    def _tokenizer(self):
        """The tokenizer as this folder applies it: lower-casing first with ``do_lower_case``."""
        return _LowerCasing(self.tokenizer) if self.do_lower_case else self.tokenizer

    def encode(self, sentences, batch_size: int = 32, *, max_tokens: int | None = None,
               show_progress_bar: bool | None = None, convert_to_numpy: bool = True,
               convert_to_tensor: bool = False, normalize_embeddings: bool = False, device=None):
        """Vectors of ``sentences`` (a string gives one vector, a list a matrix), as
        ``SentenceTransformer.encode``. Batches are length-sorted (longest first) and hold ``batch_size``
        texts, or with ``max_tokens`` as many as fit that many padded tokens (and at most ``batch_size``
        when both are given); the output keeps the input's order."""
        single = isinstance(sentences, str)
        texts = [sentences] if single else list(sentences)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InputError(f"sentences[{i}] is a {type(t).__name__}, not a string")
        if device is not None:
            try:
                same = same_device(device, self.model.device)
            except (RuntimeError, TypeError, ValueError):
                raise InputError(f"device={device!r} is not a device: use cpu, cuda or cuda:N") from None
            if not same:
                raise InputError(f"device={device!r}: the model is on {self.model.device}; move it with "
                                 "encoder.model.to(...)")
        # on a GPU the texts are tokenised in a background thread while it runs (tools.encode.encode_texts)
        out = encode_texts(self.model, self._tokenizer(), texts, pooling=self.pooling,
                           normalize=self.normalize or normalize_embeddings, batch_size=batch_size,
                           max_tokens=max_tokens, max_length=self.max_seq_length, progress=bool(show_progress_bar))
        if convert_to_tensor:
            return out[0] if single else out
        if convert_to_numpy:
            array = out.numpy()
            return array[0] if single else array
        vectors = list(out)
        return vectors[0] if single else vectors

    def encode_ids(self, ids: Sequence[Sequence[int]], *, batch_size: int | None = 32, max_tokens: int | None = None,
                   progress: bool = False, normalize: bool = False) -> torch.Tensor:
        """Vectors (N, D) float32 of already tokenised texts (``tokenize(texts)["input_ids"]``), in their order
        (``tools.encode.encode_ids`` with this folder's pooling and normalisation)."""
        return encode_ids(self.model, ids, self.tokenizer.pad_token_id, pooling=self.pooling,
                          normalize=self.normalize or normalize, batch_size=batch_size, max_tokens=max_tokens,
                          progress=progress)


#: libraries that take an embedding backend: name -> the module holding their BaseEmbedder
BACKEND_LIBRARIES = {"keybert": "keybert.backend", "bertopic": "bertopic.backend"}


def as_backend(encoder: "SentenceEncoder", library: str = "keybert"):
    """``encoder`` as the embedding backend of KeyBERT or BERTopic: an instance of that library's own
    ``BaseEmbedder`` whose ``embed(documents)`` is ``encoder.encode(documents)``. Handed anything else
    (a SentenceEncoder itself, a path), those libraries do not recognise it and silently load a model from
    the hub instead; a backend is what they take as is:

        KeyBERT(model=as_backend(encoder, "keybert"))
        BERTopic(embedding_model=as_backend(encoder, "bertopic"))"""
    import importlib

    from ..errors import MissingExtra

    if library not in BACKEND_LIBRARIES:
        raise InputError(f"library={library!r}: minibert makes backends for {', '.join(BACKEND_LIBRARIES)}")
    try:
        base = importlib.import_module(BACKEND_LIBRARIES[library]).BaseEmbedder
    except ImportError:
        raise MissingExtra(f"as_backend(..., {library!r}) needs the {library} package: pip install {library}") from None

    class MinibertBackend(base):
        """minibert's SentenceEncoder behind {library}'s BaseEmbedder."""

        def __init__(self):
            super().__init__(embedding_model=encoder)

        def embed(self, documents, verbose: bool = False):
            return encoder.encode(list(documents), show_progress_bar=bool(verbose))

    return MinibertBackend()


def cosine_search(matrix: np.ndarray, queries: np.ndarray, k: int = 5) -> list[list[tuple[int, float]]]:
    """The ``k`` rows of ``matrix`` most cosine-similar to each query: [[(row, score), ...], ...], best first."""
    matrix, queries = np.asarray(matrix, dtype=np.float32), np.atleast_2d(np.asarray(queries, dtype=np.float32))
    if matrix.ndim != 2 or queries.shape[1] != matrix.shape[1]:
        raise InputError(f"queries have width {queries.shape[1]}, the matrix {matrix.shape[-1]}: embed them with the same model")
    if not isinstance(k, int) or k < 1:
        raise InputError(f"k must be a positive integer, got {k!r}")
    k = min(k, len(matrix))
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    scores = (queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-12)) @ (
        matrix / np.maximum(norms, 1e-12)).T  # (Q, N)
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [[(int(j), float(scores[q, j])) for j in top[q]] for q in range(len(queries))]


__all__ = ["SentenceEncoder", "pool", "read_pooling_config", "cosine_search", "POOLING_MODES"]
