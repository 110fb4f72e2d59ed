"""Many tasks on one frozen base: bottleneck adapters, prefix-tuning and LoRA as task modules.

Three parameter-efficient ways to adapt the whole encoder train a few per cent of the parameters or less
and leave the base untouched, so one base serves many tasks:

    add_adapter(model, "trec", "houlsby", bottleneck=64)     # a task module; the base is frozen
    add_adapter(model, "ner", "prefix", prefix_length=16)
    set_active(model, "trec")                                 # switching copies and reloads nothing
    save_adapter(model, "trec", "out/trec")                   # a small folder: JSON config + safetensors
    load_adapter(model, "out/trec")                           # checks the base it was trained on

Where each kind acts in a block (x: the block's input, h = LayerNorm(x + attention), s: a sub-layer's
output before its residual add; the block then goes on unchanged, LayerNorm(input + s')):

  ``houlsby``  (Houlsby et al. 2019; AdapterHub's DoubleSeqBnConfig) after attention and after the FFN:
               s' = s + up(act(down(s)))
  ``pfeiffer`` (Pfeiffer et al. 2020; AdapterHub's SeqBnConfig) after the FFN only, reading the sub-layer's
               normalised sum (the FFN's LayerNorm runs twice, as AdapterHub computes it):
               s' = s + up(act(down(LayerNorm(h + s))))
  ``prefix``   (Li and Liang 2021; P-tuning v2, Liu et al. 2022) P learnt keys and values put before each
               block's own in attention's ``kv`` slot: every token attends them, padding never hides them.
               While training they come from a small MLP (the reparameterisation): E (P, H) -> Linear ->
               tanh -> Linear -> (layers x 2 x H); ``flatten_prefix`` computes them once and drops the MLP
  ``lora``     (Hu et al. 2021) y = W x + b + (alpha / r) B A dropout(x) on the chosen linear layers

All three act from outside ``model.py``: bottleneck adapters and LoRA through torch forward hooks on the
attention, feed-forward and linear modules, prefixes through the attention's key/value slot. Their
parameters live in ``model.task_modules`` (one entry per task); the hooks ask which one is active and do
nothing when none is (or when the active one is of another kind). Dropout: the adapter acts on the
sub-layer's output before the block's dropout (AdapterHub after it): the same in eval mode.

Every tool sees an adapted model as it is: hooks and ``run_with_cache`` (each adapter has its own hook
points, ``task_modules.tasks.<name>.ffn.<i>.hook_output``), probing, bf16; the fast path runs the readable
path for it (its fused blocks do not run task modules), int8 bases take adapters and prefixes (not LoRA
task modules, which train through the base's fp32 linear layers). ``training.lora.apply_lora`` stays the
one-task LoRA that merges into the weights.
"""

from __future__ import annotations

import copy
import math
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_fraction, check_index, check_positive, encoder_of
from ..errors import InputError
from ..hookpoints import HookPoint
from ..parts import check_fits, check_record, files, write_part
from .lora import LoRAPair

KINDS = ("houlsby", "pfeiffer", "prefix", "lora")
GOES_ON = "task modules go on"  # how a refused model is told (checks.encoder_of)
NONLINEARITIES = {"swish": F.silu, "silu": F.silu, "relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}
INITS = ("identity", "bert", "houlsby")
PART = "adapter"  # a saved task module is a part (``parts``): adapter.json and adapter.safetensors
CONFIG_FILE, WEIGHTS_FILE = files(PART)
#: the base's config fields a task module depends on beyond its tensors' shapes: a module trained on one
#: value computes something else on another (12 heads split the prefix keys otherwise than 4)
BASE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "position_embedding_type")
#: what adapter.json must still say as the weights file recorded it (where the base came from may change)
SEALED = ("name", "options", "base_config", "head")
#: what ``save_adapter`` records of each kind's options: ``add_adapter``'s argument names
SAVED_OPTIONS = {"houlsby": ("bottleneck", "nonlinearity", "init"), "pfeiffer": ("bottleneck", "nonlinearity", "init"),
                 "prefix": ("prefix_length", "prefix_bottleneck", "dropout"), "lora": ("r", "alpha", "dropout", "targets")}


# --------------------------------------------------------------------------------------- the modules
def default_init(linear: nn.Linear, generator: torch.Generator | None) -> nn.Linear:
    """nn.Linear's own initialisation (Kaiming-uniform weight, uniform bias), drawn from ``generator``."""
    with torch.no_grad():
        nn.init.kaiming_uniform_(linear.weight, a=math.sqrt(5), generator=generator)
        if linear.bias is not None:
            bound = 1 / math.sqrt(linear.in_features)
            nn.init.uniform_(linear.bias, -bound, bound, generator=generator)
    return linear


