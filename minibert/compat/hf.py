"""Code written for transformers' ``BertModel`` runs on minibert: the calling convention, not a new model.

    from minibert.compat import TransformersBertModel
    model = TransformersBertModel.from_pretrained("weights/all-MiniLM-L6-v2")
    out = model(input_ids, attention_mask=mask, output_hidden_states=True)
    out[0], out[-1], out.last_hidden_state, out.to_tuple(), list(out.keys())    # as transformers' outputs
    model.encoder.layer[:4], model.get_input_embeddings(), model.state_dict()   # transformers' names

``TransformersBertModel`` subclasses the public ``minibert.BertModel``: the same parameters, the same forward pass
(the readable one; the numbers are the textbook model's), the tool methods, and on top of it what
transformers callers write -- ``output_hidden_states``, ``return_dict``, ``inputs_embeds``, ``head_mask``,
``encoder_hidden_states=None``, outputs that index like ``ModelOutput``, transformers' submodule names
(``embeddings.word_embeddings``, ``encoder.layer[i].attention.self.query``, ...), blocks that return a
tensor, and ``state_dict`` / ``load_state_dict`` in transformers' tensor names. ``inputs_embeds`` and ``head_mask``
are hooks at the model's own hook points (``embeddings.word``, ``blocks.i.attn.probs``), so ``model.py``
has no branch for them.

``TRANSFORMERS_SURFACE`` lists which of transformers' BertModel attributes this covers and which not
(docs/reference/transformers-compat.md is made from it and a test holds the two together).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from contextlib import contextmanager

import torch
from torch import nn

from ..errors import InputError
from ..hookpoints import HookPoint, registered
from ..loading import normalise_name, tensor_map
from ..model import BertModel as TextbookBertModel
from ..model import Block, Embeddings, Encoder
from ..models import BertModel
from ..tools.hooks import hooks

OUTPUT_FIELDS = ("last_hidden_state", "pooler_output", "hidden_states", "past_key_values", "attentions",
                 "cross_attentions")


class ModelOutput(OrderedDict):
    """transformers' ``BaseModelOutputWithPoolingAndCrossAttentions`` behaviour: fields that are None are
    absent; ``out.name``, ``out["name"]``, ``out[0]`` / ``out[-1]`` / ``out[1:]`` (over the fields that
    are set, in order), ``to_tuple()``, ``keys()``, ``len(out)``, iteration over the keys."""

    def __init__(self, **fields):
        super().__init__((k, fields[k]) for k in OUTPUT_FIELDS if fields.get(k) is not None)
        for k in OUTPUT_FIELDS:
            object.__setattr__(self, k, fields.get(k))

    def __getitem__(self, key):
        if isinstance(key, str):
            return super().__getitem__(key)
        return self.to_tuple()[key]

    def to_tuple(self) -> tuple:
        return tuple(self.values())


class _Aliases:
    """transformers' attribute names for a minibert module's own children (``aliases``: theirs -> ours),
    for reading and for replacing. The aliases are not registered as modules of their own, so
    ``named_modules()``, ``parameters()`` and ``state_dict()`` see every module once, under minibert's name."""

    aliases: dict[str, str] = {}

    def __getattr__(self, name):
        return super().__getattr__(type(self).aliases.get(name, name))

    def __setattr__(self, name, value):
        super().__setattr__(type(self).aliases.get(name, name), value)

    def __delattr__(self, name):
        super().__delattr__(type(self).aliases.get(name, name))


