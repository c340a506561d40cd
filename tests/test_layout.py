"""The code's layout, held (issue 32): no import cycle, file or function past its size, beyond
the ones listed here as still to cut. Each list may only shrink: a new cycle, a new file over
600 lines or a new function over 80 lines outside scripts/ and tests/ fails here. The import
ladder itself is `lint-imports` (pyproject.toml), run by .ci/run."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("offload", "runners", "nvme")

KNOWN_CYCLES: list[set[str]] = []
KNOWN_LONG_FILES: set[str] = set()
KNOWN_LONG_FUNCTIONS: set[tuple[str, str]] = set()
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def _sources():
    for base in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, base)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT), open(path, encoding="utf-8").read()


def _module(rel: str) -> str:
    mod = rel[:-3].replace(os.sep, ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere: top level, in functions (deferred) and
    under TYPE_CHECKING alike."""
    sources = dict(_sources())
    modules = {_module(rel): rel for rel in sources}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, rel in modules.items():
        package = mod if rel.endswith("__init__.py") else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(sources[rel])):
            if isinstance(node, ast.Import):
                graph[mod] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    target = full if full in modules else base if base in modules else None
                    if target and target != mod:
                        graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_import_cycles_are_only_the_known_ones():
    got = cycles(import_graph())
    new = [sorted(c) for c in got if c not in KNOWN_CYCLES]
    assert not new, f"new import cycle(s), cut them at a seam (docs/ARCHITECTURE.md): {new}"
    cut = [sorted(c) for c in KNOWN_CYCLES if c not in got]
    assert not cut, f"cut already: remove from KNOWN_CYCLES {cut}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_new_file_or_function_past_its_size():
    long_files, long_functions = set(), set()
    for rel, source in _sources():
        if source.count("\n") > MAX_FILE_LINES:
            long_files.add(rel)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long_functions.add((rel, node.name))
    assert long_files <= KNOWN_LONG_FILES, f"over {MAX_FILE_LINES} lines: {sorted(long_files - KNOWN_LONG_FILES)}"
    assert long_functions <= KNOWN_LONG_FUNCTIONS, \
        f"over {MAX_FUNCTION_LINES} lines: {sorted(long_functions - KNOWN_LONG_FUNCTIONS)}"


MAX_TOP_LEVEL_MODULES = 12


def test_offload_keeps_its_concepts_in_packages():
    top = [n for n in os.listdir(os.path.join(ROOT, "offload")) if n.endswith(".py") and n != "__init__.py"]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, \
        f"offload/ has {len(top)} top-level modules (at most {MAX_TOP_LEVEL_MODULES}): move {sorted(top)} into the package of their concept"
