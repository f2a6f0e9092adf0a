"""The gateway's OCI images (`make images`: tools/oci_image.py, issue 15).

tools/oci_image.py builds, without a container daemon, the sidecar's image (the static
`gateway-ext-proc` binary alone, run as 65532:65532) and the wasm filter's (the Wasm image
specification's *compat* variant, which Istio and Envoy Gateway pull), each as an OCI image layout
directory and a tarball. These tests build both into a temporary directory from the binaries
`make images` compiled and check them with code of their own and with skopeo (containers/image,
the library podman and CRI-O pull with):

1. each layout is an OCI image layout: `oci-layout`, `index.json` -> manifest -> config and layer,
   every blob's sha256 and size as its descriptor says, the media types, no other blob;
2. the sidecar image runs its entrypoint /gateway-ext-proc as 65532:65532, and its one layer holds
   that static binary and nothing else, owned by root; the filter image is what the Istio and
   Envoy Gateway fetchers accept (one gzip tar layer holding plugin.wasm, the compat annotation),
   its plugin.wasm the built module;
3. each tarball holds the layout and docker's manifest.json: skopeo copies it as an OCI archive
   with the manifest digest unchanged (what a registry then serves), and reads it as a docker
   archive (the format `docker load` before docker 25 reads), layer diff_ids verified;
4. the build is reproducible (the same inputs give the same bytes), and refuses a dynamically
   linked sidecar;
5. the binary taken out of the layer runs: `--help`, against a real redis-server it reaches by
   host name (musl's resolver), and the whole gateway (Envoy + the image's plugin.wasm + the
   image's sidecar) admits, streams and rate-limits;
6. the `images.yaml` it writes, merged into the example gateway config, renders manifests pinned
   by these digests;
7. the Dockerfile builds the same contents (paths, modes, user, entrypoint).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml

from helpers import auth, chat_body, post, sse_events
from stack import (
    ROOT,
    START_DEADLINE_S,
    TARGET,
    WASM_PATH,
    Model,
    Pool,
    Stack,
    Tenant,
    free_port,
    new_api_key,
    redis_binary,
)

TOOL = ROOT / "tools" / "oci_image.py"
STATIC_SIDECAR = Path(os.environ.get("STATIC_EXT_PROC_BIN",
                                      TARGET / "x86_64-unknown-linux-musl" / "image" / "gateway-ext-proc"))
DYNAMIC_SIDECAR = TARGET / "release" / "gateway-ext-proc"
GATEWAYCTL = Path(os.environ.get("GATEWAYCTL_BIN", TARGET / "release" / "gatewayctl"))
EXAMPLE = ROOT / "envoy" / "examples" / "gateway.yaml"

REGISTRY = "registry.test:5000/team"
TAG = "1.2.3"
SIDECAR_REF = f"{REGISTRY}/llm-gateway-ext-proc:{TAG}"
FILTER_REF = f"{REGISTRY}/llm-gateway-filter:{TAG}"

MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


def run_tool(out: Path, *extra: str, sidecar: Path = STATIC_SIDECAR, check: bool = True) -> subprocess.CompletedProcess:
    for path in (sidecar, WASM_PATH):
        if not path.is_file():
            pytest.fail(f"{path} not built: run `make images`")
    result = subprocess.run([sys.executable, str(TOOL), "--sidecar", str(sidecar), "--filter", str(WASM_PATH),
                             "--registry", REGISTRY, "--tag", TAG, "--out", str(out), *extra],
                            capture_output=True, text=True, timeout=120, check=False)
    if check and result.returncode != 0:
        pytest.fail(f"oci_image.py failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """The output directory of one build of both images, and what the tool printed."""
    out = tmp_path_factory.mktemp("images")
    return out, run_tool(out).stdout


@pytest.fixture(scope="module")
def images(built) -> Path:
    return built[0]


def skopeo(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("skopeo")
    if not exe:
        pytest.fail("skopeo not found: run `make setup` (installs Debian's skopeo)")
    # --insecure-policy: local copies between directories, no registry; no signature policy file
    # is needed for them.
    result = subprocess.run([exe, "--insecure-policy", *args], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, f"skopeo {' '.join(args)}:\n{result.stderr}"
    return result


# ------------------------------------------------------------------ reading a layout, our own way


def blob(layout: Path, descriptor: dict) -> bytes:
    """A blob of the layout, checked against its descriptor (sha256 and size)."""
    algorithm, hex_digest = descriptor["digest"].split(":", 1)
    assert algorithm == "sha256" and re.fullmatch(r"[0-9a-f]{64}", hex_digest), descriptor
    data = (layout / "blobs" / "sha256" / hex_digest).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hex_digest, f"{descriptor['digest']}: content does not match"
    assert len(data) == descriptor["size"], f"{descriptor['digest']}: {len(data)} bytes, descriptor says {descriptor['size']}"
    return data


def read_image(layout: Path) -> dict:
    """index.json -> manifest -> config and layer, every step checked; what it found."""
    assert json.loads((layout / "oci-layout").read_bytes()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((layout / "index.json").read_bytes())
    assert index["schemaVersion"] == 2 and index["mediaType"] == MT_INDEX
    assert len(index["manifests"]) == 1, "one image per layout"
    [descriptor] = index["manifests"]
    assert descriptor["mediaType"] == MT_MANIFEST
    manifest_bytes = blob(layout, descriptor)
    manifest = json.loads(manifest_bytes)
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == MT_MANIFEST
    assert manifest["config"]["mediaType"] == MT_CONFIG
    config = json.loads(blob(layout, manifest["config"]))
    assert len(manifest["layers"]) == 1, manifest["layers"]
    [layer_descriptor] = manifest["layers"]
    assert layer_descriptor["mediaType"] == MT_LAYER_GZIP
    layer = blob(layout, layer_descriptor)
    assert layer[:2] == b"\x1f\x8b", "a gzip layer"
    layer_tar = gzip.decompress(layer)
    # The config names the uncompressed layer by its digest (diff_id).
    assert config["rootfs"] == {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer_tar).hexdigest()]}
    # Nothing in blobs/ but what the manifest references.
    referenced = {d["digest"].split(":")[1] for d in (descriptor, manifest["config"], layer_descriptor)}
    assert {p.name for p in (layout / "blobs" / "sha256").iterdir()} == referenced
    return {"index_descriptor": descriptor, "manifest": manifest, "manifest_bytes": manifest_bytes,
            "digest": descriptor["digest"], "config": config, "layer_tar": layer_tar}


def members(layer_tar: bytes) -> dict[str, tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(layer_tar)) as tar:
        return {m.name: (m, tar.extractfile(m).read() if m.isfile() else b"") for m in tar.getmembers()}


def elf_interpreter(data: bytes) -> bool:
    """Whether an ELF64 executable names a dynamic loader (a PT_INTERP program header)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2
    phoff, = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    return any(struct.unpack_from("<I", data, phoff + i * phentsize)[0] == 3 for i in range(phnum))


