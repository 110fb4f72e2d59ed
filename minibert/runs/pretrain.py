"""``minibert pretrain``: from corpus files to a pre-trained BERT in a folder.

    a model to start from   --model M (continued pre-training: its weights, its vocabulary; a head it
                            lacks is made fresh) | --geometry tiny|mini|small|medium|base | --blocks N
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
import logging
import warnings
from pathlib import Path

from ..config import BertConfig
from ..errors import InputError
from ..hardware import training_device
from ..loading import copy_tokenizer
from ..tokenizer import BertTokenizer
from ..training import ddp
from ..settings import base_of
from ..training.pretrain import CHANGEABLE, PretrainConfig, pretrain
from ..training.pretrain_data import Examples, MaskingRule, MixedExamples, TokenStore, corpus_files
from .settings import GEOMETRIES, PretrainRun  # noqa: F401  (GEOMETRIES: geometry_config's, and the benchmarks')
from .skeleton import resolved

log = logging.getLogger(__name__)



def geometry_config(vocab_size: int, *, geometry: str | None = None, layers: int | None = None,
                    hidden: int | None = None, heads: int | None = None, intermediate: int | None = None,
                    max_positions: int = 512) -> BertConfig:
    """A BertConfig from a named geometry or explicit sizes (heads default to hidden / 64, the FFN to 4 x
    hidden); a hidden size the heads do not divide is refused by name."""
    if geometry is not None:
        if geometry not in GEOMETRIES:
            raise InputError(f"--geometry {geometry!r}: use one of {', '.join(GEOMETRIES)}")
        if layers is not None or hidden is not None:
            raise InputError("--geometry names the layers and width: leave out --blocks / --hidden")
        layers, hidden = GEOMETRIES[geometry]
    if layers is None or hidden is None:
        raise InputError("from scratch, give --geometry, or --blocks and --hidden (and optionally --heads)")
    heads = heads if heads is not None else max(1, hidden // 64)
    if hidden % heads:
        raise InputError(f"--hidden {hidden} is not divisible by --heads {heads}: each head gets hidden / heads "
                         "features")
    return BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=intermediate if intermediate is not None else 4 * hidden,
                      max_position_embeddings=max_positions)


def run_pretraining(run: PretrainRun) -> dict:
    """The whole command (see the module docstring and ``PretrainRun`` for every setting). ``dropout``:
    every dropout of the model at this probability while it trains (None: the config's, 0.1 from scratch).
    ``store``: the corpus' token store folder (default OUT/store). ``teacher``: a masked-LM folder (or
    ``BertForMaskedLM``) the model also learns from, DistilBERT's way (``distill.MaskedLMDistiller`` with
    ``temperature``, default 2, and ``alpha``, default 0.5; not with NSP). ``untied``: from scratch, a
    masked-LM decoder of its own instead of the word embeddings (``untied.py``; not BERT, an ablation).
    ``norm``: from scratch, where each block's LayerNorm sits (``models/norms.py``: post, pre, deepnorm).
    ``device``: where the model trains (fp16 needs CUDA).

    ``run.out`` follows the output-folder rule (``outputs.RunFolder``): not a model folder read here, empty
    or new unless ``resume`` (the unfinished run there goes on, same settings; a finished one has nothing
    to resume and is returned as it is) or ``overwrite`` (replaced). Every setting and file is checked
    before anything is created. Returns ``pretrain``'s summary."""
    from ..outputs import RunFolder, reads_of
    from ..tools.surgery import dropout as dropout_at

    where, files, eval_files, mix_files, mix_share = _checked(run)  # before any file is created
    config = base_of(run, PretrainConfig)
    rank = ddp.rank()
    folder = RunFolder(run.out, command="pretrain", writer=rank == 0, resume=run.resume, overwrite=run.overwrite,
                       reads=reads_of(run))
    out_dir = folder.path
    net, tokenizer, teacher = _models(run, config)  # loaded or built: nothing is written yet
    if ddp.is_distributed():
        ddp.init()
    rule = MaskingRule(probability=run.mask, whole_word=run.whole_word)
    source = run.vocab if run.scratch else run.model  # the tokenizer files every checkpoint and snapshot gets
    shape = net.config  # the geometry as built: --geometry tiny and --blocks 2 --hidden 128 are the same run
    temperature, alpha = _teacher_weights(run)
    settings = {"corpus": [resolved(f) for f in files], "model": resolved(run.model), "vocab": resolved(run.vocab),
                "layers": shape.num_hidden_layers, "hidden": shape.hidden_size, "heads": shape.num_attention_heads,
                "intermediate": shape.intermediate_size, "untied": run.untied, "norm": shape.norm_placement,
                "max_length": run.max_length,
                "nsp": run.nsp, "whole_word": run.whole_word, "mask": run.mask,
                "mix": None if run.mix is None else [resolved(mix_files[0]), mix_share],
                "eval_texts": None if eval_files is None else [resolved(f) for f in eval_files], "dropout": run.dropout,
                "teacher": resolved(run.teacher), "temperature": temperature, "alpha": alpha,
                **{k: v for k, v in config.recorded().items() if k not in CHANGEABLE}}
    with folder.claim(settings) as claimed:
        claimed.resume_hint = lambda: resume_hint(out_dir, folder.shown)
        if claimed.finished:
            summary = claimed.finished_summary("pretrain") or {}
            message = (f"nothing to resume: {folder.shown} holds a finished run ({summary.get('steps', '?')} steps); "
                       "--overwrite trains it again from the start, --model continues from its weights in a new run")
            warnings.warn(message, stacklevel=2)
            return {**summary, "nothing_to_resume": True}
        if claimed.state == "new" and run.resume:
            warnings.warn(f"resume: {folder.shown} holds no run (nothing to resume): starting from step 0",
                          stacklevel=2)
        examples, held, config = _examples(run, config, tokenizer, rule, files, mix_files, mix_share, out_dir)
        if run.scratch:
            log.info(f"from scratch: {shape.num_hidden_layers} x {shape.hidden_size}, {shape.num_attention_heads} heads, "
                     f"FFN {shape.intermediate_size}, vocabulary {shape.vocab_size:,}"
                     f"{', untied decoder' if run.untied else ''}"
                     f"{'' if run.norm == 'post' else ', ' + run.norm + ' norm placement'}"
                     f" ({sum(p.numel() for p in net.parameters()):,} parameters)")
        net.to(where)
        if teacher is not None and next(teacher.parameters()).device != where:
            teacher = copy.deepcopy(teacher).to(where)  # the caller's teacher stays where it is
        trained = net
        if teacher is not None:
            from ..training.distill import MaskedLMDistiller

            trained = MaskedLMDistiller(teacher, net, temperature=temperature, alpha=alpha)
        with (dropout_at(net, run.dropout) if run.dropout is not None else contextlib.nullcontext()):
            summary = pretrain(trained, examples, config, out_dir, eval_examples=held,
                               resume=run.resume and claimed.state != "new",  # a new folder: said above, once
                               tokenizer_source=source)
        if rank == 0:
            copy_tokenizer(source, out_dir)
            claimed.note(pretrain=summary)
    if ddp.is_distributed():
        ddp.finish()  # every process leaves the job together (a process that exits first can abort the others)
    return summary


