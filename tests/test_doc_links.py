"""Every relative link in README.md and the pages under docs/ resolves.

A link [text](path) must name an existing file; [text](page.md#anchor) and
[text](#anchor) must also name a heading of that page, by GitHub's anchor
rule (lowercase; punctuation other than '-' and '_' dropped; each space a
'-'; a repeated heading gets -1, -2, ...). Headings inside ``` blocks do not
count. Web links (http:, https:, mailto:) are not checked.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^()\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(text):
  """The anchors GitHub gives the headings of a markdown page."""
  seen, out = {}, set()
  for title in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", _FENCE.sub("", text), re.M):
    slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    out.add(slug if n == 0 else f"{slug}-{n}")
  return out


def broken_links(pages):
  """'page: target (why)' for each relative link of pages that does not resolve."""
  bad = []
  for page in pages:
    for target in _LINK.findall(_FENCE.sub("", page.read_text())):
      if re.match(r"[a-z]+:", target):
        continue
      path, _, anchor = target.partition("#")
      dest = (page.parent / path).resolve() if path else page
      if not dest.exists():
        bad.append(f"{page.name}: {target} (no such file)")
      elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
        bad.append(f"{page.name}: {target} (no such heading)")
  return bad


def test_every_doc_link_resolves():
  pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  bad = broken_links(pages)
  assert not bad, "broken links:\n" + "\n".join(bad)


def test_a_broken_link_is_reported(tmp_path):
  (tmp_path / "a.md").write_text("# Top\n\n## The bf16 step (CPU)\n\n## Top\n")
  (tmp_path / "b.md").write_text(
      "[ok](a.md#the-bf16-step-cpu) [ok](a.md#top-1) [ok](#x)\n# X\n"
      "```\n# not a heading\n[skipped](gone.md)\n```\n"
      "[bad](a.md#not-a-heading) [bad](gone.md) [web](https://example.com/x.md#y)\n")
  assert broken_links([tmp_path / "b.md"]) == [
      "b.md: a.md#not-a-heading (no such heading)", "b.md: gone.md (no such file)"]
