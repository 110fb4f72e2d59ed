"""The compiled forward of one short input (minibert.tools.compiled, ``fast.prepare(model, compile=True)``).

Compiling for real takes about 20 s even for a tiny model, so one test compiles (a 2-block model, freezing
without max-autotune's kernel tuning: the same export and AOTInductor package, fewer candidate kernels), and
the others run a stand-in compiler: ``build`` writes the weights it was given to the artefact file and
``load`` answers with the readable model of the weights in that file -- so an artefact served to other
weights shows as other numbers -- and the timing against the fast path is given, not measured."""

from __future__ import annotations

import copy
import hashlib
import json
import warnings

import pytest
import torch

from conftest import hf_config, random_hf_model
from minibert import BertConfig, BertModel
from minibert.errors import InputError
from minibert.quantize import quantize_linears
from minibert.testing import fp32_noise_floor
from minibert.testing import largest_difference as compare
from minibert.tools import compiled, fast

TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=80)


def tiny(seed=0, **overrides) -> BertModel:
    torch.manual_seed(seed)
    return BertModel(BertConfig(**{**TINY, **overrides})).eval()


def ids_of(rows, batch=1, seed=0):
    return torch.randint(5, 100, (batch, rows), generator=torch.Generator().manual_seed(seed))


class StandIn:
    """A compiler that freezes the weights it is given into the artefact file, and a loader that runs the
    readable model of the weights in the file it reads (counting builds, loads and calls)."""

    def __init__(self, monkeypatch, ratios=None):
        self.frozen: dict[str, BertModel] = {}  # the artefact's sha256 -> the model it froze
        self.builds = self.calls = 0
        self.ratios = ratios or {8: 0.6, 16: 0.7, 32: 0.9, 48: 1.1, 64: 1.2}
        monkeypatch.setattr(compiled, "build", self.build)
        monkeypatch.setattr(compiled, "load", self.load)
        monkeypatch.setattr(compiled, "time_against_fast", lambda model, runner, forward: dict(self.ratios))

    def build(self, model, path):
        self.builds += 1
        frozen = copy.deepcopy(model)
        payload = json.dumps({k: v.tolist() for k, v in model.state_dict().items()}).encode()
        path.write_bytes(payload)
        self.frozen[hashlib.sha256(payload).hexdigest()] = frozen

    def load(self, path):
        frozen = self.frozen[hashlib.sha256(path.read_bytes()).hexdigest()]

        def run(input_ids, token_type_ids, position_ids):
            self.calls += 1
            return list(BertModel.forward(frozen, input_ids, None, token_type_ids, position_ids).hidden_states)
        return run


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIBERT_CACHE", str(tmp_path))
    monkeypatch.setattr(compiled, "_SAID", set())  # each test hears its own "once"
    return tmp_path


def same_as_readable(model, run, input_ids, **kw) -> bool:
    with torch.inference_mode():
        slow, quick = model(input_ids, **kw), run(input_ids, **kw)
    batch = {"input_ids": input_ids, "attention_mask": kw.get("attention_mask", torch.ones_like(input_ids))}
    return compare(slow, quick, batch["attention_mask"]) <= fast.NOISE_FACTOR["onednn"] * fp32_noise_floor(model, batch)


def test_built_once_kept_and_served_only_to_one_short_input(cache, monkeypatch):
    stand_in = StandIn(monkeypatch)
    model = tiny()
    run = fast.prepare(model, compile=True)
    assert stand_in.builds == 1 and run.compiled is not None and run.compiled.up_to == 32  # slower from 48 on
    files = list((cache / compiled.FOLDER).glob("*.pt2"))
    record = json.loads((cache / compiled.RECORD).read_text())
    (entry,) = [e for machine in record.values() for e in machine.values()]
    assert [f.name for f in files] == [entry["file"]] and entry["up_to"] == 32
    assert entry["sha256"] == hashlib.sha256(files[0].read_bytes()).hexdigest()
    assert not list((cache / compiled.FOLDER).glob(".*"))  # no temporary file left

    again = fast.prepare(model, compile=True)  # as a later process: loaded, not built
    assert stand_in.builds == 1 and again.compiled.path == files[0]

    served = stand_in.calls
    for rows in (2, 16, 32):  # one input of 2..up_to real tokens: the compiled forward
        assert same_as_readable(model, run, ids_of(rows))
        served += 1
        assert stand_in.calls == served
    for ids, kw in [(ids_of(1), {}), (ids_of(33), {}), (ids_of(16, batch=2), {}),  # too short, too long, a batch
                    (ids_of(16), {"attention_mask": torch.tensor([[1] * 12 + [0] * 4])}),  # padding
                    (ids_of(16), {"num_blocks": 1})]:  # early exit
        assert same_as_readable(model, run, ids, **kw)
        assert stand_in.calls == served, (ids.shape, kw)

    with torch.inference_mode():  # the hidden states asked for, the pooler as the model's
        out, ref = run(ids_of(8), output_hidden_states=[0, -1]), model(ids_of(8))
    assert stand_in.calls == served + 1
    assert [h is None for h in out.hidden_states] == [False, True, False]
    assert torch.allclose(out.pooler_output, ref.pooler_output, atol=1e-5)
    with torch.inference_mode():
        assert run(ids_of(8), output_hidden_states=False, pooler=False).hidden_states is None


