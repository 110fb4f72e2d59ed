"""Hostile files and killed processes (issue 29): every reader checks types at the border and fails with
our error naming the file and field; absurd configs fail fast; NaN weights, duplicate vocabulary lines
and ids past the model are said at load; paths in a folder's files stay inside it; writes are atomic;
training resumes bit for bit; hooks are visible to the thread that opened them only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibert import BertConfig, BertModel, BertTokenizer, InputError
from minibert.compat import SentenceEncoder

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
    [f"w{i}" for i in range(97)]  # 128 tokens
TINY = dict(vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=64)


def make_folder(directory: Path) -> Path:
    """A complete sentence-transformers folder around a tiny random BERT: every file a folder can hold."""
    torch.manual_seed(0)
    BertModel(BertConfig(**TINY)).eval().save_pretrained(directory)
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    files = {
        "tokenizer_config.json": {"do_lower_case": True, "model_max_length": 64, "cls_token": "[CLS]",
                                  "tokenizer_class": "BertTokenizer"},
        "special_tokens_map.json": {"cls_token": {"content": "[CLS]", "lstrip": False}, "sep_token": "[SEP]",
                                    "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"},
        "modules.json": [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                         {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                         {"idx": 2, "name": "2", "path": "2_Normalize",
                          "type": "sentence_transformers.models.Normalize"}],
        "sentence_bert_config.json": {"max_seq_length": 32, "do_lower_case": False},
        "1_Pooling/config.json": {"word_embedding_dimension": 16, "pooling_mode_cls_token": False,
                                  "pooling_mode_mean_tokens": True, "include_prompt": True},
    }
    (directory / "1_Pooling").mkdir()
    for name, content in files.items():
        (directory / name).write_text(json.dumps(content), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("hostile") / "model")


def load_everything(directory: Path):
    """What a user loads from a folder: the model, the tokenizer, the sentence encoder (and it encodes)."""
    BertModel.from_pretrained(directory)
    BertTokenizer.from_pretrained(directory)
    SentenceEncoder.from_pretrained(directory).encode(["a b c w1"])


def test_the_untouched_folder_loads(folder):
    load_everything(folder)


# --------------------------------------------------------------------------- 1. types at the border
JSON_FILES = ["config.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json",
              "sentence_bert_config.json", "1_Pooling/config.json"]
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
                           | st.text(max_size=8) | st.sampled_from(["abc", "0", "false", "yes", "gelu", "../x", "/etc"]),
                           lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5),
                                                                                             children, max_size=3),
                           max_leaves=6)


def _keys(data) -> list:
    if isinstance(data, dict):
        return list(data)
    return list(range(len(data))) if isinstance(data, list) else []


@st.composite
def mutations(draw):
    """(file, how, what): a change to one file of the folder."""
    name = draw(st.sampled_from(JSON_FILES + ["vocab.txt", "model.safetensors"]))
    if name.endswith(".json"):
        how = draw(st.sampled_from(["set", "set_inner", "delete", "extra", "nest", "bytes", "truncate", "retype"]))
    elif name == "vocab.txt":
        how = draw(st.sampled_from(["bytes", "truncate", "duplicate", "non_utf8"]))
    else:  # model.safetensors: its header and data
        how = draw(st.sampled_from(["bytes", "truncate"]))
    return name, how, draw(json_values), draw(st.integers(0, 10**6)), draw(st.binary(min_size=1, max_size=40))


def apply(directory: Path, mutation) -> None:
    name, how, value, number, raw = mutation
    path = directory / name
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[:number % max(1, len(data))])
    elif how == "bytes":
        cut = number % max(1, len(data))
        path.write_bytes(data[:cut] + raw + data[cut + len(raw):])
    elif how == "non_utf8":
        path.write_bytes(data[:number % max(1, len(data))] + b"\xff\xfe\xc3" + data[number % max(1, len(data)):])
    elif how == "duplicate":
        lines = data.decode().split("\n")
        i = number % len(VOCAB)
        lines.insert(number % len(lines), lines[i])
        path.write_text("\n".join(lines), encoding="utf-8")
    elif how == "nest":
        path.write_text("[" * (10 + number % 3000) + "1" + "]" * (10 + number % 3000), encoding="utf-8")
    elif how == "retype":  # the whole document another JSON type
        path.write_text(json.dumps(value), encoding="utf-8")
    else:
        doc = json.loads(data)
        target = doc
        if how == "set_inner":  # one level down: a module entry, a special token's object, ...
            inner = [k for k in _keys(doc) if isinstance(doc[k], (dict, list))]
            target = doc[inner[number % len(inner)]] if inner else doc
        keys = _keys(target)
        if how in ("set", "set_inner") and keys:
            target[keys[number % len(keys)]] = value
        elif how == "delete" and keys:
            del target[keys[number % len(keys)]]
        elif how == "extra" and isinstance(target, dict):
            target[f"extra{number}"] = value
        path.write_text(json.dumps(doc), encoding="utf-8")


@settings(max_examples=150, deadline=10_000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(mutation=mutations())
def test_any_damage_to_any_file_is_success_or_our_error(folder, tmp_path_factory, mutation):
    """Each file a checkpoint, tokenizer or sentence-transformers folder holds, changed in one way -- a
    field of another JSON type, a key missing or added, deep nesting, other bytes, not UTF-8, cut short, a
    repeated vocabulary line: loading succeeds or raises InputError (CheckpointError is one), never any
    other exception, never a hang (10 s deadline an example)."""
    directory = tmp_path_factory.mktemp("mutated") / "model"
    shutil.copytree(folder, directory)
    try:
        apply(directory, mutation)
        try:
            load_everything(directory)
        except InputError:
            pass
    finally:
        shutil.rmtree(directory.parent)


def _message(fn) -> str:
    with pytest.raises(InputError) as info:
        fn()
    return str(info.value)


def edit_json(path: Path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_the_named_classes_get_our_error_naming_file_and_field(folder, tmp_path):
    cases = [("config.json", {"layer_norm_eps": "abc"}, "layer_norm_eps must be a finite number > 0, got 'abc'"),
             ("config.json", {"layer_norm_eps": None}, "layer_norm_eps must be a finite number > 0, got None"),
             ("config.json", {"hidden_dropout_prob": "x"}, "hidden_dropout_prob must be in [0, 1), got 'x'"),
             ("config.json", {"pad_token_id": "0"}, "pad_token_id='0' is out of range"),
             ("tokenizer_config.json", {"model_max_length": "512"}, "'model_max_length' is a string ('512'); it must be"),
             ("tokenizer_config.json", {"cls_token": ["[CLS]"]}, "'cls_token' is an array"),
             ("tokenizer_config.json", {"do_lower_case": "false"}, "'do_lower_case' is a string ('false'); it must be a boolean"),
             ("tokenizer_config.json", {"do_lower_case": "yes"}, "'do_lower_case' is a string ('yes')"),
             ("1_Pooling/config.json", {"pooling_mode": 3}, "'pooling_mode' is an integer (3)")]
    for name, change, expected in cases:
        directory = tmp_path / "case"
        shutil.copytree(folder, directory)
        edit_json(directory / name, **change)
        message = _message(lambda: load_everything(directory))
        assert expected in message and str(directory) in message, (name, change, message)
        shutil.rmtree(directory)
    shutil.copytree(folder, tmp_path / "modules")
    (tmp_path / "modules" / "modules.json").write_text(json.dumps({"0": "Transformer"}))
    assert "must hold a JSON array, found an object" in _message(lambda: SentenceEncoder.from_pretrained(tmp_path / "modules"))
    (tmp_path / "modules" / "modules.json").write_text(json.dumps([{"idx": 0, "type": 3}]))
    assert "'type' is an integer (3); it must be a string" in _message(lambda: SentenceEncoder.from_pretrained(tmp_path / "modules"))
    (tmp_path / "modules" / "modules.json").write_text("[" * 5000 + "]" * 5000)
    assert "nests JSON too deeply" in _message(lambda: SentenceEncoder.from_pretrained(tmp_path / "modules"))
    (tmp_path / "modules" / "vocab.txt").write_bytes(b"[PAD]\n\xff\xfe\n")
    assert "is not UTF-8 text" in _message(lambda: BertTokenizer.from_pretrained(tmp_path / "modules"))


def _rewrite_dtype(path: Path, name: str, dtype: str, element: int) -> None:
    """Rewrite one tensor of a safetensors file to another dtype (same element count), by hand."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    shape = tensors[name].shape
    tensors[name] = {"I64": torch.zeros(shape, dtype=torch.int64), "BOOL": torch.zeros(shape, dtype=torch.bool),
                     "C64": torch.zeros(shape, dtype=torch.complex64), "I8": torch.zeros(shape, dtype=torch.int8)}[dtype]
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", ["I64", "BOOL", "C64", "I8"])
def test_weights_of_a_non_float_dtype_are_refused_by_name(folder, tmp_path, dtype):
    directory = tmp_path / "m"
    shutil.copytree(folder, directory)
    _rewrite_dtype(directory / "model.safetensors", "encoder.layer.1.output.LayerNorm.weight", dtype, 0)
    message = _message(lambda: BertModel.from_pretrained(directory))
    assert "not real floating point" in message and "encoder.layer.1.output.LayerNorm.weight" in message


