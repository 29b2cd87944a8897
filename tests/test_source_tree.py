"""The tree's file list without git (tests/source_tree.py): the same files git lists, and the tests that read
every file of the tree pass from a copy of it that has no repository, as a source archive or an sdist has.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from source_tree import ROOT, tree_files, walk

GIT = shutil.which("git")
#: The tests that list the tree's files (they ran ``git ls-files`` themselves, and failed without a repository);
#: of test_settings_declared.py only its scans of the tree (the rest start the command line, 40 s of CI's time).
_DECLARED = "tests/test_settings_declared.py::"
TREE_TESTS = ["tests/test_version_pins.py",
              _DECLARED + "test_every_hicache_name_outside_tests_and_docs_is_a_declared_setting",
              _DECLARED + "test_no_hicache_variable_is_read_outside_settings",
              _DECLARED + "test_settings_are_constructed_only_where_they_are_declared"]  # fmt: skip


def _git(root: Path, *args: str) -> list[str]:
    out = subprocess.run(["git", *args, "-z"], cwd=root, capture_output=True, check=True).stdout.decode()
    return [p.rstrip("/") for p in out.split("\0") if p]  # an untracked nested repository is listed as "dir/"


def _untracked(root: Path) -> list[str]:
    # Only the .gitignore files, as the walk reads them: not .git/info/exclude nor a user's global excludes.
    return _git(root, "ls-files", "--others", "--exclude-per-directory=.gitignore")


@pytest.mark.skipif(GIT is None or not (ROOT / ".git").exists(), reason="needs git and this tree's repository")
def test_the_walk_lists_what_git_lists_on_this_tree():
    """Tracked files and untracked ones git does not ignore: the walk leaves out exactly what git leaves out."""
    tracked = [p for p in _git(ROOT, "ls-files") if os.path.lexists(ROOT / p)]  # not one deleted in the checkout
    expected = sorted(set(tracked) | set(_untracked(ROOT)))
    assert walk(ROOT) == expected
    assert tree_files(ROOT) == sorted(_git(ROOT, "ls-files"))  # in a checkout, the tracked files as before


@pytest.mark.skipif(GIT is None, reason="needs git, the reference the walk is held to")
def test_the_walk_reads_gitignore_as_git_does(tmp_path):
    """Edge cases of gitignore(5), each decided by a real git on the same tree."""
    files = {
        ".gitignore": (ROOT / ".gitignore").read_text() + "*.log\n!keep.log\n/top-only.txt\nout/\nlib/**/gen\n"
        "a?c.txt\n[xy].tmp\n\\#hash\ntrailing.txt   \n",
        "keep.log": "", "drop.log": "", "top-only.txt": "", "sub/top-only.txt": "", "sub/out": "",
        "sub/out2/out/x": "", "out/y": "", "lib/one/two/gen/z": "", "lib/gen": "", "abc.txt": "", "abbc.txt": "",
        "x.tmp": "", "z.tmp": "", "#hash": "", "trailing.txt": "", "src/a.py": "", "src/.venv/b.py": "",
        "build/c.py": "", "pkg.egg-info/PKG-INFO": "", "pkg/__pycache__/m.pyc": "",
        "nested/.gitignore": "!*.log\nlocal/\n/only-here\n", "nested/again.log": "", "nested/local/q": "",
        "nested/only-here": "", "nested/deeper/only-here": "", "site/index.html": "", "deep/site/index.html": "",
    }  # fmt: skip
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results").symlink_to("../src")  # a link to a folder: one entry, never walked into
    (tmp_path / "vendored" / ".git").mkdir(parents=True)  # a nested repository: one entry
    (tmp_path / "vendored" / "inner.py").write_text("")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path / "vendored", check=True)
    listed = walk(tmp_path)
    assert listed == sorted(_untracked(tmp_path))
    assert "keep.log" in listed and "drop.log" not in listed and "nested/again.log" in listed  # not vacuous


def test_the_tree_checks_pass_from_a_copy_without_git(tmp_path):
    """What a source archive holds, without .git: the tests that list the tree read it and pass."""
    copy = tmp_path / "src"
    # What the tree holds, as an archive would: the walk, not git's index (a copy of the checkout whose index
    # lags its files, as the GPU machine's does, left a new module out of the copy).
    for rel in walk(ROOT):
        source, target = ROOT / rel, copy / rel
        if not os.path.lexists(source):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    assert not (copy / ".git").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GIT_"))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *TREE_TESTS],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
