"""bench — benchmarks that measure a baseline in the same run and print the ratio: aggregation
cost of every rule (``mpifl bench aggregation``) and vectorised training (``mpifl bench simulate``).

May import: every folder below it.  Never imports: sweep, cli.
"""
