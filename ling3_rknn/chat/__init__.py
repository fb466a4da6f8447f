"""Chat layer: OpenAI messages <-> Bailing V3 prompt segments, and model text -> assistant message.

Leaf package: imports nothing else from ``ling3_rknn`` (enforced by import-linter).
"""

from .render import TEMPLATE_SHA256, render, render_text
from .segments import ChatFormatError, Segment

__all__ = [
    "TEMPLATE_SHA256",
    "ChatFormatError",
    "Segment",
    "render",
    "render_text",
]
