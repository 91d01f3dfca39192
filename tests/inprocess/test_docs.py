"""The documentation stands alone: nothing points outside the repository, every citation of
docs/ALGORITHMS.md names a section that exists, and the reference's hyper-parameter tables
match the rules' ``Params`` classes (their single source of truth)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "ALGORITHMS.md"
#: what a user's clone must be readable with: the package, its docs and every shipped file
SCOPE = ("mpifl", "docs", "README.md", "CONTRIBUTING.md", "CHANGELOG.md", "jobs", "slurm",
         "analysis", "examples", "tools", "tests")
#: pointers to files outside the repository (the team's shared folder, its SPEC and DESIGN)
FORBIDDEN = (
    ("../shared", re.compile(re.escape("../shared"))),
    ("SPEC §", re.compile(r"\bSPEC\s*§")),
    ("SPEC.md", re.compile(r"\bSPEC\.md\b")),
    ('DESIGN "...', re.compile(r"\bDESIGN,?\s+\"")),
    # the team's issue tracker is not shipped: cite files, commits and papers instead
    ("issue N", re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)),
)
CITATION = re.compile(r"ALGORITHMS\.md((?:(?:\s*,\s*|\s+and\s+|\s+)§[0-9][0-9.\-–]*)+)")
SECTION_REF = re.compile(r"§([0-9][0-9.\-–]*)")


def _tracked_files() -> list[Path]:
    """The tracked text files in SCOPE (every file under it when git is not available)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *SCOPE], cwd=ROOT, check=True,
                             capture_output=True).stdout
        paths = [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for s in SCOPE for p in ((ROOT / s).rglob("*") if (ROOT / s).is_dir()
                                            else [ROOT / s])]
    assert paths, "no files found in scope"
    return [p for p in paths if p.is_file()]


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None  # binary (HDF5, PNG)


