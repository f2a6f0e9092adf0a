"""The sidecar's live config: it reloads its file when the file changes (or at SIGHUP) with nothing
restarted. A new tenant is admitted, a limit change applies to new requests, a stream in flight
finishes and is metered under the config it started with (also when its tenant is removed), and a
file that does not validate, or that changes what cannot reload (the listen address), is refused
with the field named while the running config keeps serving."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis
import yaml

from helpers import assert_openai_error, auth, chat_body, post, stream_in_background, wait_for
from sidecar_checks import landed_events, metric, sidecar_metrics
from stack import Model, Pool, Stack, Tenant, new_api_key

KEY, LATER_KEY = new_api_key(), new_api_key()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    pools = [Pool("pool_slow", ["sim/slow"], ["--ttft-ms", "10", "--itl-ms", "40", "--output-tokens", "30"])]
    models = [Model("slow", "pool_slow", 4096, served_model_name="sim/slow")]
    tenants = [Tenant("main", [KEY], {"requests_per_minute": 100000}),
               Tenant("later", [LATER_KEY], {"requests_per_minute": 100000})]

    def sidecar_without_later(s: Stack) -> dict:
        s.sidecar_config_from = None
        config = s.sidecar_config()
        s.sidecar_config_from = sidecar_without_later
        config["tenants"] = [t for t in config["tenants"] if t["id"] != "later"]
        return config

    # The filter knows both tenants' keys; the sidecar starts without the second tenant.
    s = Stack(tmp_path_factory.mktemp("sidecar-reload"), pools, models, tenants,
              sidecar_overrides={"metrics_listen": "127.0.0.1:0"}, sidecar_config_from=sidecar_without_later)
    with s:
        yield s


def sidecar_file(stack):
    return stack.workdir / "sidecar.yaml"


def running(stack) -> dict:
    return yaml.safe_load(sidecar_file(stack).read_text())


def write(stack, config: dict) -> None:
    """Renames a new file over the sidecar's config, as gatewayctl apply does."""
    tmp = stack.workdir / ".sidecar.yaml.tmp"
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    os.replace(tmp, sidecar_file(stack))


def reloads(stack, result: str) -> float:
    return metric(sidecar_metrics(stack), "llm_gateway_config_reloads_total", result=result)


def generation(stack) -> float:
    return metric(sidecar_metrics(stack), "llm_gateway_config_generation")


def sidecar_proc(stack):
    return next(p for p in stack.procs if p.name == "sidecar")


def test_a_new_tenant_is_admitted_once_the_sidecar_reloads(stack):
    r = post(stack, "/v1/chat/completions", chat_body("slow"), key=LATER_KEY)
    assert_openai_error(r, 403)
    before = generation(stack)
    config = running(stack)
    config["tenants"].append({"id": "later", "limits": {"requests_per_minute": 100000}})
    started = time.monotonic()
    write(stack, config)
    assert wait_for(lambda: generation(stack) == before + 1, timeout=15, interval=0.01), stack.logs()
    swapped = time.monotonic() - started
    assert wait_for(lambda: post(stack, "/v1/chat/completions", chat_body("slow"), key=LATER_KEY).status_code == 200,
                    timeout=15), stack.logs()
    print(f"sidecar reloaded {1000 * swapped:.0f} ms after the rename; "
          f"its first request (a 30-token completion) answered 200 {1000 * (time.monotonic() - started):.0f} ms after it")
    assert generation(stack) == before + 1
    client = redis.Redis(port=stack.redis_port)
    assert len(landed_events(client, "later", 1)) >= 1


def test_a_limit_change_applies_to_new_requests_and_a_stream_in_flight_finishes(stack):
    thread, events, first_chunk = stream_in_background(stack.base_url, chat_body("slow", stream=True), auth(KEY))
    assert first_chunk.wait(10)
    config = running(stack)
    main = next(t for t in config["tenants"] if t["id"] == "main")
    main["limits"] = {"requests_per_minute": 2}
    before = generation(stack)
    write(stack, config)
    assert wait_for(lambda: generation(stack) == before + 1, timeout=15), stack.logs()
    statuses = [post(stack, "/v1/chat/completions", chat_body("slow"), key=KEY).status_code for _ in range(4)]
    assert 429 in statuses, statuses
    thread.join(20)
    assert not thread.is_alive()
    assert events[-1] == "[DONE]"
    main["limits"] = {"requests_per_minute": 100000}
    write(stack, config)
    assert wait_for(lambda: generation(stack) == before + 2, timeout=15), stack.logs()


def test_a_removed_tenants_request_in_flight_is_metered(stack):
    client = redis.Redis(port=stack.redis_port)
    had = len(landed_events(client, "later", 0, timeout=0))
    thread, events, first_chunk = stream_in_background(stack.base_url, chat_body("slow", stream=True),
                                                       auth(LATER_KEY))
    assert first_chunk.wait(10)
    config = running(stack)
    config["tenants"] = [t for t in config["tenants"] if t["id"] != "later"]
    before = generation(stack)
    write(stack, config)
    assert wait_for(lambda: generation(stack) == before + 1, timeout=15), stack.logs()
    assert_openai_error(post(stack, "/v1/chat/completions", chat_body("slow"), key=LATER_KEY), 403)
    thread.join(20)
    assert events[-1] == "[DONE]"
    assert len(landed_events(client, "later", had + 1)) == had + 1, stack.logs()


def test_a_bad_file_is_refused_naming_the_field_and_the_running_config_serves(stack):
    refused = reloads(stack, "refused")
    before = generation(stack)
    config = running(stack)
    config["tenants"][0]["limits"] = {"requests_per_minute": 0}
    write(stack, config)
    assert wait_for(lambda: reloads(stack, "refused") == refused + 1, timeout=15), stack.logs()
    assert generation(stack) == before
    assert "tenants[0].limits.requests_per_minute" in sidecar_proc(stack).log_tail(50)
    assert post(stack, "/v1/chat/completions", chat_body("slow"), key=KEY).status_code == 200


def test_a_listen_change_is_refused_with_its_reason(stack):
    refused = reloads(stack, "refused")
    config = running(stack)
    config["tenants"][0]["limits"] = {"requests_per_minute": 100000}
    config["listen"] = "127.0.0.1:1"
    write(stack, config)
    assert wait_for(lambda: reloads(stack, "refused") == refused + 1, timeout=15), stack.logs()
    assert "listen: cannot change while the sidecar runs" in sidecar_proc(stack).log_tail(50)
    assert post(stack, "/v1/chat/completions", chat_body("slow"), key=KEY).status_code == 200


def test_sighup_reloads_and_does_not_stop_the_sidecar(stack):
    config = running(stack)
    config["listen"] = "127.0.0.1:0"
    before = generation(stack)
    config["tenants"][0]["limits"] = {"requests_per_minute": 99999}
    write(stack, config)
    sidecar_proc(stack).popen.send_signal(signal.SIGHUP)
    assert wait_for(lambda: generation(stack) == before + 1, timeout=15), stack.logs()
    assert sidecar_proc(stack).alive()
    assert post(stack, "/v1/chat/completions", chat_body("slow"), key=KEY).status_code == 200
