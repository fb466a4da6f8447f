"""Host-side exporter: Hugging Face checkpoint -> quantized RKNN bundle."""
