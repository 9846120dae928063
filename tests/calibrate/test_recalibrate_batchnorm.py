"""BatchNorm recalibration: statistics equal to independently computed averages, modes and momentum
restored (also after a failure), dropout off, skips with reasons, the before/after report."""

from __future__ import annotations

import copy
import math

import model_zoo
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normswap.calibrate import ModelInputs, find_batchnorms, recalibrate_batchnorm
from normswap.errors import BadInputError
from normswap.load import load_model

# Statistics in float32 against float64 references: a few ulps of the values' scale.
STAT_TOL = {"rtol": 1e-5, "atol": 1e-5}


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    return model_zoo.randomize_norms(model, seed=seed).eval()


def _batches(sizes: list[int], shape: tuple[int, ...], seed: int = 0, scale: float = 2.0, shift: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((n, *shape), generator=g) * scale + shift for n in sizes]


def _unbiased_stats(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (dim 1) mean and unbiased variance over every other dim, in float64."""
    y = y.double().transpose(0, 1).flatten(1)
    return y.mean(1), y.var(1, unbiased=True)


def _bn_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def _flags(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(8)
        self.conv1 = nn.Conv2d(8, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn1(self.conv1(F.relu(self.bn0(self.conv0(x))))).mean((2, 3))


def test_statistics_equal_exact_batch_averages_after_an_upstream_change():
    torch.manual_seed(0)
    model = _randomize(ConvNet())
    with torch.no_grad():
        model.conv0.weight.mul_(3.0)  # the change upstream that makes the stored statistics stale
    batches = _batches([8, 8, 8, 8], (3, 10, 10))
    holdout = _batches([4], (3, 10, 10), seed=1)[0]

    new, report = recalibrate_batchnorm(model, batches, holdout=holdout)

    # Independent reference in float64: BN in training mode normalizes each batch with its own biased
    # statistics; running stats average the per-batch mean and unbiased var over batches.
    m = copy.deepcopy(model).double()
    means0, vars0, means1, vars1 = [], [], [], []
    with torch.no_grad():
        for x in batches:
            y0 = m.conv0(x.double())
            mu0, var0 = _unbiased_stats(y0)
            means0.append(mu0)
            vars0.append(var0)
            z = F.batch_norm(y0, None, None, m.bn0.weight, m.bn0.bias, training=True, eps=m.bn0.eps)
            mu1, var1 = _unbiased_stats(m.conv1(F.relu(z)))
            means1.append(mu1)
            vars1.append(var1)
        population_mean0 = _unbiased_stats(torch.cat([m.conv0(x.double()) for x in batches]))[0]
    torch.testing.assert_close(new.bn0.running_mean.double(), torch.stack(means0).mean(0), **STAT_TOL)
    torch.testing.assert_close(new.bn0.running_var.double(), torch.stack(vars0).mean(0), **STAT_TOL)
    torch.testing.assert_close(new.bn1.running_mean.double(), torch.stack(means1).mean(0), **STAT_TOL)
    torch.testing.assert_close(new.bn1.running_var.double(), torch.stack(vars1).mean(0), **STAT_TOL)
    # equal batch sizes: the average of batch means is the mean over every sample
    torch.testing.assert_close(new.bn0.running_mean.double(), population_mean0, **STAT_TOL)

    assert report.batches == 4 and report.samples == 32 and report.batch_sizes == [8, 8, 8, 8]
    assert [layer.calls for layer in report.layers] == [4, 4]
    assert int(new.bn0.num_batches_tracked) == 4
    assert report.holdout_source == "separate held-out batch" and report.holdout_samples == 4
    assert report.kind.value == "data-driven" and report.ok and report.skips == [] and report.notes == []
    # the input model is untouched without inplace=True
    assert not torch.equal(model.bn0.running_mean, new.bn0.running_mean)


def test_uneven_batches_weigh_equally_as_documented():
    bn = nn.BatchNorm1d(3).eval()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, 3, generator=g) + offset for n, offset in ((2, -3.0), (5, 0.0), (9, 4.0))]

    new, report = recalibrate_batchnorm(nn.Sequential(bn), batches, holdout=batches[0])

    stats = [_unbiased_stats(x) for x in batches]
    per_batch_mean = torch.stack([s[0] for s in stats]).mean(0)
    per_batch_var = torch.stack([s[1] for s in stats]).mean(0)
    torch.testing.assert_close(new[0].running_mean.double(), per_batch_mean, **STAT_TOL)
    torch.testing.assert_close(new[0].running_var.double(), per_batch_var, **STAT_TOL)
    # and not the sample-weighted mean, which these offsets put far away
    sample_mean = torch.cat(batches).double().mean(0)
    assert (new[0].running_mean.double() - sample_mean).abs().min() > 0.5
    assert report.batch_sizes == [2, 5, 9] and report.samples == 16
    assert report.notes == [
        "batch sizes differ (2 to 9): each batch weighs the same in the average, whatever its size"
    ]


def test_last_batch_is_held_out_and_max_batches_holds_out_the_next():
    model = _randomize(ConvNet())
    batches = _batches([4, 4, 4, 4, 4], (3, 8, 8))
    recalibrated_first_two, _ = recalibrate_batchnorm(model, batches[:2], holdout=batches[4])

    new, report = recalibrate_batchnorm(model, batches[:3])
    assert report.batches == 2 and report.holdout_source == "last batch of the data"
    torch.testing.assert_close(new.bn0.running_mean, recalibrated_first_two.bn0.running_mean, rtol=0, atol=0)

    consumed = []

    def stream():
        for i, x in enumerate(batches):
            consumed.append(i)
            yield x

    new, report = recalibrate_batchnorm(model, stream(), max_batches=2)
    assert report.batches == 2 and report.holdout_source == "the batch after the first 2 of the data"
    assert consumed == [0, 1, 2]  # batch 2 was read as the holdout, nothing after it
    torch.testing.assert_close(new.bn0.running_mean, recalibrated_first_two.bn0.running_mean, rtol=0, atol=0)
    with torch.no_grad():
        ref_old, ref_new = model(batches[2]), new(batches[2])
    assert report.holdout is not None
    assert report.holdout.outputs[0].max_abs == pytest.approx(
        float((ref_new - ref_old).abs().max()), rel=1e-6
    )


def test_more_batches_asked_for_than_the_data_holds_is_said():
    """--batches beyond the data: every batch but the held-out one calibrates, and the report says so
    (it used fewer silently), with or without a separate holdout."""
    model = _randomize(ConvNet())
    batches = _batches([4, 4, 4], (3, 8, 8))
    reference, _ = recalibrate_batchnorm(model, batches[:2], holdout=batches[2])
    new, report = recalibrate_batchnorm(model, batches, max_batches=5)
    assert report.batches == 2 and report.holdout_source == "last batch of the data"
    assert report.notes == [
        "5 calibration batches were asked for (--batches); the data holds 2 besides the held-out one, "
        "and all of them were used"
    ]
    torch.testing.assert_close(new.bn0.running_mean, reference.bn0.running_mean, rtol=0, atol=0)
    _, report = recalibrate_batchnorm(model, batches, max_batches=5, holdout=batches[0])
    assert report.batches == 3 and report.notes == [
        "5 calibration batches were asked for (--batches); the data holds 3, and all of them were used"
    ]
    _, report = recalibrate_batchnorm(model, batches, max_batches=2)
    assert report.batches == 2 and report.notes == []


def test_report_numbers_match_independent_computation():
    model = _randomize(ConvNet(), seed=3)
    batches = _batches([6, 6, 6], (3, 8, 8))
    new, report = recalibrate_batchnorm(model, batches)

    for layer in report.layers:
        old_bn, new_bn = model.get_submodule(layer.path), new.get_submodule(layer.path)
        delta = (new_bn.running_mean.double() - old_bn.running_mean.double()).abs()
        ratio = new_bn.running_var.double() / old_bn.running_var.double()
        assert layer.mean_shift == pytest.approx(
            float((delta / (old_bn.running_var.double() + old_bn.eps).sqrt()).max()), rel=1e-12
        )
        assert layer.mean_max_abs_change == pytest.approx(float(delta.max()), rel=1e-12)
        assert layer.var_ratio_min == pytest.approx(float(ratio.min()), rel=1e-12)
        assert layer.var_ratio_max == pytest.approx(float(ratio.max()), rel=1e-12)
        assert layer.num_features == old_bn.num_features and layer.class_name == "BatchNorm2d"

    with torch.no_grad():
        before, after = model(batches[-1]).double(), new(batches[-1]).double()
    holdout = report.holdout.outputs[0]
    assert report.holdout_samples == 6
    assert holdout.max_abs == pytest.approx(float((after - before).abs().max()), rel=1e-6)
    expected_sqnr = 20 * math.log10(float(before.norm() / (before - after).norm()))
    assert holdout.sqnr_db == pytest.approx(expected_sqnr, abs=1e-4)
    data = report.to_dict()
    assert data["kind"] == "data-driven" and data["batches"] == 2 and len(data["layers"]) == 2


class TrainingShift(nn.Module):
    """Adds 100 in training mode: proves a non-BatchNorm module ran in eval mode during calibration."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 100.0 if self.training else x


def test_dropout_and_other_modules_are_in_eval_mode_during_calibration():
    model = nn.Sequential(nn.Dropout(0.5), TrainingShift(), nn.LayerNorm(4), nn.BatchNorm1d(4))
    model.train()
    flags = _flags(model)
    batches = _batches([16, 16, 16], (4,))

    new, _ = recalibrate_batchnorm(model, batches, holdout=batches[0])

    # with dropout on, half the entries would be zero and the rest doubled: the statistics would differ
    ln = model[2]
    stats = [_unbiased_stats(ln(x).detach()) for x in batches]
    torch.testing.assert_close(
        new[3].running_mean.double(), torch.stack([s[0] for s in stats]).mean(0), **STAT_TOL
    )
    torch.testing.assert_close(
        new[3].running_var.double(), torch.stack([s[1] for s in stats]).mean(0), **STAT_TOL
    )
    assert _flags(new) == flags == [True] * 5
    assert new[3].momentum == 0.1


@pytest.mark.parametrize("inplace", [False, True])
def test_modes_and_momentum_restored(inplace):
    model = nn.Sequential(nn.BatchNorm1d(3, momentum=0.3), nn.Dropout(0.1), nn.BatchNorm1d(3, momentum=None))
    model.eval()
    model[1].train()  # mixed modes must come back exactly as they were
    model[2].train()
    flags = _flags(model)
    new, _ = recalibrate_batchnorm(model, _batches([4, 4, 4], (3,)), inplace=inplace)
    assert (new is model) is inplace
    assert _flags(new) == flags == [False, False, True, True]
    assert new[0].momentum == 0.3 and new[2].momentum is None
    assert int(new[0].num_batches_tracked) == 2


def test_failure_midway_restores_everything_inplace():
    model = _randomize(ConvNet())
    model.bn1.momentum = 0.05
    model.conv1.train()
    flags, state = _flags(model), _bn_state(model)

    def batches():
        yield from _batches([4, 4], (3, 8, 8))
        yield torch.randn(4, 3, 8)  # a 3-D batch: conv2d on a wrong-rank input fails mid-way
        yield from _batches([4], (3, 8, 8))

    with pytest.raises(
        BadInputError, match=r"calibration batch 2 \(args\[0\] \(4, 3, 8\)\) does not fit the model"
    ):
        recalibrate_batchnorm(model, batches(), inplace=True)
    assert _flags(model) == flags
    assert model.bn0.momentum == 0.1 and model.bn1.momentum == 0.05
    for key, value in _bn_state(model).items():
        assert torch.equal(value, state[key]), key

    def interrupt(done: int, total: int | None) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        recalibrate_batchnorm(model, _batches([4] * 5, (3, 8, 8)), inplace=True, on_batch=interrupt)
    assert _flags(model) == flags and model.bn1.momentum == 0.05
    for key, value in _bn_state(model).items():
        assert torch.equal(value, state[key]), key


def test_progress_callback_sees_every_batch_and_the_total():
    seen = []
    recalibrate_batchnorm(
        nn.Sequential(nn.BatchNorm1d(2)), _batches([3] * 5, (2,)), on_batch=lambda d, t: seen.append((d, t))
    )
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    seen.clear()
    recalibrate_batchnorm(
        nn.Sequential(nn.BatchNorm1d(2)),
        iter(_batches([3] * 5, (2,))),
        on_batch=lambda d, t: seen.append((d, t)),
    )
    assert seen == [(1, None), (2, None), (3, None), (4, None)]


def test_no_batchnorm_is_a_clear_error():
    with pytest.raises(BadInputError, match=r"^nothing to recalibrate: the model has no BatchNorm layers$"):
        recalibrate_batchnorm(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), _batches([2, 2], (3,)))


