"""The repository stands alone: every cited markdown file exists, and every cited section is there.

Scans the tracked text files (`git ls-files`; a walk of the tree where there is no git) for
markdown links and bare mentions of markdown files (any name ending in `.md`), resolved against
the citing file's directory and the repository root; URLs are skipped. Citations of a document
under docs/ by section number (docs/architecture.md section 3.7; also lists and ranges such as
sections 3.3-3.5, 3.8) or by a quoted heading title (docs/design.md "Batches") must name a
heading of that document.
Failures list every culprit as file:line. (This file spells made-up names in pieces, so that it
does not cite them itself.)
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
TEXT_SUFFIXES = ('.py', '.md', '.sh', '.toml', '.cfg', '.txt')
SKIP_DIRS = {'.git', '.venv', 'node_modules', '__pycache__'}

URL = re.compile(r'[a-z][a-z0-9+.-]*://\S+', re.I)
MD_LINK = re.compile(r'\[[^\]]*\]\(\s*<?([^)\s>]+?\.md)(?:#[^)\s]*)?>?\s*\)')
MD_MENTION = re.compile(r'(?<![\w/.-])((?:\.{1,2}/)?[\w][\w./-]*\.md)\b(?![\w-])')
# A document cited by a capitalised name without the suffix, followed by a section number.
BARE_DOC = re.compile(r'\b([A-Z][A-Z_]{3,})(?=\s+sections?\s+\d)')
# A reference to one of our numbered docs: the path, then section numbers and/or a quoted title.
# Comment markers and line breaks may sit between the parts of a citation.
_GAP = r'[\s#*>]*'
SECTIONS = re.compile(
    r'(?P<doc>docs/[\w-]+\.md)' + r"(?:'s)?,?" + _GAP +
    r'(?:(?:sections?|§)' + _GAP + r')?'
    r'(?P<nums>\d+(?:\.\d+)*(?:' + _GAP + r'(?:,|-|–|and|to)' + _GAP + r'\d+(?:\.\d+)*)*)?'
    r'(?:,?' + _GAP + r'(?:sections?' + _GAP + r')?"(?P<title>[A-Za-z][^"\n]{1,79})")?')
HEADING = re.compile(r'^#{1,6}\s+(?:(?P<num>\d+(?:\.\d+)*)\.?\s+)?(?P<title>.+?)\s*#*\s*$')


def tracked_text_files() -> list[str]:
  """Repository-relative paths of the text files under version control."""
  try:
    out = subprocess.run(['git', 'ls-files', '-z'], cwd=ROOT, capture_output=True, check=True)
    paths = [p for p in out.stdout.decode().split('\0') if p]
  except (OSError, subprocess.CalledProcessError):
    paths = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
      dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith('.egg-info')]
      paths += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames]
  return sorted(p for p in paths
                if (p.endswith(TEXT_SUFFIXES) or p.startswith(('configs/', '.ci/')))
                and os.path.isfile(os.path.join(ROOT, p)))


def _read(path: str) -> str:
  with open(os.path.join(ROOT, path), encoding='utf-8', errors='replace') as f:
    return f.read()


def _line_of(text: str, offset: int) -> int:
  return text.count('\n', 0, offset) + 1


def _resolves(citing: str, target: str) -> bool:
  here = os.path.dirname(os.path.join(ROOT, citing))
  return any(os.path.isfile(os.path.normpath(os.path.join(base, target))) for base in (here, ROOT))


def md_citations(path: str, text: str):
  """(line, cited path) of every markdown link to, or bare mention of, a `.md` file."""
  blanked = URL.sub(lambda m: ' ' * len(m.group()), text)  # keep offsets, drop URLs
  seen = set()
  for pattern, suffix in ((MD_LINK, ''), (MD_MENTION, ''), (BARE_DOC, '.' + 'md')):
    for m in pattern.finditer(blanked):
      if m.start(1) in seen:
        continue
      seen.add(m.start(1))
      yield _line_of(text, m.start(1)), m.group(1) + suffix


def broken_md_citations() -> list[str]:
  return [f'{path}:{line}: {target}'
          for path in tracked_text_files()
          for line, target in md_citations(path, _read(path))
          if not _resolves(path, target)]


@functools.cache
def headings(doc: str) -> tuple[set[str], tuple[str, ...]]:
  """(section numbers, heading titles) of a markdown document."""
  nums, titles = set(), []
  in_code = False
  for line in _read(doc).splitlines():
    if line.lstrip().startswith('```'):
      in_code = not in_code
      continue
    m = None if in_code else HEADING.match(line)
    if m:
      if m.group('num'):
        nums.add(m.group('num'))
      titles.append(m.group('title'))
  return nums, tuple(titles)


def _expand(nums: str) -> list[str]:
  """'3.3-3.5, 3.8 and 6' -> ['3.3', '3.4', '3.5', '3.8', '6']."""
  out = []
  for part in re.split(r'\s*(?:,|and)\s*', nums.replace('#', ' ')):
    ends = [e.strip() for e in re.split(r'-|–|\bto\b', part) if e.strip()]
    if len(ends) == 2:
      a, b = ends
      head_a, _, last_a = a.rpartition('.')
      head_b, _, last_b = b.rpartition('.')
      if head_a == head_b and last_a.isdigit() and last_b.isdigit():
        out += [f'{head_a}.{i}' if head_a else str(i) for i in range(int(last_a), int(last_b) + 1)]
        continue
    out += ends
  return out


def section_citations():
  """(citing file, line, doc, section number or None, title or None) of citations of docs/."""
  for path in tracked_text_files():
    text = _read(path)
    for m in SECTIONS.finditer(text):
      line = _line_of(text, m.start())
      for num in _expand(m.group('nums')) if m.group('nums') else ():
        yield path, line, m.group('doc'), num, None
      if m.group('title'):
        yield path, line, m.group('doc'), None, m.group('title')


def missing_sections() -> list[str]:
  out = []
  for path, line, doc, num, title in section_citations():
    if not os.path.isfile(os.path.join(ROOT, doc)):
      continue  # reported by the link check
    nums, titles = headings(doc)
    if num is not None and num not in nums:
      out.append(f'{path}:{line}: {doc} has no section {num}')
    if title is not None and not any(title.lower() in t.lower() for t in titles):
      out.append(f'{path}:{line}: {doc} has no heading "{title}"')
  return out


def test_every_cited_md_file_exists():
  broken = broken_md_citations()
  assert not broken, (f'{len(broken)} citation(s) of .md files that are not in the repository '
                      '(cite docs/architecture.md, docs/design.md or docs/performance.md):\n'
                      + '\n'.join(broken))


def test_every_cited_section_exists():
  missing = missing_sections()
  assert not missing, f'{len(missing)} citation(s) of missing sections:\n' + '\n'.join(missing)


def test_architecture_has_the_sections_the_code_cites():
  """The numbering the code relies on, even before any file cites it."""
  nums, _ = headings('docs/architecture.md')
  cited = {'1', '2', '2.1', '3.2', '3.3', '3.4', '3.5', '3.6', '3.7', '3.8', '3.9', '3.10',
           '3.11', '3.12', '3.15', '3.16', '4', '6', '7'}
  assert cited <= nums, f'docs/architecture.md lacks sections {sorted(cited - nums)}'


def test_the_scanner_finds_what_it_should():
  """The patterns themselves: links, bare mentions, URLs, section lists and titles."""
  md = '.' + 'md'
  text = (f'see [the notes](../NOTES{md}#top) and docs/design{md}, not https://x.org/B{md}\n'
          f'# cite docs/architecture{md} sections 3.3-3.5, 3.8 and docs/design{md} "Batches"\n'
          'and NOTES' + ' section 4.\n')
  cited = sorted((line, target) for line, target in md_citations('tests/x.py', text))
  assert cited == [(1, f'../NOTES{md}'), (1, f'docs/design{md}'), (2, f'docs/architecture{md}'),
                   (2, f'docs/design{md}'), (3, f'NOTES{md}')]
  assert not _resolves('tests/x.py', f'../NOTES{md}')
  assert _resolves('tests/x.py', f'../docs/design{md}')
  assert _resolves('README.md', f'docs/design{md}')
  found = [(m.group('doc'), _expand(m.group('nums')) if m.group('nums') else [], m.group('title'))
           for m in SECTIONS.finditer(text)]
  assert (f'docs/architecture{md}', ['3.3', '3.4', '3.5', '3.8'], None) in found
  assert (f'docs/design{md}', [], 'Batches') in found
