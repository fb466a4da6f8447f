"""``ling3-rknn bench``: the product measured end to end, through the engine's public API.

One job per module: ``measure`` drives a real engine, ``report`` turns figures into the
JSON report, ``plot`` draws it (optional ``plot`` extra), ``compare`` sets two reports side
by side, ``command`` is the CLI glue.
"""
