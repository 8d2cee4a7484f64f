// Greedy tokens from a local transformers.js model folder in Node (onnxruntime-node, CPU), and the process's RSS.
//   node greedy_node.mjs FOLDER PROMPTS NEW [DTYPE]    e.g. node greedy_node.mjs /tmp/gpt2 1,2,3,4;9,8 8 fp32
// Prints one JSON line: {"tokens": [[...new ids] per prompt], "rss_start", "rss_loaded", "rss"} (bytes; "rss"
// after the last generate).
import path from "node:path";
import { env, AutoModelForCausalLM, Tensor } from "@huggingface/transformers";

const [folder, promptsText, newText, dtype = "fp32"] = process.argv.slice(2);
const root = path.resolve(folder);
env.allowRemoteModels = false;  // nothing from the hub: the folder is the model
env.allowLocalModels = true;
env.localModelPath = path.dirname(root) + path.sep;
env.useFSCache = false;

const rss_start = process.memoryUsage().rss;
const model = await AutoModelForCausalLM.from_pretrained(path.basename(root), { dtype, device: "cpu" });
const rss_loaded = process.memoryUsage().rss;
const n = Number(newText);
const tokens = [];
for (const prompt of promptsText.split(";")) {
  const ids = prompt.split(",").map((t) => BigInt(t));
  const input_ids = new Tensor("int64", BigInt64Array.from(ids), [1, ids.length]);  // (1, prompt)
  const attention_mask = new Tensor("int64", new BigInt64Array(ids.length).fill(1n), [1, ids.length]);
  const out = await model.generate({ input_ids, attention_mask, max_new_tokens: n, min_new_tokens: n,
                                     do_sample: false });  // (1, prompt + new)
  tokens.push(Array.from(out.data, Number).slice(ids.length));
}
console.log(JSON.stringify({ tokens, rss_start, rss_loaded, rss: process.memoryUsage().rss }));
await model.dispose();