class BottleneckAdapter(nn.Module):
    """down-projection, nonlinearity, up-projection, plus a residual: ``residual + up(act(down(x)))``.

    init: ``identity`` (default: down as nn.Linear's default, up and its bias zero, so the adapted model
    starts as the base exactly), ``bert`` (AdapterHub's default: N(0, 0.02) weights, zero biases) or
    ``houlsby`` (truncated N(0, 0.01^2) weights, zero biases, as Houlsby et al.)."""

    def __init__(self, hidden: int, bottleneck: int, nonlinearity: str, init: str, dtype=None, device=None,
                 generator: torch.Generator | None = None):
        super().__init__()
        self.down = nn.Linear(hidden, bottleneck, dtype=dtype, device=device)  # H -> m
        self.up = nn.Linear(bottleneck, hidden, dtype=dtype, device=device)  # m -> H
        self.nonlinearity = nonlinearity
        self.act = NONLINEARITIES[nonlinearity]
        self.hook_down, self.hook_output = HookPoint(), HookPoint()
        with torch.no_grad():
            if init == "identity":
                default_init(self.down, generator)
                nn.init.zeros_(self.up.weight)
                nn.init.zeros_(self.up.bias)
            else:
                for linear in (self.down, self.up):
                    if init == "bert":
                        nn.init.normal_(linear.weight, std=0.02, generator=generator)
                    else:
                        nn.init.trunc_normal_(linear.weight, std=1e-2, a=-2e-2, b=2e-2, generator=generator)
                    nn.init.zeros_(linear.bias)

    def forward(self, x, residual):  # (B, T, H) each
        down = self.hook_down(self.act(self.down(x)))  # (B, T, m)
        return self.hook_output(self.up(down) + residual)  # (B, T, H)

    def extra_repr(self) -> str:
        return f"{self.down.in_features} -> {self.down.out_features} -> {self.up.out_features}, {self.nonlinearity}"


class BottleneckTask(nn.Module):
    """One task's bottleneck adapters: ``ffn[i]`` for every block, and ``attn[i]`` for Houlsby's."""

    def __init__(self, kind: str, config, bottleneck: int, nonlinearity: str, init: str, dtype, device, generator=None):
        super().__init__()
        self.kind = kind
        n, H = config.num_hidden_layers, config.hidden_size
        make = lambda: BottleneckAdapter(H, bottleneck, nonlinearity, init, dtype=dtype, device=device,  # noqa: E731
                                         generator=generator)
        self.attn = nn.ModuleList(make() for _ in range(n)) if kind == "houlsby" else None
        self.ffn = nn.ModuleList(make() for _ in range(n))


class PrefixTask(nn.Module):
    """One task's prefixes: P keys and values for every block.

    Reparameterised (while training): ``embedding`` E (P, H), then ``mlp`` = Linear(H, m) -> tanh ->
    Linear(m, layers x 2 x H), AdapterHub's layout (for block i: keys at 2i, values at 2i + 1). Flat
    (``flatten_prefix``, or loaded): ``prefix`` (layers, 2, P, H) itself."""

    def __init__(self, config, prefix_length: int, bottleneck: int, dropout: float, flat: bool, dtype, device,
                 generator=None):
        super().__init__()
        self.kind = "prefix"
        self.layers, self.heads, self.hidden = config.num_hidden_layers, config.num_attention_heads, config.hidden_size
        self.prefix_length = prefix_length
        self.dropout = nn.Dropout(dropout)
        if flat:
            self.prefix = nn.Parameter(torch.randn(self.layers, 2, prefix_length, self.hidden, generator=generator)
                                       .mul_(0.02).to(dtype=dtype, device=device))
            self.embedding = self.mlp = None
        else:
            self.prefix = None
            self.embedding = nn.Embedding(prefix_length, self.hidden, dtype=dtype, device=device)
            self.mlp = nn.Sequential(nn.Linear(self.hidden, bottleneck, dtype=dtype, device=device), nn.Tanh(),
                                     nn.Linear(bottleneck, self.layers * 2 * self.hidden, dtype=dtype, device=device))
            with torch.no_grad():  # torch's defaults (N(0, 1) embedding, Kaiming-uniform linears), from ``generator``
                self.embedding.weight.normal_(generator=generator)
                default_init(self.mlp[0], generator)
                default_init(self.mlp[2], generator)

    def all_prefixes(self) -> torch.Tensor:  # (layers, 2, P, H)
        if self.prefix is not None:
            return self.prefix
        out = self.mlp(self.embedding.weight)  # (P, layers * 2 * H)
        return out.view(self.prefix_length, self.layers, 2, self.hidden).permute(1, 2, 0, 3)

    def keys_values(self, i: int, like: torch.Tensor, prefixes: torch.Tensor | None = None):
        """Block i's extra keys and values for a batch like ``like`` (B, h, T, d): each (B, h, P, d).
        ``prefixes``: ``all_prefixes()`` when the caller has it already."""
        B, h, _, d = like.shape
        kv = self.dropout((self.all_prefixes() if prefixes is None else prefixes)[i])  # (2, P, H)
        kv = kv.to(like.dtype).view(2, self.prefix_length, h, d).transpose(1, 2)  # (2, h, P, d)
        return kv[0].expand(B, h, self.prefix_length, d), kv[1].expand(B, h, self.prefix_length, d)

    def flatten(self) -> None:
        """Compute the prefixes once and keep them as parameters: the MLP (the training device) goes."""
        if self.prefix is None:
            with torch.no_grad():
                prefix = self.all_prefixes().detach().clone()
            self.prefix = nn.Parameter(prefix, requires_grad=self.embedding.weight.requires_grad)
            self.embedding = self.mlp = None


