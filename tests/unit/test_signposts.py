"""Signposts that stay true: the pointers prose makes into the code name things that exist.

Over zerokit/, benchmarks/ (not results/: generated output), scripts/, tests/, docs/ and README.md:
- every `[Note: X]` cited is defined: a line holding only `[Note: X]` (in a comment, `# [Note: X]`) that starts a
  docstring or comment paragraph; a citation that names a file (`core/engine.py [Note: X]`, "(`optim/sharded.py`
  [Note: X])", "`core/collectives/hybrid.py`, [Note: X]", "[Note: X] in zerokit/stages/zero3.py") is defined in that file;
- every "path/file.py `name`" pointer names a file that exists and defines `name` (def, class, assignment or
  argument at any level; for `A.b`, each of A and b);
- no class body defines a method twice (the second silently replaces the first);
- no file:line pointers (they go stale with the first edit above the line);
- the README's stage table is the current output of `scripts/stage_diff.sh --stat`.
Each check lists every violation at once. The checks take their files as (path, text) pairs, so
`test_each_check_finds_a_planted_violation` runs them on planted text and shows each can fail.
"""
import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("zerokit", "benchmarks", "scripts", "tests", "docs", "README.md")
SKIPPED = ("benchmarks/results/",)  # generated output: what a run printed, not prose about the code
SUFFIXES = (".py", ".md", ".sh")
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its planted examples are not signposts

NOTE = re.compile(r"\[Note:\s*([^\]]*)\]")
# a file path just before a citation: `core/engine.py [Note: X]`, "(`optim/sharded.py` [Note: X", "x.py`, [Note:"
PATH_BEFORE = re.compile(r"([\w./\\-]+\.(?:py|md|sh))`?,?\s*$")
# or just after it (or after a list of them): "[Note: A] and [Note: B] in zerokit/stages/zero3.py"
PATH_AFTER = re.compile(r"(?:\s*(?:,|and)\s*\[Note:[^\]]*\])*\s+in\s+`?([\w./\\-]+\.(?:py|md|sh))\b")
POINTER = re.compile(r"(?<![\w/.])`?([\w][\w./\\-]*\.py)`?\s+\(?`([A-Za-z_][\w.]*)(?=[`(\[])")
FILE_LINE = re.compile(r"(?<![\w/.])[\w./-]*\w\.(?:py|md|sh):\d+\b")


def repo_files():
    """(path, text) for every scanned file, path relative to the repo root with / separators."""
    out = []
    for top in SCANNED:
        p = ROOT / top
        paths = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
        for q in paths:
            rel = q.relative_to(ROOT).as_posix()
            if q.suffix in SUFFIXES and "__pycache__" not in rel and not rel.startswith(SKIPPED) and rel != THIS:
                out.append((rel, q.read_text()))
    return out


def _unwrap(text):
    """The text with each line's comment marker dropped, so a citation wrapped over `#` lines reads as one."""
    return "\n".join(re.sub(r"^\s*#+ ?", "", line) for line in text.splitlines())


def _norm(name):
    """A cited name as one line: wrapping and Python's implicit string concatenation (`"a " "b"`) dropped."""
    return " ".join(re.sub(r'"\s*[rbuf]*"', "", name).split())


def note_definitions(path, text):
    """The Notes `path` defines: `[Note: X]` alone on a line that begins a paragraph of a docstring or comment."""
    defined = set()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        body = s[1:].strip() if s.startswith("#") else s
        m = re.fullmatch(r"(?:[rbuf]*\"\"\"|[rbuf]*''')?\s*\[Note:\s*([^\]]+)\]", body)
        if not m:
            continue
        prev = lines[i - 1].strip() if i else ""
        if s.startswith("#"):  # a comment paragraph starts after a line that is not comment text
            starts = not prev.startswith("#") or prev.strip("# ") == ""
        else:  # a docstring paragraph starts after a blank line, or opens the docstring
            starts = body[:1] != "[" or prev == "" or prev.endswith(('"""', "'''"))
        if starts:
            defined.add(_norm(m.group(1)))
    return defined


