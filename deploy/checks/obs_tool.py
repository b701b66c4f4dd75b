#!/usr/bin/env python3
"""Helpers of the observability checks (deploy/checks/obs_static.sh, obs_live.sh).

  obs_tool.py lint-dashboard DASHBOARD_JSON
      Structure of the Grafana dashboard: unique ids and titles, panels on the 24-column grid
      without overlaps, the datasource/job/instance variables, every query on ${datasource},
      every selector filtered by job and instance, and the panels the observability issue
      requires.
  obs_tool.py promql-rules DASHBOARD_JSON OUT
      Writes a Prometheus rule file with one recording rule per dashboard query (Grafana
      variables substituted), so that `promtool check rules OUT` parses every query.
  obs_tool.py exprs DASHBOARD_JSON
      Prints the dashboard's queries, variables substituted, as JSON [{"where", "expr"}].
  obs_tool.py prom-config --mode check|live CONFIG OUT [--targets FILE] [--drop-k8s]
      Rewrites prometheus.yml for a promtool or Prometheus without kubernetes_sd (Debian
      builds it without): check mode replaces each kubernetes_sd_configs block by a
      placeholder static target (its relabel_configs are still validated); live mode drops
      the kubernetes_sd jobs, points file_sd at --targets and scrapes every second. Relative
      rule_files and file_sd paths become absolute.
  obs_tool.py metric-names --dashboard D --rules R --metrics FILE...
      Every metric name the dashboard queries and the alert rules read must be exported by
      one of the /metrics FILEs (text exposition format); fails listing the missing ones.
      The CUDA workers' device K/V series (DEVICE_ONLY_RE) are not required.
  obs_tool.py prom-eval --url URL --dashboard D --job JOB --targets N [--timeout S]
      Against a Prometheus server scraping a cluster: waits until N targets of JOB are up,
      then every dashboard query (with $job=JOB) must succeed and return series (one that
      reads only the CUDA workers' device K/V series may be empty), the
      job/instance variables must list JOB, and every rule must evaluate with health ok.

Needs python3 and PyYAML (python3-yaml, a dependency of yamllint, which tools/setup.sh
installs).
"""
import argparse
import copy
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

try:
    import yaml
except ImportError:  # pragma: no cover
    sys.exit("obs_tool.py: needs PyYAML (Debian package python3-yaml; tools/setup.sh installs yamllint, which pulls it in)")

# ---------------------------------------------------------------------------------------------
# PromQL scanning (enough of the grammar to find metric names; promtool does the real parse)

AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
}
KEYWORDS = AGGREGATIONS | {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "atan2", "inf", "nan", "start", "end",
}
IGNORED_NAMES = {"up"}  # synthesized by Prometheus per target, never exported
# Exported only by workers on the CUDA backend (--device cuda: its device K/V block pools,
# worker/kv_metrics.h); the clusters the live check runs are on the CPU, so these are not
# required to be exported there, and a query that reads only these may return no series.
DEVICE_ONLY_RE = re.compile(r"dgserve_(prefill|denoise)_device_kv_\w+")

GRAFANA_INTERVALS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}


def substitute_grafana_vars(expr):
    """$__rate_interval and friends become durations; other variables ($job, ${instance})
    become .* (they only appear inside regex matchers)."""
    def repl(m):
        name = m.group(1) or m.group(2)
        return GRAFANA_INTERVALS.get(name, ".*")
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
NUMBER_RE = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d[\w.]*(?:[eE][+-]?\d+)?)")
IDENT_RE = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _strip(expr):
    s = STRING_RE.sub('""', expr)
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range vectors and subqueries
    s = GROUPING_RE.sub(" ", s)
    return s


