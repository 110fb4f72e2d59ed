"""The settings of each run, declared once (``minibert.settings``): the command line, the checks, the
CLI reference page and the Python API all come from these dataclasses. Standard library only, so that the
CLI builds its parser without importing torch.

    FinetuneRun   minibert finetune   (``runs.finetune.finetune(run)``)
    ExitsRun      minibert exits      (``runs.exits.train_exits(run)``)
    DistillRun    minibert distill    (``runs.distill.distill_corpus(run)`` / ``distill_task(run)``)
    PretrainRun   minibert pretrain   (``runs.pretrain.run_pretraining(run)``)

and the recipes' own defaults (``RECIPES``): what trains, the learning rate and the schedule each recipe
was measured to work with. A run that leaves ``lr`` or ``epochs`` unset takes its recipe's, and says so.
A recipe's schedule is stated in the unit that carries across dataset sizes: its epochs, and the fewest
optimiser steps it needs (``min_steps``) -- on a small training file the epochs grow until that many steps
are taken (``recipe_epochs``; at most ``max_epochs``); the warm-up is a fraction of the steps.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..checks import check_seed
from ..errors import InputError
from ..settings import base_of, check, setting
from ..training.settings import LR_BOUNDS, POOLINGS, EmbeddingDistillConfig, FitConfig, PretrainConfig

DEFAULT_MODEL = "bert-base-uncased"
MODEL_HELP = f"checkpoint directory, .safetensors file or hub id (default {DEFAULT_MODEL})"


# the settings several commands share, each declared here once (a dataclass field is made per class)
def _text_column():
    return setting("text", "the column holding the text")


def _text_pair_column():
    return setting(None, "a second text per row (sentence pairs)")


def _label_column():
    return setting("label", "the column holding the label")


def _tag_column():
    return setting("upos", "CoNLL-U column with the tags (--task tag)")


def _overwrite():
    return setting(False, "replace what --out holds (a model or another run): its files are deleted when the run "
                          "starts, in one step; without it a folder that holds anything is refused")


def _device():
    return setting(None, "where to train: cpu (default), cuda or cuda:N")


@dataclass(frozen=True)
class Recipe:
    """A fine-tuning recipe's defaults: what trains, at which learning rate, for how many epochs, its own
    options, and the measurement they come from."""

    trains: str
    lr: float
    epochs: int
    options: tuple[tuple[str, object], ...] = ()  # (field of FinetuneRun, default) -- the recipe's own options
    measured: str = ""
    min_steps: int = 0  # the fewest optimiser steps its defaults were measured to need: more epochs on small data
    max_epochs: int = 30  # ... but never more epochs than this
    caveat: str = ""  # where it was measured to trail full fine-tuning by more than 5 points, and what closes it


def recipe_epochs(recipe: Recipe, rows: int, batch_size: int) -> tuple[int, str]:
    """The epochs ``recipe`` takes on ``rows`` training rows in batches of ``batch_size``: its own, or more when
    those would be fewer than its ``min_steps`` optimiser steps (up to ``max_epochs``); and why, in words."""
    per_epoch = -(-rows // batch_size)  # the last batch may be short
    needed = -(-recipe.min_steps // per_epoch) if recipe.min_steps else 0
    epochs = min(max(recipe.epochs, needed), max(recipe.max_epochs, recipe.epochs))
    why = f"{rows:,} row{'s' if rows != 1 else ''} at batch {batch_size}: {_steps(per_epoch)} an epoch"
    if epochs == recipe.epochs:
        return epochs, why + (f"; {epochs} epochs reach its {recipe.min_steps:,} steps" if recipe.min_steps else "")
    if epochs < needed:  # capped: the most epochs it takes, still short of its steps
        return epochs, why + (f"; {epochs} epochs (its most) rather than {recipe.epochs}: {_steps(epochs * per_epoch)} "
                              f"in all, short of the {recipe.min_steps:,} its defaults were measured with")
    return epochs, why + (f"; {epochs} epochs rather than {recipe.epochs}, for at least "
                          f"{recipe.min_steps:,} steps ({epochs * per_epoch:,})")


def _steps(n: int) -> str:
    return f"{n:,} step{'s' if n != 1 else ''}"


#: every recipe's defaults, and what they measured: all-MiniLM-L6-v2, TREC-6 (the first 600, 1,200 and all 5,452
#: training questions; the 500 test questions held out), batch 16, max length 64, the best epoch's accuracy, mean
#: of seeds 0-1 (5,452 rows: seed 0). The learning rates were measured first at 3 epochs of 1,500 rows
#: (benchmarks/results/recipes_epyc-zen4.md); the schedule in steps next (min_steps 600, one value for every
#: recipe: at 1,200 rows 3 epochs left gradual unfreezing 4.9 points and LoRA 4.2 behind full fine-tuning, 8
#: epochs (600 steps) brought every recipe but ScalarMix within 2.1; a per-recipe sweep of min_steps is not done):
#: benchmarks/results/recipes_sizes_epyc-zen4.md, `python benchmarks/bench_recipes.py`. ``measured``: 1,200 rows.
_STEPS = 600
RECIPES = {
    "full": Recipe("everything", 5e-5, 3, measured="accuracy 0.958 (0.957 on 600 rows)", min_steps=_STEPS),
    "gradual": Recipe("the head first, then one more block from the top each epoch, the embeddings last",
                      2e-4, 3, measured="accuracy 0.963 (0.953 on 600 rows)", min_steps=_STEPS),
    "llrd": Recipe("everything, each block at 0.9x the rate of the one above", 5e-5, 3,
                   measured="accuracy 0.959 (0.959 on 600 rows)", min_steps=_STEPS),
    "lora": Recipe("LoRA's A and B (rank 8, alpha 16) on the adapted layers, and the head", 1e-3, 3,
                   options=(("lora_rank", 8), ("lora_targets", ("query", "value")), ("merge_lora", False)),
                   measured="accuracy 0.937 (0.936 on 600 rows)", min_steps=_STEPS),
    "scalarmix": Recipe("a ScalarMix over every layer and a linear head (the encoder frozen)", 1e-2, 3,
                        measured="accuracy 0.894 (0.872 on 600 rows)", min_steps=_STEPS,
                        caveat="6.4 points behind full fine-tuning on 1,200 TREC-6 rows, 8.5 on 600, 6.0 on 5,452: its "
                               "encoder is frozen and no setting of it closes that; --recipe gradual or llrd does"),
    "adapter": Recipe("the bottleneck adapters and the head (the base frozen)", 1e-3, 3,
                      options=(("adapter_kind", "houlsby"), ("adapter_size", 64)),
                      measured="accuracy 0.960 (0.945 on 600 rows)", min_steps=_STEPS),
    "prefix": Recipe("the prefixes (through their MLP), a pooler of the module's own and the head (the base "
                     "frozen)", 1e-3, 3, options=(("prefix_length", 16),),
                     measured="accuracy 0.946 (0.932 on 600 rows)", min_steps=_STEPS),
}
TASK_MODULE_RECIPES = ("adapter", "prefix", "lora")
TASKS = ("classify", "regress", "tag")


def _recipe_help() -> str:
    said = "; ".join(f"{name}: {r.trains}" + (f" ({r.caveat})" if r.caveat else "") for name, r in RECIPES.items())
    return (f"what trains and how: {said}. adapter, prefix and lora write the task module alone with the head (KB to "
            "a few MB; `minibert predict` takes it)")


def _epochs_help() -> str:
    rules = sorted({f"{r.epochs}, more on a small file to take at least {r.min_steps} optimiser steps (up to "
                    f"{r.max_epochs} epochs)" for r in RECIPES.values()})
    return "the recipe's: " + "; ".join(rules)


@dataclass(kw_only=True)
class FinetuneRun(FitConfig):
    """``minibert finetune``: a task head (and a recipe) trained on labelled files. The loop's settings
    (``FitConfig``) are its own too; ``lr`` and ``epochs`` default to the recipe's."""

    train: str = setting(help=".csv / .tsv / .jsonl (classify, regress) or .conllu / BIO file (tag)", required=True,
                         path="read")
    eval: str = setting(help="held-out data in the same format, evaluated after each epoch", required=True,
                        path="read")
    out: str = setting(help="directory for the best checkpoint, its tokenizer and metrics.json", required=True,
                       path="run")
    model: str = setting(DEFAULT_MODEL, MODEL_HELP.removesuffix(f" (default {DEFAULT_MODEL})"), path="model")
    task: str = setting("classify", "classify (a label per row), regress (a number per row) or tag (a tag per "
                        "word)", choices=TASKS)
    text_column: str = _text_column()
    text_pair_column: str | None = _text_pair_column()
    label_column: str = _label_column()
    tag_column: str = _tag_column()
    recipe: str = setting("full", _recipe_help(), choices=tuple(RECIPES))
    epochs: int | None = setting(None, "passes over the training file", low=1, default_text=_epochs_help())
    lr: float | None = setting(None, "peak learning rate (warmup over the first 10 % of the steps, then linear "
                               "decay)", **LR_BOUNDS,
                               default_text="the recipe's: " + ", ".join(f"{n} {r.lr:g}" for n, r in RECIPES.items()))
    batch_size: int = setting(16, "texts per batch", low=1)
    max_length: int = setting(128, "truncate texts to this many tokens, [CLS] and [SEP] included; at most the "
                              "model's positions", low=3)
    overwrite: bool = _overwrite()
    device: str | None = _device()
    lora_rank: int | None = setting(None, "--recipe lora: the rank r (alpha = 2r), at most the hidden size", low=1,
                                    default_text="8")
    lora_targets: tuple[str, ...] | None = setting(
        None, "--recipe lora: the linear layers to adapt, comma-separated: query, key, value, output (attention), "
              "dense_in, dense_out (feed-forward), or patterns such as '*.ffn.*'", default_text="query,value")
    merge_lora: bool = setting(False, "--recipe lora: write the merged whole checkpoint instead of the task module")
    adapter_kind: str | None = setting(None, "--recipe adapter: after attention and the FFN (houlsby, the default) "
                                       "or after the FFN only (pfeiffer)", choices=("houlsby", "pfeiffer"))
    adapter_size: int | None = setting(None, "--recipe adapter: the bottleneck width, 1 to the model's hidden size",
                                       low=1, default_text="64")
    prefix_length: int | None = setting(None, "--recipe prefix: P, the learnt keys and values per block, 1 to the "
                                        "model's positions", low=1, default_text="16")
    layerdrop: float = setting(0.0, "skip each block with this probability while training (LayerDrop; e.g. 0.2), "
                               "to prune later; in [0, 1)", low=0.0, below=1.0)

    def recipe_options(self) -> dict:
        """The recipe's own options (its defaults where not given); an option of another recipe is refused
        by name, as it would otherwise be ignored."""
        for name, recipe in RECIPES.items():
            for option, _ in recipe.options:
                if name != self.recipe and getattr(self, option) not in (None, False):
                    flag = "--" + option.replace("_", "-")
                    raise InputError(f"{flag} belongs to the {name} recipe; this run's recipe is "
                                     f"{self.recipe}: leave it out, or use --recipe {name}")
        return {option: default if getattr(self, option) in (None, False) else getattr(self, option)
                for option, default in RECIPES[self.recipe].options}

    def with_recipe_defaults(self, rows: int | None = None, batch_size: int | None = None
                             ) -> tuple[FinetuneRun, list[str]]:
        """This run with ``lr`` and ``epochs`` taken from its recipe where not given, and the words saying
        which were taken (empty when the user gave both). The epochs follow the training file's ``rows``
        (``recipe_epochs``: at least the recipe's ``min_steps`` steps of ``batch_size``, default this run's);
        without ``rows``, the recipe's own epochs."""
        recipe = RECIPES[self.recipe]
        chosen, said = {}, []
        if self.lr is None:
            chosen["lr"] = recipe.lr
            said.append(f"lr {recipe.lr:g}")
        if self.epochs is None:
            if rows is None:
                chosen["epochs"], why = recipe.epochs, ""
            else:
                chosen["epochs"], why = recipe_epochs(recipe, rows, batch_size or self.batch_size)
            said.append(f"epochs {chosen['epochs']}" + (f" ({why})" if why else ""))
        return replace(self, **chosen), said