class LoRATask(nn.Module):
    """One task's LoRA pairs, keyed by the adapted layer's module path (dots written as ``__``)."""

    def __init__(self, layers: dict, r: int, alpha: float, dropout: float, dtype, device, generator=None):
        super().__init__()
        self.kind = "lora"
        self.pairs = nn.ModuleDict({path.replace(".", "__"): LoRAPair(m.in_features, m.out_features, r, alpha,
                                                                      dropout, dtype, device, generator)
                                    for path, m in layers.items()})

    def pair(self, path: str):
        return self.pairs[path.replace(".", "__")] if path.replace(".", "__") in self.pairs else None


class TaskModules(nn.Module):
    """``model.task_modules``: every task module of one encoder, by name, and which one is active. Its
    methods are what the hooks call."""

    def __init__(self):
        super().__init__()
        self.tasks = nn.ModuleDict()
        self.active: str | None = None
        self.options: dict[str, dict] = {}  # name -> the options it was made with (saved with it)
        self.lora_paths: set[str] = set()  # linear layers that carry a LoRA hook
        self._prefixes = None  # the active prefix task's (layers, 2, P, H), computed once per forward pass

    def __getstate__(self):  # copies and pickles leave the last pass's prefixes (and their graph) behind
        state = super().__getstate__()
        state["_prefixes"] = None
        return state

    def refuses(self, doing: str) -> str | None:  # checks.check_parts asks before a save or int8
        if doing == "save" and len(self.tasks):
            return (f"task modules ({', '.join(self.tasks)}: adapters, prefixes or LoRA added by "
                    "minibert.training.adapters), which a BERT checkpoint has no names for: save each with "
                    "save_adapter, and the base (remove_adapter each first) with save_pretrained")
        lora = [name for name, task in self.tasks.items() if task.kind == "lora"]
        if doing == "int8" and lora:
            return (f"LoRA task modules ({', '.join(lora)}) act through torch forward hooks on the linear layers, "
                    "which the int8 layers would drop: remove them (remove_adapter) first; adapters and prefixes stay")
        return None

    def current(self, kind=None):
        task = self.tasks[self.active] if self.active is not None else None
        if task is None or (kind is not None and task.kind not in kind):
            return None
        return task

    # the hooks (torch forward hooks, and the key/value slot's ``extend``) ----------------------------
    def after_attention(self, i, module, args, output):
        task = self.current(("houlsby",))
        if task is None:
            return None
        s, probs = output  # (B, T, H), probabilities or None
        return task.attn[i](s, s), probs

    def after_ffn(self, i, norm, module, args, output):
        task = self.current(("houlsby", "pfeiffer"))
        if task is None:
            return None
        if task.kind == "houlsby":
            return task.ffn[i](output, output)
        return task.ffn[i](norm(output + args[0]), output)  # Pfeiffer: reads LayerNorm(h + s)

    def new_pass(self, module, args):  # a forward pre-hook on the encoder: the prefixes of the last pass go
        self._prefixes = None

    def prefix_for(self, i, k):
        task = self.current(("prefix",))
        if task is None:
            return None
        if self._prefixes is None:  # the MLP runs once a forward pass, for every block (as AdapterHub's pool)
            self._prefixes = task.all_prefixes()
        return task.keys_values(i, k, self._prefixes)

    def pooled(self, module, args, output):  # a forward hook on the base's pooler
        task = self.current()
        own = getattr(task, "pooler", None) if task is not None else None
        if own is None:
            return None
        return torch.tanh(own(args[0][:, 0]))  # (B, H): the task's own pooler on the first token

    def pooled_without_base(self, module, args, output):  # a forward hook on a base that has no pooler
        task = self.current()
        own = getattr(task, "pooler", None) if task is not None else None
        if own is not None and output.pooler_output is None:
            output.pooler_output = torch.tanh(own(output.last_hidden_state[:, 0]))  # (B, H)
        return output

    def lora(self, path, module, args, output):
        task = self.current(("lora",))
        pair = None if task is None else task.pair(path)
        return None if pair is None else output + pair(args[0])


