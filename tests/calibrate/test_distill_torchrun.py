"""``normswap distill`` under torchrun on the CPU (gloo): two processes compute what one does, a run
resumed in two processes from a checkpoint of another equals the uninterrupted one, a sharded (.dcp) result
loads into the model, and a killed worker fails the command with nothing written. The models are an HF
Llama from a config (random weights, norms far from identity) and its DyT conversion, whose 0-d alphas
FSDP2 cannot shard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hf_dirs import make_directory
from normswap_cli.app import app
from typer.testing import CliRunner

runner = CliRunner()
# The uneven split on purpose: 5 rows over 2 processes are 3 + 2, so the loss weights matter.
COMMON = ("--trust-pickle", "--batch-size", "5", "--lr", "1e-3")


@pytest.fixture(scope="module")
def llama_dyt(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchrun")
    original = make_directory(root, "llama")
    student = root / "student.pt"
    result = runner.invoke(app, ["convert", str(original), "--to", "dyt", "-o", str(student)])
    assert result.exit_code == 0, result.output
    data = root / "data.pt"
    torch.save(torch.randint(0, 300, (25, 10), generator=torch.Generator().manual_seed(1)), data)
    return original, student, data


def _torchrun(*args: str, processes: int = 2, shown: str | None = None, **popen: object) -> subprocess.Popen:
    """``shown``: the local ranks whose output torchrun passes on (default: every rank's)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    command += [f"--local-ranks-filter={shown}"] if shown is not None else []
    command += ["-m", "normswap_cli", *args]
    # faulthandler: an abort at exit prints every thread's Python stack (one was seen under load)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def _finish(process: subprocess.Popen, timeout: float = 240) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return output


def _worst_relative(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    assert expected.keys() == got.keys()
    return max(((expected[k] - got[k]).abs().max() / expected[k].abs().max()).item() for k in expected)


def test_two_processes_compute_what_one_does_and_resume_across_process_counts(llama_dyt, tmp_path):
    original, student, data = llama_dyt
    run = ("distill", str(original), str(student), "--data", str(data), *COMMON)

    one = tmp_path / "one.pt"
    result = runner.invoke(
        app, [*run, "--steps", "6", "-o", str(one), "--report", str(tmp_path / "one.json")]
    )
    assert result.exit_code == 0, result.output
    expected = torch.load(one, weights_only=False).state_dict()
    one_report = json.loads((tmp_path / "one.json").read_text())

    # Uninterrupted, two processes, the teacher sharded too, the result sharded with DCP.
    sharded = tmp_path / "two.dcp"
    report = tmp_path / "two.json"
    output = _finish(
        _torchrun(*run, "--steps", "6", "-o", str(sharded), "--shard-teacher", "--report", str(report))
    )
    assert output.count("wrote ") == 1, output  # process 0 alone speaks and writes
    two_report = json.loads(report.read_text())
    assert two_report["processes"] == 2 and "5 scalar parameters whole" in two_report["placement"]
    # the teacher, a model directory, read straight into its shards: no process held it whole
    assert (
        f"teacher: 2 blocks (model.layers) and the root, model.embed_tokens, lm_head on their own, read shard by "
        f"shard from {original}" in (two_report["placement"])
    )
    got = torch.load(student, weights_only=False).state_dict()
    dcp.load(got, checkpoint_id=str(sharded), no_dist=True)
    assert _worst_relative(expected, got) < 1e-6
    for a, b in zip(one_report["losses"], two_report["losses"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(a)
    moved = max(
        (expected[k] - v).abs().max().item()
        for k, v in torch.load(student, weights_only=False).state_dict().items()
    )
    assert moved > 1e-3  # the comparison is of trained weights, not of the starting point

    # Interrupted after 4 steps (one process), resumed in two processes to 6: the same model again.
    checkpoints = tmp_path / "ck"
    result = runner.invoke(
        app,
        [*run, "--steps", "4", "-o", str(tmp_path / "four.pt"), "--checkpoint-dir", str(checkpoints),
         "--checkpoint-every", "2"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    resumed = tmp_path / "resumed.pt"
    resume = ("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2", "--resume")
    output = _finish(_torchrun(*run, "--steps", "6", "-o", str(resumed), *resume))
    assert f"resumed from {checkpoints / 'step-00000004'} after 4 of 6 steps" in output
    assert _worst_relative(expected, torch.load(resumed, weights_only=False).state_dict()) < 1e-6
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000006"]


def _workers(agent: int) -> list[int]:
    children = Path(f"/proc/{agent}/task/{agent}/children")
    return [int(pid) for pid in children.read_text().split()] if children.exists() else []


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the workers through /proc")
def test_a_killed_worker_fails_the_command_and_nothing_is_half_written(llama_dyt, tmp_path):
    original, student, data = llama_dyt
    output, checkpoints = tmp_path / "out.pt", tmp_path / "ck"
    agent = _torchrun(
        "distill", str(original), str(student), "--data", str(data), *COMMON, "--steps", "100000",
        "-o", str(output), "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (checkpoints.is_dir() and any(p.name.startswith("step-") for p in checkpoints.iterdir())):
            assert agent.poll() is None, agent.communicate()[0]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
        workers = _workers(agent.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        log, _ = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 1, log
    assert "Signal 9 (SIGKILL)" in log
    # No output, not even a temp file of it; every checkpoint that has a name is complete.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    named = [p for p in checkpoints.iterdir() if not p.name.startswith(".")]
    assert named and all((p / "run.json").is_file() and (p / ".metadata").is_file() for p in named)


def test_pt2_models_are_read_into_their_shards_and_compute_the_same(llama_dyt, tmp_path):
    """A .pt2 student and a .pt2 teacher are never loaded whole under torchrun: built on the meta device
    from the archive's program, each process reads its rows of each weight member; the program is
    unflattened, so its blocks are called as modules and FSDP2 shards it block by block (the flat graph
    would be one unit, gathered whole). Two processes reach the losses of one."""
    original, _, data = llama_dyt
    student = tmp_path / "student.pt2"
    result = runner.invoke(app, ["convert", str(original), "--to", "dyt", "-o", str(student)])
    assert result.exit_code == 0, result.output
    from normswap.load import load_model

    teacher = load_model(str(original))
    teacher_pt2 = tmp_path / "teacher.pt2"
    ids = torch.randint(0, 300, (2, 11))  # batch and sequence free: the distillation's batches are 5 x 10
    free = {"input_ids": {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}}
    program = torch.export.export(teacher.model, (), {"input_ids": ids}, dynamic_shapes=free, strict=False)
    torch.export.save(program, teacher_pt2)
    run = (
        "distill",
        str(teacher_pt2),
        str(student),
        "--data",
        str(data),
        "--batch-size",
        "5",
        "--lr",
        "1e-3",
    )
    one = tmp_path / "one.json"
    result = runner.invoke(app, [*run, "--steps", "3", "-o", str(tmp_path / "one.pt2"), "--report", str(one)])
    assert result.exit_code == 0, result.output
    two = tmp_path / "two.json"
    # written as .pt: the check before the work pickles the flat program the output is written from
    run_two = (*run, "--steps", "3", "-o", str(tmp_path / "two.pt"), "--report", str(two), "--shard-teacher")
    _finish(_torchrun(*run_two))
    one_report, two_report = json.loads(one.read_text()), json.loads(two.read_text())
    placement = two_report["placement"]
    assert placement.startswith("student: 2 blocks (model.layers) and the root"), placement
    assert f"read shard by shard from {student}" in placement
    assert f"read shard by shard from {teacher_pt2}" in placement
    for a, b in zip(one_report["losses"], two_report["losses"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(a)
    assert min(one_report["losses"]) > 1e-6  # the losses compared are not zeros
    # the trained students compute the same (weights are no measure: Adam turns last-bit gradient
    # differences into updates of up to lr)
    first, second, start = (_logits(p) for p in (tmp_path / "one.pt2", tmp_path / "two.pt", student))
    assert ((first - second).abs().max() / first.abs().max()).item() < 1e-5
    assert ((first - start).abs().max() / first.abs().max()).item() > 1e-3  # trained, not the start


def _logits(model: Path) -> torch.Tensor:
    from normswap.load import load_model

    ids = torch.randint(0, 300, (5, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return load_model(str(model), trust_pickle=True).model(input_ids=ids).logits


def _two_nodes(*args: str, port: int) -> list[str]:
    """Two torchrun launches of one process each that meet through a c10d rendezvous on localhost, as two
    machines of a cluster would."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    command += ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=normswap-test"]
    # faulthandler: an abort at exit prints every thread's Python stack (one was seen under load)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    nodes = [
        subprocess.Popen(
            [*command, "-m", "normswap_cli", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]  # fmt: skip
    return [_finish(node) for node in nodes]


def test_a_directory_student_is_read_into_shards_and_written_shard_by_shard(tmp_path):
    """A student that is a model directory is never loaded whole under torchrun: built on the meta device,
    each process reads its rows, and a directory output is written one gathered tensor at a time. One
    process on each of two "nodes" and two processes on one node resuming a one-process run's
    checkpoint train what one process trains."""
    import socket

    original = make_directory(tmp_path, "llama")
    student = tmp_path / "student"
    result = runner.invoke(app, ["convert", str(original), "--to", "layernorm", "-o", str(student)])
    assert result.exit_code == 0, result.output
    data = tmp_path / "data.pt"
    torch.save(torch.randint(0, 300, (15, 10), generator=torch.Generator().manual_seed(1)), data)
    run = ("distill", str(original), str(student), "--data", str(data), *COMMON, "--steps", "2")

    result = runner.invoke(app, [*run, "-o", str(tmp_path / "one")])
    assert result.exit_code == 0, result.output
    report = tmp_path / "nodes.json"
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    outputs = _two_nodes(*run, "-o", str(tmp_path / "nodes"), "--report", str(report), port=port)
    assert sum(output.count("wrote ") for output in outputs) == 1, outputs  # process 0 alone writes
    placement = json.loads(report.read_text())["placement"]
    assert placement.startswith(
        "student: 2 blocks (model.layers) and the root, model.embed_tokens, lm_head on their own, read shard by "
        f"shard from {student}"
    )

    expected, started = _logits(tmp_path / "one"), _logits(student)
    assert (expected - started).abs().max() > 1e-3 * expected.abs().max()  # trained, not the start
    for written in ("nodes",):
        got = _logits(tmp_path / written)
        assert (expected - got).abs().max() <= 1e-5 * expected.abs().max(), written
        # laid out as the student was (its recorded LayerNorms: stock loaders kept out), side files copied
        files = sorted(p.name for p in (tmp_path / written).iterdir())
        assert files == sorted(p.name for p in (tmp_path / "one").iterdir()), files
        assert "normswap-model.safetensors.index.json" in files and "tokenizer.json" in files

    # stopped after 1 step in one process, resumed in two from its checkpoint: the same model again
    checkpoints = ("--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1")
    first = [a if a != "2" else "1" for a in run]  # --steps 1
    result = runner.invoke(app, [*first, *checkpoints, "-o", str(tmp_path / "first")])
    assert result.exit_code == 0, result.output
    output = _finish(_torchrun(*run, *checkpoints, "--resume", "-o", str(tmp_path / "resumed")))
    assert "resumed from" in output and "after 1 of 2 steps" in output, output
    resumed = _logits(tmp_path / "resumed")
    assert (expected - resumed).abs().max() <= 1e-5 * expected.abs().max()

    refused = _torchrun(*run, "-o", str(tmp_path / "cast"), "--dtype", "bfloat16")
    log, _ = refused.communicate(timeout=240)
    assert refused.returncode != 0 and "written shard by shard in" in " ".join(log.split()), log
    assert not (tmp_path / "cast").exists()


_FACTORY = """
import transformers


def build():
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).eval()
"""


def test_factories_with_weights_files_are_read_into_their_shards(tmp_path):
    """A factory given --weights / --converted-weights is built with its parameters on the meta device
    (its rotary frequencies computed as it builds them), sharded, and each process reads its rows from the
    weights file: safetensors by byte range, a torch.save archive memory-mapped. Two processes reach the
    losses of one, and the trained student's logits."""
    from safetensors.torch import save_file

    from normswap.load import load_model

    factory = tmp_path / "factory.py"
    factory.write_text(_FACTORY)
    spec = f"{factory}:build"
    torch.manual_seed(0)
    teacher = load_model(spec).model
    teacher_weights = tmp_path / "teacher.safetensors"
    save_file({k: v.contiguous() for k, v in teacher.state_dict().items()}, teacher_weights)
    # the student: the same architecture moved away from the teacher (its weights, a torch.save archive)
    student = {k: v + 0.05 * torch.randn_like(v) for k, v in teacher.state_dict().items()}
    student_weights = tmp_path / "student.pt"
    torch.save(student, student_weights)
    data = tmp_path / "data.pt"
    torch.save(torch.randint(0, 300, (10, 8), generator=torch.Generator().manual_seed(1)), data)
    run = (
        "distill", spec, spec, "--weights", str(teacher_weights), "--converted-weights", str(student_weights),
        "--data", str(data), "--batch-size", "5", "--lr", "1e-3", "--steps", "3",
    )  # fmt: skip
    one = tmp_path / "one.json"
    result = runner.invoke(app, [*run, "-o", str(tmp_path / "one.pt"), "--report", str(one)])
    assert result.exit_code == 0, result.output
    two = tmp_path / "two.json"
    _finish(_torchrun(*run, "-o", str(tmp_path / "two.pt"), "--report", str(two), "--shard-teacher"))
    one_report, two_report = json.loads(one.read_text()), json.loads(two.read_text())
    placement = two_report["placement"]
    assert f"read shard by shard from {student_weights}" in placement, placement
    assert f"read shard by shard from {teacher_weights}" in placement, placement
    assert placement.startswith("student: 2 blocks (model.layers) and the root"), placement
    assert min(one_report["losses"]) > 1e-6
    for a, b in zip(one_report["losses"], two_report["losses"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(a)
    ids = torch.randint(0, 300, (3, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        first, second = (
            torch.load(tmp_path / n, weights_only=False)(ids).logits for n in ("one.pt", "two.pt")
        )
    assert ((first - second).abs().max() / first.abs().max()).item() < 1e-5


def test_mixed_precision_and_activation_checkpointing_under_torchrun(llama_dyt, tmp_path):
    """FSDP2's MixedPrecisionPolicy (bfloat16 compute, float32 reduction and weights) with per-block
    recomputation (which alone changes no number: tests/calibrate/test_distill.py): the run trains, says
    so, keeps float32 weights, and its losses stay near the float32 run's. Mixed precision is refused
    outside torchrun."""
    original, student, data = llama_dyt
    run = ("distill", str(original), str(student), "--data", str(data), *COMMON, "--steps", "3")
    reports = {}
    for name, flags in (("plain", ()), ("mixed", ("--mixed-precision", "--activation-checkpointing"))):
        reports[name] = tmp_path / f"{name}.json"
        _finish(_torchrun(*run, *flags, "-o", str(tmp_path / f"{name}.pt"), "--report", str(reports[name])))
    plain, mixed = (json.loads(reports[n].read_text()) for n in ("plain", "mixed"))
    assert "bfloat16 compute with float32 gradient reduction" in mixed["placement"]
    assert "2 blocks (model.layers) recompute their activations in the backward" in mixed["notes"]
    for a, b in zip(plain["losses"], mixed["losses"], strict=True):
        assert abs(a - b) <= 0.1 * abs(a) and a != b  # bfloat16 rounding: near, not equal
    weights = torch.load(tmp_path / "mixed.pt", weights_only=False).state_dict()
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}
    result = runner.invoke(app, [*run, "--mixed-precision", "-o", str(tmp_path / "one.pt")])
    assert result.exit_code == 2 and "--mixed-precision applies under torchrun" in " ".join(
        result.output.split()
    )


def test_a_broken_teacher_is_refused_by_every_process(tmp_path):
    """A NaN in rows of the teacher that only the second process reads: that process finds it, the first
    is told (they agree before any collective, so none waits), and the run stops with the rule's sentence
    and nothing written, as in one process."""
    from safetensors.torch import save_file

    from normswap.load import load_model

    factory = tmp_path / "factory.py"
    factory.write_text(_FACTORY)
    spec = f"{factory}:build"
    torch.manual_seed(0)
    weights = {k: v.contiguous().clone() for k, v in load_model(spec).model.state_dict().items()}
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name][-1, 5] = float("nan")  # the last row: the second of two row shards
    teacher = tmp_path / "teacher.safetensors"
    save_file(weights, teacher)
    data = tmp_path / "data.pt"
    torch.save(torch.randint(0, 300, (10, 8), generator=torch.Generator().manual_seed(1)), data)
    run = (
        "distill", spec, spec, "--weights", str(teacher), "--data", str(data), "--batch-size", "5",
        "--steps", "1",
    )  # fmt: skip
    one = runner.invoke(app, [*run, "-o", str(tmp_path / "one.pt")])
    assert one.exit_code == 2 and f"its {name} holds NaN" in " ".join(one.output.split()), one.output
    two = _torchrun(*run, "--shard-teacher", "-o", str(tmp_path / "two.pt"), shown="0")  # process 0's output
    log, _ = two.communicate(timeout=240)
    said = f"its {name} holds NaN at [63, 5] (1 non-finite value in rows 32-63)"
    assert two.returncode != 0 and said in " ".join(log.split()), log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.pt", "factory.py", "teacher.safetensors"]