# ------------------------------------------------------------------------------------ 2. fail fast
def test_an_absurd_config_fails_fast_and_small(folder, tmp_path):
    """num_hidden_layers 1,000,000 beside a 2-block checkpoint took 56 s and 5.2 GB before it said so."""
    import subprocess
    import sys
    import textwrap

    for layers in (1_000_000, 100_000_000, 1000):
        directory = tmp_path / f"deep{layers}"
        shutil.copytree(folder, directory)
        edit_json(directory / "config.json", num_hidden_layers=layers)
        code = f"""
            import resource, time, minibert, minibert.loading, minibert.models  # imports before the clock
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            start = time.perf_counter()
            try:
                minibert.BertModel.from_pretrained({str(directory)!r})
            except minibert.InputError as e:
                message = str(e)
            print(time.perf_counter() - start, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
            print(message)
        """
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        timing, message = out.stdout.splitlines()[:2]
        seconds, megabytes = map(float, timing.split())
        assert seconds < 1.0 and megabytes < 100, (layers, seconds, megabytes)
        assert ("num_hidden_layers=1000, the checkpoint has 2 blocks" in message if layers == 1000
                else f"num_hidden_layers={layers} is out of range: it must be an int in [1, 1024]" in message), message


# ---------------------------------------------------------------------------- 3. silent wrong results
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_said_at_load(folder, tmp_path, bad):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "m"
    shutil.copytree(folder, directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["encoder.layer.0.attention.self.key.weight"][3, 4] = bad
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    message = _message(lambda: BertModel.from_pretrained(directory))
    assert "1 tensor(s) hold NaN or Inf" in message and "encoder.layer.0.attention.self.key.weight (1 of 256 values)" in message


def test_a_repeated_vocabulary_line_and_ids_past_the_model_are_errors(folder, tmp_path):
    directory = tmp_path / "m"
    shutil.copytree(folder, directory)
    (directory / "vocab.txt").write_text("\n".join(VOCAB + ["[CLS]"]) + "\n", encoding="utf-8")
    message = _message(lambda: BertTokenizer.from_pretrained(directory))
    assert "line 129 repeats the token '[CLS]' of line 3" in message
    (directory / "vocab.txt").write_text("\n".join(VOCAB + ["extra"]) + "\n", encoding="utf-8")
    BertTokenizer.from_pretrained(directory)  # a longer vocabulary is a tokenizer of its own...
    message = _message(lambda: SentenceEncoder.from_pretrained(directory))  # ...but not this model's
    assert "ids up to 128 ('extra'), past" in message and "vocab_size of 128" in message


def test_booleans_must_be_booleans_and_absurd_limits_are_clamped(folder, tmp_path):
    directory = tmp_path / "m"
    shutil.copytree(folder, directory)
    edit_json(directory / "tokenizer_config.json", model_max_length=1e30)  # transformers' "no limit" sentinel
    assert BertTokenizer.from_pretrained(directory).model_max_length == 64  # the model's positions
    edit_json(directory / "tokenizer_config.json", model_max_length=1e8)
    with pytest.warns(UserWarning, match="model_max_length 1e\\+08 is more than the model's 64 positions"):
        assert BertTokenizer.from_pretrained(directory).model_max_length == 64
    edit_json(directory / "tokenizer_config.json", model_max_length=0)
    assert "'model_max_length' is an integer (0); it must be at least 1" in _message(
        lambda: BertTokenizer.from_pretrained(directory))
    for value in ("false", "yes", 1, None):
        edit_json(directory / "tokenizer_config.json", model_max_length=64, do_lower_case=value)
        if value is None:  # absent / null: the default
            assert BertTokenizer.from_pretrained(directory).do_lower_case is True
        else:
            assert "it must be a boolean" in _message(lambda: BertTokenizer.from_pretrained(directory))
    with pytest.raises(InputError, match='a string is not a boolean: "false" would read as true'):
        BertTokenizer(VOCAB, do_lower_case="false")


# ------------------------------------------------------------------ 4. nothing read outside the folder
def test_paths_in_a_folders_files_stay_inside_it(folder, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    directory = tmp_path / "m"
    shutil.copytree(folder, directory)
    modules = json.loads((directory / "modules.json").read_text())
    for path in ("../other", str(other), "link"):
        if path == "link":
            (directory / "link").symlink_to(other, target_is_directory=True)
        for entry in (0, 1):
            changed = [dict(m) for m in modules]
            changed[entry]["path"] = path if entry == 0 else (path + "/1_Pooling" if path != str(other) else
                                                              str(other / "1_Pooling"))
            (directory / "modules.json").write_text(json.dumps(changed))
            message = _message(lambda: SentenceEncoder.from_pretrained(directory))
            assert "leads outside" in message and "modules.json" in message, (path, entry, message)
    # a shard index naming files outside the folder (an absolute path, .., a link)
    from safetensors.torch import load_file, save_file

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(folder / "config.json", sharded / "config.json")
    tensors = load_file(folder / "model.safetensors")
    save_file(tensors, tmp_path / "outside.safetensors", metadata={"format": "pt"})
    (sharded / "inside-link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    for shard in (str(tmp_path / "outside.safetensors"), "../outside.safetensors", "inside-link.safetensors"):
        (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in tensors}}))
        message = _message(lambda: BertModel.from_pretrained(sharded))
        assert "leads outside" in message and "model.safetensors.index.json" in message, (shard, message)
    shutil.copy(tmp_path / "outside.safetensors", sharded / "shard.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "shard.safetensors" for n in tensors}}))
    BertModel.from_pretrained(sharded)  # inside: fine


# ------------------------------------------------------------------------ 5. writes a kill cannot break
KILLER = """
import json, os, signal, sys, time
import torch
torch.set_num_threads(1)  # this process forks: no thread pool to inherit half-way
from minibert import BertConfig, BertModel
geometry = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072)
torch.manual_seed(0)
a = BertModel(BertConfig(**geometry, layer_norm_eps=1e-12)).eval()
b = BertModel(BertConfig(**geometry, layer_norm_eps=1e-11)).eval()  # another config.json...
with torch.no_grad():
    for p in b.parameters():
        p.add_(1.0)  # ...and other values in every tensor
target, points = sys.argv[1], int(sys.argv[2])


savers = []  # the pid of every save forked here


def forked_save(model):  # a child process that saves MODEL over the checkpoint there; its pid
    pid = os.fork()
    if pid == 0:
        model.save_pretrained(target)
        os._exit(0)
    savers.append(pid)
    return pid


def timed_save(model):  # one save as the killed ones run (a forked child, its pages copied on write): the
    old = os.stat(target).st_ino  # seconds until the swap, seen from here as the path's folder changing
    started = time.perf_counter()
    pid = forked_save(model)
    swapped = None
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if swapped is None and os.stat(target).st_ino != old:
            swapped = time.perf_counter() - started
        time.sleep(0.0005)
    return swapped or time.perf_counter() - started


def killed_save(delay):  # saves the model the path does not hold over it, kills it after DELAY seconds; where
    there = json.load(open(os.path.join(target, "config.json")))["layer_norm_eps"]  # the kill landed
    model = b if there == 1e-12 else a
    pid = forked_save(model)
    if delay is None:  # once it has ended: a zombie until waited for, still ours to kill
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    else:
        time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    eps = json.load(open(os.path.join(target, "config.json")))["layer_norm_eps"]
    loaded = BertModel.from_pretrained(target)  # strict: every tensor there, every shape right, no NaN
    ref = a if eps == 1e-12 else b
    same = all(torch.equal(x, y) for x, y in zip(loaded.state_dict().values(), ref.state_dict().values()))
    aside = sorted(n for n in os.listdir(os.path.dirname(target)) if n != os.path.basename(target))
    # a killed write leaves only a save's temporary folder (the next save removes it), nothing else: its own, or
    # -- when the kill came before this save's clean-up, as it can on a loaded machine -- the one before's
    assert all(any(name.startswith(f".ckpt.{p}.") for p in savers) and name.endswith((".tmp", ".tmp.old"))
               for name in aside), aside
    return {"delay": delay, "landed": "after" if eps == model.config.layer_norm_eps else "before", "same": same,
            "aside": aside}


a.save_pretrained(target)
to_swap = sorted(timed_save(m) for m in (b, a, b))[1]  # on this machine now, wherever else the CPU is busy
# spread from a tenth of that to three times it, evenly on a log scale: one save's swap moves (by 3x within a
# run here, as the disk's cache fills), so a kill lands before it and one after wherever it went
rows = [killed_save(to_swap / 10 * 30 ** (point / (points - 1))) for point in range(points)]
for extra in range(10):  # until kills landed on both sides, ones further out
    seen = {r["landed"] for r in rows}
    if seen == {"before", "after"}:
        break
    delays = [r["delay"] for r in rows if r["delay"] is not None]
    if "before" not in seen:  # earlier, the last time at once
        rows.append(killed_save(min(delays) / 4 if extra < 9 else 0.0))
    else:  # later, the last time once the save has ended
        rows.append(killed_save(max(delays) * 2 if extra < 9 else None))
for row in rows:
    print(json.dumps(dict(row, to_swap=to_swap)), flush=True)
"""


def test_a_save_killed_at_any_moment_leaves_the_old_or_the_new_checkpoint(tmp_path):
    """A checkpoint of BERT-base's width (4 blocks of 768, 210 MB) is saved over another and the saving
    process is killed with SIGKILL at 10 moments, from a tenth of the time a save takes to its swap on this
    machine now to three times it (each save a forked child of a process that holds both models; more
    kills, further out, if none landed on one side): each time the path holds A or B whole -- config.json
    and every weight of the same one -- never a mix, a truncated file or nothing."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", KILLER, str(tmp_path / "ckpt"), "10"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert 10 <= len(rows) <= 20 and all(r["same"] for r in rows), rows
    assert {r["landed"] for r in rows} == {"before", "after"}, rows  # kills landed before and after the swap
    assert max(len(r["aside"]) for r in rows) <= 1  # each save removed what the killed one before it left
    BertModel.from_pretrained(tmp_path / "ckpt").save_pretrained(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


RUN = """
import os, signal, sys, traceback, torch
from minibert import BertConfig, BertForSequenceClassification, BertModel
from minibert.training.depth import EarlyExit
from minibert.training.distill import EmbeddingDistiller, init_student
from minibert.training.loop import FitConfig, fit


def run(kind, mode, out):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3 if kind != "classifier" else 2,
                        num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.2,
                        id2label={0: "a", 1: "b"})
    if kind == "distill":  # a student of two blocks learns a teacher's mean-pooled vectors (the loss: the distiller's)
        teacher = BertModel(config).eval()  # the attention term runs the readable teacher, not the fast path, whose
        # fp32 kernel is chosen by timing the first time a machine meets a geometry (then kept for every process)
        model = EmbeddingDistiller(teacher, init_student(teacher, [0, 2]), similarity_weight=0.5, hidden_weight=0.1,
                                   attention_weight=0.1)
    elif kind == "exits":  # early exits trained with the classifier (PABEE's joint loss)
        model = EarlyExit(BertForSequenceClassification(config), frozen=False, pooling="mean")
    else:
        model = BertForSequenceClassification(config)
    data = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(1, 50, (24, 6), generator=data), torch.randint(0, 2, (24,), generator=data)
    mask = (torch.arange(6)[None, :] < torch.randint(2, 7, (24, 1), generator=data)).long()

    def batches(epoch):
        order = torch.randperm(24, generator=torch.Generator().manual_seed(epoch))
        for i in range(0, 24, 6):
            if mode == "kill" and epoch == 2 and i == 12:
                os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of the third epoch
            rows = order[i:i + 6]
            if kind == "classifier":
                yield {"input_ids": ids[rows], "labels": labels[rows]}
            else:
                yield {"input_ids": ids[rows], "attention_mask": mask[rows],
                       **({"labels": labels[rows]} if kind == "exits" else {})}

    def unfreeze(m, epoch):  # the embeddings train from the third epoch on: the optimizer is rebuilt then
        for p in m.bert.embeddings.parameters():
            p.requires_grad_(epoch >= 2)

    config = FitConfig(epochs=4, lr=1e-2, accumulate=2, progress=False, resume=mode == "resume")
    if kind == "classifier":
        evaluate = lambda m: {"score": float(sum(p.double().sum() for p in m.parameters()))}
        fit(model, batches, config=config, evaluate=evaluate, metric="score", out_dir=out, on_epoch_start=unfreeze,
            save=lambda m, d: None)
    else:
        fit(model, batches, config=config, out_dir=out, save=lambda m, d: None)
    torch.save(model.state_dict(), os.path.join(out, "final.pt"))


