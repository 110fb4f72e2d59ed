"""Training: the loop (``loop``: fit, AdamW groups, schedules, the epoch reporter), batches of labelled
data (``data``) and their readers (``datasets``), metrics (``metrics``), recipes (``recipes``: gradual
unfreezing, the ScalarMix head), LoRA (``lora``), distillation (``distill``: students, losses, distillers),
adaptive depth (``depth``: LayerDrop, early exit), torchrun data parallelism (``ddp``), and the from-files
pipelines behind the CLI (``pipelines``). Above analysis: a recipe may use a ScalarMix; nothing below
imports it, and compat never does."""
