"""The files of this source tree, with or without git: for the tests that read every file of the tree.

In a git checkout that is ``git ls-files`` (the tracked files). A source archive (``git archive``) or an
sdist has no repository, so there the tree is walked instead, leaving out what the tree's ``.gitignore``
files leave out (``.venv/``, ``build/``, ``*.egg-info/``, ...) and not descending into a symbolic link
or a nested repository, which git lists as one entry: the same files, so the same checks, either way.
``tests/test_source_tree.py`` holds the walk to git's own answer on this tree and on a tree of edge cases.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tree_files(root: Path = ROOT) -> list[str]:
    """Every file of the tree under ``root``, as paths relative to it with ``/``, sorted."""
    # Only at the repository's own top: an archive unpacked inside some other checkout must not be
    # answered by that checkout's index (which would list none of its files, and check nothing).
    if (root / ".git").exists() and shutil.which("git"):
        done = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
        if done.returncode == 0:
            return sorted(p for p in done.stdout.decode().split("\0") if p)
    return walk(root)


def walk(root: Path) -> list[str]:
    """The files under ``root`` that its ``.gitignore`` files do not leave out, as git would list them."""
    rules = Ignores()
    found = []
    for folder, dirs, files in os.walk(root):
        rel = Path(folder).relative_to(root).as_posix()
        base = "" if rel == "." else rel
        if ".gitignore" in files:
            rules.read(root / base / ".gitignore", base)
        kept = []
        for name in sorted(dirs):
            path = f"{base}/{name}" if base else name
            full = Path(folder) / name
            link = full.is_symlink()  # a link to a folder is a file to git: listed, never walked into
            if name == ".git" or rules.ignored(path, is_dir=not link):
                continue
            if link or (full / ".git").exists():  # a nested repository: one entry, as git lists it
                found.append(path)
            else:
                kept.append(name)
        dirs[:] = kept
        for name in files:
            path = f"{base}/{name}" if base else name
            if name != ".git" and not rules.ignored(path, is_dir=False):
                found.append(path)
    return sorted(found)


class Ignores:
    """The patterns of the ``.gitignore`` files read so far, matched as gitignore(5) says."""

    def __init__(self) -> None:
        self._rules: list[tuple[str, re.Pattern[str], bool, bool]] = []  # (folder, pattern, negated, dirs only)

    def read(self, path: Path, base: str) -> None:
        for line in path.read_text().splitlines():
            rule = _rule(line)
            if rule is not None:
                self._rules.append((base, *rule))

    def ignored(self, path: str, *, is_dir: bool) -> bool:
        """Whether ``path`` (relative to the tree, with ``/``) is left out; the last matching pattern decides.

        A deeper ``.gitignore`` is read after its parents, so its patterns come later and win, as in git.
        """
        out = False
        for base, pattern, negated, dirs_only in self._rules:
            if dirs_only and not is_dir:
                continue
            if base and not path.startswith(base + "/"):
                continue
            if pattern.fullmatch(path[len(base) + 1 :] if base else path):
                out = not negated
        return out


def _rule(line: str) -> tuple[re.Pattern[str], bool, bool] | None:
    if not line.strip() or line.startswith("#"):
        return None
    while line.endswith(" ") and not line.endswith("\\ "):  # trailing spaces, unless escaped
        line = line[:-1]
    negated = line.startswith("!")
    if negated or line.startswith(("\\!", "\\#")):
        line = line[1:]
    dirs_only = line.endswith("/")
    line = line.rstrip("/")
    anchored = "/" in line  # at the start or in the middle: relative to the .gitignore's folder
    line = line.lstrip("/")
    body = _translate(line)
    return re.compile(body if anchored else f"(?:.*/)?{body}"), negated, dirs_only


def _translate(glob: str) -> str:
    if glob == "**":
        return ".*"
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**/", i) and (i == 0 or glob[i - 1] == "/"):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("/**", i) and i + 3 == len(glob):
            out.append("/.*")
            i += 3
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        elif glob[i] == "\\" and i + 1 < len(glob):
            out.append(re.escape(glob[i + 1]))
            i += 2
        elif glob[i] == "[" and "]" in glob[i + 2 :]:
            end = glob.index("]", i + 2)
            inside = glob[i + 1 : end]
            if inside.startswith("!"):
                inside = "^" + inside[1:]
            out.append(f"[{inside}]")
            i = end + 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return "".join(out)