# one process imports torch once and forks each run: the uninterrupted one, the killed one, the resumed one
kind, root = sys.argv[1], sys.argv[2]
for mode, folder in (("full", "full"), ("kill", "cut"), ("resume", "cut")):
    pid = os.fork()
    if pid == 0:
        try:
            run(kind, mode, os.path.join(root, folder))
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(mode, code, os.path.exists(os.path.join(root, folder, "training_state.pt")), flush=True)
"""


def killed_and_resumed(tmp_path, kind: str) -> tuple[dict, dict]:
    """The final weights of a run of ``kind`` left alone and of the same run killed by SIGKILL in the
    middle of its third epoch and started again with resume=True (``RUN``; the folders: full/, cut/)."""
    import signal
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", RUN, kind, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    # (mode, exit code, a training state there after it): the killed run left the state of its second epoch,
    # the resumed one finished and removed it
    assert done.stdout.split() == ["full", "0", "False", "kill", str(-signal.SIGKILL), "True", "resume", "0", "False"], (
        done.stdout + done.stderr[-3000:])
    return tuple(torch.load(tmp_path / d / "final.pt") for d in ("full", "cut"))


@pytest.mark.parametrize("kind", ["distill", "exits"])
def test_every_kind_of_run_resumes_bit_for_bit(tmp_path, kind):
    """Distillation and early exits train through the same loop with their own loss: killed by SIGKILL in
    the middle of the third epoch and resumed, each ends with the uninterrupted run's weights, bit for bit."""
    full, cut = killed_and_resumed(tmp_path, kind)
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)
    losses = [[e["train_loss"] for e in json.loads((tmp_path / d / "metrics.json").read_text())["epochs"]]
              for d in ("full", "cut")]
    assert losses[0] == losses[1] and len(losses[0]) == 4 and losses[0][-1] < losses[0][0], losses


