"""The code's comments point to docs/design-notes.md by section, `(docs/design-notes.md, "engine/runner.py")`:
every pointer names a section there, and every section names a file of src/tformer, so a measurement moved out
of the code can always be found from it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tformer"
NOTES = ROOT / "docs" / "design-notes.md"
# a pointer may break across lines: a comment's `# "name"` or a docstring's next line
POINTER = re.compile(r'docs/design-notes\.md,\s*(?:#\s*)?"([^"]+)"')


def _sections() -> list[str]:
    return re.findall(r"^## (\S+)$", NOTES.read_text(), re.MULTILINE)


def _pointers() -> list[tuple[str, str]]:
    """(file, section named) for every pointer in src/tformer."""
    return [
        (path.relative_to(SRC).as_posix(), name)
        for path in sorted(SRC.rglob("*.py"))
        for name in POINTER.findall(path.read_text())
    ]


def test_the_pattern_finds_pointers_on_one_line_and_across_lines():
    one_line = '# why (docs/design-notes.md, "engine/runner.py")'
    across = '# why (docs/design-notes.md,\n# "engine/runner.py")'
    in_docstring = 'why (docs/design-notes.md,\n    "engine/runner.py")."""'
    assert [POINTER.findall(text) for text in (one_line, across, in_docstring)] == [["engine/runner.py"]] * 3


def test_every_pointer_names_a_section_of_the_design_notes():
    pointers = _pointers()
    assert len(pointers) >= 20, "the pattern no longer finds the code's pointers; update POINTER"
    sections = set(_sections())
    missing = [f"{path} -> {name!r}" for path, name in pointers if name not in sections]
    assert not missing, f"pointers to no section of docs/design-notes.md: {missing}; add the section (## file)"


def test_every_section_names_a_file_of_the_package_once():
    sections = _sections()
    assert len(sections) == len(set(sections)), "a file has two sections in docs/design-notes.md; merge them"
    gone = [name for name in sections if not (SRC / name).is_file()]
    assert not gone, f"docs/design-notes.md has sections for files that no longer exist: {gone}; rename them"
