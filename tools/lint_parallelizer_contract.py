#!/usr/bin/env python3
"""Check the ModelParallelizer contract that import-linter cannot express.

    python tools/lint_parallelizer_contract.py              # the repository (CI)
    python tools/lint_parallelizer_contract.py PATH ...     # files or directories
    python tools/lint_parallelizer_contract.py --shared DIR PATH ...

Rules (each violation prints ``path:line:col: CODE message``; exit status 1):

PC001  A sidecar (a subclass of ``ModelParallelizer``, directly or through
       another sidecar) defines or assigns a public name. The contract has one
       public operation, ``parallelize(model, mesh_context)``, inherited
       unchanged; a sidecar customizes only protected hooks
       (``_fully_shard_module``, ``_apply_fsdp_sharding``,
       ``_checkpoint_targets``, ``_apply``) and private helpers.
PC002  A file defining a sidecar imports from a submodule of
       ``physicsnemo_dp.distributed`` or a name not in its ``__all__``:
       models depend only on the exported surface.
PC003  Shared code (``--shared``, default ``physicsnemo_dp/distributed``)
       branches on a model's identity: a condition, comparison, subscript or
       ``.get`` key that reads ``__name__``, ``__qualname__``, ``__module__``,
       ``__class__``, ``model_type``, ``architectures``, ``name_or_path`` or
       ``model_name``, or compares ``type(...)``. Model-specific behaviour
       belongs in the model's sidecar. (Names in error messages are fine.)
PC004  A second source of parallelization policy: a function or method that
       takes a ``mesh_context`` also takes a parameter named like a policy
       (``*polic*``, ``*strateg*``, ``*scheme*``, ``parallel_config``,
       ``parallel_plan``, ``parallelize_context``), or a class / function is
       named ``ParallelizeContext`` / ``parallel_scheme``. The resolved
       MeshContext is the only policy input: pipelines
       (``physicsnemo_dp.pipelines``) select components, they do not map
       components to their own strategies.

Only the standard library is used, and nothing is imported: the check is a
pure reading of the source, fast enough for a pre-commit hook.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "physicsnemo_dp.distributed"
BASE_CLASS = "ModelParallelizer"
DEFAULT_PATHS = ("physicsnemo_dp", "examples")
DEFAULT_SHARED = ("physicsnemo_dp/distributed",)
IDENTITY_ATTRIBUTES = frozenset(
    {"__name__", "__qualname__", "__module__", "__class__", "model_type", "architectures",
     "name_or_path", "_name_or_path", "model_name"}
)  # fmt: skip


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    col: int
    code: str
    message: str

    def __str__(self) -> str:
        try:
            shown = self.path.resolve().relative_to(ROOT)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}:{self.col}: {self.code} {self.message}"


def _python_files(paths) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(f for f in sorted(p.rglob("*.py")) if "__pycache__" not in f.parts and ".venv" not in f.parts)
        elif p.suffix == ".py":
            files.append(p)
    return files


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _sidecar_classes(trees: dict[Path, ast.Module]) -> dict[Path, list[ast.ClassDef]]:
    """Classes deriving from ModelParallelizer, transitively by base-class name over all files."""
    classes = [(path, node) for path, tree in trees.items() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    sidecar_names = {BASE_CLASS}
    found: dict[Path, list[ast.ClassDef]] = {}
    changed = True
    while changed:
        changed = False
        for path, cls in classes:
            if cls in found.get(path, []) or not any(_base_name(b) in sidecar_names for b in cls.bases):
                continue
            found.setdefault(path, []).append(cls)
            sidecar_names.add(cls.name)
            changed = True
    return found


def _check_public_members(path: Path, cls: ast.ClassDef) -> list[Violation]:
    out = []
    for node in cls.body:
        names = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [(node.name, node)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [(t.id, t) for t in targets if isinstance(t, ast.Name)]
        for name, where in names:
            if not name.startswith("_"):
                hint = (
                    "do not override parallelize(); override a protected hook"
                    if name == "parallelize"
                    else "make it protected (a leading underscore)"
                )
                out.append(Violation(path, where.lineno, where.col_offset, "PC001",
                                     f"sidecar {cls.name} has public member {name!r}: sidecars expose only "
                                     f"parallelize(); {hint}"))  # fmt: skip
    return out


def _exported_names() -> set[str]:
    init = ROOT / PACKAGE.replace(".", "/") / "__init__.py"
    for node in ast.walk(ast.parse(init.read_text(), str(init))):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _module_of(path: Path) -> str | None:
    try:
        rel = path.resolve().relative_to(ROOT).with_suffix("")
    except ValueError:
        return None
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    if not node.level:
        return node.module or ""
    here = (_module_of(path) or "").split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _check_imports(path: Path, tree: ast.Module, exported: set[str]) -> list[Violation]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [(_absolute(node, path), [a.name for a in node.names])]
        else:
            continue
        for module, names in modules:
            if module.startswith(PACKAGE + "."):
                out.append(Violation(path, node.lineno, node.col_offset, "PC002",
                                     f"sidecar module imports {module}; import from {PACKAGE} (its __all__) only"))  # fmt: skip
            elif module == PACKAGE and names:
                hidden = sorted(set(names) - exported)
                if hidden:
                    out.append(Violation(path, node.lineno, node.col_offset, "PC002",
                                         f"{hidden} are not in {PACKAGE}.__all__; sidecars use exported names only"))  # fmt: skip
    return out


def _reads_identity(node: ast.AST) -> ast.AST | None:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in IDENTITY_ATTRIBUTES:
            return sub
        if isinstance(sub, ast.Constant) and sub.value in IDENTITY_ATTRIBUTES:  # getattr(x, "__name__")
            return sub
    return None


def _compares_type(node: ast.Compare) -> bool:
    operands = [node.left, *node.comparators]
    return any(isinstance(o, ast.Call) and isinstance(o.func, ast.Name) and o.func.id == "type" for o in operands)


def _decision_points(tree: ast.Module):
    """(node, expression) pairs whose value decides control flow or a lookup."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            yield node, node.test
        elif isinstance(node, ast.comprehension):
            for cond in node.ifs:
                yield cond, cond
        elif isinstance(node, ast.Match):
            yield node, node.subject
        elif isinstance(node, ast.Compare):
            yield node, node
        elif isinstance(node, ast.Subscript):
            yield node, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
            yield node, node.args[0]


