"""Chat layer: OpenAI messages <-> Bailing V3 prompt segments, and model text -> assistant message.

Leaf package: imports nothing else from ``ling3_rknn`` (enforced by import-linter).
"""

from .history import history_text
from .parse import assistant_message, new_tool_call_id, parse_assistant
from .parsed import (
    ContentDelta,
    ParsedMessage,
    ParseEvent,
    ReasoningDelta,
    ToolCall,
    ToolCallParsed,
)
from .render import TEMPLATE_SHA256, render, render_text
from .segments import ChatFormatError, Segment
from .stream_parse import StreamingParser

__all__ = [
    "TEMPLATE_SHA256",
    "ChatFormatError",
    "ContentDelta",
    "ParseEvent",
    "ParsedMessage",
    "ReasoningDelta",
    "Segment",
    "StreamingParser",
    "ToolCall",
    "ToolCallParsed",
    "assistant_message",
    "history_text",
    "new_tool_call_id",
    "parse_assistant",
    "render",
    "render_text",
]
