"""Task heads on the encoder (paper, section 4 and figure 4): what fine-tuning adds to BERT.

    sequence classification   logits = W dropout(pooler_output) + b          (B, num_labels)
    token classification      logits = W dropout(h_t) + b for every token t  (B, T, num_labels)
    extractive QA             start, end = split(W h_t + b)                  (B, T) each

Each class is compatible with transformers' ``BertForSequenceClassification``,
``BertForTokenClassification`` and ``BertForQuestionAnswering``: the same computation, the same loss, the
same checkpoint names (``bert.*`` for the encoder, ``classifier.*`` / ``qa_outputs.*`` for the head) and
config fields (``id2label``, ``problem_type``, ``classifier_dropout``). ``from_pretrained`` loads a
fine-tuned checkpoint of that kind; ``from_encoder`` starts fine-tuning from an encoder checkpoint with a
new head, initialised as transformers does (N(0, 0.02) weights, zero biases) from an explicit seed.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import BertConfig
from ..errors import InputError
from ..loading import load_model, load_task_model, save_model
from ..tokenizer import BertTokenizer
from ..tools.batching import text_batches
from .bert import BertModel


@dataclass
class ClassifierOutput:
    logits: torch.Tensor  # (B, num_labels) for sequences, (B, T, num_labels) for tokens
    loss: torch.Tensor | None = None  # when labels were given
    hidden_states: tuple[torch.Tensor, ...] | None = None  # the encoder's, (B, T, H) each
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class SpanOutput:
    start_logits: torch.Tensor  # (B, T): how likely each token starts the answer
    end_logits: torch.Tensor  # (B, T): how likely each token ends it
    loss: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class _TaskModel(nn.Module):
    """The encoder (``self.bert``) plus a head; loading, saving and initialisation shared by the three."""

    checkpoint_head = "classifier"  # the head's tensor prefix in transformers' checkpoints
    head_attribute = "classifier"  # ... and ours
    needs_pooler = False
    default_labels = None  # what from_encoder uses when given no labels
    fresh_pooler = False  # from_encoder gave the encoder a new pooler (its checkpoint had none)

    def __init__(self, config: BertConfig, *, add_pooler: bool | None = None):
        super().__init__()
        if config.num_labels is None:
            raise InputError(f"{type(self).__name__} needs config.id2label (the classes); got a config without")
        self.config = config
        self.bert = BertModel(config, add_pooler=self.needs_pooler if add_pooler is None else add_pooler)

    def head_out_features(self) -> int:
        return self.config.num_labels

    def encode(self, input_ids, attention_mask, token_type_ids, position_ids, output_attentions,
               output_hidden_states=True):
        return self.bert(input_ids, attention_mask, token_type_ids, position_ids, output_attentions,
                         output_hidden_states)

    @classmethod
    def from_pretrained(cls, source, *, revision=None, dtype=None, device=None):
        """Load a fine-tuned checkpoint of this kind (transformers' or ours). An encoder checkpoint without
        this head is a CheckpointError that points at ``from_encoder``."""
        return load_task_model(cls, source, revision=revision, dtype=dtype, device=device)

    @classmethod
    def from_encoder(cls, source, *, labels=None, problem_type=None, classifier_dropout=None, seed: int = 0,
                     revision=None, device=None):
        """Start fine-tuning: the encoder from ``source`` (any checkpoint minibert loads) and a new head
        for ``labels`` (a list of class names, or an int: that many classes named LABEL_i; 1 =
        regression; QA needs none), drawn from N(0, 0.02) with ``seed``."""
        if labels is None:
            if cls.default_labels is None:
                raise InputError(f"{cls.__name__}.from_encoder needs labels= (class names, or their number)")
            labels = cls.default_labels
        names = [f"LABEL_{i}" for i in range(labels)] if isinstance(labels, int) else [str(n) for n in labels]
        if not names or len(set(names)) != len(names):
            raise InputError(f"labels must be distinct class names (or a positive int), got {labels!r}")
        encoder = load_model(BertModel, source, revision=revision, device=device, mlm_head=False)
        config = encoder.config
        config.id2label = dict(enumerate(names))
        config.problem_type = problem_type
        config.classifier_dropout = classifier_dropout
        config.validate()
        generator = torch.Generator().manual_seed(seed)
        fresh = None
        if cls.needs_pooler and encoder.pooler is None:  # e.g. a BertForMaskedLM checkpoint: a fresh pooler
            import warnings

            encoder.pooler = fresh = fresh_pooler(encoder, generator)
            warnings.warn(f"{source} has no pooler, which {cls.__name__} classifies: starting from a fresh one "
                          f"(N(0, 0.02), seed {seed}), as transformers does", stacklevel=2)
        with torch.device("meta"):
            model = cls(config, add_pooler=encoder.pooler is not None)
        model.bert = encoder
        model.fresh_pooler = fresh is not None
        head = init_head(nn.Linear(config.hidden_size, model.head_out_features(), device=device), generator)
        setattr(model, cls.head_attribute, head)
        model.source = encoder.source  # where the tokenizer is, for predict()
        return model.train()

    def save_pretrained(self, directory) -> None:
        """config.json (with id2label) and model.safetensors that transformers loads as this class."""
        save_model(self, directory)

    def _batches(self, texts, text_pairs, tokenizer, batch_size, max_length, offsets=False):
        """(tokenizer, rows, batch) over the texts (or pairs), batched in length order by
        ``tools.batching.text_batches``; the tokenizer defaults to the checkpoint's."""
        if isinstance(texts, str):
            texts = [texts]
        if text_pairs is not None and isinstance(text_pairs, str):
            text_pairs = [text_pairs]
        if tokenizer is None:
            tokenizer = BertTokenizer.from_pretrained(getattr(self, "source", None) or "")
        for rows, batch in text_batches(tokenizer, texts, text_pairs, batch_size=batch_size, max_length=max_length,
                                        offsets=offsets, device=self.bert.device):
            yield tokenizer, rows, batch

    @contextmanager
    def _predicting(self):
        """Eval mode and inference_mode inside the block; the training mode comes back afterwards."""
        training = self.training
        self.eval()
        try:
            with torch.inference_mode():
                yield
        finally:
            self.train(training)


class _Classifier(_TaskModel):
    """A task model whose head is transformers' classifier: dropout, then a linear layer to num_labels."""

    def __init__(self, config: BertConfig, *, add_pooler: bool | None = None):
        super().__init__(config, add_pooler=add_pooler)
        self.dropout, self.classifier = classifier_layers(config)


class BertForSequenceClassification(_Classifier):
    """A label (or a score) per text or text pair, from the pooled [CLS] vector."""

    needs_pooler = True

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_attentions=False, output_hidden_states=True) -> ClassifierOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids, output_attentions,
                          output_hidden_states)
        logits = self.classifier(self.dropout(out.pooler_output))  # (B, num_labels)
        loss = None if labels is None else sequence_loss(logits, labels, self.config)
        return ClassifierOutput(logits, loss, out.hidden_states, out.attentions)

    def predict(self, texts, text_pairs=None, *, tokenizer=None, batch_size: int = 32, max_length=None) -> list[dict]:
        """For each text (or pair): ``{"label": name, "score": p, "scores": {name: p}}`` (softmax); for
        regression ``{"score": value}``; for multi-label ``{"labels": [names with p >= 0.5], "scores": ...}``
        (sigmoid). ``tokenizer`` defaults to the one saved beside the checkpoint."""
        names = [self.config.id2label[i] for i in range(self.config.num_labels)]
        kind = problem_type(self.config)
        results = [None] * (1 if isinstance(texts, str) else len(texts))
        with self._predicting():
            for _, rows, batch in self._batches(texts, text_pairs, tokenizer, batch_size, max_length):
                logits = self(**batch, output_hidden_states=False).logits.float()  # keeps no hidden state
                for i, row in zip(rows, logits):
                    if kind == "regression":
                        results[i] = {"score": float(row[0]) if len(row) == 1 else row.tolist()}
                    elif kind == "multi_label_classification":
                        p = row.sigmoid().tolist()
                        results[i] = {"labels": [n for n, q in zip(names, p) if q >= 0.5], "scores": dict(zip(names, p))}
                    else:
                        p = row.softmax(-1).tolist()
                        best = max(range(len(p)), key=p.__getitem__)
                        results[i] = {"label": names[best], "score": p[best], "scores": dict(zip(names, p))}
        return results


