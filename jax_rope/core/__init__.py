"""The floor every operator stands on: codes and layouts shared with C++,
the compiled extension, the implementation choice, argument checks, batching
helpers, and one registration per primitive (`primitive.define_primitive`)
with its per-platform lowering and partitioning."""
