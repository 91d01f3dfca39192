"""experiment — one run: the config schema, TOML and --set loading, validation, assembling the
parts from a config, and the run's lifecycle (new, overwrite, resume) on every rank.

May import: every folder below it (core ... runtime, report).  Never imports: sweep, bench, cli.
"""
