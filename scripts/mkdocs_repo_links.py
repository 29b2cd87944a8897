"""MkDocs hook: links from a page to files of the repository outside docs/ (code, examples).

The site carries only docs/, so such a link has no target there. A link whose file exists in the
repository becomes its text (a code span naming the path where the text is plain); a link to a file
that does not exist is a warning, which ``mkdocs build --strict`` turns into a failure. On GitHub the
same Markdown keeps its links.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repo_links")
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)", re.MULTILINE)


def _rewrite(text: str, page_dir: Path, docs_dir: Path, page: str) -> str:
    def one(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
            return match.group(0)
        # normpath, not resolve: docs/results is a link into benchmarks/, and belongs to the site
        path = Path(os.path.normpath(page_dir / target.split("#", 1)[0]))
        if path == docs_dir or docs_dir in path.parents:
            return match.group(0)
        if not path.exists():
            log.warning("Doc file '%s' links to '%s', which is not in the repository", page, target)
            return match.group(0)
        return label if label.startswith("`") else f"{label} (`{target.lstrip('./')}`)"

    return LINK.sub(one, text)


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = Path(os.path.normpath(config["docs_dir"]))
    page_dir = Path(page.file.abs_src_path).parent
    # Fenced code keeps its text: only prose between fences is rewritten.
    parts = re.split(r"(^(?:```|~~~).*?^(?:```|~~~)[^\n]*$)", markdown, flags=re.MULTILINE | re.DOTALL)
    return "".join(p if FENCE.match(p) else _rewrite(p, page_dir, docs_dir, page.file.src_uri) for p in parts)
