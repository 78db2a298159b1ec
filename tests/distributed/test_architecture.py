"""The architecture guardrails, run the way CI runs them: as subprocesses.

* ``lint-imports`` checks the import contracts in ``pyproject.toml`` (the
  layers of ``docs/architecture.md`` point one way; core tensor code does not
  import ``physicsnemo_dp.distributed``; nothing in ``physicsnemo_dp`` imports
  ``datapipes`` or ``examples``);
* the import graph has no cycles, every module of the package has a layer,
  and private torch APIs are reached only through ``_torch_compat.py``;
* ``tools/lint_parallelizer_contract.py`` checks what import rules cannot
  (one public method on sidecars, exported imports only, no model-name
  branching in shared code).

Each is also run on deliberately broken inputs, so a check that silently
stopped checking would fail here.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib

import grimp
import networkx

from .._tools import executable

ROOT = Path(__file__).resolve().parents[2]
LINT_SCRIPT = ROOT / "tools" / "lint_parallelizer_contract.py"


def _lint_imports_executable() -> str:
    return executable("lint-imports", "import-linter")


def _run(command, cwd) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(cwd))
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _lint_imports(cwd) -> subprocess.CompletedProcess:
    return _run([_lint_imports_executable(), "--no-cache", "--no-logo"], cwd)


def test_import_contracts_hold():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


def test_layers_contract_catches_an_upward_import(tmp_path):
    shutil.copytree(ROOT / "physicsnemo_dp", tmp_path / "physicsnemo_dp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "physicsnemo_dp" / "rule_kit.py", "a") as f:  # the kit reaching up to the families
        f.write("\ndef _peek():\n    from .rules import pointwise\n    return pointwise\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "Layers point one way (docs/architecture.md) BROKEN" in result.stdout
    assert "physicsnemo_dp.rule_kit -> physicsnemo_dp.rules.pointwise" in result.stdout


def _import_graph(package: str = "physicsnemo_dp") -> networkx.DiGraph:
    """Every import between modules of ``package``, function-level imports included."""
    graph = grimp.build_graph(package)
    g = networkx.DiGraph()
    for module in graph.modules:
        g.add_node(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.startswith(package):
                g.add_edge(module, imported)
    return g


def test_no_import_cycles():
    cycles = [sorted(c) for c in networkx.strongly_connected_components(_import_graph()) if len(c) > 1]
    assert cycles == [], f"import cycles between modules of physicsnemo_dp: {cycles}"


def test_every_module_has_a_layer():
    """A new top-level module must be placed in the layers contract, or nothing constrains it."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers"]
    named = {name.strip() for layer in layers["layers"] for name in layer.split("|")}
    package = ROOT / "physicsnemo_dp"
    present = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    present |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert present - named == set(), f"modules without a layer in pyproject.toml: {sorted(present - named)}"
    assert named - present == set(), f"layers naming no module: {sorted(named - present)}"


def _private_torch_uses(path: Path, root: Path = ROOT) -> list[str]:
    """Imports and attribute chains from ``torch`` that pass through a private (``_x``) name."""
    private = lambda name: name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # noqa: E731
    nodes = list(ast.walk(ast.parse(path.read_text(), str(path))))
    inner = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}  # only whole chains count
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            names = [".".join([value.id, *reversed(parts)])] if isinstance(value, ast.Name) else []
        else:
            continue
        for name in dict.fromkeys(names):
            parts = name.split(".")
            if parts[0] == "torch" and any(private(p) for p in parts[1:]):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
                break  # one finding per statement
    return found


def test_private_torch_apis_only_in_torch_compat():
    """A torch upgrade must be a one-file change: private torch names appear only in _torch_compat.py."""
    files = [p for d in ("physicsnemo_dp", "datapipes") for p in (ROOT / d).rglob("*.py")]
    uses = [u for p in files if p.name != "_torch_compat.py" for u in _private_torch_uses(p)]
    assert uses == [], "private torch APIs outside physicsnemo_dp/_torch_compat.py:\n" + "\n".join(uses)


def test_private_torch_check_finds_every_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nimport torch._dynamo\nfrom torch.utils import _pytree\n"
        "from torch._ops import OpOverload\nx = torch._C.TensorBase\ny = torch.__version__\n"
        "z = torch.nn.functional.pad\n"
    )
    found = [u.split(": ", 1)[1] for u in _private_torch_uses(sample, tmp_path)]
    assert found == ["torch._dynamo", "torch.utils._pytree", "torch._ops", "torch._C.TensorBase"], found


