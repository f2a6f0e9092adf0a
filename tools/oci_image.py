#!/usr/bin/env python3
"""Builds the gateway's two OCI images without a container daemon (`make images`).

* `llm-gateway-ext-proc`: the sidecar. One layer holding a static binary at `/gateway-ext-proc`
  (owned by root, mode 0755), run as user 65532:65532 with the binary as the entrypoint; no shell,
  no libc, no CA certificates, nothing else.
* `llm-gateway-filter`: the wasm filter in the *compat* variant of the Wasm image specification
  that Istio (WasmPlugin, and the istio-agent's ECDS fetch of `oci://` modules) and Envoy
  Gateway (EnvoyExtensionPolicy `code.type: Image`) pull: one `application/vnd.oci.image.layer.v1.tar+gzip`
  layer holding `plugin.wasm`, and the manifest annotation `module.wasm.image/variant: compat`.
  Both fetchers try this variant first; the *oci* variant they also read needs two layers of
  custom media types that `docker load` and registries without OCI-artifact support refuse.

Each image is written as an OCI image layout directory (image-spec v1.1 `image-layout.md`:
`oci-layout`, `index.json`, `blobs/sha256/<hex>`) and as a tarball of that directory. The layout
also holds a `manifest.json` in `docker save`'s format (Config, RepoTags, Layers), so the tarball
is at once an OCI archive (`skopeo copy oci-archive:...`; `docker load` from docker 25 on) and a
docker archive (`docker load` before 25; `crane push FILE`).

The printed digest is the manifest's: what a registry serves when the manifest is pushed as is:
`crane push DIR REF` or `skopeo copy --preserve-digests oci:DIR docker://REF` keep it; `crane push`
of the tarball and `docker load` + `docker push` rewrite the manifest (docker media types), and
the digest the registry then reports is the one to use.

Everything is deterministic: tar entries sorted, mtimes SOURCE_DATE_EPOCH (default 0), owner
0:0 with no names, gzip without a name or time; the same inputs give byte-identical outputs.
Only the Python standard library is used.

    python3 tools/oci_image.py --sidecar target/x86_64-unknown-linux-musl/image/gateway-ext-proc \\
        --filter target/wasm32-wasip1/release/gateway_filter.wasm --out target/images \\
        --registry registry.example.com            # tag: the workspace version (Cargo.toml)

writes `OUT/ext-proc/`, `OUT/ext-proc.tar`, `OUT/filter/`, `OUT/filter.tar` and `OUT/images.yaml`
(the gateway config's image fields, for gatewayctl) and prints the references, digests and sizes.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import struct
import sys
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Media types (OCI image-spec v1.1 media-types.md).
OCI_LAYOUT_VERSION = "1.0.0"
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"

# The sidecar's image: where the binary is and who runs it (65532: "nonroot" of distroless; the
# Deployment gatewayctl renders sets the same runAsUser / runAsGroup).
SIDECAR_REPOSITORY = "llm-gateway-ext-proc"
SIDECAR_PATH = "gateway-ext-proc"  # in the layer: /gateway-ext-proc
SIDECAR_USER = "65532:65532"
# The filter's image (Wasm image specification, compat variant).
FILTER_REPOSITORY = "llm-gateway-filter"
FILTER_PATH = "plugin.wasm"
WASM_VARIANT_ANNOTATION = "module.wasm.image/variant"

# The reference grammar of distribution/reference (docker's and every OCI registry's):
# name components of lowercase alphanumerics and separators, an optional registry host[:port].
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9]))*(?::[0-9]+)?"
REGISTRY_RE = re.compile(rf"^{_HOST}(?:/{_COMPONENT})*$")
TAG_RE = re.compile(r"^[\w][\w.-]{0,127}$")

# ELF (System V gABI): the e_machine values of the architectures we can label, as OCI names them.
ELF_MACHINES = {62: "amd64", 183: "arm64"}
PT_INTERP = 3


class ImageError(Exception):
    """An input the images cannot be built from; the message says which and why."""


@dataclass
class Blob:
    """Content-addressed bytes and their OCI descriptor fields."""

    data: bytes
    media_type: str

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.data).hexdigest()

    def descriptor(self, **extra) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": len(self.data), **extra}


@dataclass
class Built:
    """One image written: its reference, manifest digest and where it lies."""

    name: str  # "ext-proc" or "filter"
    ref: str  # registry/repository:tag
    digest: str  # sha256:<hex> of the manifest
    layout: Path
    tarball: Path
    blob_bytes: int  # manifest + config + layers, what a registry stores

    @property
    def sha256(self) -> str:
        return self.digest.removeprefix("sha256:")


def source_date_epoch() -> int:
    """Timestamps of every tar entry and of the config (reproducible-builds.org convention)."""
    value = os.environ.get("SOURCE_DATE_EPOCH", "0")
    if not value.isdigit():
        raise ImageError(f"SOURCE_DATE_EPOCH must be a non-negative integer, got {value!r}")
    return int(value)


def rfc3339(epoch: int) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def compact_json(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def layer_tar(path: str, data: bytes, mode: int, epoch: int) -> bytes:
    """A tar of one regular file at `path` (relative to /), owned by 0:0 without names."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(path)
        info.size, info.mode, info.mtime = len(data), mode, epoch
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def gzipped(data: bytes) -> bytes:
    """gzip without a file name and with time 0 (RFC 1952 MTIME 0: none), level 9."""
    return gzip.compress(data, compresslevel=9, mtime=0)


