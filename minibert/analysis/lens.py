"""Fill-mask and the logit lens, with the masked-LM head of a pre-training checkpoint.

The logit lens (nostalgebraist 2020) reads every layer's hidden state with the final prediction head:
which token would the model predict if it stopped here? For BERT the head is the masked-LM head
(transform + LayerNorm + tied word embeddings); applied to hidden_states[-1] it is exactly the model's
prediction, applied to earlier layers it shows when that prediction forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from ..inputs import check_index
from ..tools import fast


@dataclass
class LensRow:
    layer: int  # index into hidden_states: 0 = embeddings output, i = block i - 1's output
    top_token: str  # this layer's own best guess
    top_prob: float
    target_rank: int  # rank of the final prediction at this layer (1 = best)
    target_prob: float  # probability of the final prediction at this layer


@dataclass
class LensResult:
    text: str
    position: int  # token position of the [MASK]
    target: str  # the model's final prediction
    rows: list[LensRow]

    def table(self) -> str:
        lines = [f"logit lens at position {self.position} ([MASK]) of {self.text!r}; "
                 f"final prediction {self.target!r}",
                 f"{'layer':>5}  {'top token':<16}{'p(top)':>8}  {'rank of ' + repr(self.target):>18}"
                 f"{'p(' + self.target + ')':>14}"]
        for r in self.rows:
            name = "emb" if r.layer == 0 else str(r.layer)
            lines.append(f"{name:>5}  {r.top_token:<16}{r.top_prob:>8.3g}  {r.target_rank:>18}{r.target_prob:>14.3g}")
        return "\n".join(lines)


def _mask_positions(tokenizer, batch) -> list[tuple[int, int]]:
    mask_id = tokenizer.vocab[tokenizer.mask_token]
    return [tuple(p) for p in (batch["input_ids"] == mask_id).nonzero().tolist()]


def _no_mask_error(tokenizer, text: str, max_length: int) -> InputError:
    """Why a text has no [MASK] in its token ids: none was written, or truncation cut it off."""
    tokens = tokenizer.tokenize(text)
    if tokenizer.mask_token in tokens:
        where = tokens.index(tokenizer.mask_token) + 2  # 1-based, after [CLS]
        return InputError(f"the {tokenizer.mask_token} in {text[:60]!r}... is token {where} of {len(tokens) + 2}, "
                          f"past the {max_length}-token limit, so truncation cut it off; shorten the text "
                          f"or move the {tokenizer.mask_token} earlier")
    return InputError(f"no {tokenizer.mask_token} token in {text!r}; write {tokenizer.mask_token} "
                      "where a word should be predicted")


def _max_length(model, tokenizer, max_length):
    limit = min(model.config.max_position_embeddings, tokenizer.model_max_length)
    if max_length is None:
        return limit
    return check_index("max_length", max_length, 3, limit, "[CLS], [MASK] and [SEP] need 3 tokens; the model has "
                       f"{model.config.max_position_embeddings} positions")


def fill_mask(model, tokenizer, texts, top_k: int = 5, max_length: int | None = None
              ) -> list[list[list[tuple[str, float]]]]:
    """For each text, for each [MASK] in it, the top_k (token, probability) predictions. Texts longer than
    ``max_length`` tokens (default: the model's limit) are truncated; a [MASK] cut off that way is an error
    that says so."""
    if isinstance(texts, str):
        texts = [texts]
    vocab = model.config.vocab_size
    check_index("top_k", top_k, 1, vocab, f"the vocabulary has {vocab} tokens")
    max_length = _max_length(model, tokenizer, max_length)
    batch = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    positions = _mask_positions(tokenizer, batch)
    missing = [t for i, t in enumerate(texts) if not any(b == i for b, _ in positions)]
    if missing:
        raise _no_mask_error(tokenizer, missing[0], max_length)
    with torch.inference_mode():
        hidden = fast.prepare(model)(**batch, output_hidden_states=False).last_hidden_state
        results: list[list] = [[] for _ in texts]
        for b, t in positions:
            probs = model.mlm_logits(hidden[b, t]).float().softmax(-1)
            p, ids = probs.topk(top_k)
            tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
            results[b].append([(tok, float(q)) for tok, q in zip(tokens, p)])
    return results


def logit_lens(model, tokenizer, text: str, mask_index: int = 0, max_length: int | None = None) -> LensResult:
    """Apply the masked-LM head to every hidden state at the ``mask_index``-th [MASK] of ``text``."""
    max_length = _max_length(model, tokenizer, max_length)
    batch = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
    positions = [t for _, t in _mask_positions(tokenizer, batch)]
    if not positions:
        raise _no_mask_error(tokenizer, text, max_length)
    check_index("mask_index", mask_index, 0, len(positions) - 1, f"the text has {len(positions)} masks")
    t = positions[mask_index]
    with torch.inference_mode():
        out = model(**batch)
        probs = torch.stack([model.mlm_logits(h[0, t]) for h in out.hidden_states]).float().softmax(-1)  # (L+1, V)
    target = int(probs[-1].argmax())
    rows = []
    for layer, p in enumerate(probs):
        top = int(p.argmax())
        rank = int((p > p[target]).sum()) + 1
        rows.append(LensRow(layer, tokenizer.convert_ids_to_tokens([top])[0], float(p[top]), rank, float(p[target])))
    return LensResult(text, t, tokenizer.convert_ids_to_tokens([target])[0], rows)
