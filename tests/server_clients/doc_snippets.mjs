// Runs the opencode and pi client settings the docs show, as written, against a server:
// opencode's provider through @ai-sdk/openai-compatible (what its "npm" names), pi's
// models.json entry through @mariozechner/pi-ai. Only the host and port of the base URL
// are the test server's. Usage: node doc_snippets.mjs BASE_URL SNIPPETS_JSON
// (SNIPPETS_JSON: {"opencode": <opencode.json>, "pi": <models.json>}); prints one JSON line
// per model and client.
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { stream as piStream } from "@mariozechner/pi-ai";
import { generateText } from "ai";

const base = new URL(process.argv[2]);
const snippets = JSON.parse(process.argv[3]);
const question = [{ role: "user", content: "Hello! Who are you?" }];

function served(url) {
  const target = new URL(url);
  target.protocol = base.protocol;
  target.host = base.host;
  return target.toString().replace(/\/$/, "");
}

// opencode replaces {env:NAME} in its config; pi reads an apiKey naming a variable from it.
const opencodeValue = (v) => v?.replace(/\{env:([A-Z0-9_]+)\}/g, (_, n) => process.env[n] ?? "");
const piKey = (v) => process.env[v] ?? v;

function emit(result) {
  console.log(JSON.stringify(result));
}

for (const [name, provider] of Object.entries(snippets.opencode.provider)) {
  for (const id of Object.keys(provider.models)) {
    const client = createOpenAICompatible({
      name,
      baseURL: served(provider.options.baseURL),
      apiKey: opencodeValue(provider.options.apiKey) || "none",
      includeUsage: true,
    });
    try {
      const result = await generateText({ model: client(id), messages: question, maxRetries: 0 });
      emit({ client: "opencode", npm: provider.npm, id, finishReason: result.finishReason,
             text: result.text, reasoning: result.reasoningText ?? "" });
    } catch (error) {
      emit({ client: "opencode", npm: provider.npm, id, thrown: String(error?.message ?? error) });
    }
  }
}

for (const [name, provider] of Object.entries(snippets.pi.providers)) {
  for (const entry of provider.models) {
    const model = {
      name: entry.id, input: ["text"], cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 },
      ...entry, api: provider.api, provider: name, baseUrl: served(provider.baseUrl),
    };
    for (const thinking of ["off", "medium"]) {  // pi's --thinking off: no reasoningEffort
      const options = { apiKey: piKey(provider.apiKey), maxRetries: 0 };
      if (thinking !== "off") options.reasoningEffort = thinking;
      const s = piStream(model, { systemPrompt: "You are pi.", messages: [
        { role: "user", content: question[0].content, timestamp: Date.now() }] }, options);
      for await (const _ of s);
      const message = await s.result();
      emit({
        client: "pi", id: entry.id, thinkingLevel: thinking, stopReason: message.stopReason,
        errorMessage: message.errorMessage ?? null,
        thinking: message.content.filter((b) => b.type === "thinking").map((b) => b.thinking).join(""),
        text: message.content.filter((b) => b.type === "text").map((b) => b.text).join(""),
      });
    }
  }
}
