"""The package's import layering, read from the source with `ast`.

Every module of `kvcellar` belongs to one component (its top-level package or
module) and every component to one layer. A module may import its own
component and any component of a layer below its own; components of one layer
are siblings and import neither each other nor anything above. Imports inside
functions count like top-level ones (a deferred import is still a dependency),
and the modules of the package import each other without a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kvcellar"

# Lowest first; "kvcellar" is the package's own `__init__` (its version).
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({PACKAGE, "errors", "cpuinfo"}),
    frozenset({"serialization", "huge_pages", "blas_preload"}),
    frozenset({"store"}),
    frozenset({"engine"}),
    frozenset({"actors", "demo"}),
    frozenset({"http", "simulations"}),
    frozenset({"cli"}),
    frozenset({"bench"}),
)
LAYER_OF = {component: level for level, layer in enumerate(LAYERS) for component in layer}
NOT_PACKAGE = {"tests", "docs", "build", ".venv"}


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (`kvcellar.store.ssd`)."""
    modules: dict[str, Path] = {}
    # Hidden top-level folders (.venv, .agents with the agent clients' own venv and node_modules, .git) are not
    # the package; skipping them before the walk keeps it fast.
    tops = [top for top in PACKAGE_ROOT.iterdir() if not top.name.startswith(".") and top.name not in NOT_PACKAGE]
    paths = [top for top in tops if top.suffix == ".py"] + [
        path for top in tops if top.is_dir() for path in top.rglob("*.py")
    ]
    for path in sorted(paths):
        relative = path.relative_to(PACKAGE_ROOT)
        if any(part.endswith(".egg-info") for part in relative.parts):
            continue
        parts = [PACKAGE, *relative.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """The `kvcellar` modules a module's source imports, anywhere in it
    (relative imports resolved against `module`)."""
    imported: set[str] = set()
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package_parts[: len(package_parts) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            imported.add(base)
            # `from kvcellar.store import kvfile` imports the module `kvcellar.store.kvfile`.
            imported.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in imported if name == PACKAGE or name.startswith(PACKAGE + ".")}


def component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def layering_violations(module: str, imports: set[str]) -> list[str]:
    """Each import of `module` that reaches sideways or up."""
    own = component(module)
    violations = []
    for target in sorted(imports):
        other = component(target)
        if other == own or other not in LAYER_OF:
            continue
        if LAYER_OF[other] >= LAYER_OF[own]:
            where = "in the same layer as" if LAYER_OF[other] == LAYER_OF[own] else "in a layer above"
            violations.append(f"{module} imports {target}: {other} is {where} {own}")
    return violations


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    graph = {}
    for name, path in modules.items():
        targets = imported_modules(path.read_text(), name, path.name == "__init__.py")
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def test_every_component_has_a_layer():
    components = {component(name) for name in package_modules()}
    assert components == set(LAYER_OF), f"give each component a layer: {sorted(components ^ set(LAYER_OF))}"


def test_every_module_imports_only_its_own_component_and_lower_layers():
    violations = [line for module, imports in import_graph().items() for line in layering_violations(module, imports)]
    assert not violations, "\n".join(violations)


def test_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize(
    ("module", "source", "offender"),
    [
        ("kvcellar.store.journal", "import kvcellar.actors.durability\n", "kvcellar.actors.durability"),
        ("kvcellar.engine.engine", "from kvcellar.demo import corpus\n", "kvcellar.demo.corpus"),
        ("kvcellar.actors.system", "from kvcellar.demo.train import train\n", "kvcellar.demo.train"),
        ("kvcellar.http.app", "from kvcellar.cli.serve import serve_command\n", "kvcellar.cli.serve"),
        ("kvcellar.cli.journal", "from kvcellar.bench import soak\n", "kvcellar.bench.soak"),
        ("kvcellar.store.ssd", "def f():\n    from kvcellar.actors import system\n", "kvcellar.actors.system"),
        ("kvcellar.http.app", "from kvcellar.simulations.harness import simulate\n", "kvcellar.simulations.harness"),
        ("kvcellar.errors", "from kvcellar.serialization import to_cbor\n", "kvcellar.serialization"),
        ("kvcellar.store.kvfile", "from ..engine import engine\n", "kvcellar.engine.engine"),
    ],
)
def test_the_check_catches_an_import_that_reaches_up_or_sideways(module, source, offender):
    imports = imported_modules(source, module, is_package=False)
    violations = layering_violations(module, imports)
    assert any(f"imports {offender}:" in line for line in violations), violations


def test_the_check_allows_own_component_and_lower_layers():
    source = (
        "from kvcellar.store import kvfile\nfrom kvcellar.errors import UsageError\n"
        "import kvcellar.engine.engine\nfrom . import gateway\n"
    )
    imports = imported_modules(source, "kvcellar.actors.system", is_package=False)
    assert {"kvcellar.store.kvfile", "kvcellar.engine.engine", "kvcellar.actors.gateway"} <= imports
    assert layering_violations("kvcellar.actors.system", imports) == []
