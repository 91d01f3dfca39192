"""runtime — a run in motion: the MPI round protocol on flat buffers, where clients live (in
process or on worker ranks), the server's and the workers' round loops, live loggers, signals, the heap.

The only layer that imports mpi4py (an import-linter contract forbids it everywhere else):
the agreed set-up steps, the round protocol, the shard group's collectives.

May import: core, metrics, data, models, aggregators, store, clients.
Never imports: report, experiment, sweep, bench, cli.
"""
