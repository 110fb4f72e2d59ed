"""Parity reports: how far apart two BERT encoders are, layer by layer.

Two uses:

- minibert against transformers on the same checkpoint (``minibert parity --model M``): is this checkpoint
  computed the same by both? (It should be, to ~1e-6 in fp32.)
- one checkpoint against another, both run by minibert (``minibert parity --model A --against B``):
  where does a converted, quantised, pruned or fine-tuned copy start to drift from the original?

For every layer the report gives the max and mean absolute difference of the hidden states over real
(unpadded) tokens and of the attention probabilities over real query/key pairs, then the pooler. The
first row whose max exceeds ``atol`` is the first divergent layer. Row "embeddings" is hidden_states[0];
row "block i" is block i's output (hidden_states[i + 1]) and its attention probabilities.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..names import QUANTISED_DTYPES, SHORT_DTYPES
from ..errors import InputError, MissingExtra
from ..tools.pooling import pool

#: the built-in inputs: plain sentences, sentence pairs, very short and long texts, accents, numbers,
#: punctuation and non-Latin script, batched so that padding is exercised
DEFAULT_TEXTS = [
    "The bank approved the loan application.",
    "A quick brown fox jumps over the lazy dog near the riverbank.",
    "Hi!",
    "Tokenizers split unaffable words like unbelievably into word pieces.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Café au lait costs €3.50 in Zürich; naïve résumé writers don't care.",
    "東京は日本の首都です。 Москва — столица России.",
    "In 1969, Apollo 11 landed on the Moon: 4 days, 6 hours and 45 minutes after launch.",
    " ".join(["This long sentence repeats itself to fill many positions of the model."] * 12),
]
DEFAULT_PAIRS = [
    ("Where is the bank?", "It is next to the river."),
    ("He went to the store to buy milk and eggs for breakfast.", "The store was closed."),
    ("Short.", "A somewhat longer second segment with several more tokens in it, to pad the first."),
]
#: the built-in inputs also reach the model's last position: a text and a pair long enough to fill every
#: position (``max_length``: 512 for BERT), each padded beside a short one. Ordinary words, varied, so that
#: every position embedding is added to a real token's
LONG_TEXT = ("The committee met again on Tuesday to review the river survey, the new budget for the library, "
             "and seven letters from residents who asked why the old bridge near the station was still closed. ")
LONG_PAIR = ("Which of the reports mentioned the harbour, the weather station and the museum's winter hours? ",
             "Most of them did, although the second report described the harbour in far more detail than the rest. ")
DEFAULT_ATOL = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 5e-3, "int8": 2.0}
assert set(DEFAULT_ATOL) == {*SHORT_DTYPES, *QUANTISED_DTYPES}  # every dtype name (names.py) has a tolerance
#: int8 is judged by what its users compare, the sentence vectors: mean-pooled last layer, cosine to fp32's
MIN_COSINE = {"int8": 0.99}
#: a task head in int8 is judged by its decisions: the share of argmax labels (per input; per real token for a
#: tagger; start and end for extractive QA) that agree with fp32's. 0.9 is a judgement, not a measured
#: optimum: a deployment that changes one decision in ten does not compute what the reference computes, and a
#: head that computes something else agrees at chance. Measured (AMD EPYC Zen 3, onnxruntime 1.32): all-MiniLM-L6-v2
#: with an untrained 6-label head (N(0, 0.02)) through ORT's dynamic int8 agrees on 0.75 of parity's 16 built-in
#: inputs at a largest logit difference of 0.013 -- its logits are nearly tied, so int8's drift flips them: FAIL
MIN_AGREEMENT = {"int8": 0.9}


#: what must be equal for two models to be compared at all: their shapes, and what the last position is
GEOMETRY = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
            "max_position_embeddings", "type_vocab_size")


def geometry(config) -> dict:
    """The geometry of a BertConfig, as ``GEOMETRY``'s fields."""
    return {name: getattr(config, name) for name in GEOMETRY}


