"""Help and errors point at the published site named in the package metadata, not at `docs/`
paths the wheel does not ship."""

from importlib.metadata import metadata
from pathlib import Path

from kvoffload import _docs
from kvoffload._docs import DEFAULT_DOCS_URL, docs_root, docs_url

ROOT = Path(__file__).parents[1]


def test_the_documentation_url_comes_from_the_package_metadata(monkeypatch):
    # The installed metadata is what `make build-ext` made from pyproject.toml's [project.urls].
    urls = metadata("kvoffload").get_all("Project-URL")
    assert f"Documentation, {DEFAULT_DOCS_URL}" in urls
    assert docs_root() == DEFAULT_DOCS_URL
    # A fork's metadata names its own site, and help follows it.
    fork = {"Project-URL": ["Homepage, https://x.example", "Documentation, https://docs.x.example"]}

    class Fork:
        def get_all(self, key):
            return fork.get(key)

    monkeypatch.setattr(_docs, "metadata", lambda name: Fork())
    assert docs_url("simulator") == "https://docs.x.example/simulator/"
    assert f'Documentation = "{DEFAULT_DOCS_URL}"' in (ROOT / "pyproject.toml").read_text()
    assert f"site_url: {DEFAULT_DOCS_URL}\n" in (ROOT / "mkdocs.yml").read_text()


def test_a_page_url_is_where_mkdocs_publishes_the_page():
    assert docs_url("simulator") == DEFAULT_DOCS_URL + "simulator/"
    assert docs_url("disk-tier", "capacity") == DEFAULT_DOCS_URL + "disk-tier/#capacity"
    assert docs_url("index") == DEFAULT_DOCS_URL
    # Every page a link can name exists in docs/.
    assert (ROOT / "docs" / "simulator.md").is_file()
