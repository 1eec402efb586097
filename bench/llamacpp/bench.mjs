// llama.cpp (node-llama-cpp's prebuilt CPU build, its ggml variant picked
// for this CPU at run time) on a GGUF, run as accel-generate runs a
// benchmark: the prompt token ids 1..PROMPT (default 8), then TOKENS tokens
// greedy or sampled at temperature 1, end of sequence ignored. Prints one
// JSON line: load to ready, TTFT (the prompt and the first token), decode
// tok/s after the first.
//   node bench.mjs MODEL.gguf greedy|sampled [TOKENS] [SEED] [THREADS] [PROMPT]
import {existsSync} from "node:fs";

const [modelPath, mode = "greedy", tokensArg = "24", seedArg = "1", threadsArg, promptArg = "8"] =
  process.argv.slice(2);
if (!modelPath || !["greedy", "sampled"].includes(mode)) {
  console.error("usage: node bench.mjs MODEL.gguf greedy|sampled [TOKENS] [SEED] [THREADS] [PROMPT]");
  process.exit(2);
}
if (!existsSync(modelPath)) {
  console.error(`bench.mjs: ${modelPath}: no such file (make_gguf.py writes one)`);
  process.exit(1);
}
const tokens = Number(tokensArg);
const promptLength = Number(promptArg);
for (const [name, value] of [["TOKENS", tokens], ["PROMPT", promptLength]]) {
  if (!Number.isInteger(value) || value < 1) {
    console.error(`bench.mjs: ${name} must be a whole number above 0`);
    process.exit(2);
  }
}
// Loaded after the checks, so that bad arguments are named without it.
const {getLlama, LlamaLogLevel} = await import("node-llama-cpp");
const start = performance.now();
const llama = await getLlama({gpu: false, logLevel: LlamaLogLevel.warn});
const threads = threadsArg ? Number(threadsArg) : llama.cpuMathCores;
const model = await llama.loadModel({modelPath, gpuLayers: 0, useMmap: true});
const context = await model.createContext({contextSize: promptLength + tokens + 8, batchSize: 512, threads});
const sequence = context.getSequence();
const ready = performance.now();
const options = mode === "greedy" ? {temperature: 0} : {temperature: 1, seed: Number(seedArg)};
let first = 0;
const out = [];
for await (const token of sequence.evaluate(Array.from({length: promptLength}, (_, i) => i + 1), options)) {
  if (out.length === 0) first = performance.now();
  out.push(token);
  if (out.length >= tokens) break;
}
const end = performance.now();
console.log(JSON.stringify({
  model: modelPath, mode, threads, prompt: promptLength, load_s: (ready - start) / 1000, ttft_s: (first - ready) / 1000,
  tokens: out.length, tok_s_after_first: (out.length - 1) / ((end - first) / 1000),
  system: llama.systemInfo,
}));
await llama.dispose();