class BertForTokenClassification(_Classifier):
    """A label per token (e.g. named-entity tags), from each token's last hidden state."""

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, labels=None,
                output_attentions=False, output_hidden_states=True) -> ClassifierOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids, output_attentions,
                          output_hidden_states)
        logits = self.classifier(self.dropout(out.last_hidden_state))  # (B, T, num_labels)
        loss = None
        if labels is not None:  # -100 marks tokens without a label (padding, special tokens, later pieces)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), torch.as_tensor(labels).view(-1),
                                   ignore_index=-100)
        return ClassifierOutput(logits, loss, out.hidden_states, out.attentions)

    def predict(self, texts, *, tokenizer=None, batch_size: int = 32, max_length=None) -> list[list[tuple]]:
        """For each text, ``(token, label, probability)`` for every real token (special tokens left out)."""
        names = self.config.id2label
        results = [None] * (1 if isinstance(texts, str) else len(texts))
        with self._predicting():
            for tok, rows, batch in self._batches(texts, None, tokenizer, batch_size, max_length):
                probs = self(**batch, output_hidden_states=False).logits.float().softmax(-1)  # (B, T, num_labels)
                p, best = probs.max(-1)
                special = {tok.vocab[t] for t in (tok.cls_token, tok.sep_token, tok.pad_token)}
                for r, ids, row_p, row_best in zip(rows, batch["input_ids"].tolist(), p.tolist(), best.tolist()):
                    results[r] = [(tok.convert_ids_to_tokens([i])[0], names[b], q)
                                  for i, q, b in zip(ids, row_p, row_best) if i not in special]
        return results


