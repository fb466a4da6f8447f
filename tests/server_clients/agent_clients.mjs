// Drives the server with the exact client libraries of opencode (Vercel AI SDK +
// @ai-sdk/openai-compatible) and pi (@mariozechner/pi-ai); group "apis" drives the other
// two APIs: the AI SDK's default OpenAI provider (@ai-sdk/openai, Responses API) and pi's
// anthropic-messages provider. The Python test queues the scripted model outputs in the
// same order as the scenarios below and checks the JSON lines printed here.
// Usage: node agent_clients.mjs http://127.0.0.1:PORT/v1 [chat|apis]
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { isContextOverflow, stream as piStream } from "@mariozechner/pi-ai";
import { generateText, jsonSchema, streamText, tool } from "ai";

const baseURL = process.argv[2];
const group = process.argv[3] ?? "chat";
const MODEL = "ling-3.0-tiny";
const readSchema = {
  type: "object",
  properties: { path: { type: "string" }, limit: { type: "integer" } },
  required: ["path"],
};

function emit(name, result) {
  console.log(JSON.stringify({ scenario: name, ...result }));
}

async function run(name, body) {
  try {
    emit(name, await body());
  } catch (error) {
    emit(name, { thrown: String(error && error.message ? error.message : error) });
  }
}

// opencode: includeUsage forced on, tools without execute (the agent runs them itself).
const provider = createOpenAICompatible({ name: "ling3", baseURL, apiKey: "k", includeUsage: true });
const tools = { read: tool({ description: "Read a file", inputSchema: jsonSchema(readSchema) }) };
const user = { role: "user", content: "Show me a.py" };

// pi: developer role, store:false, max_completion_tokens, reasoning_effort, strict:false tools.
const piModel = {
  id: MODEL,
  name: "Ling-3.0-tiny (RK3588)",
  api: "openai-completions",
  provider: "ling3-rknn",
  baseUrl: baseURL,
  reasoning: true,
  input: ["text"],
  cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 },
  contextWindow: 32768,
  maxTokens: 16384,
};
const piContext = {
  systemPrompt: "You are pi.",
  messages: [{ role: "user", content: "Show me a.py and b.py", timestamp: Date.now() }],
  tools: [{ name: "read", description: "Read a file", parameters: readSchema }],
};

async function piRun(options) {
  const s = piStream(piModel, piContext, { apiKey: "k", ...options });
  const kinds = new Set();
  for await (const event of s) kinds.add(event.type);
  const message = await s.result();
  return {
    events: [...kinds].sort(),
    stopReason: message.stopReason,
    errorMessage: message.errorMessage ?? null,
    overflow: isContextOverflow(message, piModel.contextWindow),
    thinking: message.content.filter((b) => b.type === "thinking").map((b) => b.thinking).join(""),
    text: message.content.filter((b) => b.type === "text").map((b) => b.text).join(""),
    calls: message.content
      .filter((b) => b.type === "toolCall")
      .map((b) => ({ id: b.id, name: b.name, arguments: b.arguments })),
    usage: message.usage,
  };
}

if (group === "chat") {
  await run("aisdk_stream_tool_call", async () => {
    const result = streamText({ model: provider(MODEL), messages: [user], tools });
    const errors = [];
    for await (const part of result.fullStream) if (part.type === "error") errors.push(String(part.error));
    const calls = await result.toolCalls;
    const usage = await result.usage;
    return {
      errors,
      finishReason: await result.finishReason,
      reasoning: await result.reasoningText,
      text: await result.text,
      calls: calls.map((c) => ({ id: c.toolCallId, name: c.toolName, input: c.input })),
      inputTokens: usage.inputTokens,
      cachedInputTokens: usage.cachedInputTokens ?? usage.inputTokenDetails?.cacheReadTokens ?? null,
    };
  });

  await run("aisdk_stream_tool_result_turn", async () => {
    const messages = [
      user,
      {
        role: "assistant",
        content: [
          { type: "reasoning", text: "Need the file." },
          { type: "tool-call", toolCallId: "call_1", toolName: "read", input: { path: "a.py", limit: 20 } },
        ],
      },
      {
        role: "tool",
        content: [
          { type: "tool-result", toolCallId: "call_1", toolName: "read", output: { type: "text", value: "print(1)" } },
        ],
      },
    ];
    const result = streamText({ model: provider(MODEL), messages, tools });
    return { finishReason: await result.finishReason, text: await result.text };
  });

  await run("aisdk_generate_reasoning", async () => {
    const result = await generateText({ model: provider(MODEL), messages: [user] });
    return { finishReason: result.finishReason, reasoning: result.reasoningText, text: result.text };
  });

  await run("aisdk_context_overflow", async () => {
    await generateText({ model: provider(MODEL), messages: [user], maxRetries: 0 });
    return { thrown: null };
  });

  await run("pi_stream_parallel_calls", () => piRun({ reasoningEffort: "medium" }));
  await run("pi_context_overflow", () => piRun({}));
}

if (group === "apis") {
  // The AI SDK's default OpenAI provider: `openai(model)` is the Responses API.
  const openai = createOpenAI({ baseURL, apiKey: "k" });
  await run("aisdk_responses_tool_call", async () => {
    const result = streamText({ model: openai(MODEL), messages: [user], tools });
    const errors = [];
    for await (const part of result.fullStream) if (part.type === "error") errors.push(String(part.error));
    const calls = await result.toolCalls;
    return {
      errors,
      finishReason: await result.finishReason,
      reasoning: await result.reasoningText,
      calls: calls.map((c) => ({ name: c.toolName, input: c.input })),
    };
  });
  await run("aisdk_responses_generate", async () => {
    const result = await generateText({ model: openai(MODEL), messages: [user] });
    return { finishReason: result.finishReason, text: result.text, reasoning: result.reasoningText };
  });

  // pi's anthropic-messages provider (the Anthropic SDK underneath; base URL without /v1).
  const piAnthropic = { ...piModel, api: "anthropic-messages", baseUrl: baseURL.replace(/\/v1$/, "") };
  await run("pi_anthropic_tool_call", async () => {
    const s = piStream(piAnthropic, piContext, { apiKey: "k", thinkingEnabled: true, thinkingBudgetTokens: 1024 });
    for await (const _ of s);
    const message = await s.result();
    return {
      stopReason: message.stopReason,
      errorMessage: message.errorMessage ?? null,
      thinking: message.content.filter((b) => b.type === "thinking").map((b) => b.thinking).join(""),
      calls: message.content.filter((b) => b.type === "toolCall").map((b) => ({ name: b.name, arguments: b.arguments })),
      cacheRead: message.usage.cacheRead,
    };
  });
}
