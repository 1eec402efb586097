// Checks the rendered deploy/ manifests and the Dockerfile against the
// Kubernetes OpenAPI schemas and against what the built accel-serve really
// does. Run by scripts/check_deploy.sh:
//
//   node deploy/check/check_deploy.mjs --npm DIR --build DIR --dockerfile FILE \
//     --presets CMakePresets.json NAME=rendered.yaml...
//
// Facts come from the binaries, never from a copy of them here:
//  - flag names and defaults: `accel-serve --helpfull`;
//  - health service names: accel-serve started twice on 127.0.0.1 (once on a
//    model whose config.json is a FIFO, so it stays "loading"; once on the
//    embedded default model until ready), each name asked through
//    `accel-client health`. Live names answer SERVING while loading; ready
//    names NOT_SERVING while loading and SERVING once loaded;
//  - metric names: the ready server's /metrics;
//  - runtime libraries: the NEEDED entries of accel-serve and accel-client,
//    mapped to Debian packages with dpkg -S.
// Every problem is printed; the exit status is 1 when there was any.
import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { pathToFileURL } from "node:url";

const problems = [];
function problem(where, message) {
  problems.push(`${where}: ${message}`);
}
function fail(message) {
  console.error(`check_deploy: ${message}`);
  process.exit(1);
}

// --- arguments ----------------------------------------------------------------
const args = { renders: {} };
for (const arg of process.argv.slice(2)) {
  const flag = arg.match(/^--(npm|build|dockerfile|presets)=(.*)$/);
  if (flag) {
    args[flag[1]] = flag[2];
    continue;
  }
  const render = arg.match(/^([\w-]+)=(.+)$/);
  if (!render) fail(`unexpected argument ${arg}`);
  args.renders[render[1]] = render[2];
}
for (const key of ["npm", "build", "dockerfile", "presets"]) {
  if (!args[key]) fail(`--${key}= is missing`);
}
const modules = path.join(args.npm, "node_modules");
const load = (p) => import(pathToFileURL(path.join(modules, p)).href);
const YAML = await load("yaml/dist/index.js");
const k8s = await load("kubernetes-models/index.js");
const promop = await load("@kubernetes-models/prometheus-operator/index.js");
const Ajv = (await load("ajv/dist/ajv.js")).default;
const serveBin = path.join(args.build, "bin/accel-serve");
const clientBin = path.join(args.build, "bin/accel-client");
const defaultModel = path.join(args.build, "share/accel/default-model");
for (const p of [serveBin, clientBin, path.join(defaultModel, "config.json")]) {
  if (!fs.existsSync(p)) fail(`${p} is missing; build accel-serve and accel-client first`);
}

// --- quantities ---------------------------------------------------------------
const kUnits = { "": 1, k: 1e3, K: 1e3, M: 1e6, G: 1e9, T: 1e12, KB: 1e3, MB: 1e6, GB: 1e9,
  TB: 1e12, Ki: 2 ** 10, Mi: 2 ** 20, Gi: 2 ** 30, Ti: 2 ** 40, KiB: 2 ** 10, MiB: 2 ** 20,
  GiB: 2 ** 30, TiB: 2 ** 40, B: 1 };
function bytes(text) {
  const m = String(text).match(/^([0-9.]+)\s*([A-Za-z]*)$/);
  if (!m || !(m[2] in kUnits)) return NaN;
  return Number(m[1]) * kUnits[m[2]];
}
function seconds(text) {
  const m = String(text).match(/^([0-9.]+)(ms|s|m|h)$/);
  if (!m) return NaN;
  return Number(m[1]) * { ms: 0.001, s: 1, m: 60, h: 3600 }[m[2]];
}

// --- accel-serve --helpfull -----------------------------------------------------
const help = spawnSync(serveBin, ["--helpfull"], { encoding: "utf8" });
// The "Flags from FILE:" headings go: otherwise each file's last flag ran on into the next
// heading and was not recognised (the engine's --threads once accel-serve took its flags from
// several files).
const helpText = `${help.stdout}${help.stderr}`.replace(/\n\s*Flags from [^\n]*:\n/g, "\n");
const flagDefaults = new Map();
for (const block of helpText.split(/\n(?=\s{4}--)/)) {
  const m = block.match(/^\s*--(\w+) \(([\s\S]*)\);\s+default: ([\s\S]*?);\s*$/);
  if (m) flagDefaults.set(m[1], m[3].replace(/^"(.*)"$/, "$1"));
}
for (const name of ["port", "metrics_port", "shutdown_timeout", "max_memory", "flagfile"]) {
  if (!flagDefaults.has(name)) fail(`accel-serve --helpfull lists no --${name}`);
}
const defaultPort = Number(flagDefaults.get("port"));
const defaultMetricsPort = Number(flagDefaults.get("metrics_port"));

// Flag lines of a flagfile (comments and blank lines skipped).
function parseFlagLines(text, where) {
  const flags = [];
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (line === "" || line.startsWith("#")) continue;
    const m = line.match(/^--(\w+)(?:=(.*))?$/);
    if (!m) {
      problem(where, `"${line}" is not --name=value`);
      continue;
    }
    if (!flagDefaults.has(m[1])) problem(where, `--${m[1]} is not a flag of accel-serve`);
    flags.push([m[1], m[2] ?? "true"]);
  }
  return flags;
}

