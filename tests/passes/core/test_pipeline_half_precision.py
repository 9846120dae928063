"""Exact passes on half-precision models are judged against the same model computed in fp32."""

from __future__ import annotations

import dataclasses
import importlib

import model_zoo
import torch

from normswap.passes import FoldBatchNorm, Pipeline
from normswap.util.tolerance import TOLERANCE


def test_a_correct_bf16_fold_of_a_deep_net_passes_against_fp32(monkeypatch):
    # Two bf16 runs of the same function can differ by more than the bf16 row of the table (1.9e-2 > 1.6e-2
    # on one CPU, within it on another: the rounding depends on the CPU's kernels). The row is tightened
    # here so that this path is taken on every machine.
    tight = dataclasses.replace(TOLERANCE[torch.bfloat16], exact=1e-4)
    monkeypatch.setitem(TOLERANCE, torch.bfloat16, tight)
    model, args, kwargs = model_zoo.resnet18(size=64)
    model = model.to(torch.bfloat16)
    args = (args[0].to(torch.bfloat16),)
    _, report = Pipeline([FoldBatchNorm()])(model, args, kwargs)
    validation = report.passes[0].validation
    assert len(report.passes[0].changes) == 20
    # two bf16 runs of the same function differ by more than the (tightened) bf16 tolerance ...
    assert not validation["within_tolerance"]
    # ... so the fold is judged against the model in fp32, where it is no worse than the original
    half = validation["rounding"]
    assert report.ok, report.exact_failures
    assert half["rewritten_rel_error"] <= 2 * half["original_rel_error"]
    assert 0 < half["original_rel_error"] < 0.05  # bf16 rounding, not a broken model


def test_a_wrong_bf16_fold_still_fails(monkeypatch):
    fold = importlib.import_module("normswap.passes.batchnorm.group")
    real = fold.fold_bn_into_conv_weights

    def wrong(weight, bias, scale, shift, out_channel_dim=0):
        w, b = real(weight, bias, scale, shift, out_channel_dim)
        return w * 1.2, b

    monkeypatch.setattr(fold, "fold_bn_into_conv_weights", wrong)
    model, args, kwargs = model_zoo.resnet18(size=32)
    model = model.to(torch.bfloat16)
    _, report = Pipeline([FoldBatchNorm()])(model, (args[0].to(torch.bfloat16),), kwargs)
    assert not report.ok and report.exact_failures[0].startswith("fold_batchnorm: output moved by")
    half = report.passes[0].validation["rounding"]
    assert half["rewritten_rel_error"] > 2 * half["original_rel_error"]


def test_an_fp32_fold_beyond_the_table_is_judged_against_fp64(monkeypatch):
    # fp32's own rounding exceeds the table on ill-conditioned models (timm's tresnet_l with random
    # weights: 1.2e-4 x max|out| from fp64); tightening the row makes resnet18 one here
    tight = dataclasses.replace(TOLERANCE[torch.float32], exact=1e-9)
    monkeypatch.setitem(TOLERANCE, torch.float32, tight)
    model, args, kwargs = model_zoo.resnet18(size=64)
    _, report = Pipeline([FoldBatchNorm()])(model, args, kwargs)
    validation = report.passes[0].validation
    assert not validation["within_tolerance"]
    rounding = validation["rounding"]  # the example input's verdict (the variants are noise-level here)
    assert rounding["dtype"] == "fp64" and rounding["within_rounding"]
    assert rounding["rewritten_rel_error"] <= 2 * rounding["original_rel_error"]
    assert 0 < rounding["original_rel_error"] < 1e-5  # fp32 rounding, not a broken model
    # in place, the input model is the one rewritten: nothing to judge against, the table decides
    _, in_place = Pipeline([FoldBatchNorm()])(model, args, kwargs, inplace=True)
    assert not in_place.ok and "rounding" not in in_place.passes[0].validation


def test_a_wrong_fp32_fold_fails_against_fp64_too(monkeypatch):
    fold = importlib.import_module("normswap.passes.batchnorm.group")
    real = fold.fold_bn_into_conv_weights

    def slightly_wrong(weight, bias, scale, shift, out_channel_dim=0):
        w, b = real(weight, bias, scale, shift, out_channel_dim)
        return w * (1 + 1e-4), b

    monkeypatch.setattr(fold, "fold_bn_into_conv_weights", slightly_wrong)
    model, args, kwargs = model_zoo.resnet18(size=32)
    _, report = Pipeline([FoldBatchNorm()])(model, args, kwargs)
    rounding = report.passes[0].validation["rounding"]
    assert not report.ok and rounding["dtype"] == "fp64" and not rounding["within_rounding"]