def resolve(cited, files, near=None):
    """The scanned files a cited path names: the exact path, or every path it is a tail of (`core/params/unit.py` is
    zerokit/core/params/unit.py); a bare name next to the citing file first."""
    cited = cited.replace("\\", "").lstrip("./")
    if near and "/" not in cited:
        sibling = str(Path(near).parent / cited)
        if sibling in files:
            return [sibling]
    return [p for p in files if p == cited or p.endswith("/" + cited)]


OURS = ("zerokit/", "benchmarks/", "scripts/", "tests/", "docs/", "core/", "optim/", "stages/", "checkpoint/",
        "commands/")


def _missing(cited, targets):
    """A cited path that names no scanned file: a violation where the path is one of ours (a file moved or
    renamed), not where it is another project's (torch/...) or a bare name no file here has."""
    return not targets and cited.replace("\\", "").lstrip("./").startswith(OURS)


def check_notes(files):
    """Every `[Note: X]` cited is defined; where the citation names a file, in that file."""
    by_path = dict(files)
    defs = {p: note_definitions(p, t) for p, t in files}
    everywhere = set().union(*defs.values())
    bad = []
    for path, text in files:
        flat = _unwrap(text)
        for m in NOTE.finditer(flat):
            name = _norm(m.group(1))
            if name == "...":  # the form itself (docs/style.md), not a citation
                continue
            line = flat.count("\n", 0, m.start()) + 1
            before = (PATH_BEFORE.search(flat[max(0, m.start() - 120):m.start()].replace("(", " "))
                      or PATH_AFTER.match(flat, m.end()))
            if before:
                targets = resolve(before.group(1), by_path, near=path)
                if _missing(before.group(1), targets):
                    bad.append(f"{path} line {line}: [Note: {name}] cited in {before.group(1)}, no such file")
                elif targets and not any(name in defs[t] for t in targets):
                    where = ", ".join(sorted(p for p in defs if name in defs[p])) or "nowhere"
                    bad.append(f"{path} line {line}: [Note: {name}] cited in {before.group(1)}, defined in {where}")
            elif name not in everywhere:
                bad.append(f"{path} line {line}: [Note: {name}] is defined nowhere")
    return bad


def defined_names(text):
    """Every name a Python file defines at any level: functions, classes, assignment targets (self.x too), arguments."""
    names = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def check_pointers(files):
    """Every "path/file.py `name`" pointer names a scanned file that defines `name`."""
    by_path = dict(files)
    names = {}
    bad = []
    for path, text in files:
        flat = _unwrap(text)
        for m in POINTER.finditer(flat):
            cited, name = m.group(1), m.group(2).rstrip(".")
            line = flat.count("\n", 0, m.start()) + 1
            targets = resolve(cited, by_path, near=path)
            if not targets:
                if _missing(cited, targets):
                    bad.append(f"{path} line {line}: {cited} `{name}`: no such file")
                continue
            for t in targets:
                if t not in names:
                    names[t] = defined_names(by_path[t]) if t.endswith(".py") else set()
            missing = [part for part in name.split(".") if not any(part in names[t] for t in targets)]
            if missing:
                bad.append(f"{path} line {line}: {cited} `{name}`: {' '.join(targets)} defines no {missing[0]}")
    return bad


def check_methods_once(files):
    """No class body defines a method twice (a property's setter or an @overload is not a second definition)."""
    bad = []
    for path, text in files:
        if not path.endswith(".py"):
            continue
        for cls in ast.walk(ast.parse(text)):
            if not isinstance(cls, ast.ClassDef):
                continue
            seen = {}
            for node in cls.body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                decorators = {ast.unparse(d) for d in node.decorator_list}
                if any(d.endswith((".setter", ".deleter")) or d in ("overload", "typing.overload") for d in decorators):
                    continue
                if node.name in seen:
                    bad.append(f"{path}: {cls.name}.{node.name} defined at lines {seen[node.name]} and {node.lineno}")
                seen[node.name] = node.lineno
    return bad


