"""core — what every layer shares: errors, the parameter layout, the wire columns, registries.

May import: nothing of mpifl (numpy, torch, pydantic only).
Never imports: any other mpifl folder.
"""
