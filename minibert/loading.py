"""Finding, checking, loading and saving checkpoints.

The one place where checkpoint tensor names meet minibert's module names is ``tensor_map``: it lists
every tensor a model of a given config owns, under both names, with its shape. Loading and saving
both go through it, so they cannot drift apart.

Loading is strict and all-or-nothing: every tensor of the checkpoint is matched and its shape checked
against the config *before* the model is built, and the model is built on the ``meta`` device and then
takes the checkpoint's tensors directly (safetensors maps the file into memory; nothing is copied when
no dtype or device change is asked). Nothing is ever initialised at random.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from .checks import check_parts, encoder_of
from .config import NORM_MODEL_TYPES, BertConfig, read_json_object
from .errors import CheckpointError, InputError, first_line
from .names import hub_repo_id, parse_dtype
from .textfiles import atomic_dir, atomic_file, inside

WEIGHT_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
CONVERT_HINT = ("convert it to safetensors first: python weights/convert_to_safetensors.py {path} "
                "(it reads the pickle with torch.load(weights_only=True), so no code in it runs)")

#: what a checkpoint save replaces in its folder: old weights (one file or shards) never outlive a save
CHECKPOINT_FILES = ("config.json", "model*.safetensors", INDEX_FILE, *PICKLE_FILES)

#: files fetched from the hub for a model (tokenizer files come along: they are small)
MODEL_FILES = ["config.json", WEIGHT_FILE, INDEX_FILE, "model-*-of-*.safetensors",
               "vocab.txt", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json"]


# ------------------------------------------------------------------------------------- the name map
def tensor_map(config: BertConfig, *, with_pooler: bool = True, with_mlm_head: bool = False):
    """Every tensor of a minibert model as (checkpoint name, our name, shape), in checkpoint order.

    Checkpoint names are transformers' BertModel names (no ``bert.`` prefix, ``weight``/``bias``);
    ``normalise_name`` brings the older spellings to these. nn.Linear weights are (out, in) in both.
    The masked-LM head's names are BertForMaskedLM's ``cls.predictions.*``; its decoder weight is the
    word embedding matrix (tied), so it has no row of its own here.
    """
    H, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    rows = [
        ("embeddings.word_embeddings.weight", "embeddings.word.weight", (V, H)),
        ("embeddings.position_embeddings.weight", "embeddings.position.weight",
         (config.max_position_embeddings, H)),
        ("embeddings.token_type_embeddings.weight", "embeddings.token_type.weight",
         (config.type_vocab_size, H)),
        ("embeddings.LayerNorm.weight", "embeddings.norm.weight", (H,)),
        ("embeddings.LayerNorm.bias", "embeddings.norm.bias", (H,)),
    ]
    per_block = [  # (checkpoint part, our part, weight shape, bias shape)
        ("attention.self.query", "attn.query", (H, H), (H,)),
        ("attention.self.key", "attn.key", (H, H), (H,)),
        ("attention.self.value", "attn.value", (H, H), (H,)),
        ("attention.output.dense", "attn.output", (H, H), (H,)),
        ("attention.output.LayerNorm", "attn_norm", (H,), (H,)),
        ("intermediate.dense", "ffn.dense_in", (F, H), (F,)),
        ("output.dense", "ffn.dense_out", (H, F), (H,)),
        ("output.LayerNorm", "ffn_norm", (H,), (H,)),
    ]
    for i in range(config.num_hidden_layers):
        for theirs, ours, w_shape, b_shape in per_block:
            rows.append((f"encoder.layer.{i}.{theirs}.weight", f"encoder.blocks.{i}.{ours}.weight", w_shape))
            rows.append((f"encoder.layer.{i}.{theirs}.bias", f"encoder.blocks.{i}.{ours}.bias", b_shape))
    if config.norm_placement == "pre":  # the pre-LN stack's last LayerNorm (models/norms.py; not in BERT)
        rows.append(("encoder.final_norm.weight", "encoder.final_norm.weight", (H,)))
        rows.append(("encoder.final_norm.bias", "encoder.final_norm.bias", (H,)))
    if with_pooler:
        rows.append(("pooler.dense.weight", "pooler.dense.weight", (H, H)))
        rows.append(("pooler.dense.bias", "pooler.dense.bias", (H,)))
    if with_mlm_head:
        rows += [
            ("cls.predictions.transform.dense.weight", "mlm_head.transform.weight", (H, H)),
            ("cls.predictions.transform.dense.bias", "mlm_head.transform.bias", (H,)),
            ("cls.predictions.transform.LayerNorm.weight", "mlm_head.norm.weight", (H,)),
            ("cls.predictions.transform.LayerNorm.bias", "mlm_head.norm.bias", (H,)),
            ("cls.predictions.bias", "mlm_head.bias", (V,)),
        ]
        if not config.tie_word_embeddings:  # an untied decoder (untied.py) is a tensor of its own
            rows.append(("cls.predictions.decoder.weight", "mlm_head.decoder", (V, H)))
    return rows


#: the masked-LM head's tied copies: the decoder weight is the word embeddings, its bias the head's bias
MLM_TIED = {"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight",
            "cls.predictions.decoder.bias": "cls.predictions.bias"}


#: tensors a checkpoint may carry that the encoder does not use: skipped and reported by name
SKIPPED_PREFIXES = {
    "cls.": "pre-training heads (next sentence; the masked-LM head unless loaded)",
    "classifier.": "task head",
    "qa_outputs.": "task head",
}
BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what a weight may be stored as  # stored buffers, recomputed here


def normalise_name(name: str) -> str:
    """Bring old checkpoint spellings to today's BertModel names: drop a ``bert.`` prefix and rename
    the TensorFlow-era LayerNorm ``gamma``/``beta`` to ``weight``/``bias``."""
    if name.startswith("bert."):
        name = name[len("bert."):]
    name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", name)
    return re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)


# ------------------------------------------------------------------------------ finding the files
def resolve_source(source, *, revision=None, files=MODEL_FILES) -> Path:
    """Return a local path for ``source``: an existing directory or file as is, otherwise a hub repo id
    downloaded (or found in the cache; HF_HUB_OFFLINE=1 is honoured) through huggingface_hub."""
    path = Path(os.fspath(source)).expanduser()
    if path.exists():
        if revision is not None:
            raise InputError(f"revision={revision!r} only applies to hub repo ids, not the local path {path}")
        return path
    repo_id = hub_repo_id(str(source))
    local = os.path.abspath(path)
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", repo_id) or repo_id.startswith((".", "/")):
        raise FileNotFoundError(f"model {str(source)!r} not found: no file or folder {local} (and it cannot be a "
                                "hub repo id)")
    from huggingface_hub import constants, snapshot_download  # imported here: only hub loading needs it

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(files)))
    except Exception as e:  # network down, offline cache miss, unknown repo or revision, ...
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        reason = first_line(e, limit=120)
        raise FileNotFoundError(
            f"model {str(source)!r} not found: no file or folder {local}, and hub repo {repo_id!r} (revision "
            f"{revision or 'main'}) is not in the cache {constants.HF_HUB_CACHE}"
            + (" (HF_HUB_OFFLINE=1: the hub itself is not asked)" if offline else
               f" and could not be fetched ({type(e).__name__}: {reason})")) from None


def find_checkpoint(path: Path) -> tuple[Path, list[Path]]:
    """Return (config.json path, safetensors files) for a directory or a .safetensors file."""
    if path.is_file():
        if path.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"):
            raise CheckpointError(f"{path} is not a safetensors file; minibert does not unpickle "
                                  "checkpoints (unpickling can run code): " + CONVERT_HINT.format(path=path))
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is not a .safetensors file or a checkpoint directory")
        directory, weight_files = path.parent, [path]
    else:
        directory = path
        if (path / WEIGHT_FILE).exists():
            weight_files = [path / WEIGHT_FILE]
        elif (path / INDEX_FILE).exists():
            weight_map = read_json_object(path / INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{path / INDEX_FILE} has no valid weight_map (tensor name -> shard file)")
            # every shard is a file of this folder: an index naming ../x or /etc/x is refused, links included
            weight_files = [inside(path, name, str(path / INDEX_FILE)) for name in sorted(set(weight_map.values()))]
            missing = [str(p) for p in weight_files if not p.exists()]
            if missing:
                raise CheckpointError(f"{INDEX_FILE} in {path} names shard files that are missing: {missing}")
        else:
            pickles = [name for name in PICKLE_FILES if (path / name).exists()]
            if pickles:
                raise CheckpointError(f"{path} holds only {pickles[0]}, a pickle; minibert reads safetensors "
                                      "only: " + CONVERT_HINT.format(path=path))
            raise CheckpointError(f"no {WEIGHT_FILE} or {INDEX_FILE} in {path}")
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"no config.json beside the weights in {directory}")
    return config_path, weight_files


# ---------------------------------------------------------------------------------------- loading
def read_checkpoint(weight_files: list[Path]) -> dict[str, torch.Tensor]:
    """All tensors of the (possibly sharded) checkpoint under their original names. safetensors maps
    the files: the tensors share the page cache and cost no copy until they are converted."""
    from safetensors import safe_open

    tensors = {}
    for file in weight_files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name in tensors:
                        raise CheckpointError(f"tensor {name!r} appears in more than one shard")
                    tensors[name] = f.get_tensor(name)
        except (CheckpointError, MemoryError):
            raise
        except Exception as e:  # safetensors' own SafetensorError (header too small, not fully covered, ...)
            size = file.stat().st_size if file.exists() else 0
            raise CheckpointError(f"{file} is truncated or corrupt: not a readable safetensors file "
                                  f"({size:,} bytes; safetensors says: {e}). Download or convert it again"
                                  ) from None
    return tensors


def match_checkpoint(config: BertConfig, tensors: dict[str, torch.Tensor], where: str = "checkpoint",
                     mlm_head: bool | None = None):
    """Match checkpoint tensors to our names. Returns (state dict in our names, has_pooler, has_mlm_head,
    skipped names). ``mlm_head``: None = take ``cls.predictions.*`` if present, True = require it, False =
    skip it. Raises CheckpointError listing every missing, unexpected or wrongly shaped tensor at once."""
    present = any(normalise_name(n).startswith("cls.predictions.") for n in tensors)
    if mlm_head and not present:
        raise CheckpointError(f"{where} has no masked-LM head (no cls.predictions.* tensors); it is an "
                              "encoder-only checkpoint")
    with_head = present if mlm_head is None else bool(mlm_head)
    by_name, skipped, tied = {}, [], {}
    for name, tensor in tensors.items():
        key = normalise_name(name)
        if key in BUFFERS:
            continue
        if with_head and key in MLM_TIED and not (key == "cls.predictions.decoder.weight"
                                                   and not config.tie_word_embeddings):
            tied[key] = (name, tensor)
            continue
        if not (with_head and key.startswith("cls.predictions.")) and any(
                name.startswith(p) for p in SKIPPED_PREFIXES):
            skipped.append(name)
            continue
        if key in by_name:
            raise CheckpointError(f"{where}: {name!r} and another tensor both normalise to {key!r}")
        by_name[key] = (name, tensor)

    blocks = {int(m.group(1)) for k in by_name if (m := re.match(r"encoder\.layer\.(\d+)\.", k))}
    if blocks != set(range(config.num_hidden_layers)):  # said before the per-tensor lists are built
        wanted = set(range(config.num_hidden_layers))
        missing = [f"encoder.layer.{i}.*" for i in sorted(wanted - blocks)]
        extra = [f"encoder.layer.{i}.*" for i in sorted(blocks - wanted)]
        raise CheckpointError(f"{where} does not fit its config: config.json says num_hidden_layers="
                              f"{config.num_hidden_layers}, the checkpoint has {len(blocks)} blocks"
                              + (f"; missing tensors of {_shorten(missing, 4)}" if missing else "")
                              + (f"; unexpected tensors of {_shorten(extra, 4)}" if extra else ""))
    has_pooler = any(k.startswith("pooler.") for k in by_name)
    if with_head and "cls.predictions.decoder.bias" in tied and (
            "cls.predictions.bias" not in by_name or not config.tie_word_embeddings):
        # only the tied copy; or untied, where transformers (5) scores with the decoder's own bias
        by_name["cls.predictions.bias"] = tied.pop("cls.predictions.decoder.bias")
    expected = tensor_map(config, with_pooler=has_pooler, with_mlm_head=with_head)
    problems = _misfits(config, by_name, expected)
    if problems:
        raise CheckpointError(f"{where} does not fit its config: " + "; ".join(problems))

    for copy, original in MLM_TIED.items():  # tied copies must really be copies: we keep one tensor
        if copy in tied:
            name, tensor = tied[copy]
            if tuple(tensor.shape) != tuple(by_name[original][1].shape) or not torch.equal(
                    tensor, by_name[original][1].to(tensor.dtype)):
                raise CheckpointError(f"{where}: {name} differs from {by_name[original][0]}; minibert's masked-LM "
                                      "head ties them (as BERT does). Load with mlm_head=False to skip the head")

    state = {}
    for theirs, ours, shape in expected:
        tensor = by_name[theirs][1]
        assert tuple(tensor.shape) == shape, (theirs, tuple(tensor.shape), shape)
        state[ours] = tensor
    check_finite(state, {ours: by_name[theirs][0] for theirs, ours, _ in expected}, where)
    return state, has_pooler, with_head, sorted(skipped)


def _misfits(config: BertConfig, by_name: dict, expected: list) -> list[str]:
    """What keeps the checkpoint's tensors (``by_name``: our key -> (their name, tensor)) from being the
    ``expected`` ones: missing, unexpected, wrongly shaped and not real floating point, each said once."""
    expected_names = {theirs for theirs, _, _ in expected}
    missing = [theirs for theirs, _, _ in expected if theirs not in by_name]
    unexpected = sorted(k for k in by_name if k not in expected_names)
    wrong_shape = [f"{by_name[theirs][0]}: checkpoint {tuple(by_name[theirs][1].shape)}, config {shape}"
                   for theirs, _, shape in expected
                   if theirs in by_name and tuple(by_name[theirs][1].shape) != shape]
    problems = []
    if missing:
        depth = sum(1 for k in by_name if re.fullmatch(r"encoder\.layer\.\d+\.output\.dense\.weight", k))
        note = (f" (config.json says num_hidden_layers={config.num_hidden_layers}, the checkpoint has "
                f"{depth} blocks)" if depth < config.num_hidden_layers else "")
        problems.append(f"{len(missing)} missing tensor(s){note}: {_shorten(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {_shorten(unexpected)}")
    if wrong_shape:
        problems.append(f"{len(wrong_shape)} tensor(s) whose shape disagrees with config.json: "
                        f"{_shorten(wrong_shape)}")
    wrong_dtype = [f"{by_name[theirs][0]}: {str(by_name[theirs][1].dtype).replace('torch.', '')}"
                   for theirs, _, _ in expected if theirs in by_name and by_name[theirs][1].dtype not in WEIGHT_DTYPES]
    if wrong_dtype:
        problems.append(f"{len(wrong_dtype)} tensor(s) that are not real floating point (float16, bfloat16, float32 "
                        f"or float64): {_shorten(wrong_dtype)}")
    return problems


def check_finite(state: dict[str, torch.Tensor], names: dict[str, str], where: str, saving: bool = False) -> None:
    """Every weight a finite number: NaN or Inf anywhere would make every output NaN, silently. One pass
    over the (mapped) weights: a sum per tensor (NaN and Inf propagate into it; the rare finite tensor
    whose sum overflows is then checked value by value); the error names the tensors and how many values.
    ``saving``: the weights are about to be written (every checkpoint is checked so; nothing is written)."""
    bad = []
    for ours, tensor in state.items():
        if torch.isfinite(tensor.sum(dtype=torch.float32 if tensor.dtype != torch.float64 else None)):
            continue
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            bad.append(f"{names.get(ours, ours)} ({int(finite.numel() - finite.sum()):,} of {finite.numel():,} values)")
    if bad:
        end = ("Nothing was written: the model diverged (a learning rate too high, too short a warmup, fp16 "
               "overflow)" if saving else "The checkpoint is damaged (or was saved from a diverged run)")
        raise CheckpointError(f"{where}: {len(bad)} tensor(s) hold NaN or Inf, which would make every output NaN: "
                              f"{_shorten(bad)}. {end}")


def _shorten(names: list[str], limit: int = 12) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def read_config(source, *, revision=None) -> BertConfig:
    """The config of a checkpoint, without its weights: what a command checks its options against before
    any work (a size bounded by the model, a --max-length past its positions)."""
    config_path, _ = find_checkpoint(resolve_source(source, revision=revision))
    return BertConfig.from_json_file(config_path)


def load_model(cls, source, *, revision=None, dtype=None, device=None, mlm_head=None):
    path = resolve_source(source, revision=revision)
    config_path, weight_files = find_checkpoint(path)
    config = BertConfig.from_json_file(config_path)
    tensors = read_checkpoint(weight_files)
    state, has_pooler, has_head, skipped = match_checkpoint(config, tensors, where=str(path), mlm_head=mlm_head)
    del tensors
    with torch.device("meta"):  # no memory, no random init: every parameter is assigned below
        model = cls(config, add_pooler=has_pooler, add_mlm_head=has_head)
    return _take(model, state, dtype, device, path, skipped)


def load_pretraining_model(cls, source, *, revision=None, dtype=None, device=None):
    """An encoder of class ``cls`` with its masked-LM head when the checkpoint has one, and the
    next-sentence head's tensors (``cls.seq_relationship.{weight,bias}``, shapes checked) or None: what
    ``BertForMaskedLM`` / ``BertForPreTraining`` start from. Everything else is as strict as ``load_model``."""
    path = resolve_source(source, revision=revision)
    config_path, weight_files = find_checkpoint(path)
    config = BertConfig.from_json_file(config_path)
    tensors = read_checkpoint(weight_files)
    nsp = {normalise_name(n).rsplit(".", 1)[1]: tensors.pop(n) for n in list(tensors)
           if normalise_name(n).startswith("cls.seq_relationship.")}
    if nsp:
        expected = {"weight": (2, config.hidden_size), "bias": (2,)}
        wrong = [f"cls.seq_relationship.{k}: {tuple(nsp[k].shape) if k in nsp else 'missing'}, config {shape}"
                 for k, shape in expected.items() if k not in nsp or tuple(nsp[k].shape) != shape]
        if wrong or set(nsp) != set(expected):
            raise CheckpointError(f"{path}: the next-sentence head does not fit: {', '.join(wrong) or sorted(nsp)}")
        check_finite(nsp, {}, str(path))
    state, has_pooler, has_head, skipped = match_checkpoint(config, tensors, where=str(path), mlm_head=None)
    del tensors
    with torch.device("meta"):
        model = cls(config, add_pooler=has_pooler, add_mlm_head=has_head)
    return _take(model, state, dtype, device, path, skipped), (nsp or None)


def head_map(config: BertConfig, prefix: str, attribute: str, out_features: int):
    """A task head's tensors as (checkpoint name, our name, shape): ``classifier.*`` or ``qa_outputs.*``."""
    H = config.hidden_size
    return [(f"{prefix}.weight", f"{attribute}.weight", (out_features, H)),
            (f"{prefix}.bias", f"{attribute}.bias", (out_features,))]


