"""The layout (docs/layout.md): the tutorial at the top, the machinery in folders; no import circle;
the budgets; docs/paper.md's links to the code lines they name; one test file per code file, named
for its path (docs/tests.md)."""
import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ["data.py", "model.py", "rollout.py", "reward.py", "stapo.py", "s2t.py", "train.py",
            "eval.py", "config.py", "test_stapo.py", "conftest.py"]
STEP_FILES = ["model.py", "rollout.py", "reward.py", "stapo.py", "s2t.py", "train.py"]


def _python_files() -> list[str]:
    """The repository's .py files, relative to the root, found on disk (CI's copy has no .git):
    hidden folders (.git, .ci-venv, .venv) and caches left out."""
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                  if not any(part.startswith(".") or part == "__pycache__"
                             for part in p.relative_to(ROOT).parts))


def _code_files() -> list[Path]:
    """The project's Python files outside the tests, relative to the root."""
    listed = _python_files()
    return sorted(Path(p) for p in listed
                  if not p.startswith(("tests/", "testdata/", "examples/", "tasks/"))
                  and p not in ("test_stapo.py", "conftest.py") and (ROOT / p).is_file())


def _module(path: Path) -> str:
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports}, from every import statement, at the top or inside a
    function (an import inside a function still runs the other file's code: a circle through it is a
    circle)."""
    modules = {_module(p): p for p in _code_files()}
    graph = {m: set() for m in modules}
    for m, path in modules.items():
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # a submodule, or a name in a module
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                # the longest that is a file
                target = next((name.rsplit(".", k)[0] for k in range(name.count(".") + 1)
                               if name.rsplit(".", k)[0] in modules), None)
                if target and target != m:
                    graph[m].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle (one path around each strongly connected component of more than one
    module)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    """No file imports one that imports it back, directly or through others (config.parse_config's
    imports of reward, run_folder and plots once closed a circle)."""
    graph = import_graph()
    assert "config" in graph and "run_folder.logs" in graph and graph["train"]
    assert cycles(graph) == []
    # the check finds one
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph collapsed to rooms: a room is a top-level file or a top-level folder (the
    first part of a module's name: fast_decode/ is one room), importing the rooms its modules
    import."""
    rooms = {m.split(".")[0]: set() for m in graph}
    for m, targets in graph.items():
        rooms[m.split(".")[0]] |= {t.split(".")[0] for t in targets} - {m.split(".")[0]}
    return rooms


def test_no_import_circle_between_rooms():
    """No room imports one that imports it back, directly or through others: imports run one way
    between the tutorial's files and the folders (command_line/checks.py importing config and
    run_folder, the vLLM engine in fast_decode/ importing rollout.py, train.py importing
    tools/plots.py once closed three)."""
    rooms = room_graph(import_graph())
    assert {"command_line", "config", "engines", "fast_decode", "rollout", "run_folder",
            "train"} <= set(rooms)
    assert cycles(rooms) == []
    modules = {"a": {"b.x"}, "b.x": set(), "b.y": {"a"}, "c": {"b.y"}}  # no circle of modules, ...
    assert cycles(modules) == [] and room_graph(modules) == {"a": {"b"}, "b": {"a"}, "c": {"b"}}
    assert cycles(room_graph(modules)) == [["a", "b"]]  # ... one of rooms a, b: the check finds it