class _View:
    """An attribute path of transformers that has no module of its own here (``layer.attention.self``):
    its names lead to minibert's modules (``{"query": (block, "attn.query")}``), for reading and
    replacing. A view is never called, so a torch hook belongs on the modules it names."""

    def __init__(view, **names):  # (not `self`: transformers' own path has a part named "self")
        object.__setattr__(view, "_names", names)

    def _place(self, name):
        if name not in self._names:
            raise AttributeError(f"this part of transformers' layout has no {name!r} here; it has "
                                 f"{sorted(self._names)}")
        target = self._names[name]
        if isinstance(target, _View):
            raise AttributeError(f"{name!r} is a view onto several modules; replace the modules it names")
        owner, path = target
        *parents, last = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        return owner, last

    def __getattr__(self, name):
        if isinstance(self._names.get(name), _View):
            return self._names[name]
        owner, last = self._place(name)
        return getattr(owner, last)

    def __setattr__(self, name, value):
        owner, last = self._place(name)
        setattr(owner, last, value)

    def __repr__(self):
        parts = [f"{k}={v!r}" if isinstance(v, _View) else f"{k}={v[1]}" for k, v in self._names.items()]
        return f"_View({', '.join(parts)})"


class TransformersEmbeddings(_Aliases, Embeddings):
    """The embeddings with transformers' names (``word_embeddings``, ``position_embeddings``,
    ``token_type_embeddings``, ``LayerNorm``) and its calling convention: ``embeddings(input_ids)``
    with every other argument optional (positions 0..T-1, segment 0), or ``inputs_embeds=``."""

    aliases = {"word_embeddings": "word", "position_embeddings": "position",
               "token_type_embeddings": "token_type", "LayerNorm": "norm"}

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                past_key_values_length: int = 0, cache_length: int = 0):
        if (input_ids is None) == (inputs_embeds is None):
            raise InputError("embeddings(...): pass exactly one of input_ids and inputs_embeds")
        shape = tuple(input_ids.shape) if input_ids is not None else tuple(inputs_embeds.shape[:-1])
        if len(shape) != 2:
            raise InputError(f"embeddings(...): input of shape {shape}; it must be (batch, tokens)")
        B, T = shape
        device = (input_ids if input_ids is not None else inputs_embeds).device
        start = past_key_values_length or cache_length
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=device)[None].expand(B, T)
        if token_type_ids is None:
            token_type_ids = torch.zeros(B, T, dtype=torch.long, device=device)
        if inputs_embeds is None:
            return super().forward(input_ids, token_type_ids, position_ids)
        placeholder = torch.full((B, T), self.word.padding_idx or 0, dtype=torch.long, device=device)
        with hooks_at(self.hook_word, lambda x, name: inputs_embeds.to(x.dtype)):
            return super().forward(placeholder, token_type_ids, position_ids)


class TransformersLayer(_Aliases, Block):
    """A block that returns its output tensor (as transformers 5's ``BertLayer``; attention maps are
    recorded at ``attn.probs``) and answers transformers' names: ``attention.self.query/key/value``,
    ``attention.output.dense/LayerNorm``, ``intermediate.dense``, ``output.dense/LayerNorm``."""

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        return super().forward(hidden_states, attention_mask)[0]  # (B, T, H)

    @property
    def attention(self) -> _View:
        return _View(self=_View(query=(self, "attn.query"), key=(self, "attn.key"), value=(self, "attn.value"),
                                dropout=(self, "attn.dropout")),
                     output=_View(dense=(self, "attn.output"), LayerNorm=(self, "attn_norm"),
                                  dropout=(self, "dropout")))

    @property
    def intermediate(self) -> _View:
        return _View(dense=(self, "ffn.dense_in"), intermediate_act_fn=(self, "ffn.act"))

    @property
    def output(self) -> _View:
        return _View(dense=(self, "ffn.dense_out"), LayerNorm=(self, "ffn_norm"), dropout=(self, "dropout"))


