"""No class of the C++ worker grows past ~500 lines, wherever its methods live.

The file rule (tests/test_source_size.py) cannot see a class whose methods are spread over
several files, which is how the worker's scheduler once grew to ~1.9k lines in six files. This
adds up, per class, its declaration in the header and every out-of-line member definition
(``Class::method(...) { ... }`` at the top level of a .cpp) in worker/src.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "worker" / "src"
LIMIT = 520  # "about 500", as for files

# a definition starts at column 0 and names Class::member (qualified return types allowed)
_DEF = re.compile(r"^(?!\s)(?!//)[^;{}()]*?\b([A-Z]\w*)::~?\w+\s*\(")
_CLASS = re.compile(r"^(?:class|struct)\s+([A-Z]\w*)\b[^;]*\{\s*$")


def _definitions(text: str) -> dict[str, int]:
    """Lines of out-of-line member definitions per class in one .cpp."""
    sizes: dict[str, int] = defaultdict(int)
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _DEF.match(lines[i])
        if m is None:
            i += 1
            continue
        start, depth, opened = i, 0, False
        while i < len(lines):
            depth += lines[i].count("{") - lines[i].count("}")
            opened = opened or "{" in lines[i]
            i += 1
            if opened and depth <= 0:
                break
            if not opened and lines[i - 1].rstrip().endswith(";"):  # a declaration, not a body
                break
        if opened:
            sizes[m.group(1)] += i - start
    return sizes


def _declarations(text: str) -> dict[str, int]:
    """Lines of top-level class/struct declarations (their bodies) in one header."""
    sizes: dict[str, int] = defaultdict(int)
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _CLASS.match(line)
        if m is None:
            continue
        depth = 0
        for j in range(i, len(lines)):
            depth += lines[j].count("{") - lines[j].count("}")
            if depth <= 0:
                sizes[m.group(1)] += j - i + 1
                break
    return sizes


def class_sizes(root: Path = SRC) -> dict[str, int]:
    total: dict[str, int] = defaultdict(int)
    for f in sorted(root.rglob("*")):
        if f.suffix not in (".cpp", ".h"):
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        parts = _definitions(text) if f.suffix == ".cpp" else _declarations(text)
        for name, n in parts.items():
            total[name] += n
    return dict(total)


def test_no_worker_class_over_about_500_lines():
    sizes = class_sizes()
    assert "Scheduler" in sizes and "SessionTable" in sizes, f"the count found too little: {sorted(sizes)}"
    assert sizes["Scheduler"] > 100, "the scheduler's methods were not counted"
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert over == {}


def test_the_count_follows_a_class_over_files(tmp_path):
    (tmp_path / "a.h").write_text("class Big {\npublic:\n    void f();\n};\n")
    body = "\n".join(f"    x += {k};" for k in range(300))
    (tmp_path / "a.cpp").write_text(f"void Big::f() {{\n{body}\n}}\n\nint Big::g(int x) const {{ return x; }}\n")
    (tmp_path / "b.cpp").write_text(f"void Big::h() {{\n{body}\n}}\n")
    sizes = class_sizes(tmp_path)
    assert sizes["Big"] == 4 + 302 + 1 + 302
    assert sizes["Big"] > LIMIT