def elf_architecture(data: bytes, what: str) -> str:
    """The OCI architecture of a static ELF executable; refuses one that needs a dynamic loader
    (PT_INTERP), which an image without libc could not start."""
    if data[:4] != b"\x7fELF":
        raise ImageError(f"{what}: not an ELF executable")
    if data[4] != 2 or data[5] != 1:
        raise ImageError(f"{what}: not a 64-bit little-endian ELF executable")
    (machine,) = struct.unpack_from("<H", data, 18)
    (phoff,) = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    for i in range(phnum):
        (p_type,) = struct.unpack_from("<I", data, phoff + i * phentsize)
        if p_type == PT_INTERP:
            raise ImageError(
                f"{what}: dynamically linked (it names an ELF interpreter); the image holds no libc: "
                "build it for the musl target (`make images` does)")
    if machine not in ELF_MACHINES:
        raise ImageError(f"{what}: ELF machine {machine} is none of {sorted(ELF_MACHINES)}")
    return ELF_MACHINES[machine]


def check_wasm(data: bytes, what: str) -> None:
    if data[:4] != b"\0asm" or len(data) < 8:
        raise ImageError(f"{what}: not a WebAssembly module (no \\0asm header)")


def labels(title: str, description: str, version: str) -> dict:
    """The config's labels (OCI image-spec annotations.md pre-defined keys)."""
    return {
        "org.opencontainers.image.title": title,
        "org.opencontainers.image.description": description,
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.licenses": "Apache-2.0",
    }


def image_blobs(*, path: str, data: bytes, mode: int, arch: str, container_config: dict,
                manifest_annotations: dict | None, epoch: int, created_by: str) -> tuple[Blob, Blob, Blob]:
    """The layer, config and manifest of a one-layer image."""
    tar = layer_tar(path, data, mode, epoch)
    layer = Blob(gzipped(tar), MT_LAYER_GZIP)
    created = rfc3339(epoch)
    config = Blob(compact_json({
        "created": created,
        "architecture": arch,
        "os": "linux",
        "config": container_config,
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(tar).hexdigest()]},
        "history": [{"created": created, "created_by": created_by}],
    }), MT_CONFIG)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": config.descriptor(),
        "layers": [layer.descriptor()],
    }
    if manifest_annotations:
        manifest["annotations"] = manifest_annotations
    return layer, config, Blob(compact_json(manifest), MT_MANIFEST)