def test_track_running_stats_false_is_skipped_with_reason():
    model = nn.Sequential(nn.BatchNorm1d(3, track_running_stats=False), nn.BatchNorm1d(3))
    _, report = recalibrate_batchnorm(model, _batches([4, 4, 4], (3,)))
    assert [layer.path for layer in report.layers] == ["1"]
    assert [(s.site, s.reason) for s in report.skips] == [
        (
            "0",
            "BatchNorm1d has track_running_stats=False: it always normalizes with the statistics of the batch "
            "at hand, so there are no running statistics to recalibrate",
        )
    ]
    with pytest.raises(
        BadInputError, match=r"nothing to recalibrate: no BatchNorm can be recalibrated \(0: "
    ):
        recalibrate_batchnorm(model[:1], _batches([4, 4], (3,)))


def test_frozen_batchnorm_and_instancenorm_are_skipped_with_reasons():
    from torchvision.ops.misc import FrozenBatchNorm2d

    model = nn.Sequential(
        FrozenBatchNorm2d(3), nn.InstanceNorm2d(3, track_running_stats=True), nn.BatchNorm2d(3)
    )
    _, report = recalibrate_batchnorm(model, _batches([2, 2, 2], (3, 4, 4)))
    assert [layer.path for layer in report.layers] == ["2"]
    reasons = {s.site: s.reason for s in report.skips}
    assert reasons["0"].startswith("FrozenBatchNorm2d keeps frozen statistics")
    assert reasons["1"] == "InstanceNorm2d is not a BatchNorm: its running statistics are left as they are"


