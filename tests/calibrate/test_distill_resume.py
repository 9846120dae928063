"""Checkpoints and --resume of a distillation run in one process, and the batch split of data parallelism
(the arithmetic that makes N processes compute the one-process step; torchrun itself runs in
test_distill_torchrun.py)."""

from __future__ import annotations

import json
from pathlib import Path

import model_zoo
import pytest
import torch
from torch import nn

from normswap.calibrate.data import ModelInputs
from normswap.calibrate.distill import distill
from normswap.calibrate.distill_checkpoint import CheckpointPlan
from normswap.calibrate.distill_loss import distillation_loss
from normswap.calibrate.parallel import DataParallel
from normswap.errors import BadInputError
from normswap.passes import SwapNorm


def _gpt2_pair():
    teacher, args, kwargs = model_zoo.gpt2()
    student, _ = SwapNorm("dyt")(teacher, args, kwargs)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (4, 12), generator=g) for _ in range(4)]
    return teacher, student, data


def _options(**overrides):
    return {"steps": 6, "lr": 2e-3, "loss": "kl", "temperature": 2.0, **overrides}


def test_resumed_run_is_the_uninterrupted_run(tmp_path):
    teacher, student, data = _gpt2_pair()
    straight, straight_report = distill(teacher, student, data, **_options())

    plan = CheckpointPlan(tmp_path / "ck", every=2)
    # The "killed" run: 4 of the 6 steps, checkpointed after steps 2 and 4 (the older one removed).
    _, first = distill(teacher, student, data, **_options(steps=4), checkpoints=plan)
    assert sorted(p.name for p in plan.directory.iterdir()) == ["step-00000004"]
    assert first.checkpoint == str(plan.directory / "step-00000004")
    record = json.loads((plan.directory / "step-00000004" / "run.json").read_text())
    assert record["step"] == 4 and record["losses"] == first.losses

    resumed, report = distill(
        teacher, student, data, **_options(), checkpoints=CheckpointPlan(plan.directory, every=2, resume=True)
    )
    assert report.resumed_from_step == 4 and report.steps_done == 6
    # Same losses, same weights, bit for bit: nothing in a step is random, batches cycle by step number.
    assert report.losses == straight_report.losses
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # The held-out figures compare the same models as the straight run's.
    assert report.holdout_loss_before == straight_report.holdout_loss_before
    assert report.holdout_loss_after == straight_report.holdout_loss_after
    assert sorted(p.name for p in plan.directory.iterdir()) == ["step-00000006"]


def test_resume_refuses_another_run_with_the_reason(tmp_path):
    teacher, student, data = _gpt2_pair()
    plan = CheckpointPlan(tmp_path / "ck", every=2)
    resume = CheckpointPlan(plan.directory, resume=True)

    with pytest.raises(BadInputError, match="holds no finished checkpoint"):
        distill(teacher, student, data, **_options(), checkpoints=resume)
    distill(teacher, student, data, **_options(steps=2), checkpoints=plan)
    # A folder a killed run left while writing is hidden and ignored.
    (plan.directory / ".step-00000004.normswap-tmp-host-1-abcd").mkdir()

    with pytest.raises(BadInputError, match=r"another run: lr 0\.002 in the checkpoint, 0\.001 now"):
        distill(teacher, student, data, **_options(lr=1e-3), checkpoints=resume)
    other_data = [d.flip(0) for d in data]
    with pytest.raises(BadInputError, match="step 1 trained on another batch than now"):
        distill(teacher, student, other_data, **_options(), checkpoints=resume)
    other_teacher, _, _ = model_zoo.gpt2()
    with torch.no_grad():
        other_teacher.lm_head.weight.mul_(1.01)
    with pytest.raises(BadInputError, match="another run: the original model's weights differ"):
        distill(other_teacher, student, data, **_options(), checkpoints=resume)
    with pytest.raises(BadInputError, match="has done 2 steps, --steps is 2: nothing to continue"):
        distill(teacher, student, data, **_options(steps=2), checkpoints=resume)
    with pytest.raises(BadInputError, match="another run: train 'all' in the checkpoint, 'norms' now"):
        distill(teacher, student, data, **_options(train="norms"), checkpoints=resume)

    # Another model (one more block): its trained parameters differ.
    wider, args, kwargs = model_zoo.gpt2(layers=3)
    wider_student, _ = SwapNorm("dyt")(wider, args, kwargs)
    with pytest.raises(
        BadInputError, match=r"another run: the trained parameters differ \(only in the checkpoint: \[\]"
    ):
        distill(wider, wider_student, data, **_options(), checkpoints=resume)


def test_checkpoint_options_are_checked(tmp_path):
    with pytest.raises(BadInputError, match="--checkpoint-every must be at least 1, got 0"):
        CheckpointPlan(Path("ck"), every=0)
    with pytest.raises(BadInputError, match=r"--checkpoint-dir needs --checkpoint-every K \(or --resume\)"):
        CheckpointPlan(tmp_path / "ck").check()


def test_a_new_run_leaves_another_runs_checkpoints_alone(tmp_path):
    teacher, student, data = _gpt2_pair()
    plan = CheckpointPlan(tmp_path / "ck", every=3)
    distill(teacher, student, data, **_options(steps=3), checkpoints=plan)
    with pytest.raises(
        BadInputError, match="holds checkpoints of an earlier run \\(step-00000003\\): give --resume"
    ):
        distill(
            teacher, student, data, **_options(lr=1e-3), checkpoints=CheckpointPlan(plan.directory, every=2)
        )
    assert sorted(p.name for p in plan.directory.iterdir()) == ["step-00000003"]


