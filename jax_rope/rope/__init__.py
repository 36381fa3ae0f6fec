"""Fused query/key rotary position embedding (spec/rope.md): the public
functions (`api`), options and validation (`options`), the primitives and
their lowering (`primitives`), the jnp fallback (`fallback`), and cos/sin
tables for real models (`tables`)."""