def metric_names(expr):
    """Metric names an expression reads (selectors' names; `{__name__=...}` selectors are
    returned by name_regexes instead)."""
    s = _strip(expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = NUMBER_RE.sub(" ", s)
    names = []
    for m in IDENT_RE.finditer(s):
        word = m.group(0)
        rest = s[m.end():].lstrip()
        if rest.startswith("("):
            continue  # a function or an aggregation
        if word in KEYWORDS:
            continue
        names.append(word)
    return names


def name_regexes(expr):
    """The regexes of `{__name__=~"..."}` matchers (and `__name__="..."` literals)."""
    out = []
    for m in re.finditer(r'__name__\s*(=~|=)\s*"((?:[^"\\]|\\.)*)"', expr):
        out.append(m.group(2) if m.group(1) == "=~" else re.escape(m.group(2)))
    return out


def selectors(expr):
    """(name, matchers) of every vector selector: `name{...}`, bare `name`, `{...}`."""
    s = STRING_RE.sub(lambda m: "\0" * len(m.group(0)), expr)  # keep offsets, hide strings
    s = re.sub(r"\[[^\]]*\]", lambda m: " " * len(m.group(0)), s)
    s = GROUPING_RE.sub(lambda m: " " * len(m.group(0)), s)
    s = NUMBER_RE.sub(lambda m: " " * len(m.group(0)), s)
    out = []
    i = 0
    while i < len(s):
        m = IDENT_RE.match(s, i)
        if m and (i == 0 or not (s[i - 1].isalnum() or s[i - 1] in "_:")):
            word = m.group(0)
            j = m.end()
            k = j
            while k < len(s) and s[k] == " ":
                k += 1
            if k < len(s) and s[k] == "(" or word in KEYWORDS:
                i = j
                continue
            if k < len(s) and s[k] == "{":
                end = s.index("}", k)
                out.append((word, expr[k + 1:end]))
                i = end + 1
            else:
                out.append((word, None))
                i = j
            continue
        if s[i] == "{":
            end = s.index("}", i)
            out.append((None, expr[i + 1:end]))
            i = end + 1
            continue
        i += 1
    return out


# ---------------------------------------------------------------------------------------------
# the dashboard

def load_dashboard(path):
    with open(path) as f:
        return json.load(f)


def label_values_selector(query):
    """The selector of a Grafana `label_values(selector, label)` variable query, or None."""
    m = re.fullmatch(r"\s*label_values\(\s*(.*?)\s*,\s*\w+\s*\)\s*", query, re.S)
    if m:
        return m.group(1)
    return None


def dashboard_queries(d):
    """[(where, raw_expr)] of every panel target and Prometheus query variable."""
    out = []
    for p in d.get("panels", []):
        inner = p.get("panels", []) if p.get("type") == "row" else []
        for panel in [p] + inner:
            for t in panel.get("targets", []) or []:
                if "expr" in t:
                    out.append((f'panel {panel.get("id")} "{panel.get("title")}" {t.get("refId")}', t["expr"]))
    for v in d.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            if isinstance(q, dict):
                q = q.get("query", "")
            sel = label_values_selector(q or "")
            if sel:
                out.append((f'variable ${v.get("name")}', sel))
    return out


REQUIRED = [
    # (what, predicate over (panel, exprs)) — the panels the observability issue asks for.
    ("request rate by status", lambda p, e: "dgserve_gateway_requests_total" in e and "by (status)" in e),
    ("error ratio", lambda p, e: 'status!="OK"' in e),
    ("TTFT prefill stage p50/p95", lambda p, e: "dgserve_gateway_prefill_duration_seconds_bucket" in e and "histogram_quantile(0.95" in e),
    ("TTFT first canvas step p95", lambda p, e: "dgserve_gateway_time_to_first_step_seconds_bucket" in e and "histogram_quantile(0.95" in e),
    ("TTFT first committed block p95", lambda p, e: "dgserve_gateway_time_to_first_block_seconds_bucket" in e and "histogram_quantile(0.95" in e),
    ("TTFT p50", lambda p, e: "dgserve_gateway_time_to_first_block_seconds_bucket" in e and "histogram_quantile(0.5" in e),
    ("steps-per-canvas heatmap", lambda p, e: p.get("type") == "heatmap" and "steps_per_canvas_bucket" in e),
    ("canvas latency", lambda p, e: "dgserve_denoise_canvas_duration_seconds_bucket" in e),
    ("output tokens/s", lambda p, e: "dgserve_denoise_output_tokens_total" in e),
    ("active canvases", lambda p, e: "dgserve_denoise_active_canvases" in e),
    ("queue depth (prefill and denoise)", lambda p, e: "dgserve_prefill_queue_depth" in e and "dgserve_denoise_queue_depth" in e),
    ("KV blocks used/free", lambda p, e: "dgserve_denoise_kv_blocks" in e and "by (instance, state)" in e),
    ("prefix-cache hit rate", lambda p, e: "dgserve_prefill_prefix_cache_hits_total" in e and "dgserve_prefill_prefix_cache_queries_total" in e),
    ("KV transfer bytes/s by transport", lambda p, e: "dgserve_prefill_kv_transfer_bytes_total" in e and "by (transport)" in e),
    ("KV transfer failures by transport", lambda p, e: "dgserve_prefill_kv_transfer_failures_total" in e and "by (transport)" in e),
    ("HTTP open connections and streams", lambda p, e: "dgserve_gateway_http_open_connections" in e and "dgserve_gateway_http_open_streams" in e),
    ("admission queue depth", lambda p, e: "dgserve_gateway_queued_requests" in e),
    ("admission queue time p95", lambda p, e: "dgserve_gateway_queue_duration_seconds_bucket" in e and "histogram_quantile(0.95" in e),
    ("resumes", lambda p, e: "dgserve_gateway_resumes_total" in e),
]


def lint_dashboard(d):
    errors = []
    panels = d.get("panels", [])
    ids, titles = {}, {}
    cells = {}
    for p in panels:
        pid, title = p.get("id"), p.get("title")
        if pid in ids:
            errors.append(f"panel id {pid} used twice ({ids[pid]!r} and {title!r})")
        ids[pid] = title
        if p.get("type") != "row":
            if title in titles:
                errors.append(f"panel title {title!r} used twice")
            titles[title] = pid
        g = p.get("gridPos") or {}
        if not all(isinstance(g.get(k), int) for k in ("x", "y", "w", "h")):
            errors.append(f"panel {pid} {title!r} has no complete gridPos")
            continue
        if g["x"] < 0 or g["w"] < 1 or g["x"] + g["w"] > 24:
            errors.append(f"panel {pid} {title!r} is off the 24-column grid: {g}")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    errors.append(f"panel {pid} {title!r} overlaps panel {cells[(x, y)]}")
                    break
                cells[(x, y)] = pid
            else:
                continue
            break
        if p.get("type") == "row":
            if p.get("panels"):
                errors.append(f"row {title!r} is collapsed-style (panels inside); keep rows open")
            continue
        if (p.get("datasource") or {}).get("uid") != "${datasource}":
            errors.append(f"panel {pid} {title!r} does not use the ${{datasource}} variable")
        targets = p.get("targets") or []
        if not targets:
            errors.append(f"panel {pid} {title!r} has no queries")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs):
            errors.append(f"panel {pid} {title!r} repeats a refId: {refs}")
        for t in targets:
            if (t.get("datasource") or {}).get("uid") != "${datasource}":
                errors.append(f"panel {pid} {title!r} query {t.get('refId')} does not use ${{datasource}}")
            expr = t.get("expr", "")
            if not expr.strip():
                errors.append(f"panel {pid} {title!r} query {t.get('refId')} is empty")
            for name, matchers in selectors(expr):
                if matchers is None or 'job=~"$job"' not in matchers or 'instance=~"$instance"' not in matchers:
                    errors.append(f'panel {pid} {title!r} query {t.get("refId")}: selector {name or ""}{{{matchers or ""}}} '
                                  'lacks job=~"$job" / instance=~"$instance"')
    variables = {v.get("name"): v for v in d.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        errors.append("no `datasource` variable of type datasource for prometheus")
    for name in ("job", "instance"):
        v = variables.get(name)
        if not v or v.get("type") != "query" or (v.get("datasource") or {}).get("uid") != "${datasource}":
            errors.append(f"no `{name}` query variable on ${{datasource}}")
    for what, pred in REQUIRED:
        if not any(pred(p, " ".join(t.get("expr", "") for t in p.get("targets") or []))
                   for p in panels if p.get("type") != "row"):
            errors.append(f"no panel shows: {what}")
    return errors


# ---------------------------------------------------------------------------------------------
# prometheus.yml rewrites

K8S_ROLES = {"node", "service", "pod", "endpoints", "endpointslice", "ingress"}


def rewrite_prom_config(cfg_path, mode, targets=None, drop_k8s=False):
    base = os.path.dirname(os.path.abspath(cfg_path))
    with open(cfg_path) as f:
        cfg = yaml.safe_load(f)
    out = copy.deepcopy(cfg)
    notes = []
    absolute = lambda p: p if os.path.isabs(p) else os.path.join(base, p)
    out["rule_files"] = [absolute(p) for p in cfg.get("rule_files", []) or []]
    jobs = []
    for sc in out.get("scrape_configs", []) or []:
        if "kubernetes_sd_configs" in sc:
            for sd in sc["kubernetes_sd_configs"]:
                if sd.get("role") not in K8S_ROLES:
                    raise SystemExit(f"obs_tool.py: job {sc['job_name']}: kubernetes_sd role {sd.get('role')!r} is not one of {sorted(K8S_ROLES)}")
            if mode == "live" or drop_k8s:
                notes.append(f"dropped the kubernetes_sd job {sc['job_name']}")
                continue
            del sc["kubernetes_sd_configs"]
            sc["static_configs"] = [{"targets": ["kubernetes-sd.invalid:80"]}]
            notes.append(f"job {sc['job_name']}: kubernetes_sd_configs replaced by a placeholder static target "
                         "(its relabel_configs are still checked)")
        for fsd in sc.get("file_sd_configs", []) or []:
            if mode == "live" and targets:
                fsd["files"] = [os.path.abspath(targets)]
                fsd["refresh_interval"] = "1s"
            else:
                fsd["files"] = [absolute(p) for p in fsd.get("files", [])]
        jobs.append(sc)
    out["scrape_configs"] = jobs
    if mode == "live":
        g = out.setdefault("global", {})
        g["scrape_interval"] = g["scrape_timeout"] = g["evaluation_interval"] = "1s"
    return out, notes


# ---------------------------------------------------------------------------------------------
# exported metrics

def exported_metrics(paths):
    samples, families = set(), {}
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                if line.startswith("# TYPE "):
                    parts = line.split()
                    if len(parts) >= 4:
                        families[parts[2]] = parts[3]
                    continue
                if line.startswith("#"):
                    continue
                m = IDENT_RE.match(line)
                if m:
                    samples.add(m.group(0))
    return samples, families


def base_name(name):
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def rule_exprs(rules_path):
    with open(rules_path) as f:
        doc = yaml.safe_load(f)
    out = []
    for g in doc.get("groups", []):
        for r in g.get("rules", []):
            out.append((f'rule {r.get("alert") or r.get("record")}', str(r.get("expr", ""))))
    return out


def check_metric_names(dashboard_path, rules_path, metric_files):
    samples, families = exported_metrics(metric_files)
    queries = [(w, substitute_grafana_vars(e)) for w, e in dashboard_queries(load_dashboard(dashboard_path))]
    queries += rule_exprs(rules_path)
    referenced = {}  # name -> [where]
    regexes = []
    for where, expr in queries:
        for name in metric_names(expr):
            if name not in IGNORED_NAMES and not DEVICE_ONLY_RE.fullmatch(name):
                referenced.setdefault(name, []).append(where)
        for rx in name_regexes(expr):
            regexes.append((where, rx))
    missing = []
    for name, wheres in sorted(referenced.items()):
        b = base_name(name)
        ok = name in samples or name in families or (
            b != name and families.get(b) in ("histogram", "summary") and (name in samples or name.endswith(("_sum", "_count"))))
        if not ok:
            missing.append((name, wheres))
    bad_regexes = []
    for where, rx in regexes:
        if not any(re.fullmatch(rx, s) for s in samples):
            bad_regexes.append((where, rx))
    bases = sorted({base_name(n) for n in referenced})
    print(f"obs_tool.py: {len(queries)} expressions reference {len(bases)} metrics: {', '.join(bases)}")
    unused = sorted(f for f in families if f.startswith("dgserve_") and f not in {base_name(n) for n in referenced})
    if unused:
        print(f"obs_tool.py: exported but not on the dashboard or in a rule (informational): {', '.join(unused)}")
    for name, wheres in missing:
        print(f"MISSING: {name} (base {base_name(name)}) is not exported; read by: {'; '.join(sorted(set(wheres)))}")
    for where, rx in bad_regexes:
        print(f'MISSING: {where}: __name__=~"{rx}" matches no exported metric')
    return 1 if missing or bad_regexes else 0



# ---------------------------------------------------------------------------------------------
# a live Prometheus server

def prom_get(url, path, params=None, timeout=10):
    q = ("?" + urllib.parse.urlencode(params)) if params else ""
    with urllib.request.urlopen(f"{url}{path}{q}", timeout=timeout) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{path}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def prom_query(url, expr):
    data = urllib.parse.urlencode({"query": expr}).encode()
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query", data=data, timeout=10) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:  # 400/422: a bad query; the body says why
        body = json.load(e)
    if body.get("status") != "success":
        raise RuntimeError(f"{body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]


def prom_eval(url, dashboard_path, job, want_targets, timeout):
    deadline = time.monotonic() + timeout
    errors = []
    # 1. the targets of the job are up, and scraped a few times (rate() needs two samples)
    up = []
    while time.monotonic() < deadline:
        try:
            up = [r for r in prom_query(url, f'up{{job="{job}"}} == 1')]
        except (OSError, RuntimeError):
            up = []
        if len(up) >= want_targets:
            break
        time.sleep(0.5)
    if len(up) < want_targets:
        targets = prom_get(url, "/api/v1/targets")
        return [f"only {len(up)} of {want_targets} targets of job {job} are up: "
                + json.dumps([(t.get('scrapeUrl'), t.get('health'), t.get('lastError')) for t in targets.get('activeTargets', [])])]
    print(f"obs_tool.py: {len(up)} targets of job {job} up: "
          + ", ".join(f"{r['metric'].get('instance')} ({r['metric'].get('component')})" for r in up))
    time.sleep(3)
    # 2. every dashboard query succeeds and returns series
    d = load_dashboard(dashboard_path)
    empty = 0
    for where, raw in dashboard_queries(d):
        expr = raw.replace("$job", job).replace("${job}", job)
        expr = substitute_grafana_vars(expr)
        try:
            result = prom_query(url, expr)
        except (OSError, RuntimeError) as e:
            errors.append(f"{where}: query failed: {e}: {expr}")
            continue
        if not result:
            empty += 1
            names = metric_names(raw)
            if names and all(DEVICE_ONLY_RE.fullmatch(n) for n in names):
                print(f"obs_tool.py: {where}: no series (reads only CUDA-worker metrics)")
                continue
            errors.append(f"{where}: no series (a metric or label that does not match): {expr}")
    print(f"obs_tool.py: {len(dashboard_queries(d))} dashboard queries evaluated, {empty} empty")
    # 3. the job and instance variables list the cluster
    for v in d.get("templating", {}).get("list", []):
        if v.get("type") != "query":
            continue
        query = v.get("query") if isinstance(v.get("query"), str) else v["query"].get("query", "")
        sel = label_values_selector(query)
        if not sel:
            continue
        label = re.search(r",\s*(\w+)\s*\)\s*$", query).group(1)
        sel = substitute_grafana_vars(sel.replace("$job", job))
        values = sorted({s.get(label) for s in prom_get(url, "/api/v1/series", {"match[]": sel}) if s.get(label)})
        if not values or (label == "job" and job not in values):
            errors.append(f"variable ${v.get('name')}: label_values({sel}, {label}) gives {values}")
        else:
            print(f"obs_tool.py: variable ${v.get('name')} lists {values}")
    # 4. every rule evaluated, health ok
    while True:
        groups = prom_get(url, "/api/v1/rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("health") in ("ok", "err") for r in rules):  # "unknown" until evaluated
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if not rules:
        errors.append("Prometheus loaded no rules")
    for r in rules:
        if r.get("health") != "ok":
            errors.append(f"rule {r.get('name')}: health {r.get('health')}: {r.get('lastError')}")
    states = ", ".join(f"{r.get('name')}={r.get('state', '-')}" for r in rules)
    print(f"obs_tool.py: {len(rules)} rules evaluated: {states}")
    return errors

# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("lint-dashboard"); p.add_argument("dashboard")
    p = sub.add_parser("promql-rules"); p.add_argument("dashboard"); p.add_argument("out")
    p = sub.add_parser("exprs"); p.add_argument("dashboard")
    p = sub.add_parser("prom-config")
    p.add_argument("--mode", choices=["check", "live"], required=True)
    p.add_argument("--targets"); p.add_argument("--drop-k8s", action="store_true")
    p.add_argument("config"); p.add_argument("out")
    p = sub.add_parser("metric-names")
    p.add_argument("--dashboard", required=True); p.add_argument("--rules", required=True)
    p.add_argument("--metrics", nargs="+", required=True)
    p = sub.add_parser("prom-eval")
    p.add_argument("--url", required=True); p.add_argument("--dashboard", required=True)
    p.add_argument("--job", required=True); p.add_argument("--targets", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60)
    a = ap.parse_args()

    if a.cmd == "lint-dashboard":
        errors = lint_dashboard(load_dashboard(a.dashboard))
        for e in errors:
            print(f"LINT: {e}")
        if not errors:
            n = sum(1 for p in load_dashboard(a.dashboard)["panels"] if p.get("type") != "row")
            print(f"obs_tool.py: dashboard lint clean ({n} panels, every requirement present)")
        return 1 if errors else 0
    if a.cmd in ("promql-rules", "exprs"):
        queries = [(w, substitute_grafana_vars(e)) for w, e in dashboard_queries(load_dashboard(a.dashboard))]
        if a.cmd == "exprs":
            json.dump([{"where": w, "expr": e} for w, e in queries], sys.stdout, indent=1)
            print()
            return 0
        rules = [{"record": f"dashboard:query_{i}", "expr": e, "labels": {"where": w}} for i, (w, e) in enumerate(queries)]
        with open(a.out, "w") as f:
            yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}, f, sort_keys=False, width=1000)
        print(f"obs_tool.py: wrote {len(rules)} dashboard queries as recording rules to {a.out}")
        return 0
    if a.cmd == "prom-config":
        out, notes = rewrite_prom_config(a.config, a.mode, a.targets, a.drop_k8s)
        with open(a.out, "w") as f:
            yaml.safe_dump(out, f, sort_keys=False)
        for n in notes:
            print(f"obs_tool.py: {n}")
        return 0
    if a.cmd == "metric-names":
        return check_metric_names(a.dashboard, a.rules, a.metrics)
    if a.cmd == "prom-eval":
        errors = prom_eval(a.url.rstrip("/"), a.dashboard, a.job, a.targets, a.timeout)
        for e in errors:
            print(f"FAIL: {e}")
        return 1 if errors else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