# ------------------------------------------------------------------ 1, 2. the layouts


def test_layouts_are_oci_image_layouts(built):
    images, printed = built
    for name, ref in (("ext-proc", SIDECAR_REF), ("filter", FILTER_REF)):
        image = read_image(images / name)
        # What `make images` prints: the reference pinned by the manifest digest.
        assert f"{name}: {ref}@{image['digest']}\n" in printed, printed
        # The tag, as the layout's reference name, and the full name docker 25+ loads it under.
        assert image["index_descriptor"]["annotations"] == {
            "org.opencontainers.image.ref.name": TAG, "io.containerd.image.name": ref}
        assert image["config"]["os"] == "linux"
        assert image["index_descriptor"]["platform"] == {"architecture": image["config"]["architecture"], "os": "linux"}
        # Timestamps: SOURCE_DATE_EPOCH, 0 by default.
        assert image["config"]["created"] == "1970-01-01T00:00:00Z"
        assert len(image["config"]["history"]) == 1


def test_sidecar_image_runs_the_static_binary_as_65532(images):
    image = read_image(images / "ext-proc")
    config = image["config"]
    assert config["architecture"] == "amd64"
    assert config["config"]["User"] == "65532:65532"
    assert config["config"]["Entrypoint"] == ["/gateway-ext-proc"]
    assert "Cmd" not in config["config"] and "Env" not in config["config"]
    files = members(image["layer_tar"])
    assert list(files) == ["gateway-ext-proc"], "the binary and nothing else"
    info, data = files["gateway-ext-proc"]
    assert info.isreg() and info.mode == 0o755
    assert (info.uid, info.gid, info.uname, info.gname, info.mtime) == (0, 0, "", "", 0)
    assert data == STATIC_SIDECAR.read_bytes()
    assert not elf_interpreter(data), "statically linked: the image has no dynamic loader or libc"


