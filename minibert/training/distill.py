"""Distillation: a shallower student learns to behave like its teacher.

A student is the teacher with fewer blocks -- its embeddings, the chosen blocks (every other one by
default, as DistilBERT), its pooler and head, copied -- and then trained to match the teacher:

    sentence embeddings (sentence-transformers' model distillation), on unlabelled text:
        loss = MSE(pool(student), pool(teacher))                               pooled sentence vectors
             + similarity_weight * MSE(cos_s(i, j), cos_t(i, j))                 every pair i < j in the batch
    task (Hinton et al. 2015; DistilBERT), on labelled data, from a fine-tuned teacher:
        loss = alpha * T^2 * KL(softmax(z_t / T) || softmax(z_s / T)) + (1 - alpha) * CE(z_s, y)
    masked LM (DistilBERT's pre-training), while pre-training (``MaskedLMDistiller``, ``pretrain --teacher``):
        the same, over the masked tokens' word distributions

and, in the first two modes, optional terms on the inside of the stack (TinyBERT, MiniLM), through a layer map
``{student hidden state i: teacher hidden state j}`` (0 = the embedding output; by default the uniform
map i -> i * N / M of TinyBERT, the student's last state on the teacher's last):

        + hidden_weight    * mean over mapped i of MSE(h_s[i], h_t[j])          over real tokens
        + attention_weight * mean over mapped i of KL(A_t[j] || A_s[i])         attention distributions of
                                                                                 the blocks that made them,
                                                                                 every head, real queries

``T^2`` keeps the soft term's gradient on the scale of the hard one's whatever the temperature. Where
unlabelled text is scarce, ``augment_texts`` makes more from it (crops, pairs, word dropout): the teacher
labels any text. The teacher always runs in fp32 and without gradients (``full_precision``), also when the
student trains under bf16 autocast; for long embedding runs its vectors can be computed once
(``cache_teacher``), so that the step is the student's alone.

    from minibert.training.distill import init_student, distill_embeddings, embedding_agreement
    student = init_student(teacher, blocks=[0, 2, 4])                   # 6 -> 3 blocks
    distill_embeddings(teacher, student, tokenizer, texts, config=EmbeddingDistillConfig(epochs=1, lr=1e-4))
    embedding_agreement(encode_texts(teacher, tok, held), encode_texts(student, tok, held))  # {"spearman", "top_k_overlap", ...}

``minibert distill`` runs both modes from files: ``minibert.runs.distill`` (``distill_corpus``,
``distill_task``).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..tools.pooling import pool
from ..errors import InputError
from ..models.heads import problem_type
from ..checks import check_fraction, check_index, encoder_of
from ..model import BertModel
from ..tools import fast
from ..tools.batching import collate
from ..tools.encode import encode_texts
from ..tools.surgery import dropout, keep_blocks
from . import metrics
from .data import _epoch_rows
from .loop import History, epoch_reporter, fit
from .settings import EmbeddingDistillConfig

log = logging.getLogger(__name__)

POOLINGS = ("mean", "cls", "max")


# --------------------------------------------------------------------------------------------- student
def default_blocks(num_blocks: int) -> list[int]:
    """Every other block from the bottom, as DistilBERT: 0, 2, 4 of 6; 0, 2, ..., 10 of 12."""
    return list(range(0, num_blocks, 2))


def init_student(teacher: nn.Module, blocks: Sequence[int] | None = None) -> nn.Module:
    """A copy of ``teacher`` (a BertModel or a task model) with only the blocks ``blocks`` (default
    every other one), in that order; embeddings, pooler and head are copied, every parameter trainable.
    The teacher is unchanged."""
    encoder = encoder_of(teacher)
    chosen = default_blocks(encoder.config.num_hidden_layers) if blocks is None else list(blocks)
    student = keep_blocks(teacher, chosen, what="student blocks")
    for p in student.parameters():  # a student is trained whole, even when the teacher was frozen
        p.requires_grad_(True)
    return student


def uniform_layer_map(student_layers: int, teacher_layers: int) -> dict[int, int]:
    """TinyBERT's uniform map on hidden states: student state i <- teacher state i * N / M (i = 1..M);
    the embedding outputs (state 0) are left out."""
    if teacher_layers % student_layers:
        step = teacher_layers / student_layers
        return {i: round(i * step) for i in range(1, student_layers + 1)}
    return {i: i * teacher_layers // student_layers for i in range(1, student_layers + 1)}


def parse_layer_map(text: str, student_layers: int, teacher_layers: int) -> dict[int, int]:
    """``"1:2,2:4,3:6"`` -> {1: 2, 2: 4, 3: 6} (student hidden state : teacher hidden state, 0 = the
    embeddings); ``"uniform"`` -> ``uniform_layer_map``."""
    if text.strip() == "uniform":
        return uniform_layer_map(student_layers, teacher_layers)
    mapping = {}
    for item in text.split(","):
        s, sep, t = item.partition(":")
        try:
            i, j = int(s), int(t)
        except ValueError:
            raise InputError(f"layer map {text!r}: each item is student:teacher, e.g. 1:2,2:4,3:6; got {item!r}") from None
        check_index("layer map: student hidden state", i, 0, student_layers, f"the student has states 0..{student_layers}")
        check_index("layer map: teacher hidden state", j, 0, teacher_layers, f"the teacher has states 0..{teacher_layers}")
        if i in mapping:
            raise InputError(f"layer map {text!r} names student state {i} twice")
        mapping[i] = j
    return mapping


# ---------------------------------------------------------------------------------------------- losses
def soft_target_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), averaged over rows (..., C)."""
    C = student_logits.shape[-1]
    log_p_student = F.log_softmax(student_logits.reshape(-1, C).float() / temperature, -1)
    log_p_teacher = F.log_softmax(teacher_logits.reshape(-1, C).float() / temperature, -1)
    return F.kl_div(log_p_student, log_p_teacher, reduction="batchmean", log_target=True) * temperature**2