def test_import_contracts_catch_violations(tmp_path):
    shutil.copytree(ROOT / "physicsnemo_dp", tmp_path / "physicsnemo_dp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "physicsnemo_dp" / "errors.py", "a") as f:
        f.write("\nimport datapipes\nfrom examples import train_ddp_domain\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "physicsnemo_dp is not allowed to import datapipes" in result.stdout
    assert "physicsnemo_dp is not allowed to import examples" in result.stdout
    assert "does not import datapipes or examples BROKEN" in result.stdout

    with open(tmp_path / "physicsnemo_dp" / "split.py", "a") as f:
        f.write("\nfrom .distributed import MeshContext\n")
    with open(tmp_path / "physicsnemo_dp" / "launch.py", "a") as f:  # allowed: launch is not core
        f.write("\nfrom .distributed import MeshContext\n")
    result = _lint_imports(tmp_path)
    assert "Core tensor code does not import physicsnemo_dp.distributed BROKEN" in result.stdout
    assert "import physicsnemo_dp does not load physicsnemo_dp.distributed BROKEN" in result.stdout
    assert "physicsnemo_dp.split -> physicsnemo_dp.distributed" in result.stdout
    assert "physicsnemo_dp.launch -> physicsnemo_dp.distributed" not in result.stdout
    assert result.returncode != 0


def test_parallelizer_lint_passes_on_the_repository():
    result = _run([sys.executable, str(LINT_SCRIPT)], ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


_BAD_SIDECARS = '''
from physicsnemo_dp.distributed import ModelParallelizer, MeshContext
from physicsnemo_dp.distributed import sync_helpers
from physicsnemo_dp.distributed.parallelizer import find_blocks
import physicsnemo_dp.distributed.precision


class WideParallelizer(ModelParallelizer):
    strategy_name = "mine"

    def _fully_shard_module(self, module, **kwargs):
        return module

    def parallelize_fsdp2(self, model, mesh_context):
        return model


class EntryParallelizer(WideParallelizer):
    def parallelize(self, model, mesh_context):
        return model
'''

_GOOD_SIDECAR = '''
from physicsnemo_dp.distributed import ModelParallelizer


class MyParallelizer(ModelParallelizer):
    def __init__(self):
        self._seen = 0

    def _fully_shard_module(self, module, **kwargs):
        self._seen += 1
        return super()._fully_shard_module(module, **kwargs)

    def _helper(self):
        return None


class NotASidecar:
    def parallelize_anything(self):
        return None
'''

_MODEL_NAME_BRANCHES = '''
def choose(model, table):
    if type(model).__name__ == "Transolver":
        return 1
    if "Mesh" in model.__class__.__qualname__:
        return 2
    x = 3 if model.config.model_type == "unet" else 4
    while getattr(model, "__name__") != "x":
        break
    if type(model) is dict:
        return 5
    handler = table[type(model).__name__]
    other = table.get(model.config.architectures[0])
    ok = [m for m in model.modules() if m.__module__.startswith("models")]
    raise ValueError(f"{type(model).__name__} is fine in a message")
'''


def test_parallelizer_lint_rejects_violations(tmp_path):
    bad, good, shared = tmp_path / "bad_sidecar.py", tmp_path / "good_sidecar.py", tmp_path / "shared"
    shared.mkdir()
    bad.write_text(_BAD_SIDECARS)
    good.write_text(_GOOD_SIDECAR)
    (shared / "dispatch.py").write_text(_MODEL_NAME_BRANCHES)
    result = _run([sys.executable, str(LINT_SCRIPT), "--shared", str(shared), str(tmp_path)], ROOT)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    by_file = lambda name: [line.split(": ", 1)[1] for line in lines if Path(line.split(":")[0]).name == name]  # noqa: E731

    sidecar = by_file("bad_sidecar.py")
    assert sum(v.startswith("PC001") for v in sidecar) == 3, sidecar  # strategy_name, parallelize_fsdp2, parallelize
    assert any("public member 'parallelize_fsdp2'" in v for v in sidecar)
    assert any("public member 'strategy_name'" in v for v in sidecar)
    assert any("EntryParallelizer has public member 'parallelize'" in v and "do not override" in v for v in sidecar)
    assert any("['sync_helpers'] are not in physicsnemo_dp.distributed.__all__" in v for v in sidecar)
    assert any("imports physicsnemo_dp.distributed.parallelizer" in v for v in sidecar)
    assert any("imports physicsnemo_dp.distributed.precision" in v for v in sidecar)
    assert len(sidecar) == 6, sidecar

    assert by_file("good_sidecar.py") == []
    flagged = sorted(int(line.split(":")[1]) for line in lines if "dispatch.py" in line)
    assert all("PC003" in line for line in lines if "dispatch.py" in line)
    # every line of the snippet that branches on identity; the error message on line 15 does not
    assert flagged == [3, 5, 7, 8, 10, 12, 13, 14], result.stdout


def test_parallelizer_lint_cli_errors(tmp_path):
    result = _run([sys.executable, str(LINT_SCRIPT), str(tmp_path / "missing.py")], ROOT)
    assert result.returncode == 2 and "no such file or directory" in result.stderr
    result = _run([sys.executable, str(LINT_SCRIPT), "--help"], ROOT)
    assert result.returncode == 0 and "PATH" in result.stdout.upper()


_SECOND_POLICY_SOURCES = '''
class ParallelizeContext:
    pass


class Pipeline:
    @classmethod
    def from_components(cls, components, *, mesh_context=None, component_strategies=None, frozen=()):
        return cls()

    def load(self, mesh_context, parallel_scheme=None, mp_policies=None):
        return self


def from_checkpoint(path, *, mesh_context=None, components_to_parallelize=(), components_to_load=()):
    return path


def build(strategy, policy):  # no mesh_context: an ordinary config builder
    return strategy
'''


def test_parallelizer_lint_rejects_a_second_policy_source(tmp_path):
    """PC004: the resolved MeshContext is the only policy input of a loader (no per-component policy map)."""
    (tmp_path / "pipeline.py").write_text(_SECOND_POLICY_SOURCES)
    result = _run([sys.executable, str(LINT_SCRIPT), "--shared", str(tmp_path), str(tmp_path)], ROOT)
    assert result.returncode == 1
    lines = [line for line in result.stdout.splitlines() if "PC004" in line]
    assert sorted(int(line.split(":")[1]) for line in lines) == [2, 8, 11, 11], result.stdout
    assert any("'component_strategies'" in line for line in lines)
    assert any("'mp_policies'" in line for line in lines) and any("'parallel_scheme'" in line for line in lines)
    assert any("'ParallelizeContext' is a second parallelization API" in line for line in lines)
