"""The public ``minibert.BertModel``: the textbook model of ``model.py`` plus one-line conveniences.

``model.py`` is BERT and nothing else. Users also want to write ``model.hooks({...})`` or
``model(**batch, fast=True)``; those conveniences live here, in a subclass that adds no computation of
its own: each method hands the model to the tool that does the work (``minibert.tools``). Everything
below is also reachable as a plain function, e.g. ``hooks.run_with_cache(model, ...)``.
"""

from __future__ import annotations

from ..model import BertModel as TextbookBertModel
from ..tools import accounting, fast, hooks, surgery
from .norms import place_norms


class BertModel(TextbookBertModel):
    """``minibert.model.BertModel`` with the tools as methods. ``from_pretrained``, ``save_pretrained``,
    the forward pass and every parameter are the textbook model's -- unless ``config.norm_placement`` asks
    for one of the ablations of ``models/norms.py`` (pre-LN, DeepNorm), which only this class builds."""

    def __init__(self, config, *, add_pooler: bool = True, add_mlm_head: bool = False):
        super().__init__(config, add_pooler=add_pooler, add_mlm_head=add_mlm_head)
        place_norms(self, config)  # BERT's post-LN: nothing changes

    def forward(self, *args, fast: bool = False, **kwargs):
        """As ``minibert.model.BertModel.forward``; ``fast=True`` runs ``minibert.tools.fast.prepare(self)``
        instead (same numbers on real tokens within 2x the fp32 noise floor, zeros at padding)."""
        if fast:
            return _fast.prepare(self)(*args, **kwargs)
        return super().forward(*args, **kwargs)

    # hook points and interventions: minibert.tools.hooks
    def hook_point_names(self) -> list[str]:
        return hooks.hook_point_names(self)

    def has_hooks(self) -> bool:
        return hooks.has_hooks(self)

    def hooks(self, fns):
        return hooks.hooks(self, fns)

    def run_with_cache(self, *args, names=None, detach=True, **kwargs):
        return hooks.run_with_cache(self, *args, names=names, detach=detach, **kwargs)

    def ablate_heads(self, heads, mode="zero", reference=None):
        return hooks.ablate_heads(self, heads, mode=mode, reference=reference)

    def patch(self, cache, names=None, positions=None):
        return hooks.patch(self, cache, names=names, positions=positions)

    # surgery and accounting: minibert.tools.surgery, minibert.tools.accounting
    def keep_blocks(self, indices) -> "BertModel":
        return surgery.keep_blocks(self, indices)

    def truncate(self, k: int) -> "BertModel":
        return surgery.truncate(self, k)

    def freeze(self, embeddings: bool = True, blocks: int = 0, pooler: bool = False) -> "BertModel":
        return surgery.freeze(self, embeddings=embeddings, blocks=blocks, pooler=pooler)

    def unfreeze(self) -> "BertModel":
        return surgery.unfreeze(self)

    def parameter_counts(self) -> dict:
        return accounting.parameter_counts(self)


_fast = fast  # the module (the forward's ``fast`` argument shadows the name inside it)
