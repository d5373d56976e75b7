from pathlib import Path

from fa4gen.render import jinja as render

REPO = Path(__file__).resolve().parent.parent


def test_templates_come_from_the_same_tree_as_the_code():
    # run from a checkout or worktree, an editable install of another checkout (which maps the
    # package fa4gen.templates to its own templates/) must not lend this code its templates
    assert render.templates_dir() == REPO / "templates"
    assert render.environment().loader.searchpath == [str(REPO / "templates")]
