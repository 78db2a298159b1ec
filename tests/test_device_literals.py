"""Library code follows its inputs' device: no hard-coded ``"cuda"`` or CPU tensors (a static scan).

An op that allocates with ``device="cpu"`` or ``torch.device("cuda")`` works
on this CPU machine and breaks on a GPU (or on the other GPU). The scan reads
every module of ``physicsnemo_dp/`` and ``datapipes/`` (ast, no imports) and
flags:

* string literals ``"cuda"`` / ``"cuda:N"`` anywhere, except as an operand of
  a comparison (``x.device.type == "cuda"`` follows the input);
* ``torch.device("cpu")`` and a ``device="cpu"`` keyword of any call;
* ``.to("cpu")`` and ``.cuda()``;
* a parameter default ``device="cpu"``.

Each place where that is right is listed in ``ALLOWED`` with its reason,
by module and enclosing function (not line: edits elsewhere do not move it).
A new occurrence fails with where it is; an entry that no longer matches
anything fails too, so the list stays what the code does.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("physicsnemo_dp", "datapipes")
_CUDA = re.compile(r"^cuda(:\d+)?$")

#: (module path, enclosing function, what) -> why it is legitimate there.
ALLOWED = {
    ("physicsnemo_dp/collectives.py", "mesh_device", 'torch.device("cpu")'):
        "the mapping from a mesh's device type to the device its collectives use (gloo: CPU)",
    ("physicsnemo_dp/collectives.py", "_post", 'device="cpu"'):
        "host buffers that receive point-to-point transfers gloo cannot make into CUDA memory (send/recv: CPU only)",
    ("physicsnemo_dp/checkpoint.py", "_collective_device", 'torch.device("cpu")'):
        "where a small agreement flag lives: gloo reduces CPU tensors (torch.distributed backend table)",
    ("datapipes/agreement.py", "_device", 'torch.device("cpu")'):
        "where a small agreement flag lives: gloo reduces CPU tensors, NCCL device tensors only",
    ("datapipes/agreement.py", "_device", '"cuda"'):
        "NCCL reduces CUDA tensors only: the flag goes to the current CUDA device",
    ("physicsnemo_dp/distributed/mesh_context.py", "MeshContext.build", '"cuda"'):
        "device selection: cuda when torch.cuda.is_available(), one GPU per LOCAL_RANK (torchrun's contract)",
    ("physicsnemo_dp/distributed/mesh_context.py", "MeshContext.device", '"cuda"'):
        "the mesh's device type is cuda: this rank's device is the current CUDA device",
    ("physicsnemo_dp/launch.py", "_rank_main", '"cuda"'):
        "launch's device from its backend (gloo: CPU, nccl: one GPU per rank via set_device)",
    ("physicsnemo_dp/random.py", "Stream.__init__", 'default device="cpu"'):
        "a generator's device is explicit, as in torch.Generator(device='cpu'): draws follow it, not inputs",
    ("physicsnemo_dp/random.py", "stream", 'default device="cpu"'):
        "as Stream.__init__: the default of torch.Generator",
}  # fmt: skip


def _is_cpu(node) -> bool:
    return isinstance(node, ast.Constant) and node.value == "cpu"


class _Scan(ast.NodeVisitor):
    def __init__(self, module: str):
        self.module = module
        self.where: list[str] = []
        self.compared: set[int] = set()  # ids of constants that are operands of a comparison
        self.found: list[tuple[str, str, str, int]] = []

    def _add(self, what: str, node) -> None:
        self.found.append((self.module, ".".join(self.where) or "<module>", what, node.lineno))

    def _scope(self, node) -> None:
        self.where.append(node.name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg == "device" and _is_cpu(default):
                    self._add('default device="cpu"', default)
        self.generic_visit(node)
        self.where.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_Compare(self, node) -> None:
        for operand in (node.left, *node.comparators):
            for inner in ast.walk(operand):
                if isinstance(inner, ast.Constant):
                    self.compared.add(id(inner))
        self.generic_visit(node)

    def visit_Call(self, node) -> None:
        func = node.func
        named_device = (isinstance(func, ast.Name) and func.id == "device") or (
            isinstance(func, ast.Attribute)
            and func.attr == "device"
            and isinstance(func.value, ast.Name)
            and func.value.id == "torch"
        )
        if named_device and node.args and _is_cpu(node.args[0]):
            self._add('torch.device("cpu")', node)
        if any(kw.arg == "device" and _is_cpu(kw.value) for kw in node.keywords):
            self._add('device="cpu"', node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "to" and node.args and _is_cpu(node.args[0]):
            self._add('.to("cpu")', node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "cuda" and not node.args:
            self._add(".cuda()", node)
        self.generic_visit(node)

    def visit_Constant(self, node) -> None:
        if isinstance(node.value, str) and _CUDA.match(node.value) and id(node) not in self.compared:
            self._add(f'"{node.value}"', node)


def scan(root: Path = ROOT, packages=PACKAGES) -> list[tuple[str, str, str, int]]:
    """``(module, function, what, line)`` of every device literal the rules above flag."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            scanner = _Scan(path.relative_to(root).as_posix())
            scanner.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
            found += scanner.found
    return found


def test_library_code_does_not_hard_code_a_device():
    found = scan()
    new = [
        f"{module}:{line} in {where}: {what}"
        for module, where, what, line in found
        if (module, where, what) not in ALLOWED
    ]
    assert not new, (
        "library code hard-codes a device where it should follow its inputs (allocate with "
        "device=x.device or collectives.mesh_device(mesh)); if it is right there, add it to ALLOWED with "
        "the reason:\n  " + "\n  ".join(new)
    )
    stale = sorted(set(ALLOWED) - {(module, where, what) for module, where, what, _ in found})
    assert not stale, f"ALLOWED lists places that no longer hard-code a device (remove them): {stale}"


def test_the_scan_sees_each_kind_of_hard_coded_device(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "import torch\n"
        "def f(x, device='cpu'):\n"
        "    a = torch.zeros(3, device='cpu')\n"
        "    b = torch.device('cpu')\n"
        "    c = x.to('cuda:0')\n"
        "    d = x.cuda()\n"
        "    e = x.to('cpu')\n"
        "    if x.device.type == 'cuda':  # follows the input: not flagged\n"
        "        return torch.empty(3, device=x.device)\n"
        "class K:\n"
        "    def g(self):\n"
        "        return torch.device('cuda', 0)\n"
    )
    found = [(where, what, line) for _, where, what, line in scan(tmp_path, ("pkg",))]
    assert found == [
        ("f", 'default device="cpu"', 2), ("f", 'device="cpu"', 3), ("f", 'torch.device("cpu")', 4),
        ("f", '"cuda:0"', 5), ("f", ".cuda()", 6), ("f", '.to("cpu")', 7), ("K.g", '"cuda"', 12),
    ]  # fmt: skip
