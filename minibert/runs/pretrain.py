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

import contextlib
import copy
import dataclasses
import warnings
from pathlib import Path
from typing import Callable, Sequence

from ..config import BertConfig
from ..errors import InputError
from ..hardware import training_device
from ..loading import copy_tokenizer
from ..tokenizer import BertTokenizer
from ..training import ddp
from ..training.pretrain import PretrainConfig, pretrain
from ..training.pretrain_data import Examples, MaskingRule, MixedExamples, TokenStore, corpus_files
from .skeleton import resolved

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
                    dropout: float | None = None, resume: bool = False, overwrite: bool = False, store=None,
                    teacher=None, temperature: float | None = None, alpha: float | None = None,
                    untied: bool = False, device=None, log: Callable[[str], None] | None = None) -> dict:
    """The whole command (see the module docstring). ``dropout``: every dropout of the model at this
    probability while it trains (None: the config's, 0.1 from scratch). ``store``: the corpus' token store
    folder (default OUT/store; runs on one corpus and vocabulary can share one). ``teacher``: a masked-LM
    folder (or ``BertForMaskedLM``) the model also learns from, DistilBERT's way
    (``distill.MaskedLMDistiller`` with ``temperature``, default 2, and ``alpha``, default 0.5; not with
    NSP). ``untied``: from scratch, a masked-LM decoder of its own instead of the word embeddings
    (``untied.py``; not BERT, an ablation). ``device``: where the model trains ("cpu", "cuda", "cuda:N";
    None: the CPU; fp16 needs CUDA).

    ``out_dir`` follows the output-folder rule (``outputs.RunFolder``): not a model folder read here, empty
    or new unless ``resume`` (the unfinished run there goes on, same settings; a finished one has nothing
    to resume and is returned as it is) or ``overwrite`` (replaced). Every argument and file is checked
    before anything is created. Returns ``pretrain``'s summary."""
    from ..checks import check_fraction, check_max_length
    from ..models.pretraining import BertForMaskedLM, BertForPreTraining
    from ..outputs import RunFolder
    from ..tools.surgery import check_dropout, dropout as dropout_at

    # everything that can be checked without loading anything, before any file is created
    config.check()
    where = training_device(device)
    if config.fp16 and where.type != "cuda":
        raise InputError("--fp16 needs a CUDA device (--device cuda); on a CPU use --bf16")
    check_fraction("--mask", mask)
    if not 0 < mask:
        raise InputError("--mask must be more than 0: a masked-LM needs masked tokens")
    if dropout is not None:
        check_dropout(dropout)
    if teacher is None:
        if temperature is not None or alpha is not None:
            raise InputError("--temperature and --alpha go with --teacher (distillation while pre-training)")
    else:
        if nsp:
            raise InputError("a teacher distils the masked-LM predictions only: leave out --nsp")
        temperature = 2.0 if temperature is None else temperature
        alpha = 0.5 if alpha is None else alpha
        check_fraction("--alpha", alpha, closed=True)
        if not temperature > 0:
            raise InputError(f"--temperature {temperature!r} must be > 0")
    scratch = model is None
    if untied and not scratch:
        raise InputError("--untied makes a new decoder from scratch: a continued model keeps its checkpoint's head "
                         "(config.json's tie_word_embeddings)")
    if scratch and vocab is None:
        raise InputError("from scratch, give --vocab FOLDER (a vocab.txt and tokenizer_config.json, e.g. "
                         "weights/all-MiniLM-L6-v2): the ids the model learns")
    if not scratch and any(v is not None for v in (geometry, layers, hidden, heads, intermediate, vocab)):
        raise InputError("--model continues a checkpoint (its geometry and vocabulary): leave out --geometry, "
                         "--layers, --hidden, --heads, --intermediate and --vocab")
    check_max_length("--max-length", max_length, 1 << 16, pair=nsp)  # the model's own limit: below
    files = corpus_files(corpus)  # every file exists and is readable, before the first is tokenised
    eval_files = corpus_files([eval_texts], "--eval-texts file") if eval_texts is not None else None
    mix_share = None
    if mix is not None:
        path, _, share = mix.rpartition(":")
        try:
            mix_share = float(share)
        except ValueError:
            raise InputError(f"--mix {mix!r}: give FILE:share, e.g. general.txt:0.2") from None
        check_fraction("--mix share", mix_share)
        if not path:
            raise InputError(f"--mix {mix!r}: give FILE:share, e.g. general.txt:0.2")
        mix_files = corpus_files([path], "--mix file")
    rank = ddp.rank()
    folder = RunFolder(out_dir, command="pretrain", reads={"--model": model, "--teacher": teacher, "--vocab": vocab},
                       resume=resume, overwrite=overwrite, writer=rank == 0)
    out_dir = folder.path
    if rank != 0:
        log = None  # process 0 alone speaks

    # the vocabulary and the model (loaded or built: nothing is written yet)
    cls = BertForPreTraining if nsp else BertForMaskedLM
    if scratch:
        tokenizer = BertTokenizer.from_pretrained(vocab)
        bert_config = geometry_config(len(tokenizer.vocab), geometry=geometry, layers=layers, hidden=hidden,
                                      heads=heads, intermediate=intermediate)
        bert_config = dataclasses.replace(bert_config, tie_word_embeddings=not untied)
        check_max_length("--max-length", max_length, bert_config.max_position_embeddings, pair=nsp)
        check_training_memory(bert_config, config, max_length, mask)
        net = cls.from_config(bert_config, seed=config.seed)
    else:
        tokenizer = BertTokenizer.from_pretrained(model)
        net = cls.from_pretrained(model, seed=config.seed).train()
        check_max_length("--max-length", max_length, net.config.max_position_embeddings, pair=nsp)
    tokenizer.check_fits(net.config, "the model")
    if teacher is not None:  # the teacher loads and predicts this vocabulary's words
        if not isinstance(teacher, BertForMaskedLM):
            teacher = BertForMaskedLM.from_pretrained(teacher)
        tokenizer.check_fits(teacher.config, "the teacher")
    if ddp.is_distributed():
        ddp.init()
    rule = MaskingRule(probability=mask, whole_word=whole_word)
    source = vocab if scratch else model  # the tokenizer files every checkpoint and snapshot gets
    shape = net.config  # the geometry as built: --geometry tiny and --layers 2 --hidden 128 are the same run
    settings = {"corpus": [resolved(f) for f in files], "model": resolved(model), "vocab": resolved(vocab),
                "layers": shape.num_hidden_layers, "hidden": shape.hidden_size, "heads": shape.num_attention_heads,
                "intermediate": shape.intermediate_size, "untied": untied, "max_length": max_length, "nsp": nsp,
                "whole_word": whole_word, "mask": mask, "mix": None if mix is None else [resolved(mix_files[0]), mix_share],
                "eval_texts": None if eval_files is None else [resolved(f) for f in eval_files], "dropout": dropout,
                "teacher": resolved(teacher), "temperature": temperature, "alpha": alpha,
                **{k: v for k, v in config.recorded().items() if k not in CHANGEABLE}}

    with folder.claim(settings) as run:
        run.resume_hint = lambda: resume_hint(out_dir, folder.shown)
        if run.finished:
            summary = run.finished_summary("pretrain") or {}
            message = (f"nothing to resume: {folder.shown} holds a finished run ({summary.get('steps', '?')} steps); "
                       "--overwrite trains it again from the start, --model continues from its weights in a new run")
            warnings.warn(message, stacklevel=2)
            return {**summary, "nothing_to_resume": True}
        if run.state == "new" and resume:
            warnings.warn(f"resume: {folder.shown} holds no run (nothing to resume): starting from step 0",
                          stacklevel=2)
        store_folder = out_dir / "store" if store is None else Path(store)
        store_ = _store(files, tokenizer, store_folder, config.progress, log)
        examples = Examples(store_, tokenizer, max_length=max_length, nsp=nsp, rule=rule, seed=config.seed)
        if mix is not None:
            other = _store(mix_files, tokenizer, out_dir / "mix-store", config.progress, log)
            examples = MixedExamples(examples, Examples(other, tokenizer, max_length=max_length, nsp=nsp, rule=rule,
                                                        seed=config.seed + 1), mix_share)
        held = None
        if eval_texts is not None:
            held = held_examples(eval_texts, tokenizer, out_dir / "eval-store", max_length=max_length, nsp=nsp,
                                 rule=rule, progress=config.progress, log=log)
            config = dataclasses.replace(config, eval_examples=min(config.eval_examples, held.per_epoch))
        if scratch and log is not None:
            log(f"from scratch: {bert_config.num_hidden_layers} x {bert_config.hidden_size}, "
                f"{bert_config.num_attention_heads} heads, FFN {bert_config.intermediate_size}, vocabulary "
                f"{bert_config.vocab_size:,}{', untied decoder' if untied else ''} "
                f"({sum(p.numel() for p in net.parameters()):,} parameters)")
        net.to(where)
        if teacher is not None and next(teacher.parameters()).device != where:
            teacher = copy.deepcopy(teacher).to(where)  # the caller's teacher stays where it is
        trained = net
        if teacher is not None:
            from ..training.distill import MaskedLMDistiller

            trained = MaskedLMDistiller(teacher, net, temperature=temperature, alpha=alpha)
        if log is not None:
            steps = config.total_steps(max_length)
            log(f"{store_}; {examples.per_epoch:,} examples of {max_length} tokens an epoch; {steps:,} steps of "
                f"{config.batch_size * config.accumulate} examples "
                f"({steps * config.batch_size * config.accumulate / examples.per_epoch:.2f} epochs)")
        with (dropout_at(net, dropout) if dropout is not None else contextlib.nullcontext()):
            summary = pretrain(trained, examples, config, out_dir, eval_examples=held,
                               resume=resume and run.state != "new",  # a new folder: said above, once
                               tokenizer_source=source, log=log)
        if rank == 0:
            copy_tokenizer(source, out_dir)
            run.note(pretrain=summary)
    return summary


