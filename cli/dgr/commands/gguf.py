"""`dgr gguf …`: inspect, fingerprint, slice and verify GGUF files; write synthetic models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..gguf import gguf_set, presets as gguf_presets, slice as gguf_slice, synth as gguf_synth, identity
from ..gguf.models import resolve_model

app = typer.Typer(no_args_is_help=True)

FileArg = typer.Argument(None, help="GGUF file or any part of a split set PREFIX-NNNNN-of-MMMMM.gguf "
                         "(default: the embedded SmolLM2-135M).", show_default=False)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


@app.command("inspect")
def inspect_cmd(
    file: Optional[Path] = FileArg,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Architecture, hyper-parameters, tensors grouped by layer range, types, sizes, tokenizer."""
    info = gguf_set.inspect_model(resolve_model(file))
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    typer.echo(f"{info['path']}  ({_mib(info['file_bytes'])}, GGUF v{info['gguf_version']})")
    if info.get("parts"):
        typer.echo(f"  split set:     {len(info['parts'])} parts (metadata in part 1)")
        for part in info["parts"]:
            extra = f" + {', '.join(part['globals'])}" if part["globals"] else ""
            typer.echo(f"    {Path(part['path']).name:<40} {_mib(part['file_bytes']):>12} "
                       f"{part['n_tensors']:>5} tensors  layers {part['layers']}{extra}")
    typer.echo(f"  name:          {info['name']}")
    typer.echo(f"  architecture:  {info['architecture']}")
    hp = info["hparams"]
    typer.echo(f"  layers:        {hp.get('block_count')}   n_embd: {hp.get('embedding_length')}   "
               f"n_ff: {hp.get('feed_forward_length')}   context: {hp.get('context_length')}")
    typer.echo(f"  heads:         {hp.get('attention.head_count')} (KV heads {hp.get('attention.head_count_kv')})")
    if info["tied_output"] is not None:
        typer.echo(f"  output:        {'tied to token_embd' if info['tied_output'] else 'separate output.weight'}")
    types = ", ".join(f"{k} x{v}" for k, v in info["types"].items())
    typer.echo(f"  tensors:       {info['n_tensors']} ({_mib(info['tensor_bytes'])}): {types}")
    for g in info["groups"]:
        types = ", ".join(f"{k} x{v}" for k, v in g["types"].items())
        extra = f", {_mib(g['bytes_per_layer'])}/layer" if "bytes_per_layer" in g else ""
        names = ", ".join(g["names"]) if len(g["names"]) <= 4 else f"{len(g['names'])} per layer"
        typer.echo(f"    {g['range']:<14} {g['tensors']:>4} tensors {_mib(g['bytes']):>12}{extra}  [{types}]  {names}")
    tok = info["tokenizer"]
    typer.echo(f"  tokenizer:     {tok['model']} (pre {tok['pre']}), vocab {tok['n_vocab']}, "
               f"bos {tok.get('bos_token_id')}, eos {tok.get('eos_token_id')}"
               + (f", merges {tok['n_merges']}" if "n_merges" in tok else "")
               + (", chat template" if tok["chat_template"] else ""))
    typer.echo(f"  tokenizer digest: {tok['digest']}")
    if info["slice"]:
        s = info["slice"]
        typer.echo(f"  slice:         layers {s.get('layer_start')}:{s.get('layer_end')} of {s.get('n_layer')}"
                   f" (head={s.get('head')}, tail={s.get('tail')})")
        typer.echo(f"  source artifact id: {s.get('source_artifact_id')}")


