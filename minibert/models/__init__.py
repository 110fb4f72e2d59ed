"""The models a user meets: ``BertModel`` (the textbook model of ``model.py`` with the tools as methods,
``bert.py``), the task heads built on it (``heads.py``: sequence and token classification, extractive
QA) and the pre-training heads (``pretraining.py``: masked LM, next sentence). Every model the library makes -- loaded, cut, distilled, fine-tuned, wrapped for transformers'
calling convention -- is one of these, so ``model.hooks(...)``, ``model.run_with_cache(...)`` and
``model(**batch, fast=True)`` work on whatever a user gets. Above ``tools`` (the methods call them),
below ``analysis``, ``training`` and ``compat`` (which build these models)."""

from __future__ import annotations

from ..lazy import lazy_exports

_LAZY = {"BertModel": ".bert", "BertForSequenceClassification": ".heads", "BertForTokenClassification": ".heads",
         "BertForQuestionAnswering": ".heads", "ClassifierOutput": ".heads", "SpanOutput": ".heads",
         "TASK_CLASSES": ".heads", "BertForMaskedLM": ".pretraining", "BertForPreTraining": ".pretraining",
         "PreTrainingOutput": ".pretraining"}
__all__ = sorted(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY, globals())
