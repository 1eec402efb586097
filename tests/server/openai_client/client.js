// One call through the official openai npm client, for
// tests/server/openai_http_test.cc. Prints one JSON line on stdout:
//   {"ok": true, "result": <response>}            (unary, or models.list)
//   {"ok": true, "chunks": [<chunk>, ...]}        (params.stream: every chunk)
//   {"ok": false, "error": {"class", "status", "message", "code", "param", "type"}}
//
//   node client.js NPM_DIR BASE_URL API_KEY METHOD PARAMS_JSON
//   METHOD: models.list | completions.create | chat.completions.create | responses.create
//           | chat.completions.stream (the stream helper: {"ok", "chunks", "final"}, final
//             being its accumulated finalChatCompletion())
//           | responses.stream (the stream helper: {"ok", "chunks", "final"}, final
//             being its finalResponse())
'use strict';
const path = require('path');

async function main() {
  const [npmDir, baseURL, apiKey, method, paramsJson] = process.argv.slice(2);
  const { default: OpenAI } = require(path.resolve(npmDir, 'node_modules', 'openai'));
  const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
  const params = paramsJson ? JSON.parse(paramsJson) : {};
  try {
    if (method === 'models.list') {
      const ids = [];
      const page = await client.models.list();
      for await (const model of page) ids.push(model);
      print({ ok: true, result: ids });
      return;
    }
    if (method === 'chat.completions.stream' || method === 'responses.stream') {
      const stream = method === 'responses.stream' ? client.responses.stream(params)
                                                   : client.chat.completions.stream(params);
      const chunks = [];
      for await (const chunk of stream) chunks.push(chunk);
      const final = method === 'responses.stream' ? await stream.finalResponse()
                                                  : await stream.finalChatCompletion();
      print({ ok: true, chunks, final });
      return;
    }
    if (method === 'responses.create') {
      if (params.stream) {
        const stream = await client.responses.create(params);
        const chunks = [];
        for await (const event of stream) chunks.push(event);
        print({ ok: true, chunks });
      } else {
        const response = await client.responses.create(params);
        // output_text is the SDK's convenience (not on the wire).
        print({ ok: true, result: response, output_text: response.output_text });
      }
      return;
    }
    const target = method === 'completions.create' ? client.completions : client.chat.completions;
    if (params.stream) {
      const stream = await target.create(params);
      const chunks = [];
      for await (const chunk of stream) chunks.push(chunk);
      print({ ok: true, chunks });
    } else {
      print({ ok: true, result: await target.create(params) });
    }
  } catch (e) {
    print({
      ok: false,
      error: {
        class: e.constructor.name,
        status: e.status === undefined ? null : e.status,
        message: String(e.message),
        code: e.code === undefined ? null : e.code,
        param: e.param === undefined ? null : e.param,
        type: e.type === undefined ? null : e.type,
        isBadRequest: e instanceof OpenAI.BadRequestError,
        isAuthentication: e instanceof OpenAI.AuthenticationError,
        isNotFound: e instanceof OpenAI.NotFoundError,
      },
    });
  }
}

function print(value) { process.stdout.write(JSON.stringify(value) + '\n'); }

main().catch((e) => { console.error(e); process.exit(1); });