@dataclass(kw_only=True)
class ExitsRun(FitConfig):
    """``minibert exits``: early exits on a fine-tuned classifier (frozen, or trained with it)."""

    model: str = setting(help="a classifier written by `minibert finetune`", required=True, path="model")
    train: str = setting(help="labelled training data (.csv / .tsv / .jsonl)", required=True, path="read")
    eval: str = setting(help="held-out data: the accuracy / blocks / time table is measured on it", required=True,
                        path="read")
    out: str = setting(help="directory for the classifier with its exits", required=True, path="run")
    text_column: str = _text_column()
    label_column: str = _label_column()
    joint: bool = setting(False, "train the whole model with the exits (default: frozen model, only the exits learn)")
    epochs: int = setting(2, "passes over the training file", low=1)
    lr: float | None = setting(None, "learning rate", **LR_BOUNDS,
                               default_text="1e-3: only the exits train; --joint 5e-5")
    batch_size: int = setting(16, "texts per batch", low=1)
    max_length: int = setting(128, "truncate texts to this many tokens, [CLS] and [SEP] included", low=3)
    rounds: int = setting(5, "timing rounds for the speed column: every rule warmed up, then called in alternation "
                          "this many times; the median and quartiles are printed", low=1)
    overwrite: bool = _overwrite()
    device: str | None = setting(None, "where to train and measure: cpu (default), cuda or cuda:N")
    progress: bool = setting(True, "no progress bar or epoch lines", flag="--quiet", negate=True)

    def learning_rate(self) -> float:
        """The rate given, else the one for what trains: 1e-3 for the exits alone, 5e-5 with the model."""
        return self.lr if self.lr is not None else (5e-5 if self.joint else 1e-3)


