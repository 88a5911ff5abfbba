"""Imports what a slim conversion imports and nothing else: the RSS floor of bench/slim_bench.py."""

import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401

import kvconvert.cli  # noqa: F401
import kvconvert.io.source  # noqa: F401
import kvconvert.methods.slim  # noqa: F401
import kvconvert.pipeline  # noqa: F401
