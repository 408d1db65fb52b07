// "Copy as": the same request as curl, Python (openai) or an Ollama /api/chat call.

function pyLiteral(v, indent = 0) {
  const pad = " ".repeat(indent + 4), end = " ".repeat(indent);
  if (v === null || v === undefined) return "None";
  if (v === true) return "True";
  if (v === false) return "False";
  if (typeof v === "number") return String(v);
  if (typeof v === "string") return JSON.stringify(v);
  if (Array.isArray(v)) {
    if (!v.length) return "[]";
    return "[\n" + v.map((x) => pad + pyLiteral(x, indent + 4)).join(",\n") + ",\n" + end + "]";
  }
  const ks = Object.keys(v);
  if (!ks.length) return "{}";
  return "{\n" + ks.map((k) => `${pad}${JSON.stringify(k)}: ${pyLiteral(v[k], indent + 4)}`).join(",\n") + ",\n" + end + "}";
}

export function asCurl(origin, body, hasKey) {
  const auth = hasKey ? ` \\\n  -H "Authorization: Bearer $MLXD_API_KEY"` : "";
  const json = JSON.stringify(body, null, 2).replace(/'/g, "'\\''");
  return `curl ${origin}/v1/chat/completions${auth} \\\n  -H "Content-Type: application/json" \\\n  -d '${json}'`;
}

export function asPython(origin, body, hasKey) {
  const { model, messages, stream, ...rest } = body;
  delete rest.stream_options;
  const key = hasKey ? `os.environ["MLXD_API_KEY"]` : `"none"`;
  const extra = Object.entries(rest).map(([k, v]) => `    ${k}=${pyLiteral(v, 4)},\n`).join("");
  return `import os\n\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="${origin}/v1", api_key=${key})\n` +
    `stream = client.chat.completions.create(\n    model=${JSON.stringify(model)},\n` +
    `    messages=${pyLiteral(messages, 4)},\n${extra}    stream=True,\n)\n` +
    `for chunk in stream:\n    if chunk.choices and chunk.choices[0].delta.content:\n` +
    `        print(chunk.choices[0].delta.content, end="", flush=True)\nprint()\n`;
}

// Ollama's /api/chat: images as bare base64 beside the text, options by Ollama's names.
export function asOllama(origin, body, hasKey) {
  const messages = body.messages.map((m) => {
    if (typeof m.content === "string") return { role: m.role, content: m.content };
    const text = m.content.filter((p) => p.type === "text").map((p) => p.text).join("\n");
    const images = m.content.filter((p) => p.type === "image_url")
      .map((p) => p.image_url.url.replace(/^data:[^,]*,/, ""));
    return images.length ? { role: m.role, content: text, images } : { role: m.role, content: text };
  });
  const options = {};
  for (const [a, b] of [["temperature", "temperature"], ["top_p", "top_p"], ["seed", "seed"],
    ["max_tokens", "num_predict"], ["stop", "stop"]]) if (body[a] !== undefined) options[b] = body[a];
  const req = { model: body.model, messages, stream: true };
  if (Object.keys(options).length) req.options = options;
  if (body.response_format && body.response_format.json_schema) req.format = body.response_format.json_schema.schema;
  if (body.tools) req.tools = body.tools;  // Ollama has no tool_choice
  const auth = hasKey ? ` \\\n  -H "Authorization: Bearer $MLXD_API_KEY"` : "";
  const json = JSON.stringify(req, null, 2).replace(/'/g, "'\\''");
  return `curl ${origin}/api/chat${auth} \\\n  -d '${json}'`;
}