def hidden_state_loss(student_states, teacher_states, layer_map: dict[int, int], mask) -> torch.Tensor:
    """Mean over the map of the MSE between mapped hidden states, on real tokens only."""
    real = mask.bool() if mask is not None else torch.ones(student_states[0].shape[:2], dtype=torch.bool,
                                                            device=student_states[0].device)
    losses = [F.mse_loss(student_states[i][real].float(), teacher_states[j][real].float()) for i, j in layer_map.items()]
    return torch.stack(losses).mean()


def attention_loss(student_probs, teacher_probs, layer_map: dict[int, int], mask) -> torch.Tensor:
    """Mean over the map of KL(teacher || student) between the attention distributions of the blocks that
    made the mapped states (state i comes from block i - 1), averaged over heads and real query rows."""
    losses = []
    for i, j in layer_map.items():
        if i == 0 or j == 0:
            continue  # the embedding output has no attention
        s, t = student_probs[i - 1].float(), teacher_probs[j - 1].float()  # (B, heads, T, T)
        kl = (torch.xlogy(t, t) - t * s.clamp_min(1e-30).log()).sum(-1)  # (B, heads, T); 0 * log 0 = 0
        if mask is not None:
            real = mask.bool()[:, None, :].expand_as(kl)
            losses.append(kl[real].mean())
        else:
            losses.append(kl.mean())
    if not losses:
        raise InputError("attention distillation needs a layer map with a block output (state >= 1) on both sides")
    return torch.stack(losses).mean()


def full_precision(teacher, input_ids, *args, **kwargs):
    """The teacher's forward pass without gradients and outside any autocast: when ``fit`` trains the
    student in bf16 (``FitConfig(bf16=True)``), the targets are still the teacher's own fp32 outputs."""
    with torch.no_grad(), torch.autocast(torch.as_tensor(input_ids).device.type, enabled=False):
        return teacher(input_ids, *args, **kwargs)


@dataclass
class DistillOutput:
    loss: torch.Tensor
    parts: dict = field(default_factory=dict)  # each term's value, for logging