def _teacher_weights(run: PretrainRun) -> tuple[float | None, float | None]:
    """The distillation's temperature and alpha (2 and 0.5 unless given; None without a teacher)."""
    if run.teacher is None:
        return None, None
    return (2.0 if run.temperature is None else run.temperature), (0.5 if run.alpha is None else run.alpha)


def _checked(run: PretrainRun):
    """Everything that can be checked without loading anything: the settings, the device, the files (each
    exists and is readable, before the first is tokenised), the --mix share. Returns (device, corpus
    files, eval files or None, mix files or None, mix share or None)."""
    from ..checks import check_fraction, check_max_length

    run.check()
    where = training_device(run.device)
    if run.fp16 and where.type != "cuda":
        raise InputError("--fp16 needs a CUDA device (--device cuda); on a CPU use --bf16")
    check_max_length("--max-length", run.max_length, 1 << 16, pair=run.nsp)  # the model's own limit: later
    files = corpus_files(run.corpus)
    eval_files = corpus_files([run.eval_texts], "--eval-texts file") if run.eval_texts is not None else None
    mix_files = mix_share = None
    if run.mix is not None:
        path, _, share = run.mix.rpartition(":")
        try:
            mix_share = float(share)
        except ValueError:
            raise InputError(f"--mix {run.mix!r}: give FILE:share, e.g. general.txt:0.2") from None
        check_fraction("--mix share", mix_share)
        if not path:
            raise InputError(f"--mix {run.mix!r}: give FILE:share, e.g. general.txt:0.2")
        mix_files = corpus_files([path], "--mix file")
    return where, files, eval_files, mix_files, mix_share


