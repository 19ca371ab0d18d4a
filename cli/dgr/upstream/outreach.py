"""The upstream collaboration package: `dgr upstream render`.

Fills the Jinja2 templates of ``upstream/outreach/templates/`` from the real sources and writes
a proposal for llama.cpp maintainers, one pull-request text per patch and the llama.cpp-style
examples to one folder (default ``upstream/outreach/rendered/``). The example sources are copied
from ``upstream/outreach/examples/`` only into a folder outside the repository's own render
(``--out``: a package to hand over); the committed render points at them instead of holding a
second copy. The sources are the patch series and each patch (subject,
reason, ``Upstreamable:``/``Forwarded:`` lines, files and line counts from
``git apply --numstat``, the lines it adds to ``include/llama.h``), the pin, the assumptions
file, and figures read from ``evidence/*/results.json`` as listed in ``figures.toml``.

Provenance is enforced, not hoped for: templates can print a number only through a helper that
knows where it came from (``fig`` for an evidence figure, printed with its file and JSON
pointer; ``stat`` for a count taken from a repository file; ``ref`` for a cited public link).
Each helper marks its output; after rendering, every number-like token outside those marks,
code spans and link targets fails the render. The output has no timestamps and is written in a
fixed order, so rendering twice gives the same bytes. Nothing is sent anywhere: this only
writes files.
"""

from __future__ import annotations

import email
import email.policy
import filecmp
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from .. import paths
from ..errors import DgrError
from . import patchstack
from . import pin as pin_mod
from .figures import Figure, load_figures

# Marks around text a provenance helper produced (control characters never in templates).
_OPEN, _CLOSE = "\x02", "\x03"
# What render writes into --out; only these are replaced there, nothing else is touched.
OUTPUTS = ("README.md", "proposal.md", "pull-requests", "examples")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.\-/@+])\d+(?:[.,:]\d+)*")
# a code span that is only a measurement (a decimal or a unit); API values such as `-1` are fine
_BARE_NUMBER_CODE = re.compile(r"^[\s~<>=+\-]*\d[\d,]*(\.\d+)?\s*(%|[KMG]i?B|bytes?|ms|s|tok/s|x)?\s*$")


def outreach_dir() -> Path:
    return paths.repo_root() / "upstream" / "outreach"


def templates_dir() -> Path:
    return outreach_dir() / "templates"


def examples_dir() -> Path:
    return outreach_dir() / "examples"


def default_out_dir() -> Path:
    return outreach_dir() / "rendered"


# ---------------------------------------------------------------------------- the patches


@dataclass(frozen=True)
class FileChange:
    path: str
    added: int
    removed: int


@dataclass(frozen=True)
class Patch:
    number: str            # "0001", from the file name
    file: str              # file name in upstream/patches/
    subject: str
    reason: str            # the body before the Upstreamable:/Forwarded: fields
    upstreamable: str
    forwarded: str
    files: tuple[FileChange, ...]
    api: tuple[str, ...]   # lines the patch adds to include/llama.h, in order
    api_diff: str          # its hunks of include/llama.h, as in the patch ("" when none)

    @property
    def source(self) -> str:
        return f"upstream/patches/{self.file}"

    @property
    def slug(self) -> str:
        return Path(self.file).stem

    @property
    def added(self) -> int:
        return sum(f.added for f in self.files)

    @property
    def removed(self) -> int:
        return sum(f.removed for f in self.files)


def _body_fields(body: str) -> tuple[str, dict[str, str]]:
    """Split a patch description into its reason (paragraphs) and trailing ``Key: value`` fields."""
    reason: list[str] = []
    fields: dict[str, str] = {}
    for para in re.split(r"\n\s*\n", body.strip()):
        m = re.match(r"^(Upstreamable|Forwarded):\s*(.*)$", para, re.S)
        if m:
            # a field may carry its neighbour on the next line (no blank line between them)
            for fm in re.finditer(r"^(Upstreamable|Forwarded):\s*(.*?)(?=^\w+:|\Z)", para, re.S | re.M):
                fields[fm.group(1)] = " ".join(fm.group(2).split())
        else:
            reason.append(" ".join(para.split()))
    return "\n\n".join(reason), fields