class UnusedAndShared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.BatchNorm1d(3)
        self.unused = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.shared(x) * 2.0)


def test_unused_batchnorm_keeps_its_statistics_and_shared_one_averages_its_calls():
    model = _randomize(UnusedAndShared())
    unused_before = _bn_state(model.unused)
    batches = _batches([5, 5, 5], (3,))
    new, report = recalibrate_batchnorm(model, batches, holdout=batches[0])
    for key, value in _bn_state(new.unused).items():
        assert torch.equal(value, unused_before[key]), key
    assert [(s.site, s.reason) for s in report.skips] == [
        ("unused", "BatchNorm1d was not called by the model's forward on the calibration data")
    ]
    assert report.layers[0].calls == 6
    assert report.notes == [
        "shared ran 6 times in 3 calibration batches: its statistics average all its calls"
    ]
    # the second call sees the first call's batch-normalized (and affine) output times 2
    w, b = model.shared.weight.detach().double(), model.shared.bias.detach().double()
    stats = []
    for x in batches:
        stats.append(_unbiased_stats(x))
        stats.append(
            _unbiased_stats(2.0 * F.batch_norm(x.double(), None, None, w, b, training=True, eps=1e-5))
        )
    torch.testing.assert_close(
        new.shared.running_mean.double(), torch.stack([s[0] for s in stats]).mean(0), **STAT_TOL
    )
    torch.testing.assert_close(
        new.shared.running_var.double(), torch.stack([s[1] for s in stats]).mean(0), **STAT_TOL
    )


