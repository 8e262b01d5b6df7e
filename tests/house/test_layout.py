"""The house by concern (docs/architecture.md, STYLE.md §18): src/podkit keeps few modules at its top, each
package opens with the sentence that says what it is, no module imports another that imports it back (counting
imports made inside functions), nothing is re-exported for old callers, and no file passes 800 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(60)
SRC = ROOT / "src"
TOP_MAX = 16
LINES_MAX = 800


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted((SRC / "podkit").rglob("*.py")):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of podkit's own modules, wherever in the module they are made. `from a.b import c`
    imports a.b (and c, when c is a module); a package's __init__ is not counted for its own submodules."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[m] |= {t for t in found if t in mods and t != m and not m.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    out.append(sorted(scc))
    return out


def test_no_module_of_podkit_imports_one_that_imports_it_back():
    found = circles(imports(modules()))
    assert not found, "import circles (a reader in a writer's room?): " + "; ".join(" <-> ".join(c) for c in found)


def test_the_circle_finder_finds_a_circle_through_a_function_level_import():
    """The rule above can fail: two modules whose only way back is an import inside a function."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    tree = {"podkit.x": Path("x"), "podkit.y": Path("y")}
    code = {"x": "from podkit import y\n", "y": "def f():\n    from podkit import x\n"}
    real_read = Path.read_text
    try:
        Path.read_text = lambda self, *a, **k: code[str(self)]  # noqa: ARG005
        assert circles(imports(tree)) == [["podkit.x", "podkit.y"]]
    finally:
        Path.read_text = real_read


def test_few_modules_stay_at_the_top_and_every_package_says_what_it_is():
    top = sorted(p.name for p in (SRC / "podkit").glob("*.py"))
    assert len(top) <= TOP_MAX, top
    for init in sorted((SRC / "podkit").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 8, f"{init.relative_to(ROOT)} opens with no sentence saying what it is"


def test_nothing_is_re_exported_for_old_callers():
    said = [f"{p.relative_to(ROOT)}:{i}" for p in modules().values()
            for i, line in enumerate(p.read_text().splitlines(), 1) if "noqa: F401" in line and "as ever" in line]
    assert not said, said
    inits = [p for p in (SRC / "podkit").glob("*/__init__.py")
             if any(isinstance(n, (ast.Import, ast.ImportFrom)) and getattr(n, "module", "") != "__future__"
                    for n in ast.parse(p.read_text()).body)]
    allowed = {"programs", "areal"}  # their __init__ holds code of their own (the program table, AReaL's layer)
    assert not [p for p in inits if p.parent.name not in allowed], inits


def test_no_file_passes_800_lines():
    long = {str(p.relative_to(ROOT)): n for p in [*SRC.rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
                                                  *(ROOT / "bench").glob("*.py")]
            if (n := len(p.read_text().splitlines())) > LINES_MAX}
    assert not long, long