#: options of embedding mode only, refused in task mode: (field, message)
EMBEDDING_ONLY = (
    ("group_by_length", "--group-by-length is for embedding mode (--texts); task distillation batches as finetune"),
    ("augment", "--augment is for embedding mode (--texts): task distillation trains on labelled rows"),
    ("freeze_embeddings", "--freeze-embeddings is for embedding mode (--texts)"),
    ("cache_teacher", "--cache-teacher is for embedding mode (--texts): task distillation runs the teacher on each "
                      "batch"),
)


@dataclass(kw_only=True)
class DistillRun(EmbeddingDistillConfig):
    """``minibert distill``: a shallower student of a teacher -- its sentence embeddings on unlabelled texts
    (``texts``: embedding mode), or its predictions on labelled files (``train`` and ``eval``: task mode)."""

    teacher: str = setting(help="the model to imitate (a fine-tuned checkpoint for task mode)", required=True,
                           path="model")
    out: str = setting(help="directory for the student's best checkpoint, tokenizer, metrics.json", required=True,
                       path="run")
    student_blocks: str | list | None = setting(None, "teacher blocks the student starts from, e.g. 0,2,4",
                                         default_text="every other: 0,2,4,...")
    texts: str | list | None = setting(None, "embedding mode: unlabelled texts, one per line (in Python, a list of "
                                       "texts too)", path="read")
    eval_texts: str | list | None = setting(None, "embedding mode: held-out texts for the agreement, at least 21",
                                            default_text="5 % of --texts, at least 21, at most 1000", path="read")
    pooling: str | None = setting(None, "embedding mode: sentence vector", choices=POOLINGS, flag="--pool",
                                  default_text="a sentence-transformers teacher's pooling, else mean")
    normalize: bool | None = setting(None, "embedding mode: match unit vectors (default: as a sentence-transformers "
                                     "teacher does)")
    augment: int = setting(0, "embedding mode: add N texts made from --texts (crops, pairs, word dropout)")
    freeze_embeddings: bool = setting(False, "embedding mode: the student keeps the teacher's embeddings (a faster "
                                      "step)")
    train: str | None = setting(None, "task mode: labelled training data (the finetune formats)", path="read")
    eval: str | None = setting(None, "task mode: held-out data, evaluated after each epoch", path="read")
    task: str | None = setting(None, "task mode: what the teacher does", choices=("classify", "tag"),
                               default_text="classify")
    temperature: float | None = setting(None, "task mode: softmax temperature T", low=0.0, strict=True,
                                        default_text="2")
    alpha: float | None = setting(None, "task mode: weight of the soft targets, in [0, 1]", low=0.0, high=1.0,
                                  default_text="0.5")
    layer_map: str | None = setting(None, "student:teacher hidden states, e.g. 1:2,2:4,3:6", default_text="uniform")
    student_dropout: float | None = setting(None, "the student's dropout while it trains; the saved student keeps "
                                            "its own", low=0.0, below=1.0,
                                            default_text="0 in embedding mode, its own in task mode")
    text_column: str = _text_column()
    text_pair_column: str | None = _text_pair_column()
    label_column: str = _label_column()
    tag_column: str = _tag_column()
    lr: float | None = setting(None, "learning rate", **LR_BOUNDS,
                               default_text="5e-4 embeddings, 5e-5 task")
    overwrite: bool = _overwrite()
    device: str | None = setting(None, "where the teacher and the student run: cpu (default), cuda or cuda:N")
    progress: bool = setting(True, "no progress bar or epoch lines", flag="--quiet", negate=True)
    bf16: bool = setting(False, "the student trains under bf16 autocast (fp32 master weights; the teacher stays fp32)")

    @property
    def mode(self) -> str:
        return "task" if self.train is not None else "embeddings"

    def check(self) -> None:
        """The settings, and what goes with which mode (one of --texts / --train, the task mode's --eval)."""
        super().check()
        if self.texts is not None and self.train is not None:
            raise InputError("--texts (sentence-embedding distillation) and --train (task distillation) exclude "
                             "each other")
        if self.texts is None and self.train is None:
            raise InputError("give --texts (sentence-embedding distillation on unlabelled text) or --train and --eval "
                             "(task distillation from a fine-tuned teacher)")
        if self.train is not None and self.eval is None:
            raise InputError("task distillation needs --eval (held-out data in the --train format)")
        if self.train is not None:
            for name, message in EMBEDDING_ONLY:
                if getattr(self, name):
                    raise InputError(message)
        else:
            for name in ("task", "temperature", "alpha"):
                if getattr(self, name) is not None:
                    raise InputError(f"--{name} is for task mode (--train / --eval): embedding distillation matches "
                                     "the teacher's sentence vectors, not its predictions")

    def blocks(self) -> list[int] | None:
        """``student_blocks`` as block numbers (None: the default choice)."""
        if self.student_blocks is None or isinstance(self.student_blocks, (list, tuple)):
            return None if self.student_blocks is None else list(self.student_blocks)
        try:
            return [int(x) for x in self.student_blocks.split(",") if x.strip()]
        except ValueError:
            raise InputError(f"--student-blocks {self.student_blocks!r}: give block numbers separated by commas, "
                             "e.g. 0,2,4") from None

    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (5e-4 if self.mode == "embeddings" else 5e-5)


