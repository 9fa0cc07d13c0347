"""The frozen encoder and what it writes: `weights` (aliases, fingerprints) < `batching` < `onnx_backend` <
`encoders` (FrozenEncoder, its manifest) < `cache` (content-addressed vectors, keyed by the manifest)."""
