"""Every ```python block of README.md and docs/ runs, so a documented snippet that stops working fails CI.

Each block runs as written, in a fresh namespace and a fresh working directory. What a block takes from
its surrounding prose (the free names it reads, such as ``model`` and ``x``, and the files it names, such
as ``"model.pt2"``) is supplied by the harness below, built from small real models: torchvision's
ResNet-18, and Hugging Face GPT-2 and Llama built from tiny configs. A block that reads a name or names a
file the harness does not know fails and says which, so a new block comes with its fixture.

A block that cannot sensibly run here (it needs a GPU, torchrun or a multi-GB model) carries the line
``<!-- not run: REASON -->`` immediately before its fence; it is skipped with that reason, and only a few
blocks may be (MAX_NOT_RUN).
"""

from __future__ import annotations

import ast
import builtins
import copy
import re
import shutil
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MAX_NOT_RUN = 4

FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)```python\b.*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.+?)\s*-->\s*$")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclass(frozen=True)
class Block:
    document: str  # relative to the repository root
    number: int  # 1-based, among the document's python blocks
    line: int  # 1-based line of the block's first code line
    source: str
    not_run: str | None  # the reason given in <!-- not run: REASON -->, if any

    @property
    def id(self) -> str:
        return f"{self.document}:{self.number}"


def _blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    document = path.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    at = 0
    while at < len(lines):
        opening = FENCE_OPEN.match(lines[at])
        if not opening:
            at += 1
            continue
        indent = opening["indent"]
        end = next(
            (i for i in range(at + 1, len(lines)) if lines[i].strip() == "```"),
            None,
        )
        assert end is not None, f"{document}:{at + 1}: a ```python fence that is never closed"
        assert all(not line.strip() or line.startswith(indent) for line in lines[at + 1 : end]), (
            f"{document}:{at + 1}: a block's lines are indented less than its fence"
        )
        marker = NOT_RUN.match(lines[at - 1]) if at else None
        blocks.append(
            Block(
                document=document,
                number=len(blocks) + 1,
                line=at + 2,
                source=textwrap.dedent("\n".join(lines[at + 1 : end])) + "\n",
                not_run=marker["reason"] if marker else None,
            )
        )
        at = end + 1
    return blocks


def _all_blocks() -> list[Block]:
    return [block for path in _documents() for block in _blocks_of(path)]


BLOCKS = _all_blocks()


# -- what a block reads: its free names and the files it names ----------------------------------------


def _free_names(source: str) -> set[str]:
    """Names the block reads but never binds (assignment, import, def, for, with, except, ...)."""
    tree = ast.parse(source)
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound - set(dir(builtins))


def _strings(source: str) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


# -- the names the prose explains: scenes of small real models -----------------------------------------
#
# A scene is one model with the inputs that go with it. A block gets the first scene that supplies every
# free name it reads: `model` with `x` is the ResNet, `model` with `input_ids` is GPT-2.


def _resnet18() -> dict[str, Any]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    batches = [(torch.randn(2, 3, 32, 32),) for _ in range(2)]
    return {"model": model, "x": torch.randn(2, 3, 32, 32), "batches": batches}


def _gpt2() -> dict[str, Any]:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    batches = [(torch.randint(0, 128, (2, 12)),) for _ in range(2)]
    return {"model": model, "input_ids": torch.randint(0, 128, (2, 12)), "batches": batches}


@dataclass(frozen=True)
class Scene:
    names: frozenset[str]
    build: Callable[[], dict[str, Any]]


SCENES = {
    "resnet18": Scene(frozenset({"model", "x", "batches"}), _resnet18),
    "gpt2": Scene(frozenset({"model", "input_ids", "batches"}), _gpt2),
}


def _scene_for(block: Block) -> str | None:
    free = _free_names(block.source)
    if not free:
        return None
    for name, scene in SCENES.items():
        if free <= scene.names:
            return name
    known = "; ".join(f"{name}: {sorted(scene.names)}" for name, scene in SCENES.items())
    raise AssertionError(
        f"{block.id} (line {block.line}) reads {sorted(free)}, which no scene of tests/test_docs_code.py "
        f"supplies all of ({known}): add one"
    )


# -- the files the prose names: written once per module, copied into each block's directory -----------


def _write_resnet_pt2(path: Path) -> None:
    scene = _resnet18()
    torch.export.save(torch.export.export(scene["model"], (scene["x"],)), path)


def _write_llama_dir(path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)


FILES: dict[str, Callable[[Path], None]] = {
    "model.pt2": _write_resnet_pt2,
    "llama-dir": _write_llama_dir,
}


@pytest.fixture(scope="module")
def made_files(tmp_path_factory) -> Callable[[str], Path]:
    """``made_files(name)``: the file (or directory) ``name`` of FILES, written on first use."""
    store = tmp_path_factory.mktemp("docs-files")

    def made(name: str) -> Path:
        path = store / name
        if not path.exists():
            FILES[name](path)
        return path

    return made