class BertForQuestionAnswering(_TaskModel):
    """Extractive QA (SQuAD-style): a start and an end score per token; the answer is the best span."""

    checkpoint_head = "qa_outputs"
    head_attribute = "qa_outputs"
    default_labels = 2  # transformers' QA head: num_labels = 2 outputs, start and end

    def __init__(self, config: BertConfig, *, add_pooler: bool | None = None):
        super().__init__(config, add_pooler=add_pooler)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)  # (start, end) scores

    def head_out_features(self) -> int:
        return 2

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                start_positions=None, end_positions=None, output_attentions=False,
                output_hidden_states=True) -> SpanOutput:
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids, output_attentions,
                          output_hidden_states)
        start, end = self.qa_outputs(out.last_hidden_state).unbind(-1)  # (B, T) each
        loss = None
        if start_positions is not None and end_positions is not None:
            T = start.shape[1]  # positions outside the input are ignored, as in transformers
            start_positions = torch.as_tensor(start_positions).view(-1).clamp(0, T)
            end_positions = torch.as_tensor(end_positions).view(-1).clamp(0, T)
            loss = (F.cross_entropy(start, start_positions, ignore_index=T)
                    + F.cross_entropy(end, end_positions, ignore_index=T)) / 2
        return SpanOutput(start.contiguous(), end.contiguous(), loss, out.hidden_states, out.attentions)

    def predict(self, questions, contexts, *, tokenizer=None, batch_size: int = 16, max_length=None,
                max_answer_tokens: int = 30) -> list[dict]:
        """For each (question, context): the best span of the context, ``{"answer": text, "start": char,
        "end": char, "score": start logit + end logit}``, with start <= end < start + max_answer_tokens."""
        contexts = [contexts] if isinstance(contexts, str) else list(contexts)
        results = [None] * len(contexts)
        with self._predicting():
            for _, rows, batch in self._batches(questions, contexts, tokenizer, batch_size, max_length, offsets=True):
                offsets = batch.pop("offset_mapping")
                out = self(**batch, output_hidden_states=False)
                for k, start, end, types, mask, offs in zip(rows, out.start_logits, out.end_logits,
                                                            batch["token_type_ids"], batch["attention_mask"], offsets):
                    in_context = (types == 1) & (mask == 1) & (offs[:, 1] > offs[:, 0])  # context tokens, no [SEP]
                    scores = start[:, None] + end[None, :]  # (T, T): span i..j
                    T = scores.shape[0]
                    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
                    allowed = (j >= i) & (j < i + max_answer_tokens) & in_context[:, None] & in_context[None, :]
                    if not bool(allowed.any()):
                        results[k] = {"answer": "", "start": 0, "end": 0, "score": float("-inf")}
                    else:
                        best = int(scores.masked_fill(~allowed, float("-inf")).flatten().argmax())
                        a, b = divmod(best, T)
                        first, last = int(offs[a, 0]), int(offs[b, 1])
                        results[k] = {"answer": contexts[k][first:last], "start": first, "end": last,
                                      "score": float(scores[a, b])}
        return results