def _check_model_names(path: Path, tree: ast.Module) -> list[Violation]:
    out, seen = [], set()
    for node, expr in _decision_points(tree):
        culprit = _reads_identity(expr)
        if culprit is None and isinstance(expr, ast.Compare) and _compares_type(expr):
            culprit = expr
        if culprit is not None and (culprit.lineno, culprit.col_offset) not in seen:
            seen.add((culprit.lineno, culprit.col_offset))
            out.append(Violation(path, culprit.lineno, culprit.col_offset, "PC003",
                                 "shared parallelization code branches on a model's name or type; move "
                                 "model-specific behaviour into the model's sidecar"))  # fmt: skip
    return out


POLICY_WORDS = ("polic", "strateg", "scheme", "parallel_config", "parallel_plan", "parallelize_context")
SECOND_API_NAMES = frozenset({"ParallelizeContext", "parallel_scheme"})


def _check_policy_sources(path: Path, tree: ast.Module) -> list[Violation]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in SECOND_API_NAMES:
            out.append(Violation(path, node.lineno, node.col_offset, "PC004",
                                 f"{node.name!r} is a second parallelization API; take a MeshContext "
                                 "(physicsnemo_dp.distributed) instead"))  # fmt: skip
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                  *filter(None, (node.args.vararg, node.args.kwarg))]  # fmt: skip
        if not any(a.arg == "mesh_context" for a in params):
            continue
        for a in params:
            if a.arg != "mesh_context" and any(word in a.arg.lower() for word in POLICY_WORDS):
                out.append(Violation(path, a.lineno, a.col_offset, "PC004",
                                     f"{node.name}() takes mesh_context and also {a.arg!r}: a second policy "
                                     "source; the one resolved MeshContext carries the strategy and policies "
                                     "for every component it parallelizes"))  # fmt: skip
    return out


def lint(paths, shared) -> list[Violation]:
    files = _python_files(paths)
    shared_files = {f.resolve() for f in _python_files(shared)}
    trees = {f: ast.parse(f.read_text(), str(f)) for f in files}
    for f in shared_files - {p.resolve() for p in trees}:
        trees[f] = ast.parse(f.read_text(), str(f))
    violations = []
    sidecars = _sidecar_classes(trees)
    exported = _exported_names() if sidecars else set()
    for path, classes in sidecars.items():
        for cls in classes:
            violations += _check_public_members(path, cls)
        violations += _check_imports(path, trees[path], exported)
    for path, tree in trees.items():
        if path.resolve() in shared_files:
            violations += _check_model_names(path, tree)
        if path in files:
            violations += _check_policy_sources(path, tree)
    return sorted(violations, key=lambda v: (str(v.path), v.line, v.col))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Check the ModelParallelizer sidecar contract.")
    parser.add_argument("paths", nargs="*", help=f"files or directories to scan (default: {' '.join(DEFAULT_PATHS)})")
    parser.add_argument("--shared", action="append", help=f"shared code checked for model-name branching (default: {DEFAULT_SHARED[0]})")
    args = parser.parse_args(argv)
    paths = args.paths or [ROOT / p for p in DEFAULT_PATHS]
    shared = args.shared or [ROOT / p for p in DEFAULT_SHARED]
    missing = [str(p) for p in [*paths, *shared] if not Path(p).exists()]
    if missing:
        parser.error(f"no such file or directory: {missing}")
    violations = lint(paths, shared)
    for v in violations:
        print(v)
    if violations:
        print(f"{len(violations)} parallelizer-contract violation(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
