"""Pallas GPU kernels for the hot paths, one op per file.

Each op file holds the plain-jnp definition (`*_xla`, also the XLA implementation the layer
runs with `implementation="xla"`) and the Pallas kernel with the same signature.
"""
