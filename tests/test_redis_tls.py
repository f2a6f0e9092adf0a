"""Redis as clouds run it (issue 16, item 3): `rediss://` with the CA and a client certificate,
AUTH as an ACL user whose rules are exactly the minimal ACL documented in docs/deploy.md, the
password from a file; a real redis-server with TLS only (`--port 0 --tls-port P`) and its default
user off.

- The sidecar admits, limits and records usage through it, and Redis's ACL LOG shows no command
  or key it refused (the documented ACL is enough).
- A wrong password, a wrong user and an unreachable Redis stop the sidecar at start-up with
  `connecting to redis: ...` (exit 1), never printing the password; a password changed under a
  running sidecar gives the tier's failure mode (`closed`: 503 `rate_limiter_unavailable`) and the
  password shows up in no log, response body or metric.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import redis

from helpers import assert_openai_error, chat_body, post, wait_for
from sidecar_checks import landed_events, usage_hash
from stack import SIDECAR_BIN, Model, Pool, Stack, StackError, Tenant, free_port, new_api_key, redis_binary
from tls_certs import make_ca

DEPLOY_DOC = Path(__file__).resolve().parent.parent / "docs" / "deploy.md"
PASSWORD = "pw-" + secrets.token_hex(12)
ADMIN_PASSWORD = "admin-" + secrets.token_hex(12)
KEYS = {"rt-a": new_api_key(), "rt-tiny": new_api_key(), "rt-closed": new_api_key()}
START_S = 30


def documented_acl_rules() -> list[str]:
    """The rules of the minimal ACL in docs/deploy.md (`ACL SETUSER llmgw <rules>`), with the
    password placeholder left out."""
    match = re.search(r"^ACL SETUSER llmgw (.+)$", DEPLOY_DOC.read_text(), re.MULTILINE)
    assert match, "docs/deploy.md documents no `ACL SETUSER llmgw ...` line"
    rules = match.group(1).split()
    assert ">PASSWORD" in rules, rules
    return [r for r in rules if r != ">PASSWORD"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("redis-pki")
    ca = make_ca(d / "ca")
    server = ca.issue("redis", server=True, dns=["localhost"], ips=["127.0.0.1"], client_too=True)
    client = ca.issue("sidecar", server=False)
    return {"ca": ca.cert, "server": server, "client": client, "dir": d}


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory, pki):
    """redis-server with TLS only (client certificates required), users `llmgw` (the documented
    ACL) and `admin` (for the test's reads); the default user off."""
    d = tmp_path_factory.mktemp("redis-tls")
    port = free_port()
    argv = [redis_binary(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(pki["server"][0]), "--tls-key-file", str(pki["server"][1]),
            "--tls-ca-cert-file", str(pki["ca"]), "--tls-auth-clients", "yes",
            "--save", "", "--appendonly", "no", "--dir", str(d),
            "--user", "llmgw", "on", f">{PASSWORD}", *documented_acl_rules(),
            "--user", "admin", "on", f">{ADMIN_PASSWORD}", "~*", "&*", "+@all",
            "--user", "default", "off"]
    log = open(d / "redis.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    client = admin(port, pki)
    deadline = time.monotonic() + START_S
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise StackError(f"redis-server (TLS) did not start:\n{(d / 'redis.log').read_text()}")
            time.sleep(0.05)  # polling interval of a readiness loop bounded by the deadline
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def admin(port: int, pki) -> redis.Redis:
    return redis.Redis(port=port, ssl=True, ssl_ca_certs=str(pki["ca"]), ssl_certfile=str(pki["client"][0]),
                       ssl_keyfile=str(pki["client"][1]), username="admin", password=ADMIN_PASSWORD,
                       socket_timeout=2)


def redis_section(port: int, pki, password_file: Path, username: str = "llmgw") -> dict:
    return {"url": f"rediss://127.0.0.1:{port}/0", "username": username,
            "password_file": str(password_file),
            "tls": {"ca_file": str(pki["ca"]), "cert_file": str(pki["client"][0]),
                    "key_file": str(pki["client"][1])}}


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory, tls_redis, pki):
    work = tmp_path_factory.mktemp("redis-tls-stack")
    password_file = work / "redis-password"
    password_file.write_text(PASSWORD + "\n")
    pools = [Pool("pool_rt", ["sim/rt"], ["--output-tokens", "4"])]
    models = [Model("rt", "pool_rt", served_model_name="sim/rt")]
    tenants = [
        Tenant("rt-a", [KEYS["rt-a"]], {"requests_per_minute": 1000, "tokens_per_minute": 1_000_000}),
        Tenant("rt-tiny", [KEYS["rt-tiny"]], {"requests_per_minute": 2}),
        Tenant("rt-closed", [KEYS["rt-closed"]], {"requests_per_minute": 1000}, tier="free"),
    ]
    overrides = {
        "metrics_listen": "127.0.0.1:0",
        "redis": {**redis_section(tls_redis, pki, password_file), "tier_failure_modes": {"free": "closed"},
                  "breaker": {"failure_threshold": 1, "open_ms": 200}},
    }
    with Stack(work, pools, models, tenants, redis_port=tls_redis, sidecar_overrides=overrides) as s:
        s.admin = admin(tls_redis, pki)
        yield s


def chat(stack, tenant: str):
    return post(stack, "/v1/chat/completions", chat_body("rt"), key=KEYS[tenant])


def test_limits_and_usage_over_tls_with_the_minimal_acl(tls_stack):
    stack = tls_stack
    assert stack.sidecar_config()["redis"]["url"].startswith("rediss://")
    stack.admin.acl_log_reset()
    for _ in range(3):
        r = chat(stack, "rt-a")
        assert r.status_code == 200, (r.text, stack.logs())
    assert [chat(stack, "rt-tiny").status_code for _ in range(2)] == [200, 200], stack.logs()
    assert_openai_error(chat(stack, "rt-tiny"), 429, "rate_limit_exceeded")
    assert wait_for(lambda: usage_hash(stack.admin, "rt-a").get("rt:requests") == 3, timeout=30), (
        usage_hash(stack.admin, "rt-a"), stack.logs())
    assert len(landed_events(stack.admin, "rt-a", 3)) == 3
    # The bucket keys the sidecar wrote are the llmgw:* ones the ACL allows, and nothing was denied.
    assert stack.admin.keys("llmgw:rl:{rt-tiny}*"), stack.admin.keys("*")
    assert stack.admin.acl_log() == [], stack.admin.acl_log()
    users = {u["user"] if isinstance(u, dict) else u for u in stack.admin.acl_users()}
    assert "llmgw" in {u.decode() if isinstance(u, bytes) else u for u in users}


def run_sidecar(work: Path, redis: dict) -> subprocess.CompletedProcess:
    """Starts a sidecar on its own with this `redis` section; it should exit at once."""
    work.mkdir(parents=True, exist_ok=True)
    config = work / "sidecar.json"
    import json  # noqa: PLC0415

    config.write_text(json.dumps({"listen": "127.0.0.1:0", "redis": redis, "tenants": []}))
    return subprocess.run([str(SIDECAR_BIN), "--config", str(config)], capture_output=True, text=True,
                          timeout=START_S, check=False)


@pytest.mark.parametrize("case", ["wrong password", "wrong user", "unreachable", "no client certificate"])
def test_start_up_failures_never_print_the_password(tls_redis, pki, tmp_path, case):
    password_file = tmp_path / "pw"
    section = redis_section(tls_redis, pki, password_file)
    secret = PASSWORD
    if case == "wrong password":
        secret = "wrong-" + secrets.token_hex(8)
    elif case == "wrong user":
        section["username"] = "nobody"
    elif case == "unreachable":
        section["url"] = f"rediss://127.0.0.1:{free_port()}/0"
    else:
        del section["tls"]["cert_file"], section["tls"]["key_file"]
    password_file.write_text(secret)
    result = run_sidecar(tmp_path / "sidecar", section)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "connecting to redis" in out, out
    if case in ("wrong password", "wrong user"):
        assert re.search(r"WRONGPASS|AuthenticationFailed|invalid username-password", out), out
    assert secret not in out, out


def test_a_changed_password_gives_the_failure_mode_and_is_never_shown(tls_stack):
    stack = tls_stack
    assert chat(stack, "rt-closed").status_code == 200, stack.logs()
    admin_client = stack.admin
    new_password = "rotated-" + secrets.token_hex(12)
    admin_client.execute_command("ACL", "SETUSER", "llmgw", "resetpass", f">{new_password}")
    try:
        admin_client.execute_command("CLIENT", "KILL", "USER", "llmgw")
        # The sidecar's reconnects fail authentication: tier `free` fails closed.
        def refused():
            r = chat(stack, "rt-closed")
            return r if r.status_code == 503 else None

        r = wait_for(refused, timeout=30)
        assert r is not None, stack.logs()
        assert_openai_error(r, 503, "rate_limiter_unavailable")
        assert PASSWORD not in r.text and new_password not in r.text
        with urllib_open(stack.sidecar_metrics_url + "/metrics") as metrics:
            text = metrics.read().decode()
        assert PASSWORD not in text and new_password not in text
    finally:
        admin_client.execute_command("ACL", "SETUSER", "llmgw", "resetpass", f">{PASSWORD}")
    # Back: the sidecar reconnects with its password.
    assert wait_for(lambda: chat(stack, "rt-closed").status_code == 200, timeout=30), stack.logs()
    logs = "".join(p.log.read_text(errors="replace") for p in stack.procs)
    assert "WRONGPASS" in logs or "AuthenticationFailed" in logs or "auth" in logs.lower(), stack.logs()
    assert PASSWORD not in logs and new_password not in logs


def urllib_open(url: str):
    import urllib.request  # noqa: PLC0415

    return urllib.request.urlopen(url, timeout=5)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory, pki):
    """Three Redis Cluster masters with TLS only (clients, cluster bus and replication:
    `tls-cluster yes`, `tls-replication yes`), the same users as `tls_redis`; slots assigned by
    `redis-cli --cluster create --tls`."""
    import shutil  # noqa: PLC0415

    d = tmp_path_factory.mktemp("redis-tls-cluster")
    ports = Stack._cluster_ports(3)
    procs = []
    tls_args = ["--tls-cert-file", str(pki["server"][0]), "--tls-key-file", str(pki["server"][1]),
                "--tls-ca-cert-file", str(pki["ca"]), "--tls-auth-clients", "yes",
                "--tls-cluster", "yes", "--tls-replication", "yes"]
    users = ["--user", "llmgw", "on", f">{PASSWORD}", *documented_acl_rules(),
             "--user", "admin", "on", f">{ADMIN_PASSWORD}", "~*", "&*", "+@all",
             "--user", "default", "off", "--masteruser", "admin", "--masterauth", ADMIN_PASSWORD]
    for port in ports:
        log = open(d / f"redis-{port}.log", "ab")  # noqa: SIM115
        procs.append(subprocess.Popen(
            [redis_binary(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(d), "--cluster-enabled", "yes",
             "--cluster-config-file", f"nodes-{port}.conf", *tls_args, *users],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL))
    try:
        deadline = time.monotonic() + START_S
        for port in ports:
            while True:
                try:
                    admin(port, pki).ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise StackError(f"redis {port} did not start") from None
                    time.sleep(0.05)  # polling interval of a readiness loop bounded by the deadline
        cli = shutil.which("redis-cli") or "redis-cli"
        create = subprocess.run(
            [cli, "--tls", "--cacert", str(pki["ca"]), "--cert", str(pki["client"][0]),
             "--key", str(pki["client"][1]), "--user", "admin", "--pass", ADMIN_PASSWORD,
             "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0",
             "--cluster-yes"], capture_output=True, text=True, timeout=START_S, check=False)
        assert create.returncode == 0, create.stdout + create.stderr
        for port in ports:
            while admin(port, pki).cluster("info").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise StackError(f"redis cluster node {port} not ok")
                time.sleep(0.05)  # polling interval of a readiness loop bounded by the deadline
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)


def test_redis_cluster_over_tls_with_the_minimal_acl(tmp_path, tls_cluster, pki):
    from redis.cluster import RedisCluster  # noqa: PLC0415

    password_file = tmp_path / "redis-password"
    password_file.write_text(PASSWORD)
    key = new_api_key()
    section = redis_section(tls_cluster[0], pki, password_file)
    del section["url"]
    section["cluster_urls"] = [f"rediss://127.0.0.1:{p}" for p in tls_cluster]

    def sidecar_config(_stack) -> dict:
        return {"listen": "127.0.0.1:0", "redis": section,
                "tenants": [{"id": "rt-cl", "limits": {"requests_per_minute": 2}}]}

    cluster = RedisCluster(host="127.0.0.1", port=tls_cluster[0], ssl=True, ssl_ca_certs=str(pki["ca"]),
                           ssl_certfile=str(pki["client"][0]), ssl_keyfile=str(pki["client"][1]),
                           username="admin", password=ADMIN_PASSWORD)
    for node in cluster.get_primaries():
        cluster.acl_log_reset(target_nodes=node)
    with Stack(tmp_path / "stack", [Pool("pool_cl", ["sim/cl"], ["--output-tokens", "4"])],
               [Model("cl", "pool_cl", served_model_name="sim/cl")],
               [Tenant("rt-cl", [key], {"requests_per_minute": 2})], redis_port=tls_cluster[0],
               sidecar_config_from=sidecar_config) as stack:
        codes = [post(stack, "/v1/chat/completions", chat_body("cl"), key=key).status_code for _ in range(3)]
        assert codes == [200, 200, 429], (codes, stack.logs())
        assert wait_for(lambda: usage_hash(cluster, "rt-cl").get("cl:requests") == 2, timeout=30), stack.logs()
        logs = "".join(p.log.read_text(errors="replace") for p in stack.procs)
        assert PASSWORD not in logs
    denied = [entry for node in cluster.get_primaries() for entry in cluster.acl_log(target_nodes=node)]
    assert denied == [], denied
    cluster.close()