def check_same_geometry(a: dict, b: dict, name_a: str, name_b: str) -> None:
    """Refuse, in one line, two models whose geometries differ (each field both state): a comparison of one
    model's first blocks with another's would otherwise pass on what the two share."""
    differ = [f"{k} {a[k]} vs {b[k]}" for k in a if k in b and a[k] is not None and b[k] is not None and a[k] != b[k]]
    if differ:
        raise InputError(f"{name_a} and {name_b} are not the same model: {', '.join(differ)}; parity compares one "
                         "model computed two ways, so their geometry must be the same")


@dataclass
class Row:
    layer: str
    hidden_max: float
    hidden_mean: float
    attention_max: float | None = None
    attention_mean: float | None = None

    def worst(self) -> float:
        return max(self.hidden_max, self.attention_max or 0.0)


@dataclass
class ParityReport:
    a: str
    b: str
    dtype: str
    atol: float
    rows: list[Row] = field(default_factory=list)
    inputs: int = 0
    # cosine of the two models' sentence vectors (mean of the last hidden state over real tokens), per input
    cosine_min: float | None = None
    cosine_mean: float | None = None
    min_cosine: float | None = None  # when set, cosine_min below it fails the report
    longest: int = 0  # the longest input compared, in tokens
    positions: int | None = None  # the model's max_position_embeddings
    # a task head's decisions: the share of argmax labels that agree (runtime parity), and the least that passes
    agreement: float | None = None
    min_agreement: float | None = None
    fingerprints: dict = field(default_factory=dict)  # side -> what was read, as sha256
    notes: list = field(default_factory=list)  # what the reader must know to read the rows (what was not seen)

    @property
    def first_divergent(self) -> str | None:
        for row in self.rows:
            if not row.worst() <= self.atol:  # NaN counts as divergent
                return row.layer
        return None

    @property
    def cosine_ok(self) -> bool:
        return self.min_cosine is None or (self.cosine_min is not None and self.cosine_min >= self.min_cosine)

    @property
    def agreement_ok(self) -> bool:
        return self.min_agreement is None or (self.agreement is not None and self.agreement >= self.min_agreement)

    @property
    def ok(self) -> bool:
        return self.first_divergent is None and self.cosine_ok and self.agreement_ok

    def reasons(self) -> list[str]:
        """Why the report fails, each with the number that failed and its bound ([] when it passes)."""
        out = []
        first = self.first_divergent
        if first is not None:
            row = next(r for r in self.rows if r.layer == first)
            out.append(f"first layer over {self.atol:g}: {first} ({row.worst():.2e})")
        if not self.cosine_ok:
            out.append("sentence cosine too low: " + (f"{self.cosine_min:.4f} < {self.min_cosine:g}"
                                                      if self.cosine_min is not None else "not measured"))
        if not self.agreement_ok:
            out.append("head's argmax agreement too low: " + (f"{self.agreement:.4f} < {self.min_agreement:g}"
                                                             if self.agreement is not None else "not measured"))
        return out

    def table(self) -> str:
        w = max([12, *(len(row.layer) + 2 for row in self.rows)])  # "block 11 (last)" is wider than "block 11"
        reach = f", longest {self.longest} tokens" + (f" of {self.positions} positions" if self.positions else "") \
            if self.longest else ""
        lines = [f"parity: {self.a}  vs  {self.b}  ({self.dtype}, {self.inputs} inputs{reach}, atol {self.atol:g}; "
                 "differences over real tokens)"]
        lines += [f"  {side}: {what}" for side, what in self.fingerprints.items()]
        lines += [f"{'layer':<{w}}{'hidden max':>12}{'hidden mean':>13}{'attn max':>11}{'attn mean':>11}"]
        first = self.first_divergent

        def fmt(v):
            return f"{v:.2e}" if v is not None else "-"

        for row in self.rows:
            mark = "  <- first divergent" if row.layer == first else ("  >atol" if not row.worst() <= self.atol
                                                                    else "")
            lines.append(f"{row.layer:<{w}}{fmt(row.hidden_max):>12}{fmt(row.hidden_mean):>13}"
                         f"{fmt(row.attention_max):>11}{fmt(row.attention_mean):>11}{mark}")
        worst = max((r.worst() for r in self.rows), default=0.0)
        if self.cosine_min is not None:
            lines.append(f"sentence vectors (mean of the last layer): cosine min {self.cosine_min:.4f}, mean "
                         f"{self.cosine_mean:.4f}" + (f" (needs >= {self.min_cosine:g})"
                                                      if self.min_cosine is not None else ""))
        if self.agreement is not None:
            lines.append(f"task head: argmax agreement {self.agreement:.4f}"
                         + (f" (needs >= {self.min_agreement:g})" if self.min_agreement is not None else ""))
        lines += [f"note: {note}" for note in self.notes]
        lines.append(f"result: {'PASS' if self.ok else 'FAIL'} -- largest difference {worst:.2e}"
                     + "".join(f"; {reason}" for reason in self.reasons()))
        return "\n".join(lines)

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(first_divergent=self.first_divergent, ok=self.ok, reasons=self.reasons())
        return data

    def write_json(self, path) -> None:
        from ..textfiles import write_text_atomic

        write_text_atomic(path, json.dumps(self.to_json(), indent=2) + "\n")


