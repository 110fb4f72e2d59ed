"""Per-layer probing: where in the stack is a word-level property linearly decodable?

    sentences (words + labels) ──► features for every layer, one forward pass per batch
                               ──► a linear probe per layer on a training split of the sentences
                               ──► held-out accuracy per layer, majority baseline, control task, selectivity

A probe is a multinomial logistic regression on frozen features (Alain and Bengio 2016; Tenney et al.
2019). The control task (Hewitt and Liang 2019) gives every word type one random label, fixed by the
seed and drawn from the real label distribution; selectivity = real accuracy - control accuracy. High
accuracy with low selectivity means the probe memorised word identities rather than read the property.

Sub-words are pooled into words with the tokenizer's character offsets (first piece, or mean).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..textfiles import read_conllu  # noqa: F401  (its home is minibert.textfiles)
from ..tools import fast
from ..tools.batching import collate, plan_batches
from ..tools.progress import progress_bar
from ..words import assign_pieces, word_spans


# ---------------------------------------------------------------------------------------- features
def extract_word_features(model, tokenizer, sentences: list[list[str]], *, pool: str = "first",
                          batch_size: int | None = 16, progress: bool = True, max_tokens: int | None = None):
    """Features of every word at every layer: a float32 tensor (L + 1, n_words, H) and a list with one
    (sentence index, word index) per row. Words that yield no sub-word (e.g. only control characters),
    or that fall past the 512-token limit, are left out and not listed."""
    texts, spans = zip(*(word_spans(words) for words in sentences)) if sentences else ((), ())
    return extract_span_features(model, tokenizer, list(texts), list(spans), pool=pool, batch_size=batch_size,
                                 progress=progress, max_tokens=max_tokens)


def extract_span_features(model, tokenizer, texts: list[str], spans: list[list[tuple[int, int]]], *,
                          pool: str = "first", batch_size: int | None = 16, progress: bool = True, max_length=None,
                          max_tokens: int | None = None):
    """Features of character spans (words, or any stretch of a text) at every layer: (L + 1, n, H) float32
    and (text index, span index) per row, in text order. A span's vector is its first sub-word's
    (``pool="first"``) or the mean of its sub-words'; spans without a sub-word are left out. Batches are
    length-sorted and hold ``batch_size`` texts, or up to ``max_tokens`` padded tokens (``tools.batching``)."""
    if pool not in ("first", "mean"):
        raise InputError(f"pool {pool!r}; use 'first' or 'mean'")
    encoded = tokenizer(list(texts), truncation=True, max_length=max_length, return_offsets_mapping=True,
                        return_token_type_ids=False, return_attention_mask=False)
    token_ids, all_offsets = encoded["input_ids"], encoded["offset_mapping"]
    plan = plan_batches([len(x) for x in token_ids], batch_size=batch_size, max_tokens=max_tokens)
    chunks, index = [], []
    bar = progress_bar(len(texts), "features", progress)
    run = fast.prepare(model)
    with torch.inference_mode():
        for ids in plan:
            batch = collate(token_ids, ids, tokenizer.pad_token_id, device=model.device)
            hidden = torch.stack(run(**batch).hidden_states).float()  # (L + 1, B, T, H)
            for row, text_id in enumerate(ids):
                pieces = assign_pieces(all_offsets[text_id], [1] * len(token_ids[text_id]), spans[text_id])
                for w, positions in enumerate(pieces):
                    if not positions:
                        continue
                    vec = hidden[:, row, positions[0]] if pool == "first" else hidden[:, row, positions].mean(1)
                    chunks.append(vec)
                    index.append((text_id, w))
            bar.update(len(ids))
    bar.close()
    if not chunks:
        raise InputError("no word produced a sub-word token")
    features = torch.stack(chunks, dim=1)  # (L + 1, n_words, H)
    order_back = sorted(range(len(index)), key=lambda k: index[k])  # back to corpus order
    return features[:, order_back], [index[k] for k in order_back]


# ------------------------------------------------------------------------------------------- probes
def train_linear_probe(x_train, y_train, num_classes: int, *, l2: float = 0.1, max_iter: int = 50, seed: int = 0):
    """Multinomial logistic regression, full-batch L-BFGS on standardised features. Deterministic.
    ``l2`` (on the summed squared weights) limits the probe's capacity to memorise word identities, the
    complexity control that Hewitt and Liang (2019) recommend; 0.1 keeps task accuracy while the
    control task (pure memorisation) drops."""
    torch.manual_seed(seed)
    mean, std = x_train.mean(0), x_train.std(0).clamp(min=1e-6)
    xs = (x_train - mean) / std
    probe = torch.nn.Linear(xs.shape[1], num_classes).double()
    torch.nn.init.zeros_(probe.weight)
    torch.nn.init.zeros_(probe.bias)
    xs = xs.double()
    opt = torch.optim.LBFGS(probe.parameters(), lr=1, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(probe(xs), y_train) + l2 * probe.weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return lambda x: probe(((x - mean) / std).double()).argmax(-1)


@dataclass
class ProbeResult:
    layers: list[int]
    accuracy: list[float]  # held-out accuracy of the real task, per layer
    control_accuracy: list[float]  # held-out accuracy of the control task, per layer
    majority_baseline: float  # always predict the most frequent training label
    n_train: int
    n_test: int
    labels: list[str] = field(default_factory=list)

    @property
    def selectivity(self) -> list[float]:
        return [a - c for a, c in zip(self.accuracy, self.control_accuracy)]

    @property
    def best_layer(self) -> int:
        return self.layers[max(range(len(self.layers)), key=lambda i: self.accuracy[i])]

    def table(self) -> str:
        lines = [f"{'layer':>5}  {'accuracy':>8}  {'control':>7}  {'selectivity':>11}",
                 "-" * 38]
        for l, a, c, s in zip(self.layers, self.accuracy, self.control_accuracy, self.selectivity):
            mark = "  <- best" if l == self.best_layer else ""
            lines.append(f"{l:>5}  {a:>8.3f}  {c:>7.3f}  {s:>11.3f}{mark}")
        lines.append(f"majority baseline {self.majority_baseline:.3f}; {len(self.labels)} labels; "
                     f"{self.n_train} training words, {self.n_test} held-out words")
        return "\n".join(lines)


def probe_layers(features: torch.Tensor, words: list[str], labels: list[str], sentence_ids: list[int], *,
                 test_fraction: float = 0.2, seed: int = 0, control: bool = True, l2: float = 0.1) -> ProbeResult:
    """Train and evaluate one probe per layer. ``features`` (L + 1, n, H); ``words``, ``labels``,
    ``sentence_ids`` one per row. The split is by sentence, so no held-out sentence was seen in training."""
    n = features.shape[1]
    if not (len(words) == len(labels) == len(sentence_ids) == n):
        raise InputError("features, words, labels and sentence_ids must describe the same words")
    if not 0 < test_fraction < 1:
        raise InputError(f"test_fraction must be in (0, 1), got {test_fraction}")
    sentences = sorted(set(sentence_ids))
    if len(sentences) < 2:
        raise InputError("probing needs at least 2 sentences (one to train on, one to test on)")
    rng = random.Random(seed)
    rng.shuffle(sentences)
    n_test_sent = max(1, round(len(sentences) * test_fraction))
    test_sentences = set(sentences[:n_test_sent])
    test = torch.tensor([s in test_sentences for s in sentence_ids])
    train = ~test

    label_names = sorted(set(labels))
    if len(label_names) < 2:
        raise InputError(f"probing needs at least 2 different labels, got {len(label_names)}: {label_names}; "
                         "with one class every probe is trivially 100 % accurate")
    y = torch.tensor([label_names.index(l) for l in labels])
    # control task: one random label per word type, drawn from the label distribution, fixed by the seed
    counts = Counter(labels)
    population, weights = zip(*sorted(counts.items()))
    rng_control = random.Random(seed + 1)
    control_of = {w: rng_control.choices(population, weights)[0] for w in sorted(set(words))}
    y_control = torch.tensor([label_names.index(control_of[w]) for w in words])

    majority = Counter(y[train].tolist()).most_common(1)[0][0]
    baseline = float((y[test] == majority).double().mean())
    acc, ctrl = [], []
    for layer in range(features.shape[0]):
        x = features[layer]
        predict = train_linear_probe(x[train], y[train], len(label_names), l2=l2, seed=seed)
        acc.append(float((predict(x[test]) == y[test]).double().mean()))
        if control:
            predict_c = train_linear_probe(x[train], y_control[train], len(label_names), l2=l2, seed=seed)
            ctrl.append(float((predict_c(x[test]) == y_control[test]).double().mean()))
        else:
            ctrl.append(float("nan"))
    return ProbeResult(list(range(features.shape[0])), acc, ctrl, baseline, int(train.sum()), int(test.sum()),
                       label_names)


def labelled_word_features(model, tokenizer, data: list[tuple[list[str], list[str]]], *, pool: str = "first",
                           batch_size: int = 16, progress: bool = True):
    """What a probe reads from (words, labels) sentences: ``features`` (L + 1, n, H) of the n labelled
    words, their ``words`` (lowercased), ``labels`` and ``sentence_ids``. A label of None (``_`` in CoNLL-U)
    marks a word that is read for context but not probed."""
    classes = sorted({label for _, labels in data for label in labels if label is not None})
    if len(classes) < 2:
        raise InputError(f"probing needs at least 2 different labels, the data has {len(classes)}: {classes}; "
                         "with one class every probe is trivially 100 % accurate")
    features, index = extract_word_features(model, tokenizer, [w for w, _ in data], pool=pool,
                                            batch_size=batch_size, progress=progress)
    labelled = [k for k, (s, w) in enumerate(index) if data[s][1][w] is not None]  # "_" is no label
    if len(labelled) < len(index):
        features, index = features[:, labelled], [index[k] for k in labelled]
    words = [data[s][0][w].lower() for s, w in index]
    labels = [data[s][1][w] for s, w in index]
    return features, words, labels, [s for s, _ in index]


def probe_model(model, tokenizer, data: list[tuple[list[str], list[str]]], *, pool: str = "first",
                batch_size: int = 16, seed: int = 0, test_fraction: float = 0.2, progress: bool = True) -> ProbeResult:
    """The whole pipeline on (words, labels) sentences: features for every layer, then probes. A label
    of None (``_`` in CoNLL-U) marks a word that is read for context but not probed."""
    features, words, labels, sentence_ids = labelled_word_features(model, tokenizer, data, pool=pool,
                                                                   batch_size=batch_size, progress=progress)
    return probe_layers(features, words, labels, sentence_ids, seed=seed, test_fraction=test_fraction)
