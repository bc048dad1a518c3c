"""zerokit's imports go downward only: no cycle, core/'s sub-packages in their declared order, core/ below the rest.

Every module under zerokit/ is parsed with `ast` (nothing is imported); each `import` / `from ... import`
is resolved to the zerokit module it names and recorded as module-level or lazy (inside a function, where
it runs only when called). The checks:
- (a) no import cycle among zerokit modules counting module-level imports (a cycle there can fail at
  import time, depending on which module is imported first); lazy imports may not close one either,
  so that the graph stays a layering and a lazy import is only a way to defer torch or a slow import;
- (b) core/'s layers import only the layers `ALLOWED` lists below them (every import, lazy ones too):
  collectives at the bottom, then the options every layer reads (core/nest.py, core/precision.py,
  core/config.py), then params, then grads and accounting (accounting may read params), then the
  engine (core/engine.py, core/preemption.py) on top;
- (c) nothing in zerokit/core imports zerokit/stages, zerokit/checkpoint or zerokit/commands.
Each check takes the graph as data, so `test_each_check_finds_a_planted_violation` plants a cycle
(flat_param importing user_grads, user_grads importing flat_param), a lazy upward import that closes a
cycle (precision importing flat_param) and a stage import from core/, and shows each is reported.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "zerokit"

# core/'s layers: a module belongs to the first prefix it starts with.
LAYERS = {
    "collectives": ("zerokit.core.collectives",),
    "options": ("zerokit.core.nest", "zerokit.core.precision", "zerokit.core.config"),
    "params": ("zerokit.core.params",),
    "grads": ("zerokit.core.grads",),
    "accounting": ("zerokit.core.accounting",),
    "engine": ("zerokit.core.engine", "zerokit.core.preemption"),
}
# who may import whom (besides its own layer): downward only
ALLOWED = {
    "collectives": set(),
    "options": {"collectives"},
    "params": {"collectives", "options"},
    "grads": {"collectives", "options", "params"},
    "accounting": {"collectives", "options", "params"},
    "engine": {"collectives", "options", "params", "grads", "accounting"},
}
ABOVE_CORE = ("zerokit.stages", "zerokit.checkpoint", "zerokit.commands")


def modules():
    """{dotted name: source} for every module under zerokit/ (a package's __init__ as the package)."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = (p.read_text(), p.name == "__init__.py")
    return out


def imports(sources):
    """{module: {imported zerokit module: "module" or "lazy"}} (module-level wins over lazy)."""
    names = set(sources)

    def target(name):
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, (text, is_pkg) in sources.items():
        found = {}

        def visit(node, lazy):
            for child in ast.iter_child_nodes(node):
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    if isinstance(child, ast.Import):
                        cands = [a.name for a in child.names]
                    else:
                        base = child.module or ""
                        if child.level:  # relative: from the package this module is in
                            pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                            pkg = pkg[:len(pkg) - (child.level - 1)]
                            base = ".".join(pkg + ([base] if base else []))
                        # `from zerokit.core.params import unit` imports the module zerokit.core.params.unit
                        cands = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in child.names]
                    for c in cands:
                        t = target(c)
                        if t.startswith("zerokit") and t != mod and found.get(t) != "module":
                            found[t] = "lazy" if lazy else "module"
                visit(child, inner)

        visit(ast.parse(text), False)
        graph[mod] = found
    return graph