# ------------------------------------------------------------------------------------------- runners
# A runner maps a batch dict to (hidden_states tuple, attentions tuple or None, pooler or None).
Runner = Callable[[dict], tuple]


# Each runs the batch where its model is and hands back CPU tensors: ``compare`` reads them beside the
# batch's CPU mask (a model on a GPU is compared as one on the CPU).
def _on(model, batch: dict) -> dict:
    device = next(model.parameters()).device
    return {k: v.to(device) for k, v in batch.items()}


def _cpu(tensors):
    return None if tensors is None else tuple(t.cpu() for t in tensors)


def minibert_runner(model) -> Runner:
    def run(batch):
        out = model(**_on(model, batch), output_attentions=True)
        pooled = out.pooler_output.cpu() if out.pooler_output is not None else None
        return _cpu(out.hidden_states), _cpu(out.attentions), pooled
    return run


def fast_runner(fast_model) -> Runner:
    """The fast path (no attention maps): hidden states and pooler."""
    def run(batch):
        out = fast_model(**batch)
        return out.hidden_states, None, out.pooler_output
    return run


def transformers_runner(model) -> Runner:
    def run(batch):
        out = model(**_on(model, batch), output_hidden_states=True, output_attentions=True)
        attentions = out.attentions if out.attentions and out.attentions[0] is not None else None
        pooled = getattr(out, "pooler_output", None)
        return _cpu(out.hidden_states), _cpu(attentions), pooled.cpu() if pooled is not None else None
    return run


def load_transformers(source: str, dtype: torch.dtype):
    """transformers' BertModel for ``source`` with eager attention (the one that returns probabilities)."""
    try:
        import transformers
    except ImportError:
        raise MissingExtra("comparing against transformers needs it installed: pip install -e \".[parity]\" in the "
                          "minibert checkout (or pip install transformers); --against compares two checkpoints without it") from None
    from ..loading import resolve_source

    path = resolve_source(source)
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    where: dict = {"pretrained_model_name_or_path": path}
    if path.is_file():  # the file named is the file read: its tensors, its folder's config
        from safetensors.torch import load_file

        where = {"pretrained_model_name_or_path": None, "state_dict": load_file(str(path)),
                 "config": transformers.BertConfig.from_pretrained(path.parent)}
    try:
        model = transformers.BertModel.from_pretrained(**where, dtype=dtype, attn_implementation="eager")
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = transformers.BertModel.from_pretrained(**where, torch_dtype=dtype, attn_implementation="eager")
    if next(model.parameters()).dtype != dtype:  # an older release may have ignored the keyword
        model = model.to(dtype)
    return model.eval()