class _Distiller(nn.Module):
    """The student (trained) and the teacher (frozen, always in eval mode) in one module for ``fit``."""

    def __init__(self, teacher: nn.Module, student: nn.Module, *, hidden_weight: float = 0.0,
                 attention_weight: float = 0.0, layer_map: dict[int, int] | None = None):
        super().__init__()
        t, s = encoder_of(teacher).config, encoder_of(student).config
        if (hidden_weight or attention_weight) and t.hidden_size != s.hidden_size:
            raise InputError(f"hidden-state distillation needs the same width: teacher {t.hidden_size}, "
                             f"student {s.hidden_size}")
        if attention_weight and t.num_attention_heads != s.num_attention_heads:
            raise InputError(f"attention distillation needs the same heads: teacher {t.num_attention_heads}, "
                             f"student {s.num_attention_heads}")
        for name, value in (("hidden_weight", hidden_weight), ("attention_weight", attention_weight)):
            if not value >= 0:
                raise InputError(f"{name}={value!r} must be >= 0")
        self.teacher, self.student = teacher, student  # the teacher runs under no_grad; its flags are left as they are
        self.config = s  # for fit's layer-wise options
        self.hidden_weight, self.attention_weight = float(hidden_weight), float(attention_weight)
        self.layer_map = layer_map or uniform_layer_map(s.num_hidden_layers, t.num_hidden_layers)
        for i, j in self.layer_map.items():
            check_index("layer map: student hidden state", i, 0, s.num_hidden_layers, "student states")
            check_index("layer map: teacher hidden state", j, 0, t.num_hidden_layers, "teacher states")

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()  # never dropout in the teacher
        return self

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        # fit groups and layer-decays the student's parameters by their names in the student
        return self.student.named_parameters(prefix, recurse, remove_duplicate)

    def save_pretrained(self, directory) -> None:
        self.student.save_pretrained(directory)

    def _inside_terms(self, s_out, t_out, mask) -> dict:
        parts = {}
        if self.hidden_weight:
            parts["hidden"] = self.hidden_weight * hidden_state_loss(s_out.hidden_states, t_out.hidden_states,
                                                                     self.layer_map, mask)
        if self.attention_weight:
            parts["attention"] = self.attention_weight * attention_loss(s_out.attentions, t_out.attentions,
                                                                        self.layer_map, mask)
        return parts


def similarity_loss(student_vectors: torch.Tensor, teacher_vectors: torch.Tensor) -> torch.Tensor:
    """MSE between the two models' cosine similarities of every pair of texts in the batch (B, H) -- the
    structure a user of the vectors compares (similarity-preserving distillation, Tung and Mori 2019)."""
    s, t = F.normalize(student_vectors.float(), dim=-1), F.normalize(teacher_vectors.float(), dim=-1)
    B = s.shape[0]
    if B < 2:
        return s.sum() * 0.0
    pairs = torch.triu_indices(B, B, 1, device=s.device)
    return F.mse_loss((s @ s.T)[pairs[0], pairs[1]], (t @ t.T)[pairs[0], pairs[1]])


class EmbeddingDistiller(_Distiller):
    """Sentence-embedding distillation: the student's pooled vectors regress the teacher's (MSE), with
    ``normalize`` comparing unit vectors (for models used through cosine similarity); with
    ``similarity_weight``, plus the MSE between the two models' in-batch cosine-similarity matrices."""

    def __init__(self, teacher: BertModel, student: BertModel, *, pooling: str = "mean", normalize: bool = False,
                 similarity_weight: float = 0.0, **inside):
        super().__init__(teacher, student, **inside)
        if pooling not in POOLINGS:
            raise InputError(f"pooling {pooling!r}: use one of {POOLINGS}")
        if not similarity_weight >= 0:
            raise InputError(f"similarity_weight={similarity_weight!r} must be >= 0")
        self.pooling, self.normalize, self.similarity_weight = pooling, normalize, float(similarity_weight)
        self._fast_teacher = fast.prepare(teacher)

    def sentence_vectors(self, out, attention_mask) -> torch.Tensor:
        return self.compared(pool(out.last_hidden_state.float(), attention_mask, self.pooling))  # (B, H), pooled in fp32

    def compared(self, vectors: torch.Tensor) -> torch.Tensor:
        """Pooled vectors as the loss compares them: fp32 (under autocast too), unit length with ``normalize``."""
        vectors = vectors.float()
        return F.normalize(vectors, dim=-1) if self.normalize else vectors

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, teacher_vectors=None) -> DistillOutput:
        """``teacher_vectors`` (B, H): the teacher's pooled vectors of these rows, computed once before
        training (``distill_embeddings(cache_teacher=True)``); the teacher then does not run here."""
        attentions = bool(self.attention_weight)
        if teacher_vectors is None:
            teacher = self.teacher if attentions else self._fast_teacher  # no maps needed: the fast path
            t_out = full_precision(teacher, input_ids, attention_mask, token_type_ids, output_attentions=attentions)
            t_vec = self.sentence_vectors(t_out, attention_mask)
        elif self.hidden_weight or self.attention_weight:
            raise InputError("cached teacher vectors carry no hidden states or attentions: "
                             "hidden_weight and attention_weight need the teacher to run on each batch")
        else:
            t_vec = self.compared(teacher_vectors)
        s_out = self.student(input_ids, attention_mask, token_type_ids, output_attentions=attentions)
        s_vec = self.sentence_vectors(s_out, attention_mask)
        parts = {"embedding": F.mse_loss(s_vec, t_vec)}
        if self.similarity_weight:
            parts["similarity"] = self.similarity_weight * similarity_loss(s_vec, t_vec)
        if teacher_vectors is None:
            parts.update(self._inside_terms(s_out, t_out, attention_mask))
        return DistillOutput(sum(parts.values()), {k: float(v.detach()) for k, v in parts.items()})


