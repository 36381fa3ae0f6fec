"""Scaling out beyond the partitioning every primitive has: context-parallel
attention over a sharded sequence (`context`) and the sequence-parallel split
of packed causal attention (`sequence`)."""