def make_batches(tokenizer, texts=None, pairs=None, batch_size: int = 8, max_length: int | None = None) -> list[dict]:
    """Padded batches of the texts (and of the pairs): built-in ones when neither is given. Kept in the
    given order on purpose, not length-sorted as ``tools.batching`` would: a parity check wants short and
    long inputs padded together, so that the mask's effect on every layer is compared too."""
    builtin = texts is None and pairs is None
    if builtin:
        texts, pairs = DEFAULT_TEXTS, DEFAULT_PAIRS
    batches = []
    texts = list(texts or [])
    for start in range(0, len(texts), batch_size):
        chunk = texts[start:start + batch_size]
        batches.append(dict(tokenizer(chunk, padding=True, truncation=True, max_length=max_length,
                                      return_tensors="pt")))
    pairs = list(pairs or [])
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        batches.append(dict(tokenizer([a for a, _ in chunk], [b for _, b in chunk], padding=True,
                                      truncation=True, max_length=max_length, return_tensors="pt")))
    if builtin and max_length is not None:  # every position, each long input padded beside a short one
        batches += reaching_batches(tokenizer, max_length)
    if not batches:
        raise InputError("no inputs: give at least one text")
    return batches


def reaching_batches(tokenizer, max_length: int) -> list[dict]:
    """A text and a pair that fill all ``max_length`` positions (truncated there), each padded beside a
    short input: what a check needs to see a model's late positions (a runtime whose position embeddings
    past 200 were lost agrees with the reference on every shorter input)."""
    words = max_length + 8  # at least one token a word: enough to be cut at max_length
    long_text = " ".join((LONG_TEXT * (words // 30 + 2)).split()[:words])
    first, second = (" ".join((part * (words // 30 + 2)).split()[:words]) for part in LONG_PAIR)
    texts = dict(tokenizer([long_text, "Hi!"], padding=True, truncation=True, max_length=max_length,
                           return_tensors="pt"))
    pairs = dict(tokenizer([first, "Short."], [second, "Yes."], padding=True, truncation=True,
                           max_length=max_length, return_tensors="pt"))
    return [texts, pairs]


def longest_input(batches: list[dict]) -> int:
    """The most real tokens of any input in ``batches``."""
    return max(int(b["attention_mask"].sum(1).max()) if "attention_mask" in b else b["input_ids"].shape[1]
               for b in batches)


def compare(run_a: Runner, run_b: Runner, batches: list[dict], *, atol: float, name_a: str = "a",
            name_b: str = "b", dtype: str = "fp32") -> ParityReport:
    """Run both on every batch and collect per-layer differences over real tokens."""
    stats: dict[str, dict[str, list[float]]] = {}  # layer -> kind -> [max, sum, count], running
    count = 0
    cosines = []

    def add(layer, kind, diff):  # diff: 1-D tensor of absolute differences
        entry = stats.setdefault(layer, {}).setdefault(kind, [0.0, 0.0, 0])
        if diff.numel():
            m = _max(diff)
            entry[0] = float("nan") if m != m or entry[0] != entry[0] else max(entry[0], m)  # NaN sticks
            entry[1] += float(diff.double().sum())
            entry[2] += diff.numel()

    with torch.inference_mode():
        for batch in batches:
            mask = batch.get("attention_mask")
            valid = (torch.ones_like(batch["input_ids"]) if mask is None else mask).bool()
            count += int(valid.shape[0])
            ha, aa, pa = run_a(batch)
            hb, ab, pb = run_b(batch)
            if len(ha) != len(hb):
                raise InputError(f"{name_a} has {len(ha) - 1} blocks but {name_b} has {len(hb) - 1}; "
                                 "per-layer parity needs the same depth")
            pair = valid[:, None, :, None] & valid[:, None, None, :]  # (B, 1, T, T) real query and key
            for i, (x, y) in enumerate(zip(ha, hb)):
                layer = "embeddings" if i == 0 else f"block {i - 1}"
                add(layer, "hidden", (x.float() - y.float())[valid].abs().flatten())
                if i > 0 and aa is not None and ab is not None:
                    p, q = aa[i - 1], ab[i - 1]
                    add(layer, "attention", (p.float() - q.float()).masked_select(pair).abs())
            if pa is not None and pb is not None:
                add("pooler", "hidden", (pa.float() - pb.float()).abs().flatten())
            va, vb = (pool(h[-1].float(), valid, "mean") for h in (ha, hb))  # (B, H): sentence vectors
            cosines.append(torch.nn.functional.cosine_similarity(va.double(), vb.double(), dim=-1))

    every = torch.cat(cosines) if cosines else torch.ones(0)
    report = ParityReport(a=name_a, b=name_b, dtype=dtype, atol=atol, inputs=count, longest=longest_input(batches),
                          cosine_min=float(every.min()) if every.numel() else None,
                          cosine_mean=float(every.mean()) if every.numel() else None, min_cosine=MIN_COSINE.get(dtype))
    for layer, kinds in stats.items():  # insertion order: embeddings, block 0, ..., pooler
        h, a = kinds["hidden"], kinds.get("attention")
        report.rows.append(Row(layer, h[0], h[1] / max(h[2], 1),
                               a[0] if a else None, a[1] / max(a[2], 1) if a else None))
    return report


def _max(t: torch.Tensor) -> float:
    return float("nan") if bool(torch.isnan(t).any()) else float(t.max())  # NaN must not hide


def run_parity(model: str, *, against: str | None = None, dtype: str = "fp32", texts=None, atol=None,
               tokenizer_source: str | None = None, device=None) -> ParityReport:
    """The ``minibert parity`` command as a function: ``model`` vs transformers on the same checkpoint, or
    ``model`` vs ``against``, both through minibert; both on ``device`` (None: the CPU; int8 is the CPU's)."""
    from ..names import parse_dtype
    from ..models import BertModel
    from ..tokenizer import BertTokenizer

    if dtype not in DEFAULT_ATOL:
        raise InputError(f"dtype {dtype!r} is not supported; use one of {sorted(DEFAULT_ATOL)}")
    atol = DEFAULT_ATOL[dtype] if atol is None else float(atol)
    if against is None and dtype != "int8":  # transformers has post-LN blocks only: no ablation to compare with
        from ..loading import read_config

        placement = read_config(model).norm_placement
        if placement != "post":
            raise InputError(f"{model} is a {placement} model (norm_placement={placement!r}): transformers cannot "
                             "represent it (its BertModel is BERT's post-LN), so there is nothing of transformers' to "
                             "compare it with; compare it with another minibert checkpoint instead: --against B")
    from ..loading import read_config

    tokenizer = BertTokenizer.from_pretrained(tokenizer_source or model)
    positions = read_config(model).max_position_embeddings
    batches = make_batches(tokenizer, texts=texts) if texts is not None else \
        make_batches(tokenizer, max_length=positions)  # the built-in inputs reach the last position
    if dtype == "int8":  # int8 against fp32, both through minibert's fast path (what an int8 user runs)
        if against is not None:
            raise InputError("--dtype int8 compares the int8 model with its own fp32 weights; leave out --against")
        from ..tools import fast

        reference, quantised = BertModel.from_pretrained(model), BertModel.from_pretrained(model, dtype="int8")
        report = compare(fast_runner(fast.prepare(quantised)), fast_runner(fast.prepare(reference)), batches,
                         atol=atol, name_a=f"minibert int8 {model}", name_b=f"minibert fp32 {model}", dtype=dtype)
        report.positions = positions
        return report
    torch_dtype = parse_dtype(dtype)
    ours = BertModel.from_pretrained(model, dtype=torch_dtype, device=device)
    if against is None:
        reference = load_transformers(model, torch_dtype).to(device or "cpu")
        report = compare(minibert_runner(ours), transformers_runner(reference), batches, atol=atol,
                         name_a=f"minibert {model}", name_b=f"transformers {model}", dtype=dtype)
    else:
        other = BertModel.from_pretrained(against, dtype=torch_dtype, device=device)
        check_same_geometry(geometry(ours.config), geometry(other.config), model, against)
        if (ours.pooler is None) != (other.pooler is None):
            raise InputError(f"{model if ours.pooler is None else against} has no pooler and "
                             f"{against if ours.pooler is None else model} has one: not the same model")
        report = compare(minibert_runner(ours), minibert_runner(other), batches, atol=atol, name_a=model,
                         name_b=against, dtype=dtype)
    report.positions = positions
    return report
