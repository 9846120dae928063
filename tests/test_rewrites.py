"""The registry of rewrites (normswap.rewrites) is the one list: what it says of each rewrite is what the
config builds, what streams, what makes a graph, what the command offers and what the README shows."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from normswap import rewrites
from normswap.api.config import ConvertConfig
from normswap.modules.semantics import CONVERT_TARGETS
from normswap.passes.core.base import Needs

ROOT = Path(__file__).resolve().parent.parent


def config_asking_for(entry: rewrites.Rewrite) -> ConvertConfig:
    """The smallest configuration that asks for ``entry`` alone (with the option it refines)."""
    if entry in rewrites.TARGETS:
        return ConvertConfig(to=entry.field, groups=2 if entry.field == "groupnorm" else None)
    value = "all" if entry.field == "add_weight_norm" else True
    to = entry.needs.removeprefix("--to ") if entry.needs else None
    return ConvertConfig(**{entry.field: value}, to=to)


def test_every_option_is_a_config_field_and_every_target_a_target():
    fields = {f.name for f in dataclasses.fields(ConvertConfig)}
    assert [r.field for r in rewrites.OPTIONS if r.field not in fields] == []
    assert sorted(r.field for r in rewrites.TARGETS) == sorted(CONVERT_TARGETS)
    assert len(rewrites.BY_OPTION) == len(rewrites.REWRITES)  # no option listed twice


@pytest.mark.parametrize("entry", rewrites.REWRITES, ids=lambda r: r.option)
def test_the_config_builds_what_the_registry_says(entry):
    config = config_asking_for(entry)
    assert entry.option in config.rewrites()
    passes = config.passes()
    # the rewrite's own pass comes last (after the passes it refines, --defer-rms after the fold it needs);
    # --to rmsnorm's exact route comes first, the lossy swap after it takes what it leaves
    own = passes[0] if entry.field == "rmsnorm" else passes[-1]
    assert own.kind.value == entry.kind, (entry.option, own.name)
    assert (own.needs is Needs.EXPORTED_GRAPH) is entry.graph, (entry.option, own.name)


def test_what_streams_is_what_the_stream_can_plan():
    from normswap.api.checkpoint import stream_problem

    for entry in rewrites.REWRITES:
        config = dataclasses.replace(config_asking_for(entry), exact=entry.kind == rewrites.EXACT)
        assert (stream_problem(config) is None) is entry.streams, entry.option


def test_every_rewrite_that_streams_has_its_planner_and_no_other_has_one():
    from normswap.passes.streaming import GRAPH_PLANNERS, PARAMETER_PLANNERS

    streamed = {entry.option for entry in rewrites.REWRITES if entry.streams}
    assert streamed == set(GRAPH_PLANNERS) | PARAMETER_PLANNERS


def test_every_rewrite_has_its_docs_page_and_a_row_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## What it does") :]
    table = table[: table.index("\n## ", 4)]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for entry in rewrites.REWRITES:
        assert (ROOT / "docs" / entry.docs).is_file(), entry.docs
        spelled = entry.option if entry in rewrites.OPTIONS else entry.field
        row = next((r for r in rows if re.search(rf"(?<![\w-]){re.escape(spelled)}(?![\w-])", r)), None)
        assert row is not None, f"README's table has no row for {entry.option}"
        assert f"| {entry.kind} |" in row or entry.field == "rmsnorm", (entry.option, row)
        assert entry.docs in row, (entry.option, row)


def test_the_help_of_the_command_is_the_registrys():
    from normswap_cli.app import app
    from typer.testing import CliRunner

    shown = " ".join(CliRunner().invoke(app, ["convert", "--help"], env={"COLUMNS": "200"}).output.split())
    for entry in rewrites.OPTIONS:
        assert " ".join(entry.help.split()) in shown.replace("│ ", "").replace(" │", ""), entry.option


def test_every_on_off_rewrite_reaches_the_config_from_its_flag(monkeypatch, tmp_path):
    """convert's on/off flags are made from the registry: each sets its own field and no other."""
    from normswap_cli.app import app
    from typer.testing import CliRunner

    import normswap.api

    seen = []

    def capture(model, config, **kwargs):
        seen.append(config)
        raise normswap.BadInputError("captured")

    monkeypatch.setattr(normswap.api, "convert", capture)
    on_off = [entry for entry in rewrites.OPTIONS if entry.field != "add_weight_norm"]
    for entry in on_off:
        needs = entry.needs.split() if entry.needs else []  # "--to fused" for --fuse-add
        argv = ["convert", "m.pt2", *needs, entry.option, "-o", str(tmp_path / "out.pt2")]
        result = CliRunner().invoke(app, argv)
        assert "captured" in result.output, (entry.option, result.output)
        asked = {e.field for e in on_off if getattr(seen[-1], e.field)}
        assert asked == {entry.field}, entry.option


def test_passes_run_in_the_order_of_the_registry_stages():
    config = ConvertConfig(
        add_weight_norm="all", fuse_add=True, fuse_inline=True, fold_norm_affine=True, to="fused",
        fold_layerscale=True, fold_bn=True, remove_weight_norm=True,
    )  # fmt: skip
    passes = [p.name for p in config.passes()]
    assert passes == [
        "remove_weight_norm", "fold_batchnorm", "fold_layerscale", "fuse_norm", "fold_norm_affine",
        "add_weight_norm", "fuse_graph_norm", "fuse_add_norm",
    ]  # fmt: skip
    stage = {r.field: r.stage for r in rewrites.REWRITES}
    asked = ["remove_weight_norm", "fold_bn", "fold_layerscale", "fused", "fold_norm_affine", "add_weight_norm",
             "fuse_inline", "fuse_add"]  # fmt: skip
    assert [stage[f] for f in asked] == sorted(stage[f] for f in asked)
    # a rewrite that needs another's passes runs them too, at their own stage
    assert [p.name for p in ConvertConfig(defer_rms=True).passes()] == ["fold_norm_affine", "defer_rms"]
