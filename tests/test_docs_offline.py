"""The check `make docs` runs on the built site (tests/docs_offline.py): whatever a page would fetch
from another host is reported, addresses that are only links are not."""

from __future__ import annotations

from pathlib import Path

from docs_offline import main, problems

CLEAN = """<!doctype html><html><head>
<link rel="canonical" href="https://kvoffload.github.io/kvoffload/design/">
<link rel="stylesheet" href="../assets/stylesheets/main.css">
<script src="../assets/javascripts/bundle.js"></script>
</head><body>
<a href="https://github.com/kvoffload/kvoffload">the repository</a>
<pre class="language-text"><code>+--+</code></pre>
</body></html>"""

FETCHING = """<!doctype html><html><head>
<link rel="preconnect" href="https://fonts.gstatic.com" crossorigin>
<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">
<script src="https://unpkg.com/mermaid@11/dist/mermaid.min.js"></script>
</head><body>
<img src="//cdn.example.com/diagram.png">
<div style="background: url('https://cdn.example.com/bg.png')"></div>
<pre class="mermaid"><code>flowchart TB</code></pre>
</body></html>"""


def test_a_site_that_loads_only_its_own_files_passes(tmp_path: Path) -> None:
    (tmp_path / "design").mkdir()
    (tmp_path / "design" / "index.html").write_text(CLEAN)
    (tmp_path / "main.css").write_text("body { background: url(../img/bg.png) }")
    assert problems(tmp_path) == []
    assert main([str(tmp_path)]) == 0


def test_every_fetch_from_another_host_and_every_script_drawn_diagram_is_reported(
    tmp_path: Path,
) -> None:
    (tmp_path / "index.html").write_text(FETCHING)
    (tmp_path / "extra.css").write_text('@import "https://fonts.googleapis.com/css2?family=X";')
    assert problems(tmp_path) == [
        "extra.css: loads https://fonts.googleapis.com/css2?family=X",
        "index.html: <link> loads https://fonts.gstatic.com",
        "index.html: <link> loads https://fonts.googleapis.com/css?family=Roboto",
        "index.html: <script> loads https://unpkg.com/mermaid@11/dist/mermaid.min.js",
        "index.html: <img> loads //cdn.example.com/diagram.png",
        "index.html: <div style> loads https://cdn.example.com/bg.png",
        "index.html: <pre class='mermaid'> needs a script to draw",
    ]
    assert main([str(tmp_path)]) == 1


def test_a_folder_without_pages_is_not_a_site(tmp_path: Path) -> None:
    assert main([str(tmp_path)]) == 1
