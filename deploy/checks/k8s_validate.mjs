// Validates the built kustomize output of deploy/k8s (deploy/checks/k8s_check.sh converts each
// build to JSON first):
//   node deploy/checks/k8s_validate.mjs [--build-dir DIR] PROFILE=FILE.json ...
// PROFILE is base, cpu or gpu (each has its own assertions below). Every object is validated
// against its schema with the npm kubernetes-models (ServiceMonitor: @kubernetes-models/
// prometheus-operator), loaded from third_party/npm/node_modules; an apiVersion/kind they do not
// know fails. Then the cross-references: Service / PDB / NetworkPolicy / ServiceMonitor / HPA
// targets, probe and Service ports, ConfigMap, volume and $(VAR) references, security settings,
// the drain timing, and (with --build-dir holding the binaries) every --flag the manifests pass.
import { execFileSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '../..');
const NPM = join(ROOT, 'third_party/npm');
const require = createRequire(join(NPM, 'package.json'));

const problems = [];
let current = '';
function fail(msg) {
  problems.push(`${current}: ${msg}`);
}
function check(cond, msg) {
  if (!cond) fail(msg);
  return Boolean(cond);
}

// ---- schema models --------------------------------------------------------------------------
const promOperatorDir = join(NPM, 'node_modules/@kubernetes-models/prometheus-operator');
// The package is ESM-only with an exports map; import its files directly.
const promOperator = {
  'monitoring.coreos.com/v1': await import(pathToFileURL(join(promOperatorDir, 'monitoring.coreos.com/v1/index.js')).href),
};

function modelClass(apiVersion, kind) {
  if (promOperator[apiVersion]) return promOperator[apiVersion][kind];
  if (!/^([a-z0-9.-]+\/)?v[0-9a-z]+$/.test(apiVersion || '')) return undefined;
  let mod;
  try {
    mod = require(`kubernetes-models/${apiVersion}`); // "v1" (core) or "group/version"
  } catch {
    return undefined;
  }
  return mod[kind];
}

// ---- helpers --------------------------------------------------------------------------------
const name = (o) => o?.metadata?.name;
const id = (o) => `${o.kind}/${name(o)}`;
function labelsMatch(selector, labels) {
  // selector: {matchLabels, matchExpressions} (LabelSelector) or a plain map (Service)
  if (!selector) return false;
  const plain = !('matchLabels' in selector) && !('matchExpressions' in selector);
  const matchLabels = plain ? selector : selector.matchLabels || {};
  for (const [k, v] of Object.entries(matchLabels)) if (labels?.[k] !== v) return false;
  for (const e of plain ? [] : selector.matchExpressions || []) {
    const has = labels && e.key in labels;
    if (e.operator === 'In' && !(has && e.values.includes(labels[e.key]))) return false;
    if (e.operator === 'NotIn' && has && e.values.includes(labels[e.key])) return false;
    if (e.operator === 'Exists' && !has) return false;
    if (e.operator === 'DoesNotExist' && has) return false;
  }
  return true;
}
const podLabels = (d) => d.spec?.template?.metadata?.labels || {};
const podSpec = (d) => d.spec?.template?.spec || {};
const containers = (d) => podSpec(d).containers || [];
const initContainers = (d) => podSpec(d).initContainers || [];
const allPorts = (d) => containers(d).flatMap((c) => c.ports || []);
const component = (d) => podLabels(d)['app.kubernetes.io/component'];
function portIn(ports, port) {
  // a port given by name or number, among container ports
  return ports.some((p) => (typeof port === 'number' ? p.containerPort === port : p.name === port));
}
function parseQuantity(q) {
  if (q === undefined) return undefined;
  const m = /^([0-9.]+)([a-zA-Z]*)$/.exec(String(q));
  if (!m) return NaN;
  const mult = { '': 1, m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40 }[m[2]];
  return mult === undefined ? NaN : Number(m[1]) * mult;
}