def test_filter_image_is_the_wasm_compat_variant(images):
    image = read_image(images / "filter")
    # What Istio's and Envoy Gateway's image fetchers take: an OCI manifest whose single layer
    # is application/vnd.oci.image.layer.v1.tar+gzip, a tar holding plugin.wasm; the compat
    # variant's annotation.
    assert image["manifest"]["annotations"] == {"module.wasm.image/variant": "compat"}
    files = members(image["layer_tar"])
    assert list(files) == ["plugin.wasm"]
    info, data = files["plugin.wasm"]
    assert info.isreg() and info.mode == 0o644 and (info.uid, info.gid) == (0, 0)
    assert data == WASM_PATH.read_bytes()
    assert data[:4] == b"\0asm"
    assert "Entrypoint" not in image["config"]["config"]


# ------------------------------------------------------------------ 3. the tarballs


def test_tarballs_hold_the_layout_and_docker_manifest(images):
    for name, ref in (("ext-proc", SIDECAR_REF), ("filter", FILTER_REF)):
        layout = images / name
        with tarfile.open(images / f"{name}.tar") as tar:
            entries = tar.getmembers()
            names = [m.name for m in entries]
            assert names == sorted(names)
            assert all((m.uid, m.gid, m.mtime) == (0, 0, 0) for m in entries)
            on_disk = {p.relative_to(layout).as_posix() for p in layout.rglob("*")}
            assert set(names) == on_disk
            for m in entries:
                if m.isfile():
                    assert tar.extractfile(m).read() == (layout / m.name).read_bytes(), m.name
        image = read_image(layout)
        docker = json.loads((layout / "manifest.json").read_bytes())
        assert docker == [{
            "Config": "blobs/sha256/" + image["manifest"]["config"]["digest"].split(":")[1],
            "RepoTags": [ref],
            "Layers": ["blobs/sha256/" + image["manifest"]["layers"][0]["digest"].split(":")[1]],
        }]


def test_skopeo_reads_the_layout_and_copies_the_archive_digest_unchanged(images, tmp_path):
    for name in ("ext-proc", "filter"):
        image = read_image(images / name)
        raw = skopeo("inspect", "--raw", f"oci:{images / name}").stdout
        assert raw.encode().removesuffix(b"\n") == image["manifest_bytes"]
        # A copy that keeps the manifest is what a push with crane or skopeo does: the copy's
        # digest is the one gatewayctl pins.
        copy = tmp_path / f"{name}-oci"
        skopeo("copy", "--preserve-digests", f"oci-archive:{images / name}.tar", f"oci:{copy}")
        [descriptor] = json.loads((copy / "index.json").read_bytes())["manifests"]
        assert descriptor["digest"] == image["digest"]
        assert blob(copy, descriptor) == image["manifest_bytes"]


def test_skopeo_reads_the_tarball_as_a_docker_archive(images, tmp_path):
    for name in ("ext-proc", "filter"):
        image = read_image(images / name)
        config = json.loads(skopeo("inspect", "--config", f"docker-archive:{images / name}.tar").stdout)
        assert config["rootfs"] == image["config"]["rootfs"]
        # Copied out of the docker archive (containers/image checks each layer against its
        # diff_id), the layer is ours, byte for byte once uncompressed.
        copy = tmp_path / f"{name}-from-docker-archive"
        skopeo("copy", f"docker-archive:{images / name}.tar", f"oci:{copy}")
        index = json.loads((copy / "index.json").read_bytes())
        manifest = json.loads(blob(copy, index["manifests"][0]))
        layer = blob(copy, manifest["layers"][0])
        assert (gzip.decompress(layer) if layer[:2] == b"\x1f\x8b" else layer) == image["layer_tar"]


# ------------------------------------------------------------------ 4. reproducible, refusing


def test_the_build_is_reproducible(images, tmp_path):
    run_tool(tmp_path)
    for name in ("ext-proc", "filter"):
        assert (tmp_path / f"{name}.tar").read_bytes() == (images / f"{name}.tar").read_bytes(), name
    assert (tmp_path / "images.yaml").read_text() == (images / "images.yaml").read_text()


