"""`dgr build`: configure and build the patched llama.cpp and the dgr-worker."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..errors import DgrError
from ..upstream import build as build_mod

app = typer.Typer()


@app.callback(invoke_without_command=True)
def build(
    backend: str = typer.Option("cpu", "--backend", help="cpu | vulkan | cuda | hip | metal"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Parallel jobs (default: CPU count)."),
    clean: bool = typer.Option(False, "--clean", help="Delete build/<backend>/ first."),
    target: Optional[List[str]] = typer.Option(None, "--target", help="Ninja target(s) (default dgr-worker)."),
    tests: bool = typer.Option(False, "--tests", help="Also build the CTest programs (dgr-tests)."),
    tools: bool = typer.Option(False, "--tools", help="Also build whole-model llama.cpp tools (llama-bench, …)."),
    cuda_arch: Optional[str] = typer.Option(None, "--cuda-arch", help="CUDA architectures for --backend cuda, "
                                            "e.g. '80;89;90' (default: CUDAARCHS, else native with a GPU, else 80;89;90)."),
    sanitize: bool = typer.Option(False, "--sanitize", help="Build in build/<backend>-asan/ with the dgr targets (worker core, "
                                  "worker, tools, CTest programs; not llama.cpp) compiled with AddressSanitizer + UBSan "
                                  "(then: ctest --test-dir build/<backend>-asan; docs/fuzzing.md)."),
    rpc: bool = typer.Option(False, "--rpc", help="Also build llama.cpp's rpc-server and RPC llama-bench, llama-batched-bench in "
                                                  "build/<backend>-rpc/ (the RPC lane of `dgr bench route`)."),
    bundle: Optional[Path] = typer.Option(None, "--bundle", metavar="OUT_DIR",
                                          help="Build a relocatable bundle for a lent GPU machine into OUT_DIR (an ignored folder, "
                                               "e.g. build/bundle-cuda): ggml/llama shared (build/gpu-bundle-<backend>/), dgr-worker, "
                                               "llama-bench, llama-batched-bench, their libraries, stripped; refuses when it and the "
                                               "tree would not travel (64 MiB). --backend cpu, cuda or vulkan (cuda and vulkan also "
                                               "hold the CPU build; --cuda-arch default 90-real: sm_90 code, no PTX). docs/backends.md."),
    wheels: Optional[bool] = typer.Option(None, "--wheels/--no-wheels",
                                          help="With --bundle: carry the Python packages the lent machine lacks (default: with cuda "
                                               "or vulkan)."),
    vulkan: bool = typer.Option(False, "--vulkan", help="With --bundle: also the Vulkan build (build/gpu-bundle-vulkan/) and "
                                                        "the Vulkan loader .debs, for the Vulkan worker on the GPU's driver."),
) -> None:
    """Build build/<backend>/bin/dgr-worker (static llama.cpp, distribution gRPC).

    vulkan: installs glslc, libvulkan1 and mesa-vulkan-drivers with apt (as root; otherwise it
    prints the command) and fetches newer Vulkan headers into build/vulkan-sdk (hash-checked).
    cuda: compile with the machine's nvcc; cuBLAS comes from the toolkit or build/cuda-sdk.
    `dgr doctor` shows what each backend has and lacks."""
    if bundle is not None:
        from ..upstream import bundle as bundle_mod

        if backend not in bundle_mod.BUNDLE_BACKENDS or target or tests or tools or sanitize or rpc or clean:
            raise DgrError("--bundle takes --backend cpu|cuda|vulkan, --vulkan, --cuda-arch, --jobs and --wheels only")
        doc = bundle_mod.make_bundle(bundle, backend, cuda_arch=cuda_arch or bundle_mod.DEFAULT_CUDA_ARCH, jobs=jobs,
                                     wheels=wheels, vulkan=vulkan)
        typer.echo(bundle_mod.summary(doc))
        typer.echo(f"manifest: {bundle / build_mod.BUNDLE_MANIFEST}")
        return
    if vulkan:
        raise DgrError("--vulkan goes with --bundle (a plain Vulkan build is --backend vulkan)")
    if cuda_arch:
        import os

        os.environ["CUDAARCHS"] = cuda_arch
    targets = tuple(target) if target else build_mod.DEFAULT_TARGETS
    if tests:
        targets += build_mod.TEST_TARGETS
    if tools:
        targets += build_mod.TOOL_TARGETS
    import time

    t0 = time.monotonic()
    res = build_mod.build(backend, jobs=jobs, clean=clean, targets=targets, sanitize=sanitize)
    typer.echo(f"built {', '.join(res.targets)} in {res.bin_dir} ({time.monotonic() - t0:.0f} s; toolchain: "
               f"{res.build_dir / build_mod.TOOLCHAIN_RECORD})")
    if rpc:
        typer.echo(f"built rpc-server, llama-bench (GGML_RPC) in {build_mod.build_rpc_tools(backend, jobs=jobs, clean=clean)}")