# ------------------------------------------------------------------------------------------ the API
def _container(encoder, create: bool) -> TaskModules | None:
    found = getattr(encoder, "task_modules", None)
    if found is None and create:
        found = TaskModules()
        encoder.task_modules = found
        encoder.encoder.register_forward_pre_hook(found.new_pass)
        for i, block in enumerate(encoder.encoder.blocks):  # the hooks, once: they ask the container
            block.attn.register_forward_hook(partial(found.after_attention, i))
            block.ffn.register_forward_hook(partial(found.after_ffn, i, block.ffn_norm))
            block.attn.kv.extend = partial(found.prefix_for, i)
        if encoder.pooler is not None:
            encoder.pooler.register_forward_hook(found.pooled)
        else:  # no pooler to stand in for: a module's own pooler fills pooler_output itself
            encoder.register_forward_hook(found.pooled_without_base)
    return found


def base_fingerprint(model, own_pooler: bool = False) -> str:
    """sha256 of the base's own tensors that a task module reads (task modules and a masked-LM head left
    out): what a saved task module was trained on. A module with a pooler of its own never reads the base's
    (``own_pooler``): that is left out too, so the module fits its base whether or not the base has one (a
    masked-LM checkpoint has none)."""
    from ..tools.fingerprint import weights_fingerprint

    skip = ("task_modules.", "mlm_head.") + (("pooler.",) if own_pooler else ())
    return weights_fingerprint(encoder_of(model, GOES_ON), skip=skip)


#: each kind's options (``add_adapter``'s keywords) and their defaults; another kind's option is refused
OPTIONS = {
    "houlsby": {"bottleneck": 64, "reduction_factor": None, "nonlinearity": None, "init": "identity", "pooler": False},
    "pfeiffer": {"bottleneck": 64, "reduction_factor": None, "nonlinearity": None, "init": "identity", "pooler": False},
    "prefix": {"prefix_length": 16, "prefix_bottleneck": 512, "flat": False, "dropout": 0.0, "pooler": False},
    "lora": {"r": 8, "alpha": 16.0, "dropout": 0.0, "targets": ("query", "value"), "pooler": False},
}


def add_adapter(model, name: str, kind: str = "houlsby", *, activate: bool = True,
                train_head: tuple[str, ...] = ("classifier", "qa_outputs"), seed: int | None = 0, **options):
    """Add a task module ``name`` of ``kind`` (houlsby, pfeiffer, prefix, lora) to ``model`` (an encoder or
    a task head: the module goes on its encoder), freeze the base and make it active (``activate``).
    What trains afterwards: the new module and the head's layers named in ``train_head``. ``options``, by
    kind (``OPTIONS`` holds their defaults; another kind's is refused by name):

    houlsby / pfeiffer: ``bottleneck`` m (or ``reduction_factor``: m = H // factor, AdapterHub's way),
    ``nonlinearity`` (swish for Houlsby, relu for Pfeiffer by default, as AdapterHub), ``init``.
    prefix: ``prefix_length`` P, ``prefix_bottleneck`` (the MLP's width), ``flat`` (no MLP), ``dropout``.
    lora: ``r``, ``alpha``, ``dropout``, ``targets`` (as ``training.lora.lora_targets``).
    every kind: ``pooler``, the module carries a pooler of its own (a copy of the base's, trained with it)
    that stands in for the base's while the module is active -- for a base whose first-token output was
    never trained to summarise a text (sentence-transformers models such as all-MiniLM-L6-v2, trained with
    mean pooling), a frozen pooler leaves a prefix little to read (1,500 TREC-6 questions, 3 epochs at lr
    1e-3: test accuracy 0.41 without, 0.93 with).

    The random parts are drawn from a generator seeded with ``seed`` (None: torch's global one). Returns
    the model."""
    encoder = encoder_of(model, GOES_ON)
    if not isinstance(name, str) or not name.isidentifier():
        raise InputError(f"adapter name {name!r}: use a Python identifier (letters, digits, _), e.g. 'trec'")
    if kind not in KINDS:
        raise InputError(f"kind={kind!r}: use one of {KINDS}")
    unknown = sorted(set(options) - set(OPTIONS[kind]))
    if unknown:
        raise InputError(f"{', '.join(unknown)}: not an option of a {kind} module; it takes {', '.join(OPTIONS[kind])}")
    existing = _container(encoder, create=False)
    if existing is not None and name in existing.tasks:
        raise InputError(f"this model already has a task module named {name!r} (remove_adapter it first)")
    options = {**OPTIONS[kind], **options}
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    task, record = _new_task(encoder, kind, options, generator)
    for p in model.parameters():
        p.requires_grad_(False)
    container = _container(encoder, create=True)
    if kind == "lora":
        for path in record["targets"]:
            if path not in container.lora_paths:
                encoder.get_submodule(path).register_forward_hook(partial(container.lora, path))
                container.lora_paths.add(path)
    container.tasks[name] = task
    container.options[name] = record
    for p in task.parameters():  # the new module trains (and the head); the base and other modules do not
        p.requires_grad_(True)
    for attribute in train_head:
        head = getattr(model, attribute, None)
        if head is not None and model is not encoder:
            for p in head.parameters():
                p.requires_grad_(True)
    if activate:
        container.active = name
    task.train(encoder.training)
    return model