def test_sync_batchnorm_calibrates_on_one_process():
    model = nn.Sequential(nn.SyncBatchNorm(3)).eval()
    batches = _batches([4, 4, 4], (3, 5, 5))
    new, report = recalibrate_batchnorm(model, batches, holdout=batches[0])
    assert report.layers[0].class_name == "SyncBatchNorm"
    stats = [_unbiased_stats(x) for x in batches]
    torch.testing.assert_close(
        new[0].running_mean.double(), torch.stack([s[0] for s in stats]).mean(0), **STAT_TOL
    )
    torch.testing.assert_close(
        new[0].running_var.double(), torch.stack([s[1] for s in stats]).mean(0), **STAT_TOL
    )


def test_timm_batchnormact_calibrates_with_its_children_in_eval_mode():
    from timm.layers import BatchNormAct2d

    bn = BatchNormAct2d(3, act_layer=nn.ReLU, drop_layer=nn.Dropout)
    model = _randomize(nn.Sequential(bn))
    seen_modes = []
    bn.drop.register_forward_pre_hook(lambda module, args: seen_modes.append((module.training, bn.training)))
    batches = _batches([4, 4], (3, 5, 5))
    new, report = recalibrate_batchnorm(model, batches, holdout=batches[0], inplace=True)
    # during calibration the BatchNorm trains while its dropout child stays off; then both are in eval
    assert seen_modes[:2] == [(False, True), (False, True)] and seen_modes[2:] == [(False, False)] * 2
    stats = [_unbiased_stats(x) for x in batches]
    torch.testing.assert_close(
        bn.running_mean.double(), torch.stack([s[0] for s in stats]).mean(0), **STAT_TOL
    )
    torch.testing.assert_close(
        bn.running_var.double(), torch.stack([s[1] for s in stats]).mean(0), **STAT_TOL
    )
    assert report.layers[0].class_name == "BatchNormAct2d"
    # its activation still applies after recalibration
    assert float(new(batches[0]).detach().min()) >= 0.0


