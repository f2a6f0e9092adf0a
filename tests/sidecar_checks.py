"""What the sidecar left in Redis and in its /metrics, read back for the integration tests.

- the per tenant x day usage hash (`llmgw:usage:{tenant}:YYYY-MM-DD`),
- the usage events on `llmgw:usage-events` (protobuf `llm_gateway.v1.UsageEvent`, decoded here with
  a tiny wire-format reader: no generated code needed),
- the token buckets (`llmgw:rl:{tenant}:rpm|tpm`, hashes {t: tokens as a float, ts: microseconds}),
- the sidecar's Prometheus text.

Every function takes a redis-py client (`redis.Redis` or `redis.cluster.RedisCluster`).
"""

from __future__ import annotations

import datetime
import re
import urllib.request

import httpx

from helpers import wait_for

STREAM = "llmgw:usage-events"

# llm_gateway.v1.UsageEvent (proto/llm_gateway/v1/usage.proto): field number -> (name, kind).
_EVENT_FIELDS = {
    1: ("request_id", "str"), 2: ("tenant", "str"), 3: ("model", "str"), 4: ("pool", "str"),
    5: ("prompt_tokens", "int"), 6: ("completion_tokens", "int"), 7: ("cached_tokens", "int"),
    8: ("ttft_us", "int"), 9: ("duration_us", "int"), 10: ("status", "int"),
    11: ("end_reason", "int"), 12: ("usage_source", "int"), 13: ("reserved_tokens", "int"),
    14: ("finished_at_unix_ms", "int"), 15: ("record_id", "str"), 16: ("tier", "str"),
    17: ("cost_nano_usd", "int"), 18: ("requests", "int"), 19: ("api_key", "str"),
}
END_COMPLETED, END_INCOMPLETE, END_UNREPORTED = 1, 2, 3
SOURCE_UPSTREAM, SOURCE_STREAMED_CHUNKS, SOURCE_RESERVATION = 1, 2, 3


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def decode_usage_event(data: bytes) -> dict:
    """The fields of a protobuf UsageEvent; proto3 defaults (0, "") for absent ones."""
    event: dict = {name: ("" if kind == "str" else 0) for name, kind in _EVENT_FIELDS.values()}
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            length, i = _varint(data, i)
            value, i = data[i:i + length], i + length
        else:
            raise ValueError(f"unexpected wire type {wire} for field {number}")
        if number in _EVENT_FIELDS:
            name, kind = _EVENT_FIELDS[number]
            event[name] = value.decode() if kind == "str" else value
    return event


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")


def usage_hash(client, tenant: str) -> dict[str, int]:
    raw = client.hgetall(f"llmgw:usage:{{{tenant}}}:{today()}")
    return {_s(k): int(v) for k, v in raw.items()}


def usage_events(client, tenant: str) -> list[dict]:
    """Decoded usage events of a tenant, oldest first (every stream entry, duplicates included)."""
    events = []
    for _, fields in client.xrange(STREAM):
        fields = {_s(k): v for k, v in fields.items()}
        if _s(fields["tenant"]) == tenant:
            event = decode_usage_event(fields["event"] if isinstance(fields["event"], bytes)
                                       else fields["event"].encode("latin-1"))
            assert event["record_id"] == _s(fields["record_id"]), (event, fields)
            events.append(event)
    return events


def landed_events(client, tenant: str, count: int, timeout: float = 15, **fields) -> list[dict]:
    """The tenant's usage events (those whose fields equal `fields`) once at least `count` are
    in the stream, else what is there after `timeout` s. The event is appended by a call after
    the record's ledger write, so a usage hash that counts a record does not yet mean that its
    event is in the stream; callers assert the exact count on what this returns."""
    def matching() -> list[dict]:
        return [e for e in usage_events(client, tenant) if all(e.get(k) == v for k, v in fields.items())]
    wait_for(lambda: len(matching()) >= count, timeout=timeout)
    return matching()


def assert_tpm_settled(client, tenant: str, capacity: int) -> None:
    """The tenant's TPM bucket (refill 1/min in the callers' configs) holds `capacity` minus what
    its records charged, polled: a record's event is appended after its ledger write."""
    key = bucket_key(tenant, "tpm")

    def used() -> int:
        return sum(e["prompt_tokens"] + e["completion_tokens"] for e in usage_events(client, tenant))
    assert wait_for(lambda: (b := bucket(client, key)) and capacity - used() - 0.01 <= b[0] <= capacity - used() + 2), \
        (bucket(client, key), capacity - used())


def bucket(client, key: str) -> tuple[float, int] | None:
    """(tokens, updated-at in microseconds) of a token bucket, None when it does not exist."""
    t, ts = client.hmget(key, "t", "ts")
    if t is None or ts is None:
        return None
    return float(t), int(float(ts))


def bucket_key(tenant: str, kind: str, model: str | None = None) -> str:
    return f"llmgw:rl:{{{tenant}}}:m:{model}:{kind}" if model else f"llmgw:rl:{{{tenant}}}:{kind}"


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


# ------------------------------------------------------------------ Prometheus text

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        have = dict(_LABEL.findall(m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def sidecar_metrics(stack) -> str:
    assert stack.sidecar_metrics_url, "the sidecar runs without metrics_listen"
    with urllib.request.urlopen(stack.sidecar_metrics_url + "/metrics", timeout=2) as r:
        return r.read().decode()


# ------------------------------------------------------------------ OpenAI headers

_RESET = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)$")


def parse_reset(value: str) -> float:
    """Seconds of an OpenAI `x-ratelimit-reset-*` duration (`0.25s`, `59.9s`, `1m30s`, `2h0m0s`)."""
    m = _RESET.match(value)
    assert m, f"not an OpenAI reset duration: {value!r}"
    h, mins, s = m.groups()
    return int(h or 0) * 3600 + int(mins or 0) * 60 + float(s or 0)


def content_chunks(events: list) -> int:
    """Streamed chunks with non-empty content (what the sidecar counts as completion tokens)."""
    return sum(1 for e in events if isinstance(e, dict) and e.get("choices")
               and (e["choices"][0].get("delta") or {}).get("content"))


def open_stream(base_url: str, body: dict, headers: dict, timeout: float = 10) -> tuple:
    """Sends a streamed request and returns (client, response) once the response headers are in;
    the caller reads or closes it (`response.close(); client.close()`)."""
    client = httpx.Client(timeout=timeout)
    request = client.build_request("POST", base_url + "/v1/chat/completions", json=body, headers=headers)
    return client, client.send(request, stream=True)