def test_a_killed_run_resumes_to_the_same_weights_bit_for_bit(tmp_path):
    """fit with dropout, gradient accumulation, a schedule and a recipe that rebuilds the optimizer, killed
    by SIGKILL in the middle of its third epoch and started again with resume=True, ends with exactly the
    weights of the run that was never interrupted."""
    full, cut = killed_and_resumed(tmp_path, "classifier")
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)
    history = [json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("full", "cut")]
    assert [e["train_loss"] for e in history[0]["epochs"]] == [e["train_loss"] for e in history[1]["epochs"]]
    assert not (tmp_path / "cut" / "training_state.pt").exists()  # finished: nothing left to resume
    # a resume with other settings is refused by name
    (tmp_path / "other").mkdir()
    from minibert.training.loop import FitConfig, TrainState, read_state

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    TrainState(model, optimizer, scheduler, step=3, position=1).save(
        tmp_path / "other" / "training_state.pt", FitConfig(epochs=4).recorded(), [], history={})
    with pytest.raises(InputError, match=r"other settings \(epochs=4 then, 5 now\)"):
        read_state(tmp_path / "other" / "training_state.pt", FitConfig(epochs=5, resume=True).recorded(), "cpu")


# ------------------------------------------------------------------------------------------ 6. threads
def test_hooks_are_seen_only_by_the_thread_that_opened_them(folder):
    """Four threads run plain, fast and int8 forward passes of the same models while a fifth keeps
    ablating heads in a hooks block: each gets exactly (bit for bit) what it gets alone, and the ablating
    thread gets its ablated result."""
    import threading

    from minibert.tools import fast
    from minibert.tools.hooks import ablate_heads

    model = BertModel.from_pretrained(folder)
    int8 = BertModel.from_pretrained(folder, dtype="int8")
    tok = BertTokenizer.from_pretrained(folder)
    batch = dict(tok(["a b c w1 w2", "w3 d e"], padding=True, return_tensors="pt"))
    runs = {"plain": lambda: model(**batch).last_hidden_state,
            "fast": lambda: fast.prepare(model)(**batch).last_hidden_state,
            "int8": lambda: fast.prepare(int8)(**batch).last_hidden_state,
            "plain again": lambda: model(**batch, output_attentions=True).last_hidden_state}

    def ablated():
        with ablate_heads(model, {0: [1], 1: [0]}):
            return model(**batch).last_hidden_state
    with torch.inference_mode():
        alone = {name: run() for name, run in runs.items()}
        alone_ablated = ablated()
    assert not torch.equal(alone_ablated, alone["plain"])
    failures, stop = [], threading.Event()

    def worker(name):
        with torch.inference_mode():
            for _ in range(60):
                got = runs[name]()
                if not torch.equal(got, alone[name]):
                    failures.append(name)
                    return

    def ablator():
        with torch.inference_mode():
            while not stop.is_set():
                if not torch.equal(ablated(), alone_ablated):
                    failures.append("ablating")
                    return
    threads = [threading.Thread(target=worker, args=(name,)) for name in runs]
    other = threading.Thread(target=ablator)
    other.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    other.join()
    assert failures == []


def test_a_save_keeps_the_folders_other_files_and_drops_old_weights(folder, tmp_path):
    """save_pretrained swaps the whole folder: the tokenizer and metrics other writers put there are kept
    (linked over), an old sharded checkpoint is not (it would sit beside the new single file)."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "out"
    shutil.copytree(folder, target)
    tensors = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, target / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, target / "model-00002-of-00002.safetensors")
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}}))
    (target / "metrics.json").write_text("{}")
    model = BertModel.from_pretrained(target)  # the sharded one loads
    model.save_pretrained(target)
    kept = sorted(p.name for p in target.iterdir())
    assert "model.safetensors" in kept and not [n for n in kept if n.startswith("model-") or n.endswith("index.json")]
    assert {"vocab.txt", "tokenizer_config.json", "metrics.json", "modules.json", "1_Pooling"} <= set(kept)
    SentenceEncoder.from_pretrained(target).encode(["a b"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left