def test_a_dynamically_linked_sidecar_is_refused(tmp_path):
    if not DYNAMIC_SIDECAR.is_file():
        pytest.fail(f"{DYNAMIC_SIDECAR} not built: run `make build`")
    assert elf_interpreter(DYNAMIC_SIDECAR.read_bytes()), "the host build is expected to be dynamic"
    result = run_tool(tmp_path, sidecar=DYNAMIC_SIDECAR, check=False)
    assert result.returncode == 2
    assert "dynamically linked" in result.stderr
    assert not (tmp_path / "ext-proc").exists()


# ------------------------------------------------------------------ 5. the binary out of the layer


@pytest.fixture(scope="module")
def sidecar_from_layer(images, tmp_path_factory) -> Path:
    _, data = members(read_image(images / "ext-proc")["layer_tar"])["gateway-ext-proc"]
    path = tmp_path_factory.mktemp("rootfs") / "gateway-ext-proc"
    path.write_bytes(data)
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def plugin_from_layer(images, tmp_path_factory) -> Path:
    _, data = members(read_image(images / "filter")["layer_tar"])["plugin.wasm"]
    path = tmp_path_factory.mktemp("plugin") / "plugin.wasm"
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    """A redis-server on 127.0.0.1 (and ::1 where it exists), for the sidecar to reach as `localhost`."""
    import redis  # noqa: PLC0415

    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "-::1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_timeout=1)
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start (exit {proc.poll()})")
                time.sleep(0.05)  # polling interval of a readiness loop bounded by the deadline
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_sidecar_from_the_layer_runs(sidecar_from_layer):
    result = subprocess.run([str(sidecar_from_layer), "--help"], capture_output=True, text=True, timeout=30,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout
    version = subprocess.run([str(sidecar_from_layer), "--version"], capture_output=True, text=True, timeout=30,
                             check=False)
    with open(ROOT / "Cargo.toml", "rb") as f:
        workspace_version = tomllib.load(f)["workspace"]["package"]["version"]
    assert version.stdout.strip() == f"gateway-ext-proc {workspace_version}"


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line a process prints on stdout, or what it printed before exiting or the deadline."""
    fd, pending = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while b"\n" not in pending and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            data = os.read(fd, 4096)
            if not data:
                break
            pending += data
    return pending.decode(errors="replace").split("\n")[0]


def sidecar_banner(binary: Path, redis_url: str, workdir: Path, timeout: float) -> tuple[str, str]:
    """Starts the sidecar with a minimal config; its first stdout line within `timeout`, and its log."""
    config = workdir / "sidecar.yaml"
    config.write_text(yaml.safe_dump({
        "listen": "127.0.0.1:0",
        "redis": {"url": redis_url},
        "tenants": [{"id": "acme", "limits": {"requests_per_minute": 60}}],
    }))
    log = workdir / "sidecar.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen([str(binary), "--config", str(config)], stdout=subprocess.PIPE, stderr=stderr,
                                stdin=subprocess.DEVNULL)
    try:
        return first_line(proc, timeout), log.read_text()
    finally:
        # (A SIGTERM this early may find the sidecar's handler not yet installed; the exit status
        # is not what this checks.)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_sidecar_from_the_layer_reaches_redis_by_host_name(sidecar_from_layer, redis_port, tmp_path):
    # The sidecar binds its gRPC port only once it has reached Redis: the banner says that the
    # static binary resolved `localhost` (musl's resolver, /etc/hosts) and spoke to redis-server.
    banner, log = sidecar_banner(sidecar_from_layer, f"redis://localhost:{redis_port}/0", tmp_path, START_DEADLINE_S)
    assert banner.startswith("gateway-ext-proc listening on 127.0.0.1:"), f"{banner!r}\n{log}"
    # ... and a name that resolves nowhere leaves it waiting, unbound.
    (tmp_path / "unresolved").mkdir()
    banner, log = sidecar_banner(sidecar_from_layer, f"redis://no-such-host.invalid:{redis_port}/0",
                                 tmp_path / "unresolved", 3.0)
    assert banner == "", f"{banner!r}\n{log}"


def test_the_gateway_runs_on_the_images_contents(sidecar_from_layer, plugin_from_layer, redis_port, tmp_path):
    key = new_api_key()
    pools = [Pool("pool_a", ["sim/a"], ["--output-tokens", "4"])]
    models = [Model("a", "pool_a", 4096, served_model_name="sim/a")]
    tenants = [Tenant("acme", [key], {"requests_per_minute": 2})]
    with Stack(tmp_path / "stack", pools, models, tenants, redis_port=redis_port,
               sidecar_bin=sidecar_from_layer, wasm_path=plugin_from_layer,
               sidecar_overrides={"redis": {"url": f"redis://localhost:{redis_port}/0"}}) as stack:
        assert stack.sidecar_bin == sidecar_from_layer and stack.wasm_path == plugin_from_layer
        assert post(stack, "/v1/chat/completions", chat_body("a")).status_code == 401
        with httpx.stream("POST", stack.base_url + "/v1/chat/completions", headers=auth(key),
                          json=chat_body("a", stream=True), timeout=10) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        assert post(stack, "/v1/chat/completions", chat_body("a"), key=key).status_code == 200
        # The third request in the minute: refused by the limit kept in Redis.
        third = post(stack, "/v1/chat/completions", chat_body("a"), key=key)
        assert third.status_code == 429, third.text
        assert int(third.headers["retry-after"]) >= 1
        # The limits and the usage records are in the Redis the sidecar reached by name.
        import redis  # noqa: PLC0415

        assert redis.Redis(port=redis_port).dbsize() > 0


# ------------------------------------------------------------------ 6. gatewayctl pins the digests


def test_images_yaml_renders_manifests_pinned_by_the_digests(images, tmp_path):
    if not GATEWAYCTL.exists():
        pytest.fail(f"{GATEWAYCTL} not built: run `make build`")
    sidecar, filt = read_image(images / "ext-proc"), read_image(images / "filter")
    fields = yaml.safe_load((images / "images.yaml").read_text())
    assert fields == {
        "filter": {"module": {"url": f"oci://{FILTER_REF}", "sha256": filt["digest"].split(":")[1]}},
        "kubernetes": {"sidecar": {"image": SIDECAR_REF, "image_sha256": sidecar["digest"].split(":")[1]}},
    }
    config = yaml.safe_load(EXAMPLE.read_text())
    config["filter"]["wasm_file"] = str(WASM_PATH)
    config["filter"]["module"] = fields["filter"]["module"]
    config["kubernetes"]["sidecar"].update(fields["kubernetes"]["sidecar"])
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = tmp_path / "out"
    result = subprocess.run([str(GATEWAYCTL), "render", "--config", str(path), "--out", str(out)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    deployment = yaml.safe_load((out / "kubernetes" / "sidecar-deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == f"{SIDECAR_REF}@{sidecar['digest']}"
    envoy_filter = yaml.safe_load((out / "istio" / "envoyfilter.yaml").read_text())
    [ecds] = [p["patch"]["value"] for p in envoy_filter["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG"]
    remote = ecds["typed_config"]["config"]["vm_config"]["code"]["remote"]
    assert remote["http_uri"]["uri"] == f"oci://{FILTER_REF}"
    assert remote["sha256"] == filt["digest"].split(":")[1]
    policy = yaml.safe_load((out / "envoy-gateway" / "envoyextensionpolicy.yaml").read_text())
    assert policy["spec"]["wasm"][0]["code"] == {
        "type": "Image", "image": {"url": FILTER_REF, "sha256": filt["digest"].split(":")[1]}}


# ------------------------------------------------------------------ 7. the Dockerfile


def dockerfile_stages() -> dict[str, list[str]]:
    """The Dockerfile's instructions by stage name (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE)
        if m:
            current = m.group(2)
            stages[current] = [f"FROM {m.group(1)}"]
        elif current:
            stages[current].append(re.sub(r"\s+", " ", line))
    return stages


def test_dockerfile_builds_the_same_contents():
    stages = dockerfile_stages()
    makefile = (ROOT / "Makefile").read_text()
    build = " ".join(stages["build"])
    # The same cargo builds as `make images`.
    for command in ("cargo build --locked --profile image --target x86_64-unknown-linux-musl -p gateway-ext-proc",
                    "cargo build --release --locked --target wasm32-wasip1 -p gateway-filter"):
        assert command in build, command
        assert command in makefile.replace("$(MUSL)", "x86_64-unknown-linux-musl"), command
    assert stages["ext-proc"] == [
        "FROM scratch",
        "COPY --from=build --chown=0:0 --chmod=0755 /src/target/x86_64-unknown-linux-musl/image/gateway-ext-proc /gateway-ext-proc",
        "USER 65532:65532",
        'ENTRYPOINT ["/gateway-ext-proc"]',
    ]
    assert stages["filter"] == [
        "FROM scratch",
        "COPY --from=build --chown=0:0 --chmod=0644 /src/target/wasm32-wasip1/release/gateway_filter.wasm /plugin.wasm",
    ]