def load_task_model(cls, source, *, revision=None, dtype=None, device=None):
    """A fine-tuned checkpoint (transformers' BertFor... layout): ``bert.*`` encoder and the head."""
    path = resolve_source(source, revision=revision)
    config_path, weight_files = find_checkpoint(path)
    config = BertConfig.from_json_file(config_path)
    if config.num_labels is None:
        raise CheckpointError(f"{config_path} has no id2label/num_labels: it is not a fine-tuned {cls.__name__} "
                              f"checkpoint. To fine-tune from an encoder, use {cls.__name__}.from_encoder(...)")
    tensors = read_checkpoint(weight_files)
    out_features = 2 if cls.checkpoint_head == "qa_outputs" else config.num_labels
    head = {}
    for theirs, ours, shape in head_map(config, cls.checkpoint_head, cls.head_attribute, out_features):
        tensor = tensors.pop(theirs, None)
        if tensor is None:
            raise CheckpointError(f"{path} has no {theirs}: it is not a {cls.__name__} checkpoint (it holds "
                                  f"{_shorten(sorted(n for n in tensors if not n.startswith(('bert.', 'encoder.'))), 4) or 'an encoder only'}). "
                                  f"To fine-tune from an encoder, use {cls.__name__}.from_encoder(...)")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{path}: {theirs} has shape {tuple(tensor.shape)}, config.json says {shape} "
                                  f"({out_features} outputs)")
        head[ours] = tensor
    state, has_pooler, _, skipped = match_checkpoint(config, tensors, where=str(path), mlm_head=False)
    del tensors
    if cls.needs_pooler and not has_pooler:
        raise CheckpointError(f"{path} has no pooler, which {cls.__name__} classifies")
    with torch.device("meta"):
        model = cls(config, add_pooler=has_pooler)
    state = {f"bert.{name}": tensor for name, tensor in state.items()} | head
    return _take(model, state, dtype, device, path, skipped)


