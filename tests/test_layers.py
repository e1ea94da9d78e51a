"""The package's layers, written once, and the two rules they imply.

LAYERS lists the package's parts bottom to top. A module may import its own part and the parts
below it, never one above (an arrow that runs back up). The PURE parts import no JAX, Flax or
Orbax, directly or through anything they import, so the simulator and the tests run them without
an accelerator stack. Both rules are read from the source tree: a new module in a folder is
covered the moment it exists.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "dilaserve_jax"

# Bottom to top. Parts on one line (a tuple) sit at the same height and may not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core", "serving"),
    ("kernels",),
    ("models",),
    ("mesh",),
    ("decoding",),
    ("tasks",),
    ("serving.policy",),
    ("serving.cluster",),
    ("sim",),
    ("serving.executor",),
    ("frontend",),
    ("server_api",),
    ("serve", "generate", "client"),
    ("bench",),
)
PURE = ("core", "serving", "serving.policy", "serving.cluster", "sim")
ACCELERATOR_STACK = ("jax", "jaxlib", "flax", "orbax")
HEIGHT = {part: h for h, parts in enumerate(LAYERS) for part in parts}


def part_of(module: str) -> str | None:
    """The layer part a dotted module name belongs to (the longest listed prefix), or None."""
    rest = module.removeprefix("dilaserve_jax").lstrip(".")
    best = None
    for part in HEIGHT:
        if rest == part or rest.startswith(part + "."):
            if best is None or len(part) > len(best):
                best = part
    return best


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out.append((".".join(parts), path))
    return out


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, including those inside functions; relative
    imports resolved against `module`."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names if part_of(f"{base}.{a.name}") != part_of(base)]
    return found


def test_every_module_belongs_to_a_layer():
    stray = [m for m, _ in modules() if m != "dilaserve_jax" and part_of(m) is None]
    assert not stray, f"modules outside every layer (add their part to LAYERS): {stray}"


def test_no_import_runs_back_up_the_layers():
    bad = []
    for module, path in modules():
        mine = part_of(module)
        if mine is None:
            continue
        for line, target in imports(path, module):
            theirs = part_of(target) if target.startswith("dilaserve_jax") else None
            if theirs is None or theirs == mine:
                continue
            if HEIGHT[theirs] >= HEIGHT[mine]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({mine}) imports {target} ({theirs})")
    assert not bad, "imports that run up (or sideways across) the layers:\n" + "\n".join(bad)


def test_pure_parts_name_no_accelerator_stack():
    bad = []
    for module, path in modules():
        if part_of(module) not in PURE:
            continue
        for line, target in imports(path, module):
            if target.split(".")[0] in ACCELERATOR_STACK:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
            elif target.startswith("dilaserve_jax") and part_of(target) not in (*PURE, None) and part_of(target) != "tasks":
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}, which is not pure")
    assert not bad, "pure modules reaching for JAX:\n" + "\n".join(bad)


def test_pure_parts_import_without_the_accelerator_stack_installed():
    """Transitively: every pure module imports with JAX, Flax and Orbax made unimportable."""
    pure = [m for m, _ in modules() if part_of(m) in PURE and not m.endswith("__main__")]
    assert len(pure) > 20, pure  # the walk found the folders
    code = textwrap.dedent(f"""
        import importlib, importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in {ACCELERATOR_STACK!r}:
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        for m in {pure!r}:
            importlib.import_module(m)
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_rules_catch_a_violation(tmp_path):
    """The checks can fail: an upward and an impure import in a scratch module are both found."""
    scratch = tmp_path / "scratch.py"
    scratch.write_text("import jax\nfrom dilaserve_jax.serving.executor import runner\n")
    found = [t for _, t in imports(scratch, "dilaserve_jax.serving.policy.scratch")]
    assert "jax" in found
    assert part_of(found[1]) == "serving.executor" and HEIGHT["serving.executor"] > HEIGHT["serving.policy"]
    assert part_of("dilaserve_jax.serving.policy.latency") == "serving.policy"
