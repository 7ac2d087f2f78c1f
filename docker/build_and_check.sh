#!/usr/bin/env bash
# Build the service image from the project's Dockerfile with buildah and prove that it serves (`make container`).
#
#   docker/build_and_check.sh            # CPU image on a local debootstrapped Debian bookworm-slim base
#   BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04 DEVICE=cuda CHECK_DEVICE=cpu docker/build_and_check.sh
#                                        # GPU image, where that base image can be pulled (not on our build machine),
#                                        # checked on the CPU: `buildah run --isolation chroot` runs no NVIDIA
#                                        # container hook, so the container sees no libcuda (a GPU check is a run
#                                        # with the toolkit: docker run --gpus all, or podman with a CDI device)
#   TORCH_CPU_INDEX=URL                  # another PyTorch CPU wheel index (a mirror); empty: PyPI's torch
#
# Steps: (1) a local base image from `debootstrap --variant=minbase bookworm`, slimmed as debian:bookworm-slim is
# (cached: built once), (2) the image (`buildah build --isolation chroot`, the build machine's pip index settings
# passed as build secrets), (3) the image's size, split into torch with its CUDA wheels and everything else
# (docker/image_size.py), (4) a sample scene drawn by the image's own Python (the project's scene renderer), (5) the
# image's entrypoint run as its non-root user with the weights mounted read-only and a tmpfs on /tmp, /readyz
# waited for, the sample captioned with curl, the uid checked, the weights' checksums and the container's root
# filesystem compared before/after, (6) SIGTERM and the exit code checked. Prints the image size and time to
# ready. Needs nothing from the project's .venv. Anything missing (root, buildah, curl) or any failing step is an
# error with a message, never a silent pass or a bare exit code.
set -Eeuo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
CACHE=${CACHE:-$ROOT/.cache/container}
LOCAL_BASE=localhost/captioner-base:bookworm-slim
BASE_IMAGE=${BASE_IMAGE:-$LOCAL_BASE}
DEVICE=${DEVICE:-cpu}
[ "$DEVICE" = cuda ] && default_tag=gpu || default_tag=cpu  # the tags compose and k8s/ use
TAG=${TAG:-$default_tag}
IMAGE=${IMAGE:-localhost/attention-captioner:$TAG}
PORT=${PORT:-18765}
CHECK_DEVICE=${CHECK_DEVICE:-$DEVICE}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-1200}  # every checkpoint is exported to ONNX and warmed first: ~10 min on 2 busy cores
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ISOLATION=(--isolation chroot)
mkdir -p "$CACHE"

say() { printf '\n== %s\n' "$*"; }
die() { printf 'container check FAILED: %s\n' "$*" >&2; exit 1; }
# any other failing command (set -e) says which one, instead of a bare exit status
trap 'status=$?; printf "container check FAILED: line %s: \"%s\" exited %s\n" "$LINENO" "$BASH_COMMAND" "$status" >&2' ERR

# -- 0. tools -----------------------------------------------------------------------------------------------------
if [ "$(id -u)" != 0 ]; then
  die "needs root (buildah's chroot isolation and debootstrap); run as root, nothing was built or checked"
fi
if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
  command -v apt-get >/dev/null || die "buildah/debootstrap missing and no apt-get to install them"
  say "installing buildah and debootstrap (Debian packages)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap >/dev/null \
    || die "could not install buildah and debootstrap"
fi
for tool in curl ss python3; do  # python3: the host's, standard library only (JSON, the size report)
  command -v "$tool" >/dev/null || die "$tool is missing on this machine (curl; ss from iproute2; python3)"
done