def _take(model, state, dtype, device, path, skipped):
    """Give a meta-device model the checkpoint's tensors (converted when a dtype or device is asked).
    ``dtype="int8"``: fp32 weights, then the blocks' linear layers quantised (``minibert.quantize``)."""
    int8 = isinstance(dtype, str) and dtype.lower() == "int8"
    encoder = encoder_of(model)
    check_norm_placement(encoder, f"{path} (loading)", stacklevel=5)  # at the from_pretrained call
    if getattr(encoder, "mlm_head", None) is not None and not encoder.config.tie_word_embeddings:
        from .untied import UntiedMaskedLMHead

        with torch.device("meta"):
            encoder.mlm_head = UntiedMaskedLMHead(encoder.config)  # the checkpoint's own decoder weight
    if int8 and device is not None and torch.device(device).type != "cpu":
        raise InputError(f"dtype='int8' (dynamic quantisation) runs on the CPU, not on device={device!r}")
    dtype = torch.float32 if int8 else parse_dtype(dtype)
    if dtype is not None and not int8:
        from .hardware import warn_if_slow

        warn_if_slow(dtype, device, stacklevel=4)  # points at the caller of from_pretrained
    for name, tensor in state.items():
        target_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        state[name] = tensor.to(device=device, dtype=target_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()  # like transformers: a loaded model starts in inference mode (dropout off)
    model.source = str(path)
    model.skipped_tensors = skipped  # what the checkpoint held beyond the model, e.g. cls.* heads
    if int8:
        from .quantize import quantize_linears

        quantize_linears(model)
    return model


def check_norm_placement(encoder, where: str, stacklevel: int) -> None:
    """A config whose ``norm_placement`` is not BERT's post-LN needs a model built for it (minibert.BertModel,
    ``models/norms.py``), and such a checkpoint is minibert's alone: transformers would compute BERT's
    post-LN blocks from it. Said as a warning on every load and save; a model that does not compute what its
    config says is refused (``where``: the path, and loading or saving)."""
    placement = encoder.config.norm_placement
    if getattr(encoder, "norm_placement", "post") != placement:
        raise InputError(f"{where}: config.json says norm_placement={placement!r}, which "
                         f"{type(encoder).__module__}.{type(encoder).__name__} does not build (it is BERT's post-LN): "
                         "use minibert.BertModel, whose blocks follow the config")
    if placement != "post":
        import warnings

        warnings.warn(f"a {placement} model (norm_placement={placement!r}, an ablation: minibert's models/norms.py) "
                      "is read back as itself by minibert only: its config.json says model_type "
                      f"{NORM_MODEL_TYPES[placement]!r}, which transformers' Auto classes refuse and its BertModel "
                      "warns of (BERT is post-LN: it would compute something else)",
                      stacklevel=stacklevel)  # one text: said once a process


# ----------------------------------------------------------------------------------------- saving
def save_model(model, directory) -> None:
    """config.json + model.safetensors in transformers' layout: BertModel's; BertForMaskedLM's with a
    masked-LM head (encoder names prefixed ``bert.``, head under ``cls.predictions.``); a task model's
    (``bert.*`` and ``classifier.*`` / ``qa_outputs.*``) for the classes of heads.py."""
    from safetensors.torch import save_file

    check_parts(model, "save")  # int8 layers, LoRA layers and task modules have no names in a checkpoint
    params = dict(model.named_parameters())
    task = hasattr(model, "checkpoint_head")
    encoder = model.bert if task else model
    check_norm_placement(encoder, f"{directory} (saving)", stacklevel=4)  # at save_pretrained's caller
    mlm = getattr(encoder, "mlm_head", None) is not None
    rows = [(f"bert.{theirs}" if (mlm or task) and not theirs.startswith("cls.") else theirs,
             f"bert.{ours}" if task else ours, shape)
            for theirs, ours, shape in tensor_map(encoder.config, with_pooler=encoder.pooler is not None,
                                                  with_mlm_head=mlm)]
    if task:
        rows += head_map(model.config, model.checkpoint_head, model.head_attribute, model.head_out_features())
    state = {}
    for theirs, ours, shape in rows:
        tensor = params.pop(ours)
        assert tuple(tensor.shape) == shape, (ours, tuple(tensor.shape), shape)
        state[theirs] = tensor.detach().to("cpu").contiguous()
    assert not params, f"parameters with no checkpoint name: {sorted(params)}"
    check_finite(state, {}, f"{directory}: not saved", saving=True)  # finite or nothing, every checkpoint
    if mlm and not encoder.config.tie_word_embeddings:  # untied, transformers (5) scores with the decoder's own
        state["cls.predictions.decoder.bias"] = state["cls.predictions.bias"].clone()  # bias: the one bias, twice
    architecture = type(model).__name__ if task else ("BertForMaskedLM" if mlm else "BertModel")
    # config.json and the weights go in together: a process killed mid-save leaves the old checkpoint
    # whole (or none), never new weights beside an old config (textfiles.atomic_dir)
    with atomic_dir(directory, replaced=CHECKPOINT_FILES) as tmp:
        model.config.to_json_file(tmp / "config.json", architectures=(architecture,))  # which class it is
        save_file(state, tmp / WEIGHT_FILE, metadata={"format": "pt"})


TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json")


def copy_tokenizer(model_source, out_dir) -> None:
    """Copy the tokenizer files of ``model_source`` (a directory or a file in one) into ``out_dir``
    (created when missing), so that a checkpoint written there is usable on its own."""
    source = resolve_source(model_source)
    source = source if source.is_dir() else source.parent
    dangling = [name for name in TOKENIZER_FILES if (source / name).is_symlink() and not (source / name).exists()]
    if dangling:  # a link whose file is gone: copying "what is there" would silently leave the tokenizer out
        raise CheckpointError(f"{source / dangling[0]} is a link to a file that is gone "
                              f"({(source / dangling[0]).resolve()}): the tokenizer cannot be copied with the model")
    if not any((source / name).is_file() for name in ("vocab.txt", "tokenizer.json")):
        raise CheckpointError(f"{source} has no vocab.txt or tokenizer.json: there is no tokenizer to copy beside "
                              "the model, which could not then be used on its own")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists() and (source / name).resolve() != (out_dir / name).resolve():
            with atomic_file(out_dir / name) as tmp:
                shutil.copy(source / name, tmp)
