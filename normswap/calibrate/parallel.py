"""Data-parallel distillation on PyTorch's own engine: torchrun's processes, FSDP2 sharding, DCP.

Why this shape: a user who swaps the norms of a 7B-70B model cannot hold teacher and student whole on one
device, and already runs training with torchrun and FSDP2. So normswap adds no launcher and no
communication of its own: it reads what torchrun puts in the environment, joins the process group
(NCCL on GPUs, gloo on the CPU), builds a one-dimensional device mesh over every process, and shards the
student with ``fully_shard`` per block (the largest ModuleList of one class: transformer layers, ResNet
stages are not one class so such a model is sharded at its root only) and then at the root. The
optimizer is created after sharding, over the sharded parameters (FSDP2 replaces each parameter).

Each training batch of the data is the *global* batch: every process reads the same data and takes its
slice of the rows (``tensor_split``: the first ``n % world`` processes take one row more). Its loss is
weighted by ``world * rows_here / rows`` so that FSDP's gradient average over processes equals the
gradient of the one-process loss on the whole batch, even when the rows do not divide evenly; the loss
reported is the sum of ``loss_here * rows_here / rows`` over processes, the one-process figure.

The teacher runs under no_grad. It is sharded too (``fully_shard`` per block, parameters gathered per
block for its forward and freed after) when its parameters exceed :data:`TEACHER_SHARD_BYTES` per
process, or when asked; otherwise each process holds a copy, which costs no communication.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.calibrate.data import ModelInputs
from normswap.errors import BadInputError

# Above this many bytes of teacher parameters, the teacher is sharded like the student.
TEACHER_SHARD_BYTES = 1 << 30

# What torchrun sets in every worker's environment.
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# A collective that waits this long for a peer has lost it: torchrun stops the group well before.
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def launched_by_torchrun() -> bool:
    """True when this process is one of several that torchrun started (WORLD_SIZE > 1)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