# -- 1. the local base image (what debian:bookworm-slim would be, made from Debian's packages) -------------------
# "slim" as Debian's official images make it (debuerreotype-slimify): no manuals, docs or translations, now or in
# packages installed later (a dpkg path-exclude file).
slimify() {
  local rootfs=$1 config=$1/etc/dpkg/dpkg.cfg.d/docker-slim
  mkdir -p "$(dirname "$config")"
  printf '# the "slim" variant: manuals, docs and translations are not installed\n' > "$config"
  for dir in doc groff info linda lintian/overrides locale man; do
    echo "path-exclude /usr/share/$dir/*" >> "$config"
    [ -d "$rootfs/usr/share/$dir" ] && find "$rootfs/usr/share/$dir" -mindepth 1 -depth \
      ! -path '*/doc/*/copyright' ! -path '*/locale/locale.alias' \( ! -type d -o -empty \) -delete
  done
  printf 'path-include /usr/share/doc/*/copyright\npath-include /usr/share/locale/locale.alias\n' >> "$config"
}
if [ "$BASE_IMAGE" = "$LOCAL_BASE" ] && ! buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
  tarball=$CACHE/bookworm-slim.tar
  if [ ! -s "$tarball" ]; then
    say "debootstrap --variant=minbase bookworm, slimmed (once; cached in $tarball)"
    rootfs=$CACHE/rootfs-bookworm
    if [ ! -x "$rootfs/usr/bin/apt-get" ]; then
      rm -rf "$rootfs"
      debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR"
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    slimify "$rootfs"
    tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  fi
  say "importing the base image $BASE_IMAGE"
  ctr=$(buildah from scratch)
  buildah add "$ctr" "$tarball" / >/dev/null
  buildah config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah commit --rm "$ctr" "$BASE_IMAGE" >/dev/null
fi

