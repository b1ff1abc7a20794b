"""``python -m chief`` from a checkout: a thin shim over ``collective.chief``, where the chief's code
lives. Not installed: an installed package runs ``python -m collective.chief``."""