@pytest.fixture(scope="module")
def scenes() -> Callable[[str], dict[str, Any]]:
    """``scenes(name)``: a fresh copy of the scene's objects; each scene is built once per module."""
    built: dict[str, dict[str, Any]] = {}

    def scene(name: str) -> dict[str, Any]:
        if name not in built:
            built[name] = SCENES[name].build()
        return copy.deepcopy(built[name])

    return scene


# -- the tests ----------------------------------------------------------------------------------------


def test_every_python_block_is_found():
    # the harness sees every fence the documents open, or it would pass over a block silently
    for path in _documents():
        found = _blocks_of(path)
        assert len(found) == path.read_text().count("```python"), path
    assert BLOCKS, "no ```python block in README.md or docs/: the parser is broken"


def test_few_blocks_are_marked_not_run():
    marked = [f"{block.id}: {block.not_run}" for block in BLOCKS if block.not_run]
    assert len(marked) <= MAX_NOT_RUN, "too many blocks are marked not run:\n" + "\n".join(marked)
    # a marker that is not on the line right before a ```python or ```console fence marks nothing
    markers = sum(1 for path in _documents() for line in path.read_text().splitlines() if NOT_RUN.match(line))
    sessions = sum(1 for s in SESSIONS if s.not_run)
    assert markers == len(marked) + sessions, "a <!-- not run: ... --> line is not right before a fence"


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_block_runs(block: Block, tmp_path, monkeypatch, scenes, made_files):
    if block.not_run:
        pytest.skip(f"not run: {block.not_run}")
    monkeypatch.chdir(tmp_path)
    for name in sorted(_strings(block.source) & FILES.keys()):
        made = made_files(name)
        if made.is_dir():
            shutil.copytree(made, tmp_path / name)
        else:
            shutil.copy2(made, tmp_path / name)
    scene = _scene_for(block)
    namespace: dict[str, Any] = {"__name__": "__docs__", **(scenes(scene) if scene else {})}
    # padded so that a traceback names the markdown file and line, and shows that line
    code = compile("\n" * (block.line - 1) + block.source, str(ROOT / block.document), "exec")
    exec(code, namespace)


# ---- console sessions: ```console blocks whose lines start with "$ " are commands a reader types in the
# repository root; each session runs in order, in a fresh folder, through the real command line (typer's
# runner, in this process) and must exit 0. Blocks without "$ " lines show commands with placeholders.


@dataclass(frozen=True)
class Session:
    path: Path
    number: int
    commands: tuple[str, ...]
    not_run: str | None = None  # the reason given in a `<!-- not run: REASON -->` line before the fence

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:console{self.number}"


def _sessions() -> list[Session]:
    found = []
    for path in _documents():
        number, inside, commands, previous, reason = 0, False, [], "", None
        for line in path.read_text().splitlines():
            if line.strip().startswith("```console"):
                inside, commands, number = True, [], number + 1
                marked = NOT_RUN.match(previous)
                reason = marked.group("reason") if marked else None
            elif inside and line.strip().startswith("```"):
                inside = False
                if commands:
                    found.append(Session(path, number, tuple(commands), reason))
            elif inside and line.startswith("$ "):
                commands.append(line[2:])
            previous = line
    return found


SESSIONS = _sessions()


def _run_command(command: str) -> tuple[int, str]:
    import shlex

    from normswap_cli.app import app
    from typer.testing import CliRunner

    words = shlex.split(command)
    if words[:2] == ["python", "-c"]:
        exec(compile(words[2], "<docs>", "exec"), {})
        return 0, ""
    assert words[0] == "normswap", f"a documented session runs normswap or python -c, not {words[0]}"
    # the repository's files (tests/model_zoo.py, examples/) as the reader's shell sees them
    words = [
        str(ROOT / w) if w.split(":")[0] in {"tests/model_zoo.py"} or w.startswith("examples/") else w
        for w in words
    ]
    ran = CliRunner().invoke(app, words[1:])
    return ran.exit_code, ran.output


def test_console_sessions_are_found():
    assert len(SESSIONS) >= 5, [s.id for s in SESSIONS]
    # the sessions left to their own tests are few, and each says where it is run
    assert len([s for s in SESSIONS if s.not_run]) <= 4
    assert all("test" in s.not_run for s in SESSIONS if s.not_run)


@pytest.mark.parametrize("session", SESSIONS, ids=[s.id for s in SESSIONS])
def test_console_session_runs(session: Session, tmp_path, monkeypatch):
    if session.not_run:
        pytest.skip(f"not run here: {session.not_run}")
    monkeypatch.chdir(tmp_path)
    for command in session.commands:
        code, output = _run_command(command)
        assert code == 0, f"{session.id}: `{command}` exited {code}:\n{output}"
