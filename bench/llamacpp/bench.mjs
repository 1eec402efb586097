// llama.cpp (node-llama-cpp's prebuilt CPU build, its ggml variant picked
// for this CPU at run time) on a GGUF, run as accel-generate runs a
// benchmark: the prompt token ids 1..8, then N tokens greedy or sampled at
// temperature 1, end of sequence ignored. Prints one JSON line: load to
// ready, TTFT (the prompt and the first token), decode tok/s after the first.
//   node bench.mjs MODEL.gguf greedy|sampled [TOKENS] [SEED] [THREADS]
import {getLlama, LlamaLogLevel} from "node-llama-cpp";

const [modelPath, mode = "greedy", tokensArg = "24", seedArg = "1", threadsArg] = process.argv.slice(2);
if (!modelPath || !["greedy", "sampled"].includes(mode)) {
  console.error("usage: node bench.mjs MODEL.gguf greedy|sampled [TOKENS] [SEED] [THREADS]");
  process.exit(2);
}
const tokens = Number(tokensArg);
const start = performance.now();
const llama = await getLlama({gpu: false, logLevel: LlamaLogLevel.warn});
const threads = threadsArg ? Number(threadsArg) : llama.cpuMathCores;
const model = await llama.loadModel({modelPath, gpuLayers: 0, useMmap: true});
const context = await model.createContext({contextSize: 256, batchSize: 256, threads});
const sequence = context.getSequence();
const ready = performance.now();
const options = mode === "greedy" ? {temperature: 0} : {temperature: 1, seed: Number(seedArg)};
let first = 0;
const out = [];
for await (const token of sequence.evaluate([1, 2, 3, 4, 5, 6, 7, 8], options)) {
  if (out.length === 0) first = performance.now();
  out.push(token);
  if (out.length >= tokens) break;
}
const end = performance.now();
console.log(JSON.stringify({
  model: modelPath, mode, threads, load_s: (ready - start) / 1000, ttft_s: (first - ready) / 1000,
  tokens: out.length, tok_s_after_first: (out.length - 1) / ((end - first) / 1000),
  system: llama.systemInfo,
}));
await llama.dispose();
