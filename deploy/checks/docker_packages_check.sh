#!/usr/bin/env bash
# Checks the Debian package lists of deploy/docker/Dockerfile:
#   - the builder stage (FROM debian:12) installs exactly BUILD_PACKAGES of tools/setup.sh;
#   - the runtime stage (FROM debian:12-slim) installs only runtime library packages: Debian
#     section libs, no -dev, none of the setup script's build or test packages;
#   - with --build-dir DIR: the runtime list is exactly the Debian packages owning the shared
#     libraries (ldd, transitively) of the binaries the runtime stage copies from the builder,
#     looked up in DIR, minus what debian:12-slim already holds. Exits 77 (skipped) when DIR lacks
#     a binary (the tree is configured but not built).
#
#   bash deploy/checks/docker_packages_check.sh [--dockerfile FILE] [--setup FILE] [--build-dir DIR]
#
# Extras and missing packages are listed by name (with the library and binary that need them).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DOCKERFILE=$ROOT/deploy/docker/Dockerfile
SETUP=$ROOT/tools/setup.sh
BUILD_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dockerfile) DOCKERFILE=$2; shift 2 ;;
    --setup) SETUP=$2; shift 2 ;;
    --build-dir) BUILD_DIR=$2; shift 2 ;;
    *) echo "docker_packages_check: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v python3 >/dev/null || { echo "docker_packages_check: python3 not found" >&2; exit 1; }

exec python3 - "$DOCKERFILE" "$SETUP" "$BUILD_DIR" <<'PY'
import os
import re
import shlex
import subprocess
import sys

dockerfile, setup, build_dir = sys.argv[1], sys.argv[2], sys.argv[3]
# Already in debian:12-slim (dependencies of dpkg and apt), so the runtime stage need not list
# them; listing them is not an error either.
SLIM_BASE = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g"}
problems = []


def fail(msg):
    problems.append(msg)
    print(f"FAIL {msg}", file=sys.stderr)


