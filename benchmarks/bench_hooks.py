"""What an unhooked HookPoint costs, now that it honours torch's module hooks.

Times, side by side in one process (``minibert.tools.timing.alternate``, medians over rounds):

* one call of an empty ``HookPoint`` against the previous one (``if not self.fns: return x``, kept here as
  ``PreviousHookPoint`` for the comparison), in a loop of 100,000 calls;
* the readable forward pass of all-MiniLM-L6-v2 (96 points) on 8 sentences, with plain points and with the
  previous ones swapped in.

    python benchmarks/bench_hooks.py [--rounds 15]

Writes benchmarks/results/hooks.json and .md (machine: CPU model, flags, threads, torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "weights"))

from minibert import BertModel, BertTokenizer  # noqa: E402
from minibert.hardware import cpu_info  # noqa: E402
from minibert.hookpoints import HookPoint  # noqa: E402

from minibert.tools import timing as harness  # noqa: E402


class PreviousHookPoint(nn.Module):
    """The empty path of HookPoint before torch hooks were honoured: one truth test."""

    def __init__(self):
        super().__init__()
        self.fns = []

    @property
    def active(self):  # what the attention asked before: `hook_probs.fns`
        return bool(self.fns)

    def __call__(self, x):
        if not self.fns:
            return x
        raise NotImplementedError  # (only the empty path is timed)


def swap_points(model, cls):
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (HookPoint, PreviousHookPoint)):
                setattr(module, name, cls())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    x = torch.zeros(1)
    now, before = HookPoint(), PreviousHookPoint()
    calls = 100_000

    def loop(point):
        def run():
            for _ in range(calls):
                point(x)
        return run
    single = harness.medians(harness.alternate({"HookPoint": loop(now), "previous": loop(before)}, args.rounds))

    from fetch_minilm import fetch

    directory = fetch()
    model, tok = BertModel.from_pretrained(directory), BertTokenizer.from_pretrained(directory)
    old = BertModel.from_pretrained(directory)
    swap_points(old, PreviousHookPoint)
    batch = dict(tok(["The bank approved the loan application.", "The river bank was muddy."] * 4, padding=True,
                     return_tensors="pt"))
    with torch.inference_mode():
        times = harness.alternate({"HookPoint": lambda: model(**batch), "previous": lambda: old(**batch)},
                                  args.rounds, warmup=2, rotate=True)
    forward = harness.medians(times)
    name, flags = cpu_info()
    report = {"machine": {"cpu": name, "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx"))),
                          "threads": torch.get_num_threads(), "torch": torch.__version__},
              "ns_per_empty_call": {k: v / calls * 1e9 for k, v in single.items()},
              "forward_ms": {k: v * 1e3 for k, v in forward.items()},
              "forward_ratio": harness.paired_ratio(times, "HookPoint", "previous")}
    out = ROOT / "benchmarks" / "results" / "hooks"
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    m = report["machine"]
    lines = ["# An unhooked HookPoint", "",
             f"{m['cpu']} ({', '.join(m['cpu_flags']) or 'no AVX flags'}), {m['threads']} threads, torch {m['torch']}; "
             f"medians of {args.rounds} alternating rounds. Other CPUs give other numbers.", "",
             "| | HookPoint (honours torch hooks) | previous (fns only) |", "|---|---:|---:|",
             f"| one empty call, ns | {report['ns_per_empty_call']['HookPoint']:.0f} | "
             f"{report['ns_per_empty_call']['previous']:.0f} |",
             f"| MiniLM readable forward, 8 x {batch['input_ids'].shape[1]} tokens, ms | "
             f"{report['forward_ms']['HookPoint']:.2f} | {report['forward_ms']['previous']:.2f} |", "",
             f"Forward ratio (paired, median): {report['forward_ratio']:.3f}."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
