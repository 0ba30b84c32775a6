"""The router tried as an attacker would: each test is one way in that must stay shut, run
against a real router (HTTP and gRPC) over a real engine and a real redis-server.

Keys come from a keys file the tests rewrite (revocation); the router reads it again every
0.2 s here (5 s as deployed)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router import keys as api_keys
from router.redis_server import EmbeddedRedis, free_port
from tests.router.helpers import MODEL, PROMPT, RunningRouter, get, post, raw_completion_stream

pytestmark = pytest.mark.slow

A, B = "sk-alice-0123456789", "sk-bob-9876543210"
ONE_AT_A_TIME = "sk-single-stream-key"
FEW_TOKENS = "sk-twenty-tokens-key"
ISOLATED = "sk-isolated-tenant-key"
KEYS_FILE = f"""# the attack suite's keys
{A} alice
{B} bob
{ONE_AT_A_TIME} single concurrency=1
{FEW_TOKENS} few tokens_per_s=0.001 token_burst=20
{ISOLATED} isolated isolate_cache=true
"""
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEYS_FILE)
    return path


@pytest.fixture(scope="module")
def keyed(local_engine, checkpoint, redis_server, keys_file) -> Iterator[RunningRouter]:  # type: ignore[no-untyped-def]
    """A router whose keys come from `keys_file` (its own Redis database)."""
    running = _watchful_router(local_engine, checkpoint, redis_server, 7, keys_file=str(keys_file))
    yield running
    running.stop()


def _watchful_router(engine: Any, checkpoint: Any, redis: Any, db: int, **kw: Any) -> RunningRouter:
    """A router that looks at its keys and TLS files every 0.2 s."""
    from router.backends import LocalBackend
    from tests.router.helpers import start_router

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(api_keys, "RELOAD_EVERY_S", 0.2)
        return start_router(LocalBackend(engine), checkpoint.tokenizer, redis, db=db, **kw)


def _redis(router: RunningRouter) -> Any:
    import redis

    return redis.Redis.from_url(router.redis_url)


def _completion(router: RunningRouter, key: str | None, **body: Any) -> tuple[int, Any, str]:
    code, out, _, headers = post(router.url + "/v1/completions", {**BODY, **body}, key)
    return code, out, headers.get("x-request-id", "")


def _wait_for(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_keys_hold_whatever_redis_holds(keyed: RunningRouter) -> None:
    """Redis loses the keys (deleted, or replaced by a key someone wrote into it): the router
    still asks for a key, takes only its own, and writes its mirror back."""
    client = _redis(keyed)
    client.delete("outrider:keys")
    intruder = api_keys.key_digest("sk-written-into-redis")
    client.hset("outrider:keys", intruder, json.dumps({"name": "x", "requests_per_s": 0}))
    assert _completion(keyed, None)[0] == 401
    assert _completion(keyed, "sk-written-into-redis")[0] == 401
    assert _completion(keyed, A)[0] == 200
    configured = {api_keys.key_digest(k).encode() for k in (A, B, ONE_AT_A_TIME, FEW_TOKENS)}
    configured.add(api_keys.key_digest(ISOLATED).encode())
    # The mirror is rewritten from the configuration: the intruder's entry is gone.
    assert _wait_for(lambda: set(client.hkeys("outrider:keys")) == configured)
    assert client.ttl("outrider:keys") > 0
    assert get(keyed.url + "/v1/models")[0] == 401
    assert _grpc_code(keyed, None) == "UNAUTHENTICATED"
    assert _grpc_code(keyed, "sk-written-into-redis") == "UNAUTHENTICATED"
    assert _grpc_code(keyed, A) == "OK"


def _grpc_code(router: RunningRouter, key: str | None) -> str:
    """The status of a short gRPC generation with `key`."""
    import grpc

    from router.proto import generate_pb2, generate_pb2_grpc

    metadata = [] if key is None else [("authorization", f"Bearer {key}")]
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = generate_pb2.GenerateRequest(prompt=PROMPT, max_tokens=2)
        try:
            list(stub.Generate(request, metadata=metadata, timeout=60))
        except grpc.RpcError as err:
            return str(err.code().name)
    return "OK"


def test_a_key_removed_from_the_file_is_revoked(keyed: RunningRouter, keys_file: Path) -> None:
    new = "sk-carol-added-later"
    assert _completion(keyed, new)[0] == 401
    keys_file.write_text(KEYS_FILE.replace(f"{B} bob\n", f"{new} carol\n"))
    try:
        assert _wait_for(lambda: _completion(keyed, new)[0] == 200)
        assert _completion(keyed, B)[0] == 401  # bob's key is gone
        mirror = _redis(keyed).hgetall("outrider:keys")
        assert api_keys.key_digest(B).encode() not in mirror
        assert api_keys.key_digest(new).encode() in mirror
        keys_file.write_text("")  # an emptied file: nobody gets in, the API does not open
        assert _wait_for(lambda: _completion(keyed, A)[0] == 401)
        assert _completion(keyed, None)[0] == 401
    finally:
        keys_file.write_text(KEYS_FILE)
        assert _wait_for(lambda: _completion(keyed, B)[0] == 200)


def test_another_keys_requests_and_responses_are_not_found(keyed: RunningRouter) -> None:
    code, _, request_id = _completion(keyed, A)
    assert code == 200 and request_id
    url = f"{keyed.url}/v1/requests/{request_id}"
    code, record = _wait_for(lambda: (lambda r: r if r[0] == 200 else None)(get(url, A)))
    assert code == 200 and "owner" not in record
    assert get(url, B)[0] == 404
    assert post(url + "/resume", b"", B)[0] == 404
    first = {"input": "Hi", "max_output_tokens": 3}
    code, response, _, _ = post(keyed.url + "/v1/responses", first, A)
    assert code == 200
    stored = f"{keyed.url}/v1/responses/{response['id']}"
    assert get(stored, A)[0] == 200 and get(stored, B)[0] == 404
    follow_up = {"input": "And?", "max_output_tokens": 3, "previous_response_id": response["id"]}
    code, refused, _, _ = post(keyed.url + "/v1/responses", follow_up, B)
    assert code == 404 and refused["error"]["param"] == "previous_response_id"
    assert _delete(stored, B) == 404 and get(stored, A)[0] == 200
    assert _delete(stored, A) == 200
    # The delete took the registry's entry of the request that made the response too.
    assert get(f"{keyed.url}/v1/requests/{response['id']}", A)[0] == 404
    assert _redis(keyed).keys(f"outrider:request:{response['id']}*") == []


def _delete(url: str, key: str) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, method="DELETE", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def test_ids_that_are_not_ids_and_refused_redis_commands_do_not_degrade(
    keyed: RunningRouter,
) -> None:
    """An id naming another Redis structure is not found; a Redis command that fails (a key of
    the wrong type) fails that call alone: the replica stays ready and serving."""
    code, _, request_id = _completion(keyed, A)
    assert code == 200
    assert get(f"{keyed.url}/v1/requests/{request_id}:prompt", A)[0] == 404
    assert get(f"{keyed.url}/v1/responses/x:y", A)[0] == 404
    _redis(keyed).set("outrider:request:planted", "a string, not a hash")
    code, error = get(f"{keyed.url}/v1/requests/planted", A)
    assert code == 500 and error["error"]["type"] == "server_error"
    assert get(keyed.url + "/ready") == (200, {"status": "ready", "redis": True})
    assert _completion(keyed, A)[0] == 200


def test_store_false_leaves_nothing_in_the_registry(keyed: RunningRouter) -> None:
    code, _, request_id = _completion(keyed, A, store=False)
    assert code == 200
    assert _wait_for(lambda: not _redis(keyed).keys(f"outrider:request:{request_id}*"))
    assert get(f"{keyed.url}/v1/requests/{request_id}", A)[0] == 404


def test_many_choices_with_large_settings_are_registered_once(keyed: RunningRouter) -> None:
    """16 choices of a request with 16 stop strings of 200 kB: the registry keeps one copy
    of its settings (and none of a request past the cap), not one a choice."""
    stops = ["\x00" + "s" * 200_000 + str(i) for i in range(16)]
    code, out, request_id = _completion(keyed, A, n=16, stop=stops, max_tokens=2)
    assert code == 200 and len(out["choices"]) == 16
    client = _redis(keyed)
    keys = client.keys(f"outrider:request:{request_id}*")
    used = sum(client.memory_usage(k, samples=0) or 0 for k in keys)
    assert used < 200_000  # over the 1 MiB cap: nothing kept for resuming
    code, out, request_id = _completion(keyed, A, n=16, stop=stops[:4], max_tokens=2)
    assert code == 200
    prefix = f"outrider:request:{request_id}"
    # Each choice's last tokens are written as it ends, after the answer went out: 16 entries,
    # 16 token lists and the one prompt.
    assert _wait_for(lambda: len(client.keys(prefix + "*")) == 33)
    sizes = {k.decode(): client.memory_usage(k, samples=0) or 0 for k in client.keys(prefix + "*")}
    assert sizes.pop(prefix + "-0") > 800_000  # the settings, kept with the first choice
    assert len(sizes) == 32 and max(sizes.values()) < 1000  # once, not sixteen times


def test_a_huge_body_is_refused_while_it_streams_in(keyed: RunningRouter) -> None:
    """64 MB, declared (refused on its Content-Length) and chunked (refused past 4 MB, read
    and dropped up to 16 MB):
    413 both times, the router's memory growing by far less than the body."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        for chunked in (False, True):
            status = _send_huge_body(keyed.port, 64 << 20, chunked)
            assert status == 413, (chunked, status)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    assert _completion(keyed, A)[0] == 200