def write_layout(out: Path, name: str, ref: str, tag: str, arch: str,
                 layer: Blob, config: Blob, manifest: Blob, epoch: int) -> Built:
    """Writes OUT/NAME/ (the OCI image layout, plus docker's manifest.json) and OUT/NAME.tar."""
    layout = out / name
    if layout.exists():
        if not (layout / "oci-layout").is_file():
            raise ImageError(f"{layout} exists and is not an OCI image layout: not overwriting it")
        shutil.rmtree(layout)
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for blob in (layer, config, manifest):
        (blobs / blob.digest.removeprefix("sha256:")).write_bytes(blob.data)
    (layout / "oci-layout").write_bytes(compact_json({"imageLayoutVersion": OCI_LAYOUT_VERSION}))
    index = {
        "schemaVersion": 2,
        "mediaType": MT_INDEX,
        "manifests": [manifest.descriptor(
            platform={"architecture": arch, "os": "linux"},
            # The tag (the OCI layout's ref name: `skopeo copy oci:DIR:TAG`) and the full name
            # docker 25+ `docker load` tags the image with.
            annotations={"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": tag},
        )],
    }
    (layout / "index.json").write_bytes(compact_json(index))
    # docker save's manifest.json: what `docker load` before 25 and go-containerregistry's
    # tarball reader (crane push FILE) read.
    docker_manifest = [{
        "Config": f"blobs/sha256/{config.digest.removeprefix('sha256:')}",
        "RepoTags": [ref],
        "Layers": [f"blobs/sha256/{layer.digest.removeprefix('sha256:')}"],
    }]
    (layout / "manifest.json").write_bytes(compact_json(docker_manifest))
    tarball = out / f"{name}.tar"
    write_tarball(layout, tarball, epoch)
    return Built(name, ref, manifest.digest, layout, tarball,
                 sum(len(b.data) for b in (layer, config, manifest)))


