"""ling3-rknn: Ling-3.0-tiny on the RK3588 NPU, served through an OpenAI-compatible API."""

__version__ = "0.1.0"