#: Turc et al. 2019's miniatures: (layers, hidden)
GEOMETRIES = {"tiny": (2, 128), "mini": (4, 256), "small": (4, 512), "medium": (8, 512), "base": (12, 768)}


@dataclass(kw_only=True)
class PretrainRun(PretrainConfig):
    """``minibert pretrain``: a BERT pre-trained with its own objective (masked LM, optionally next sentence)
    from corpus files, from scratch (``geometry`` or ``layers`` / ``hidden``, with ``vocab``) or continued
    (``model``). The loop's settings (``PretrainConfig``) are its own too."""

    corpus: tuple[str, ...] = setting(help="text files (a document per line, or documents separated by blank "
                                      "lines), .jsonl files (a 'text' field) or folders of them", required=True,
                                      nargs="+", path="read")
    out: str = setting(help="folder for the model, checkpoints/, log.jsonl and the token store", required=True,
                       path="run")
    model: str | None = setting(None, "continue pre-training this checkpoint (its geometry and vocabulary)",
                                path="model")
    geometry: str | None = setting(None, "from scratch: a BERT miniature (Turc et al. 2019): 2x128, 4x256, 4x512, "
                                   "8x512, 12x768", choices=tuple(GEOMETRIES))
    layers: int | None = setting(None, "from scratch: blocks", low=1, flag="--blocks")
    hidden: int | None = setting(None, "from scratch: width", low=1)
    heads: int | None = setting(None, "from scratch: attention heads", low=1, default_text="hidden / 64")
    intermediate: int | None = setting(None, "from scratch: FFN width", low=1, default_text="4 x hidden")
    vocab: str | None = setting(None, "from scratch: a folder with vocab.txt (and tokenizer_config.json)", path="model")
    untied: bool = setting(False, "from scratch: a masked-LM decoder of its own instead of the word embeddings (not "
                           "BERT: an ablation, see the pre-training results page)")
    norm: str = setting("post", "from scratch: where each block's LayerNorm sits -- post (BERT's), pre (pre-LN with a "
                        "final LayerNorm) or deepnorm (post-LN with DeepNorm's residual scale and init); not BERT "
                        "but post: an ablation only minibert reads back (models/norms.py)",
                        choices=("post", "pre", "deepnorm"))
    max_length: int = setting(128, "tokens an example, [CLS] and [SEP] included: 3 (5 with --nsp) to the model's "
                              "positions", low=3)
    mask: float = setting(0.15, "share of tokens masked", low=0.0, strict=True, below=1.0)
    whole_word: bool = setting(False, "mask whole words (a piece and its ## pieces)")
    nsp: bool = setting(False, "BERT's two-segment examples and the next-sentence head")
    mix: str | None = setting(None, "FILE:share -- replay general text for that share of the examples", path="read")
    eval_texts: str | None = setting(None, "held-out text: masked-LM loss, perplexity, accuracy every --eval-every",
                                     path="read")
    resume: bool = setting(False, "continue the unfinished run in --out from its newest checkpoint (same settings; "
                           "it ends bit for bit as the uninterrupted run would have); a finished run has nothing to "
                           "resume, and a longer run is a new one: --model OUT --out NEW")
    overwrite: bool = _overwrite()
    device: str | None = _device()
    dropout: float | None = setting(None, "every dropout at this probability while training, in [0, 1)", low=0.0,
                                    below=1.0, default_text="the model's, 0.1 from scratch; 0 turns it off")
    teacher: str | object | None = setting(None, "a masked-LM folder to distil from while pre-training (DistilBERT: "
                                           "its soft predictions at the masked tokens, weight --alpha, temperature "
                                           "--temperature); in Python a BertForMaskedLM too", path="model")
    temperature: float | None = setting(None, "with --teacher", low=0.0, strict=True, default_text="2")
    alpha: float | None = setting(None, "with --teacher: the soft term's weight in [0, 1], 1 - alpha the masked-LM "
                                  "loss's", low=0.0, high=1.0, default_text="0.5")
    store: str | None = setting(None, "the corpus' token store folder (runs on one corpus and vocabulary can share "
                                "one)", cli=False, default_text="OUT/store")

    @property
    def scratch(self) -> bool:
        return self.model is None

    def check(self) -> None:
        """The settings, and what goes together (a start from scratch or a checkpoint; a teacher's options)."""
        super().check()
        if self.eval_every is not None and self.eval_texts is None:
            raise InputError("--eval-every needs --eval-texts (held-out text to evaluate on)")
        if self.eval_texts is not None and self.eval_every is None:
            raise InputError("--eval-texts needs --eval-every N (how many steps between evaluations); without it the "
                             "held-out text would never be evaluated")
        default_plateau = next(f.default for f in fields(PretrainConfig) if f.name == "plateau_step")
        if self.plateau_step != default_plateau and self.eval_texts is None:
            raise InputError("--plateau-step reads the held-out masked accuracy: it needs --eval-texts and "
                             "--eval-every")
        if self.teacher is None:
            if self.temperature is not None or self.alpha is not None:
                raise InputError("--temperature and --alpha go with --teacher (distillation while pre-training)")
        elif self.nsp:
            raise InputError("a teacher distils the masked-LM predictions only: leave out --nsp")
        if self.untied and not self.scratch:
            raise InputError("--untied makes a new decoder from scratch: a continued model keeps its checkpoint's "
                             "head (config.json's tie_word_embeddings)")
        if self.norm != "post" and not self.scratch:
            raise InputError(f"--norm {self.norm} builds a new model from scratch: a continued model keeps its "
                             "checkpoint's norm placement (config.json's norm_placement)")
        if self.scratch and self.vocab is None:
            raise InputError("from scratch, give --vocab FOLDER (a vocab.txt and tokenizer_config.json, e.g. "
                             "weights/all-MiniLM-L6-v2): the ids the model learns")
        if not self.scratch and any(v is not None for v in (self.geometry, self.layers, self.hidden, self.heads,
                                                            self.intermediate, self.vocab)):
            raise InputError("--model continues a checkpoint (its geometry and vocabulary): leave out --geometry, "
                             "--blocks, --hidden, --heads, --intermediate and --vocab")