class TaskDistiller(_Distiller):
    """Task distillation from a fine-tuned classifier or tagger: soft targets at ``temperature`` weighted
    ``alpha``, the hard labels ``1 - alpha`` (tokens labelled -100 take part in neither)."""

    def __init__(self, teacher: nn.Module, student: nn.Module, *, temperature: float = 2.0, alpha: float = 0.5,
                 **inside):
        super().__init__(teacher, student, **inside)
        if not temperature > 0:
            raise InputError(f"temperature={temperature!r} must be > 0")
        check_fraction("alpha", alpha, closed=True)
        t, s = teacher.config, student.config
        if t.num_labels != s.num_labels:
            raise InputError(f"teacher has {t.num_labels} labels, student {s.num_labels}: they must predict the same")
        if problem_type(t) == "regression":
            raise InputError("task distillation with soft targets needs a classifier (the teacher is a regressor)")
        self.temperature, self.alpha = float(temperature), float(alpha)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None) -> DistillOutput:
        attentions = bool(self.attention_weight)
        t_out = full_precision(self.teacher, input_ids, attention_mask, token_type_ids, output_attentions=attentions)
        s_out = self.student(input_ids, attention_mask, token_type_ids, labels=labels, output_attentions=attentions)
        s_logits, t_logits = s_out.logits, t_out.logits
        if s_logits.dim() == 3 and labels is not None:  # tokens: only those with a label
            keep = torch.as_tensor(labels).reshape(-1) != -100
            s_logits, t_logits = s_logits.reshape(-1, s_logits.shape[-1])[keep], t_logits.reshape(-1, t_logits.shape[-1])[keep]
        parts = {"soft": self.alpha * soft_target_loss(s_logits, t_logits, self.temperature)}
        if labels is not None and self.alpha < 1:
            parts["hard"] = (1 - self.alpha) * s_out.loss
        parts.update(self._inside_terms(s_out, t_out, attention_mask))
        return DistillOutput(sum(parts.values()), {k: float(v.detach()) for k, v in parts.items()})


class MaskedLMDistiller(_Distiller):
    """Distillation while pre-training (DistilBERT's objective, Sanh et al. 2019): at the masked positions
    the student's word distribution learns the teacher's soft one, beside the hard masked-LM loss --

        loss = alpha * T^2 * KL(softmax(z_t / T) || softmax(z_s / T)) + (1 - alpha) * CE(z_s, y)

    over the masked tokens only (both models predict just there: sparse prediction). Teacher and student
    are ``BertForMaskedLM`` s with one vocabulary. ``training.pretrain.pretrain`` trains it like a masked
    LM (it reads ``mlm_loss`` and ``masked_logits``); in eval mode the distiller is its student, so the
    held-out evaluation measures the student's own masked-LM loss. Only the student's parameters train
    and are saved (``save_pretrained``)."""

    def __init__(self, teacher: nn.Module, student: nn.Module, *, temperature: float = 2.0, alpha: float = 0.5):
        super().__init__(teacher, student)
        from ..models.pretraining import BertForMaskedLM

        for who, model in (("teacher", teacher), ("student", student)):
            if not isinstance(model, BertForMaskedLM):
                raise InputError(f"masked-LM distillation: the {who} must be a BertForMaskedLM (got "
                                 f"{type(model).__name__})")
        if teacher.config.vocab_size != student.config.vocab_size:
            raise InputError(f"masked-LM distillation: teacher vocabulary {teacher.config.vocab_size:,} words, student "
                             f"{student.config.vocab_size:,}: they must predict the same words")
        if not temperature > 0:
            raise InputError(f"temperature={temperature!r} must be > 0")
        check_fraction("alpha", alpha, closed=True)
        self.temperature, self.alpha = float(temperature), float(alpha)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        s_out = self.student(input_ids, attention_mask, token_type_ids, labels=labels)
        if not self.training or labels is None:
            return s_out
        t_out = full_precision(self.teacher, input_ids, attention_mask, token_type_ids, labels=labels)
        soft = soft_target_loss(s_out.masked_logits, t_out.masked_logits, self.temperature)  # (N, V) each
        s_out.mlm_loss = s_out.loss = self.alpha * soft + (1 - self.alpha) * s_out.mlm_loss
        return s_out


