"""The layout (docs/layout.md): the tutorial at the top, the machinery in folders; no import circle; the budgets."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ["data.py", "model.py", "rollout.py", "reward.py", "stapo.py", "s2t.py", "train.py", "eval.py", "config.py",
            "test_stapo.py", "conftest.py"]
STEP_FILES = ["model.py", "rollout.py", "reward.py", "stapo.py", "s2t.py", "train.py"]


def _python_files() -> list[str]:
    """The repository's .py files, relative to the root, found on disk (CI's copy has no .git): hidden folders
    (.git, .ci-venv, .venv) and caches left out."""
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                  if not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(ROOT).parts))


def _code_files() -> list[Path]:
    """The project's Python files outside the tests, relative to the root."""
    listed = _python_files()
    return sorted(Path(p) for p in listed if not p.startswith(("tests/", "testdata/", "examples/", "tasks/"))
                  and p not in ("test_stapo.py", "conftest.py") and (ROOT / p).is_file())


def _module(path: Path) -> str:
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the project modules it imports}, from every import statement, at the top or inside a function
    (an import inside a function still runs the other file's code: a circle through it is a circle)."""
    modules = {_module(p): p for p in _code_files()}
    graph = {m: set() for m in modules}
    for m, path in modules.items():
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]  # a submodule, or a name in a module
            else:
                continue
            for name in names:
                target = next((name.rsplit(".", k)[0] for k in range(name.count(".") + 1)
                               if name.rsplit(".", k)[0] in modules), None)  # the longest that is a file
                if target and target != m:
                    graph[m].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle (one path around each strongly connected component of more than one module)."""
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
    """No file imports one that imports it back, directly or through others (config.parse_config's imports of
    reward, run_folder and plots once closed a circle)."""
    graph = import_graph()
    assert "config" in graph and "run_folder.logs" in graph and graph["train"]
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check finds one


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
    """The error type and one-line messages are a leaf: command_line/errors.py imports nothing of the project."""
    assert import_graph()["command_line.errors"] == set()


def test_top_level_is_the_tutorial():
    """The top level's .py files are only the tutorial's."""
    listed = _python_files()
    assert sorted(p for p in listed if "/" not in p) == sorted(TUTORIAL)


def test_budgets():
    """The six step files: at most 2,400 lines together, none over 600; every module docstring at most 20 lines."""
    lines = {f: len((ROOT / f).read_text().splitlines()) for f in STEP_FILES}
    assert sum(lines.values()) <= 2400 and max(lines.values()) <= 600, lines
    for path in [*_code_files(), Path("test_stapo.py"), Path("conftest.py")]:
        body = ast.parse((ROOT / path).read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            assert body[0].end_lineno - body[0].lineno + 1 <= 20, path
