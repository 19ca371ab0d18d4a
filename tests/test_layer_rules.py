"""Two rules of the layers, checked on the source (``ast``), with the behaviour tests that
exercise the code paths elsewhere:

- only the protocol package (``dgr.protocol``) touches a worker's raw gRPC stub or gRPC's own
  error types: every other module goes through ``AsyncWorkerClient`` / ``WorkerClient`` and
  catches the client's error types (``dgr.protocol.errors``);
- logic modules report through ``logging``: none takes a text-printing callback (a ``log``
  parameter, or any parameter typed ``Callable[[str], None]``); the CLI layer decides how log
  records are shown (``dgr.console``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = (REPO / "cli" / "dgr", REPO / "meshnet_adapter")
PROTOCOL = REPO / "cli" / "dgr" / "protocol"
GENERATED = REPO / "cli" / "dgr" / "shard"
CLI = (REPO / "cli" / "dgr" / "commands", REPO / "cli" / "dgr" / "main.py")
RAW_GRPC_ERRORS = {"RpcError", "AioRpcError"}


def _sources(skip: tuple[Path, ...]) -> list[Path]:
    return sorted(p for root in ROOTS for p in root.rglob("*.py")
                  if not any(p == s or s in p.parents for s in skip))


def raw_stub_uses(path: Path, base: Path = REPO) -> list[str]:
    """``x.stub`` attribute reads and gRPC error types (``grpc.RpcError``, ``AioRpcError``) in
    one file, as 'path:line: what'."""
    out = []
    rel = path.relative_to(base)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "stub":
            out.append(f"{rel}:{node.lineno}: .stub")
        elif isinstance(node, ast.Attribute) and node.attr in RAW_GRPC_ERRORS:
            out.append(f"{rel}:{node.lineno}: {node.attr}")
        elif isinstance(node, ast.Name) and node.id in RAW_GRPC_ERRORS:
            out.append(f"{rel}:{node.lineno}: {node.id}")
    return out


def printer_params(path: Path, base: Path = REPO) -> list[str]:
    """Parameters of functions in one file that take a text printer: named ``log`` and typed
    as a callable (or untyped), or typed ``Callable[[str], None]`` whatever their name."""
    out = []
    rel = path.relative_to(base)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
            ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            text_printer = "Callable[[str], None]" in ann.replace("'", "").replace('"', "")
            if text_printer or (arg.arg == "log" and (not ann or "Callable" in ann)):
                out.append(f"{rel}:{node.lineno}: {node.name}({arg.arg}: {ann or '?'})")
    return out


def test_only_the_protocol_package_touches_raw_stubs():
    offenders = [hit for p in _sources((PROTOCOL, GENERATED)) for hit in raw_stub_uses(p)]
    assert not offenders, "use the protocol client and its error types:\n" + "\n".join(offenders)


def test_the_stub_scan_sees_a_raw_call(tmp_path):
    """The scan is not vacuous: a raw call and a raw error catch are found."""
    probe = tmp_path / "probe.py"
    probe.write_text("import grpc\n\nasync def f(sh):\n    try:\n        await sh.stub.GetMetrics(None)\n"
                     "    except (grpc.RpcError, grpc.aio.AioRpcError):\n        pass\n")
    hits = raw_stub_uses(probe, tmp_path)
    assert sorted(h.split(": ", 1)[1] for h in hits) == [".stub", "AioRpcError", "RpcError"], hits


def test_logic_modules_take_no_printer_callbacks():
    offenders = [hit for p in _sources((*CLI, GENERATED)) for hit in printer_params(p)]
    assert not offenders, "log through logging.getLogger(__name__) instead:\n" + "\n".join(offenders)


def test_the_printer_scan_sees_a_callback(tmp_path):
    """The scan is not vacuous: both shapes of a printer parameter are found, a structured
    record named ``log`` is not."""
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import Callable\n\n"
                     "def a(x, *, log: Callable[[str], None] | None = None): ...\n"
                     "def b(say: 'Callable[[str], None]'): ...\n"
                     "def c(log=None): ...\n"
                     "def d(log: 'CommandLog'): ...\n")
    hits = printer_params(probe, tmp_path)
    assert [h.split(": ", 1)[1].split("(")[0] for h in hits] == ["a", "b", "c"], hits
