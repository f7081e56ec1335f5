"""Hugging Face model directories in and out: architecture (arch), weight names (mapping), per-rank
loading (load), export (export) and transformers as the sampler (engine). Runner floor: it builds
megatron-core models; the library never imports it."""