# -- 2. the build machine's package-index settings, as build secrets (never in a layer) ---------------------------
# pip.conf with only the index settings; the constraints and the CA bundle are their own secrets; file:// indexes
# and find-links folders are bind-mounted read-only into the build at the same paths.
say "pip index settings for the build (secrets)"
PIP_CFG=$CACHE/pip.conf
volumes=()
# `pip config get` reads one file only; `pip config list` shows the merged settings of every file (last one wins)
pip_settings=$(python3 -m pip config list 2>/dev/null || true)
pip_get() { sed -n "s/^$1='\(.*\)'\$/\1/p" <<<"$pip_settings" | tail -1; }
index_url=${PIP_INDEX_URL:-$(pip_get global.index-url)}
extra_urls=${PIP_EXTRA_INDEX_URL:-$(pip_get global.extra-index-url)}
find_links=${PIP_FIND_LINKS:-$(pip_get global.find-links)}
constraint=${PIP_CONSTRAINT:-$(pip_get global.constraint)}
cert=${PIP_CERT:-$(pip_get global.cert)}
{
  echo "[global]"
  [ -n "$index_url" ] && echo "index-url = $index_url"
  [ -n "$extra_urls" ] && echo "extra-index-url = $(echo $extra_urls)"
  [ -n "$find_links" ] && echo "find-links = $(echo $find_links)"
  true
} > "$PIP_CFG"
for location in $index_url $extra_urls $find_links; do
  path=${location#file://}
  if [ "${path:0:1}" = / ] && [ -e "$path" ]; then
    # a file index's pages link to ../../files: mount the folder above "simple"
    [ "$(basename "$path")" = simple ] && path=$(dirname "$path")
    volumes+=(-v "$path:$path:ro")
  fi
done
: > "$CACHE/empty"
secrets=(--secret "id=pip.conf,src=$PIP_CFG"
         --secret "id=pip-constraints,src=${constraint:-$CACHE/empty}"
         --secret "id=ca-bundle,src=${cert:-$CACHE/empty}")
sed 's/^/  /' "$PIP_CFG"; echo "  constraints: ${constraint:-none}; CA bundle: ${cert:-none}; mounts: ${volumes[*]:-none}"

# -- 3. build ---------------------------------------------------------------------------------------------------------
say "buildah build $IMAGE (BASE_IMAGE=$BASE_IMAGE DEVICE=$DEVICE)"
build_started=$(date +%s)
torch_index=()  # unset: the Dockerfile's default (the PyTorch CPU wheel index)
[ -n "${TORCH_CPU_INDEX+set}" ] && torch_index=(--build-arg "TORCH_CPU_INDEX=$TORCH_CPU_INDEX")
pull=(--pull=never)
[[ "$BASE_IMAGE" == localhost/* ]] || pull=(--pull=missing)
buildah build --isolation chroot --format docker --layers "${pull[@]}" \
  --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "DEVICE=$DEVICE" "${torch_index[@]}" \
  "${secrets[@]}" "${volumes[@]}" \
  -f Dockerfile -t "$IMAGE" .
echo "build took $(( $(date +%s) - build_started )) s"

# -- 4. the image's size, its user, a sample scene; then run the entrypoint as that user ----------------------------
image_config() {  # one field of the image's config: Entrypoint (as a shell command line), User; its size; or the
                  # size of its last layer (the project's code: the one layer a code change replaces)
  buildah inspect --type image "$IMAGE" | python3 -c '
import json, shlex, sys
image = json.load(sys.stdin)
field = sys.argv[1]
if field == "size":
    print(sum(layer["size"] for layer in json.loads(image["Manifest"])["layers"]))
elif field == "code-layer":
    print(json.loads(image["Manifest"])["layers"][-1]["size"])
else:
    value = image["OCIv1"]["config"].get(field)
    print(shlex.join(value) if isinstance(value, list) else value or "")' "$1"
}
size_bytes=$(image_config size)
entrypoint=$(image_config Entrypoint)
image_user=$(image_config User)
expected_uid=${image_user%%:*}
[ -n "$expected_uid" ] && [ "$expected_uid" != 0 ] && [ "$expected_uid" != root ] || die "image user is '$image_user', not a non-root uid"

ctr=$(buildah from --name "captioner-check-$$" "$IMAGE")
server_pid=""
cleanup() {
  [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null && kill -KILL "$server_pid" 2>/dev/null || true
  buildah umount "$ctr" >/dev/null 2>&1 || true
  buildah rm "$ctr" >/dev/null 2>&1 || true
}
trap cleanup EXIT

rootfs=$(buildah mount "$ctr")
# the build secrets must not have left anything behind in the image
leftovers=$(cd "$rootfs" && { ls run/secrets 2>/dev/null; grep -rls -e 'index-url' -e 'find-links' etc/pip.conf etc/xdg/pip \
  opt/venv/pip.conf root/.config/pip 2>/dev/null; } || true)
[ -z "$leftovers" ] || die "package-index configuration left in the image: $leftovers"

say "image size"
size_report=$(python3 docker/image_size.py "$rootfs" "$size_bytes")
size_report+=$'\n'"code layer:    $(( $(image_config code-layer) / 1000 )) kB (/opt/project, the last layer: all a code change replaces)"
echo "$size_report"

# The sample is drawn by the image's own Python with the project's scene renderer (scene 0 of the default seed),
# so the check needs nothing from the host's Python or the project's .venv, and its reference captions are known.
say "a sample scene, drawn by the image's own Python"
sample=$CACHE/sample-scene.jpg
draw_sample='import base64, json, sys, tempfile
from pathlib import Path
from captioner.models.data.scenes import generate
out = Path(tempfile.mkdtemp())
scene = json.loads(generate(out, {"train": 1}, progress=False).read_text())["images"][0]
jpeg = (out / scene["filepath"] / scene["filename"]).read_bytes()
json.dump({"jpeg": base64.b64encode(jpeg).decode(), "references": [s["raw"] for s in scene["sentences"]]}, sys.stdout)'
buildah run "${ISOLATION[@]}" --mount type=tmpfs,destination=/tmp "$ctr" -- python3 -c "$draw_sample" \
  > "$CACHE/sample-scene.json" || die "the image's python3 could not draw the sample scene (its output is above)"
python3 - "$CACHE/sample-scene.json" "$sample" <<'EOF' || die "the sample scene's JSON is unreadable"
import base64, json, sys
from pathlib import Path
scene = json.loads(Path(sys.argv[1]).read_text())
Path(sys.argv[2]).write_bytes(base64.b64decode(scene["jpeg"]))
print("references:", "; ".join(scene["references"]))
EOF
echo "image: $sample"
weights_sums_before=$(cd weights && find . -type f -print0 | sort -z | xargs -0 sha256sum)
marker=$CACHE/run-started
touch "$marker"; sleep 1

log=$CACHE/serve-$TAG.log
say "starting '$entrypoint' as $image_user (weights read-only, tmpfs /tmp, port $PORT)"
started_ns=$(date +%s%N)
buildah run "${ISOLATION[@]}" \
  -v "$ROOT/weights:/app/weights:ro" \
  --mount type=tmpfs,destination=/tmp \
  -e CAPTIONER_PORT="$PORT" -e CAPTIONER_DEVICE="$CHECK_DEVICE" -e CAPTIONER_LOG_FORMAT=text \
  -e CAPTIONER_DRAIN_TIMEOUT_S=10 \
  "$ctr" -- sh -c "exec $entrypoint" >"$log" 2>&1 &
runner_pid=$!

ready=""
deadline=$(( $(date +%s) + READY_TIMEOUT_S ))
while [ "$(date +%s)" -lt "$deadline" ]; do
  if ! kill -0 "$runner_pid" 2>/dev/null; then tail -30 "$log"; die "the server exited before it was ready"; fi
  if curl -fsS -o /dev/null "http://127.0.0.1:$PORT/readyz" 2>/dev/null; then ready=1; break; fi
  sleep 0.2
done
[ -n "$ready" ] || { tail -30 "$log"; die "not ready within $READY_TIMEOUT_S s"; }
ready_s=$(python3 -c "print(f'{($(date +%s%N) - $started_ns) / 1e9:.1f}')")
echo "ready after $ready_s s"

server_pid=$(ss -ltnpH "sport = :$PORT" | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2)
[ -n "$server_pid" ] || die "cannot find the process listening on port $PORT"
server_uid=$(awk '/^Uid:/ {print $2}' "/proc/$server_pid/status")
echo "server pid $server_pid runs as uid $server_uid (image user $image_user)"
[ "$server_uid" = "$expected_uid" ] || die "server runs as uid $server_uid, not $expected_uid"

say "captioning the sample scene through the container"
response=$CACHE/caption-$TAG.json
http_code=$(curl -sS -o "$response" -w '%{http_code}' -F "file=@$sample" "http://127.0.0.1:$PORT/caption")
[ "$http_code" = 200 ] || { cat "$response"; die "POST /caption answered $http_code"; }
caption=$(python3 -c 'import json, sys
model, text, tokens, attention = (json.load(open(sys.argv[1]))[k] for k in ("model", "caption", "tokens", "attention"))
found = "one of" if text in json.load(open(sys.argv[2]))["references"] else "not among"
print(f"{model}: {text!r} ({found} the references; tokens {tokens}, {len(attention)} attention rows)")' \
  "$response" "$CACHE/sample-scene.json")
echo "caption: $caption"
metrics=$(curl -fsS "http://127.0.0.1:$PORT/metrics")  # not piped into grep -q: its early exit fails curl under pipefail
grep -q '^captioner_request_latency_seconds_count' <<<"$metrics" || die "/metrics has no captioner_ request series"

say "SIGTERM"
kill -TERM "$server_pid"
exit_code=0
wait "$runner_pid" || exit_code=$?
server_pid=""
echo "exit code $exit_code"
[ "$exit_code" = 0 ] || { tail -20 "$log"; die "exit code $exit_code after SIGTERM (expected 0)"; }

weights_sums_after=$(cd weights && find . -type f -print0 | sort -z | xargs -0 sha256sum)
[ "$weights_sums_before" = "$weights_sums_after" ] || die "the weights folder changed during the run"
written=$(cd "$rootfs" && find . -xdev -newer "$marker" ! -path './tmp*' ! -path './proc*' ! -path './sys*' \
  ! -path './dev*' ! -path './run*' ! -path './etc/hosts' ! -path './etc/resolv.conf' ! -path './etc/hostname' \
  ! -path './app/weights' ! -path '.' -print 2>/dev/null | head -20)
[ -z "$written" ] || die "the container wrote outside /tmp: $written"
echo "weights unchanged (sha256 of $(echo "$weights_sums_after" | wc -l) files); nothing written outside /tmp"

say "summary"
echo "image:         $IMAGE (base $BASE_IMAGE)"
echo "$size_report"
echo "time to ready: $ready_s s (process start to /readyz 200, device $CHECK_DEVICE)"
echo "caption:       $caption"
echo "user:          uid $server_uid; SIGTERM exit code $exit_code"