#: settings a resumed run may change (how often it logs, evaluates, saves; what it keeps)
CHANGEABLE = ("eval_every", "eval_examples", "save_every", "keep", "log_every", "snapshots")


def resume_hint(out_dir: Path, shown: str) -> str:
    """Where an interrupted pre-training run in ``out_dir`` can go on from, in words."""
    from ..training.pretrain import checkpoints

    found = checkpoints(Path(out_dir))
    if found:
        return (f"{shown} can be resumed from step {int(found[-1].name.split('-')[1])} ({found[-1]}): run the same "
                "command with --resume")
    return (f"{shown} has no checkpoint yet (--save-every N writes them): the same command with --resume starts "
            "again from step 0")


def check_training_memory(bert_config, config: PretrainConfig, max_length: int, mask: float = 0.15) -> None:
    """Say what a model from scratch will take while it trains when that is large (over 2 GiB) -- fp32
    weights, gradients and AdamW's two moments (16 bytes a parameter), the activations autograd keeps for a
    micro-batch (``tools.accounting.activation_memory``) and the masked-LM logits at the ``mask`` share of
    the tokens -- and refuse one that cannot fit in this machine's memory (``hardware.check_memory``)."""
    from ..hardware import check_memory
    from ..tools.accounting import activation_memory, parameter_counts

    params = parameter_counts(bert_config)["total"]
    weights = 16 * params
    masked = round(config.batch_size * max_length * mask)
    activations = (activation_memory(bert_config, config.batch_size, max_length)["training"]
                   + 8 * masked * bert_config.vocab_size)
    check_memory(weights + activations,
                 f"a {bert_config.num_hidden_layers} x {bert_config.hidden_size} model from scratch has {params:,} "
                 f"parameters: about {weights / 2**30:.1f} GiB for the weights, gradients and AdamW's moments, and "
                 f"{activations / 2**30:.1f} GiB of activations a micro-batch of {config.batch_size} x {max_length}",
                 note_above=2**31, advice="; choose a smaller geometry, --batch-size or --max-length")


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
