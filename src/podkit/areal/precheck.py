"""Does trainer.entry import? Asked before the trainer waits for inference, so that an import error on a GPU
pod is named in a second, not after SGLang's minutes of loading and graph capture.

    python precheck.py <script.py | module:function> <checkout>    (in the trainer's Python)

Static, so that it costs no torch import: the entry parses, and every module it imports at its top
level resolves: the checkout's own modules (followed into theirs, and a name imported from one must be
defined there), and the first part of any other module is installed. What it cannot tell (an import in a
`try`, a script that changes sys.path, a module with `__getattr__` or `import *`) it leaves to the run.
Prints a JSON object: {} when nothing is wrong, else the failure as failure.describe writes it.
Stdlib only: it runs in the user's environment, whatever it has.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys


class Unresolved(Exception):
    def __init__(self, type_: str, message: str, path: str, node) -> None:
        super().__init__(message)
        self.type, self.message = type_, message
        self.path, self.lineno = path, getattr(node, "lineno", 0)


def local(name: str, roots: list[str]) -> str | None:
    """The checkout's file for module `name` (a package's __init__.py, or its directory), else None."""
    parts = name.split(".")
    if parts[0] == "areal":
        return None  # the bootstrap runs the installed, patched AReaL, never a checkout's copy
    for root in roots:
        base = os.path.join(root, *parts)
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
        if os.path.isdir(base):  # a namespace package
            return base
    return None


def defined(tree: ast.Module) -> set[str] | None:
    """Top-level names a module defines; None when it cannot be told statically."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                return None
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            return None  # names defined conditionally: not told statically
    return names


class Checker:
    def __init__(self, roots: list[str]) -> None:
        self.roots, self.seen = roots, set()

    def parse(self, path: str) -> ast.Module | None:
        with open(path, "rb") as f:
            source = f.read()
        if b"sys.path" in source:
            return None  # it changes where imports come from: leave it to the run
        return ast.parse(source, path)  # a SyntaxError names its own file and line

    def module(self, path: str) -> None:
        if path in self.seen or os.path.isdir(path):
            return
        self.seen.add(path)
        tree = self.parse(path)
        if tree is None:
            return
        for node in tree.body:  # the top level only: what runs on import
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.resolve(alias.name, path, node)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found = self.resolve(node.module, path, node)
                if found and not os.path.isdir(found):
                    self.names(found, node, path)

    def names(self, found: str, node: ast.ImportFrom, path: str) -> None:
        tree = self.parse(found)
        have = defined(tree) if tree is not None else None
        if have is None:
            return
        for alias in node.names:
            sub = local(f"{node.module}.{alias.name}", self.roots)
            if alias.name != "*" and alias.name not in have and not sub:
                raise Unresolved("ImportError", f"cannot import name {alias.name!r} from {node.module!r} ({found})",
                                 path, node)

    def resolve(self, name: str, path: str, node) -> str | None:
        found = local(name, self.roots)
        if found:
            self.module(found)
            return found
        top = name.split(".")[0]
        if top not in sys.builtin_module_names and importlib.util.find_spec(top) is None:
            raise Unresolved("ModuleNotFoundError", f"No module named {top!r}", path, node)
        return None


def check(entry: str, checkout: str) -> dict:
    if ":" in entry and not entry.endswith(".py"):
        module, _, function = entry.partition(":")
        roots = [checkout]
        path = local(module, roots)
    else:
        path, function = os.path.join(checkout, entry), ""
        roots = list(dict.fromkeys([os.path.dirname(path), checkout]))
        module = ""
    sys.path[:0] = roots
    c = Checker(roots)
    try:
        if path is None:
            c.resolve(module, checkout, None)
            return {}  # installed, not the checkout's: the run imports it
        c.module(path)
        if function and not os.path.isdir(path):
            tree = c.parse(path)
            have = defined(tree) if tree is not None else None
            if have is not None and function not in have:
                raise Unresolved("AttributeError", f"module {module!r} has no attribute {function!r}", path, None)
    except SyntaxError as e:
        return {"type": type(e).__name__, "message": str(e.msg), "where": f"{e.filename}:{e.lineno}",
                "code": (e.text or "").strip()}
    except Unresolved as e:
        code = ""
        if e.lineno:
            try:
                with open(e.path, encoding="utf-8", errors="replace") as f:
                    code = f.read().splitlines()[e.lineno - 1].strip()
            except (OSError, IndexError):
                pass
        return {"type": e.type, "message": e.message, "where": f"{e.path}:{e.lineno}" if e.lineno else e.path,
                "code": code}
    except (OSError, ValueError, RecursionError):
        return {}  # cannot be read here: the run will say
    return {}


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1], sys.argv[2])))