def _numstat(patch: Path) -> tuple[FileChange, ...]:
    try:
        out = subprocess.run(["git", "apply", "--numstat", str(patch)], check=True, capture_output=True,
                             text=True, cwd=tempfile.gettempdir()).stdout
    except FileNotFoundError:
        raise DgrError("git not found", hint="apt-get install git") from None
    except subprocess.CalledProcessError as exc:
        raise DgrError(f"git apply --numstat {patch.name} failed: {exc.stderr.strip()}") from None
    changes = []
    for line in out.splitlines():
        added, removed, path = line.split("\t", 2)
        changes.append(FileChange(path, int(added), int(removed)))
    return tuple(changes)


def _lines_of(diff: str, path: str):
    """The lines a diff has for ``path`` after its ``+++`` header (hunk headers and content)."""
    current = None
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            current = None
        elif line.startswith("+++ "):
            current = line[4:].removeprefix("b/")
        elif current == path:
            yield line


def _added_lines(diff: str, path: str) -> tuple[str, ...]:
    """Lines a diff adds to ``path`` (without the leading ``+``)."""
    return tuple(line[1:] for line in _lines_of(diff, path) if line.startswith("+"))


def _hunks(diff: str, path: str) -> str:
    """The ``@@`` hunks a diff has for ``path``, verbatim."""
    return "\n".join(line for line in _lines_of(diff, path)
                     if line.startswith(("@@", "+", "-", " ")) or line == "")


def read_patch(path: Path) -> Patch:
    text = path.read_text(encoding="utf-8")
    if text.startswith("From "):                    # the mbox separator line of git format-patch
        text = text.split("\n", 1)[1]
    msg = email.message_from_string(text, policy=email.policy.default)
    subject = " ".join(str(msg["Subject"] or "").split())
    payload = msg.get_payload()
    if not subject or not isinstance(payload, str):
        raise DgrError(f"{path.name} is not a git format-patch file (no subject or body)")
    body, _, diff = payload.partition("\ndiff --git ")
    body = body.split("\n---\n", 1)[0]
    reason, fields = _body_fields(body)
    for key in ("Upstreamable", "Forwarded"):
        if key not in fields:
            raise DgrError(f"{path.name} has no '{key}:' line in its description",
                           hint="every patch says whether it is upstreamable and where it was forwarded")
    m = re.match(r"^(\d{4})-", path.name)
    if not m:
        raise DgrError(f"{path.name}: patch file names start with a 4-digit number (dgr patches export)")
    return Patch(number=m.group(1), file=path.name, subject=subject, reason=reason,
                 upstreamable=fields["Upstreamable"], forwarded=fields["Forwarded"],
                 files=_numstat(path), api=_added_lines("diff --git " + diff, "include/llama.h"),
                 api_diff=_hunks("diff --git " + diff, "include/llama.h"))


def read_series(stack: patchstack.Stack | None = None) -> list[Patch]:
    stack = stack or patchstack.default_stack()
    return [read_patch(stack.patches_dir / name) for name in stack.series()]


# ---------------------------------------------------------------------------- provenance


