"""``minibert pretrain``: from corpus files to a pre-trained BERT in a folder.

    a model to start from   --model M (continued pre-training: its weights, its vocabulary; a head it
                            lacks is made fresh) | --geometry tiny|mini|small|medium|base | --layers N
                            --hidden H --heads A [--intermediate F] (from scratch, BERT's N(0, 0.02)
                            initialisation, the vocabulary of --vocab FOLDER)
    the text                --corpus FILE... -> a token store in OUT/store (built once, reused);
                            --eval-texts FILE -> OUT/eval-store; --mix FILE:share replays general text
    the run                 training.pretrain.pretrain: checkpoints, log.jsonl, the model in OUT;
                            --teacher DIR distils a masked LM into it as it trains (DistilBERT)

The geometries are the BERT miniatures of Turc et al. 2019 (layers x hidden, heads = hidden / 64, FFN =
4 x hidden): tiny 2 x 128, mini 4 x 256, small 4 x 512, medium 8 x 512, base 12 x 768.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Callable, Sequence

from ...config import BertConfig
from ...errors import InputError
from ...hardware import training_device
from ...loading import copy_tokenizer
from ...textfiles import output_dir
from ...tokenizer import BertTokenizer
from .. import ddp
from ..pretrain import PretrainConfig, pretrain
from ..pretrain_data import Examples, MaskingRule, MixedExamples, TokenStore, corpus_files

#: Turc et al. 2019's miniatures: (layers, hidden)
GEOMETRIES = {"tiny": (2, 128), "mini": (4, 256), "small": (4, 512), "medium": (8, 512), "base": (12, 768)}


def geometry_config(vocab_size: int, *, geometry: str | None = None, layers: int | None = None,
                    hidden: int | None = None, heads: int | None = None, intermediate: int | None = None,
                    max_positions: int = 512) -> BertConfig:
    """A BertConfig from a named geometry or explicit sizes (heads default to hidden / 64, the FFN to 4 x
    hidden); a hidden size the heads do not divide is refused by name."""
    if geometry is not None:
        if geometry not in GEOMETRIES:
            raise InputError(f"--geometry {geometry!r}: use one of {', '.join(GEOMETRIES)}")
        if layers is not None or hidden is not None:
            raise InputError("--geometry names the layers and width: leave out --layers / --hidden")
        layers, hidden = GEOMETRIES[geometry]
    if layers is None or hidden is None:
        raise InputError("from scratch, give --geometry, or --layers and --hidden (and optionally --heads)")
    heads = heads if heads is not None else max(1, hidden // 64)
    if hidden % heads:
        raise InputError(f"--hidden {hidden} is not divisible by --heads {heads}: each head gets hidden / heads "
                         "features")
    return BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=intermediate if intermediate is not None else 4 * hidden,
                      max_position_embeddings=max_positions)


def run_pretraining(corpus: Sequence, out_dir, *, model: str | None = None, geometry: str | None = None,
                    layers: int | None = None, hidden: int | None = None, heads: int | None = None,
                    intermediate: int | None = None, vocab: str | None = None, max_length: int = 128,
                    nsp: bool = False, whole_word: bool = False, mask: float = 0.15,
                    config: PretrainConfig = PretrainConfig(steps=1000), eval_texts=None, mix: str | None = None,
                    dropout: float | None = None, resume: bool = False, store=None, teacher=None,
                    temperature: float = 2.0, alpha: float = 0.5, untied: bool = False, device=None,
                    log: Callable[[str], None] | None = None) -> dict:
    """The whole command (see the module docstring). ``dropout``: every dropout of the model at this
    probability while it trains (None: the config's, 0.1 from scratch). ``store``: the corpus' token store
    folder (default OUT/store; runs on one corpus and vocabulary can share one). ``teacher``: a masked-LM
    folder (or ``BertForMaskedLM``) the model also learns from, DistilBERT's way
    (``distill.MaskedLMDistiller`` with ``temperature`` and ``alpha``; not with NSP). ``untied``: from
    scratch, a masked-LM decoder of its own instead of the word embeddings (``untied.py``; not BERT,
    an ablation). ``device``: where the model trains ("cpu", "cuda", "cuda:N"; None: the CPU; fp16 needs
    CUDA). Returns ``pretrain``'s summary."""
    from ...checks import check_fraction
    from ...models.pretraining import BertForMaskedLM, BertForPreTraining

    config.check()
    where = training_device(device)
    if config.fp16 and where.type != "cuda":
        raise InputError("--fp16 needs a CUDA device (--device cuda); on a CPU use --bf16")
    out_dir = output_dir(out_dir)  # before any work
    rank = ddp.init()[0] if ddp.is_distributed() else 0
    if rank != 0:
        log = None  # process 0 alone speaks
    check_fraction("--mask", mask)
    if not 0 < mask:
        raise InputError("--mask must be more than 0: a masked-LM needs masked tokens")
    if teacher is not None:
        if nsp:
            raise InputError("a teacher distils the masked-LM predictions only: leave out --nsp")
        check_fraction("--alpha", alpha, closed=True)
        if not temperature > 0:
            raise InputError(f"--temperature {temperature!r} must be > 0")
    files = corpus_files(corpus)
    cls = BertForPreTraining if nsp else BertForMaskedLM
    scratch = model is None
    if untied and not scratch:
        raise InputError("--untied makes a new decoder from scratch: a continued model keeps its checkpoint's head "
                         "(config.json's tie_word_embeddings)")
    if scratch:
        if vocab is None:
            raise InputError("from scratch, give --vocab FOLDER (a vocab.txt and tokenizer_config.json, e.g. "
                             "weights/all-MiniLM-L6-v2): the ids the model learns")
        tokenizer = BertTokenizer.from_pretrained(vocab)
        bert_config = geometry_config(len(tokenizer.vocab), geometry=geometry, layers=layers, hidden=hidden,
                                      heads=heads, intermediate=intermediate)
        bert_config = dataclasses.replace(bert_config, tie_word_embeddings=not untied)
    else:
        if any(v is not None for v in (geometry, layers, hidden, heads, intermediate, vocab)):
            raise InputError("--model continues a checkpoint (its geometry and vocabulary): leave out --geometry, "
                             "--layers, --hidden, --heads, --intermediate and --vocab")
        tokenizer = BertTokenizer.from_pretrained(model)
    if scratch and max_length > bert_config.max_position_embeddings:
        raise InputError(f"--max-length {max_length} is more than the model's {bert_config.max_position_embeddings} "
                         "positions")
    if teacher is not None:  # before any work: the teacher loads and predicts this vocabulary's words
        if not isinstance(teacher, BertForMaskedLM):
            teacher = BertForMaskedLM.from_pretrained(teacher).to(where)
        tokenizer.check_fits(teacher.config, "the teacher")
    rule = MaskingRule(probability=mask, whole_word=whole_word)
    store = _store(files, tokenizer, out_dir / "store" if store is None else Path(store), config.progress, log)
    examples = Examples(store, tokenizer, max_length=max_length, nsp=nsp, rule=rule, seed=config.seed)
    if mix is not None:
        path, _, share = mix.rpartition(":")
        try:
            share = float(share)
        except ValueError:
            raise InputError(f"--mix {mix!r}: give FILE:share, e.g. general.txt:0.2") from None
        check_fraction("--mix share", share)
        other = _store(corpus_files([path]), tokenizer, out_dir / "mix-store", config.progress, log)
        examples = MixedExamples(examples, Examples(other, tokenizer, max_length=max_length, nsp=nsp, rule=rule,
                                                    seed=config.seed + 1), share)
    held = None
    if eval_texts is not None:
        held = held_examples(eval_texts, tokenizer, out_dir / "eval-store", max_length=max_length, nsp=nsp, rule=rule,
                             progress=config.progress, log=log)
        config = dataclasses.replace(config, eval_examples=min(config.eval_examples, held.per_epoch))
    if scratch:
        net = cls.from_config(bert_config, seed=config.seed)
        if log is not None:
            log(f"from scratch: {bert_config.num_hidden_layers} x {bert_config.hidden_size}, "
                f"{bert_config.num_attention_heads} heads, FFN {bert_config.intermediate_size}, vocabulary "
                f"{bert_config.vocab_size:,}{', untied decoder' if untied else ''} "
                f"({sum(p.numel() for p in net.parameters()):,} parameters)")
    else:
        net = cls.from_pretrained(model, seed=config.seed).train()
        if net.config.max_position_embeddings < max_length:
            raise InputError(f"--max-length {max_length} is more than {model}'s "
                             f"{net.config.max_position_embeddings} positions")
    tokenizer.check_fits(net.config, "the model")
    net.to(where)
    if teacher is not None and next(teacher.parameters()).device != where:
        teacher = copy.deepcopy(teacher).to(where)  # the caller's teacher stays where it is
    trained = net
    if teacher is not None:
        from ..distill import MaskedLMDistiller

        trained = MaskedLMDistiller(teacher, net, temperature=temperature, alpha=alpha)
    if log is not None:
        steps = config.total_steps(max_length)
        log(f"{store}; {examples.per_epoch:,} examples of {max_length} tokens an epoch; {steps:,} steps of "
            f"{config.batch_size * config.accumulate} examples ({steps * config.batch_size * config.accumulate / examples.per_epoch:.2f} epochs)")
    from ...tools.surgery import check_dropout, dropout as dropout_at

    source = vocab if scratch else model  # the tokenizer files every checkpoint and snapshot gets
    if dropout is None:
        summary = pretrain(trained, examples, config, out_dir, eval_examples=held, resume=resume,
                           tokenizer_source=source, log=log)
    else:
        check_dropout(dropout)
        with dropout_at(net, dropout):
            summary = pretrain(trained, examples, config, out_dir, eval_examples=held, resume=resume,
                               tokenizer_source=source, log=log)
    if rank == 0:
        copy_tokenizer(source, out_dir)
    return summary


def held_examples(eval_texts, tokenizer, folder, *, max_length: int, nsp: bool = False, rule: MaskingRule = MaskingRule(),
                  progress: bool = False, log=None) -> Examples:
    """The held-out examples of ``eval_texts`` (their token store in ``folder``), in one order whatever the
    run's seed: with ``evaluate``'s fixed mask seed, every run -- any seed, any depth -- is measured on the
    same examples with the same masks."""
    store = _store(corpus_files([eval_texts]), tokenizer, folder, progress, log)
    return Examples(store, tokenizer, max_length=max_length, nsp=nsp, rule=rule, seed=0)


def _store(files, tokenizer, folder, progress: bool, log) -> TokenStore:
    """The token store of ``files``: under torchrun process 0 builds it while the others wait, then they
    open what it built."""
    if not ddp.is_distributed():
        return TokenStore.build(files, tokenizer, folder, progress=progress, log=log)
    import torch.distributed as dist

    rank = ddp.init()[0]
    store = TokenStore.build(files, tokenizer, folder, progress=progress, log=log) if rank == 0 else None
    dist.barrier()
    return store or TokenStore.build(files, tokenizer, folder, progress=False)