def check_no_file_line(files):
    """No `file.py:123` pointers: they name a line that moves with the first edit above it."""
    bad = []
    for path, text in files:
        for n, line in enumerate(text.splitlines(), 1):
            bad += [f"{path} line {n}: {m.group(0)}" for m in FILE_LINE.finditer(line)]
    return bad


def readme_stage_table(readme):
    """The README's stage table: its header line through its last row."""
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| file | lines |"))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end])


def test_every_cited_note_is_defined_where_the_citation_says():
    bad = check_notes(repo_files())
    assert not bad, f"{len(bad)} Note citations without their definition:\n" + "\n".join(bad)


def test_every_file_and_name_pointer_names_a_file_that_defines_it():
    bad = check_pointers(repo_files())
    assert not bad, f"{len(bad)} pointers to a name the file does not define:\n" + "\n".join(bad)


def test_no_class_defines_a_method_twice():
    bad = check_methods_once(repo_files())
    assert not bad, f"{len(bad)} methods defined twice in one class body:\n" + "\n".join(bad)


def test_no_file_line_pointers():
    bad = check_no_file_line(repo_files())
    assert not bad, f"{len(bad)} file:line pointers (name the function or the Note instead):\n" + "\n".join(bad)


def test_readme_stage_table_is_stage_diff_stat():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "stage_diff.sh"), "--stat"], capture_output=True,
                         text=True, check=True).stdout.strip()
    table = readme_stage_table((ROOT / "README.md").read_text())
    assert table == out, f"README's stage table:\n{table}\nscripts/stage_diff.sh --stat prints:\n{out}"


def test_each_check_finds_a_planted_violation():
    """Each check on planted text: the violation is reported (and the clean twin passes), every one listed."""
    note = "[" + "Note: "  # split so this file's own text holds no citation
    defs = ("zerokit/core/a.py", f'"""A.\n\n{note}kept]\nwhy.\n"""\n'
                                 f"def f():\n    pass\nclass K:\n    LIMIT = 1\n")
    other = ("zerokit/core/b.py", f"x = 1\n# {note}own]\n# why\n")
    cites = ("docs/x.md", f"core/a.py {note}kept], (`core/a.py`\n{note}kept]) and {note}own]; {note}...]\n"
                          f"{note}own] and {note}own] in core/b.py\n")
    assert check_notes([defs, other, cites]) == []
    planted = ("zerokit/core/c.py", f"# in core/b.py {note}kept]; {note}gone]\n# see core/nofile.py {note}kept]\n"
                                    f"# then:\n# {note}not a definition]\n# (a paragraph's second line)\n"
                                    f"# {note}kept] and {note}own] in core/a.py\n")
    bad = check_notes([defs, other, planted])
    assert [b.split(":")[0] for b in bad] == ["zerokit/core/c.py line 1"] * 2 + ["zerokit/core/c.py line 2",
                                                                                 "zerokit/core/c.py line 4",
                                                                                 "zerokit/core/c.py line 6"], bad
    tick = "`"
    assert check_pointers([defs, ("docs/y.md", f"core/a.py {tick}f{tick} and (core/a.py {tick}K.LIMIT{tick})")]) == []
    bad = check_pointers([defs, ("docs/y.md", f"core/a.py {tick}g{tick}; core/a.py {tick}K.other{tick}; "
                                              f"core/c.py {tick}f{tick}")])
    assert len(bad) == 3, bad
    twice = ("zerokit/k.py", "class E:\n    def zero_grad(self):\n        pass\n\n    @property\n    def p(self):\n"
                             "        pass\n\n    @p.setter\n    def p(self, v):\n        pass\n\n"
                             "    def zero_grad(self):\n        pass\n")
    assert check_methods_once([twice]) == ["zerokit/k.py: E.zero_grad defined at lines 2 and 13"]
    assert check_no_file_line([("docs/z.md", "see engine" + ".py:123 and core/unit" + ".py:7, not a.py or 1:2")]) \
        == ["docs/z.md line 1: engine.py:123", "docs/z.md line 1: core/unit.py:7"]
    readme = "x\n| file | lines |\n|---|---|\n| a | 1 |\n\nafter | no\n"
    assert readme_stage_table(readme) == "| file | lines |\n|---|---|\n| a | 1 |"
