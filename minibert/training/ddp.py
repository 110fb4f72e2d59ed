"""Data-parallel training: ``torchrun`` starts N processes, each trains a replica on its share of every batch.

    torchrun --standalone --nproc_per_node 2 -m minibert finetune --train train.csv --eval test.csv --model M --out DIR --batch-size 16

is ``minibert finetune ... --batch-size 32`` in one process, split over two: every process builds the
same global batch of ``batch_size x N`` rows (same seed), keeps its own contiguous slice of the rows, and
PyTorch's DistributedDataParallel averages the gradients (gloo on CPU, NCCL on CUDA) before each
optimiser step, so every replica takes the same step -- the step one process takes on the whole batch
(``tests/training/test_ddp.py`` holds the weights equal to 1e-5). Each replica's loss is rescaled by its share of
the batch's examples (tagging: of its labelled tokens), so uneven slices average exactly too.

Dropout draws differ between one process and N (each draws for its own rows), so the two runs agree
exactly with dropout off and in distribution with it on. Process 0 evaluates, writes the checkpoint and
prints; the others only train. Gradual unfreezing changes what trains mid-run, which DDP does not allow:
it is refused. On several machines: ``torchrun --nnodes 2 --node_rank R --master_addr HOST ...``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..errors import InputError


def world_size() -> int:
    """Processes in this torchrun job (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank in the torchrun job, from the environment torchrun sets (0 outside torchrun):
    known before the job is joined, so the first process alone checks and takes the output folder."""
    return int(os.environ.get("RANK", "0"))


def is_distributed() -> bool:
    return world_size() > 1


def init(backend: str | None = None) -> tuple[int, int]:
    """Join the torchrun job (once): (rank, world size). gloo on CPU, nccl when CUDA is there."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    return dist.get_rank(), dist.get_world_size()


def finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _share(batch: dict, rank: int, world: int) -> tuple[dict, float]:
    """This rank's contiguous slice of a global batch, and the factor that turns its mean loss into its
    share of the global mean: (its examples / all examples) x world."""
    rows = len(batch["input_ids"])
    bounds = [rows * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    local = {k: v[lo:hi] if isinstance(v, torch.Tensor) and len(v) == rows else v for k, v in batch.items()}
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() > 1:  # token labels: the loss is a mean over labelled tokens
        total, mine = int((labels != -100).sum()), int((labels[lo:hi] != -100).sum())
    else:
        total, mine = rows, hi - lo
    return local, (mine / total * world) if total else 0.0


def wrap(model: nn.Module, *, find_unused_parameters: bool) -> nn.Module:
    """``model`` in DistributedDataParallel, the one wrapping every training run uses under torchrun
    (``loop.train`` runs the loss through it). ``find_unused_parameters``: a step may leave some parameters
    without a gradient (LayerDrop skips blocks, a tagger never uses the pooler, masked-LM needs no NSP head)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, find_unused_parameters=find_unused_parameters)


def sliced(loss, rank: int, world: int):
    """``loss(model, batch)`` on this rank's slice of a global batch, rescaled to its share of the global
    mean (``_share``), so the averaged gradients are those of the whole batch."""
    def local_loss(model: nn.Module, batch: dict):
        local, factor = _share(batch, rank, world)
        return loss(model, local) * factor
    return local_loss


def check_recipe(recipe: str) -> None:
    """Refuse what DDP cannot do: the gradual recipe changes what trains mid-run."""
    if recipe == "gradual":
        raise InputError("the gradual recipe unfreezes blocks during training, which DistributedDataParallel "
                         "does not allow; run it in one process")