class LayerNamedEncoder(_Aliases, Encoder):
    """The encoder with its blocks also reachable as ``encoder.layer`` (transformers' name), for reading
    and for replacing: ``encoder.layer = nn.ModuleList(encoder.layer[:4])`` keeps the first 4 blocks.
    Its blocks are ``TransformersLayer``: each call returns the block's output tensor."""

    aliases = {"layer": "blocks"}

    def forward(self, x, mask=None, return_probs=False, num_blocks=None, skip_blocks=(), keep_all=True):
        hidden_states, ran = [x], 0
        for i, block in enumerate(self.blocks[:num_blocks]):
            if i not in skip_blocks:
                x = block(x, mask)  # (B, T, H); block.__call__, so torch hooks on a layer fire
            if not keep_all:
                hidden_states.clear()  # only the latest output is kept
            hidden_states.append(x)
            ran += 1
        return hidden_states, [None] * ran  # maps: recorded by the model's forward


@contextmanager
def hooks_at(point: HookPoint, fn):
    """``fn`` registered at one hook point for the ``with`` block (the embeddings' own inputs_embeds)."""
    with registered([(point, "embeddings.word", fn)]):
        yield


def _name_as_transformers(model) -> None:
    """Give ``model``'s own embeddings, encoder and blocks the classes that add transformers' names (the
    same modules, parameters and numbers; only new names and calling conventions)."""
    model.embeddings.__class__ = TransformersEmbeddings
    model.encoder.__class__ = LayerNamedEncoder
    for block in model.encoder.blocks:
        block.__class__ = TransformersLayer


#: transformers' BertModel.forward arguments for a decoder, which an encoder takes only as None / False
DECODER_ARGUMENTS = ("encoder_hidden_states", "encoder_attention_mask", "past_key_values", "use_cache")