@dataclass
class Provenance:
    """The helpers a template prints numbers with; records every source one document used."""

    figures: dict[str, Figure]
    used: dict[str, list[str]] = field(default_factory=dict)   # file -> what it gave, first-use order

    def _use(self, file: str, what: str) -> None:
        items = self.used.setdefault(file, [])
        if what not in items:
            items.append(what)

    def _mark(self, text: str) -> str:
        return f"{_OPEN}{text}{_CLOSE}"

    def fig(self, fid: str) -> str:
        """An evidence figure with its file and JSON pointer."""
        if fid not in self.figures:
            raise DgrError(f"template uses figure {fid!r}, which figures.toml does not list")
        f = self.figures[fid]
        self._use(f.file, f.label)
        return self._mark(f"{f.text} (`{f.source}`)")

    def figrow(self, fid: str) -> str:
        """A table row ``| label | value | source |`` for an evidence figure."""
        if fid not in self.figures:
            raise DgrError(f"template uses figure {fid!r}, which figures.toml does not list")
        f = self.figures[fid]
        self._use(f.file, f.label)
        return self._mark(f"| {f.label} | {f.text} | `{f.source}` |")

    def stat(self, value: Any, source: str, what: str = "line counts (git apply --numstat)") -> str:
        """A count taken from a repository file or folder (``source``), ``what`` says how."""
        if not source:
            raise DgrError("stat() needs a source")
        self._use(source, what)
        return self._mark(str(value))

    def ref(self, text: str, url: str) -> str:
        """A cited public link; its text may carry numbers (issue and PR numbers)."""
        if not url.startswith("https://"):
            raise DgrError(f"ref({text!r}) needs an https:// link, got {url!r}")
        return self._mark(f"[{text}]({url})")

    def quote(self, text: str, source: str) -> str:
        """Text quoted from a repository file (a patch description), as a Markdown blockquote."""
        self._use(source, "quoted text")
        lines = "\n".join(f"> {ln}" if ln else ">" for ln in text.splitlines())
        return self._mark(lines.replace("\n", f"{_CLOSE}\n{_OPEN}"))

    def sources(self) -> list[str]:
        """One marked line per source file used so far: ``file``: what it gave."""
        return [self._mark(f"`{src}`: {'; '.join(what)}") for src, what in self.used.items()]


def _strip_code(line: str, problems: list[str], where: str) -> str:
    def code(m: re.Match) -> str:
        bare = _BARE_NUMBER_CODE.match(m.group(1))
        if bare and (bare.group(1) or bare.group(2)):
            problems.append(f"{where}: a bare number in a code span: `{m.group(1)}`")
        return " "
    return re.sub(r"`([^`]*)`", code, line)


def audit(text: str, name: str) -> list[str]:
    """Number-like tokens in ``text`` that no provenance helper produced."""
    problems: list[str] = []
    in_fence = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        where = f"{name}:{lineno}"
        rest = re.sub(f"{_OPEN}[^{_CLOSE}]*{_CLOSE}", " ", line)
        rest = _strip_code(rest, problems, where)
        rest = re.sub(r"\]\([^)]*\)", "]", rest)            # link targets
        rest = re.sub(r"<https?://[^>]*>|https?://\S+", " ", rest)
        rest = re.sub(r"<!--.*?-->", " ", rest)
        for m in _NUMBER.finditer(rest):
            problems.append(f"{where}: number {m.group(0)!r} without a source: {line.strip()[:100]!r}")
    return problems


def _unmark(text: str) -> str:
    return text.replace(_OPEN, "").replace(_CLOSE, "")


# ---------------------------------------------------------------------------- render

_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
          "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
          "nineteen", "twenty")


def count_word(n: int) -> str:
    return _WORDS[n] if 0 <= n < len(_WORDS) else str(n)


def _environment(tdir: Path) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(tdir)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                             autoescape=False)
    env.filters["words"] = count_word
    # "https://github.com/ggml-org/llama.cpp.git" -> "ggml-org/llama.cpp"
    env.filters["repo_name"] = lambda url: re.sub(r"^https://github\.com/|\.git$", "", url)
    return env


@dataclass(frozen=True)
class Document:
    path: str        # relative to the output folder
    text: str


def _context(patches: list[Patch]) -> dict[str, Any]:
    pin = pin_mod.load_pin()
    assumptions = patchstack.load_assumptions(paths.repo_root() / "upstream" / "assumptions.toml")
    example_files = sorted(p.relative_to(examples_dir()).as_posix()
                           for p in examples_dir().rglob("*") if p.is_file())
    return {
        "pin": pin,
        "patches": patches,
        "assumptions": assumptions,
        "example_files": example_files,
        "series_digest": patchstack.default_stack().series_digest(),
    }