def cycles(graph, kinds=("module",)):
    """The strongly connected components of more than one module, following imports of `kinds` (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, kind in graph.get(v, {}).items():
            if kind not in kinds or w not in graph:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def layer_of(mod):
    return next((name for name, prefixes in LAYERS.items()
                 if any(mod == p or mod.startswith(p + ".") for p in prefixes)), None)


def check_layers(graph):
    """Every import between core/'s layers goes to a layer ALLOWED below; every core module has a layer."""
    bad = []
    for mod, found in sorted(graph.items()):
        if not mod.startswith("zerokit.core.") or mod == "zerokit.core":
            continue
        src = layer_of(mod)
        if src is None:
            bad.append(f"{mod}: in no layer of test_layering.LAYERS")
            continue
        for t, kind in sorted(found.items()):
            dst = layer_of(t)
            if dst is not None and dst != src and dst not in ALLOWED[src]:
                bad.append(f"{mod} ({src}) imports {t} ({dst}, {kind}): {src} may import only {sorted(ALLOWED[src])}")
    return bad


def check_core_below_the_rest(graph):
    """Nothing in zerokit/core imports a stage, the checkpoint code or a command."""
    return [f"{mod} imports {t} ({kind})" for mod, found in sorted(graph.items())
            if mod == "zerokit.core" or mod.startswith("zerokit.core.")
            for t, kind in sorted(found.items()) if t.startswith(ABOVE_CORE)]


GRAPH = imports(modules())


def test_no_import_cycle_among_module_level_imports():
    assert cycles(GRAPH) == []


def test_no_import_cycle_counting_lazy_imports_too():
    assert cycles(GRAPH, kinds=("module", "lazy")) == []


def test_core_layers_import_only_downward():
    assert check_layers(GRAPH) == []


def test_core_imports_no_stage_checkpoint_or_command():
    assert check_core_below_the_rest(GRAPH) == []


def test_the_graph_sees_lazy_and_module_level_imports():
    """The parser finds what it must: a module-level import, a lazy one, and `from package import module`."""
    assert GRAPH["zerokit.core.engine"]["zerokit.core.params.flat_param"] == "module"
    assert GRAPH["zerokit.core.accounting.ledger"]["zerokit.core.params.flat_param"] == "lazy"
    assert GRAPH["zerokit.core.collectives.comm"]["zerokit.core.collectives.ordered"] == "module"
    assert GRAPH["zerokit.lora"]["zerokit.quant"] == "module" and "zerokit.lora" not in GRAPH["zerokit.quant"]


def test_each_check_finds_a_planted_violation():
    """A planted cycle, upward import and stage import are each reported (the real graph passes above)."""
    planted = {mod: dict(found) for mod, found in GRAPH.items()}
    planted["zerokit.core.grads.user_grads"]["zerokit.core.params.flat_param"] = "module"
    planted["zerokit.core.params.flat_param"]["zerokit.core.grads.user_grads"] = "module"
    assert ["zerokit.core.grads.user_grads", "zerokit.core.params.flat_param"] in cycles(planted)
    bad = check_layers(planted)
    assert len(bad) == 1 and bad[0].startswith("zerokit.core.params.flat_param (params) imports "
                                               "zerokit.core.grads.user_grads (grads, module)"), bad
    lazy = {mod: dict(found) for mod, found in GRAPH.items()}
    lazy["zerokit.core.precision"]["zerokit.core.params.flat_param"] = "lazy"  # flat_param imports precision
    assert cycles(lazy) == [] and cycles(lazy, kinds=("module", "lazy")) != []
    assert [b.split(" (")[0] for b in check_layers(lazy)] == ["zerokit.core.precision"]
    above = {mod: dict(found) for mod, found in GRAPH.items()}
    above["zerokit.core.engine"]["zerokit.stages.zero3"] = "lazy"
    assert check_core_below_the_rest(above) == ["zerokit.core.engine imports zerokit.stages.zero3 (lazy)"]
    text = {"zerokit.x": ("from zerokit import y\n\ndef f():\n    from . import z\n", False),
            "zerokit.y": ("import zerokit.x\n", False), "zerokit.z": ("", False), "zerokit": ("", True)}
    g = imports(text)
    assert g["zerokit.x"] == {"zerokit.y": "module", "zerokit.z": "lazy"}
    assert cycles(g) == [["zerokit.x", "zerokit.y"]]