def _sections() -> dict[str, set[str]]:
    """Section number -> the numbers of its numbered items, from the reference's '## N.' headings."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        m = re.match(r"## (\d+)\. ", line)
        if m:
            current = m.group(1)
            sections[current] = set()
        elif line.startswith("## "):
            current = None
        elif current is not None:
            item = re.match(r"(\d+)\. ", line)
            if item:
                sections[current].add(item.group(1))
    return sections


def _missing(ref: str, sections: dict[str, set[str]]) -> list[str]:
    """The parts of one '§' reference ('7', '5.7', '0-1', '5.2-5.5') that do not exist."""
    bad = []
    for part in re.split(r"[-–]", ref.rstrip(".-–")):
        sec, _, item = part.partition(".")
        if sec not in sections or (item and item not in sections[sec]):
            bad.append(part)
    return bad


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_reference_exists_with_spec_numbering():
    sections = _sections()
    assert sorted(sections, key=int) == [str(i) for i in range(12)]
    # the numbered steps that code cites (FedFV's and FedLF's)
    assert {"1", "2", "3", "4", "5", "6"} <= sections["3"]
    assert {str(i) for i in range(1, 9)} <= sections["5"]


def test_nothing_points_outside_the_repository():
    hits = []
    for path in _tracked_files():
        text = _text(path)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if path == Path(__file__) and "re.compile(" in line:
                continue  # the patterns themselves
            for what, pattern in FORBIDDEN:
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{lineno}: {what}: {line.strip()}")
    assert not hits, "pointers outside the repository (cite docs/ALGORITHMS.md):\n" + "\n".join(hits)


def test_every_citation_names_an_existing_section():
    sections = _sections()
    bad, count = [], 0
    for path in _tracked_files():
        text = _text(path)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for m in CITATION.finditer(line):
                for ref in SECTION_REF.findall(m.group(1)):
                    count += 1
                    for part in _missing(ref, sections):
                        bad.append(f"{path.relative_to(ROOT)}:{lineno}: §{part}")
    assert count > 50, f"only {count} citations of ALGORITHMS.md found"
    assert not bad, "citations of sections that docs/ALGORITHMS.md lacks:\n" + "\n".join(bad)


def test_references_inside_the_reference_exist():
    sections = _sections()
    text = REFERENCE.read_text(encoding="utf-8")
    bad = [ref for ref in SECTION_REF.findall(text) if _missing(ref, sections)]
    assert not bad, f"docs/ALGORITHMS.md refers to missing sections: {bad}"


def test_readme_links_to_the_reference_resolve():
    anchors = {_slug(line.lstrip("#")) for line in REFERENCE.read_text(encoding="utf-8").splitlines()
               if line.startswith("#")}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/ALGORITHMS\.md)(?:#([^)\s]+))?\)", readme)
    assert links, "the README does not link to docs/ALGORITHMS.md"
    bad = [a for _, a in links if a and a not in anchors]
    assert not bad, f"README links to missing anchors of docs/ALGORITHMS.md: {bad}"


def _builtin_rules():
    from mpifl.aggregators import available, rule

    return [(name, rule(name)) for name in available()
            if rule(name).__module__.startswith("mpifl.aggregators.")]


def _rule_block(text: str, name: str) -> str:
    """The part of the reference that documents rule ``name``: from the line naming it as
    ``(`name`)`` (a §7 heading) or ``(`[name]`,`` (a hyper-parameter table) to the next heading."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if (line.startswith("### ") and f"(`{name}`)" in line) or f"(`[{name}]`," in line:
            block = []
            for later in lines[i + 1:]:
                if later.startswith("#"):
                    break
                block.append(later)
            return "\n".join(block)
    return ""


def _shown(default) -> str:
    if default is None:
        return "none"
    if isinstance(default, str):
        return f'`"{default}"`'
    return f"`{default!r}`"


@pytest.mark.parametrize("name", [n for n, _ in _builtin_rules()])
def test_hyper_parameter_tables_match_params(name):
    cls = dict(_builtin_rules())[name]
    text = REFERENCE.read_text(encoding="utf-8")
    fields = cls.Params.model_fields
    if not fields:
        assert re.search(rf"`\[{name}\]`", text) or f"(`{name}`)" in text, name
        return
    block = _rule_block(text, name)
    assert block, f"docs/ALGORITHMS.md has no hyper-parameter table for {name}"
    for key, field in fields.items():
        row = f"| `{key}` | {_shown(field.default)} |"
        assert row in block, f"{name}: expected the row '{row}' (from {cls.__name__}.Params)"


def test_the_architecture_table_lists_every_module():
    """docs/ARCHITECTURE.md's layer table names each module of each folder ("store: checkpoint,
    ..."), so a new module must be placed in a layer there too."""
    table = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    wrong = {}
    for folder in sorted(p for p in (ROOT / "mpifl").iterdir()
                         if p.is_dir() and (p / "__init__.py").exists()):
        found = re.search(rf"\b{folder.name}: ([a-z_0-9, ]+)", table)
        listed = set(found.group(1).replace(" ", "").split(",")) if found else set()
        modules = {m.stem for m in folder.glob("*.py") if m.stem != "__init__"}
        if listed != modules:
            wrong[folder.name] = {"missing": sorted(modules - listed),
                                  "gone": sorted(listed - modules)}
    assert not wrong, f"docs/ARCHITECTURE.md's layer table is out of date: {wrong}"


#: the quick start's commands that need an optional extra (pyproject.toml), and that extra
QUICK_START_EXTRAS = {"mpifl plot": "plot", "mpifl report": "plot", "mpiexec": "mpi"}


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/tutorials/install.md"])
def test_the_install_line_brings_what_the_quick_start_runs(page):
    """A newcomer who copies the install line can run every command of the README's quick
    start: its extras include each one those commands need (matplotlib for ``mpifl plot``,
    tabulate for ``report``'s table, mpi4py and MPICH for ``mpiexec``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    needed = {extra for command, extra in QUICK_START_EXTRAS.items() if command in quick}
    assert needed, "the README's quick start runs none of the commands this test knows"
    lines = re.findall(r'pip install -e "\.\[([a-z,]+)\]"',
                       (ROOT / page).read_text(encoding="utf-8"))
    assert lines, f"{page} has no install line"
    assert needed <= set(lines[0].split(",")), (page, lines[0], needed)
