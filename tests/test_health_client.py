"""WorkerClient.health speaks the standard grpc.health.v1 service (grpcio-health-checking):
checked against the reference Python health servicer, no native build needed."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dgr.protocol.client import WorkerClient, WorkerError


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_health_reads_each_status(health_server):
    servicer, target = health_server
    S = health_pb2.HealthCheckResponse
    servicer.set("", S.SERVING)
    servicer.set("dgr.shard.v1.ShardRuntimeService", S.NOT_SERVING)
    with WorkerClient(target) as c:
        assert c.health() == "SERVING"
        assert c.health("dgr.shard.v1.ShardRuntimeService") == "NOT_SERVING"
        servicer.set("", S.UNKNOWN)
        assert c.health() == "UNKNOWN"


def test_an_unknown_service_is_a_worker_error(health_server):
    _, target = health_server
    with WorkerClient(target) as c, pytest.raises(WorkerError):
        c.health("no.such.Service", timeout=5)