def _models(run: PretrainRun, config: PretrainConfig):
    """(the model to train, its tokenizer, the teacher or None): built from scratch (``run.geometry`` or
    sizes, ``run.vocab``) or loaded (``run.model``), checked against ``max_length`` and the tokenizer."""
    from ..checks import check_max_length
    from ..models.norms import norm_config
    from ..models.pretraining import BertForMaskedLM, BertForPreTraining

    cls = BertForPreTraining if run.nsp else BertForMaskedLM
    if run.scratch:
        tokenizer = BertTokenizer.from_pretrained(run.vocab)
        bert_config = geometry_config(len(tokenizer.vocab), geometry=run.geometry, layers=run.layers,
                                      hidden=run.hidden, heads=run.heads, intermediate=run.intermediate)
        bert_config = norm_config(dataclasses.replace(bert_config, tie_word_embeddings=not run.untied), run.norm)
        check_max_length("--max-length", run.max_length, bert_config.max_position_embeddings, pair=run.nsp)
        check_training_memory(bert_config, config, run.max_length, run.mask)
        net = cls.from_config(bert_config, seed=config.seed)
    else:
        tokenizer = BertTokenizer.from_pretrained(run.model)
        net = cls.from_pretrained(run.model, seed=config.seed).train()
        check_max_length("--max-length", run.max_length, net.config.max_position_embeddings, pair=run.nsp)
    tokenizer.check_fits(net.config, "the model")
    teacher = run.teacher
    if teacher is not None:  # the teacher loads and predicts this vocabulary's words
        if not isinstance(teacher, BertForMaskedLM):
            teacher = BertForMaskedLM.from_pretrained(teacher)
        tokenizer.check_fits(teacher.config, "the teacher")
    return net, tokenizer, teacher


def _examples(run: PretrainRun, config: PretrainConfig, tokenizer, rule, files, mix_files, mix_share, out_dir):
    """(the run's examples, the held-out ones or None, the config with its evaluation size fitted): the token
    stores built once (or reused), a --mix replayed, and what an epoch and the run hold said."""
    store_folder = out_dir / "store" if run.store is None else Path(run.store)
    store_ = _store(files, tokenizer, store_folder, config.progress)
    examples = Examples(store_, tokenizer, max_length=run.max_length, nsp=run.nsp, rule=rule, seed=config.seed)
    if mix_files is not None:
        other = _store(mix_files, tokenizer, out_dir / "mix-store", config.progress)
        examples = MixedExamples(examples, Examples(other, tokenizer, max_length=run.max_length, nsp=run.nsp,
                                                    rule=rule, seed=config.seed + 1), mix_share)
    held = None
    if run.eval_texts is not None:
        held = held_examples(run.eval_texts, tokenizer, out_dir / "eval-store", max_length=run.max_length,
                             nsp=run.nsp, rule=rule, progress=config.progress)
        config = dataclasses.replace(config, eval_examples=min(config.eval_examples, held.per_epoch))
    steps, per_step = config.total_steps(run.max_length), config.batch_size * config.accumulate
    log.info(f"{store_}; {examples.per_epoch:,} examples of {run.max_length} tokens an epoch; {steps:,} steps of "
             f"{per_step} examples ({steps * per_step / examples.per_epoch:.2f} epochs)")
    return examples, held, config




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
                  progress: bool = False) -> Examples:
    """The held-out examples of ``eval_texts`` (their token store in ``folder``), in one order whatever the
    run's seed: with ``evaluate``'s fixed mask seed, every run -- any seed, any depth -- is measured on the
    same examples with the same masks."""
    store = _store(corpus_files([eval_texts]), tokenizer, folder, progress)
    return Examples(store, tokenizer, max_length=max_length, nsp=nsp, rule=rule, seed=0)


def _store(files, tokenizer, folder, progress: bool) -> TokenStore:
    """The token store of ``files``: under torchrun process 0 builds it while the others wait, then they
    open what it built."""
    if not ddp.is_distributed():
        return TokenStore.build(files, tokenizer, folder, progress=progress)
    import torch.distributed as dist

    rank = ddp.init()[0]
    store = TokenStore.build(files, tokenizer, folder, progress=progress) if rank == 0 else None
    dist.barrier()
    return store or TokenStore.build(files, tokenizer, folder, progress=False)
