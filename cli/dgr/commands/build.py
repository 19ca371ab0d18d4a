"""`dgr build`: configure and build the patched llama.cpp and the dgr-worker."""

from __future__ import annotations

from typing import List, Optional

import typer

from ..upstream import build as build_mod

app = typer.Typer()


@app.callback(invoke_without_command=True)
def build(
    backend: str = typer.Option("cpu", "--backend", help="cpu | vulkan | cuda | hip | metal"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", help="Parallel jobs (default: CPU count)."),
    clean: bool = typer.Option(False, "--clean", help="Delete build/<backend>/ first."),
    target: Optional[List[str]] = typer.Option(None, "--target", help="Ninja target(s) (default dgr-worker)."),
    tests: bool = typer.Option(False, "--tests", help="Also build the CTest programs (dgr-tests)."),
    tools: bool = typer.Option(False, "--tools", help="Also build whole-model llama.cpp tools (llama-bench, …)."),
    rpc: bool = typer.Option(False, "--rpc", help="Also build llama.cpp's rpc-server and an RPC llama-bench in "
                                                  "build/<backend>-rpc/ (the RPC lane of `dgr bench route`)."),
) -> None:
    """Build build/<backend>/bin/dgr-worker (static llama.cpp, distribution gRPC)."""
    targets = tuple(target) if target else build_mod.DEFAULT_TARGETS
    if tests:
        targets += build_mod.TEST_TARGETS
    if tools:
        targets += build_mod.TOOL_TARGETS
    res = build_mod.build(backend, jobs=jobs, clean=clean, targets=targets)
    typer.echo(f"built {', '.join(res.targets)} in {res.bin_dir}")
    if rpc:
        typer.echo(f"built rpc-server, llama-bench (GGML_RPC) in {build_mod.build_rpc_tools(backend, jobs=jobs, clean=clean)}")
