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
import importlib.machinery
import importlib.util
import json
import os
import sys


class CannotTell(Exception):
    """The code changes how imports resolve (sys.path, site, import hooks, globals()): the run decides."""


# Text that makes a static answer unsafe, in any module the check reads: none of it is refused, all is left
# to the run. A working script must never be refused here.
DYNAMIC = (b"sys.path", b"site.", b"pyximport", b"globals()", b"__path__", b"importlib", b"sys.modules",
           b"exec(", b"__import__")


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
        init = os.path.join(base, "__init__.py")
        if os.path.isfile(base + ".py"):
            return base + ".py"
        if os.path.isfile(init):
            return init
        # A compiled or extension module (.so, .pyc, .pyd): it resolves; there is nothing to read.
        for suffix in importlib.machinery.all_suffixes():
            if os.path.isfile(base + suffix):
                return base + suffix
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
        elif not isinstance(node, (ast.Expr, ast.Pass, ast.Assert)):
            return None  # anything else (if, try, with, match, a loop, type, del...): not told statically
    return names


class Checker:
    def __init__(self, roots: list[str]) -> None:
        self.roots, self.seen = roots, set()

    def parse(self, path: str) -> ast.Module | None:
        with open(path, "rb") as f:
            source = f.read()
        if any(d in source for d in DYNAMIC):
            raise CannotTell(path)
        return ast.parse(source, path)  # a SyntaxError names its own file and line

    def module(self, path: str) -> None:
        if path in self.seen or not path.endswith(".py"):
            return  # a namespace package's directory or an extension: nothing to read
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
                if found and found.endswith(".py"):
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
        if function and path.endswith(".py"):
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
    except (CannotTell, OSError, ValueError, RecursionError):
        return {}  # cannot be told, or read, here: the run will say
    return {}


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1], sys.argv[2])))
