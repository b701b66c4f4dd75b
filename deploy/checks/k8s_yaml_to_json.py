#!/usr/bin/env python3
"""YAML → JSON for deploy/checks/k8s_check.sh, and comparison of two kustomize builds.

  k8s_yaml_to_json.py IN.yaml OUT.json   every document of IN as one JSON array
  k8s_yaml_to_json.py --compare A.yaml B.yaml
      exits 1 (printing the first differences) unless A and B hold the same objects, ignoring
      document order, empty labels/annotations and the hash suffix of generated ConfigMap names
      (kustomize v2 and v5 hash differently)

Uses python3-yaml (a dependency of Debian's yamllint). Kubernetes YAML is YAML 1.2 (Go's yaml
library); PyYAML speaks YAML 1.1, whose implicit types differ (yes/no/on/off booleans, 1:30
sexagesimal integers, timestamps), so the loader below resolves only the YAML 1.2 core schema.
"""
import json
import re
import sys

import yaml


class CoreLoader(yaml.SafeLoader):
    """SafeLoader with the implicit scalars of the YAML 1.2 core schema only."""


CoreLoader.yaml_implicit_resolvers = {}
for tag, regexp, first in [
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^[-+]?[0-9]+$", "-+0123456789"),
    ("tag:yaml.org,2002:float",
     r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
     "-+0123456789."),
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
]:
    CoreLoader.add_implicit_resolver(tag, re.compile(regexp), list(first))


def load(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.load_all(f, Loader=CoreLoader) if d is not None]


HASHED = re.compile(r"^(dgserve-[a-z-]+)-[a-z0-9]{10}$")


def normalize(value):
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in ("labels", "annotations") and v == {}:
                continue
            out[k] = normalize(v)
        return out
    if isinstance(value, list):
        return [normalize(v) for v in value]
    if isinstance(value, str):
        return HASHED.sub(r"\1-HASH", value)
    return value


def compare(a_path, b_path):
    def keyed(path):
        objs = {}
        for o in load(path):
            o = normalize(o)
            key = f'{o.get("kind")}/{o.get("metadata", {}).get("name")}'
            objs[key] = json.dumps(o, sort_keys=True, indent=1)
        return objs

    a, b = keyed(a_path), keyed(b_path)
    problems = []
    for key in sorted(set(a) | set(b)):
        if key not in a:
            problems.append(f"only in {b_path}: {key}")
        elif key not in b:
            problems.append(f"only in {a_path}: {key}")
        elif a[key] != b[key]:
            al, bl = a[key].splitlines(), b[key].splitlines()
            first = next((i for i in range(min(len(al), len(bl))) if al[i] != bl[i]), min(len(al), len(bl)))
            problems.append(f"{key} differs near: {al[first:first + 3]} vs {bl[first:first + 3]}")
    for p in problems:
        print(p)
    return 1 if problems else 0


def main(argv):
    if len(argv) == 4 and argv[1] == "--compare":
        return compare(argv[2], argv[3])
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(load(argv[1]), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
