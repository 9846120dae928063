"""The in-place all-gather and reduce-scatter installed on FSDP2 units under gloo give what gloo's own
collectives give (SUM and AVG, three processes so that the order of a sum could matter)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from normswap.calibrate.gloo_comms import BroadcastAllGather, ReduceToOwnerScatter

WORLD = 3


def _worker(rank: int, store: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        group = dist.group.WORLD
        generator = torch.Generator().manual_seed(rank)
        shard = torch.randn(1000, generator=generator)
        expected = torch.empty(WORLD * 1000)
        dist.all_gather_into_tensor(expected, shard)
        # FSDP2 hands its own slice of the output as the input
        gathered = torch.full((WORLD * 1000,), float("nan"))
        gathered.chunk(WORLD)[rank].copy_(shard)
        BroadcastAllGather()(gathered, gathered.chunk(WORLD)[rank], group)
        found = {"gather": torch.equal(gathered, expected)}
        for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
            full = torch.randn(WORLD * 500, generator=generator)
            reference = full.clone()
            dist.all_reduce(reference)
            if op == dist.ReduceOp.AVG:
                reference /= WORLD
            out = torch.empty(500)
            ReduceToOwnerScatter()(out, full.clone(), group, op)
            found[name] = (out - reference.chunk(WORLD)[rank]).abs().max().item()
        torch.save(found, Path(results) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_in_place_collectives_give_what_gloo_gives(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        found = torch.load(tmp_path / f"{rank}.pt")
        assert found["gather"], rank
        assert found["sum"] <= 1e-6 and found["avg"] <= 1e-6, found
