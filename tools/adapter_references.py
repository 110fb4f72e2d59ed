"""Reference outputs of the `adapters` library (AdapterHub) for minibert's adapter and prefix-tuning tests.

`adapters` 1.3.0 pins transformers ~= 4.57.6, which the rest of the test extra does not use, so this script
builds its own environment and runs itself there:

    python tools/adapter_references.py            # builds .cache/adapter-references-env once, then writes
                                                  # tests/data/adapters/ (a tiny random BERT, and for each
                                                  # method its weights, inputs and hidden states)

What it writes (a few hundred KB): ``base/`` (a 3-layer, 32-wide random BertModel saved by transformers),
and for each of ``houlsby`` (DoubleSeqBnConfig), ``pfeiffer`` (SeqBnConfig) and ``prefix``
(PrefixTuningConfig, and the same prefix ejected to its flat form) a ``<method>.safetensors`` with the
library's own tensor names for the method's weights (random, larger than their init so that they matter),
the padded batch, and every hidden state the adapted model returns in eval mode (fp32); ``<method>.json``
with the configuration; ``PROVENANCE.json`` with the versions and this command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "adapters"
ENV = ROOT / ".cache" / "adapter-references-env"
PINS = ["torch==2.13.0", "adapters==1.3.0", "transformers==4.57.6", "safetensors"]


def build_environment() -> Path:
    python = ENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(ENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", PINS[0]], check=True)  # the CPU build first
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS[1:]], check=True)
    return python


def inside():
    """Runs in the pinned environment."""
    import adapters
    import safetensors
    import torch
    import transformers
    from adapters import DoubleSeqBnConfig, PrefixTuningConfig, SeqBnConfig
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, type_vocab_size=2)
    base = BertModel(config).eval()
    OUT.mkdir(parents=True, exist_ok=True)
    base.save_pretrained(OUT / "base", safe_serialization=True)

    # a padded batch of pairs: lengths 9, 4, 7
    lengths = [9, 4, 7]
    T = max(lengths)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 120, (3, T), generator=g)
    attention_mask = torch.zeros(3, T, dtype=torch.long)
    token_type_ids = torch.zeros(3, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        attention_mask[i, :n] = 1
        input_ids[i, n:] = 0
        token_type_ids[i, n // 2:n] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}

    methods = {
        "houlsby": DoubleSeqBnConfig(reduction_factor=4),  # bottleneck 8, swish
        "pfeiffer": SeqBnConfig(reduction_factor=4),  # bottleneck 8, relu
        "prefix": PrefixTuningConfig(prefix_length=5, bottleneck_size=24),  # tanh MLP
    }
    for name, adapter_config in methods.items():
        model = BertModel.from_pretrained(OUT / "base").eval()
        adapters.init(model)
        model.add_adapter(name, config=adapter_config)
        model.set_active_adapters(name)
        weights = {k: v for k, v in model.state_dict().items() if f".{name}." in k or k.endswith(f".{name}")}
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():  # weights that matter: random, larger than the near-zero init
            for key, value in model.named_parameters():
                if key in weights:
                    value.copy_(torch.randn(value.shape, generator=g) * 0.3)
        model.eval()
        with torch.no_grad():
            out = model(**batch, output_hidden_states=True)
        tensors = {f"weights.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items() if k in weights}
        tensors |= {f"batch.{k}": v for k, v in batch.items()}
        tensors |= {f"hidden_states.{i}": h.contiguous() for i, h in enumerate(out.hidden_states)}
        if name == "prefix":  # the same prefix after training: the MLP folded away (flat keys and values)
            model.eject_prefix_tuning(name)
            model.eval()
            flat = {k: v for k, v in model.state_dict().items() if "prefix_tunings" in k}
            tensors |= {f"ejected.{k}": v.detach().clone().contiguous() for k, v in flat.items()}
            with torch.no_grad():
                again = model(**batch, output_hidden_states=True)
            tensors |= {f"ejected_hidden_states.{i}": h.contiguous() for i, h in enumerate(again.hidden_states)}
        save_file(tensors, str(OUT / f"{name}.safetensors"))
        (OUT / f"{name}.json").write_text(json.dumps({"config_class": type(adapter_config).__name__,
                                                      "config": adapter_config.to_dict()}, indent=2, default=str) + "\n")
    (OUT / "PROVENANCE.json").write_text(json.dumps({
        "command": "python tools/adapter_references.py",
        "versions": {"adapters": adapters.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "safetensors": safetensors.__version__},
        "what": "a random 3-layer, 32-wide BertModel (seed 0); each method's weights set to N(0, 0.3^2) (seed 2); "
                "hidden states in eval mode, fp32, for a padded batch of three pairs (lengths 9, 4, 7)",
    }, indent=2) + "\n")
    print(f"wrote {OUT}")


def main():
    if "--inside" in sys.argv:
        inside()
        return
    python = Path(os.environ["ADAPTER_REFERENCES_PYTHON"]) if os.environ.get("ADAPTER_REFERENCES_PYTHON") \
        else build_environment()
    subprocess.run([str(python), __file__, "--inside"], check=True)


if __name__ == "__main__":
    main()