def test_steps_may_grow_when_the_data_holds_more_batches(tmp_path):
    """With more data than steps, a longer run reads more batches; the ones the checkpoint trained on are
    the same, so it continues into what the longer uninterrupted run computes."""
    teacher, student, _ = _gpt2_pair()
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 128, (4, 12), generator=g) for _ in range(10)]
    holdout = data[-1]
    straight, straight_report = distill(teacher, student, data, **_options(), holdout=holdout)
    plan = CheckpointPlan(tmp_path / "ck", every=2)
    distill(teacher, student, data, **_options(steps=4), holdout=holdout, checkpoints=plan)
    resumed, report = distill(
        teacher,
        student,
        data,
        **_options(),
        holdout=holdout,
        checkpoints=CheckpointPlan(plan.directory, every=2, resume=True),
    )
    assert report.resumed_from_step == 4 and report.losses == straight_report.losses
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def _parallel(rank: int, world: int) -> DataParallel:
    return DataParallel(rank=rank, world_size=world, device=torch.device("cpu"), mesh=None)


def test_each_process_takes_its_rows_and_their_share():
    ids = torch.arange(7 * 3).reshape(7, 3)
    mask = torch.ones(7, 3)
    position = torch.arange(3)  # not per sample: every process keeps it whole
    batch = ModelInputs((ids,), {"attention_mask": mask, "position_ids": position})
    parts = [_parallel(r, 3).local_rows(batch, "batch 0") for r in range(3)]
    assert [p.num_samples for p, _ in parts] == [3, 2, 2]
    assert [share for _, share in parts] == [3 / 7, 2 / 7, 2 / 7]
    assert torch.equal(torch.cat([p.args[0] for p, _ in parts]), ids)
    assert all(p.kwargs["position_ids"] is position for p, _ in parts)
    assert torch.equal(parts[1][0].kwargs["attention_mask"], mask[3:5])
    with pytest.raises(BadInputError, match="training batch 2 has 2 samples, fewer than the 3 processes"):
        _parallel(0, 3).local_rows(ModelInputs((ids[:2],)), "training batch 2")


@pytest.mark.parametrize("loss", ["mse", "kl"])
def test_weighted_process_losses_give_the_whole_batch_gradient(loss):
    """What FSDP computes with the weights of the split: the average over processes of the gradients of
    ``loss_here * world * rows_here / rows`` is the gradient of the whole batch's loss, and the sum of
    ``loss_here * rows_here / rows`` its value, with rows that do not divide evenly (7 over 3)."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 6)
    x, target = torch.randn(7, 4, 5), torch.randn(7, 4, 6)

    def loss_of(rows: slice) -> torch.Tensor:
        out = [("output", layer(x[rows]))]
        return distillation_loss(out, [("output", target[rows])], loss, temperature=2.0)

    layer.zero_grad()
    whole = loss_of(slice(None))
    whole.backward()
    expected = layer.weight.grad.clone()

    world, total = 3, 0.0
    averaged, unweighted = torch.zeros_like(expected), torch.zeros_like(expected)
    for rank in range(world):
        part, share = _parallel(rank, world).local_rows(ModelInputs((torch.arange(7),)), "batch")
        rows = slice(int(part.args[0][0]), int(part.args[0][-1]) + 1)
        layer.zero_grad()
        here = loss_of(rows)
        (here * share * world).backward()
        averaged += layer.weight.grad / world
        unweighted += layer.weight.grad / (share * world) / world
        total += float(here.detach()) * share
    assert abs(total - float(whole)) < 1e-6 * abs(float(whole))
    torch.testing.assert_close(averaged, expected, rtol=1e-5, atol=1e-7)
    # The plain mean of the processes' gradients is not it: with uneven rows the weights matter.
    assert (unweighted - expected).abs().max() > 1e-3 * expected.abs().max()


class _WritesAMarker:
    """What a hostile checkpoint could hold: unpickling it calls ``open`` (any callable would do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_whose_metadata_names_other_code_is_refused_before_it_runs(tmp_path):
    """DCP reads ``.metadata`` with plain pickle: --resume checks it first, so nothing it names runs."""
    import pickle

    teacher, student, data = _gpt2_pair()
    plan = CheckpointPlan(tmp_path / "ck", every=2)
    distill(teacher, student, data, **_options(steps=2), checkpoints=plan)
    metadata = plan.directory / "step-00000002" / ".metadata"
    marker = tmp_path / "ran"
    metadata.write_bytes(pickle.dumps(_WritesAMarker(str(marker))))
    with pytest.raises(
        BadInputError, match=r"step-00000002/\.metadata is refused: it names (builtins|io)\.open, which"
    ):
        distill(teacher, student, data, **_options(), checkpoints=CheckpointPlan(plan.directory, resume=True))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ("not json", "is not a valid checkpoint record"),
        ('{"format": 1, "step": "two", "losses": [], "run": {}}', "is not a checkpoint record"),
        ('{"format": 1, "step": 2, "losses": [0.1, 0.2], "run": [1]}', "its run is a list, not a record"),
        (
            '{"format": 9, "step": 2, "losses": [0.1, 0.2], "run": {}}',
            "written by another version of normswap",
        ),
    ],
)
def test_a_damaged_run_record_is_refused_with_the_reason(tmp_path, record, reason):
    teacher, student, data = _gpt2_pair()
    plan = CheckpointPlan(tmp_path / "ck", every=2)
    distill(teacher, student, data, **_options(steps=2), checkpoints=plan)
    (plan.directory / "step-00000002" / "run.json").write_text(record)
    with pytest.raises(BadInputError, match=reason):
        distill(teacher, student, data, **_options(), checkpoints=CheckpointPlan(plan.directory, resume=True))