# ------------------------------------------------------------------------------------------ embeddings
def text_batches(tokenizer, texts: Sequence[str], *, batch_size: int = 32, max_length: int | None = 128,
                 shuffle: bool = True, seed: int = 0, group_by_length: bool = False,
                 targets: torch.Tensor | None = None) -> Callable[[int], object]:
    """``batches(epoch)`` of unlabelled texts for ``fit``, shuffled by ``seed + epoch``. The texts are
    tokenised once, here. ``group_by_length``: batches of similar lengths (less padding to compute; see
    ``data._epoch_rows``). ``targets`` (len(texts), H): each batch also carries its rows' vectors, as
    ``teacher_vectors``."""
    if not texts:
        raise InputError("no texts to distil on")
    check_index("batch_size", batch_size, 1, 10**9)
    if targets is not None and len(targets) != len(texts):
        raise InputError(f"targets: {len(targets)} vectors for {len(texts)} texts")
    ids = tokenizer(list(texts), truncation=True, max_length=max_length, return_token_type_ids=False,
                    return_attention_mask=False)["input_ids"]
    lengths = [len(x) for x in ids] if group_by_length else None

    def batches(epoch: int):
        for rows in _epoch_rows(len(texts), batch_size, shuffle, seed + epoch, lengths):
            batch = collate(ids, rows, tokenizer.pad_token_id)
            if targets is not None:
                batch["teacher_vectors"] = targets[torch.as_tensor(rows)]
            yield batch
    return batches


def augment_texts(texts: Sequence[str], n: int, *, seed: int = 0, drop: float = 0.15) -> list[str]:
    """``n`` new texts made from ``texts``, for embedding distillation when unlabelled text like the texts
    the student will see is scarce (the teacher labels whatever it is given, so any text like them is
    training data). In turn: a crop (a contiguous run of 50-90 % of a text's words, at least 3), a pair
    (two texts joined by a space), a word dropout (each word dropped with probability ``drop``, at least 2
    kept); where a text is too short for a crop or a dropout, a pair instead. Deterministic given ``seed``;
    shuffled. Make them from the training texts only: made from held-out texts they would leak into
    training."""
    sources = [t.split() for t in texts if t.strip()]
    if not sources:
        raise InputError("augment_texts: no non-empty text to make new ones from")
    check_index("n (texts to make)", n, 0, 10**9)
    check_fraction("drop", drop)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words, made = rng.choice(sources), None
        if i % 3 == 0 and len(words) >= 4:  # a crop
            size = max(3, round(len(words) * rng.uniform(0.5, 0.9)))
            start = rng.randrange(0, len(words) - size + 1)
            made = words[start:start + size]
        elif i % 3 == 2:  # a word dropout
            kept = [w for w in words if rng.random() >= drop]
            made = kept if len(kept) >= 2 else None
        if made is None:  # a pair (also where the text was too short for the other two)
            made = words + rng.choice(sources)
        out.append(" ".join(made))
    rng.shuffle(out)
    return out