def write_tarball(layout: Path, tarball: Path, epoch: int) -> None:
    """A tar of the layout directory's contents (no leading directory), entries sorted."""
    entries = sorted(p for p in layout.rglob("*"))
    tmp = tarball.with_suffix(".tar.tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in entries:
            rel = path.relative_to(layout).as_posix()
            info = tarfile.TarInfo(rel + ("/" if path.is_dir() else ""))
            info.mtime, info.uid, info.gid, info.uname, info.gname = epoch, 0, 0, "", ""
            if path.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                data = path.read_bytes()
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    tmp.replace(tarball)


def workspace_version() -> str:
    with open(ROOT / "Cargo.toml", "rb") as f:
        return tomllib.load(f)["workspace"]["package"]["version"]


def build_sidecar(binary: Path, registry: str, tag: str, out: Path, epoch: int) -> Built:
    data = binary.read_bytes()
    arch = elf_architecture(data, str(binary))
    ref = f"{registry}/{SIDECAR_REPOSITORY}:{tag}"
    layer, config, manifest = image_blobs(
        path=SIDECAR_PATH, data=data, mode=0o755, arch=arch,
        container_config={
            "User": SIDECAR_USER,
            "Entrypoint": [f"/{SIDECAR_PATH}"],
            "WorkingDir": "/",
            "Labels": labels("llm-gateway-ext-proc",
                             "Envoy ext_proc sidecar of the LLM gateway (static binary)", tag),
        },
        manifest_annotations=None, epoch=epoch,
        created_by=f"tools/oci_image.py: /{SIDECAR_PATH} (root:root 0755), USER {SIDECAR_USER}")
    return write_layout(out, "ext-proc", ref, tag, arch, layer, config, manifest, epoch)


def build_filter(wasm: Path, registry: str, tag: str, out: Path, epoch: int) -> Built:
    data = wasm.read_bytes()
    check_wasm(data, str(wasm))
    ref = f"{registry}/{FILTER_REPOSITORY}:{tag}"
    # A wasm module runs on any architecture; the config still needs a platform, and docker load
    # refuses an OS other than its host's. linux/amd64 is what `docker build` of the documented
    # `FROM scratch` + `COPY plugin.wasm ./` gives on the usual builder; the Istio and Envoy
    # Gateway fetchers do not read it.
    layer, config, manifest = image_blobs(
        path=FILTER_PATH, data=data, mode=0o644, arch="amd64",
        container_config={"Labels": labels("llm-gateway-filter",
                                           "proxy-wasm HTTP filter of the LLM gateway (Wasm image, compat variant)", tag)},
        manifest_annotations={WASM_VARIANT_ANNOTATION: "compat"}, epoch=epoch,
        created_by=f"tools/oci_image.py: /{FILTER_PATH} (root:root 0644)")
    return write_layout(out, "filter", ref, tag, "amd64", layer, config, manifest, epoch)


def images_yaml(sidecar: Built | None, filt: Built | None) -> str:
    """The gateway config's fields for these images, to merge into gateway.yaml."""
    lines = [
        "# Written by `make images` (tools/oci_image.py): the gateway config's image fields for the",
        "# images it built, valid once they are pushed with their manifests unchanged",
        "# (docs/deploy.md, \"Images\"). Merge them into your gateway config.",
    ]
    if filt:
        lines += ["filter:", "  module:", f"    url: oci://{filt.ref}", f'    sha256: "{filt.sha256}"']
    if sidecar:
        lines += ["kubernetes:", "  sidecar:", f"    image: {sidecar.ref}", f'    image_sha256: "{sidecar.sha256}"']
    return "\n".join(lines) + "\n"


def mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sidecar", type=Path, help="the static gateway-ext-proc binary")
    parser.add_argument("--filter", type=Path, help="gateway_filter.wasm")
    parser.add_argument("--out", type=Path, required=True, help="output directory (created)")
    parser.add_argument("--registry", default="registry.example.com",
                        help="registry[/path] the images will be pushed to (default %(default)s)")
    parser.add_argument("--tag", help="image tag (default: the workspace version in Cargo.toml)")
    args = parser.parse_args(argv)
    try:
        if not args.sidecar and not args.filter:
            raise ImageError("nothing to build: give --sidecar and/or --filter")
        tag = args.tag or workspace_version()
        if not TAG_RE.match(tag):
            raise ImageError(f"--tag {tag!r}: not an image tag ([A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})")
        if not REGISTRY_RE.match(args.registry):
            raise ImageError(f"--registry {args.registry!r}: not a registry host[:port][/lowercase path]")
        for flag, path in (("--sidecar", args.sidecar), ("--filter", args.filter)):
            if path and not path.is_file():
                raise ImageError(f"{flag} {path}: no such file (run `make images`)")
        epoch = source_date_epoch()
        args.out.mkdir(parents=True, exist_ok=True)
        sidecar = build_sidecar(args.sidecar, args.registry, tag, args.out, epoch) if args.sidecar else None
        filt = build_filter(args.filter, args.registry, tag, args.out, epoch) if args.filter else None
    except (ImageError, OSError) as e:
        print(f"oci_image.py: {e}", file=sys.stderr)
        return 2
    (args.out / "images.yaml").write_text(images_yaml(sidecar, filt))
    for built in (b for b in (sidecar, filt) if b):
        print(f"{built.name}: {built.ref}@{built.digest}")
        print(f"  layout {built.layout}/, tarball {built.tarball} ({mib(built.tarball.stat().st_size)}); "
              f"in a registry {mib(built.blob_bytes)}")
        print(f"  push, digest unchanged: crane push {built.layout} {built.ref}")
        print(f"                      or: skopeo copy --preserve-digests oci:{built.layout} docker://{built.ref}")
    print(f"gateway config fields: {args.out / 'images.yaml'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