def classifier_layers(config: BertConfig) -> tuple[nn.Dropout, nn.Linear]:
    """The classification head of transformers' BertFor{Sequence,Token}Classification: dropout
    (classifier_dropout, else hidden_dropout_prob), then a linear layer to num_labels."""
    dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
    return nn.Dropout(dropout), nn.Linear(config.hidden_size, config.num_labels)


def init_head(linear: nn.Linear, generator: torch.Generator) -> nn.Linear:
    """A new head layer as BERT initialises one: weights from N(0, 0.02) drawn with ``generator`` (an
    explicit seed, so a run is reproducible), zero bias. In place; returns the layer."""
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator).to(linear.weight) * 0.02)
        if linear.bias is not None:
            linear.bias.zero_()
    return linear


def fresh_pooler(encoder, generator: torch.Generator):
    """A new pooler for ``encoder`` (one whose checkpoint had none, e.g. a masked-LM one), as transformers
    starts one: dense N(0, 0.02) from ``generator``, zero bias, on the encoder's device and dtype."""
    from ..model import Pooler

    pooler = Pooler(encoder.config)
    init_head(pooler.dense, generator)
    return pooler.to(device=encoder.device, dtype=encoder.dtype)


def problem_type(config: BertConfig, labels: torch.Tensor | None = None) -> str:
    """transformers' rule for what a sequence classifier does: ``config.problem_type`` when set, else
    regression for one label, single-label classification for integer labels (or when no labels are
    given), multi-label classification for float labels."""
    if config.problem_type is not None:
        return config.problem_type
    if config.num_labels == 1:
        return "regression"
    if labels is None or labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def sequence_loss(logits: torch.Tensor, labels, config: BertConfig) -> torch.Tensor:
    """transformers' loss: MSE for regression, cross-entropy for single-label classification, binary
    cross-entropy for multi-label (``problem_type``)."""
    labels = torch.as_tensor(labels, device=logits.device)
    kind = problem_type(config, labels)
    if kind == "regression":
        if config.num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype))
        return F.mse_loss(logits, labels.to(logits.dtype))
    if kind == "single_label_classification":
        return F.cross_entropy(logits.view(-1, config.num_labels), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


TASK_CLASSES = {cls.__name__: cls for cls in
                (BertForSequenceClassification, BertForTokenClassification, BertForQuestionAnswering)}