def embedding_agreement(teacher_vectors: torch.Tensor, student_vectors: torch.Tensor, *, k: int = 10) -> dict:
    """How alike two embeddings of the same n texts are, as a user of the vectors sees it:
    ``spearman``: rank correlation of the two models' pairwise cosine similarities (all n(n-1)/2 pairs);
    ``top_k_overlap``: the mean share of each text's k nearest neighbours (by cosine, itself left out)
    that both models agree on (``k`` is returned too); ``pearson``: the linear correlation of the cosines."""
    n = len(teacher_vectors)
    if n != len(student_vectors) or n < 3:
        raise InputError(f"embedding_agreement needs the same >= 3 texts embedded twice, got {n} and {len(student_vectors)}")
    k = check_index("k", k, 1, n - 1, "neighbours (at most n - 1)")
    a, b = (F.normalize(v.double(), dim=-1) for v in (teacher_vectors, student_vectors))
    sim_a, sim_b = a @ a.T, b @ b.T  # (n, n)
    upper = torch.triu_indices(n, n, 1)
    x, y = sim_a[upper[0], upper[1]], sim_b[upper[0], upper[1]]
    rank_correlation = metrics.spearman(x, y)  # ties averaged
    eye = torch.eye(n, dtype=torch.bool)
    top_a = sim_a.masked_fill(eye, -2).topk(k, -1).indices
    top_b = sim_b.masked_fill(eye, -2).topk(k, -1).indices
    overlap = sum(len(set(p.tolist()) & set(q.tolist())) for p, q in zip(top_a, top_b)) / (n * k)
    return {"spearman": rank_correlation, "top_k_overlap": overlap, "k": k, "pearson": metrics.pearson(x, y)}


def distill_embeddings(teacher: BertModel, student: BertModel, tokenizer, texts: Sequence[str], *,
                       eval_texts: Sequence[str] | None = None,
                       config: EmbeddingDistillConfig = EmbeddingDistillConfig(),
                       layer_map: dict[int, int] | None = None, out_dir=None) -> History:
    """Train ``student`` (in place) so that its pooled vectors (``config.pooling``, unit length with
    ``config.normalize``) match ``teacher``'s on ``texts``, with the loss and batches ``config`` sets
    (``EmbeddingDistillConfig``; ``layer_map``: student block -> teacher block for the hidden-state and
    attention terms). After each epoch, with ``eval_texts``, the two models' agreement on them
    (``embedding_agreement``, its top-``config.k`` overlap beside the Spearman); the epoch with the best
    Spearman agreement is kept in ``out_dir``. ``group_by_length``: batches of similar lengths
    (``text_batches``), less padding to compute. ``student_dropout``: every dropout of the student at this
    probability while it trains, its own again afterwards; None leaves it as it is. ``cache_teacher``: the
    teacher's vectors of all ``texts`` are computed once, before the first epoch (fast path, batched in
    length order), and every epoch trains on them: the teacher's forward pass leaves the training step. It
    keeps len(texts) x H floats and needs no hidden-state or attention term. The teacher always runs in
    fp32, also when ``config.bf16`` trains the student under bf16 autocast."""
    config.check()
    k, pooling, max_length, student_dropout = config.k, config.pooling, config.max_length, config.student_dropout
    if eval_texts is not None and len(eval_texts) < 2 * k + 1:
        raise InputError(f"eval_texts: {len(eval_texts)} text(s); the agreement's top-{k} overlap needs at least "
                         f"{2 * k + 1} (each text's {k} nearest among at least {2 * k} others; k sets it)")
    distiller = EmbeddingDistiller(teacher, student, pooling=pooling, normalize=config.normalize,
                                   similarity_weight=config.similarity_weight, hidden_weight=config.hidden_weight,
                                   attention_weight=config.attention_weight, layer_map=layer_map)
    evaluate = None
    if eval_texts:
        reference = encode_texts(teacher, tokenizer, eval_texts, pooling=pooling, max_length=max_length)

        def agreement(m):
            return embedding_agreement(reference, encode_texts(m.student, tokenizer, eval_texts, pooling=pooling,
                                                        max_length=max_length), k=k)
        evaluate = agreement
    targets = None
    if config.cache_teacher:
        started = time.perf_counter()
        targets = encode_texts(teacher, tokenizer, texts, pooling=pooling, max_length=max_length)  # (N, H), fp32
        log.info(f"teacher vectors of {len(texts):,} texts computed once: {time.perf_counter() - started:.1f} s")
    batches = text_batches(tokenizer, texts, batch_size=config.batch_size, max_length=max_length, seed=config.seed,
                           group_by_length=config.group_by_length, targets=targets)
    with (contextlib.nullcontext() if student_dropout is None else dropout(student, student_dropout)):
        return fit(distiller, batches, config=config, evaluate=evaluate, metric="spearman" if evaluate else None,
                   out_dir=out_dir, on_epoch_end=epoch_reporter(config.epochs, loss_digits=5))

