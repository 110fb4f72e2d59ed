"""BERT hyper-parameters, with the field names of transformers' ``config.json``.

The defaults are those of BERT-base (Devlin et al. 2019, section 3). Two of them decide exact parity
with transformers and are easy to get wrong:

* ``layer_norm_eps = 1e-12`` (not PyTorch's default 1e-5): every official BERT checkpoint uses it.
* ``hidden_act = "gelu"`` means the exact erf GELU, ``x * Phi(x)``; the tanh approximation differs by
  up to ~5e-4, which is far above our 1e-5 parity bound.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from .activations import ACTIVATIONS
from .checks import check_fraction, check_positive
from .errors import InputError
from .names import PRESETS, preset_name

#: transformers' problem types for sequence classification (the loss each implies: heads.py)
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")

@dataclass
class BertConfig:
    vocab_size: int = 30522  # rows of the word-embedding table (WordPiece vocabulary size)
    hidden_size: int = 768  # d_model: width of every token vector between blocks
    num_hidden_layers: int = 12  # N: number of encoder blocks
    num_attention_heads: int = 12  # h: heads per attention layer; d_head = hidden_size / h
    intermediate_size: int = 3072  # d_ff: inner width of the feed-forward network (4 x hidden)
    hidden_act: str = "gelu"  # feed-forward activation; "gelu" is the exact erf GELU
    hidden_dropout_prob: float = 0.1  # dropout on embeddings and on each sub-layer output (training only)
    attention_probs_dropout_prob: float = 0.1  # dropout on attention probabilities (training only)
    max_position_embeddings: int = 512  # rows of the position table = longest input in tokens
    type_vocab_size: int = 2  # segment (token type) embeddings: sentence A = 0, sentence B = 1
    layer_norm_eps: float = 1e-12  # epsilon of every LayerNorm; 1e-12 in all official checkpoints
    pad_token_id: int = 0  # id of [PAD]; kept for the tokenizer and for writing config.json
    position_embedding_type: str = "absolute"  # the only kind minibert implements
    # task heads (minibert/heads.py) only; the encoder never reads these
    id2label: dict[int, str] | None = None  # class index -> name; its length is num_labels (1 = regression)
    problem_type: str | None = None  # None (inferred from labels), or one of PROBLEM_TYPES
    classifier_dropout: float | None = None  # dropout before a classifier head; None = hidden_dropout_prob

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the rule it breaks."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            check_positive(f"BertConfig.{name}", getattr(self, name))
        if self.hidden_size % self.num_attention_heads:
            raise InputError(
                f"BertConfig.hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})")
        if self.hidden_act not in ACTIVATIONS:
            raise InputError(
                f"BertConfig.hidden_act {self.hidden_act!r} is not supported; choose one of {tuple(ACTIVATIONS)}")
        if self.position_embedding_type != "absolute":
            raise InputError(
                f"BertConfig.position_embedding_type {self.position_embedding_type!r} is not supported: "
                "minibert implements absolute position embeddings only (transformers 5 silently ignores "
                "'relative_key'/'relative_key_query' and computes something else; we refuse instead)")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            check_fraction(f"BertConfig.{name}", getattr(self, name))
        if not float(self.layer_norm_eps) > 0:
            raise InputError(f"BertConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if self.id2label is not None:
            if not self.id2label or sorted(self.id2label) != list(range(len(self.id2label))):
                raise InputError(f"BertConfig.id2label must map 0..num_labels-1 to names, got {self.id2label!r}")
        if self.problem_type is not None and self.problem_type not in PROBLEM_TYPES:
            raise InputError(f"BertConfig.problem_type {self.problem_type!r} is not one of {PROBLEM_TYPES}")
        if self.classifier_dropout is not None:
            check_fraction("BertConfig.classifier_dropout", self.classifier_dropout)
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise InputError(
                f"BertConfig.pad_token_id ({self.pad_token_id}) must be in [0, vocab_size={self.vocab_size})")

    @property
    def num_labels(self) -> int | None:
        """Classes of a task head (1 = regression); None for an encoder without labels."""
        return None if self.id2label is None else len(self.id2label)

    @property
    def label2id(self) -> dict[str, int] | None:
        return None if self.id2label is None else {name: i for i, name in self.id2label.items()}

    @property
    def head_size(self) -> int:
        """d_head = d_model / h (64 for BERT-base)."""
        return self.hidden_size // self.num_attention_heads

    # --------------------------------------------------------- config.json I/O
    @classmethod
    def from_dict(cls, data: dict) -> "BertConfig":
        """Build from a config.json dict; keys that are not fields (architectures, initializer_range,
        label maps, ...) do not change what the encoder computes and are ignored."""
        data = dict(data)
        if data.get("position_embedding_type") is None:
            data["position_embedding_type"] = "absolute"
        if data.get("pad_token_id") is None:
            data["pad_token_id"] = 0
        if data.get("model_type", "bert") != "bert":
            raise InputError(f"config.json has model_type {data['model_type']!r}; minibert loads 'bert' only")
        if isinstance(data.get("id2label"), dict):  # JSON keys are strings
            try:
                data["id2label"] = {int(k): str(v) for k, v in data["id2label"].items()}
            except ValueError:
                raise InputError(f"config.json's id2label keys must be integers, got {list(data['id2label'])}") from None
        elif isinstance(data.get("num_labels"), int):
            data["id2label"] = {i: f"LABEL_{i}" for i in range(data["num_labels"])}
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "BertConfig":
        return cls.from_dict(read_json_object(path))

    def to_dict(self) -> dict:
        """config.json content that transformers' BertModel reads back to the same model."""
        data = {"architectures": ["BertModel"], "model_type": "bert"}
        data.update(dataclasses.asdict(self))
        for key in ("id2label", "problem_type", "classifier_dropout"):  # task fields only when set
            if data[key] is None:
                del data[key]
        if self.id2label is not None:
            data["id2label"] = {str(i): name for i, name in self.id2label.items()}
            data["label2id"] = self.label2id
        return data

    def to_json_file(self, path: str | os.PathLike, architectures: tuple[str, ...] = ("BertModel",)) -> None:
        """Write config.json; ``architectures`` tells transformers which class the weights beside it fit."""
        data = self.to_dict()
        data["architectures"] = list(architectures)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")

    # ----------------------------------------------------------------- presets
    @classmethod
    def from_preset(cls, name: str) -> "BertConfig":
        """Geometry of an official checkpoint, e.g. ``BertConfig.from_preset("bert-base-uncased")``."""
        key = preset_name(name)
        if key is None:
            raise InputError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
        return cls(**PRESETS[key])


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON file that must hold one object (config.json, tokenizer files, shard indexes). A file that is
    not UTF-8, not JSON or not an object is an InputError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not valid JSON (truncated or corrupt?): {e}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} must hold a JSON object, found a {type(data).__name__}")
    return data
