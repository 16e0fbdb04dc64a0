"""What every runner, the t5x adapter, evaluation and the benchmarks share:
gin and command-line flags (`gin_utils`), gin files' literals read
without gin (`gin_literals`), the hosts (`multihost`,
`host_memory`), the mesh and parameter shardings (`partitioning`), and the
data (`input_pipeline`, `batches`)."""
