"""The documentation: README.md is a short front page whose links work, and docs/ builds into a site with
MkDocs in strict mode, so a broken link, a missing anchor or a page left out of the nav fails the tests.

mkdocs.yml sets ``validation:`` so that unrecognized links and missing anchors are warnings, which
``--strict`` turns into a failed build; the second test shows that it does fail.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 260

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site),
        ],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_docs_build_strictly(tmp_path):
    done = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "index.html").is_file()


@pytest.mark.parametrize(
    ("link", "complaint"),
    [
        ("no-such-page.md", "no-such-page.md"),
        ("inspect.md#no-such-anchor", "does not contain an anchor '#no-such-anchor'"),
    ],
)
def test_strict_build_fails_on_a_broken_link(tmp_path, link, complaint):
    # The same docs and config, one page more, in the nav, whose only fault is its link.
    shutil.copytree(ROOT / "docs", tmp_path / "docs")  # follows docs/img's link to the benchmark figure
    config = (ROOT / "mkdocs.yml").read_text()
    assert "paths: [.]" in config and "\nnav:\n" in config
    config = config.replace("paths: [.]", f"paths: [{ROOT.as_posix()!r}]")
    config = config.replace("\nnav:\n", "\nnav:\n  - Broken: broken.md\n", 1)
    (tmp_path / "mkdocs.yml").write_text(config)
    (tmp_path / "docs" / "broken.md").write_text(f"# Broken\n\nSee [this page]({link}).\n")

    done = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    warnings = [line for line in output.splitlines() if line.startswith("WARNING")]
    assert warnings, output
    assert all("'broken.md'" in line for line in warnings), output  # failed for this page alone
    assert any(complaint in line for line in warnings), output


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def _slugs(markdown: Path) -> set[str]:
    """The anchors of a page's headings, as both GitHub and MkDocs (Python-Markdown's toc) spell them:
    a README link must work in both places."""
    github, mkdocs = set(), set()
    inside_fence = False
    for line in markdown.read_text().splitlines():
        if line.startswith("```"):
            inside_fence = not inside_fence
        heading = re.match(r"#{1,6} (.+)", line)
        if inside_fence or not heading:
            continue
        text = re.sub(r"[`*]", "", heading.group(1)).strip().lower()
        github.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
        mkdocs.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip()))
    return github & mkdocs


def test_readme_links_point_at_files_that_exist():
    text = FENCE.sub("", README.read_text())
    links = [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]
    assert any(link.startswith("docs/") for link in links), "README.md links no docs page"
    for link in links:
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else README
        assert target.exists(), f"README.md links {link}: {target.relative_to(ROOT)} does not exist"
        if anchor:
            assert anchor in _slugs(target), (
                f"README.md links {link}: no such heading in {path or 'README.md'}"
            )


def test_every_docs_page_is_linked_from_the_readme():
    linked = {link.partition("#")[0] for link in LINK.findall(README.read_text())}
    pages = {page.relative_to(ROOT).as_posix() for page in (ROOT / "docs").rglob("*.md")}
    missing = pages - linked - {"docs/index.md"}  # index.md is the site's copy of this page
    assert not missing, f"README.md's 'Where to read on' should link: {sorted(missing)}"


def test_readme_quick_start_is_what_ci_runs():
    readme = README.read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [block.strip() for block in re.findall(r"```bash\n(.*?)```", quick_start, re.S)]
    assert len(commands) == 2, commands  # one sets up and runs the example, one runs the tests
    setup_and_example, setup_and_tests = commands
    assert "normswap convert examples/" in setup_and_example
    assert "pytest" in setup_and_tests
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert setup_and_tests in ci, f".ci/run does not run the README's test command:\n{setup_and_tests}"
    pytest_ci = next(line for line in ci if "pytest" in line and not line.startswith("#"))
    assert pytest_ci.split("&&")[-1].strip() == setup_and_tests.split("&&")[-1].strip()