// --- the real server: health names and metrics ---------------------------------
let tmp = "";
// `first` goes before the overrides (absl: a later flag wins over a flagfile's).
function startServer(model, first = []) {
  return new Promise((resolve, reject) => {
    const child = spawn(serveBin, [...first, `--model=${model}`, "--host=127.0.0.1", "--port=0",
      "--metrics_port=0", "--threads=1", `--offload_folder=${tmp}/offload`],
    { stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    let err = "";
    const timer = setTimeout(() => reject(new Error(`accel-serve did not start: ${err}`)), 60000);
    child.stderr.on("data", (d) => (err += d));
    child.stdout.on("data", (d) => {
      out += d;
      const m = out.match(/listening grpc=[^\s]*:(\d+) metrics=[^\s]*:(-?\d+)/);
      if (m) {
        clearTimeout(timer);
        resolve({ child, grpc: Number(m[1]), metrics: Number(m[2]), stderr: () => err });
      }
    });
    child.on("exit", (code) => reject(new Error(`accel-serve exited (${code}): ${err}`)));
  });
}
async function stopServer(server) {
  const exited = new Promise((resolve) => server.child.on("exit", resolve));
  server.child.kill("SIGTERM");
  const timer = setTimeout(() => server.child.kill("SIGKILL"), 30000);
  await exited;
  clearTimeout(timer);
}
// SERVING / NOT_SERVING / UNKNOWN (not registered) / an error text.
function health(port, service) {
  const r = spawnSync(clientBin, ["health", `--address=127.0.0.1:${port}`, `--service=${service}`,
    "--timeout=5s"], { encoding: "utf8" });
  const text = `${r.stdout}${r.stderr}`.trim();
  if (/^SERVING/.test(text)) return "SERVING";
  if (/^NOT_SERVING/.test(text)) return "NOT_SERVING";
  if (/unknown/i.test(text)) return "UNKNOWN";
  return text;
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Collects the probe service names first, then asks the server about each.
// The pod templates of a Deployment or of a LeaderWorkerSet (leader and workers).
function podTemplatesOf(doc) {
  if (doc.kind === "Deployment") return [doc.spec?.template];
  if (doc.kind === "LeaderWorkerSet") {
    const t = doc.spec?.leaderWorkerTemplate ?? {};
    return [t.leaderTemplate ?? t.workerTemplate, t.workerTemplate];
  }
  return [];
}
function probesOf(docs) {
  const out = [];
  for (const doc of docs) {
    for (const template of podTemplatesOf(doc)) {
      for (const c of template?.spec?.containers ?? []) {
        for (const kind of ["startupProbe", "readinessProbe", "livenessProbe"]) {
          if (c[kind]?.grpc) out.push({ kind, service: c[kind].grpc.service ?? "" });
        }
      }
    }
  }
  return out;
}

// --- the Dockerfile --------------------------------------------------------------
const dockerText = fs.readFileSync(args.dockerfile, "utf8");
const dockerLines = dockerText.replace(/\\\n/g, " ").split("\n").map((l) => l.trim())
  .filter((l) => l && !l.startsWith("#"));
const docker = { stages: {}, order: [] };
let stage = null;
for (const line of dockerLines) {
  const m = line.match(/^(\w+)\s+(.*)$/);
  if (!m) continue;
  const [, instr, rest] = [m[0], m[1].toUpperCase(), m[2]];
  if (instr === "FROM") {
    const f = rest.match(/^(\S+)(?:\s+AS\s+(\S+))?$/i);
    stage = { from: f[1], name: f[2] ?? `#${docker.order.length}`, lines: [] };
    docker.stages[stage.name] = stage;
    docker.order.push(stage);
  } else if (stage) {
    stage.lines.push([instr, rest]);
  }
}
const finalStage = docker.order[docker.order.length - 1];
const all = (instr) => docker.order.flatMap((s) => s.lines.filter((l) => l[0] === instr)
  .map((l) => ({ stage: s.name, text: l[1] })));
const lastOf = (instr) => all(instr).at(-1)?.text;

const entry = lastOf("ENTRYPOINT");
if (entry !== '["accel-serve"]') problem("Dockerfile", `ENTRYPOINT is ${entry}, not ["accel-serve"]`);
const userText = lastOf("USER") ?? "";
const dockerUid = Number(userText.split(":")[0]);
if (!(dockerUid > 0)) problem("Dockerfile", `USER "${userText}" is not a numeric non-root uid`);
const exposed = (lastOf("EXPOSE") ?? "").split(/\s+/).map(Number).sort();
const wantExposed = [defaultPort, defaultMetricsPort].sort();
if (JSON.stringify(exposed) !== JSON.stringify(wantExposed)) {
  problem("Dockerfile", `EXPOSE ${exposed.join(" ")}, but accel-serve's --port and ` +
    `--metrics_port default to ${wantExposed.join(" ")}`);
}
const healthcheck = lastOf("HEALTHCHECK") ?? "";
const hcService = healthcheck.match(/--service=([^"\s]*)/)?.[1];
const hcAddress = healthcheck.match(/--address=([^"\s]*)/)?.[1] ?? "localhost:50051";
if (!/"accel-client", "health"/.test(healthcheck) || hcService === undefined) {
  problem("Dockerfile", "HEALTHCHECK does not run accel-client health --service=NAME");
}
if (Number(hcAddress.split(":").at(-1)) !== defaultPort) {
  problem("Dockerfile", `HEALTHCHECK asks ${hcAddress}, not accel-serve's port ${defaultPort}`);
}
// One source of truth: every build stage runs scripts/setup.sh and a preset of
// CMakePresets.json, and builds the binaries and the default model.
const presets = JSON.parse(fs.readFileSync(args.presets, "utf8")).configurePresets.map((p) => p.name);
const buildStages = docker.order.filter((s) => /^build-/.test(s.name));
if (buildStages.length === 0) problem("Dockerfile", "no build-* stage");
for (const s of buildStages) {
  const runs = s.lines.filter((l) => l[0] === "RUN").map((l) => l[1]).join(" && ");
  if (!/bash scripts\/setup\.sh/.test(runs)) problem(`Dockerfile ${s.name}`, "does not run scripts/setup.sh");
  const preset = runs.match(/cmake --preset (\S+)/)?.[1];
  if (!presets.includes(preset)) problem(`Dockerfile ${s.name}`, `CMake preset "${preset}" is not in CMakePresets.json`);
  for (const target of ["accel-serve", "accel-client", "accel-default-model"]) {
    if (!new RegExp(`--target[^&]*\\b${target}\\b`).test(runs)) {
      problem(`Dockerfile ${s.name}`, `does not build ${target}`);
    }
  }
}
// The default model is copied from where the build makes it, beside bin/.
const copies = finalStage.lines.filter((l) => l[0] === "COPY").map((l) => l[1]);
const binCopy = copies.find((c) => /\/build\/bin\/accel-serve/.test(c));
const shareCopy = copies.find((c) => /\/build\/share\/accel\s/.test(c));
const prefix = binCopy?.match(/\s(\S+)\/bin\/$/)?.[1];
if (!prefix || !/\/build\/bin\/accel-client/.test(binCopy)) {
  problem("Dockerfile", "the runtime stage does not COPY build/bin/accel-serve and accel-client to PREFIX/bin/");
}
if (!shareCopy || shareCopy.split(/\s+/).at(-1) !== `${prefix}/share/accel`) {
  problem("Dockerfile", `the runtime stage does not COPY build/share/accel to ${prefix}/share/accel ` +
    "(accel-serve looks for ../share/accel/default-model beside its bin/)");
}
const imageModel = `${prefix}/share/accel/default-model`;
// The runtime packages: exactly those owning the binaries' NEEDED libraries.
const kInBaseImage = new Set(["libc6", "libgcc-s1", "libstdc++6", "zlib1g"]);
const needed = new Set();
for (const bin of [serveBin, clientBin]) {
  const ldd = spawnSync("ldd", [bin], { encoding: "utf8" }).stdout;
  const elf = spawnSync("readelf", ["-d", bin], { encoding: "utf8" }).stdout;
  for (const m of elf.matchAll(/\(NEEDED\)\s+Shared library: \[(.+)\]/g)) {
    const file = ldd.match(new RegExp(`${m[1].replace(/[.+]/g, "\\$&")} => (\\S+)`))?.[1];
    if (!file) {
      problem(bin, `ldd does not resolve ${m[1]}`);
      continue;
    }
    const real = fs.realpathSync(file);
    let owner = "";
    for (const p of [file, real, file.replace(/^\/usr/, ""), real.replace(/^\/usr/, ""),
      `/usr${file}`, `/usr${real}`]) {
      const q = spawnSync("dpkg", ["-S", p], { encoding: "utf8" });
      if (q.status === 0) {
        owner = q.stdout.split(":")[0];
        break;
      }
    }
    if (!owner) problem(bin, `no Debian package owns ${file}`);
    else if (!kInBaseImage.has(owner)) needed.add(owner);
  }
}
// libtorch links libblas.so.3, which Debian's alternatives point at the best
// BLAS installed. setup.sh installs OpenBLAS (the OpenMP build) because the
// reference BLAS that libtorch's package pulls in is about 30x slower for
// float32 products; the image must carry the same one.
const kBlas = "libopenblas0-openmp";
if ([...needed].some((p) => /^libtorch/.test(p))) {
  const setup = `${args.dockerfile.replace(/[^/]*$/, "")}scripts/setup.sh`;
  if (!fs.readFileSync(setup, "utf8").includes(kBlas)) {
    problem("scripts/setup.sh", `does not install ${kBlas}, libtorch's fast BLAS`);
  }
  needed.add(kBlas);
}
const installed = new Set();
for (const s of docker.order.filter((s) => /^runtime/.test(s.name) && s.name !== "runtime-cuda")) {
  for (const [instr, text] of s.lines) {
    if (instr !== "RUN") continue;
    for (const m of text.matchAll(/apt-get install (?:-\S+\s+)*([^&]*)/g)) {
      for (const p of m[1].trim().split(/\s+/)) if (p) installed.add(p);
    }
  }
}
for (const p of needed) {
  if (!installed.has(p)) problem("Dockerfile", `the runtime stage lacks ${p} (a library accel-serve or accel-client links)`);
}
for (const p of installed) {
  if (!needed.has(p)) problem("Dockerfile", `the runtime stage installs ${p}, which neither binary links`);
}

// --- schemas ------------------------------------------------------------------------
function modelClass(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "") return k8s[version]?.[kind];
  const key = group.split(/[.-]/).map((w, i) => (i ? w[0].toUpperCase() + w.slice(1) : w)).join("");
  return (k8s[key] ?? promop[key])?.[version]?.[kind];
}
// Unknown fields: the schemas allow extra properties, and a client-side apply
// passes them; the API server drops them or refuses the object. The field names
// come from the models' type declarations (generated from the same OpenAPI
// document): a property whose type is an imported interface is checked in
// turn; maps, inline objects and scalars are not looked into.
const declarations = new Map();
function declarationsOf(file) {
  if (declarations.has(file)) return declarations.get(file);
  const decl = { props: null, imports: new Map() };
  declarations.set(file, decl);
  if (!fs.existsSync(file)) return decl;
  const text = fs.readFileSync(file, "utf8");
  for (const m of text.matchAll(/^import \{ (\w+) \} from "([^"]+)";$/gm)) {
    decl.imports.set(m[1], m[2].startsWith(".")
      ? path.resolve(path.dirname(file), m[2].replace(/\.js$/, ".d.ts"))
      : path.join(modules, `${m[2]}.d.ts`));
  }
  const body = text.match(/^export interface I\w+(?: extends [^{]*)? \{\n([\s\S]*?)\n\}/m)?.[1];
  if (body === undefined) return decl;  // a type alias (IntOrString, Quantity): opaque
  decl.props = new Map();
  for (const m of body.matchAll(/^ {4}"([^"]+)"\??: (.*?);?$/gm)) decl.props.set(m[1], m[2]);
  return decl;
}
function checkFields(where, value, file, at) {
  const decl = declarationsOf(file);
  if (decl.props === null || value === null || typeof value !== "object" || Array.isArray(value)) return;
  for (const [key, child] of Object.entries(value)) {
    if (key === "apiVersion" || key === "kind") continue;
    const type = decl.props.get(key);
    if (type === undefined) {
      problem(where, `unknown field ${at}${key}`);
      continue;
    }
    const element = type.match(/^Array<(\w+)>$/)?.[1];
    const target = decl.imports.get(element ?? type);
    if (!target) continue;
    if (element) child.forEach?.((item, i) => checkFields(where, item, target, `${at}${key}[${i}].`));
    else checkFields(where, child, target, `${at}${key}.`);
  }
}
function declarationFile(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "") return path.join(modules, "kubernetes-models", version, `${kind}.d.ts`);
  const inCore = path.join(modules, "kubernetes-models", group, version, `${kind}.d.ts`);
  if (fs.existsSync(inCore)) return inCore;
  return path.join(modules, "@kubernetes-models/prometheus-operator", group, version, `${kind}.d.ts`);
}

// Custom resources: the openAPIV3Schema of their CRD (deploy/check/crds/, copies
// kept with their licence), by ajv; unknown fields by walking the same schema
// (structural schemas prune them on the API server, which would drop them silently).
const crdDir = path.join(path.dirname(new URL(import.meta.url).pathname), "crds");
const crdSchemas = new Map();
for (const file of fs.existsSync(crdDir) ? fs.readdirSync(crdDir) : []) {
  if (!file.endsWith(".yaml")) continue;
  const crd = YAML.parse(fs.readFileSync(path.join(crdDir, file), "utf8"));
  for (const v of crd.spec.versions) {
    crdSchemas.set(`${crd.spec.group}/${v.name} ${crd.spec.names.kind}`, v.schema.openAPIV3Schema);
  }
}
const ajv = new Ajv({ strict: false, allErrors: true, validateFormats: false });
function unknownFields(where, value, schema, at) {
  if (!schema || value === null || typeof value !== "object") return;
  if (Array.isArray(value)) {
    value.forEach((item, i) => unknownFields(where, item, schema.items, `${at}[${i}]`));
    return;
  }
  if (!schema.properties || schema["x-kubernetes-preserve-unknown-fields"] || schema.additionalProperties) return;
  for (const [key, child] of Object.entries(value)) {
    if (!(key in schema.properties)) problem(where, `unknown field ${at}${key}`);
    else unknownFields(where, child, schema.properties[key], `${at}${key}.`);
  }
}
function validateCustom(where, doc, schema) {
  const check = ajv.compile(schema);
  if (!check(doc)) {
    for (const e of check.errors) problem(where, `schema: ${e.instancePath || "/"} ${e.message}`);
  }
  // metadata is the API server's ObjectMeta, not in the CRD's schema.
  unknownFields(where, { ...doc, metadata: undefined }, schema, "");
}

function validate(name, doc) {
  const Model = modelClass(doc.apiVersion ?? "", doc.kind ?? "");
  const where = `${name}: ${doc.kind}/${doc.metadata?.name}`;
  const custom = crdSchemas.get(`${doc.apiVersion} ${doc.kind}`);
  if (!Model && custom) return validateCustom(where, doc, custom);
  if (!Model) {
    problem(where, `no schema for apiVersion ${doc.apiVersion} kind ${doc.kind}`);
    return;
  }
  const file = declarationFile(doc.apiVersion, doc.kind);
  if (declarationsOf(file).props === null) problem(where, `no type declaration at ${file}`);
  checkFields(where, doc, file, "");
  try {
    new Model(doc).validate();
  } catch (e) {
    problem(where, `schema: ${e.message}`);
  }
}

// The flags a container runs with: defaults, then each --flagfile (a key of a
// mounted ConfigMap) in order, then the other args.
function readFlags(name, where, container, pod, configMaps) {
  const flags = new Map(flagDefaults);
  const mounts = new Map((container.volumeMounts ?? []).map((m) => [m.mountPath, m]));
  const volumes = new Map((pod.volumes ?? []).map((v) => [v.name, v]));
  for (const arg of [...(container.command ?? []).slice(1), ...(container.args ?? [])]) {
    const m = arg.match(/^--(\w+)(?:=(.*))?$/);
    if (!m) {
      problem(where, `argument "${arg}" is not --name=value`);
      continue;
    }
    if (!flagDefaults.has(m[1])) problem(where, `--${m[1]} is not a flag of accel-serve`);
    if (m[1] !== "flagfile") {
      flags.set(m[1], m[2] ?? "true");
      continue;
    }
    for (const file of (m[2] ?? "").split(",")) {
      const dir = path.dirname(file);
      const mount = mounts.get(dir);
      const cm = mount && volumes.get(mount.name)?.configMap;
      const data = cm && configMaps.get(cm.name)?.data?.[path.basename(file)];
      if (data === undefined) {
        problem(where, `--flagfile ${file} is not a key of a ConfigMap mounted at ${dir}`);
        continue;
      }
      for (const [k, v] of parseFlagLines(data, `${name}: ConfigMap/${cm.name} ${path.basename(file)}`)) {
        flags.set(k, v);
      }
    }
  }

  return { flags, mounts, volumes };
}

// --- a LeaderWorkerSet: one model over several nodes --------------------------------
// Every pod is one node of a group: torchrun's flags from the variables the
// LeaderWorkerSet sets, one rank per GPU, the leader serving the ports and
// the workers health only, the whole group restarted when one pod fails.
function checkLeaderWorkerSet(name, docs, lws, liveNames, readyNames) {
  const byKind = (kind) => docs.filter((d) => d.kind === kind);
  const configMaps = new Map(byKind("ConfigMap").map((c) => [c.metadata.name, c]));
  const group = lws.spec.leaderWorkerTemplate ?? {};
  const size = group.size ?? 1;
  const at = `${name}: LeaderWorkerSet/${lws.metadata.name}`;
  if (group.restartPolicy !== "RecreateGroupOnPodRestart") {
    problem(at, "restartPolicy is not RecreateGroupOnPodRestart: a rank that fails must restart its group");
  }
  const roles = [["leader", group.leaderTemplate ?? group.workerTemplate], ["worker", group.workerTemplate]];
  const leaderPorts = new Map();
  for (const [role, template] of roles) {
    const where = `${at} ${role}`;
    const pod = template?.spec;
    const container = pod?.containers?.find((c) => c.name === "accel-serve");
    if (!container) {
      problem(where, "no container named accel-serve");
      continue;
    }
    const { flags } = readFlags(name, where, container, pod, configMaps);
    for (const [flag, variable] of [["nnodes", "LWS_GROUP_SIZE"], ["node_rank", "LWS_WORKER_INDEX"],
      ["master_addr", "LWS_LEADER_ADDRESS"]]) {
      if (flags.get(flag) !== `$(${variable})`) problem(where, `--${flag} is not $(${variable})`);
    }
    const tp = Number(flags.get("tensor_parallel_size") ?? 1);
    const pp = Number(flags.get("pipeline_parallel_size") ?? 1);
    const res = container.resources ?? {};
    const gpus = Number(res.limits?.["nvidia.com/gpu"] ?? 0);
    if (gpus * size !== tp * pp) {
      problem(where, `${size} pods x ${gpus} GPUs is not --tensor_parallel_size ${tp} x ` +
        `--pipeline_parallel_size ${pp} (one rank per GPU)`);
    }
    if (res.requests?.["nvidia.com/gpu"] !== res.limits?.["nvidia.com/gpu"]) {
      problem(where, "nvidia.com/gpu requests differ from limits");
    }
    if (res.requests?.memory !== res.limits?.memory || !res.limits?.memory) {
      problem(where, "memory requests differ from limits (or no limit)");
    }
    if (!(pod.tolerations ?? []).some((tol) => tol.key === "nvidia.com/gpu")) problem(where, "no toleration for nvidia.com/gpu");
    const port = Number(flags.get("port"));
    const named = new Map((container.ports ?? []).map((p) => [p.name, p.containerPort]));
    if (named.get("grpc") !== port) problem(where, `containerPort grpc is ${named.get("grpc")}, --port is ${port}`);
    if (role === "leader") {
      for (const [portName, flag] of [["metrics", "metrics_port"], ["http", "http_port"]]) {
        const want = Number(flags.get(flag) ?? 0);
        if (want > 0 && named.get(portName) !== want) {
          problem(where, `containerPort ${portName} is ${named.get(portName)}, --${flag} is ${want}`);
        }
      }
      if (named.get("dist") !== Number(flags.get("master_port"))) {
        problem(where, `containerPort dist is ${named.get("dist")}, --master_port is ${flags.get("master_port")}`);
      }
      for (const [k, v] of named) leaderPorts.set(k, v);
    } else if (named.has("metrics") || named.has("http")) {
      problem(where, "a worker serves health only: no metrics or http port");
    }
    for (const kind of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      const probe = container[kind];
      if (!probe?.grpc) {
        problem(where, `${kind} is not a gRPC probe`);
        continue;
      }
      if (probe.grpc.port !== port) problem(where, `${kind} port ${probe.grpc.port}, --port is ${port}`);
      const want = kind === "livenessProbe" ? liveNames : readyNames;
      if (!want.has(probe.grpc.service ?? "")) {
        problem(where, `${kind} asks health service "${probe.grpc.service ?? ""}", not a ` +
          `${kind === "livenessProbe" ? "live" : "ready"} name of accel-serve`);
      }
    }
    const preStop = container.lifecycle?.preStop?.exec?.command;
    const preStopSeconds = preStop?.[0] === "sleep" ? Number(preStop[1]) : 0;
    const shutdown = seconds(flags.get("shutdown_timeout"));
    const grace = pod.terminationGracePeriodSeconds ?? 30;
    if (preStopSeconds + shutdown + 15 > grace) {
      problem(where, `terminationGracePeriodSeconds ${grace} < preStop ${preStopSeconds} s + ` +
        `--shutdown_timeout ${shutdown} s + 15 s`);
    }
    const psc = pod.securityContext ?? {};
    if (psc.runAsNonRoot !== true) problem(where, "runAsNonRoot is not true");
    if (psc.runAsUser !== dockerUid) problem(where, `runAsUser ${psc.runAsUser}, the image's USER is ${dockerUid}`);
    if (pod.automountServiceAccountToken !== false) problem(where, "automountServiceAccountToken is not false");
    const sc = container.securityContext ?? {};
    if (sc.readOnlyRootFilesystem !== true) problem(where, "readOnlyRootFilesystem is not true");
    if (sc.allowPrivilegeEscalation !== false) problem(where, "allowPrivilegeEscalation is not false");
  }
  // The Service sends clients to the leaders only (worker index 0).
  const leaderLabels = { ...(roles[0][1]?.metadata?.labels ?? {}),
    "leaderworkerset.sigs.k8s.io/name": lws.metadata.name, "leaderworkerset.sigs.k8s.io/worker-index": "0" };
  const services = byKind("Service");
  if (services.length === 0) problem(name, "no Service for the leaders");
  for (const service of services) {
    const where = `${name}: Service/${service.metadata.name}`;
    const selector = service.spec.selector ?? {};
    if (selector["leaderworkerset.sigs.k8s.io/worker-index"] !== "0") {
      problem(where, "does not select the leaders only (leaderworkerset.sigs.k8s.io/worker-index: \"0\")");
    }
    if (!Object.entries(selector).every(([k, v]) => leaderLabels[k] === v)) {
      problem(where, "its selector does not select the leader pods");
    }
    for (const p of service.spec.ports ?? []) {
      const target = typeof p.targetPort === "string" ? leaderPorts.get(p.targetPort) : p.targetPort;
      if (target === undefined) problem(where, `port ${p.name} targets nothing on the leader`);
    }
  }
}

// --- one rendered overlay ------------------------------------------------------------
function checkRender(name, docs, liveNames, readyNames, metricNames) {
  for (const doc of docs) validate(name, doc);
  const byKind = (kind) => docs.filter((d) => d.kind === kind);
  const deployment = byKind("Deployment")[0];
  const lws = byKind("LeaderWorkerSet")[0];
  if (lws) return checkLeaderWorkerSet(name, docs, lws, liveNames, readyNames);
  if (!deployment) return problem(name, "no Deployment");
  const pod = deployment.spec.template.spec;
  const container = pod.containers.find((c) => c.name === "accel-serve");
  if (!container) return problem(name, "no container named accel-serve");
  const where = `${name}: Deployment/${deployment.metadata.name}`;
  const configMaps = new Map(byKind("ConfigMap").map((c) => [c.metadata.name, c]));
  const { flags, mounts, volumes } = readFlags(name, where, container, pod, configMaps);

  // Ports: the server's flags, the container, the probes, the Service, the
  // ServiceMonitor and the Docker image all agree.
  const port = Number(flags.get("port"));
  const metricsPort = Number(flags.get("metrics_port"));
  if (port !== defaultPort || metricsPort !== defaultMetricsPort) {
    problem(where, `--port=${port} --metrics_port=${metricsPort}, but the image EXPOSEs and ` +
      `health-checks accel-serve's defaults ${defaultPort} and ${defaultMetricsPort}`);
  }
  const named = new Map((container.ports ?? []).map((p) => [p.name, p.containerPort]));
  if (named.get("grpc") !== port) problem(where, `containerPort grpc is ${named.get("grpc")}, --port is ${port}`);
  if (named.get("metrics") !== metricsPort) {
    problem(where, `containerPort metrics is ${named.get("metrics")}, --metrics_port is ${metricsPort}`);
  }
  // The OpenAI-compatible HTTP API: a container port named http exactly when it is on.
  const httpPort = Number(flags.get("http_port") ?? "0");
  if (httpPort !== 0 && named.get("http") !== httpPort) {
    problem(where, `containerPort http is ${named.get("http")}, --http_port is ${httpPort}`);
  }
  if (httpPort === 0 && named.has("http")) {
    problem(where, `containerPort http is ${named.get("http")}, but --http_port is off`);
  }
  for (const kind of ["startupProbe", "readinessProbe", "livenessProbe"]) {
    const probe = container[kind];
    if (!probe?.grpc) {
      problem(where, `${kind} is not a gRPC probe`);
      continue;
    }
    if (probe.grpc.port !== port) problem(where, `${kind} port ${probe.grpc.port}, --port is ${port}`);
    const service = probe.grpc.service ?? "";
    const want = kind === "livenessProbe" ? liveNames : readyNames;
    if (!want.has(service)) {
      problem(where, `${kind} asks health service "${service}", which accel-serve does not register ` +
        `as ${kind === "livenessProbe" ? "live" : "ready"} (${[...want].map((s) => `"${s}"`).join(", ")})`);
    }
  }
  const startup = container.startupProbe;
  if (startup && startup.periodSeconds * startup.failureThreshold < 600) {
    problem(where, "the startupProbe allows less than 10 minutes for the model to load");
  }
  // Services: two over the same pods. The ClusterIP one (grpc and metrics) balances
  // connections, so a gRPC client's requests stay on one pod until it reconnects; the headless
  // one (grpc only) gives DNS one record per ready pod, for clients that balance each request
  // themselves (dns:/// target, round_robin policy). docs/DEPLOY.md says which to use when.
  const podLabels = deployment.spec.template.metadata?.labels ?? {};
  const matches = (labels, selector) =>
    Object.entries(selector ?? {}).every(([k, v]) => (labels ?? {})[k] === v);
  const services = byKind("Service");
  const portsOf = (service) => new Map((service.spec.ports ?? []).map((p) => [p.name, p]));
  for (const service of services) {
    const at = `${name}: Service/${service.metadata.name}`;
    for (const p of service.spec.ports ?? []) {
      const target = typeof p.targetPort === "string" ? named.get(p.targetPort) : p.targetPort;
      if (target === undefined) problem(at, `port ${p.name} targets nothing`);
    }
    if (!service.spec.selector || !matches(podLabels, service.spec.selector)) {
      problem(at, "its selector does not select the Deployment's pods");
    }
    if (!portsOf(service).has("grpc")) problem(at, "needs port grpc");
  }
  const headless = services.filter((s) => s.spec.clusterIP === "None");
  const virtual = services.filter((s) => s.spec.clusterIP !== "None");
  if (virtual.length !== 1 || (virtual[0].spec.type ?? "ClusterIP") !== "ClusterIP") {
    problem(name, "needs exactly one ClusterIP Service (the default way in)");
  } else if (!portsOf(virtual[0]).has("metrics")) {
    problem(`${name}: Service/${virtual[0].metadata.name}`, "needs ports grpc and metrics");
  } else if (httpPort !== 0 && !portsOf(virtual[0]).has("http")) {
    problem(`${name}: Service/${virtual[0].metadata.name}`,
      "needs port http: the pods serve the OpenAI-compatible API (--http_port)");
  }
  if (headless.length !== 1) {
    problem(name, "needs exactly one headless Service (clusterIP: None) for client-side round-robin");
  } else {
    const at = `${name}: Service/${headless[0].metadata.name}`;
    if (portsOf(headless[0]).has("metrics")) {
      problem(at, "has a metrics port: the ServiceMonitor would scrape every pod twice");
    }
    if (headless[0].spec.publishNotReadyAddresses === true) {
      problem(at, "publishes pods that are not ready: clients would connect to loading or draining pods");
    }
    if (virtual.length === 1 && portsOf(headless[0]).get("grpc")?.port !== portsOf(virtual[0]).get("grpc")?.port) {
      problem(at, "its grpc port differs from the ClusterIP Service's");
    }
  }
  for (const sm of byKind("ServiceMonitor")) {
    for (const e of sm.spec.endpoints ?? []) {
      if (e.port !== "metrics" || (e.path ?? "/metrics") !== "/metrics") {
        problem(`${name}: ServiceMonitor/${sm.metadata.name}`, "must scrape port metrics at /metrics");
      }
    }
    // Each pod scraped once: exactly one selected Service has the metrics port.
    const scraped = services.filter(
      (s) => matches(s.metadata.labels, sm.spec.selector?.matchLabels) && portsOf(s).has("metrics"));
    if (scraped.length !== 1) {
      problem(`${name}: ServiceMonitor/${sm.metadata.name}`,
        `selects ${scraped.length} Services with a metrics port; each pod must be scraped once`);
    }
  }
  // The HPA's metrics are ones accel-serve exports, as gauges.
  for (const hpa of byKind("HorizontalPodAutoscaler")) {
    for (const m of hpa.spec.metrics ?? []) {
      const metric = m.pods?.metric?.name ?? m.object?.metric?.name ?? m.external?.metric?.name;
      if (m.type === "Resource") problem(`${name}: HPA/${hpa.metadata.name}`, "scales on a resource (CPU/memory), not on the queue");
      else if (metricNames.get(metric) !== "gauge") {
        problem(`${name}: HPA/${hpa.metadata.name}`, `metric ${metric} is not a gauge accel-serve exports`);
      }
    }
    if (hpa.spec.scaleTargetRef.name !== deployment.metadata.name) problem(`${name}: HPA`, "targets another Deployment");
  }
  if (byKind("PodDisruptionBudget").length !== 1) problem(name, "needs one PodDisruptionBudget");

  // Drain: preStop sleep + --shutdown_timeout + 15 s (cancel, flush) fit in the grace period.
  const preStop = container.lifecycle?.preStop?.exec?.command;
  const preStopSeconds = preStop?.[0] === "sleep" ? Number(preStop[1]) : (container.lifecycle?.preStop?.sleep?.seconds ?? 0);
  const shutdown = seconds(flags.get("shutdown_timeout"));
  const grace = pod.terminationGracePeriodSeconds ?? 30;
  if (!(preStopSeconds > 0)) problem(where, "no preStop sleep before the drain");
  if (preStopSeconds + shutdown + 15 > grace) {
    problem(where, `terminationGracePeriodSeconds ${grace} < preStop ${preStopSeconds} s + ` +
      `--shutdown_timeout ${shutdown} s + 15 s`);
  }

  // Security: non-root as the image's user, read-only root, writable emptyDirs.
  const psc = pod.securityContext ?? {};
  if (psc.runAsNonRoot !== true) problem(where, "runAsNonRoot is not true");
  if (psc.runAsUser !== dockerUid) problem(where, `runAsUser ${psc.runAsUser}, the image's USER is ${dockerUid}`);
  if (psc.seccompProfile?.type !== "RuntimeDefault") problem(where, "seccompProfile is not RuntimeDefault");
  if (pod.automountServiceAccountToken !== false) problem(where, "automountServiceAccountToken is not false");
  for (const c of [...(pod.initContainers ?? []), ...pod.containers]) {
    const sc = c.securityContext ?? {};
    if (sc.readOnlyRootFilesystem !== true) problem(where, `${c.name}: readOnlyRootFilesystem is not true`);
    if (sc.allowPrivilegeEscalation !== false) problem(where, `${c.name}: allowPrivilegeEscalation is not false`);
    if (JSON.stringify(sc.capabilities?.drop) !== '["ALL"]') problem(where, `${c.name}: capabilities do not drop ALL`);
    if (name !== "base" && !c.resources?.limits?.memory) problem(where, `${c.name}: no memory limit`);
  }
  const mountOf = (dir) => [...mounts.values()].filter((m) => dir === m.mountPath || dir.startsWith(`${m.mountPath}/`))
    .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
  for (const [dir, writable] of [[flags.get("offload_folder"), true], ["/tmp", true], [flags.get("model"), false]]) {
    if (!dir) continue;
    const m = mountOf(dir);
    if (!m) problem(where, `${dir} is on the read-only root filesystem`);
    else if (writable && (m.readOnly || !volumes.get(m.name)?.emptyDir)) problem(where, `${dir} is not on a writable emptyDir`);
  }
  // The model: the init container copies the image's embedded model to --model.
  const init = (pod.initContainers ?? []).find((c) => c.name === "model");
  if (init) {
    const cmd = init.command ?? [];
    const src = cmd.at(-2);
    const dest = path.join(cmd.at(-1), path.basename(src ?? ""));
    if (src !== imageModel) problem(where, `the model init container copies ${src}; the image's default model is ${imageModel}`);
    if (dest !== flags.get("model")) problem(where, `the model init container makes ${dest}, --model is ${flags.get("model")}`);
  }

  // Memory: requests = limits, and the limit covers --max_memory's cpu budget + 1 GiB.
  const res = container.resources ?? {};
  const budget = (flags.get("max_memory") ?? "").split(",").map((kv) => kv.split("="))
    .find(([k]) => k === "cpu")?.[1];
  if (name !== "base") {
    if (!budget) problem(where, "--max_memory sets no cpu budget");
    const limit = bytes(res.limits?.memory);
    if (res.requests?.memory !== res.limits?.memory) problem(where, "memory requests differ from limits");
    if (budget && !(limit >= bytes(budget) + 2 ** 30)) {
      problem(where, `memory limit ${res.limits?.memory} < --max_memory cpu=${budget} + 1 GiB`);
    }
    if (budget && limit > 2 * bytes(budget) + 8 * 2 ** 30) {
      problem(where, `memory limit ${res.limits?.memory} is far above --max_memory cpu=${budget}`);
    }
  }
  // libtorch's intra-op threads fit the CPU limit (more only time-slice).
  const threads = Number(flags.get("threads") ?? 0);
  const cpuLimit = String(res.limits?.cpu ?? "");
  const cores = cpuLimit.endsWith("m") ? Number(cpuLimit.slice(0, -1)) / 1000 : Number(cpuLimit);
  if (name !== "base" && threads > Math.max(1, Math.ceil(cores))) {
    problem(where, `--threads=${threads} exceeds the CPU limit ${cpuLimit}`);
  }
  const gpus = res.limits?.["nvidia.com/gpu"];
  if (gpus !== undefined) {
    if (res.requests?.["nvidia.com/gpu"] !== gpus) problem(where, "nvidia.com/gpu requests differ from limits");
    if (!(pod.tolerations ?? []).some((t) => t.key === "nvidia.com/gpu")) problem(where, "no toleration for nvidia.com/gpu");
    if (!pod.nodeSelector && !pod.affinity) problem(where, "GPU pods without a node selector");
  }
}

// --- main -------------------------------------------------------------------------------
const renders = {};
for (const [name, file] of Object.entries(args.renders)) {
  renders[name] = YAML.parseAllDocuments(fs.readFileSync(file, "utf8")).map((d) => d.toJSON()).filter(Boolean);
}
const asked = new Set(["", hcService ?? ""]);
for (const docs of Object.values(renders)) for (const p of probesOf(docs)) asked.add(p.service);
asked.add("no.such.service");  // shows the check tells registered names apart

// Writes the ConfigMap files a rendered Deployment's --flagfile names into tmp.
function flagfilesOf(docs) {
  const out = [];
  for (const cm of docs.filter((d) => d.kind === "ConfigMap" && /flags/.test(d.metadata.name))) {
    for (const [key, text] of Object.entries(cm.data ?? {})) {
      fs.writeFileSync(path.join(tmp, key), text);
      out.push(path.join(tmp, key));
    }
  }
  return out.length > 0 ? [`--flagfile=${out.join(",")}`] : [];
}

// Loading: a copy of the default model whose config.json is a FIFO nobody writes.
tmp = fs.mkdtempSync(path.join(os.tmpdir(), "accel-check-deploy-"));
const loading = new Map();
const ready = new Map();
const metricNames = new Map();
try {
  fs.cpSync(defaultModel, path.join(tmp, "model"), { recursive: true });
  fs.rmSync(path.join(tmp, "model/config.json"));
  if (spawnSync("mkfifo", [path.join(tmp, "model/config.json")]).status !== 0) fail("mkfifo failed");
  let server = await startServer(path.join(tmp, "model"));
  for (const s of asked) loading.set(s, health(server.grpc, s));
  await stopServer(server);

  // The ready run reads the cpu overlay's flag files, as the pod does.
  server = await startServer(defaultModel, flagfilesOf(renders.cpu ?? []));
  for (let i = 0; i < 300 && health(server.grpc, "accel.ready") !== "SERVING"; ++i) await sleep(100);
  for (const s of asked) ready.set(s, health(server.grpc, s));
  const text = await (await fetch(`http://127.0.0.1:${server.metrics}/metrics`)).text();
  for (const m of text.matchAll(/^# TYPE (\S+) (\S+)$/gm)) metricNames.set(m[1], m[2]);
  await stopServer(server);
} finally {
  fs.rmSync(tmp, { recursive: true, force: true });
}
if (loading.get("no.such.service") !== "UNKNOWN" || ready.get("no.such.service") !== "UNKNOWN") {
  fail(`accel-client health does not report an unknown service name: ${loading.get("no.such.service")}`);
}
if (ready.get("accel.ready") !== "SERVING") fail(`accel-serve never turned ready: ${ready.get("accel.ready")}`);
const liveNames = new Set([...asked].filter((s) => loading.get(s) === "SERVING" && ready.get(s) === "SERVING"));
const readyNames = new Set([...asked].filter((s) => loading.get(s) === "NOT_SERVING" && ready.get(s) === "SERVING"));
if (hcService !== undefined && !readyNames.has(hcService)) {
  problem("Dockerfile", `HEALTHCHECK asks "${hcService}", not a ready health service name of accel-serve`);
}
if (metricNames.size === 0) fail("accel-serve's /metrics lists no metric");

for (const [name, docs] of Object.entries(renders)) checkRender(name, docs, liveNames, readyNames, metricNames);

const summary = `${Object.keys(renders).join(", ")} against accel-serve (live: ` +
  `${[...liveNames].map((s) => `"${s}"`).join(" ")}; ready: ${[...readyNames].join(" ")}; ` +
  `ports ${defaultPort}/${defaultMetricsPort}; runtime packages ${[...needed].sort().join(" ")})`;
if (problems.length > 0) {
  for (const p of problems) console.error(`check_deploy: ${p}`);
  console.error(`check_deploy: ${problems.length} problem(s) in ${summary}`);
  process.exit(1);
}
console.log(`check_deploy: ok: ${summary}`);
