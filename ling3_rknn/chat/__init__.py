"""Chat layer: OpenAI messages <-> Bailing V3 prompt segments, model text -> assistant
message, and the token stream's one event vocabulary (``events``) and marker spellings
(``markers``).

Leaf package: imports nothing else from ``ling3_rknn`` (enforced by import-linter).
"""

from .events import (
    Admitted,
    ContentDelta,
    Finished,
    FinishReason,
    GenerationEvent,
    ParsedMessage,
    ParseEvent,
    RawArguments,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallParsed,
    Usage,
)
from .history import history_form
from .parse import (
    assistant_message,
    history_text,
    new_tool_call_id,
    openai_tool_call,
    parse_assistant,
)
from .render import TEMPLATE_SHA256, render, render_text
from .schema_to_grammar import GrammarError
from .segments import ChatFormatError, Segment
from .stream_parse import StreamingParser
from .turn_grammar import GrammarText, TurnGrammar, turn_grammar

__all__ = [
    "TEMPLATE_SHA256",
    "Admitted",
    "ChatFormatError",
    "ContentDelta",
    "FinishReason",
    "Finished",
    "GenerationEvent",
    "GrammarError",
    "GrammarText",
    "ParseEvent",
    "ParsedMessage",
    "RawArguments",
    "ReasoningDelta",
    "Segment",
    "StreamingParser",
    "TextDelta",
    "ToolCall",
    "ToolCallParsed",
    "TurnGrammar",
    "Usage",
    "assistant_message",
    "history_form",
    "history_text",
    "new_tool_call_id",
    "openai_tool_call",
    "parse_assistant",
    "render",
    "render_text",
    "turn_grammar",
]
