"""The one declared tool the parser and history-form tests share (a ``read(path, limit)``
with a required string and an optional integer, so arguments of both JSON kinds occur)."""

READ_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    }
]
