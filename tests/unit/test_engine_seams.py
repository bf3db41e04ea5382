"""The engine package's own seams (docs/architecture.md, "Engine"): its subpackages import only the floors
below them, and nothing outside `engine/engine.py` assigns an attribute of the engine (helpers that drive
it, the warm-up, calibration and isolation, call its methods)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_layering import imported

ENGINE = Path(__file__).resolve().parents[2] / "hyserve" / "engine"

# floor of each engine module or subpackage: imports inside hyserve.engine point to a lower floor, or stay
# within one subpackage, or join two top-level modules of one floor
FLOORS = {
    "errors": 0,
    "outputs": 0,
    "request": 0,
    "sampling_params": 0,
    "warmup_report": 0,
    "host_tensors": 0,
    "gc_tuning": 0,
    "scheduler": 1,
    "sampling": 1,
    "runner": 2,
    "speculative": 2,
    "parallel": 3,
    "assembly": 4,
    "faults": 5,
    "input_processor": 5,
    "output_processor": 5,
    "pending_step": 5,
    "isolation": 5,
    "engine": 5,
    "engine_stats": 5,
    "lifecycle": 6,
    "engine_loop": 6,
    "delta_collector": 7,
    "engine_front": 7,
    "llm": 7,
    "async_engine": 8,
    "engine_process": 8,
}


def unit_of(rel: tuple[str, ...]) -> str:
    """The FLOORS key of a module path inside hyserve/engine (its subpackage, or the module itself)."""
    return rel[0].removesuffix(".py")


def test_every_engine_module_has_a_floor() -> None:
    units = {unit_of(f.relative_to(ENGINE).parts) for f in ENGINE.rglob("*.py")} - {"__init__"}
    assert units == set(FLOORS), f"add to FLOORS: {sorted(units - set(FLOORS))}; gone: {set(FLOORS) - units}"


def test_engine_imports_point_down() -> None:
    bad = []
    for f in sorted(ENGINE.rglob("*.py")):
        if f.name == "__init__.py" and f.parent == ENGINE:
            continue
        me = unit_of(f.relative_to(ENGINE).parts)
        for mod in imported(f):
            parts = mod.split(".")
            if parts[0] != "engine" or len(parts) < 2:
                continue
            other = parts[1]
            if other == me:
                continue
            # top-level modules of one floor may import each other (the cycle test keeps them acyclic);
            # subpackages of one floor may not
            packages = (ENGINE / other).is_dir() or (ENGINE / me).is_dir()
            if FLOORS[other] > FLOORS[me] or (FLOORS[other] == FLOORS[me] and packages):
                bad.append(f"{f.relative_to(ENGINE.parent)} (floor {FLOORS[me]}) imports hyserve.{mod} ")
    assert not bad, "\n".join(bad)


def _engine_attribute_writes(tree: ast.AST) -> list[int]:
    """Lines assigning `engine.x`, `eng.x`, `self.engine.x` (or an item of one: `eng.counters[k] += 1`)."""

    def is_engine(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("engine", "eng", "e")) or (
            isinstance(node, ast.Attribute) and node.attr in ("engine", "_engine")
        )

    def target_hits(t: ast.expr) -> bool:
        while isinstance(t, ast.Subscript):
            t = t.value
        if isinstance(t, ast.Tuple | ast.List):
            return any(target_hits(x) for x in t.elts)
        return isinstance(t, ast.Attribute) and is_engine(t.value)

    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if node.args and is_engine(node.args[0]):
                lines.append(node.lineno)
        if any(target_hits(t) for t in targets):
            lines.append(node.lineno)
    return lines


def test_only_the_engine_assigns_its_attributes() -> None:
    root = ENGINE.parent
    bad = []
    for f in sorted(root.rglob("*.py")):
        if f == ENGINE / "engine.py":
            continue
        bad += [
            f"{f.relative_to(root.parent)}:{n}" for n in _engine_attribute_writes(ast.parse(f.read_text()))
        ]
    assert not bad, "assignments to the engine's attributes outside engine/engine.py:\n" + "\n".join(bad)


def test_the_attribute_check_sees_each_form() -> None:
    src = (
        "eng.cache = x\n"
        "eng.counters['a'] += 1\n"
        "self.engine.warmup_report: int = 1\n"
        "engine.a, b = 1, 2\n"
        "setattr(engine, 'cache', x)\n"
        "eng.scheduler.cost = x\n"  # a part's attribute: the part's business
        "other.cache = x\n"
    )
    assert _engine_attribute_writes(ast.parse(src)) == [1, 2, 3, 4, 5]
