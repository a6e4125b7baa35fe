"""Bridges to PyTorch (``difftape.interop.torch``) and JAX (``difftape.interop.jax``).

Each imports its library only when it is itself imported, so ``import difftape`` never
imports torch or jax.
"""