def _send_huge_body(port: int, size: int, chunked: bool) -> int:
    """POST `size` bytes of a JSON string to /v1/completions over a bare socket; the status."""
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {A}\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {size}\r\n\r\n"
    piece = b"a" * (1 << 16)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())

        def send() -> None:
            try:
                for _ in range(size // len(piece)):
                    if chunked:
                        sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    else:
                        sock.sendall(piece)
            except OSError:
                pass  # the router answered and closed: the rest is never read

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        answer = sock.recv(64).decode(errors="replace")
        sock.shutdown(socket.SHUT_RDWR)
    sender.join(timeout=30)
    return int(answer.split()[1])


def test_per_key_concurrency_and_token_budget(keyed: RunningRouter) -> None:
    body = {**BODY, "max_tokens": 200, "ignore_eos": True}
    with raw_completion_stream(keyed.port, body, key=ONE_AT_A_TIME) as sock:
        assert b"data:" in sock.recv(4096) or b"data:" in sock.recv(4096)
        code, out, _ = _completion(keyed, ONE_AT_A_TIME)
        assert code == 429 and out["error"]["type"] == "rate_limit_error"
        assert _completion(keyed, A)[0] == 200  # other keys are not held up
    assert _wait_for(lambda: _completion(keyed, ONE_AT_A_TIME)[0] == 200)
    # 20 tokens a key (prompt + max_tokens), refilled at 0.001/s: one request of 5 + 10.
    assert _completion(keyed, FEW_TOKENS, max_tokens=10, ignore_eos=True)[0] == 200
    code, out, _ = _completion(keyed, FEW_TOKENS, max_tokens=10)
    assert code == 429 and "token rate limit" in out["error"]["message"]
    code, out, _ = _completion(keyed, FEW_TOKENS, max_tokens=30)
    assert code == 400 and out["error"]["param"] == "max_tokens"


def test_the_fairness_load_test_floods_one_key_and_times_another(
    keyed: RunningRouter, tmp_path: Path
) -> None:
    """`python -m load_tests fairness`: one user of the single-stream key is served and never
    refused; four of them are refused (429) past its limit, while every victim request is
    served; then the priority phase (the flooder's batch less urgent), both keys busy, and the
    report's figures."""
    from load_tests.__main__ import main
    from tests.router.helpers import small_workload

    argv = ["fairness", "--url", keyed.url, "--victim-key", A, "--flood-key", ONE_AT_A_TIME]
    argv += ["--requests", "3", "--max-tokens", "4", "--flood-users", "1,4"]
    argv += ["--flood-max-tokens", "4", "--share-users", "1", "--share-seconds", "2"]
    argv += ["--workload", small_workload(tmp_path), "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    data = json.loads((tmp_path / "run" / "fairness.json").read_text())
    phases = {p["name"]: p for p in data["phases"]}
    assert list(phases) == [
        "alone", "flood, 1 user", "flood, 4 users", "priority", "shares", "alone, after"
    ]  # fmt: skip
    assert all(p["completed"] == 3 for name, p in phases.items() if name != "shares")
    shares = phases["shares"]
    assert shares["victim_tokens_per_s"] > 0 and shares["flood_tokens_per_s"] > 0
    assert phases["flood, 1 user"]["flood_served"] > 0
    assert phases["flood, 1 user"]["refusals"] == {}
    assert phases["flood, 4 users"]["refusals"].get("429", 0) > 0
    assert data["slowdown"] > 0
    text = (tmp_path / "run" / "fairness.md").read_text()
    assert "heaviest flood" in text and "Urgent requests" in text and "share" in text
    page = (tmp_path / "run" / "fairness.html").read_text()
    assert 'id="victim"' in page and 'id="shares"' in page and "<svg" in page


def test_an_isolated_key_shares_no_cache(keyed: RunningRouter) -> None:
    prompt = "Once upon a time, in a land of many rivers and hills, there lived a"
    for key in (A, A):
        code, out, _ = _completion(keyed, key, prompt=prompt)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # A's own second time
    code, out, _ = _completion(keyed, ISOLATED, prompt=prompt)
    assert code == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    code, out, _ = _completion(keyed, ISOLATED, prompt=prompt)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its own, again
    code, out, _ = _completion(keyed, A, prompt=prompt, cache_salt="tenant-7")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_request_line_names_the_key_never_the_key_itself(
    keyed: RunningRouter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="outrider.requests")
    assert _completion(keyed, B)[0] == 200
    lines = _wait_for(lambda: [r for r in caplog.records if r.name == "outrider.requests"])
    fields = lines[-1].fields  # type: ignore[attr-defined]
    assert fields["key"] == "bob" and B not in json.dumps(fields)


def test_tls_for_http_and_grpc_with_renewed_certificates(
    local_engine, checkpoint, redis_server, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """HTTPS only (a plain request is not answered), gRPC over TLS, /docs switched off; the
    certificate renewed on disk is served to the next connections."""
    import ssl
    import urllib.request

    import grpc

    from router.proto import generate_pb2, generate_pb2_grpc

    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    first = _self_signed(cert, key, "first")
    tls = (str(cert), str(key))
    running = _watchful_router(local_engine, checkpoint, redis_server, 8, tls=tls, docs=False)
    try:
        url = f"https://localhost:{running.port}"
        context = ssl.create_default_context(cadata=first.decode())
        with urllib.request.urlopen(url + "/health", context=context, timeout=30) as resp:
            assert resp.status == 200
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{running.port}/health", timeout=10).read()
        for path in ("/docs", "/openapi.json", "/redoc"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(url + path, context=context, timeout=30)
            assert err.value.code == 404
        credentials = grpc.ssl_channel_credentials(root_certificates=first)
        with grpc.secure_channel(f"localhost:{running.grpc_port}", credentials) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            request = generate_pb2.GenerateRequest(prompt=PROMPT, max_tokens=2)
            assert sum(len(r.token_ids) for r in stub.Generate(request)) == 2
        renewed = _self_signed(cert, key, "renewed")
        served = _wait_for(lambda: _served_certificate(running.port) == _der(renewed))
        assert served
        credentials = grpc.ssl_channel_credentials(root_certificates=renewed)
        with grpc.secure_channel(f"localhost:{running.grpc_port}", credentials) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            assert len(list(stub.Generate(request, timeout=60))) >= 1
    finally:
        running.stop()


def _self_signed(cert: Path, key: Path, name: str) -> bytes:
    """A self-signed certificate for localhost written to `cert` and `key`; its PEM."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    built = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    pem = built.public_bytes(serialization.Encoding.PEM)
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert.write_bytes(pem)
    return pem


def _der(pem: bytes) -> bytes:
    import ssl

    return ssl.PEM_cert_to_DER_cert(pem.decode())


def _served_certificate(port: int) -> bytes:
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        return tls.getpeercert(binary_form=True) or b""


def test_requests_of_the_largest_settings_keep_redis_within_its_memory(
    local_engine, checkpoint
) -> None:  # type: ignore[no-untyped-def]
    """Requests whose settings are as large as the registry keeps (~0.8 MB each), five times
    the memory of a Redis bounded at 16 MB: Redis evicts the oldest entries, never refuses a
    write, and the router serves every request and stays ready."""
    import redis

    from router.backends import LocalBackend
    from tests.router.helpers import start_router

    server = EmbeddedRedis(restart=False, max_memory="16mb").start()
    running = start_router(LocalBackend(local_engine), checkpoint.tokenizer, server, keys=None)
    stops = ["\x00" + "s" * 200_000 + str(i) for i in range(4)]
    try:
        codes = [
            post(running.url + "/v1/completions", {**BODY, "stop": stops, "max_tokens": 1})[0]
            for _ in range(100)
        ]
        client = redis.Redis(port=server.port)
        memory = client.info("memory")
        stats = client.info("stats")
        ready = get(running.url + "/ready")
    finally:
        running.stop()
        server.stop()
    assert codes == [200] * 100
    assert memory["used_memory"] <= memory["maxmemory"] * 1.05
    assert stats["evicted_keys"] > 0
    assert ready == (200, {"status": "ready", "redis": True})


def test_redis_keeps_a_memory_bound_when_embedded() -> None:
    """The embedded redis-server evicts what expires rather than refuse writes or grow."""
    import redis

    server = EmbeddedRedis(port=free_port(), restart=False).start()
    try:
        config = redis.Redis(port=server.port).config_get("maxmemory*")
    finally:
        server.stop()
    assert int(config["maxmemory"]) > 0 and config["maxmemory-policy"] == "volatile-lru"
