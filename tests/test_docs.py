"""The docs match the code: docs/models.md names every choice the config accepts, and docs/index.md maps every page.

The choices are found by reading config.py, not listed here, so a choice added to the config later fails this test
until docs/models.md documents it."""

import ast
import re
from pathlib import Path

import pytest

from tformer import config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _choice_fields() -> dict[str, tuple[str, ...]]:
    """Each config field checked by `check_choice(key, value, TUPLE)` in config.py, with the tuple's values."""
    tree = ast.parse(Path(config.__file__).read_text())
    fields = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check_choice":
            key, _, choices = node.args
            fields[ast.literal_eval(key)] = getattr(config, choices.id)
    return fields


def test_the_config_checks_choices_the_test_can_find():
    # if check_choice were renamed or its calls moved, the checks below would pass on nothing
    fields = _choice_fields()
    assert fields["family"] == config.FAMILIES
    assert fields["ffn"] == config.FFN_NAMES
    assert len(fields) >= 10


@pytest.mark.parametrize("field", sorted(_choice_fields()))
def test_models_doc_names_every_choice_of_every_field(field):
    text = (DOCS / "models.md").read_text()
    missing = [choice for choice in _choice_fields()[field] if f"`{choice}`" not in text]
    assert f"`{field}`" in text, f"docs/models.md does not name the config field `{field}`; document it"
    assert not missing, f"docs/models.md does not name {field} choices {missing}; document them in its config section"


def test_the_docs_index_links_every_page_of_the_docs():
    index = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)(?:#[^)]*)?\)", index))
    pages = {path.name for path in DOCS.glob("*.md")} - {"index.md"}
    assert not pages - linked, f"docs/index.md does not link {sorted(pages - linked)}; add each to its map"
    assert not linked - pages, f"docs/index.md links missing pages {sorted(linked - pages)}"
