#!/usr/bin/env python3
"""The image's build context holds every source folder the top-level CMakeLists.txt adds
unconditionally: each such folder is allowlisted ("!folder/") in both .dockerignore (the classic
builder) and deploy/docker/Dockerfile.dockerignore (BuildKit). A folder added without it made the
image's configure step fail (worker/, added by a restructuring, was missing from both).

  python3 deploy/checks/docker_context_check.py    # exit 1 and a line per missing entry
"""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent.parent
cmake = (root / "CMakeLists.txt").read_text(encoding="utf-8")
# add_subdirectory(x) calls outside any if(): the image's Release build configures these.
folders, depth = [], 0
for line in cmake.splitlines():
    code = line.split("#", 1)[0].strip()
    if re.match(r"^if\s*\(", code):
        depth += 1
    elif re.match(r"^endif\s*\(", code):
        depth -= 1
    elif depth == 0:
        m = re.match(r"^add_subdirectory\s*\(\s*([^\s)]+)", code)
        if m:
            folders.append(m.group(1))
missing = []
for name in (".dockerignore", "deploy/docker/Dockerfile.dockerignore"):
    allowed = {l.strip() for l in (root / name).read_text(encoding="utf-8").splitlines()}
    for f in folders:
        if f"!{f}/" not in allowed:
            missing.append(f"{name}: '!{f}/' is missing (CMakeLists.txt adds {f}/)")
for m in missing:
    print(m)
print(f"docker_context_check: {len(folders)} folders, {len(missing)} missing entries")
sys.exit(1 if missing else 0)
