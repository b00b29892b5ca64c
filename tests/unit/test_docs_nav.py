"""Every page of the documentation can be found: each ``.md`` page under ``docs/`` is in ``mkdocs.yml``'s nav and is
linked from ``docs/index.md``, and each nav entry is a page that exists.

``mkdocs build --strict`` (``tests/unit/test_docs.py``) fails a nav entry whose file is missing, but a page left out
of the nav is only an INFO line there, and nothing checks the index page: a new page can be written, tested and never
reached. Files that ``exclude_docs`` matches (with mkdocs' own default exclusions, ``.*`` and ``/templates/``) are
not pages: they are neither required in the nav nor allowed there. A page matched by ``not_in_nav`` needs no nav
entry, as mkdocs itself intends, but is still linked from the index.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any, Dict, List, Set

import pathspec
import yaml

ROOT = Path(__file__).resolve().parents[2]

#: mkdocs excludes these before ``exclude_docs`` is read (``mkdocs.structure.files._default_exclude``).
DEFAULT_EXCLUDES = (".*", "/templates/")
#: ``[text](target)`` with an optional ``#anchor`` or ``"title"``; images and external links are filtered below.
LINK = re.compile(r"\]\(\s*<?([^)\s#>]+)")


def _spec(lines: Any) -> pathspec.PathSpec:
    text = lines if isinstance(lines, str) else ""
    return pathspec.GitIgnoreSpec.from_lines(text.splitlines())


def nav_pages(nav: Any) -> List[str]:
    """The page paths of a nav, in order (``- Title: page.md``, ``- page.md``, sections nested as lists); external
    links (``https://...``) are not pages."""
    out: List[str] = []
    items = nav if isinstance(nav, list) else [nav]
    for item in items:
        if isinstance(item, str):
            if "://" not in item:
                out.append(posixpath.normpath(item))
        elif isinstance(item, dict):
            for value in item.values():
                out += nav_pages(value)
        elif isinstance(item, list):
            out += nav_pages(item)
    return out


def doc_pages(docs_dir: Path, config: Dict[str, Any]) -> List[str]:
    """The ``.md`` files under ``docs_dir`` that mkdocs builds as pages (relative POSIX paths), excluded ones left
    out."""
    excluded = _spec("\n".join(DEFAULT_EXCLUDES)) + _spec(config.get("exclude_docs"))
    pages = (p.relative_to(docs_dir).as_posix() for p in docs_dir.rglob("*.md"))
    return sorted(p for p in pages if not excluded.match_file(p))


def index_links(index: Path, docs_dir: Path) -> Set[str]:
    """The pages under ``docs_dir`` that ``index`` links to (relative targets, resolved from the index's folder)."""
    base = index.parent.relative_to(docs_dir).as_posix()
    links = set()
    for target in LINK.findall(index.read_text(encoding="utf-8")):
        if "://" in target or target.startswith(("mailto:", "/")) or not target.endswith(".md"):
            continue
        links.add(posixpath.normpath(posixpath.join(base, target)))
    return links


def nav_problems(root: Path, config: Dict[str, Any]) -> List[str]:
    """What is wrong with the site's reachability, one line each; empty when every page is in the nav and linked
    from the index, and every nav entry is a page."""
    docs_dir = root / config.get("docs_dir", "docs")
    shown = docs_dir.relative_to(root).as_posix()
    pages = doc_pages(docs_dir, config)
    nav = nav_pages(config.get("nav", []))
    optional_in_nav = _spec(config.get("not_in_nav"))
    index = docs_dir / "index.md"
    linked = index_links(index, docs_dir) if index.is_file() else set()
    problems = []
    if not index.is_file():
        problems.append(f"{shown}/index.md does not exist: it is the page that lists every other page")
    for page in pages:
        if page not in nav and not optional_in_nav.match_file(page):
            problems.append(f"{shown}/{page} is not in mkdocs.yml's nav (add it where a reader would look for it)")
        if page != "index.md" and page not in linked:
            problems.append(f"{shown}/{page} is not linked from {shown}/index.md (add a line saying what it holds)")
    for entry in nav:
        if entry not in pages:
            why = "is excluded by exclude_docs" if (docs_dir / entry).is_file() else "does not exist"
            problems.append(f"mkdocs.yml's nav names {entry}, which {why}")
    repeated = sorted({entry for entry in nav if nav.count(entry) > 1})
    problems += [f"mkdocs.yml's nav names {entry} more than once" for entry in repeated]
    return problems


def _config(root: Path) -> Dict[str, Any]:
    return yaml.safe_load((root / "mkdocs.yml").read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------------------------------- the site


def test_every_page_is_in_the_nav_and_linked_from_the_index():
    problems = nav_problems(ROOT, _config(ROOT))
    assert not problems, "\n".join(problems)


def test_the_check_sees_the_real_site():
    config = _config(ROOT)
    pages = doc_pages(ROOT / "docs", config)
    assert "index.md" in pages and "algorithms/rl.md" in pages and len(pages) >= 20, pages
    assert "gen_config_reference.py" not in pages  # exclude_docs holds it; it is no .md page either way
    assert len(nav_pages(config["nav"])) >= 20


# ---------------------------------------------------------------------------------- the check can fail (planted)


def _plant(tmp_path: Path, index: str, nav: list, exclude: str = "") -> List[str]:
    docs = tmp_path / "docs"
    for page in ("index.md", "a.md", "algorithms/b.md", "drafts/wip.md", ".hidden.md"):
        (docs / page).parent.mkdir(parents=True, exist_ok=True)
        (docs / page).write_text("# page\n")
    (docs / "index.md").write_text(index)
    config: Dict[str, Any] = {"docs_dir": "docs", "nav": nav}
    if exclude:
        config["exclude_docs"] = exclude
    return nav_problems(tmp_path, config)


WHOLE_INDEX = "- [A](a.md): a.\n- [B](./algorithms/b.md#first): b, with an anchor.\n- [WIP](drafts/wip.md)\n"
WHOLE_NAV = ["index.md", {"A": "a.md"}, {"Algorithms": [{"B": "algorithms/b.md"}]}, "drafts/wip.md"]


def test_a_complete_planted_site_has_no_problem(tmp_path):
    assert _plant(tmp_path, WHOLE_INDEX, WHOLE_NAV) == []


def test_a_page_missing_from_the_nav_is_named(tmp_path):
    nav = ["index.md", {"A": "a.md"}, "drafts/wip.md"]
    assert _plant(tmp_path, WHOLE_INDEX, nav) == [
        "docs/algorithms/b.md is not in mkdocs.yml's nav (add it where a reader would look for it)"
    ]


def test_a_page_the_index_does_not_link_is_named(tmp_path):
    index = "- [A](a.md)\n- [WIP](drafts/wip.md)\n- [elsewhere](https://example.org/b.md)\n"
    assert _plant(tmp_path, index, WHOLE_NAV) == [
        "docs/algorithms/b.md is not linked from docs/index.md (add a line saying what it holds)"
    ]


def test_a_nav_entry_without_a_page_and_a_repeated_one_are_named(tmp_path):
    nav = WHOLE_NAV + [{"Gone": "gone.md"}, {"A again": "a.md"}]
    assert _plant(tmp_path, WHOLE_INDEX, nav) == [
        "mkdocs.yml's nav names gone.md, which does not exist",
        "mkdocs.yml's nav names a.md more than once",
    ]


def test_excluded_files_are_not_pages(tmp_path):
    # drafts/ excluded: its page needs neither nav nor index, and may not stay in the nav; .hidden.md never counts
    index = "- [A](a.md)\n- [B](algorithms/b.md)\n"
    assert _plant(tmp_path, index, WHOLE_NAV[:3], exclude="drafts/\n") == []
    assert _plant(tmp_path, index, WHOLE_NAV, exclude="drafts/\n") == [
        "mkdocs.yml's nav names drafts/wip.md, which is excluded by exclude_docs"
    ]
