"""Where the documentation lives, for help strings and errors: the `Documentation` URL of the
installed package's metadata (the wheel ships no `docs/` folder), so a fork that publishes its own
site only changes `[project.urls]`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, metadata

# The published site; used when the package metadata cannot be read (a bare source tree).
DEFAULT_DOCS_URL = "https://kvoffload.github.io/kvoffload/"


def docs_root() -> str:
    try:
        urls = metadata("kvoffload").get_all("Project-URL") or []
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        urls = []
    for entry in urls:
        label, _, url = str(entry).partition(",")
        if label.strip().lower() == "documentation" and url.strip():
            return url.strip().rstrip("/") + "/"
    return DEFAULT_DOCS_URL


def docs_url(page: str, anchor: str = "") -> str:
    """The address of one page of the site (`page` is the Markdown file's stem, as MkDocs
    publishes it: `simulator` -> `.../simulator/`), with an optional `#anchor`."""
    url = docs_root() + (f"{page}/" if page and page != "index" else "")
    return f"{url}#{anchor}" if anchor else url