def _new_task(encoder, kind: str, o: dict, generator) -> tuple[nn.Module, dict]:
    """(the module of ``kind`` built with the options ``o``, checked against the base; what its record
    keeps of them: ``save_adapter`` writes it, ``load_adapter`` builds the module again from it)."""
    config = encoder.config
    quantized = bool(getattr(encoder, "quantized", None))
    dtype = torch.float32 if quantized else encoder.dtype  # an int8 base computes in fp32 between its int8 products
    device = encoder.device
    record: dict = {"kind": kind}
    if kind in ("houlsby", "pfeiffer"):
        bottleneck, factor = o["bottleneck"], o["reduction_factor"]
        if factor is not None:
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
                raise InputError(f"reduction_factor={factor!r} must be a number >= 1 (H / bottleneck)")
            bottleneck = max(1, int(config.hidden_size // factor))
        nonlinearity = o["nonlinearity"] or ("swish" if kind == "houlsby" else "relu")
        if nonlinearity not in NONLINEARITIES:
            raise InputError(f"nonlinearity={nonlinearity!r}: use one of {tuple(NONLINEARITIES)}")
        if o["init"] not in INITS:
            raise InputError(f"init={o['init']!r}: use one of {INITS}")
        check_sizes(config, bottleneck=bottleneck)
        task = BottleneckTask(kind, config, bottleneck, nonlinearity, o["init"], dtype, device, generator)
        record |= {"bottleneck": bottleneck, "nonlinearity": nonlinearity, "init": o["init"]}
    elif kind == "prefix":
        check_fraction("dropout", o["dropout"])
        check_sizes(config, prefix_length=o["prefix_length"])
        check_positive("prefix_bottleneck", o["prefix_bottleneck"], "the reparameterisation MLP's width")
        task = PrefixTask(config, o["prefix_length"], o["prefix_bottleneck"], o["dropout"], o["flat"], dtype, device,
                          generator)
        record |= {k: o[k] for k in ("prefix_length", "prefix_bottleneck", "dropout")}
    else:
        from .lora import lora_targets

        check_fraction("dropout", o["dropout"])
        check_positive("r", o["r"], "the rank")
        if quantized:
            raise InputError("this model is int8-quantised: LoRA task modules train through the base's fp32 linear "
                             "layers; add them to the fp32 model (adapters and prefixes work on int8 bases)")
        paths = lora_targets(encoder, o["targets"])
        check_sizes(config, r=o["r"], widest=min(min(encoder.get_submodule(p).in_features,
                                                     encoder.get_submodule(p).out_features) for p in paths))
        task = LoRATask({p: encoder.get_submodule(p) for p in paths}, o["r"], o["alpha"], o["dropout"], dtype, device,
                        generator)
        record |= {"r": o["r"], "alpha": o["alpha"], "dropout": o["dropout"], "targets": paths}
    if o["pooler"]:
        if encoder.pooler is not None:
            task.pooler = copy.deepcopy(encoder.pooler.dense).to(dtype=dtype)
        else:  # a base without one (a masked-LM checkpoint): a new pooler, as transformers starts one
            from ..models.heads import init_head

            task.pooler = init_head(nn.Linear(config.hidden_size, config.hidden_size), generator).to(device=device,
                                                                                                     dtype=dtype)
        record["pooler"] = True
    return task, record


def size_limits(config, widest: int | None = None) -> dict[str, int]:
    """The largest task-module size of each kind a base of ``config`` takes: a bottleneck its hidden size, a
    prefix its positions, a LoRA rank the adapted layers' smaller side (``widest``; before the layers are
    known, the hidden size, which every BERT linear layer has on one side)."""
    return {"bottleneck": config.hidden_size, "prefix_length": config.max_position_embeddings,
            "r": config.hidden_size if widest is None else widest}


def check_sizes(config, *, bottleneck: int | None = None, prefix_length: int | None = None, r: int | None = None,
                widest: int | None = None, names: dict[str, str] | None = None) -> None:
    """A task module's sizes against the base they go on (given ones only), from 1 to ``size_limits``. What
    ``add_adapter`` checks, and ``minibert finetune`` before any work; ``names``: how the message calls each
    size (the command line's options; default the keywords')."""
    top = size_limits(config, widest)
    why = {"bottleneck": "a bottleneck narrows the hidden states: at most the model's hidden size, "
                         f"{top['bottleneck']}",
           "prefix_length": "keys and values per block: at most as many as the model has positions, "
                            f"{top['prefix_length']}",
           "r": f"at most the adapted layers' smaller side, {top['r']}: a higher rank adds nothing a full update "
                "would not"}
    for key, value in (("bottleneck", bottleneck), ("prefix_length", prefix_length), ("r", r)):
        if value is not None:
            check_index((names or {}).get(key, key), value, 1, top[key], why[key])


def module_cost(config, kind: str, *, bottleneck: int = 64, prefix_length: int = 16, prefix_bottleneck: int = 512,
                r: int = 8, targets: int = 2, batch_size: int = 16, max_length: int = 128) -> tuple[int, int]:
    """(parameters, bytes while training) of a task module of ``kind`` on a base of ``config``, before it is
    made: fp32 weights, gradients and AdamW's two moments (16 bytes a parameter), and for a prefix the
    attention scores its keys add to every block (B x heads x T x P, kept three times: scores,
    probabilities, dropout) for a batch of ``batch_size`` x ``max_length``. LoRA: ``targets`` adapted
    linear layers per block, each H x H at most."""
    n, H, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    if kind in ("houlsby", "pfeiffer"):
        params = n * (2 if kind == "houlsby" else 1) * (2 * H * bottleneck + bottleneck + H)
        return params, 16 * params
    if kind == "prefix":
        params = prefix_length * H + H * prefix_bottleneck + prefix_bottleneck + prefix_bottleneck * n * 2 * H + n * 2 * H
        scores = 3 * 4 * n * batch_size * heads * max_length * prefix_length
        return params, 16 * params + scores
    if kind == "lora":
        params = n * targets * r * 2 * max(H, config.intermediate_size)
        return params, 16 * params
    raise InputError(f"kind={kind!r}: use one of {KINDS}")


def check_module_cost(config, kind: str, *, what: str, **sizes) -> int:
    """Say what a task module will take while it trains when that is large (over 1 GiB, as a warning), and
    refuse one that cannot fit in this machine's memory (``hardware.check_memory``); returns its parameter
    count."""
    from ..hardware import check_memory

    params, needed = module_cost(config, kind, **sizes)
    check_memory(needed, f"{what}: a {kind} module of {params:,} parameters ({4 * params / 2**20:,.1f} MB saved) on "
                 f"{config.num_hidden_layers} x {config.hidden_size} takes about {needed / 2**30:.1f} GiB while it "
                 "trains", note_above=2**30)
    return params


def task_names(model) -> list[str]:
    """The task modules of ``model``, in the order they were added."""
    container = _container(encoder_of(model, GOES_ON), create=False)
    return [] if container is None else list(container.tasks)


def active_task(model) -> str | None:
    container = _container(encoder_of(model, GOES_ON), create=False)
    return None if container is None else container.active


def set_active(model, name: str | None):
    """Make task module ``name`` the one the model runs -- and the one that trains: its parameters require
    gradients, the other task modules' do not (the base stays as it is). None: the plain base. Nothing is
    copied or reloaded: the hooks read the new name on the next forward pass."""
    container = _container(encoder_of(model, GOES_ON), create=False)
    names = [] if container is None else list(container.tasks)
    if name is not None and name not in names:
        raise InputError(f"no task module named {name!r}; this model has {names or 'none'}")
    if container is not None:
        container.active = name
        for task_name, task in container.tasks.items():
            for p in task.parameters():
                p.requires_grad_(task_name == name)
    return model


def remove_adapter(model, name: str):
    """Remove task module ``name`` (the hooks stay and do nothing for it)."""
    container = _container(encoder_of(model, GOES_ON), create=False)
    if container is None or name not in container.tasks:
        raise InputError(f"no task module named {name!r}; this model has {task_names(model) or 'none'}")
    del container.tasks[name]
    container.options.pop(name, None)
    if container.active == name:
        container.active = None
    return model


def flatten_prefix(model, name: str | None = None):
    """Fold a prefix task's reparameterisation MLP away: its keys and values computed once, kept as
    parameters (what inference and ``save_adapter`` use). ``name``: the active task by default."""
    container = _container(encoder_of(model, GOES_ON), create=False)
    name = name if name is not None else (container.active if container else None)
    task = container.tasks[name] if container is not None and name in container.tasks else None
    if task is None or task.kind != "prefix":
        raise InputError(f"flatten_prefix: {name!r} is not a prefix task module of this model")
    task.flatten()
    return model


def trainable_parameters(model) -> tuple[int, int]:
    """(trainable, all) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def save_adapter(model, name: str, directory) -> Path:
    """Write task module ``name`` -- and, for a task head, the head -- to ``directory`` as a part
    (``parts``): ``adapter.json`` (kind, options, the base's fingerprint and source, the head's class and
    labels) and ``adapter.safetensors``. A prefix task is saved flat (its keys and values; the MLP is for
    training)."""
    from ..textfiles import atomic_dir

    encoder = encoder_of(model, GOES_ON)
    container = _container(encoder, create=False)
    if container is None or name not in container.tasks:
        raise InputError(f"no task module named {name!r}; this model has {task_names(model) or 'none'}")
    task = container.tasks[name]
    if task.kind == "prefix" and task.prefix is None:
        with torch.no_grad():
            prefix = task.all_prefixes().detach()
        state = {"prefix": prefix}
        if getattr(task, "pooler", None) is not None:
            state |= {f"pooler.{k}": v.detach() for k, v in task.pooler.state_dict().items()}
    else:
        state = {k: v.detach() for k, v in task.state_dict().items()}
    tensors = {f"task.{k}": v.to("cpu").contiguous() for k, v in state.items()}
    head = None
    if model is not encoder:
        attribute = getattr(model, "head_attribute", None)
        layer = getattr(model, attribute, None) if attribute else None
        if layer is not None:
            tensors |= {f"head.{k}": v.detach().to("cpu").contiguous() for k, v in layer.state_dict().items()}
            head = {"class": type(model).__name__, "attribute": attribute,
                    "id2label": {str(k): v for k, v in (model.config.id2label or {}).items()},
                    "problem_type": model.config.problem_type}
    source = str(getattr(encoder, "source", "") or "")
    if source and Path(source).exists():  # a local folder: absolute, so the record holds from anywhere
        source = str(Path(source).resolve())
    base = base_config(encoder.config)
    own_pooler = bool(container.options[name].get("pooler"))
    record = {"name": name, "options": container.options[name],
              "base_fingerprint": base_fingerprint(encoder, own_pooler=own_pooler),
              "base_source": source, "hidden_size": encoder.config.hidden_size,
              "num_hidden_layers": encoder.config.num_hidden_layers, "base_config": base, "head": head}
    with atomic_dir(directory) as tmp:
        write_part(tmp, PART, record, tensors)
    return Path(directory)


def base_config(config) -> dict:
    """The fields of a base's config a task module depends on (``BASE_FIELDS``), as adapter.json keeps them."""
    return {k: getattr(config, k) for k in BASE_FIELDS}


def check_base_config(directory, record: dict, config) -> None:
    """The base a module is loaded on has the config it was trained on (``base_config``'s ``BASE_FIELDS``,
    and the hidden_size and num_hidden_layers the record also keeps at its top, which older modules record
    alone): an InputError naming each field that differs."""
    saved = [(k, v) for k, v in (record.get("base_config") or {}).items() if k in BASE_FIELDS]
    saved += [(k, record[k]) for k in ("hidden_size", "num_hidden_layers") if k in record]
    differs = list(dict.fromkeys(f"{k} {v!r} then, {getattr(config, k, None)!r} now" for k, v in saved
                                 if v != getattr(config, k, None)))
    if differs:
        base = record.get("base_source") or "unknown"
        raise InputError(f"{Path(directory).resolve()}: trained on a base with another config ({'; '.join(differs)}); "
                         f"it computes something else on this one",
                         python=f"load it on the base it was trained on ({base})",
                         shell=f"give --model the base it was trained on ({base})")


def read_adapter_config(directory) -> dict:
    from ..textfiles import read_json

    path = Path(directory) / CONFIG_FILE
    if not path.is_file() or not (Path(directory) / WEIGHTS_FILE).is_file():
        raise InputError(f"{Path(directory).resolve()}: not a saved task module (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    record = read_json(path)
    options = record.get("options") if isinstance(record, dict) else None
    if not isinstance(options, dict) or options.get("kind") not in KINDS or not isinstance(record.get("name"), str):
        raise InputError(f"{path.resolve()}: options.kind must be one of {KINDS} and name a string")
    return record


def saved_tensors(directory) -> tuple[dict, dict]:
    """(the task module's state, the head's state) from a folder ``save_adapter`` wrote."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(directory) / WEIGHTS_FILE))
    return ({k[len("task."):]: v for k, v in tensors.items() if k.startswith("task.")},
            {k[len("head."):]: v for k, v in tensors.items() if k.startswith("head.")})


def load_adapter(model, directory, *, name: str | None = None, activate: bool = True, check_base: bool = True):
    """Add the task module saved in ``directory`` (by ``save_adapter``) under its own name (or ``name``).
    The base must be the one it was trained on (fingerprint; ``check_base=False`` to skip); a task head
    given here gets the saved head's weights when the folder has one of its shape. Nothing is added if
    anything does not fit."""
    directory = Path(directory)
    record = read_adapter_config(directory)
    check_record(directory, PART, record, keys=SEALED)  # adapter.json edited after saving
    encoder = encoder_of(model, GOES_ON)
    check_base_config(directory, record, encoder.config)
    own_pooler = bool(record["options"].get("pooler"))
    # what the module reads of its base; modules saved before counted a masked-LM head and their own pooler's
    # base in: their fingerprint is accepted too
    from ..tools.fingerprint import weights_fingerprint

    if check_base and record.get("base_fingerprint") not in {
            base_fingerprint(encoder, own_pooler=own_pooler), weights_fingerprint(encoder, skip=("task_modules.",))}:
        base = record.get("base_source") or "unknown"
        raise InputError(f"{directory.resolve()}: trained on another base ({base}; the weights' fingerprints differ)",
                         python="load it on that base, or pass check_base=False if this base is the same model "
                                "saved otherwise",
                         shell=f"give --model that base, or pass --skip-base-check if {base} is the same model saved "
                               "otherwise")
    kind = record["options"]["kind"]
    missing = [key for key in SAVED_OPTIONS[kind] if key not in record["options"]]
    if missing:
        raise InputError(f"{directory.resolve() / CONFIG_FILE}: options of a {kind} module need {missing}")
    kwargs = {key: record["options"][key] for key in SAVED_OPTIONS[kind]}  # add_adapter's own argument names
    if kind == "lora":
        kwargs["targets"] = tuple(kwargs["targets"])
    if kind == "prefix":
        kwargs["flat"] = True  # saved flat
    kwargs["pooler"] = bool(record["options"].get("pooler", False))  # a pooler of its own: recorded when it has one
    name = name or record["name"]
    task_state, head_state = saved_tensors(directory)
    head_layer = None
    if head_state and model is not encoder:
        saved_class = (record.get("head") or {}).get("class")
        head_layer = getattr(model, getattr(model, "head_attribute", ""), None)
        if saved_class is not None and saved_class != type(model).__name__:
            raise InputError(f"{directory.resolve()}: its head is a {saved_class}, not a {type(model).__name__}",
                             python="build the head the module was saved with: task_head(base, directory)")
        if head_layer is None:
            raise InputError(f"{directory.resolve()}: its head does not fit this {type(model).__name__} (it has none)",
                             python="build the head the module was saved with: task_head(base, directory)")
        check_fits(directory, head_layer, head_state, f"its head ({saved_class})")
    previous = task_names(model)
    add_adapter(model, name, kind, activate=False, **kwargs)
    container = _container(encoder, create=False)
    try:
        check_fits(directory, container.tasks[name], task_state, f"the {kind} module")
        container.tasks[name].load_state_dict({k: v.to(encoder.device) for k, v in task_state.items()})
    except (InputError, RuntimeError) as error:
        remove_adapter(model, name)
        if isinstance(error, InputError):
            raise
        raise InputError(f"{directory.resolve()}: its weights do not fit this model: {str(error).splitlines()[0]}") from None
    if head_layer is not None:
        with torch.no_grad():
            head_layer.load_state_dict({k: v.to(encoder.device) for k, v in head_state.items()})
    assert task_names(model) == previous + [name]
    if activate:
        container.active = name
    return model


def task_head(base, directory, *, activate: bool = True, name: str | None = None, check_base: bool = True):
    """A task head for the saved task module in ``directory`` built around ``base`` (a minibert
    BertModel, shared, not copied): the head class and labels the folder records, its weights, and the
    task module loaded onto the base. Several heads made this way share one base. ``name``: the module's
    name on the base (default: the one it was saved with); ``check_base``: as ``load_adapter``'s."""
    from ..models import heads

    record = read_adapter_config(directory)
    check_record(directory, PART, record, keys=SEALED)  # adapter.json edited after saving
    info = record.get("head")
    if not info:
        raise InputError(f"{Path(directory).resolve()}: this task module was saved without a head (from an encoder)")
    cls = heads.TASK_CLASSES.get(str(info.get("class")))
    if cls is None:
        raise InputError(f"{Path(directory).resolve()}: head class {info.get('class')!r} is not one of minibert's heads "
                         f"({', '.join(heads.TASK_CLASSES)})")
    if not isinstance(info.get("id2label"), dict):
        raise InputError(f"{Path(directory).resolve() / CONFIG_FILE}: head.id2label must be an object (index -> label)")
    check_base_config(directory, record, encoder_of(base, GOES_ON).config)
    encoder = encoder_of(base, GOES_ON)
    config = copy.deepcopy(encoder.config)
    config.id2label = {int(k): v for k, v in info["id2label"].items()}
    config.problem_type = info.get("problem_type")
    with torch.device("meta"):
        model = cls(config, add_pooler=encoder.pooler is not None)
    model.bert = encoder
    out = model.head_out_features()
    setattr(model, model.head_attribute, nn.Linear(config.hidden_size, out, device=encoder.device, dtype=encoder.dtype))
    model.source = getattr(encoder, "source", None)
    name = name or record["name"]
    if name in task_names(encoder):  # already on this base (another head of the same task): the head alone
        getattr(model, model.head_attribute).load_state_dict(saved_tensors(directory)[1])
    else:
        load_adapter(model, directory, name=name, activate=activate, check_base=check_base)
    model.task_name = name
    return model.eval()