class TransformersBertModel(BertModel):
    """minibert's BertModel answering transformers' BertModel calls (see the module docstring): the public
    model (its tool methods, ``minibert.tools`` on it) with transformers' names and outputs on top."""

    main_input_name = "input_ids"
    base_model_prefix = "bert"

    #: from_pretrained keyword arguments of transformers that set how outputs look (stored on the config)
    OUTPUT_OPTIONS = ("output_attentions", "output_hidden_states", "return_dict")

    def __init__(self, config, *, add_pooler: bool = True, add_mlm_head: bool = False):
        super().__init__(config, add_pooler=add_pooler, add_mlm_head=add_mlm_head)
        _name_as_transformers(self)

    @classmethod
    def from_pretrained(cls, source, *, revision=None, dtype=None, device=None, mlm_head=None, torch_dtype=None,
                        attn_implementation=None, **options):
        """As ``minibert.BertModel.from_pretrained``, plus transformers' output options
        (``output_attentions=True``, as bertviz passes; ``output_hidden_states``, ``return_dict``), set on
        the config as transformers does, ``torch_dtype=`` (its old name for dtype) and
        ``attn_implementation`` (``"eager"`` or ``"sdpa"``: both give the same numbers here)."""
        unknown = sorted(set(options) - set(cls.OUTPUT_OPTIONS))
        if unknown:
            raise InputError(f"from_pretrained: unsupported argument(s) {', '.join(unknown)}; transformers' "
                             f"options understood here: {', '.join(cls.OUTPUT_OPTIONS)}, torch_dtype, "
                             "attn_implementation")
        if attn_implementation not in (None, "eager", "sdpa"):
            raise InputError(f"attn_implementation={attn_implementation!r}: use 'eager' or 'sdpa' (the same "
                             "numbers here: the explicit formula runs whenever maps are asked for)")
        if torch_dtype is not None and dtype is not None:
            raise InputError("pass dtype= or its old name torch_dtype=, not both")
        model = super().from_pretrained(source, revision=revision, dtype=dtype if torch_dtype is None else torch_dtype,
                                        device=device, mlm_head=mlm_head)
        for name, value in options.items():
            setattr(model.config, name, bool(value))
        return model

    @classmethod
    def from_model(cls, model: TextbookBertModel) -> "TransformersBertModel":
        """``model`` behind transformers' calling convention: a new model that shares ``model``'s weights
        (the same Parameter objects: training one trains the other) in modules of its own. ``model`` itself
        is left as it was: its class, its modules, its config."""
        if not isinstance(model, TextbookBertModel):
            raise TypeError(f"from_model takes a minibert BertModel, got {type(model).__name__}")
        shared = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
        new = copy.deepcopy(model, shared)  # new modules around the same parameters
        new.__class__ = cls
        new.config = copy.deepcopy(model.config)
        _name_as_transformers(new)
        new.source = getattr(model, "source", "model")
        return new

    # ---------------------------------------------------------------------------------- forward
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, head_mask=None,
                inputs_embeds=None, *, output_attentions=None, output_hidden_states=None, return_dict=None,
                **decoder_only):
        """transformers' BertModel.forward. Returns a ``ModelOutput`` (or, with ``return_dict=False``, its
        tuple). ``hidden_states`` is None unless ``output_hidden_states`` (argument, or the attribute /
        config field of that name) asks for it. ``head_mask`` (num_heads,) or (num_layers, num_heads)
        multiplies each head's attention probabilities (transformers 4's definition; 5 dropped it).
        transformers' decoder arguments (``encoder_hidden_states``, ``encoder_attention_mask``,
        ``past_key_values``, ``use_cache``) are taken by name and must be None or False: BERT here is an
        encoder only."""
        for name in ("fast", "num_blocks", "skip_blocks"):
            if name in decoder_only:
                raise InputError(f"{name}= is minibert's own forward argument; call minibert.BertModel for it")
        unknown = sorted(set(decoder_only) - set(DECODER_ARGUMENTS))
        if unknown:
            raise InputError(f"unsupported argument(s) {', '.join(unknown)} for transformers' BertModel.forward")
        if any(decoder_only.get(name) is not None for name in DECODER_ARGUMENTS[:3]):
            raise InputError("encoder_hidden_states / encoder_attention_mask / past_key_values: BERT here is an "
                             "encoder only (no cross-attention, no cache); pass None")
        if decoder_only.get("use_cache"):
            raise InputError("use_cache=True: an encoder has no key/value cache")
        if (input_ids is None) == (inputs_embeds is None):
            raise InputError("pass exactly one of input_ids and inputs_embeds")
        output_attentions = bool(output_attentions if output_attentions is not None
                                 else getattr(self.config, "output_attentions", False))
        output_hidden_states = bool(output_hidden_states if output_hidden_states is not None
                                    else getattr(self, "output_hidden_states", False)
                                    or getattr(self.config, "output_hidden_states", False))
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        fns: dict[str, list] = {}
        if inputs_embeds is not None:
            input_ids, replace = self._embeds_hook(inputs_embeds)
            fns["embeddings.word"] = [replace]
        if head_mask is not None:
            for name, fn in self._head_mask_hooks(head_mask).items():
                fns.setdefault(name, []).append(fn)
        maps = {}
        if output_attentions:  # recorded where they are made, after any head mask (as transformers does)
            for i in range(len(self.encoder.blocks)):
                fns.setdefault(f"blocks.{i}.attn.probs", []).append(lambda x, name: maps.__setitem__(name, x))
        with hooks(self, fns):
            out = super().forward(input_ids, attention_mask, token_type_ids, position_ids,  # the readable path
                                  output_hidden_states=output_hidden_states)
        result = ModelOutput(last_hidden_state=out.last_hidden_state, pooler_output=out.pooler_output,
                             hidden_states=out.hidden_states if output_hidden_states else None,
                             attentions=tuple(maps[f"blocks.{i}.attn.probs"] for i in range(len(maps)))
                             if output_attentions else None)
        return result if return_dict else result.to_tuple()

    def _embeds_hook(self, inputs_embeds):
        H = self.config.hidden_size
        if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != H:
            raise InputError(f"inputs_embeds must be a (batch, tokens, {H}) tensor, got "
                             f"{tuple(getattr(inputs_embeds, 'shape', ())) or type(inputs_embeds).__name__}")
        B, T, _ = inputs_embeds.shape
        placeholder = torch.full((B, T), self.config.pad_token_id, dtype=torch.long, device=inputs_embeds.device)

        def replace_word_embeddings(x, name):  # the word embedding lookup's result becomes inputs_embeds
            return inputs_embeds.to(x.dtype)
        return placeholder, replace_word_embeddings

    def _head_mask_hooks(self, head_mask):
        N, h = self.config.num_hidden_layers, self.config.num_attention_heads
        mask = torch.as_tensor(head_mask, dtype=self.dtype, device=self.device)
        if mask.dim() == 1:
            mask = mask.expand(N, -1)
        if tuple(mask.shape) != (N, h):
            raise InputError(f"head_mask has shape {tuple(torch.as_tensor(head_mask).shape)}; it must be "
                             f"(num_heads,) = ({h},) or (num_layers, num_heads) = ({N}, {h})")

        def scale(row):
            return lambda probs, name: probs * row[None, :, None, None]  # (B, h, T, T)
        return {f"blocks.{i}.attn.probs": scale(mask[i]) for i in range(len(self.encoder.blocks))
                if not torch.all(mask[i] == 1)}

    # ------------------------------------------------------------------------ transformers' names
    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word = value

    def get_output_embeddings(self):
        return None  # as transformers' BertModel: no language-model head on the encoder

    def num_parameters(self, only_trainable: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not only_trainable)

    def _name_rows(self):
        config = dataclasses.replace(self.config, num_hidden_layers=len(self.encoder.blocks))  # after encoder.layer cuts
        return tensor_map(config, with_pooler=self.pooler is not None,
                          with_mlm_head=getattr(self, "mlm_head", None) is not None)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """transformers' names (``encoder.layer.0.attention.self.query.weight``, ...), in checkpoint order.
        (``minibert.BertModel.state_dict(model)`` gives minibert's own names.)"""
        ours = super().state_dict(keep_vars=keep_vars)
        out = OrderedDict() if destination is None else destination
        for theirs, name, _ in self._name_rows():
            out[prefix + theirs] = ours.pop(name)
        assert not ours, f"tensors with no transformers name: {sorted(ours)}"
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Accepts transformers' names (also ``bert.``-prefixed and the old gamma/beta spellings) or
        minibert's own; shapes are checked against the config for every tensor."""
        rows = self._name_rows()
        to_ours = {theirs: ours for theirs, ours, _ in rows}
        shapes = {ours: shape for _, ours, shape in rows}
        converted, ignored = {}, []
        for key, tensor in state_dict.items():
            name = key if key in shapes else to_ours.get(normalise_name(key))
            if name is None:
                if key.endswith(("position_ids", "token_type_ids")):
                    continue  # transformers' stored buffers: recomputed here
                ignored.append(key)
                continue
            if tuple(tensor.shape) != shapes[name]:
                raise InputError(f"{key}: shape {tuple(tensor.shape)}, this model needs {shapes[name]}")
            converted[name] = tensor
        if strict and ignored:
            raise InputError(f"unexpected tensors for this model: {', '.join(ignored[:8])}"
                             + (f" (+{len(ignored) - 8} more)" if len(ignored) > 8 else ""))
        return super().load_state_dict(converted, strict=strict, assign=assign)


