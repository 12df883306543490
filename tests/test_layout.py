"""The package's layout rules, checked from the source: no import cycles, no reads of another
object's private attributes."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "replayssm"


def _modules():
    """Map each module name of the package to its parsed source."""
    mods = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (ast.parse(path.read_text(), str(path)), is_pkg)
    return mods


def _resolve(name, module, level, is_pkg):
    """The absolute module name that `from <level dots><module> import ...` refers to."""
    if level == 0:
        return module
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_graph():
    """Edges module -> package modules it imports, at module level or inside functions alike.

    `from pkg import name` counts as an import of `pkg.name` when that is a module, else of `pkg`.
    """
    mods = _modules()
    graph = {name: set() for name in mods}
    for name, (tree, is_pkg) in mods.items():
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node.module, node.level, is_pkg)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith(PACKAGE):
                    graph[name].add(t)
    return graph


def find_cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


# torch.Tensor's in-place version counter has no public name.
PUBLIC_UNDERSCORED = {"_version"}


def _is_private_read(node: ast.Attribute, imported: set[str]) -> bool:
    """`obj._name` with obj other than self, cls, super() or an imported module, `_name` no dunder."""
    attr, owner = node.attr, node.value
    if not attr.startswith("_") or attr.startswith("__") or attr in PUBLIC_UNDERSCORED:
        return False
    # super()._name: an override calling the method it overrides, on self.
    if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
        return False
    # self/cls: the class's own state; an imported name: a module's member, e.g. torch._dynamo.
    return not (isinstance(owner, ast.Name) and owner.id in ("self", "cls", *imported))


def private_reads():
    """Every private read (`_is_private_read`) in the package, as 'module:line obj._name'."""
    found = []
    for name, (tree, _) in _modules().items():
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update((a.asname or a.name).split(".")[0] for a in node.names)
        found += [f"{name}:{node.lineno} {ast.unparse(node)}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and _is_private_read(node, imported)]
    return found


def test_no_import_cycles():
    """No two modules of the package import each other, directly or through others."""
    assert find_cycles(import_graph()) == []


def test_no_private_attribute_reads():
    """No module reads a private attribute of another object than self or cls."""
    assert private_reads() == []


def test_checks_find_what_they_look_for():
    """The cycle and private-read checks report a planted cycle and a planted private read."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("def f(runner):\n"
                     "    return runner._committed, self._ok, runner.__class__, super()._ok\n")
    reads = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and _is_private_read(n, set())]
    assert reads == ["runner._committed"]