# ------------------------------------------------------------------------------------- the depth study
BUDGETS = ("steps", "compute")


@dataclass(kw_only=True, frozen=True)
class DepthStudyConfig:
    """What ``depth_study.run_study`` pre-trains and measures: the depths, one width, the budgets (equal
    steps, equal compute), the seeds, the pre-training run and the measures' own settings."""

    depths: tuple[int, ...] = setting((1, 2, 4, 6, 8), "block counts, e.g. 1,2,4,6,8", low=1)
    hidden: int = setting(256, "the width of every model", low=1)
    heads: int = setting(4, "attention heads", low=1)
    intermediate: int = setting(1024, "the feed-forward width", low=1)
    steps: int = setting(2000, "the equal-steps budget", low=1)
    reference_depth: int = setting(4, "equal compute: the FLOPs this depth spends in --steps steps", low=1)
    budgets: tuple[str, ...] = setting(BUDGETS, "steps, compute or steps,compute")
    seeds: tuple[int, ...] = setting((0, 1), "the first everywhere, the others for the equal-steps budget; "
                                     "integers >= 0", low=0)
    batch_size: int = setting(32, "examples a step", low=1)
    max_length: int = setting(128, "tokens an example, [CLS] and [SEP] included", low=3)
    lr: float = setting(1e-3, "peak learning rate", **LR_BOUNDS)
    warmups: tuple[float, ...] = setting((0.06,), "shares of the steps spent warming up, e.g. 0,0.01,0.06,0.2 (each a "
                                         "run of every depth and seed)", low=0.0, high=1.0)
    norms: tuple[str, ...] = setting(("post",), "norm placements, e.g. post,pre,deepnorm (each a run of every depth "
                                     "and seed; models/norms.py)")
    dropout: float = setting(0.0, "dropout while pre-training (short runs learn faster without it: Geiping & "
                             "Goldstein 2022, \"Cramming\")", low=0.0, below=1.0, cli=False)
    bf16: bool = setting(False, "bf16 autocast while pre-training")
    eval_examples: int = setting(256, "held-out examples each model's masked-LM loss is measured on", low=1,
                                 cli=False)
    snapshots: int = setting(0, "every run keeps this many log-spaced snapshots (minibert probe-over-time)", low=0)
    probe_sentences: int | None = setting(None, "the first N CoNLL-U sentences are probed (None: all)", low=1,
                                          cli=False)
    task_epochs: int = setting(2, "fine-tuning epochs of the downstream task", low=1, cli=False)
    task_lr: float = setting(1e-4, "the downstream task's learning rate", **LR_BOUNDS, cli=False)

    def check(self) -> None:
        """Every field (``settings.check``), and what goes together."""
        check(self)
        if not self.depths:
            raise InputError(f"depths={self.depths!r}: give one or more block counts >= 1")
        if len(set(self.depths)) != len(self.depths):
            raise InputError(f"depths={self.depths!r} names a depth twice")
        if self.hidden % self.heads:
            raise InputError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if not self.budgets or any(b not in BUDGETS for b in self.budgets):
            raise InputError(f"budgets={self.budgets!r}: use one or both of {BUDGETS}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise InputError(f"seeds={self.seeds!r}: give one or more different seeds")
        for seed in self.seeds:
            check_seed("--seeds", seed)
        from ..config import NORM_PLACEMENTS

        if not self.norms or any(n not in NORM_PLACEMENTS for n in self.norms) or len(set(self.norms)) < len(self.norms):
            raise InputError(f"--norms {','.join(map(str, self.norms))}: give one or more different placements of "
                             f"{', '.join(NORM_PLACEMENTS)}")
        if not self.warmups or len(set(self.warmups)) < len(self.warmups):
            raise InputError(f"warmups={self.warmups!r}: give one or more different warmup shares")


#: --quick: minutes, not hours (a tutorial, a smoke test): small widths, few steps
QUICK_STUDY = dict(depths=(1, 2, 4), hidden=64, heads=2, intermediate=256, steps=60, reference_depth=2, batch_size=16,
             max_length=64, lr=2e-3, eval_examples=64, probe_sentences=60, task_epochs=1)


@dataclass(kw_only=True, frozen=True)
class DepthStudyRun(DepthStudyConfig):
    """``minibert depth-study``: pre-train encoders of several depths on one corpus (equal steps and equal
    compute, seeds for the spread), then measure and plot what depth buys."""

    corpus: tuple[str, ...] = setting(help="text files, .jsonl files or folders of them", required=True, nargs="+",
                                      path="read")
    vocab: str = setting(help="a folder with vocab.txt (and tokenizer_config.json)", required=True, path="model")
    eval_texts: str = setting(help="held-out text: every model's masked-LM loss on it", required=True, path="read")
    out: str = setting(help="folder for runs/, study.json and the figures", required=True, path="run")
    conllu: str | None = setting(None, "a .conllu file: a linear probe per layer of every model (UPOS)", path="read")
    task_train: str | None = setting(None, "a classification task's training CSV (text,label), e.g. TREC-6",
                                     path="read")
    task_eval: str | None = setting(None, "its evaluation CSV", path="read")
    quick: bool = setting(False, "minutes instead of hours: 1, 2, 4 blocks of width 64 (2 heads, FFN 256), 60 "
                          "steps of 16 x 64 at lr 2e-3, reference depth 2 (the options given change it)")
    device: str | None = setting(None, "where the models pre-train and fine-tune: cpu (default), cuda or cuda:N")
    overwrite: bool = setting(False, "replace what --out holds (a study with other settings, a model, another "
                              "run); without it a folder holding this study goes on where it stopped, and "
                              "anything else is refused")
    cut_vs_grown: bool = setting(False, "then, for each smaller depth k: the deepest model cut to k blocks, the "
                                 "k-block model grown from scratch, and one distilled from the deepest (same "
                                 "tokens), measured alike")
    progress: bool = setting(True, "no progress bar or log lines", flag="--quiet", negate=True)

    def with_preset(self, given=()) -> "DepthStudyRun":
        """With ``quick``: the quick study's values for every setting not in ``given`` (the options the command
        line was given; in Python, give the fields you set)."""
        if not self.quick:
            return self
        return replace(self, **{k: v for k, v in QUICK_STUDY.items() if k not in given})

    def config(self) -> DepthStudyConfig:
        return base_of(self, DepthStudyConfig)