#: transformers' BertModel attributes (beyond torch.nn.Module's) and BertTokenizerFast's that callers use:
#: (name, covered, note). docs/reference/transformers-compat.md is generated from it; tests check each "yes".
TRANSFORMERS_SURFACE = {
    "BertModel": [
        ("forward(input_ids, attention_mask, token_type_ids, position_ids)", True, "the readable path"),
        ("forward(output_hidden_states=, output_attentions=, return_dict=)", True, "hidden_states None unless asked"),
        ("forward(inputs_embeds=)", True, "hook at embeddings.word"),
        ("forward(head_mask=)", True, "transformers 4's definition; transformers 5 removed it"),
        ("forward(encoder_hidden_states=None, encoder_attention_mask=None, past_key_values=None)", True,
         "accepted as None; anything else is refused (no cross-attention)"),
        ("outputs: out[0], out[-1], slices, to_tuple(), keys(), len(out), attributes", True,
         "cross_attentions stays None (transformers 5 gives () with output_attentions; 4 gave None)"),
        ("encoder.layer (read and replace)", True, "the same ModuleList as encoder.blocks"),
        ("embeddings, encoder, pooler, config", True, "config fields as config.json's"),
        ("get_input_embeddings / set_input_embeddings", True, ""),
        ("get_output_embeddings", True, "None, as transformers' BertModel"),
        ("state_dict / load_state_dict in transformers' names", True, "checked shapes; buffers ignored"),
        ("from_pretrained(dir | hub id) / save_pretrained(dir)", True, "safetensors only"),
        ("device, dtype, num_parameters(), main_input_name, base_model_prefix", True, ""),
        ("embeddings.word_embeddings / position_embeddings / token_type_embeddings / LayerNorm", True,
         "the same modules as embeddings.word / position / token_type / norm (read and replace)"),
        ("encoder.layer[i].attention.self.query / key / value, attention.output.dense / LayerNorm, "
         "intermediate.dense, output.dense / LayerNorm", True,
         "the block's own modules (attn.query, ..., ffn.dense_out, ffn_norm): read and replace"),
        ("encoder.layer[i](hidden_states, mask) returns the output tensor", True,
         "as transformers 5's BertLayer (captum's LayerConductance on a layer)"),
        ("embeddings(input_ids) / embeddings(inputs_embeds=...)", True, "positions 0..T-1 and segment 0 by default"),
        ("from_pretrained(..., output_attentions=, output_hidden_states=, return_dict=, torch_dtype=, "
         "attn_implementation=)", True, "output options stored on the config, as transformers does (bertviz)"),
        ("torch forward hooks on any submodule (register_forward_hook)", True, "they fire on the readable path"),
        ("attention.self, attention.output, intermediate, output as modules of their own", False,
         "views onto the block's modules: named_modules lists minibert's names; hook the modules they name"),
        ("resize_token_embeddings, tie_weights, gradient_checkpointing_enable", False, "not implemented"),
        ("generate, push_to_hub, adapters (add_adapter ...)", False,
         "out of scope (encoder only, offline; LoRA lives in minibert.training.lora)"),
    ],
    "BertTokenizerFast": [
        ("__call__(text, text_pair, padding, truncation, max_length, return_tensors, return_offsets_mapping)",
         True, "same ids and offsets"),
        ("encode, encode_plus, batch_encode_plus", True, ""),
        ("decode, batch_decode, tokenize, convert_tokens_to_ids, convert_ids_to_tokens, convert_tokens_to_string",
         True, ""),
        ("cls/sep/pad/unk/mask_token and *_token_id, all_special_tokens, all_special_ids", True, ""),
        ("build_inputs_with_special_tokens, create_token_type_ids_from_sequences, get_special_tokens_mask",
         True, ""),
        ("model_max_length, max_len_single_sentence, max_len_sentences_pair, num_special_tokens_to_add", True, ""),
        ("__len__, vocab_size, get_vocab, model_input_names, padding_side, pad_token_type_id", True, ""),
        ("save_pretrained", True, "vocab.txt, tokenizer_config.json, special_tokens_map.json"),
        ("is_split_into_words=, return_overflowing_tokens=, stride=, word_ids()", False, "not implemented"),
        ("padding_side='left', add_tokens, backend_tokenizer, chat templates", False, "not implemented"),
    ],
}


def surface_markdown() -> str:
    """The table of docs/reference/transformers-compat.md."""
    lines = []
    for cls, rows in TRANSFORMERS_SURFACE.items():
        lines += [f"### {cls}", "", "| attribute or call | covered | note |", "|---|---|---|"]
        lines += [f"| `{name}` | {'yes' if ok else 'no'} | {note} |" for name, ok, note in rows]
        lines.append("")
    return "\n".join(lines)