# ---- the Dockerfile: stages, their apt-get install lists and the binaries copied ------------
def instructions(path):
    """(keyword, text) per Dockerfile instruction, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for raw in open(path, encoding="utf-8"):
        line = raw.rstrip("\n")
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if cur and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        kw, _, rest = cur.strip().partition(" ")
        out.append((kw.upper(), rest.strip()))
        cur = ""
    return out


stages = []  # [{"base", "name", "apt", "copies"}]
for kw, rest in instructions(dockerfile):
    if kw == "FROM":
        m = re.match(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
        stages.append({"base": m.group(1), "name": m.group(2) or "", "apt": [], "copies": []})
    elif kw == "RUN" and stages:
        for cmd in re.split(r"&&|;|\|\|", rest):
            words = shlex.split(cmd)
            if len(words) >= 2 and words[0] in ("apt-get", "apt") and "install" in words:
                args = words[words.index("install") + 1:]
                stages[-1]["apt"] += [w for w in args if not w.startswith("-")]
    elif kw == "COPY" and stages:
        words = shlex.split(rest)
        if any(w.startswith("--from=") for w in words):
            srcs = [w for w in words if not w.startswith("--")][:-1]
            stages[-1]["copies"] += srcs

by_name = {s["name"]: s for s in stages}
builder, runtime = by_name.get("builder"), by_name.get("runtime")
if not builder or not runtime:
    fail(f"{dockerfile}: expected stages named builder and runtime, found {[s['name'] for s in stages]}")
    sys.exit(1)
if builder["base"] != "debian:12":
    fail(f"builder stage is FROM {builder['base']}, expected debian:12")
if runtime["base"] != "debian:12-slim":
    fail(f"runtime stage is FROM {runtime['base']}, expected debian:12-slim")

# ---- tools/setup.sh: BUILD_PACKAGES and TEST_PACKAGES -----------------------------------------
def bash_array(text, name):
    m = re.search(rf"^{name}=\((.*?)^\)", text, re.S | re.M)
    if not m:
        return None
    words = []
    for line in m.group(1).splitlines():
        words += line.split("#", 1)[0].split()
    return words


setup_text = open(setup, encoding="utf-8").read()
build_pkgs = bash_array(setup_text, "BUILD_PACKAGES")
test_pkgs = bash_array(setup_text, "TEST_PACKAGES") or []
if build_pkgs is None:
    fail(f"{setup}: no BUILD_PACKAGES=( ... ) array")
    sys.exit(1)


def dupes(words):
    return sorted({w for w in words if words.count(w) > 1})


for label, words in (("builder stage", builder["apt"]), ("runtime stage", runtime["apt"]),
                     ("BUILD_PACKAGES", build_pkgs)):
    if dupes(words):
        fail(f"{label}: listed twice: {' '.join(dupes(words))}")

# ---- 1. builder == BUILD_PACKAGES --------------------------------------------------------------
b, s = set(builder["apt"]), set(build_pkgs)
if b - s:
    fail("builder stage installs packages that BUILD_PACKAGES of tools/setup.sh lacks: "
         + " ".join(sorted(b - s)))
if s - b:
    fail("builder stage lacks packages of BUILD_PACKAGES of tools/setup.sh: " + " ".join(sorted(s - b)))
if b == s:
    print(f"docker_packages_check: builder stage installs exactly the {len(s)} BUILD_PACKAGES of tools/setup.sh")

# ---- 2. runtime: library packages only -------------------------------------------------------
def section(pkg):
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Section}", pkg], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
        out = subprocess.run(["apt-cache", "show", "--no-all-versions", pkg], capture_output=True, text=True)
        m = re.search(r"^Section: (\S+)", out.stdout, re.M)
        return m.group(1) if m else None
    except FileNotFoundError:
        return None


rt = runtime["apt"]
not_lib = []
for p in rt:
    why = []
    if p.endswith("-dev") or p.endswith("-dbg"):
        why.append("a -dev/-dbg package")
    if p in build_pkgs or p in test_pkgs:
        why.append("a build/test package of tools/setup.sh")
    sec = section(p)
    if sec is not None and sec.split("/")[-1] not in ("libs", "oldlibs"):
        why.append(f"Debian section {sec}, not libs")
    if why:
        not_lib.append(f"{p} ({', '.join(why)})")
if not_lib:
    fail("runtime stage installs packages that are not runtime libraries: " + "; ".join(not_lib))
else:
    print(f"docker_packages_check: runtime stage installs {len(rt)} library packages, no build or test packages")

# ---- 3. runtime list == packages of the binaries' shared libraries ---------------------------
if build_dir:
    binaries = []
    for src in runtime["copies"]:
        m = re.search(r"/build/(.+)$", src)
        if m:
            binaries.append(os.path.join(build_dir, m.group(1)))
    missing_bins = [b for b in binaries if not os.path.isfile(b)]
    if not binaries:
        fail("runtime stage copies no binaries from .../build/ of the builder")
    elif missing_bins:
        print(f"docker_packages_check: {build_dir} lacks {', '.join(missing_bins)} (not built): "
              "library comparison skipped")
        sys.exit(1 if problems else 77)
    else:
        needed = {}  # package -> [(library, binary)]
        unowned = []
        for binary in binaries:
            out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                m = re.match(r"\s*(\S+) => (\S+) \(", line)
                if not m:
                    if "not found" in line:
                        fail(f"{binary}: {line.strip()}")
                    continue
                lib, path = m.group(1), m.group(2)
                pkg = None
                for candidate in (os.path.realpath(path), path):
                    r = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
                    if r.returncode == 0:
                        pkg = r.stdout.split(":", 1)[0].strip()
                        break
                if pkg is None:
                    unowned.append(f"{lib} ({path}, {os.path.basename(binary)})")
                    continue
                needed.setdefault(pkg, []).append((lib, os.path.basename(binary)))
        if unowned:
            fail("shared libraries no Debian package owns (built by hand? the image cannot have them): "
                 + "; ".join(sorted(set(unowned))))
        listed = set(rt)
        missing = sorted(set(needed) - listed - SLIM_BASE)
        extra = sorted(listed - set(needed))
        for p in missing:
            libs = sorted({l for l, _ in needed[p]})
            users = sorted({b for _, b in needed[p]})
            fail(f"runtime stage lacks {p} (provides {', '.join(libs)} for {', '.join(users)})")
        for p in extra:
            fail(f"runtime stage installs {p}, which no copied binary loads")
        if not missing and not extra and not unowned:
            print(f"docker_packages_check: runtime stage installs exactly the packages of the shared "
                  f"libraries of its {len(binaries)} binaries ({len(needed)} packages, "
                  f"{len(set(needed) & SLIM_BASE)} already in debian:12-slim)")

if problems:
    print(f"docker_packages_check: FAILED ({len(problems)} problem(s))", file=sys.stderr)
    sys.exit(1)
print("docker_packages_check: ok")
PY
