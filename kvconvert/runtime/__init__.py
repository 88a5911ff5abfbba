"""The runtime shipped in every output directory (copied verbatim; imports only torch + transformers)."""
