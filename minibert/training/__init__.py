"""Training: the loop (``loop``: fit, AdamW groups, schedules, the epoch reporter), batches of labelled
data (``data``) and their readers (``datasets``), metrics (``metrics``), recipes (``recipes``: gradual
unfreezing, the ScalarMix head), LoRA (``lora``), distillation (``distill``: students, losses, distillers),
adaptive depth (``depth``: LayerDrop, early exit), torchrun data parallelism (``ddp``), pre-training
(``pretrain``, ``pretrain_data``) and task modules (``adapters``). Above analysis: a recipe may use a
ScalarMix; nothing below imports it, compat never does and it never imports compat. The runs from files
that the CLI starts are one layer up, in ``minibert.runs``."""