@app.command("fingerprint")
def fingerprint_cmd(
    file: Optional[Path] = FileArg,
    as_json: bool = typer.Option(False, "--json", help="Print JSON with every manifest entry."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Hash again even when cached."),
) -> None:
    """The artifact manifest and artifact id (sha256 of the canonical manifest), cached by (path, size, mtime)."""
    ident = identity.identify(resolve_model(file), use_cache=not no_cache)
    if as_json:
        typer.echo(json.dumps(ident.to_json(), indent=2))
        return
    typer.echo(f"artifact id:      {ident.artifact_id}")
    typer.echo(f"metadata digest:  {ident.metadata_digest}")
    typer.echo(f"tokenizer digest: {ident.tokenizer_digest}")
    typer.echo(f"architecture:     {ident.architecture}")
    if ident.parts:
        typer.echo(f"split set:        {len(ident.parts)} parts, {', '.join(Path(q).name for q in ident.parts)}")
    typer.echo(f"tensors:          {len(ident.manifest.tensors)} ({_mib(ident.manifest.total_bytes)})")
    typer.echo(f"weight types:     {identity.weight_types_digest(ident.manifest)} "
               f"{identity.weight_types_summary(ident.manifest)}")


@app.command("slice")
def slice_cmd(
    src: Path = typer.Argument(..., help="Source GGUF (a whole artifact, or any part of a split set; never a slice)."),
    layers: str = typer.Option(..., "--layers", help="Layer range START:END (END exclusive), e.g. 0:15."),
    out: Path = typer.Option(..., "-o", "--out", help="Output GGUF."),
) -> None:
    """Write the sub-GGUF a layer range owns, bound to the source artifact id (dgr.slice.* metadata)."""
    res = gguf_slice.slice_gguf(resolve_model(src), gguf_slice.LayerRange.parse(layers), out)
    roles = [r for r, on in (("head", res.range.is_head()), ("tail", res.range.is_tail(res.n_layer))) if on]
    typer.echo(f"wrote {res.path}: layers {res.range} of {res.n_layer}"
               f"{' (' + ', '.join(roles) + ')' if roles else ''}, {len(res.tensors)} tensors, "
               f"{_mib(res.file_bytes)}; source artifact id {res.source_artifact_id}")
    if res.source_parts > 1:
        typer.echo(f"  tensor data read from {len(res.read_from)} of {res.source_parts} parts: "
                   f"{', '.join(Path(q).name for q in res.read_from)}")


@app.command("verify-slice")
def verify_slice_cmd(
    slice_file: Path = typer.Argument(..., metavar="SLICE", help="Slice GGUF."),
    source: Optional[Path] = typer.Option(None, "--source", help="Also check against this source GGUF (or any "
                                          "part of a split set)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Expect exactly this range START:END."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check a slice's tensors against its embedded manifest and, given --source, against the source."""
    expect = gguf_slice.LayerRange.parse(layers) if layers else None
    rep = gguf_slice.verify_slice(slice_file, resolve_model(source) if source else None, expect_range=expect)
    if as_json:
        typer.echo(json.dumps(rep.to_json(), indent=2))
        return
    typer.echo(f"ok: {rep.path} layers {rep.range} of {rep.n_layer}, source artifact id {rep.source_artifact_id}")
    for c in rep.checks:
        typer.echo(f"  - {c}")


@app.command("synth")
def synth_cmd(
    out: Path = typer.Option(..., "-o", "--out", help="Output GGUF."),
    preset: Optional[str] = typer.Option(
        None, "--preset", help="Realistic shapes of a model family (random weights, labelled synthetic): "
        f"{', '.join(gguf_presets.PRESETS)}. --layers overrides its depth; --dtype is f16, q8_0 or q4_k_m "
        "(default q4_k_m)."),
    arch: str = typer.Option("llama", "--arch", help=f"One of: {', '.join(gguf_synth.ARCHS)} (tiny models)."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Number of layers (tiny default: 4)."),
    tied: bool = typer.Option(False, "--tied", help="Tie the output to the token embedding (no output.weight)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Weight type of the matrices: f32, f16, q8_0 or "
                                        "q4_k_m (default: f32; q4_k_m with --preset)."),
    seed: int = typer.Option(0, "--seed", min=0, help="Random seed (same seed, same bytes)."),
    n_embd: int = typer.Option(64, "--n-embd", min=1, help="Embedding width."),
    experts: int = typer.Option(8, "--experts", min=1, help="qwen3moe: experts per layer."),
    experts_used: int = typer.Option(2, "--experts-used", min=1, help="qwen3moe: experts each token is routed to (top-k)."),
) -> None:
    """Write a random-weight model with a small real tokenizer (llama.cpp loads and runs it).

    Without --preset: a tiny model for tests. With --preset: the exact shapes of a published
    family (heads, KV heads, head size, FFN, vocabulary, RoPE, context), written tensor by tensor
    (memory: about one tensor). qwen3 adds per-head Q/K norms; qwen3moe adds a router
    (ffn_gate_inp) and stacked expert tensors (ffn_{gate,up,down}_exps) in every layer (the
    variant has no shared experts)."""
    if preset is not None:
        spec = gguf_synth.spec_from_preset(preset, dtype=dtype or "q4_k_m", n_layer=layers, seed=seed)
        p = gguf_presets.preset(preset)
        if p.note and layers is None:
            typer.echo(f"note: {p.note}", err=True)
    else:
        spec = gguf_synth.SynthSpec(arch=arch, n_layer=layers or 4, tied=tied, dtype=dtype or "f32", seed=seed,
                                    n_embd=n_embd, n_ff=3 * n_embd, n_expert=experts, n_expert_used=experts_used)
    path = gguf_synth.synthesize(spec, out, progress=True)
    moe = f", {spec.n_expert} experts (top-{spec.n_expert_used})" if spec.arch == "qwen3moe" else ""
    shape = (f"{spec.preset} shapes: {spec.n_head} heads x {spec.head_dim}, {spec.n_head_kv} KV heads, "
             f"FFN {spec.n_ff}, vocabulary {len(gguf_synth.padded_vocab(spec.n_vocab).tokens)}, "
             f"context {spec.n_ctx}, " if spec.preset else "")
    typer.echo(f"wrote {path} ({_mib(path.stat().st_size)}): SYNTHETIC weights, {shape}{spec.arch}, "
               f"{spec.n_layer} layers, n_embd {spec.n_embd}, {spec.dtype}{', tied' if spec.tied else ''}{moe}, "
               f"seed {seed}")


@app.command("recipe")
def recipe_cmd(
    file: Optional[Path] = FileArg,
    backend: str = typer.Option("cpu", "--backend", help="Backend this Shard would run on."),
    plan: Optional[str] = typer.Option(None, "--plan", help="The route's backend plan, e.g. cpu+vulkan "
                                       "(default: --backend alone); part of the fingerprint."),
    device_class: Optional[str] = typer.Option(
        None, "--device-class", help="The device class the Shard computes on, as its worker reports it "
        "(GetCapability.device): cpu, vulkan:llvmpipe, vulkan:nvidia, cuda:sm_90, … Default: cpu on the cpu "
        "backend; on any other there is none without a worker (unknown: not routable)."),
    activation_dtype: str = typer.Option("f32", "--activation-dtype", help="Activation dtype on the wire."),
    kv_dtype: str = typer.Option("f16", "--kv-dtype", help="KV cache dtype."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """The runtime recipe a Shard of this GGUF (artifact or slice) would serve, its fingerprint and
    registry status: routable only on a device class the registry entry is certified for."""
    from ..errors import DgrError
    from ..gguf import recipe as recipe_mod

    if device_class is None:
        device_class = "cpu" if backend == "cpu" else ""
    elif device_class:
        try:
            on = recipe_mod.device_class_backend(device_class)
        except recipe_mod.RecipeError as exc:
            raise DgrError(f"--device-class {exc}", hint=exc.hint) from None
        if on != backend:
            raise DgrError(f"--device-class {device_class} is a {on} device, not a {backend} one (--backend {backend})")
    r = recipe_mod.recipe_for(resolve_model(file), backend=backend, activation_dtype=activation_dtype,
                              kv_dtype=kv_dtype, backends=plan or "").with_(device_class=device_class)
    reg = recipe_mod.load_registry()
    entry = reg.lookup(r)
    status = "unregistered" if entry is None else f"{entry.status} ({entry.name})"
    why = reg.refusal(r)
    if not device_class:
        why = (f"device class unknown: not routable (give --device-class as the {backend} worker reports it; "
               f"`{recipe_mod.certify_command(r.plan)}` certifies this machine's device)")
    certified_on = list(entry.certified_devices(r.plan)) if entry is not None and entry.status == "certified" else []
    local = set(entry.local_devices(r.plan)) if entry is not None else set()
    if as_json:
        typer.echo(json.dumps({**r.to_json(), "registry": status, "routable": not why,
                               "certified_devices": certified_on, "certified_here": sorted(local),
                               **({"why": why} if why else {})}, indent=2))
        return
    for k, v in r.to_json().items():
        if k == "device_class":
            v = v or "unknown"
        typer.echo(f"{k + ':':<26}{v}")
    typer.echo(f"{'registry:':<26}{status}; routable: {'yes' if not why else 'no'}")
    shown = ", ".join(d + (" (this machine)" if d in local else "") for d in certified_on) or "none"
    typer.echo(f"{'certified devices:':<26}{shown}")
    if why:
        typer.echo(f"{'why:':<26}{why}")
