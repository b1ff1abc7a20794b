"""Tools of the checkout that are not part of the installed package: docgen, the mkdocs hooks,
snapshot_bench (the benchmark itself is collective.bench)."""
