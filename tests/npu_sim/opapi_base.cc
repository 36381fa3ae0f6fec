// The simulated libopapi.so of a split CANN install (tests only): since the
// operator repositories were split, the transformer operators live in
// libopapi_transformer.so and libopapi.so has none of jax_rope's operators.
extern "C" __attribute__((visibility("default"))) int jax_rope_sim_split_opapi() { return 1; }
