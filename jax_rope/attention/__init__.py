"""Masked attention with the NPU's sparse modes (spec/attention.md): the public
functions (`api`), the internal forward/backward API (`ops`), options and
validation (`options`), the sparse-mode records (`sparse_modes`), mask geometry
(`masks`), the positional bias (`bias`) and dropout (`dropout`), the primitives and their lowering (`primitives`), the jnp fallback
(`fallback`) and ASCII mask pictures (`mask_pictures`)."""
