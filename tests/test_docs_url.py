"""Help and errors point at the published site named in the package metadata, not at `docs/`
paths the wheel does not ship."""

from pathlib import Path

from kvoffload._docs import DEFAULT_DOCS_URL, docs_root, docs_url

ROOT = Path(__file__).parents[1]


def test_the_documentation_url_comes_from_the_package_metadata():
    # The installed metadata is what `make build-ext` made from pyproject.toml's [project.urls].
    assert docs_root() == DEFAULT_DOCS_URL
    assert f'Documentation = "{DEFAULT_DOCS_URL}"' in (ROOT / "pyproject.toml").read_text()
    assert f"site_url: {DEFAULT_DOCS_URL}\n" in (ROOT / "mkdocs.yml").read_text()


def test_a_page_url_is_where_mkdocs_publishes_the_page():
    assert docs_url("simulator") == DEFAULT_DOCS_URL + "simulator/"
    assert docs_url("disk-tier", "capacity") == DEFAULT_DOCS_URL + "disk-tier/#capacity"
    assert docs_url("index") == DEFAULT_DOCS_URL
    # Every page a link can name exists in docs/.
    assert (ROOT / "docs" / "simulator.md").is_file()