// Flags each binary accepts, from its --help (when the build directory has it).
const BINARIES = {
  'dgserve-gateway': 'gateway/dgserve-gateway',
  'dgserve-prefill-worker': 'prefill_worker/dgserve-prefill-worker',
  'dgserve-denoise-worker': 'denoise_worker/dgserve-denoise-worker',
  'dgserve-mkmodel': 'tools/dgserve-mkmodel',
};
const flagCache = new Map();
function knownFlags(buildDir, binary) {
  if (!buildDir || !BINARIES[binary]) return undefined;
  if (!flagCache.has(binary)) {
    const path = join(buildDir, BINARIES[binary]);
    let flags;
    if (existsSync(path)) {
      let out = '';
      try {
        out = execFileSync(path, ['--help'], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
      } catch (e) {
        out = `${e.stdout || ''}${e.stderr || ''}`; // absl's --help exits 1
      }
      flags = new Set([...out.matchAll(/^\s+--([A-Za-z0-9_]+) \(/gm)].map((m) => m[1]));
      if (flags.size === 0) flags = undefined;
    }
    flagCache.set(binary, flags);
  }
  return flagCache.get(binary);
}

// ---- the checks of one build ----------------------------------------------------------------
// NCCL's sockets between the GPU workers (overlays/gpu/networkpolicy-nccl.yaml).
const NCCL_PORTS = 'tcp:50100-50999';

async function validateBuild(profile, objects, buildDir) {
  const byKind = (kind) => objects.filter((o) => o.kind === kind);
  const deployments = byKind('Deployment');
  const services = byKind('Service');
  const configMaps = byKind('ConfigMap');
  const pvcs = byKind('PersistentVolumeClaim');
  const seen = new Set();
  const namespaces = new Set();

  // 1. schema of every object; unique names; one namespace
  for (const o of objects) {
    current = `${profile} ${id(o)}`;
    const Model = modelClass(o.apiVersion, o.kind);
    if (!check(Model, `unknown apiVersion/kind ${o.apiVersion} ${o.kind} (not in kubernetes-models or @kubernetes-models/prometheus-operator)`)) continue;
    try {
      new Model(o).validate();
    } catch (e) {
      fail(`schema: ${e.message}`);
    }
    check(name(o), 'no metadata.name');
    check(!seen.has(id(o)), 'defined twice');
    seen.add(id(o));
    if (o.kind !== 'Namespace') {
      if (check(o.metadata?.namespace, 'no namespace (kustomize dropped it?)')) namespaces.add(o.metadata.namespace);
    }
  }
  current = profile;
  check(namespaces.size === 1, `objects spread over namespaces ${[...namespaces].join(', ')}`);
  const ns = [...namespaces][0];
  const nsObject = byKind('Namespace')[0];
  check(nsObject && name(nsObject) === ns, `the Namespace object (${name(nsObject)}) is not the objects' namespace (${ns})`);

  const configByName = new Map(configMaps.map((c) => [name(c), c]));
  const dgConfig = configMaps.find((c) => /^dgserve-config(-[a-z0-9]+)?$/.test(name(c)));
  check(dgConfig, 'no dgserve-config ConfigMap');
  const drainGrace = Number(dgConfig?.data?.DGSERVE_DRAIN_GRACE_SECONDS);
  check(drainGrace > 0, `DGSERVE_DRAIN_GRACE_SECONDS is ${dgConfig?.data?.DGSERVE_DRAIN_GRACE_SECONDS}`);

  // 2. Deployments
  const expected = ['gateway', 'prefill', 'denoise'];
  for (const c of expected) check(deployments.some((d) => component(d) === c), `no ${c} Deployment`);
  for (const d of deployments) {
    current = `${profile} ${id(d)}`;
    const spec = podSpec(d);
    check(labelsMatch(d.spec?.selector, podLabels(d)), 'spec.selector does not match the pod template labels');
    const psc = spec.securityContext || {};
    check(psc.runAsNonRoot === true, 'pod securityContext.runAsNonRoot is not true');
    check(psc.runAsUser !== undefined && psc.runAsUser !== 0, 'pod securityContext.runAsUser is unset or 0');
    check(psc.seccompProfile?.type === 'RuntimeDefault', 'pod seccompProfile is not RuntimeDefault');
    check(spec.automountServiceAccountToken === false, 'automountServiceAccountToken is not false');
    const volumes = new Map((spec.volumes || []).map((v) => [v.name, v]));
    for (const v of volumes.values()) {
      if (v.persistentVolumeClaim) {
        check(pvcs.some((p) => name(p) === v.persistentVolumeClaim.claimName), `volume ${v.name}: no PVC ${v.persistentVolumeClaim.claimName}`);
        check(!v.persistentVolumeClaim.readOnly, `volume ${v.name}: readOnly on the volume would stop the init container from writing; set it on the mounts`);
      }
      if (v.configMap) check(configByName.has(v.configMap.name), `volume ${v.name}: no ConfigMap ${v.configMap.name}`);
    }
    const modelVolume = [...volumes.values()].find((v) => v.persistentVolumeClaim?.claimName === 'dgserve-model');
    check(modelVolume, 'no volume of the PVC dgserve-model');

    for (const [isInit, ctr] of [...initContainers(d).map((c) => [true, c]), ...containers(d).map((c) => [false, c])]) {
      current = `${profile} ${id(d)} ${isInit ? 'initContainer' : 'container'} ${ctr.name}`;
      const ports = ctr.ports || [];
      check(ctr.image, 'no image');
      const res = ctr.resources || {};
      for (const r of ['cpu', 'memory']) {
        check(res.requests?.[r] !== undefined, `no resources.requests.${r}`);
        check(res.limits?.[r] !== undefined, `no resources.limits.${r}`);
        if (res.requests?.[r] !== undefined && res.limits?.[r] !== undefined) {
          check(parseQuantity(res.requests[r]) <= parseQuantity(res.limits[r]), `requests.${r} ${res.requests[r]} above limits.${r} ${res.limits[r]}`);
        }
      }
      for (const [r, v] of Object.entries(res.limits || {})) {
        if (r.includes('/')) check(res.requests?.[r] === undefined || String(res.requests[r]) === String(v), `extended resource ${r}: requests must equal limits`);
      }
      const sc = ctr.securityContext || {};
      check(sc.allowPrivilegeEscalation === false, 'allowPrivilegeEscalation is not false');
      check(sc.readOnlyRootFilesystem === true, 'readOnlyRootFilesystem is not true');
      check((sc.capabilities?.drop || []).includes('ALL'), 'capabilities.drop lacks ALL');
      if (sc.runAsUser !== undefined) check(sc.runAsUser !== 0, 'runs as root');

      // environment: envFrom / configMapKeyRef / resourceFieldRef targets, $(VAR) references
      const envNames = new Set((ctr.env || []).map((e) => e.name));
      for (const ef of ctr.envFrom || []) {
        if (ef.configMapRef) {
          const cm = configByName.get(ef.configMapRef.name);
          if (check(cm, `envFrom: no ConfigMap ${ef.configMapRef.name}`)) {
            for (const k of Object.keys(cm.data || {})) envNames.add(`${ef.prefix || ''}${k}`);
          }
        }
      }
      for (const e of ctr.env || []) {
        const ref = e.valueFrom?.configMapKeyRef;
        if (ref) check(configByName.get(ref.name)?.data?.[ref.key] !== undefined, `env ${e.name}: no key ${ref.key} in ConfigMap ${ref.name}`);
        const rf = e.valueFrom?.resourceFieldRef;
        if (rf) {
          check(!rf.containerName || rf.containerName === ctr.name, `env ${e.name}: resourceFieldRef names container ${rf.containerName}`);
          const [kind, res2] = rf.resource.split('.');
          check(ctr.resources?.[kind]?.[res2] !== undefined, `env ${e.name}: ${rf.resource} is not set`);
        }
      }
      for (const arg of [...(ctr.command || []), ...(ctr.args || [])]) {
        // Kubernetes rewrites $(VAR) and $$ in command/args before any shell sees them
        check(!arg.includes('$$'), `"$$" in command/args: Kubernetes turns it into "$"`);
        for (const m of arg.matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
          check(envNames.has(m[1]), `$(${m[1]}) in command/args is not defined by env or envFrom (it would stay literal)`);
        }
      }
      // flags against the binary's --help
      const bin = (ctr.command || [])[0];
      const flags = knownFlags(buildDir, bin);
      if (flags) {
        for (const arg of ctr.args || []) {
          const m = /^--([A-Za-z0-9_]+)/.exec(arg);
          if (m) check(flags.has(m[1]), `${bin} has no flag --${m[1]}`);
        }
      }
      for (const arg of ctr.args || []) {
        // shell scripts: the flags after dgserve-mkmodel
        const sm = /dgserve-mkmodel([^\n]*(?:\\\n[^\n]*)*)/.exec(arg);
        const mkflags = knownFlags(buildDir, 'dgserve-mkmodel');
        if (sm && mkflags) {
          for (const m of sm[1].matchAll(/--([A-Za-z0-9_]+)/g)) check(mkflags.has(m[1]), `dgserve-mkmodel has no flag --${m[1]}`);
        }
      }
      // mounts
      for (const vm of ctr.volumeMounts || []) {
        check(volumes.has(vm.name), `volumeMount ${vm.name}: no such volume`);
        if (!isInit && modelVolume && vm.name === modelVolume.name) check(vm.readOnly === true, 'the model volume is not mounted read-only');
      }
      if (isInit) continue;

      // probes: gRPC probes need the number of a container port, HTTP/TCP a name or number
      check(ctr.readinessProbe, 'no readinessProbe');
      check(ctr.livenessProbe, 'no livenessProbe');
      for (const kind of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
        const p = ctr[kind];
        if (!p) continue;
        const handler = p.grpc || p.httpGet || p.tcpSocket;
        if (!check(handler || p.exec, `${kind} has no handler`)) continue;
        if (handler) check(portIn(ports, handler.port), `${kind} port ${handler.port} is not a container port`);
        if (p.grpc) check(typeof p.grpc.port === 'number', `${kind}: a gRPC probe port must be a number`);
      }
      check(ports.some((p) => p.name === 'grpc'), 'no port named grpc');
      check(ports.some((p) => p.name === 'metrics'), 'no port named metrics');
      check(ctr.livenessProbe?.grpc || ctr.readinessProbe?.grpc, 'neither liveness nor readiness uses the gRPC health service');
      // drain: preStop sleep + drain grace must fit into the termination grace period
      const pre = ctr.lifecycle?.preStop?.exec?.command;
      if (check(pre && pre[0] === 'sleep', 'no preStop sleep')) {
        const sleep = Number(pre[1]);
        const tgp = spec.terminationGracePeriodSeconds ?? 30;
        check(tgp >= sleep + drainGrace + 5, `terminationGracePeriodSeconds ${tgp} < preStop ${sleep} s + drain ${drainGrace} s + 5 s`);
      }
      if (ctr.args?.some((a) => a.startsWith('--drain_grace_seconds'))) {
        check(ctr.args.includes('--drain_grace_seconds=$(DGSERVE_DRAIN_GRACE_SECONDS)'), '--drain_grace_seconds does not come from DGSERVE_DRAIN_GRACE_SECONDS');
      } else {
        fail('no --drain_grace_seconds');
      }
    }
  }

  // 3. Services: selectors, target ports, headless workers; the gateway's dns:/// targets
  for (const s of services) {
    current = `${profile} ${id(s)}`;
    const targets = deployments.filter((d) => labelsMatch(s.spec?.selector, podLabels(d)));
    if (!check(targets.length > 0, `selector ${JSON.stringify(s.spec?.selector)} matches no Deployment's pods`)) continue;
    for (const p of s.spec.ports || []) {
      const tp = p.targetPort ?? p.port;
      for (const d of targets) check(portIn(allPorts(d), tp), `port ${p.name}: targetPort ${tp} is not a container port of ${id(d)}`);
    }
    const comp = component(targets[0]);
    if (comp === 'prefill' || comp === 'denoise') check(s.spec.clusterIP === 'None', 'a worker Service must be headless (clusterIP: None)');
  }
  current = profile;
  for (const c of expected) check(services.some((s) => deployments.some((d) => component(d) === c && labelsMatch(s.spec?.selector, podLabels(d)))), `no Service for the ${c} pods`);
  const gateway = deployments.find((d) => component(d) === 'gateway');
  for (const [flag, comp] of [['--prefill_workers=', 'prefill'], ['--denoise_workers=', 'denoise']]) {
    current = `${profile} ${gateway ? id(gateway) : 'gateway'}`;
    const arg = (containers(gateway || {})[0]?.args || []).find((a) => a.startsWith(flag));
    if (!check(arg, `no ${flag}`)) continue;
    const m = /^dns:\/\/\/([a-z0-9-]+)\.\$\(POD_NAMESPACE\)\.svc\.[^:]+:([0-9]+)$/.exec(arg.slice(flag.length));
    if (!check(m, `${flag}${arg.slice(flag.length)} is not dns:///SERVICE.$(POD_NAMESPACE).svc.DOMAIN:PORT`)) continue;
    const svc = services.find((s) => name(s) === m[1]);
    if (!check(svc, `${flag}: no Service ${m[1]}`)) continue;
    check(svc.spec.clusterIP === 'None', `${flag}: Service ${m[1]} is not headless, so DNS would give one virtual IP, not every pod`);
    check((svc.spec.ports || []).some((p) => p.port === Number(m[2])), `${flag}: Service ${m[1]} has no port ${m[2]}`);
    const d = deployments.find((x) => labelsMatch(svc.spec.selector, podLabels(x)));
    check(d && component(d) === comp, `${flag}: Service ${m[1]} does not select the ${comp} pods`);
  }
  if (gateway) {
    const env = containers(gateway)[0]?.env || [];
    current = `${profile} ${id(gateway)}`;
    check(env.some((e) => e.name === 'POD_NAMESPACE' && e.valueFrom?.fieldRef?.fieldPath === 'metadata.namespace'), 'POD_NAMESPACE is not the downward-API namespace');
  }

  // 4. PodDisruptionBudgets
  for (const c of expected) {
    current = profile;
    const d = deployments.find((x) => component(x) === c);
    check(byKind('PodDisruptionBudget').some((p) => d && labelsMatch(p.spec?.selector, podLabels(d))), `no PodDisruptionBudget for the ${c} pods`);
  }
  for (const p of byKind('PodDisruptionBudget')) {
    current = `${profile} ${id(p)}`;
    check(deployments.some((d) => labelsMatch(p.spec?.selector, podLabels(d))), 'selector matches no Deployment');
    const d = deployments.find((x) => labelsMatch(p.spec?.selector, podLabels(x)));
    if (p.spec?.minAvailable !== undefined && d) check(Number(p.spec.minAvailable) < (d.spec.replicas ?? 1), `minAvailable ${p.spec.minAvailable} with ${d.spec.replicas ?? 1} replicas blocks every eviction`);
  }

  // 5. HPA on the denoise queue depth
  const hpas = byKind('HorizontalPodAutoscaler');
  current = profile;
  check(hpas.length === 1, `expected one HorizontalPodAutoscaler, found ${hpas.length}`);
  for (const h of hpas) {
    current = `${profile} ${id(h)}`;
    check(h.apiVersion === 'autoscaling/v2', 'not autoscaling/v2');
    const ref = h.spec.scaleTargetRef;
    const d = deployments.find((x) => name(x) === ref.name && ref.kind === 'Deployment');
    if (check(d, `scaleTargetRef ${ref.kind}/${ref.name} does not exist`)) {
      check(component(d) === 'denoise', 'does not scale the denoise workers');
      const replicas = d.spec.replicas ?? 1;
      check(replicas >= (h.spec.minReplicas ?? 1) && replicas <= h.spec.maxReplicas, `Deployment replicas ${replicas} outside [${h.spec.minReplicas}, ${h.spec.maxReplicas}]`);
    }
    check((h.spec.minReplicas ?? 1) <= h.spec.maxReplicas, 'minReplicas above maxReplicas');
    const m = (h.spec.metrics || []).find((x) => x.type === 'Pods');
    check(m?.pods?.metric?.name === 'dgserve_denoise_queue_depth', 'no Pods metric dgserve_denoise_queue_depth');
    check(m?.pods?.target?.type === 'AverageValue', 'Pods metric target is not an AverageValue');
  }

  // 6. NetworkPolicies: who may reach which port
  const policies = byKind('NetworkPolicy');
  const allowed = {}; // component → port name → set of sources ('*' = anyone, 'prometheus', components)
  for (const np of policies) {
    current = `${profile} ${id(np)}`;
    const selected = deployments.filter((d) => labelsMatch(np.spec?.podSelector, podLabels(d)));
    if (!check(selected.length > 0, 'podSelector matches no Deployment')) continue;
    check((np.spec.policyTypes || []).includes('Ingress'), 'policyTypes lacks Ingress');
    for (const d of selected) {
      const comp = component(d);
      allowed[comp] ??= {};
      for (const rule of np.spec.ingress || []) {
        const sources = [];
        if (!rule.from || rule.from.length === 0) sources.push('*');
        for (const peer of rule.from || []) {
          if (peer.ipBlock) sources.push(`ip:${peer.ipBlock.cidr}`);
          else if (peer.namespaceSelector) sources.push('prometheus');
          else if (peer.podSelector) {
            const src = deployments.filter((x) => labelsMatch(peer.podSelector, podLabels(x)));
            if (check(src.length > 0, `from.podSelector ${JSON.stringify(peer.podSelector)} matches no Deployment`)) src.forEach((x) => sources.push(component(x)));
          }
        }
        if (!check(rule.ports?.length, 'an ingress rule without ports opens every port')) continue;
        for (const p of rule.ports) {
          // A range (endPort: NCCL's sockets) is named "tcp:<port>-<endPort>"; a single port must
          // be a container port.
          if (p.endPort !== undefined) {
            const pname = `${(p.protocol || 'TCP').toLowerCase()}:${p.port}-${p.endPort}`;
            allowed[comp][pname] ??= new Set();
            sources.forEach((s) => allowed[comp][pname].add(s));
            continue;
          }
          check(portIn(allPorts(d), p.port), `port ${p.port} is not a container port of ${id(d)}`);
          const pname = typeof p.port === 'number' ? allPorts(d).find((x) => x.containerPort === p.port)?.name : p.port;
          allowed[comp][pname] ??= new Set();
          sources.forEach((s) => allowed[comp][pname].add(s));
        }
      }
    }
  }
  current = `${profile} NetworkPolicy`;
  const want = {
    gateway: { http: ['*'], grpc: ['*'], metrics: ['prometheus'] },
    prefill: { grpc: ['gateway'], metrics: ['prometheus'] },
    denoise: { grpc: ['gateway', 'prefill'], metrics: ['prometheus'] },
  };
  if (profile === 'gpu') {  // NCCL between the workers, on the pods' local port range
    want.prefill[NCCL_PORTS] = ['denoise'];
    want.denoise[NCCL_PORTS] = ['prefill'];
  }
  for (const [comp, ports] of Object.entries(want)) {
    const got = allowed[comp] || {};
    for (const [port, sources] of Object.entries(ports)) {
      const g = [...(got[port] || [])].sort().join(',');
      check(g === [...sources].sort().join(','), `${comp} port ${port}: reachable from [${g}], expected [${sources.join(',')}]`);
    }
    for (const port of Object.keys(got)) check(port in ports, `${comp} port ${port} is opened but should not be`);
  }

  // 7. ServiceMonitor: selects the three Services, on a port they have
  const sms = byKind('ServiceMonitor');
  current = profile;
  check(sms.length >= 1, 'no ServiceMonitor');
  for (const sm of sms) {
    current = `${profile} ${id(sm)}`;
    const selected = services.filter((s) => labelsMatch(sm.spec?.selector, s.metadata?.labels));
    for (const c of expected) {
      check(selected.some((s) => deployments.some((d) => component(d) === c && labelsMatch(s.spec?.selector, podLabels(d)))), `selects no Service of the ${c} pods`);
    }
    for (const ep of sm.spec?.endpoints || []) {
      for (const s of selected) check((s.spec.ports || []).some((p) => p.name === ep.port), `endpoint port ${ep.port} is not a port of ${id(s)}`);
    }
  }

  // 8. the model volume
  current = profile;
  check(pvcs.some((p) => name(p) === 'dgserve-model'), 'no PersistentVolumeClaim dgserve-model');

  // 9. per profile
  const byComp = Object.fromEntries(deployments.map((d) => [component(d), d]));
  const gpuOf = (d) => containers(d).map((c) => [c.resources?.requests?.['nvidia.com/gpu'], c.resources?.limits?.['nvidia.com/gpu']]);
  if (profile === 'gpu') {
    for (const c of ['prefill', 'denoise']) {
      current = `gpu ${id(byComp[c] || { kind: 'Deployment' })}`;
      const d = byComp[c];
      if (!d) continue;
      for (const [req, lim] of gpuOf(d)) {
        check(Number(req) >= 1 && Number(lim) >= 1, `does not request and limit nvidia.com/gpu (requests ${req}, limits ${lim})`);
      }
      const spec = podSpec(d);
      check(spec.nodeSelector?.['nvidia.com/gpu.present'] === 'true', 'no nodeSelector nvidia.com/gpu.present=true');
      // NCCL binds port 0: the kernel's local port range must be the one the policies open.
      const range = (spec.securityContext?.sysctls || []).find((x) => x.name === 'net.ipv4.ip_local_port_range');
      check(range && `tcp:${range.value.trim().split(/\s+/).join('-')}` === NCCL_PORTS,
        `net.ipv4.ip_local_port_range is ${range?.value}, not the NetworkPolicy's ${NCCL_PORTS}`);
      check((spec.tolerations || []).some((t) => t.key === 'nvidia.com/gpu'), 'no toleration of nvidia.com/gpu');
    }
    current = 'gpu';
    check(dgConfig?.data?.DGSERVE_DEVICE === 'cuda', 'DGSERVE_DEVICE is not cuda');
    check((byComp.denoise?.spec?.replicas ?? 1) >= 2, 'fewer than 2 denoise replicas');
    check(!gpuOf(byComp.gateway || {}).flat().some((x) => x !== undefined), 'the gateway requests a GPU');
  } else {
    for (const d of deployments) {
      current = `${profile} ${id(d)}`;
      check(!gpuOf(d).flat().some((x) => x !== undefined), 'requests nvidia.com/gpu');
    }
    current = profile;
    check(dgConfig?.data?.DGSERVE_DEVICE === 'cpu', 'DGSERVE_DEVICE is not cpu');
  }
  if (profile === 'cpu') {
    for (const d of deployments) {
      current = `cpu ${id(d)}`;
      check((d.spec.replicas ?? 1) === 1, `replicas ${d.spec.replicas}, expected 1`);
      const init = initContainers(d).find((c) => c.name === 'model-init');
      if (!check(init, 'no model-init init container')) continue;
      const script = [...(init.command || []), ...(init.args || [])].join(' ');
      check(/dgserve-mkmodel/.test(script) && /--seed 3\b/.test(script), 'model-init does not run dgserve-mkmodel --seed 3');
      check(/--config \/etc\/dgserve\/default_model\/config\.json/.test(script), 'model-init does not use the image\'s default model config');
      check(/--tokenizer \/usr\/share\/dgserve\/tokenizer\.json/.test(script), 'model-init does not use the image\'s tokenizer');
      const mount = (init.volumeMounts || []).find((m) => m.mountPath === '/models');
      check(mount && !mount.readOnly, 'model-init does not mount /models writable');
    }
  }
}

// ---- main -----------------------------------------------------------------------------------
const args = process.argv.slice(2);
let buildDir;
const builds = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === '--build-dir') buildDir = args[++i];
  else {
    const m = /^(base|cpu|gpu)=(.+)$/.exec(args[i]);
    if (!m) {
      console.error(`usage: k8s_validate.mjs [--build-dir DIR] {base,cpu,gpu}=FILE.json ...  (bad argument ${args[i]})`);
      process.exit(2);
    }
    builds.push([m[1], m[2]]);
  }
}
if (builds.length === 0) {
  console.error('k8s_validate: nothing to validate');
  process.exit(2);
}
if (buildDir && !Object.keys(BINARIES).some((b) => knownFlags(buildDir, b))) {
  console.log(`k8s_validate: no binaries in ${buildDir}: flags not checked against --help`);
}
for (const [profile, file] of builds) {
  const objects = JSON.parse(readFileSync(file, 'utf8'));
  const before = problems.length;
  await validateBuild(profile, objects, buildDir);
  const kinds = {};
  for (const o of objects) kinds[o.kind] = (kinds[o.kind] || 0) + 1;
  console.log(`k8s_validate: ${profile}: ${objects.length} objects (${Object.entries(kinds).map(([k, n]) => `${n} ${k}`).join(', ')}): ${problems.length === before ? 'ok' : `${problems.length - before} problem(s)`}`);
}
if (problems.length) {
  for (const p of problems) console.error(`FAIL ${p}`);
  process.exit(1);
}
