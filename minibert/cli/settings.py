"""The settings of the commands that do not train -- encode, embed, search, layers, probe, probe-over-time,
map, fill, parity, inspect, predict -- declared once, as the run commands' are (``runs/settings.py``): one
dataclass per command whose fields carry type, default, bounds, help and the option's name. The parser,
the checks (``settings.check``: messages in option names), the reference page and the path rule come from
them. Every path field says what it is (``path=``: "model" read, "read" a data file, "file" written), so
``outputs.check_paths`` keeps every written path off every read one and off files minibert did not write.

Option names mean one thing in every command. Spellings that meant something else here are refused with
a pointer to the new one (``RENAMED``), never kept as aliases. Standard library only: ``--help`` is instant.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import SEED_LIMIT
from ..names import QUANTISED_DTYPES, SHORT_DTYPES
from ..runs.settings import DEFAULT_MODEL, MODEL_HELP
from ..settings import setting
from ..textfiles import PLOT_SUFFIXES

PLOT_FORMATS = ".png (150 dpi), .svg or .pdf; no suffix: .png"
DEVICE_HELP = "where the model runs: cpu (default), cuda or cuda:N"
DTYPE_HELP = ("the weights' dtype: fp32, bf16, fp16 (a GPU's, or a CPU with AVX-512-BF16 / AMX), int8 (quantised on "
              "load; CPU only); default: as the checkpoint stores them")
DTYPES = (*SHORT_DTYPES, *QUANTISED_DTYPES)
MAX_LENGTH_HELP = ("truncate texts to this many tokens, [CLS] and [SEP] included (default: the model's limit, 512); "
                   "how many texts were truncated is said on stderr")
OVERWRITE_HELP = ("replace an existing output file that minibert did not write (a file it wrote is replaced without "
                  "it); never a file the command reads")
WORD_POOLS = ("first", "mean")
#: compat/runtimes.RUNTIMES and compat/export's formats (cli/ imports no library module at the top: --help is instant)
RUNTIMES = ("auto", "onnxruntime", "openvino", "ctranslate2")
EXPORT_FORMATS = ("onnx", "ct2")


# the fields several commands share, each declared here once (a dataclass field is made per class)
def _model(more: str = ""):
    return setting(DEFAULT_MODEL, MODEL_HELP.removesuffix(f" (default {DEFAULT_MODEL})") + more, path="model")


def _max_length():
    return setting(None, MAX_LENGTH_HELP, low=3, default_text="")


def _device():
    return setting(None, DEVICE_HELP)


def _dtype():
    return setting(None, DTYPE_HELP, choices=DTYPES)


def _plot(what: str):
    return setting(None, f"write {what} to this file ({PLOT_FORMATS})", path="file", suffix=".png",
                   formats=PLOT_SUFFIXES)


def _json_file(what: str):
    return setting(None, f"also write {what} to this JSON file", path="file", suffix=".json")


def _overwrite():
    return setting(False, OVERWRITE_HELP)


def _quiet():
    return setting(False, "no progress bar")


def _seed():
    return setting(0, "random seed, an integer >= 0", low=0, high=SEED_LIMIT)


def _batch_size(help: str = "texts per batch (default 32)", default: int | None = None):
    return setting(default, help, low=1, default_text="" if default is None else None)


def _conllu_column():
    return setting("upos", "the CoNLL-U label column (upos, xpos, deprel, ...)")


def _word_pool():
    return setting("first", "how a word's sub-word pieces make its vector", choices=WORD_POOLS)


def _print_format():
    return setting("text", "what is printed: text (a table) or json (every number)", choices=("text", "json"),
                   flag="--format")


@dataclass(kw_only=True)
class EncodeCommand:
    """``minibert encode``: tokenise texts and print their vectors."""

    texts: tuple[str, ...] = setting(help="one or more texts", required=True, positional=True, nargs="+")
    model: str = _model("; offline: weights/all-MiniLM-L6-v2")
    max_length: int | None = _max_length()
    device: str | None = _device()
    dtype: str | None = _dtype()
    layer: int = setting(-1, "which hidden state: 0 = embeddings, -1 = the last")
    pool: str = setting("mean", "how the token vectors make the text's vector", choices=("cls", "mean", "max"))
    format: str = _print_format()


@dataclass(kw_only=True)
class EmbedCommand:
    """``minibert embed``: a file of texts to a .npy matrix (or, on Ray, shards to Parquet)."""

    texts: tuple[str, ...] = setting(help="a UTF-8 text file, one text per line, lines end at \\n only (row i of the "
                                     "output = line i); with --engine ray: shards (.txt, .jsonl, .parquet), "
                                     "directories or globs", required=True, positional=True, nargs="+", path="read")
    out: str = setting(help="output .npy file (.npy is added when missing; the directory must exist); --engine ray: a "
                       "folder", required=True, path="file", suffix=".npy")
    model: str = _model()
    max_length: int | None = _max_length()
    quiet: bool = _quiet()
    batch_size: int | None = _batch_size("texts per batch (default 32 without --max-tokens on a CPU; a budget of "
                                         "16384 tokens on a GPU)")
    device: str | None = _device()
    dtype: str | None = _dtype()
    engine: str = setting("local", "local: this process, a .npy matrix; ray: Ray Data actors, Parquet (id, vector) "
                          "files in --out (a folder); see minibert.compat.ray", choices=("local", "ray"))
    workers: int | None = setting(None, "--engine ray: actors (model copies)", low=1, default_text="2")
    threads: int | None = setting(None, "--engine ray: torch threads per actor", low=1, default_text="1")
    gpus_per_worker: float | None = setting(None, "--engine ray: GPUs per actor (e.g. 1, or 0.5 for two actors a "
                                            "GPU); each actor runs on the GPU Ray gives it", low=0, strict=True,
                                            default_text="none, CPU actors")
    address: str | None = setting(None, "--engine ray: a running cluster (auto, ray://host:10001)",
                                  default_text="local Ray")
    layers: str | None = setting(None, "pool these hidden states instead of following a sentence-transformers "
                                 "folder: -1, -4:, 0,6,-1 or all", default_text="-1")
    pool: str | None = setting(None, "how the token vectors make the text's vector", choices=("cls", "mean", "max"),
                               default_text="mean")
    combine: str | None = setting(None, "how to join several layers", choices=("concat", "mean"),
                                  default_text="concat: k x hidden dims")
    ignore_folder_settings: bool = setting(False, "a sentence-transformers folder (modules.json) is followed by "
                                           "default (its truncation, pooling, normalisation); this pools hidden "
                                           "states with the options above instead")
    max_tokens: int | None = setting(None, "token budget per batch (rows x longest row, e.g. 8192) instead of a fixed "
                                     "count; with --batch-size given too, both limits hold", low=1)
    blank: str = setting("error", "a blank line is an error, or gets a row of zeros", choices=("error", "zeros"))
    overwrite: bool = setting(False, OVERWRITE_HELP + "; --engine ray: replace what the --out folder holds, if "
                              "minibert wrote all of it")

    def path_kind(self, name: str) -> str | None:
        """The Ray engine writes a folder of shards, the local one a file."""
        return "run" if name == "out" and self.engine == "ray" else None


@dataclass(kw_only=True)
class SearchCommand:
    """``minibert search``: the lines of a corpus most similar to each query."""

    corpus: str = setting(help="a UTF-8 text file, one text per line (blank lines are never hits)", required=True,
                          positional=True, path="read")
    queries: tuple[str, ...] = setting(help="one or more query texts", required=True, positional=True, nargs="+")
    model: str = _model(" (a sentence-transformers folder's settings are followed)")
    max_length: int | None = _max_length()
    batch_size: int | None = _batch_size()
    quiet: bool = _quiet()
    device: str | None = _device()
    dtype: str | None = _dtype()
    top_k: int = setting(5, "hits per query", low=1)
    index: str | None = setting(None, "a .npy file for the corpus vectors, with a .json beside it recording what they "
                                "were made from (the corpus' sha256, the model's weights, dtype, pooling, max length, "
                                "normalisation): written on the first run, reused while all of these match, rebuilt "
                                "(and said so) when one differs", path="file", suffix=".npy", companions=(".json",))
    format: str = _print_format()
    overwrite: bool = _overwrite()


@dataclass(kw_only=True)
class LayersCommand:
    """``minibert layers``: per-layer statistics and a CKA heatmap of one text."""

    text: str = setting(help="the text", required=True, positional=True)
    model: str = _model()
    plot: str | None = _plot("the layer-similarity heatmap")
    max_length: int | None = _max_length()
    device: str | None = _device()
    dtype: str | None = _dtype()
    exclude_special: bool = setting(False, "leave [CLS] and [SEP] out of the statistics")
    overwrite: bool = _overwrite()


@dataclass(kw_only=True)
class ProbeCommand:
    """``minibert probe``: a linear probe per layer on word labels from a CoNLL-U file."""

    data: str = setting(help="a .conllu file", required=True, positional=True, path="read")
    model: str = _model()
    plot: str | None = _plot("the accuracy-per-layer curve")
    seed: int = _seed()
    quiet: bool = _quiet()
    batch_size: int = _batch_size("sentences per batch", default=16)
    device: str | None = _device()
    dtype: str | None = _dtype()
    column: str = _conllu_column()
    word_pool: str = _word_pool()
    overwrite: bool = _overwrite()


@dataclass(kw_only=True)
class ProbeOverTimeCommand:
    """``minibert probe-over-time``: probe every layer of every snapshot of a pre-training run."""

    run: str = setting(help="a pre-training run's folder (with snapshots/)", required=True, positional=True,
                       path="model")
    data: str = setting(help="a .conllu file", required=True, positional=True, path="read")
    plot: str | None = _plot("the layer x step heatmaps")
    seed: int = _seed()
    quiet: bool = _quiet()
    batch_size: int = _batch_size("sentences per batch", default=16)
    device: str | None = _device()
    column: str = _conllu_column()
    word_pool: str = _word_pool()
    json: str | None = _json_file("the grids (accuracy, control, selectivity, CKA)")
    overwrite: bool = _overwrite()


@dataclass(kw_only=True)
class MapCommand:
    """``minibert map``: 2-D maps of word, sentence or word-occurrence vectors, one panel per layer."""

    data: str = setting(help=".conllu (words by --column), .csv/.tsv/.jsonl (sentences by --label-column, or "
                        "occurrences of --word), .txt with --word", required=True, positional=True, path="read")
    out: str = setting(help="the figure (" + PLOT_FORMATS + ")", required=True, path="file", suffix=".png",
                       formats=PLOT_SUFFIXES)
    model: str = _model()
    seed: int = _seed()
    quiet: bool = _quiet()
    device: str | None = _device()
    dtype: str | None = _dtype()
    layers: str = setting("all", "hidden states to show: all, 0,3,6, -3:")
    method: str = setting("pca", "pca, tsne (scikit-learn) or umap (umap-learn)", choices=("pca", "tsne", "umap"))
    column: str = _conllu_column()
    text_column: str = setting("text", ".csv/.tsv/.jsonl: the column holding the text")
    label_column: str = setting("label", ".csv/.tsv/.jsonl: the column holding the label")
    word: str | None = setting(None, "points are the occurrences of this word (or words, comma-separated)")
    pool: str = setting("mean", "how the token vectors make a sentence's vector", choices=("cls", "mean", "max"))
    max_points: int = setting(3000, "a seeded sample when there are more", low=3)
    json: str | None = _json_file("the coordinates and scores")
    overwrite: bool = _overwrite()


@dataclass(kw_only=True)
class FillCommand:
    """``minibert fill``: [MASK] predictions of the masked-LM head (and the logit lens)."""

    texts: tuple[str, ...] = setting(help="texts with [MASK] in them", required=True, positional=True, nargs="+")
    model: str = _model()
    plot: str | None = _plot("the logit-lens plot (implies --lens)")
    max_length: int | None = _max_length()
    device: str | None = _device()
    dtype: str | None = _dtype()
    top_k: int = setting(5, "predictions per mask", low=1)
    lens: bool = setting(False, "also print the per-layer logit lens for the first mask")
    overwrite: bool = _overwrite()


@dataclass(kw_only=True)
class ParityCommand:
    """``minibert parity``: per-layer differences, minibert against transformers, another checkpoint, or a deployed
    model run by its runtime (ONNX Runtime, OpenVINO, CTranslate2)."""

    model: str = _model()
    against: str | None = setting(None, "a second checkpoint (run by minibert) instead of transformers; or a deployed "
                                  "model: an .onnx graph (or a folder with model.onnx), an OpenVINO .xml, a CTranslate2 "
                                  "folder -- run by its runtime, layer by layer where it has the hidden states",
                                  path="model")
    runtime: str = setting("auto", "which runtime runs --against: auto (by its files), onnxruntime, openvino (reads "
                           ".onnx too), ctranslate2", choices=RUNTIMES)
    dtype: str | None = setting(None, "int8: the model quantised on load (dtype='int8') against its own fp32 weights, "
                                "layer by layer, and the cosine of their sentence vectors (needs >= 0.99); against a "
                                "runtime, how it is judged (fp32, or int8 by the sentence-vector cosine) and "
                                "CTranslate2's compute type", choices=DTYPES,
                                default_text="fp32; a quantised ONNX graph: int8")
    texts: str | None = setting(None, "a text file, one input per line", path="read",
                                default_text="a built-in varied set")
    json: str | None = _json_file("the numbers")
    atol: float | None = setting(None, "tolerance", low=0.0, default_text="1e-5 fp32, 5e-3 fp16, 5e-2 bf16; a runtime "
                                 "in fp32 1e-4")
    min_cosine: float | None = setting(None, "the lowest sentence-vector cosine that passes", low=-1.0, high=1.0,
                                       default_text="0.99 for int8, none for fp32")
    device: str | None = _device()
    overwrite: bool = _overwrite()


@dataclass(kw_only=True)
class ExportCommand:
    """``minibert export``: a model as an ONNX graph or a CTranslate2 folder, checked against the model at once."""

    format: str = setting(help="onnx (ONNX Runtime, OpenVINO, optimum) or ct2 (CTranslate2)", required=True,
                          positional=True, choices=EXPORT_FORMATS)
    model: str = _model("; a fine-tuned task checkpoint or a sentence-transformers folder exports with its head "
                        "or pooling")
    out: str = setting(help="the folder to write (the graph or the converted model, the tokenizer files, export.json)",
                       required=True, path="run")
    hidden_states: bool = setting(False, "onnx: every hidden state as an output too (hidden_state_0 ... _L), for a "
                                  "per-layer minibert parity --against")
    optimize: bool = setting(False, "onnx: also ONNX Runtime's transformer optimiser's graph (model_optimized.onnx), "
                             "checked")
    int8: bool = setting(False, "also an int8 form: onnx ORT's dynamic quantisation (model_int8.onnx), checked by "
                         "sentence-vector cosine; ct2 int8 weights")
    opset: int = setting(17, "onnx: the ONNX operator set", low=14)
    overwrite: bool = setting(False, "replace what --out holds (a run of minibert's; never a model it reads)")


@dataclass(kw_only=True)
class InspectCommand:
    """``minibert inspect``: parameters per component, FLOPs per token, activation memory."""

    model: str = _model("; official names (bert-base-uncased, ...) use built-in geometry")
    batch_size: int = setting(8, "batch size for the memory estimate", low=1)
    lengths: tuple[int, ...] = setting((128, 512), "sequence lengths, comma-separated", low=1)


@dataclass(kw_only=True)
class PredictCommand:
    """``minibert predict``: labels (or tags) for the lines of a text file, with a fine-tuned model."""

    checkpoint: tuple[str, ...] = setting(help="a directory written by `minibert finetune`; or one or more task "
                                          "modules (--recipe adapter, prefix, lora), run on one shared base",
                                          required=True, positional=True, nargs="+", path="model")
    texts: str = setting(help="a UTF-8 text file, one text per line; output line i is input line i (a blank line "
                         "gives an empty one)", required=True, positional=True, path="read")
    max_length: int | None = _max_length()
    batch_size: int | None = _batch_size()
    device: str | None = _device()
    dtype: str | None = _dtype()
    model: str | None = setting(None, "task modules: the base they were trained on", path="model",
                                default_text="the one the first records")
    skip_base_check: bool = setting(False, "task modules: load them on --model even when its weights' fingerprint "
                                    "differs from the base they were trained on (the same model saved otherwise); "
                                    "its config must still match")


#: spellings that meant something else, or that another command spells otherwise: refused with the new one
RENAMED = {
    "encode": {"--json": "--format json (--json names a file to write in every command)"},
    "search": {"--json": "--format json (--json names a file to write in every command)", "-k": "--top-k"},
    "probe": {"--pool": "--word-pool (--pool is how token vectors make a sentence's vector)"},
    "probe-over-time": {"--pool": "--word-pool (--pool is how token vectors make a sentence's vector)"},
    "inspect": {"--batch": "--batch-size"},
    "pretrain": {"--layers": "--blocks (--layers picks hidden states in embed and map)"},
}
