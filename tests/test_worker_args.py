"""WorkerArgs: the one typed builder of `dgr-worker serve` arguments renders every option."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dgr.route.supervisor import WorkerArgs

# one value per field and the exact arguments it must render to
CASES = {
    "model": (Path("/m/x.gguf"), ["--model", "/m/x.gguf"]),
    "fake_model": (True, ["--fake-model"]),
    "n_layer": (8, ["--n-layer", "8"]),
    "layers": ((0, 15), ["--layers", "0:15"]),
    "listen": ("127.0.0.1:0", ["--listen", "127.0.0.1:0"]),
    "allow_remote": (True, ["--allow-remote"]),
    "fingerprint": ("fp", ["--fingerprint", "fp"]),
    "artifact_id": ("aid", ["--artifact-id", "aid"]),
    "recipe_json": ('{"a":1}', ["--recipe-json", '{"a":1}']),
    "threads": (3, ["--threads", "3"]),
    "max_sessions": (4, ["--max-sessions", "4"]),
    "ctx_per_session": (256, ["--ctx-per-session", "256"]),
    "kv_budget_mb": (12.5, ["--kv-budget-mb", "12.5"]),
    "kv_cells": (40, ["--kv-cells", "40"]),
    "memory_budget_mb": (512.0, ["--memory-budget-mb", "512.0"]),
    "queue_limit": (64, ["--queue-limit", "64"]),
    "max_batch_tokens": (512, ["--max-batch-tokens", "512"]),
    "max_prefill_chunk": (5, ["--max-prefill-chunk", "5"]),
    "pipeline_groups": (2, ["--pipeline-groups", "2"]),
    "keep_warm_ms": (50, ["--keep-warm-ms", "50"]),
    "metrics_listen": ("127.0.0.1:9100", ["--metrics-listen", "127.0.0.1:9100"]),
    "drain_timeout_s": (2.0, ["--drain-timeout-s", "2.0"]),
    "session_ttl_s": (600.0, ["--session-ttl-s", "600.0"]),
    "tls_cert": (Path("/p/c.pem"), ["--tls-cert", "/p/c.pem"]),
    "tls_key": (Path("/p/k.pem"), ["--tls-key", "/p/k.pem"]),
    "tls_client_ca": (Path("/p/ca.pem"), ["--tls-client-ca", "/p/ca.pem"]),
    "require_client_auth": (True, ["--require-client-auth"]),
    "chain_peers": ("*", ["--chain-peers", "*"]),
    "chain_tls_ca": (Path("/p/ca.pem"), ["--chain-tls-ca", "/p/ca.pem"]),
    "io_nice": (0, ["--io-nice", "0"]),
    "fake_delay_ms": (3, ["--fake-delay-ms", "3"]),
    "probe_budget_s": (5.0, ["--probe-budget-s", "5.0"]),
    "extra": (("--foo", "1"), ["--foo", "1"]),
}


def test_every_field_has_a_case():
    assert {f.name for f in dataclasses.fields(WorkerArgs)} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_option_renders(name):
    value, expected = CASES[name]
    assert WorkerArgs(**{name: value}).argv() == expected


def test_defaults_render_nothing_and_zero_is_kept():
    assert WorkerArgs().argv() == []
    assert WorkerArgs(io_nice=0, allow_remote=False).argv() == ["--io-nice", "0"]


def test_layers_as_text_and_extra_last():
    a = WorkerArgs(layers="4:8", extra=("--threads", "9"), threads=1, fake_model=True)
    assert a.argv() == ["--fake-model", "--layers", "4:8", "--threads", "1", "--threads", "9"]


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        WorkerArgs().threads = 2  # type: ignore[misc]


def test_the_cli_dry_run_renders_through_worker_args(tmp_path):
    from typer.testing import CliRunner

    from dgr.main import app

    r = CliRunner().invoke(app, ["worker", "serve", "--fake-model", "--layers", "0:4", "--io-nice", "0",
                                 "--allow-remote", "--dry-run"])
    assert r.exit_code == 0, r.output
    argv = r.output.split()
    assert argv[1:] == ["serve", *WorkerArgs(fake_model=True, layers="0:4",
                                             io_nice=0, allow_remote=True).argv()]