def build_documents(*, templates: Path | None = None, figures: dict[str, Figure] | None = None,
                    copy_examples: bool = True) -> list[Document]:
    """Render every document in memory; raises DgrError listing any number without a source.
    ``copy_examples``: include the example sources (a standalone package); off for the
    repository's own render, which sits beside them."""
    tdir = templates or templates_dir()
    if not tdir.is_dir():
        raise DgrError(f"templates folder {tdir} missing")
    figures = figures if figures is not None else load_figures(tdir / "figures.toml")
    patches = read_series()
    if not patches:
        raise DgrError("the patch series is empty: nothing to propose")
    env = _environment(tdir)
    base = _context(patches)
    base["examples_copied"] = copy_examples
    jobs: list[tuple[str, str, dict[str, Any]]] = [
        ("README.md", "index.md.j2", {}),
        ("proposal.md", "proposal.md.j2", {}),
        ("examples/README.md", "examples.md.j2", {}),
    ]
    for p in patches:
        if not (tdir / "pr" / f"{p.number}.md.j2").is_file():
            raise DgrError(f"no pull-request notes for patch {p.file}",
                           hint=f"write {tdir / 'pr' / (p.number + '.md.j2')} (what it changes, how it is tested)")
        jobs.append((f"pull-requests/{p.slug}.md", "pr.md.j2", {"patch": p, "notes": f"pr/{p.number}.md.j2"}))
    docs: list[Document] = []
    problems: list[str] = []
    for out_name, template, extra in jobs:
        prov = Provenance(figures)
        ctx = dict(base, **extra, fig=prov.fig, figrow=prov.figrow, stat=prov.stat, ref=prov.ref,
                   quote=prov.quote, sources=prov.sources)
        try:
            text = env.get_template(template).render(ctx)
        except jinja2.TemplateError as exc:
            where = f"{getattr(exc, 'filename', None) or template}:{getattr(exc, 'lineno', '?')}"
            raise DgrError(f"template {where}: {exc.message or exc}") from None
        problems += audit(text, out_name)
        docs.append(Document(out_name, _unmark(text)))
    if problems:
        raise DgrError(f"{len(problems)} number(s) in the rendered text have no source; first: {problems[0]}",
                       hint="print numbers with fig()/stat()/ref() in the templates")
    for rel in base["example_files"] if copy_examples else ():
        docs.append(Document(f"examples/{rel}", (examples_dir() / rel).read_text(encoding="utf-8")))
    return docs


def write(docs: list[Document], out: Path) -> list[Path]:
    if out.exists() and not out.is_dir():
        raise DgrError(f"--out {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:                      # only what render owns; stale files go
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    written = []
    for d in docs:
        path = out / d.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(d.text.encode("utf-8"))
        written.append(path)
    return written


def render(out: Path | None = None) -> list[Path]:
    """Render the package into ``out`` (default upstream/outreach/rendered/)."""
    out = out or default_out_dir()
    return write(build_documents(copy_examples=not _is_default(out)), out)


def _is_default(out: Path) -> bool:
    return Path(out).resolve() == default_out_dir().resolve()


def differences(out: Path | None = None) -> list[str]:
    """How ``out`` differs from a fresh render (empty when it is up to date)."""
    out = out or default_out_dir()
    with tempfile.TemporaryDirectory(prefix="dgr-outreach-") as tmp:
        fresh = Path(tmp)
        write(build_documents(copy_examples=not _is_default(out)), fresh)
        problems = []
        want = {p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file()}
        have = set()
        for name in OUTPUTS:
            t = out / name
            if t.is_file():
                have.add(name)
            elif t.is_dir():
                have |= {p.relative_to(out).as_posix() for p in t.rglob("*") if p.is_file()}
        for rel in sorted(want - have):
            problems.append(f"missing {rel}")
        for rel in sorted(have - want):
            problems.append(f"stale {rel}")
        for rel in sorted(want & have):
            if not filecmp.cmp(fresh / rel, out / rel, shallow=False):
                problems.append(f"differs {rel}")
        return problems