def test_a_changed_checkpoint_is_never_served_a_stale_artefact(cache, monkeypatch, tmp_path_factory):
    stand_in = StandIn(monkeypatch)
    folder = tmp_path_factory.mktemp("checkpoint")
    config = hf_config(**{k: v for k, v in TINY.items()})
    random_hf_model(config, seed=1).save_pretrained(folder)
    first = fast.prepare(BertModel.from_pretrained(folder).eval(), compile=True)
    random_hf_model(config, seed=2).save_pretrained(folder)  # the same folder, other weights
    model = BertModel.from_pretrained(folder).eval()
    second = fast.prepare(model, compile=True)
    assert stand_in.builds == 2 and second.compiled.path != first.compiled.path
    assert same_as_readable(model, second, ids_of(16)) and stand_in.calls == 1

    other_eps = tiny(layer_norm_eps=1e-5)  # the same weights as tiny(), another configuration: another key
    assert compiled.key_of(other_eps) != compiled.key_of(tiny())


def said(record, words: str) -> list[str]:
    """The warnings of ``record`` (``warnings.catch_warnings(record=True)``) that hold ``words``."""
    return [str(w.message) for w in record if words in str(w.message) and w.category is RuntimeWarning]


@pytest.mark.parametrize("edit", ["encoder weight in place", "embedding in place", "replaced parameter"])
def test_an_edit_after_prepare_drops_the_compiled_forward(cache, monkeypatch, edit):
    stand_in = StandIn(monkeypatch)
    model = tiny()
    run = fast.prepare(model, compile=True)
    with torch.no_grad():
        if edit == "encoder weight in place":
            model.encoder.blocks[0].ffn.dense_in.weight.mul_(1.5)
        elif edit == "embedding in place":
            model.embeddings.word.weight[5:].add_(0.5)
        else:
            model.encoder.blocks[1].attn.query.weight = torch.nn.Parameter(torch.randn(32, 32))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for seed in (0, 1):
            assert same_as_readable(model, run, ids_of(16, seed=seed))
    assert stand_in.calls == 0 and run.compiled is None
    assert len(said(record, "changed since they were compiled")) == 1


def test_no_compiler_runs_the_fast_path_and_says_why_once(cache, monkeypatch):
    import torch._inductor.config as inductor

    model = tiny()
    # what a machine without g++ finds (torch's own config patch: monkeypatch cannot restore this attribute)
    with warnings.catch_warnings(record=True) as record, inductor.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        warnings.simplefilter("always")
        runs = [fast.prepare(model, compile=True) for _ in range(2)]
    assert all(run.compiled is None for run in runs)
    lines = said(record, "no compiled forward")
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "\n" not in lines[0], lines
    assert same_as_readable(model, runs[0], ids_of(16))
    assert not (cache / compiled.FOLDER).exists()


def test_taken_only_where_faster(cache, monkeypatch):
    assert compiled.serves_up_to({8: 0.5, 16: 0.9, 32: 0.5, 48: 1.0}) == 32
    assert compiled.serves_up_to({8: 0.5, 16: 1.0, 32: 0.5}) == 8  # where it was faster at every shorter one too
    assert compiled.serves_up_to({8: 0.98, 16: 0.5}) == 0  # within MARGIN is not faster
    StandIn(monkeypatch, ratios={8: 1.2, 16: 1.3, 32: 1.5})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run = fast.prepare(tiny(), compile=True)
    assert run.compiled is None
    assert [line for line in said(record, "nowhere faster") if "1.3 at 16" in line]


def test_a_damaged_artefact_is_built_again(cache, monkeypatch):
    stand_in = StandIn(monkeypatch)
    model = tiny()
    path = fast.prepare(model, compile=True).compiled.path
    path.write_bytes(path.read_bytes()[:-10])
    run = fast.prepare(model, compile=True)
    assert stand_in.builds == 2 and same_as_readable(model, run, ids_of(16)) and stand_in.calls == 1


def test_what_compile_refuses_or_cannot_build(cache, monkeypatch):
    stand_in = StandIn(monkeypatch)
    with pytest.raises(InputError, match=r"compile='yes'"):
        fast.prepare(tiny(), compile="yes")
    for route in ("linear", "blocked"):
        with pytest.raises(InputError, match=rf"fp32_kernel='{route}' asks for F.linear's numbers"):
            fast.prepare(tiny(), fp32_kernel=route, compile=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        int8 = fast.prepare(quantize_linears(tiny()), compile=True)
        half = fast.prepare(tiny().to(torch.bfloat16), compile=True)
    assert int8.compiled is None and half.compiled is None and stand_in.builds == 0
    assert said(record, "this one is int8") and said(record, "this one is torch.bfloat16")


def test_the_compiled_forward_matches_the_readable_path(cache, monkeypatch):
    """A real export and AOTInductor compile (no stand-in): every hidden state and the pooler within the fast
    path's bound on oneDNN's own order, at several lengths of one dynamic-length artefact."""
    if compiled.compiler_missing():
        pytest.skip(compiled.compiler_missing())
    monkeypatch.setattr(compiled, "INDUCTOR", {"freezing": True})  # no kernel tuning: ~20 s instead of ~40
    monkeypatch.setattr(compiled, "TIMED_LENGTHS", (16,))
    monkeypatch.setattr(compiled, "serves_up_to", lambda ratios: compiled.MAX_ROWS)  # served whatever it timed
    model = tiny(seed=3)
    run = fast.prepare(model, compile=True)
    assert run.compiled is not None and run.compiled.up_to == compiled.MAX_ROWS
    for rows in (2, 7, 16, 64):
        ids = ids_of(rows, seed=rows)
        assert same_as_readable(model, run, ids, token_type_ids=(torch.arange(rows) >= rows // 2).long()[None])
    with torch.inference_mode():  # each call its own outputs (no buffer reused under the caller)
        first = run(ids_of(16, seed=1)).last_hidden_state
        kept = first.clone()
        run(ids_of(16, seed=2))
    assert torch.equal(first, kept)
