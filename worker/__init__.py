"""``python -m worker`` from a checkout: a thin shim over ``collective.worker``, where the worker's code
lives. Not installed: an installed package runs ``python -m collective.worker``."""