@pytest.mark.slow
def test_resnet18_statistics_match_per_batch_training_mode_runs():
    model, _, _ = model_zoo.resnet18(size=32)
    batches = _batches([2, 2, 2], (3, 32, 32), scale=1.0, shift=0.0)
    new, report = recalibrate_batchnorm(model, batches, holdout=batches[0])
    assert len(report.layers) == 20 and report.skips == []

    # Reference: each batch alone through a training-mode copy with momentum 1, which leaves exactly that
    # batch's mean and unbiased variance in every BatchNorm; then average over batches.
    per_batch = []
    for x in batches:
        m = copy.deepcopy(model).train()
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.momentum = 1.0
        with torch.no_grad():
            m(x)
        per_batch.append({k: v.double() for k, v in m.state_dict().items() if "running" in k})
    for key, value in new.state_dict().items():
        if "running" in key:
            expected = torch.stack([p[key] for p in per_batch]).mean(0)
            torch.testing.assert_close(value.double(), expected, **STAT_TOL, msg=key)
    assert not any(m.training for m in new.modules())


@pytest.mark.slow
def test_pt2_model_is_lifted_and_recalibrates_like_the_eager_one(tmp_path):
    model, args, _ = model_zoo.resnet18(size=32)
    path = tmp_path / "r18.pt2"
    torch.export.save(torch.export.export(model, args, strict=False), path)
    loaded = load_model(str(path))
    layers, skips = find_batchnorms(loaded.model)
    assert len(layers) == 20 and skips == []

    batches = _batches([2, 2, 2, 2], (3, 32, 32), scale=1.0, shift=0.0)
    from_pt2, report = recalibrate_batchnorm(loaded.model, batches)
    eager, _ = recalibrate_batchnorm(model, batches)
    assert report.batches == 3 and len(report.layers) == 20
    eager_state = eager.state_dict()
    for key, value in from_pt2.state_dict().items():
        if "running" in key:
            torch.testing.assert_close(value, eager_state[key], rtol=1e-5, atol=1e-6, msg=key)

    with pytest.raises(BadInputError, match=r"a \.pt2 model takes only the input shapes it was exported for"):
        recalibrate_batchnorm(loaded.model, _batches([5, 5], (3, 32, 32)))


def test_unlifted_batchnorm_op_in_a_graph_is_reported():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros(3))
            self.register_buffer("var", torch.ones(3))
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(F.batch_norm(x, self.mean, self.var, training=False))

    gm = torch.export.export(Functional().eval(), (torch.randn(2, 3),), strict=False).module()
    from normswap.graph.lift import lift_exported_module

    lift_exported_module(gm)
    layers, skips = find_batchnorms(gm)
    assert [path for path, _ in layers] == ["bn"]
    assert len(skips) == 1 and skips[0].reason.startswith(
        "batch_norm op in the exported graph was not lifted"
    )


def test_batches_in_every_accepted_form():
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
            return self.bn(x if y is None else x + y)

    model = TwoInputs()
    x = _batches([4, 4], (3,))
    forms = [
        [x[0], x[1], x[0]],
        [(x[0],), [x[1]], (x[0],)],
        [{"x": x[0]}, {"x": x[1]}, {"x": x[0]}],
        [ModelInputs((x[0],)), ModelInputs((), {"x": x[1]}), x[0]],
    ]
    for batches in forms:
        new, _ = recalibrate_batchnorm(model, batches)
        expected = (x[0].double().mean(0) + x[1].double().mean(0)) / 2
        torch.testing.assert_close(new.bn.running_mean.double(), expected, **STAT_TOL)
    with pytest.raises(BadInputError, match="a batch of type str cannot be fed to a model"):
        recalibrate_batchnorm(model, ["abc", "def"])


def test_too_few_batches():
    with pytest.raises(BadInputError, match=r"^nothing to calibrate on: the data yields no batches$"):
        recalibrate_batchnorm(nn.Sequential(nn.BatchNorm1d(2)), [])
    with pytest.raises(BadInputError, match="the data yields a single batch, which is held out"):
        recalibrate_batchnorm(nn.Sequential(nn.BatchNorm1d(2)), _batches([3], (2,)))


def test_non_finite_statistics_make_the_report_not_ok():
    batches = _batches([3, 3, 3], (2,))
    batches[0][0, 0] = float("nan")
    _, report = recalibrate_batchnorm(nn.Sequential(nn.BatchNorm1d(2)), batches)
    assert not report.ok and report.non_finite_layers == ["0"]
