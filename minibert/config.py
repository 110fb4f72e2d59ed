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
import math
import os
from dataclasses import dataclass

from .activations import ACTIVATIONS
from .checks import check_fraction, check_index
from .errors import InputError
from .names import PRESETS, preset_name
from .textfiles import read_json

#: the largest value each size may take: far above any published BERT (24 layers, 1024 wide, 4096 FFN,
#: 250k vocabulary, 8192 positions), low enough that tensor_map and the meta model stay cheap
LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "num_hidden_layers": 1024, "num_attention_heads": 1024,
          "intermediate_size": 1 << 18, "max_position_embeddings": 1 << 20, "type_vocab_size": 1 << 16}

#: where a block's LayerNorm may sit (BERT's is "post"; the others are models/norms.py's ablations)
NORM_PLACEMENTS = ("post", "pre", "deepnorm")
#: config.json's model_type for each placement: BERT's post-LN is "bert"; the ablations name themselves, so
#: that transformers' Auto classes refuse them ("does not recognize this architecture") and its BertModel says
#: it is instantiating another model type, instead of silently computing BERT's post-LN from their weights
NORM_MODEL_TYPES = {"post": "bert", "pre": "minibert-pre-ln", "deepnorm": "minibert-deepnorm"}

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
    # the masked-LM head only: False gives its decoder a weight of its own instead of the word embeddings
    # (transformers' field of the same name; BERT ties them, ``untied.py``)
    tie_word_embeddings: bool = True
    # where each block's LayerNorm sits: "post" is BERT's; "pre" and "deepnorm" are ablations that only
    # minibert.BertModel builds (``models/norms.py``) and only minibert reads back (transformers reads post)
    norm_placement: str = "post"
    # DeepNorm's alpha in LN(alpha x + F(x)), fixed when the model is made ((2N)^(1/4)); 1 otherwise
    residual_scale: float = 1.0
    # task heads (minibert/heads.py) only; the encoder never reads these
    id2label: dict[int, str] | None = None  # class index -> name; its length is num_labels (1 = regression)
    problem_type: str | None = None  # None (inferred from labels), or one of PROBLEM_TYPES
    classifier_dropout: float | None = None  # dropout before a classifier head; None = hidden_dropout_prob

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the rule it breaks. Sizes are bounded
        (``LIMITS``): a config asking for more than any BERT has is refused before anything is built."""
        for name, limit in LIMITS.items():
            check_index(f"BertConfig.{name}", getattr(self, name), 1, limit,
                        "a bound far above any BERT's, so that a damaged config fails before memory is taken")
        for name in ("hidden_act", "position_embedding_type"):
            if not isinstance(getattr(self, name), str):
                raise InputError(f"BertConfig.{name} must be a string, got {getattr(self, name)!r}")
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
        if not isinstance(self.tie_word_embeddings, bool):
            raise InputError(f"BertConfig.tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise InputError(f"BertConfig.norm_placement {self.norm_placement!r} is not one of {NORM_PLACEMENTS}")
        scale = self.residual_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise InputError(f"BertConfig.residual_scale must be a finite number > 0, got {scale!r}")
        if scale != 1 and self.norm_placement != "deepnorm":
            raise InputError(f"BertConfig.residual_scale={scale!r} goes with norm_placement 'deepnorm' only "
                             f"(it is {self.norm_placement!r}: the residual is added unscaled)")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            check_fraction(f"BertConfig.{name}", getattr(self, name))
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
            raise InputError(f"BertConfig.layer_norm_eps must be a finite number > 0, got {eps!r}")
        if self.id2label is not None:
            if (not isinstance(self.id2label, dict) or not self.id2label
                    or not all(isinstance(k, int) and not isinstance(k, bool) for k in self.id2label)
                    or sorted(self.id2label) != list(range(len(self.id2label)))
                    or not all(isinstance(v, str) for v in self.id2label.values())):
                raise InputError(f"BertConfig.id2label must map 0..num_labels-1 to names, got {self.id2label!r}")
        if self.problem_type is not None and (not isinstance(self.problem_type, str)
                                              or self.problem_type not in PROBLEM_TYPES):
            raise InputError(f"BertConfig.problem_type {self.problem_type!r} is not one of {PROBLEM_TYPES}")
        if self.classifier_dropout is not None:
            check_fraction("BertConfig.classifier_dropout", self.classifier_dropout)
        check_index("BertConfig.pad_token_id", self.pad_token_id, 0, self.vocab_size - 1,
                    f"an id of the vocabulary of {self.vocab_size}")

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
        model_type = data.get("model_type", "bert")
        if model_type != "bert":  # an ablation minibert wrote names its placement (earlier ones say "bert")
            placement = next((p for p, name in NORM_MODEL_TYPES.items() if name == model_type), None)
            if placement is None or data.get("norm_placement", placement) != placement:
                raise InputError(f"config.json has model_type {model_type!r}; minibert loads 'bert' (and its own "
                                 f"{', '.join(repr(t) for t in list(NORM_MODEL_TYPES.values())[1:])} with the "
                                 "matching norm_placement)")
            data.setdefault("norm_placement", placement)
        if isinstance(data.get("id2label"), dict):  # JSON keys are strings
            try:
                data["id2label"] = {int(k): v for k, v in data["id2label"].items()}
            except ValueError:
                raise InputError(f"config.json's id2label keys must be integers, got {list(data['id2label'])}") from None
        elif data.get("id2label") is not None:
            raise InputError(f"config.json's id2label must be an object (index -> name), got {data['id2label']!r}")
        elif isinstance(data.get("num_labels"), int) and not isinstance(data["num_labels"], bool):
            check_index("config.json's num_labels", data["num_labels"], 1, 1 << 16)
            data["id2label"] = {i: f"LABEL_{i}" for i in range(data["num_labels"])}
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "BertConfig":
        """config.json; a field of the wrong type or out of range is an InputError naming the file."""
        data = read_json_object(path)
        try:
            return cls.from_dict(data)
        except InputError as e:
            raise type(e)(f"{path}: {e}") from None

    def to_dict(self) -> dict:
        """config.json content that transformers' BertModel reads back to the same model."""
        data = {"architectures": ["BertModel"], "model_type": NORM_MODEL_TYPES.get(self.norm_placement, "bert")}
        data.update(dataclasses.asdict(self))
        for key in ("id2label", "problem_type", "classifier_dropout"):  # task fields only when set
            if data[key] is None:
                del data[key]
        if self.tie_word_embeddings:  # the default, BERT's: written only when a decoder is untied
            del data["tie_word_embeddings"]
        if self.norm_placement == "post":  # BERT's: written only for the ablations (models/norms.py)
            del data["norm_placement"], data["residual_scale"]
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
    not UTF-8, not JSON, too deeply nested or not an object is an InputError naming the file."""
    return read_json(path, dict)