@dataclass
class DataParallel:
    """This process's place in a torchrun job: ``rank`` of ``world_size``, on ``device``."""

    rank: int
    world_size: int
    device: torch.device
    mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    replicated: list[nn.Parameter] = field(default_factory=list)  # trained, left whole by shard()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls) -> DataParallel:
        """Join the process group torchrun describes in the environment (NCCL with CUDA, else gloo)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        missing = [name for name in _TORCHRUN_VARIABLES if name not in os.environ]
        if missing:
            raise BadInputError(
                f"WORLD_SIZE is set but {', '.join(missing)} is not: start the processes with torchrun "
                "(torchrun --nproc-per-node N --no-python normswap distill ...)"
            )
        local_rank = int(os.environ["LOCAL_RANK"])
        if torch.cuda.is_available():
            if local_rank >= torch.cuda.device_count():
                raise BadInputError(
                    f"process {local_rank} on this node has no GPU: {torch.cuda.device_count()} visible, "
                    "so start at most that many processes per node"
                )
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            device = torch.device("cpu")
            backend = "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=_COLLECTIVE_TIMEOUT)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, mesh=mesh)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # -- data ---------------------------------------------------------------------------------------

    def local_rows(self, batch: ModelInputs, what: str) -> tuple[ModelInputs, float]:
        """This process's rows of a global batch and their share of it (rows here / rows).

        Every tensor whose first dim is the batch's row count is split; others are handed whole to every
        process. A tensor that is not per sample but happens to be as long as the batch (a ``cache_position``
        of 8 positions in a batch of 8) cannot be told apart and is split too: give such inputs in another
        length, or as settings of the model."""
        rows = batch.num_samples
        if rows < self.world_size:
            raise BadInputError(
                f"{what} has {rows} samples, fewer than the {self.world_size} processes: give batches of at "
                f"least {self.world_size} (--batch-size)"
            )

        def mine(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == rows:
                return value.tensor_split(self.world_size)[self.rank]
            return value

        local = ModelInputs(tuple(mine(a) for a in batch.args), {k: mine(v) for k, v in batch.kwargs.items()})
        return local, local.num_samples / rows

    def sum(self, value: float) -> float:
        """The sum of ``value`` over every process (fp64)."""
        import torch.distributed as dist

        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return float(total.item())

    def from_main(self, value: Any) -> Any:
        """Process 0's ``value`` (any picklable object) on every process."""
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every process's ``value`` (any picklable object), in rank order, on every process."""
        import torch.distributed as dist

        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    # -- models -------------------------------------------------------------------------------------

    def shard(self, model: nn.Module, trained: bool = True, mixed_precision: bool = False) -> str:
        """``fully_shard`` the model's blocks, then its root; returns what was sharded, for the report.

        FSDP2 cannot shard a 0-d parameter (DyT's and Derf's alpha): those stay whole on every process,
        and :meth:`average_replicated_gradients` does for them what FSDP's reduce-scatter does for the rest.
        ``mixed_precision``: FSDP2's ``MixedPrecisionPolicy``: the gathered parameters and the compute in
        bfloat16, the gradients reduced and the parameters and optimizer state kept in float32, the
        model's outputs cast back to float32 (the loss compares them with the teacher's).
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from normswap.verify.blockwise import block_list, find_blocks

        try:
            path, count = find_blocks(model)
        except BadInputError:
            path, count = "", 0
        # A list in the model's order: every process must all-reduce the same parameter at the same time.
        scalars = [p for p in model.parameters() if p.ndim == 0]
        for p in scalars:
            if not p.is_meta:  # a model built on the meta device gets its memory later (to_empty)
                p.data = p.data.to(self.device)
        if trained:
            self.replicated.extend(p for p in scalars if p.requires_grad)
        policy: dict[str, Any] = {}
        if mixed_precision:
            half, full = torch.bfloat16, torch.float32
            policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=half, reduce_dtype=full)}
        large = _large_outside(model, path) if count else []
        if count:
            for block in block_list(model.get_submodule(path)):
                fully_shard(block, mesh=self.mesh, ignored_params=set(scalars), **policy)
            # the embeddings and the head, each its own unit: gathered for their own forward and backward
            # only, not held whole with the root for the whole step (they are a quarter of a 1B model)
            for _, module in large:
                fully_shard(module, mesh=self.mesh, ignored_params=set(scalars), **policy)
        # FSDP2 keeps the root's parameters gathered after forward, for the backward that follows; a
        # model that only runs forward (the teacher) would hold its largest tensors, the embeddings and
        # the head, whole for the whole run.
        forward_only = {} if trained else {"reshard_after_forward": True}
        if mixed_precision:
            policy = {
                "mp_policy": MixedPrecisionPolicy(param_dtype=half, reduce_dtype=full, output_dtype=full)
            }
        fully_shard(model, mesh=self.mesh, ignored_params=set(scalars), **forward_only, **policy)
        if self.device.type == "cpu":  # gloo: its all-gather and reduce-scatter stage a whole extra copy
            from torch.distributed.fsdp import FSDPModule

            from normswap.calibrate.gloo_comms import use_in_place_collectives

            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    use_in_place_collectives(unit)
        what = f"{count} blocks ({path}) and the root" if count else "the root only (no list of blocks)"
        what += f", {', '.join(name for name, _ in large)} on their own" if large else ""
        what += f", {len(scalars)} scalar parameters whole on every process" if scalars else ""
        return what + (", bfloat16 compute with float32 gradient reduction" if mixed_precision else "")

    def average_replicated_gradients(self) -> None:
        """Average the gradients of the parameters left whole over the processes, as FSDP does its own."""
        import torch.distributed as dist

        for p in self.replicated:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world_size)

    def place(self, model: nn.Module, shard: bool) -> str:
        """Put a model on this process's device: sharded (FSDP2) or a whole copy."""
        if shard:
            return self.shard(model, trained=False)
        model.to(self.device)
        return "a whole copy on every process"


def _large_outside(model: nn.Module, blocks: str) -> list[tuple[str, nn.Module]]:
    """The modules outside the list of blocks at ``blocks`` that hold at least half a block's parameters
    themselves (token embeddings, an LM head), and share none with another module (a tied head and
    embedding stay with the root: one parameter cannot be in two FSDP units)."""
    from normswap.verify.blockwise import block_list

    listed = model.get_submodule(blocks)
    per_block = sum(p.numel() for p in listed.parameters()) / max(1, len(block_list(listed)))
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    found = []
    for name, module in model.named_modules():
        if not name or name == blocks or name.startswith(blocks + ".") or blocks.startswith(name + "."):
            continue
        own = list(module.parameters(recurse=False))
        if (
            own
            and not list(module.children())
            and all(owners[id(p)] == 1 for p in own)
            and (sum(p.numel() for p in own) >= per_block / 2)
        ):
            found.append((name, module))
    return found


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def full_state_dict(model: nn.Module, parallel: DataParallel | None) -> dict[str, torch.Tensor]:
    """The model's whole state dict on the CPU: gathered to process 0 (empty elsewhere) when sharded."""
    if parallel is None:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
