"""Checks that a built docs site needs no network to be viewed: no page or stylesheet loads a
script, stylesheet, font or image from another host, and no diagram is left for a script to draw
(Material fetches mermaid from a CDN for those). What scripts fetch as they run is not checked:
Material's asks GitHub for the repository's star count (`repo_url`), and shows none offline.
`make docs` runs it on site/ with the docs venv's Python, so it uses the standard library only.

    python tests/docs_offline.py site
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

# Attributes a browser fetches on its own; a <link> only for the relations that load something
# (a canonical or alternate link is an address, like an <a href>).
_FETCHED = {"script": "src", "img": "src", "iframe": "src", "source": "src", "embed": "src"}
_LOADING_RELS = {"stylesheet", "preconnect", "preload", "prefetch", "modulepreload", "icon"}
_CSS_URL = re.compile(r"""(?:@import\s+|url\()\s*["']?((?:https?:)?//[^"')\s]+)""")


def _external(url: str) -> bool:
    return url.startswith(("http://", "https://", "//"))


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.problems: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        url = values.get(_FETCHED.get(tag, ""), "")
        if tag == "link" and _LOADING_RELS & set(values.get("rel", "").split()):
            url = values.get("href", "")
        if _external(url):
            self.problems.append(f"<{tag}> loads {url}")
        if "mermaid" in values.get("class", ""):
            self.problems.append(f"<{tag} class={values['class']!r}> needs a script to draw")
        style = values.get("style", "")
        self.problems += [f"<{tag} style> loads {u}" for u in _CSS_URL.findall(style)]


def problems(site: Path) -> list[str]:
    """Every reference of `site` that would go to the network when a page is viewed."""
    found: list[str] = []
    for path in sorted(site.rglob("*")):
        if path.suffix == ".html":
            page = _Page()
            page.feed(path.read_text(encoding="utf-8"))
            found += [f"{path.relative_to(site)}: {p}" for p in page.problems]
        elif path.suffix == ".css":
            text = path.read_text(encoding="utf-8")
            found += [f"{path.relative_to(site)}: loads {u}" for u in _CSS_URL.findall(text)]
    return found


def main(argv: list[str]) -> int:
    (site,) = argv
    if not any(Path(site).rglob("*.html")):
        print(f"{site}: no HTML pages", file=sys.stderr)
        return 1
    found = problems(Path(site))
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
