"""The README and docs/ link only to what exists: every relative link names a file of the checkout and every
`#anchor` a heading of its target, as GitHub and mkdocs read them. This runs without mkdocs, so `make test` stays
light; `make docs` builds the site with `mkdocs build --strict` on top of it."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+\1")
# [text](target) and ![alt](target), with an optional "title"; the text may hold one level of brackets.
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks: a link in a code block is an example, not a link."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _plain(heading: str) -> str:
    # What both renderers slug: the heading's text without its markup (code ticks, emphasis, link targets).
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[`*]", "", text)


def github_slug(heading: str) -> str:
    """GitHub's anchor: lower case, punctuation but `-` and `_` dropped, each space a `-` (runs not merged)."""
    text = re.sub(r"[^\w\- ]", "", _plain(heading).strip().lower())
    return text.replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """Python-Markdown's toc slugify, which mkdocs uses: runs of spaces and `-` become one `-`."""
    text = unicodedata.normalize("NFKD", _plain(heading)).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    """The anchors a link may use: a heading's slug where GitHub and mkdocs agree on it, so a link works in both."""
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match and github_slug(match[2]) == mkdocs_slug(match[2]):
            found.add(github_slug(match[2]))
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of `page` whose file or heading does not exist, as 'page:line: target (why)'."""
    docs = root / "docs"
    problems = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not target or SCHEME.match(target) or target.startswith("//"):
                continue  # web addresses are not checked: the tests run offline
            where = f"{page.relative_to(root)}:{number}: {target}"
            path_part, _, anchor = unquote(target).partition("#")
            if path_part.startswith("/"):
                problems.append(f"{where} (absolute: GitHub and mkdocs resolve it differently)")
                continue
            resolved = (page.parent / path_part).resolve() if path_part else page.resolve()
            if not resolved.exists():
                problems.append(f"{where} (no such file)")
                continue
            if docs in page.resolve().parents and docs not in resolved.parents:
                # mkdocs publishes docs/ alone: a link out of it is broken on the site. Name such a file in code.
                problems.append(f"{where} (outside docs/: the site has no such page)")
                continue
            if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where} (no heading '#{anchor}' in {resolved.relative_to(root)})")
    return problems


def test_every_relative_link_and_anchor_resolves():
    problems = [problem for page in pages() for problem in broken_links(page)]
    assert problems == [], "broken links:\n" + "\n".join(problems)


def test_the_check_finds_a_missing_file_a_missing_heading_and_a_link_out_of_docs(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "notes.txt").write_text("outside docs/\n")
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Real heading, with `code`\n")
    page = tmp_path / "docs" / "a.md"
    page.write_text(
        "# A\n\n## Own heading\n\n"
        "[fine](b.md#real-heading-with-code) [fine](#own-heading) [fine](b.md) [web](https://example.com/x.md)\n"
        "[gone](missing.md) [no anchor](b.md#nope) [own gone](#nope) [out](../notes.txt)\n"
        "`[in code](missing.md)`\n"
        "```\n[in a fence](missing.md)\n```\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md (no such file)",
        "b.md#nope (no heading '#nope' in docs/b.md)",
        "#nope (no heading '#nope' in docs/a.md)",
        "../notes.txt (outside docs/: the site has no such page)",
    ]
    assert all(p.startswith("docs/a.md:6: ") for p in problems)


@pytest.mark.parametrize(
    ("heading", "slug"),
    [("Checkpoints and outputs", "checkpoints-and-outputs"), ("`torch_compile`", "torch_compile"),
     ("GRPO: online RL with verifiable rewards", "grpo-online-rl-with-verifiable-rewards"),
     ("DPO and reward models (preference)", "dpo-and-reward-models-preference")],
)  # fmt: skip
def test_slugs_are_those_of_github_and_mkdocs(heading, slug):
    assert github_slug(heading) == mkdocs_slug(heading) == slug


def test_a_heading_the_two_renderers_slug_differently_is_no_anchor(tmp_path):
    # GitHub keeps both dashes of "a - b" ("a---b"), mkdocs merges them ("a-b"): a link to either breaks somewhere.
    page = tmp_path / "a.md"
    page.write_text("# a - b\n")
    assert anchors(page) == set()


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return [page for item in nav for page in _nav_pages(item)]


def test_the_site_lists_every_docs_page_once_and_nothing_else():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert sorted(nav) == sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))


def test_the_readme_is_a_five_minute_read():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