def test_machinery_imports_no_tutorial_file_that_imports_it():
    """No module in a folder imports a top-level file that imports, directly or through others, a
    module of that folder (engines/ imports rollout.py, which must never import engines/); the
    check finds a planted one. The error type and one-line messages are a leaf:
    command_line/errors.py imports nothing of the project."""
    graph = import_graph()

    def reaches(start: str, room: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m.split(".")[0] == room and "." in m:
                return True
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return False

    def back_up(g):
        return sorted((m, t) for m, targets in g.items() if "." in m for t in targets
                      if "." not in t and reaches(t, m.split(".")[0]))

    assert back_up(graph) == []
    assert graph["command_line.errors"] == set()
    graph = dict(graph, rollout=graph["rollout"] | {"engines.choice"})  # a planted climb back
    assert ("engines.choice", "rollout") in back_up(graph)


def test_top_level_is_the_tutorial():
    """The top level's .py files are only the tutorial's."""
    listed = _python_files()
    assert sorted(p for p in listed if "/" not in p) == sorted(TUTORIAL)


def test_budgets():
    """The six step files: at most 1,800 lines together, none over 450 (train.py included),
    reward.py at most 200; eval.py at most 450; every other file outside the tests and data at most
    600; train_step's body at most 60 lines; every module docstring at most 20 lines."""
    lines = {f: len((ROOT / f).read_text().splitlines()) for f in STEP_FILES}
    assert sum(lines.values()) <= 1800 and max(lines.values()) <= 450, lines
    other = {str(p): len((ROOT / p).read_text().splitlines()) for p in _code_files()}
    assert {p: n for p, n in other.items() if n > 600} == {}
    assert other["eval.py"] <= 450 and lines["reward.py"] <= 200  # the evaluation, the rule
    tree = ast.parse((ROOT / "train.py").read_text())
    step = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    assert step.end_lineno - step.body[1].lineno + 1 <= 60  # the body after its docstring
    for path in [*_code_files(), Path("test_stapo.py"), Path("conftest.py")]:
        body = ast.parse((ROOT / path).read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            assert body[0].end_lineno - body[0].lineno + 1 <= 20, path


def test_no_tool_reaches_into_train():
    """tools/ use train.py's own functions only (`train.X` where train.py defines X), never a
    name train.py imported from elsewhere: those come from their home, so train.py's imports can
    change freely."""
    tree = ast.parse((ROOT / "train.py").read_text())
    own = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    used = {(str(p), node.attr) for p in _code_files() if p.parts[0] == "tools"
            for node in ast.walk(ast.parse((ROOT / p).read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "train"}
    assert {(p, name) for p, name in used if name not in own} == set()
    assert any(name == "logged_step" for _, name in used)


# ---------------------------------------------------------------- docs/paper.md's links to the code
LINK = re.compile(r"\[([^\]]+):(\d+)\]\(\.\./([^)#]+)#L(\d+)\)")  # [PATH:NN](../PATH#LNN)


def paper_section(title: str) -> str:
    """docs/paper.md's section `## title`, up to the next `## ` heading."""
    text = (ROOT / "docs" / "paper.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def linked_line(link: tuple[str, str, str, str]) -> str:
    """The line that a `LINK` match names, once its text (PATH:NN) and its URL are seen to agree and
    the file to hold that line."""
    text_path, text_line, path, line = link
    assert (text_path, text_line) == (path, line), link
    assert (ROOT / path).is_file(), link
    lines = (ROOT / path).read_text().splitlines()
    assert 1 <= int(line) <= len(lines), link
    return lines[int(line) - 1]


def test_deliberate_differences_link_their_lines():
    """docs/paper.md's deliberate differences are numbered once, D1 .. Dn in document order, no gap
    or repeat; each links exactly one line, `[PATH:NN](../PATH#LNN)`, that carries its marker DN;
    every DN in the code (outside the tests) names an item that exists. Each row of "One name per
    quantity" links a line that holds the name it gives (its last identifier)."""
    section = paper_section("Deliberate differences")
    assert not re.search(r"^\d+\. ", section, re.M)  # no item left with a per-file number
    items = re.findall(r"^\*\*D(\d+)\.\*\* (.*)$", section, re.M)
    assert [int(n) for n, _ in items] == list(range(1, len(items) + 1)) and len(items) > 50
    for n, body in items:
        links = LINK.findall(body)
        assert len(links) == 1 and body.count("](") == 1, f"D{n}: {body}"
        assert re.search(rf"\bD{n}\b", linked_line(links[0])), f"D{n}: {links[0]}"
    markers = {(str(p), int(m)) for p in _code_files()
               for m in re.findall(r"\bD(\d+)\b", (ROOT / p).read_text())}
    assert {(p, m) for p, m in markers if not 1 <= m <= len(items)} == set()
    rows = [re.split(r"(?<!\\)\|", line)[1:-1]
            for line in paper_section("One name per quantity").splitlines()
            if line.startswith("| ") and "](" in line]
    assert len(rows) >= 20
    for paper, code, where in rows:
        name = re.findall(r"`([^`]+)`", code)[0]
        last = re.findall(r"\w+", name)[-1]
        (link,) = LINK.findall(where)
        assert re.search(rf"\b{last}\b", linked_line(link)), (paper, name, link)


# ------------------------------------------------------ the tests follow the layout (docs/tests.md)
# the paper's core: one test file at the top
CORE = {"stapo.py": "test_stapo.py", "s2t.py": "test_stapo.py"}
# train.py's tests, split by topic beside tests/test_train.py
SPLITS = {"tests/test_train_resume.py": "train.py", "tests/test_train_distributed.py": "train.py"}
# the layout, the README
NOT_CODE = {"tests/test_layout.py": "docs/layout.md", "tests/test_readme.py": "README.md"}


def rule_test_file(path: str) -> str:
    """The test file of a code file: a/b.py -> tests/test_a_b.py, x.py -> tests/test_x.py, a
    package's a/__init__.py -> tests/test_a.py; stapo.py and s2t.py -> test_stapo.py."""
    p = Path(path)
    parts = p.parent.parts if p.name == "__init__.py" else p.with_suffix("").parts
    return CORE.get(path, f"tests/test_{'_'.join(parts)}.py")


def _named_files() -> list[str]:
    """The files test files are named for: every .py file of the repository but the tests (tests/,
    testdata/, test_stapo.py): the top level, the folders, tools/, tasks/, examples/,
    conftest.py."""
    return [p for p in _python_files()
            if not p.startswith(("tests/", "testdata/")) and p != "test_stapo.py"]


def _holds_code(path: str) -> bool:
    """More than a module docstring (a folder's __init__.py that only says what the folder holds has
    no tests)."""
    body = ast.parse((ROOT / path).read_text()).body
    return len(body) > (1 if body and isinstance(body[0], ast.Expr)
                        and isinstance(body[0].value, ast.Constant) else 0)


def files_tested() -> dict[str, list[str]]:
    """{test file on disk: the files it tests by the rule}: [] for one named for no file, two for an
    ambiguous name."""
    by_test = defaultdict(list)
    for path in _named_files():
        by_test[rule_test_file(path)].append(path)
    for test, tested in {**SPLITS, **NOT_CODE}.items():
        by_test[test].append(tested)
    on_disk = ["test_stapo.py"] + [str(p.relative_to(ROOT))
                                   for p in (ROOT / "tests").glob("test_*.py")]
    return {test: sorted(by_test[test]) for test in sorted(on_disk)}


def test_every_test_file_is_named_for_the_code_file_it_tests():
    """tests/test_a_b.py tests a/b.py (the path with `/` written `_`) and nothing else; the
    exceptions are few and named: test_stapo.py (stapo.py and s2t.py), train.py's files split by
    topic beside tests/test_train.py, and the layout's and the README's own tests. No two files
    share a test file's name."""
    tested = files_tested()
    assert {test: files for test, files in tested.items()
            if len(files) != 1 and test != "test_stapo.py"} == {}
    assert tested["test_stapo.py"] == ["s2t.py", "stapo.py"]
    # split from tests/test_train.py
    assert all((ROOT / rule_test_file(base)).is_file() for base in SPLITS.values())
    names = [rule_test_file(p) for p in _named_files() if p not in CORE]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    # the rule itself, on names that exist and some that do not
    assert [rule_test_file(p) for p in ("train.py", "run_folder/lock.py", "run_folder/__init__.py",
                                        "s2t.py")] == [
        "tests/test_train.py", "tests/test_run_folder_lock.py", "tests/test_run_folder.py",
        "test_stapo.py"]


def test_docs_list_every_code_files_tests():
    """docs/tests.md's table gives every code file (a file with more than a docstring) the test
    files the rule names for it, train.py's split files marked as split by topic, and says
    "none of its own" where there is none; what follows "through" names other tests that reach
    it."""
    text = (ROOT / "docs" / "tests.md").read_text()
    rows = dict(re.findall(r"^\| `([^`]+)` \| (.*) \|$", text, re.M))
    expected = defaultdict(list)
    for test, files in files_tested().items():
        for path in files:
            expected[path].append(test)
    files = sorted({p for p in _named_files() if _holds_code(p)} | set(expected))
    assert sorted(rows) == files
    for path in files:
        own = rows[path].split("through")[0]
        listed = sorted(t for t in re.findall(r"`([^`]+)`", own)
                        if re.fullmatch(r"(tests/)?test_\w+\.py", t))
        if expected[path]:
            assert listed == sorted(expected[path]), path
        else:
            assert rows[path].startswith("none of its own"), path
    assert "split by topic" in rows["train.py"]


def test_docs_anchor_links_reach_their_headings():
    """Every link to a heading of a page (README.md and docs/*.md, `page.md#anchor` or `#anchor`)
    names a heading that exists, by GitHub's rule (lowercase, punctuation dropped, spaces to
    hyphens); seven pointed at headings renamed with bench.py -> tools.bench."""
    def slug(heading):
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    headings = {p.resolve(): {slug(h) for h in re.findall(r"^#+ (.*)$", p.read_text(), re.M)}
                for p in pages}
    broken = [f"{p.name}: {target}#{anchor}" for p in pages
              for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", p.read_text())
              if target.endswith(".md") or not target
              if anchor not in headings.get((p.parent / target).resolve() if target
                                            else p.resolve(), {anchor})]
    assert not broken
