"""API key lifecycle through gatewayctl's rendered standalone gateway (`envoy.live_config`):
`gatewayctl keys add` + `apply` makes a new key work; `keys revoke` + `apply` refuses the key on a
keep-alive connection that was open before; a key outside its validity window is refused 401; the
usage record, the daily usage hash, `gatewayctl usage --by api-key` and the request log carry the
key's name, never the key.

The time from `apply` to the refusal is printed, not asserted (a generous deadline only: this
machine is shared)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from helpers import auth, chat_body, post, wait_for
from sidecar_checks import landed_events, usage_hash
from stack import (
    FILTER_NATIVE,
    TARGET,
    WASM_PATH,
    Model,
    Pool,
    Stack,
    Tenant,
    free_port,
    new_api_key,
    sha256_hex,
)

GATEWAYCTL = Path(os.environ.get("GATEWAYCTL_BIN", TARGET / "release" / "gatewayctl"))

# The config file's own comment, which every `gatewayctl keys` edit must keep.
HEADER = "# The gateway's keys are added and revoked with `gatewayctl keys` (this line stays).\n"
DEADLINE_S = 15


@pytest.fixture(scope="module", params=["wasm_file", "native_module"])
def gateway(request, tmp_path_factory):
    """The rendered gateway; tenant `acme` holds key `first` (valid), `old` (expired) and `next`
    (valid only from 2099)."""
    filter_section = {request.param: str(WASM_PATH if request.param == "wasm_file" else FILTER_NATIVE)}
    workdir = tmp_path_factory.mktemp("keys")
    keys = {"first": new_api_key(), "old": new_api_key(), "next": new_api_key()}
    pools = [Pool("pool_main", ["sim/main"], ["--output-tokens", "3"])]
    models = [Model("main", "pool_main", served_model_name="sim/main")]
    sidecar_port, sidecar_metrics_port = free_port(), free_port()
    # The live directory is the Stack's own, where the sidecar's file is too: `gatewayctl apply`
    # swaps the filter's file there (and, where it does, the sidecar's).
    out, live_dir, config_path = workdir / "out", workdir, workdir / "gateway.yaml"
    request_log = workdir / "requests.log"

    def gateway_config(stack: Stack) -> dict:
        return {
            "envoy": {"listen": "127.0.0.1:0", "admin_port": 0, "live_config": {"dir": str(live_dir)},
                      "access_log": {"path": str(request_log)}},
            "filter": filter_section,
            "sidecar": {"listen": f"127.0.0.1:{sidecar_port}",
                        "metrics_listen": f"127.0.0.1:{sidecar_metrics_port}"},
            "redis": {"url": f"redis://127.0.0.1:{stack.redis_port}/0", "failure_mode": "open"},
            "tenants": [{"id": "acme", "api_keys": [
                {"name": "first", "sha256": sha256_hex(keys["first"])},
                {"name": "old", "sha256": sha256_hex(keys["old"]), "expires_at": "2020-01-01T00:00:00Z"},
                {"name": "next", "sha256": sha256_hex(keys["next"]), "not_before": "2099-01-01T00:00:00Z"},
            ], "limits": {"requests_per_minute": 1000, "tokens_per_minute": 1000000}}],
            "models": [{"name": m.name, "pool": m.pool, "max_model_len": m.max_model_len,
                        "served_model_name": m.served_model_name} for m in models],
            "pools": [{"name": "pool_main",
                       "endpoints": [u.removeprefix("http://") for u in stack.pool("pool_main").urls]}],
        }

    def rendered(name: str):
        def load(stack: Stack) -> dict:
            if not (out / "standalone" / name).exists():
                config_path.write_text(HEADER + yaml.safe_dump(gateway_config(stack), sort_keys=False))
                gatewayctl("render", "--config", str(config_path), "--out", str(out), "--target", "standalone")
                gatewayctl("apply", "--config", str(config_path))  # installs the filter's ECDS file
            return yaml.safe_load((out / "standalone" / name).read_text())
        return load

    tenants = [Tenant("acme", [keys["first"]], {"requests_per_minute": 1000})]
    with Stack(workdir, pools, models, tenants, sidecar_config_from=rendered("sidecar.yaml"),
               envoy_config_from=rendered("envoy.yaml")) as s:
        s.keys = keys
        s.gateway_yaml = config_path
        s.request_log = request_log
        yield s


def gatewayctl(*args: str) -> subprocess.CompletedProcess:
    if not GATEWAYCTL.exists():
        pytest.fail(f"{GATEWAYCTL} not built: run `make build`")
    result = subprocess.run([str(GATEWAYCTL), *args], capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        pytest.fail(f"gatewayctl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def keys_cmd(s, *args: str) -> str:
    return gatewayctl("keys", *args, "--config", str(s.gateway_yaml), "--tenant", "acme").stdout


def apply(s) -> float:
    gatewayctl("apply", "--config", str(s.gateway_yaml))
    return time.monotonic()


class KeepAlive:
    """One HTTP/1.1 connection to the gateway, kept open: every request goes on the same socket
    (`port` is its local port, to show it never reconnected)."""

    def __init__(self, base_url: str):
        host, port = base_url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=10)
        self.conn.connect()
        self.port = self.conn.sock.getsockname()[1]

    def status(self, key: str) -> tuple[int, dict]:
        """One request on the connection, which must still be the one opened first (a local
        reply refusing a request may close it after the reply: that reply is still on it)."""
        assert self.conn.sock is not None and self.conn.sock.getsockname()[1] == self.port, "reconnected"
        body = json.dumps(chat_body("main", max_tokens=1))
        self.conn.request("POST", "/v1/chat/completions", body=body,
                          headers={**auth(key), "content-type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if r.status != 200 else {})

    def close(self):
        self.conn.close()


def test_keys_outside_their_window_are_refused_401_saying_why(gateway):
    for name, says in [("old", "expired"), ("next", "not yet valid")]:
        r = post(gateway, "/v1/chat/completions", chat_body("main", max_tokens=1), key=gateway.keys[name])
        assert r.status_code == 401, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and says in error["message"], error
        assert gateway.keys[name] not in r.text
    assert post(gateway, "/v1/chat/completions", chat_body("main", max_tokens=1),
                key=gateway.keys["first"]).status_code == 200


def test_usage_records_carry_the_keys_name_never_the_key(gateway):
    key = gateway.keys["first"]
    r = post(gateway, "/v1/chat/completions", chat_body("main", max_tokens=2), key=key)
    assert r.status_code == 200, r.text
    client = redis.Redis(port=gateway.redis_port)
    events = landed_events(client, "acme", 1, api_key="first")
    assert events, "no usage event named by the key"
    assert all(key not in json.dumps(e, default=str) for e in events)
    raw = b"".join(v for _, fields in client.xrange("llmgw:usage-events") for v in fields.values())
    assert key.encode() not in raw and sha256_hex(key).encode() not in raw
    by_key = wait_for(lambda: usage_hash(client, "acme").get("api_key first:requests"), timeout=DEADLINE_S)
    assert by_key and by_key >= 1, usage_hash(client, "acme")
    out = gatewayctl("usage", "--redis-url", f"redis://127.0.0.1:{gateway.redis_port}/0", "--tenant", "acme",
                     "--by", "api-key", "--from", time.strftime("%Y-%m-%d", time.gmtime()),
                     "--to", time.strftime("%Y-%m-%d", time.gmtime()), "--format", "json").stdout
    rows = {row["api_key"]: row for row in json.loads(out)}
    assert rows["first"]["requests"] >= 1, rows
    logged = wait_for(lambda: [e for e in map(json.loads, gateway.request_log.read_text().splitlines())
                               if e.get("api_key") == "first"], timeout=DEADLINE_S)
    assert logged and all(e["tenant"] == "acme" for e in logged), logged
    assert key not in gateway.request_log.read_text()


def test_a_key_added_and_applied_works_and_the_file_keeps_its_comments(gateway):
    new_key = keys_cmd(gateway, "add", "--name", "added").strip()
    assert new_key.startswith("sk-") and new_key not in gateway.gateway_yaml.read_text()
    assert gateway.gateway_yaml.read_text().startswith(HEADER)
    assert "name: \"added\"" in gateway.gateway_yaml.read_text()
    status = lambda: post(gateway, "/v1/chat/completions", chat_body("main", max_tokens=1),  # noqa: E731
                          key=new_key).status_code
    assert status() == 401, "not live before the apply"
    applied = apply(gateway)
    assert wait_for(lambda: status() == 200, timeout=DEADLINE_S, interval=0.02), gateway.envoy_log()
    print(f"added key admitted {(time.monotonic() - applied) * 1000:.0f} ms after gatewayctl apply")
    listed = keys_cmd(gateway, "list")
    assert "added" in listed and new_key not in listed


def test_a_revoked_key_is_refused_on_an_open_keep_alive_connection(gateway):
    rotating = keys_cmd(gateway, "add", "--name", "rotating").strip()
    apply(gateway)
    assert wait_for(lambda: post(gateway, "/v1/chat/completions", chat_body("main", max_tokens=1),
                                 key=rotating).status_code == 200, timeout=DEADLINE_S, interval=0.02)
    conn = KeepAlive(gateway.base_url)
    try:
        assert conn.status(rotating)[0] == 200
        keys_cmd(gateway, "revoke", "--name", "rotating")
        assert "rotating" not in gateway.gateway_yaml.read_text()
        applied = apply(gateway)
        last: dict = {}

        def refused() -> bool:
            status, last["body"] = conn.status(rotating)
            return status == 401
        refused_in_time = wait_for(refused, timeout=DEADLINE_S, interval=0.02)
        took = time.monotonic() - applied
        assert refused_in_time, f"the revoked key still admitted on the open connection\n{gateway.envoy_log()}"
        print(f"revoked key refused on the open keep-alive connection {took * 1000:.0f} ms after gatewayctl apply")
        assert last["body"]["error"]["code"] == "invalid_api_key", last
    finally:
        conn.close()
    # The tenant's other keys go on.
    assert post(gateway, "/v1/chat/completions", chat_body("main", max_tokens=1),
                key=gateway.keys["first"]).status_code == 200
